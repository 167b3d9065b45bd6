"""Triton helpers the kernel modules share, left undecorated: each module decorates them at its own import
(``_round = triton.jit(bits.round_rne)``), so they are compiled or interpreted as that module's kernels are -- Triton
decides at decoration, and an interpreted kernel cannot call a compiled function (nor the other way round).
"""

from __future__ import annotations

import triton.language as tl

__all__ = ["round_rne"]


def round_rne(v, OUT_BF16: tl.constexpr, dtype):
    """fp32 -> the output dtype, to nearest, ties to even. For bf16 by the bits (what PyTorch's conversion does), so
    Triton's interpreter, whose bf16 cast truncates, computes what the GPU does; NaN stays a quiet NaN."""
    if OUT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)
