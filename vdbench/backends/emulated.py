"""The quantized kernels' numerics in pure torch (vdbench.numerics), on any device: accuracy on a CPU, and the
real kernels compared with them on a GPU. Slow by construction, never used to report speed.

``sagev2_emu`` takes the options that name one SageAttention 2 kernel (``pv``, ``gran``, ``arch``): the twin of
``sagev2_fp16:gran=per_warp`` is ``sagev2_emu:pv=fp16+gran=per_warp``. Like the ``sagev2*`` backends it writes
exact zeros into the output channels of an all-zero V channel (the kernel's NaN there; see backends/sage2.py), and
it has the package's log-sum-exp form, so ring attention runs it on a CPU. ``fp8_emu:smooth_k=1`` is the twin of
``fav3_fp8:smooth_k=1``, ``fp8_emu:rotate=hadamard`` of ``fav3_fp8:rotate=hadamard``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from vdbench.numerics import (LOG2E, SAGE_BLKK, SAGE_BLKQ, fp8_bh_inputs, fp8_emulated, fp8_prepass_reads,
                              quantize_int8_per_block, sagev1_emulated, sagev2_emulated, zero_channels_,
                              zero_v_channels)

from .registry import ANY_FLOAT, Backend, BenchProfile, LSEForm, Option, register, traffic

ORDER = 40


def _sage_prepass(q, k, v, scale=None):
    """The emulation's INT8 quantization of Q (pre-scaled by scale·log2 e) and K, to time it apart."""
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    return quantize_int8_per_block(q, SAGE_BLKQ, pre_scale=sm * LOG2E), quantize_int8_per_block(k, SAGE_BLKK)


def _fp8_prepass(q, k, v, scale=None, *, smooth_k=False, rotate=False, smooth_v=False):
    """The emulation's e4m3 quantization of Q, K, V per (batch, head) (the softmax scale does not enter it)."""
    return fp8_bh_inputs(q, k, v, smooth_k=smooth_k, rotate=rotate, smooth_v=smooth_v)


def _sagev2(q, k, v, *, scale=None, is_causal=False, return_lse=False, pv="fp8", gran="per_thread", arch="sm90"):
    res = sagev2_emulated(q, k, v, scale=scale, is_causal=is_causal, qk_gran=gran, pv=pv,
                          arch=arch if pv == "fp8" else None, return_lse=return_lse)
    out = res[0] if return_lse else res
    if pv == "fp8":  # what the backends do with an all-zero V channel (the kernel's NaN): exact zeros
        zero_channels_(out, zero_v_channels(v))
    return res


def _sagev2_label(opts: dict) -> str:
    what = opts["pv"] + ("," + opts["arch"] if opts["pv"] == "fp8" else "")
    return f"emu.sagev2[{what},{opts['gran']}]"


def _bind_sagev2(base: Backend, opts: dict) -> Backend:
    if opts["gran"] == "per_block" and opts["pv"] != "fp16":
        raise ValueError("gran=per_block is the Triton kernel's (sageattn_qk_int8_pv_fp16_triton): it needs pv=fp16")
    if opts["arch"] != "sm90" and opts["pv"] != "fp8":
        raise ValueError("arch picks one of the fp8 P·V kernels (sm90, sm89): it needs pv=fp8")
    kw = dict(pv=opts["pv"], gran=opts["gran"], arch=opts["arch"])
    label = _sagev2_label(opts)
    return dataclasses.replace(
        base, fn=partial(_sagev2, **kw), kernel=label, lse=LSEForm(partial(_sagev2, return_lse=True, **kw),
                                                                   ("cpu", "cuda"), label + "[lse]"),
        bench=BenchProfile(traffic((1, 1, 1 if opts["pv"] == "fp8" else 2), (1, 2, 3 if opts["pv"] == "fp8" else 1))))


def _bind_fp8(base: Backend, opts: dict) -> Backend:
    smooth, rotate, smooth_v = opts["smooth_k"] == "1", opts["rotate"] == "hadamard", opts["smooth_v"] == "1"
    tag = ",".join(t for t, on in (("smooth_k", smooth), ("smooth_v", smooth_v), ("rotate=hadamard", rotate)) if on)
    kw = dict(smooth_k=smooth, rotate=rotate, smooth_v=smooth_v)
    return dataclasses.replace(base, fn=partial(fp8_emulated, **kw), kernel=f"emu.fp8[{tag}]",
                               bench=BenchProfile(traffic((1, 1, 1), fp8_prepass_reads(**kw)),
                                                  prepass=partial(_fp8_prepass, **kw)))


_SAGEV2_DEFAULTS = dict(pv="fp8", gran="per_thread", arch="sm90")

register(Backend(
    "sagev1_emu", "SageAttention v1 numerics emulated in torch (INT8 per-block Q/K, K smoothing, fp16 P·V)",
    fn=sagev1_emulated, kernel="emu.sagev1", emulated=True, dtypes=ANY_FLOAT,
    no_lse_reason="the SageAttention emulation does not compute a log-sum-exp",
    bench=BenchProfile(traffic((1, 1, 2), (1, 1, 0)), prepass=_sage_prepass)))
register(Backend(
    "sagev2_emu", "SageAttention 2 numerics emulated in torch (INT8 Q/K per thread or warp, K smoothing, fp8 P·V "
    "with a per-channel V scale or fp16 P·V, each kernel's accumulation)",
    fn=partial(_sagev2, **_SAGEV2_DEFAULTS), kernel=_sagev2_label(_SAGEV2_DEFAULTS), emulated=True, dtypes=ANY_FLOAT,
    max_head_dim=128,
    lse=LSEForm(partial(_sagev2, return_lse=True, **_SAGEV2_DEFAULTS), ("cpu", "cuda"),
                _sagev2_label(_SAGEV2_DEFAULTS) + "[lse]"),
    bench=BenchProfile(traffic((1, 1, 1), (1, 2, 3))), notes="emulated, slow; quantization inside the call",
    options=(Option("pv", "fp8", ("fp8", "fp16"), help="P·V precision: fp8 (sm89/sm90 kernels) or fp16"),
             Option("gran", "per_thread", ("per_thread", "per_warp", "per_block"),
                    help="Q/K scale groups; per_block = the Triton fp16 kernel"),
             Option("arch", "sm90", ("sm90", "sm89"), help="which fp8 kernel's blocks and accumulation")),
    bind=_bind_sagev2))
register(Backend(
    "fp8_emu", "FA3 fp8 numerics emulated in torch (e4m3 Q/K/V per-(batch,head) scales, e4m3 P)",
    fn=fp8_emulated, kernel="emu.fp8", emulated=True, dtypes=ANY_FLOAT,
    no_lse_reason="the fp8 emulation does not compute a log-sum-exp",
    bench=BenchProfile(traffic((1, 1, 1), fp8_prepass_reads()), prepass=_fp8_prepass),
    options=(Option("smooth_k", "0", ("0", "1"), help="1: subtract K's mean over the sequence before quantizing"),
             Option("smooth_v", "0", ("0", "1"),
                    help="1: subtract V's mean before quantizing, add it to the output (fav3_fp8's option)"),
             Option("rotate", "none", ("none", "hadamard"),
                    help="hadamard: rotate Q and K along the head dimension before quantizing (fav3_fp8's option)")),
    bind=_bind_fp8))
