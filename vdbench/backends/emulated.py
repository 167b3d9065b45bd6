"""The quantized kernels' numerics in pure torch (vdbench.numerics), on any device: accuracy on a CPU, and the
real kernels compared with them on a GPU. Slow by construction, never used to report speed."""

from __future__ import annotations

from vdbench.numerics import (LOG2E, SAGE_BLKK, SAGE_BLKQ, fp8_emulated, quantize_fp8, quantize_int8_per_block,
                              sagev1_emulated)

from .registry import ANY_FLOAT, Backend, register, traffic

ORDER = 40


def _sage_prepass(q, k, v, scale=None):
    """The emulation's INT8 quantization of Q (pre-scaled by scale·log2 e) and K, to time it apart."""
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    return quantize_int8_per_block(q, SAGE_BLKQ, pre_scale=sm * LOG2E), quantize_int8_per_block(k, SAGE_BLKK)


def _fp8_prepass(q, k, v, scale=None):
    """The emulation's e4m3 quantization of Q, K, V per (batch, head) (the softmax scale does not enter it)."""
    return [quantize_fp8(t, "bh") for t in (q, k, v)]


register(Backend(
    "sagev1_emu", "SageAttention v1 numerics emulated in torch (INT8 per-block Q/K, K smoothing, fp16 P·V)",
    fn=sagev1_emulated, kernel="emu.sagev1", emulated=True, dtypes=ANY_FLOAT,
    no_lse_reason="the SageAttention emulation does not compute a log-sum-exp",
    bytes_model=traffic((1, 1, 2), (1, 1, 0)), prepass=_sage_prepass))
register(Backend(
    "fp8_emu", "FA3 fp8 numerics emulated in torch (e4m3 Q/K/V per-(batch,head) scales, e4m3 P)",
    fn=fp8_emulated, kernel="emu.fp8", emulated=True, dtypes=ANY_FLOAT,
    no_lse_reason="the fp8 emulation does not compute a log-sum-exp",
    bytes_model=traffic((1, 1, 1), (1, 1, 1)), prepass=_fp8_prepass))
