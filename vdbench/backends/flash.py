"""FlashAttention-2 (``flash_attn``) and FlashAttention-3 (``flash_attn_interface`` / ``fa3_fwd_interface``,
Hopper): bf16, and e4m3 with one scale per (batch, head); FA3's log-sum-exp forms for ring attention."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from vdbench.numerics import quantize_fp8

from .registry import HALF, Backend, BackendUnavailable, LSEForm, cuda, register, requires_package, traffic

ORDER = 20

_FA3_MODULES = ("flash_attn_interface", "fa3_fwd_interface")
_FA3_HEAD_DIMS = (64, 96, 128, 192, 256)


def _fav2(q, k, v, *, scale=None, is_causal=False):
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=is_causal)
    return out.transpose(1, 2)


def _fa3_module():
    for mod in _FA3_MODULES:
        if importlib.util.find_spec(mod) is not None:
            return importlib.import_module(mod)
    raise BackendUnavailable("no FlashAttention-3 module (flash_attn_interface or fa3_fwd_interface)")


def _fa3_out(res):
    # flash_attn_interface versions differ: some return (out, lse), newer ones out alone.
    return res[0] if isinstance(res, tuple) else res


def _fp8_inputs(q, k, v, scale=None):
    """fav3_fp8's quantization: e4m3 Q, K, V with one scale per (batch, head), the finest FA3's descale arguments
    take (``scale`` does not enter it: FA3 applies the softmax scale itself). Also its pre-pass for the bench."""
    return [quantize_fp8(t, "bh") for t in (q, k, v)]


def _fa3_call(q, k, v, scale, is_causal, *, fp8: bool, lse: bool):
    """FA3 on BHSD inputs: bf16, or e4m3 (``_fp8_inputs``); with ``lse`` also its log-sum-exp (B, H, S) fp32, for
    ring attention. One call site for all four forms (plain / fp8, with / without LSE), so they can't drift apart."""
    fa3 = _fa3_module()
    kw = dict(causal=is_causal)
    if fp8:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        (q8, _, qd), (k8, _, kd), (v8, _, vd) = _fp8_inputs(q, k, v)
        q_, k_, v_ = q8, k8, v8
        kw.update(q_descale=qd, k_descale=kd, v_descale=vd)
    else:
        q_, k_, v_ = q, k, v
    if lse:
        kw["return_attn_probs"] = True
    res = fa3.flash_attn_func(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), softmax_scale=scale,
                              **kw)
    out = (res[0] if lse else _fa3_out(res)).transpose(1, 2)
    if fp8:
        out = out.to(q.dtype)
    return (out, res[1].float()) if lse else out


def _fav3(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=False, lse=False)


def _fav3_fp8(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=True, lse=False)


def _lse_fav3(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=False, lse=True)


def _lse_fav3_fp8(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=True, lse=True)


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
    kernel="fa3.flash_attn_func[e4m3]", layout="BSHD", constraints=_FA3, dtypes=HALF, head_dims=_FA3_HEAD_DIMS,
    twin="fp8_emu", lse=LSEForm(_lse_fav3_fp8, ("cuda",), "fa3.flash_attn_func[e4m3][lse]"),
    # e4m3 Q/K/V; the torch pre-pass reads each once and writes it in e4m3
    bytes_model=traffic((1, 1, 1), (1, 1, 1)), prepass=_fp8_inputs))
