"""FlashAttention-2 (``flash_attn``) and FlashAttention-3 (``flash_attn_interface`` / ``fa3_fwd_interface``,
Hopper): bf16, and e4m3 with one scale per (batch, head); FA3's log-sum-exp forms for ring attention.

``fav3_fp8`` quantizes with a fused pre-pass (``vdbench.kernels.fa3_prepass``: Q, K, V read twice each, written
once in e4m3) where Triton runs, else eagerly (``vdbench.numerics.fp8_bh_inputs``) -- the same values and scales
bit for bit, the eager one ~7x the memory traffic; which one ran is in the call's kernel label. Option
``smooth_k=1`` subtracts K's mean over the sequence first (exact in exact arithmetic; removes the share of the error
a per-channel K bias causes, not the e4m3 Q·Kᵀ error of peaked attention); its log-sum-exp form adds q·mean·scale
back, so ring attention merges the true LSE. Option ``rotate=hadamard`` multiplies Q and K by a ±1 Hadamard matrix
S (S·Sᵀ = n·I) first -- FlashAttention-3's incoherent processing: Q·Kᵀ is unchanged up to the factor n, which the
softmax scale takes back, and a channel with outliers is spread over n channels before e4m3 rounds it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from functools import partial

import torch

from vdbench import kernels
from vdbench.numerics import fp8_bh_inputs, fp8_prepass_reads, rotated_fp8_inputs

from .registry import (HALF, Backend, BackendUnavailable, BenchProfile, LSEForm, Option, cuda, register,
                       requires_package, traffic)

ORDER = 20

_FA3_MODULES = ("flash_attn_interface", "fa3_fwd_interface")
_FA3_HEAD_DIMS = (64, 96, 128, 192, 256)


def _fav2(q, k, v, *, scale=None, is_causal=False):
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=is_causal)
    return out.transpose(1, 2)


def _fa3_module():
    for mod in _FA3_MODULES:  # imported already (every call after the first): no search of the path
        if mod in sys.modules:
            return sys.modules[mod]
    for mod in _FA3_MODULES:
        if importlib.util.find_spec(mod) is not None:
            return importlib.import_module(mod)
    raise BackendUnavailable("no FlashAttention-3 module (flash_attn_interface or fa3_fwd_interface)")


def _fa3_out(res):
    # flash_attn_interface versions differ: some return (out, lse), newer ones out alone.
    return res[0] if isinstance(res, tuple) else res


_PREPASS: dict[torch.device, bool] = {}  # device -> whether the Triton pre-pass runs there (decided once)


def _triton_prepass(device: torch.device) -> bool:
    if device not in _PREPASS:
        _PREPASS[device] = device.type == "cuda" and kernels.probe("fa3_prepass", device)[0]
    return _PREPASS[device]


def _fp8_inputs(q, k, v, scale=None, *, smooth_k: bool = False, rotate: bool = False, smooth_v: bool = False):
    """fav3_fp8's quantization: e4m3 Q, K, V with one scale per (batch, head), the finest FA3's descale arguments
    take (``scale`` does not enter it: FA3 applies the softmax scale itself); fused in Triton where it runs, eager
    elsewhere (bit-equal). ``rotate``: Q and K rotated by a ±1 Hadamard matrix first (a bf16 matmul each, not fused
    into the pre-pass; ``qk_gain`` tells the call to divide its softmax scale). Also its pre-pass for the bench."""
    if rotate:
        return rotated_fp8_inputs(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v, quantize=_fp8_inputs)
    if _triton_prepass(q.device):
        return kernels.fa3_fp8_prepass(q, k, v, smooth_k, smooth_v)
    return fp8_bh_inputs(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)


def _fa3_call(q, k, v, scale, is_causal, *, fp8: bool, lse: bool, smooth_k: bool = False, rotate: bool = False,
              smooth_v: bool = False):
    """FA3 on BHSD inputs: bf16, or e4m3 (``_fp8_inputs``); with ``lse`` also its log-sum-exp (B, H, S) fp32, for
    ring attention. One call site for all the forms (plain / fp8, with / without LSE, smoothed K), so they can't
    drift apart."""
    fa3 = _fa3_module()
    kw = dict(causal=is_causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    x = None
    kernel_scale = scale
    if fp8:
        x = _fp8_inputs(q, k, v, smooth_k=smooth_k, rotate=rotate, smooth_v=smooth_v)
        q_, k_, v_ = x.q8, x.k8, x.v8
        kw.update(q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale)
        kernel_scale = scale / x.qk_gain  # a rotated Q8·K8ᵀ over-counts Q·Kᵀ by the rotation's n
    else:
        q_, k_, v_ = q, k, v
    if lse:
        kw["return_attn_probs"] = True
    res = fa3.flash_attn_func(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                              softmax_scale=kernel_scale, **kw)
    out = (res[0] if lse else _fa3_out(res)).transpose(1, 2)
    if x is not None and x.v_mean is not None:
        # the kernel saw V - mean and each softmax row sums to 1: the mean goes back in one pass over O, added in
        # fp32 and rounded once (an in-place add to the kernel's own output; the fp32 copy cost 3x the traffic)
        out.add_(x.v_mean)
    if fp8:
        out = out.to(q.dtype)
    if not lse:
        return out
    lse_ = res[1].float()
    if x is not None and x.k_mean is not None:  # the kernel saw K - mean: its LSE is short by q·mean·scale
        lse_ = lse_ + torch.matmul(q.float(), x.k_mean.transpose(-1, -2)).squeeze(-1) * scale
    return out, lse_


def _fav3(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=False, lse=False)


def _fav3_fp8(q, k, v, *, scale=None, is_causal=False, smooth_k=False, rotate=False, smooth_v=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=True, lse=False, smooth_k=smooth_k, rotate=rotate,
                     smooth_v=smooth_v)


def _lse_fav3(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=False, lse=True)


def _lse_fav3_fp8(q, k, v, *, scale=None, is_causal=False, smooth_k=False, rotate=False, smooth_v=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=True, lse=True, smooth_k=smooth_k, rotate=rotate,
                     smooth_v=smooth_v)


def _prewarm_fp8(calls, device, dtype, *, smooth_k: bool = False, rotate: bool = False, smooth_v: bool = False):
    """fav3_fp8's ``prewarm``: the Triton pre-pass's specializations for ``calls`` (``CallShape`` s) compiled for
    ``device`` and their first-launch host work done (module load, launcher), from the very calls ``_fp8_inputs``
    makes, run on meta tensors of those shapes in the callers' layout under ``kernels.ahead.compile_only``: the
    JIT's own key, so the first real call finds them (on an empty Triton cache its first call compiled four
    kernels at Wan 1.3B 480p, seconds of the first step). FA3's module and the pre-pass's are imported too (a first
    call's imports); with no calls, only they."""
    from vdbench.kernels import ahead

    device = torch.device(device)
    if not _triton_prepass(device):
        return {"compiled": 0, "note": "the eager pre-pass runs here: nothing to compile"}
    _fa3_module()
    importlib.import_module("vdbench.kernels.fa3_prepass")  # triton with it: with no calls, the imports alone

    def quantize(q, k, v, *, smooth_k=False, smooth_v=False):
        return kernels.fa3_fp8_prepass(q, k, v, smooth_k, smooth_v)

    with torch.inference_mode(), ahead.compile_only(device) as compiled:
        for call in dict.fromkeys(calls):
            q, k, v = call.meta_inputs(dtype)
            if rotate:
                rotated_fp8_inputs(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v, quantize=quantize)
            else:
                quantize(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    return {"compiled": len({id(k) for k in compiled}), "loaded": ahead.load_compiled(compiled, device)}


_FP8_KERNEL = "fa3.flash_attn_func[e4m3]"


def _fp8_label(tag: str):
    """The kernel label of a fav3_fp8 call: FA3's e4m3 kernel, ``eager-prepass`` added where the fused Triton
    pre-pass does not run (a much slower quantization must not pass for the fast one)."""

    def label(q, *_):
        return f"{_FP8_KERNEL[:-1]}{tag}{'' if _triton_prepass(q.device) else ',eager-prepass'}]"

    return label


def _bind_fav3_fp8(base: Backend, opts: dict) -> Backend:
    """fav3_fp8 with K and/or V smoothing (the tensor read once more, for its mean; V's mean added to the output)
    and/or Q and K rotated by a ±1 Hadamard matrix (each read and written once more, in bf16, before the
    pre-pass)."""
    smooth, rotate, smooth_v = opts["smooth_k"] == "1", opts["rotate"] == "hadamard", opts["smooth_v"] == "1"
    on = [(o, w) for o, w, flag in (
        ("smooth_k=1", "K smoothed (its mean over the sequence subtracted)", smooth),
        ("smooth_v=1", "V smoothed (its mean subtracted, added to the output)", smooth_v),
        ("rotate=hadamard", "Q and K rotated by a Hadamard matrix along the head dimension", rotate)) if flag]
    tag = "".join("," + o.replace("=1", "") for o, _ in on)
    twin_opts = "+".join(o for o, _ in on)
    kw = dict(smooth_k=smooth, rotate=rotate, smooth_v=smooth_v)
    # V's mean added to the output afterwards (O read and written once more) is left out of the bytes model
    return dataclasses.replace(
        base, description=base.description + "".join(", " + w for _, w in on),
        fn=partial(_fav3_fp8, **kw), kernel=f"{_FP8_KERNEL[:-1]}{tag}]",
        twin=f"fp8_emu:{twin_opts}" if twin_opts else base.twin,
        lse=LSEForm(partial(_lse_fav3_fp8, **kw), ("cuda",), f"{_FP8_KERNEL[:-1]}{tag}][lse]"),
        bench=BenchProfile(traffic((1, 1, 1), fp8_prepass_reads(**kw)), prepass=partial(_fp8_inputs, **kw)),
        label=_fp8_label(tag), prewarm=partial(_prewarm_fp8, **kw))


_FA3 = (requires_package(*_FA3_MODULES, hint="pip install -e '.[fa3]'"), cuda(major=9))

register(Backend(
    "fav2", "FlashAttention-2 (flash_attn package)", fn=_fav2, kernel="flash_attn.flash_attn_func", layout="BSHD",
    constraints=(requires_package("flash_attn", hint="pip install -e '.[flash]'"), cuda(min_arch=(8, 0))),
    dtypes=HALF, max_head_dim=256, aliases=("flash", "flash_hub"),
    no_lse_reason="the fav2 wrapper does not return flash_attn's log-sum-exp"))
register(Backend(
    "fav3", "FlashAttention-3 (flash_attn_interface or fa3_fwd_interface), Hopper", fn=_fav3,
    kernel="fa3.flash_attn_func", layout="BSHD", constraints=_FA3, dtypes=(torch.bfloat16,),
    head_dims=_FA3_HEAD_DIMS, aliases=("_flash_3", "_flash_3_hub", "fa3"),
    lse=LSEForm(_lse_fav3, ("cuda",), "fa3.flash_attn_func[lse]"), notes="fp16 is not built into fa3-fwd: bf16 only"))
register(Backend(
    "fav3_fp8", "FlashAttention-3 on fp8 e4m3 Q/K/V, one scale per (batch, head)", fn=_fav3_fp8,
    kernel=_FP8_KERNEL, layout="BSHD", constraints=_FA3, dtypes=HALF, head_dims=_FA3_HEAD_DIMS,
    twin="fp8_emu", lse=LSEForm(_lse_fav3_fp8, ("cuda",), _FP8_KERNEL + "[lse]"),
    # e4m3 Q/K/V; the fused pre-pass reads each twice (amax, then quantization) and writes it in e4m3
    bench=BenchProfile(traffic((1, 1, 1), fp8_prepass_reads()), prepass=_fp8_inputs), label=_fp8_label(""),
    prewarm=_prewarm_fp8,  # the Triton pre-pass's kernels compiled before the first call (a render's first step)
    options=(Option("smooth_k", "0", ("0", "1"), help="1: subtract K's mean over the sequence before quantizing"),
             Option("smooth_v", "0", ("0", "1"),
                    help="1: subtract V's mean over the sequence before quantizing and add it to the output (keeps "
                         "Hopper's fp8 P·V accumulator centred on 0: FA3 fp8's error on pipeline inputs)"),
             Option("rotate", "none", ("none", "hadamard"),
                    help="hadamard: rotate Q and K along the head dimension before quantizing (Q·Kᵀ unchanged; "
                         "outlier channels spread out)")),
    # plain, it keeps FA3 fp8's own numerics (3.1e-1 on a captured Wan input on an H200); smooth_v=1 is the form to
    # use (3.9e-3 there, at 917 TFLOP/s at Wan 14B: docs/PERFORMANCE.md §2.2)
    variants=("smooth_v=1",),
    bind=_bind_fav3_fp8, notes="quantization pre-pass (Triton, fused) inside the call; use smooth_v=1 (accurate)"))
