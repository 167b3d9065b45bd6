"""FlashInfer's single-request prefill attention (``flashinfer-python``), with its log-sum-exp form.

What the package offers (read from flashinfer-python 0.7.2.post1): ``flashinfer.single_prefill_with_kv_cache(q, k,
v, causal=False, kv_layout="NHD", sm_scale=None, backend="auto", return_lse=False)`` -- ONE request: q is
(qo_len, heads, head_dim), k / v (kv_len, heads_kv, head_dim) in ``NHD`` or (heads_kv, kv_len, head_dim) in ``HND``;
fp16 / bf16 (fp8 with scales, not used here). ``backend="auto"`` takes its FA3-style Hopper kernel on sm90a for
head dims 64 / 128 / 256 and its FA2-style kernel elsewhere; the kernels are JIT-compiled with nvcc on first use of
a configuration unless prebuilt ones are installed (``flashinfer-cubin`` / ``flashinfer-jit-cache``). Head dims
64, 128, 256 are the ones both kernels are built for (its ahead-of-time list). ``return_lse`` gives (qo_len, heads)
fp32 in base 2 (FlashInfer's convention), which the LSE form turns into the registry's natural log. Causal masking
is bottom-right aligned (query i sees keys up to kv_len - qo_len + i), the registry's convention.

Layout: a batch is one call per request (the API has no batch dimension; the video pipelines' batch is 1 or 2, the
classifier-free-guidance pair). q, k and v go as contiguous NHD (tokens, heads, head_dim): a view, no copy, where the
caller's tensors are BHSD views of BSHD memory (what diffusers' processors pass), a copy otherwise. Why not the
strided NHD q with HND k / v that BHSD offers without copies: on an H200 the package's FA3-style kernel (its
``auto`` choice on sm90) ended the process with a floating point exception when handed those, where contiguous NHD
ran (its FA2-style kernel took both).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch

from .registry import HALF, Backend, LSEForm, Option, cuda, register, requires_package

ORDER = 24

KERNEL = "flashinfer.single_prefill_with_kv_cache"
_HINT = ("pip install flashinfer-python flashinfer-cubin; kernels without a prebuilt one are JIT-compiled with nvcc "
         "on first use")
_HEAD_DIMS = (64, 128, 256)
_LN2 = math.log(2.0)


def _nhd(x: torch.Tensor) -> torch.Tensor:
    """One request's (heads, tokens, head_dim) as contiguous (tokens, heads, head_dim): a view of BSHD memory."""
    return x.transpose(0, 1).contiguous()


def _prefill(q, k, v, scale, is_causal, *, lse: bool, kernel: str = "auto"):
    import flashinfer

    outs, lses = [], []
    for b in range(q.shape[0]):
        res = flashinfer.single_prefill_with_kv_cache(_nhd(q[b]), _nhd(k[b]), _nhd(v[b]), causal=is_causal,
                                                      sm_scale=scale, kv_layout="NHD", return_lse=lse,
                                                      backend=kernel)
        if lse:
            outs.append(res[0])
            lses.append(res[1])
        else:
            outs.append(res)
    out = torch.stack(outs).transpose(1, 2)  # (B, S, H, D) -> BHSD
    if not lse:
        return out
    return out, torch.stack(lses).transpose(1, 2).float() * _LN2  # (B, S, H) base 2 -> (B, H, S) natural log


def _flashinfer(q, k, v, *, scale=None, is_causal=False, kernel="auto"):
    return _prefill(q, k, v, scale, is_causal, lse=False, kernel=kernel)


def _lse_flashinfer(q, k, v, *, scale=None, is_causal=False, kernel="auto"):
    return _prefill(q, k, v, scale, is_causal, lse=True, kernel=kernel)


def _bind(base: Backend, opts: dict) -> Backend:
    """``flashinfer:backend=fa2|fa3``: the package's kernel picked instead of its own choice (``auto``: FA3-style on
    sm90a, FA2-style elsewhere), counted under its own label."""
    which = opts["backend"]
    return dataclasses.replace(base, fn=partial(_flashinfer, kernel=which), kernel=f"{KERNEL}[{which}]",
                               lse=LSEForm(partial(_lse_flashinfer, kernel=which), ("cuda",),
                                           f"{KERNEL}[{which}][lse]"))


register(Backend(
    "flashinfer", "FlashInfer single-request prefill attention (flashinfer-python; FA3-style kernel on Hopper, "
                  "FA2-style elsewhere)", fn=_flashinfer, kernel=KERNEL, layout="BSHD",
    constraints=(requires_package("flashinfer", hint=_HINT), cuda(min_arch=(8, 0))),
    dtypes=HALF, head_dims=_HEAD_DIMS, lse=LSEForm(_lse_flashinfer, ("cuda",), KERNEL + "[lse]"),
    options=(Option("backend", "auto", ("auto", "fa2", "fa3"),
                    help="the package's kernel: auto (its choice: FA3-style on Hopper), fa2 or fa3"),),
    bind=_bind,
    notes="one package call per batch element; JIT-compiled on first use (nvcc, 61-74 s per head dim on an H200) "
          "unless prebuilt; 0.89-0.95x fav3 on Hopper"))
