"""Zero the output channels of an attention call whose V channel is all zeros, in place, without a host sync.

Why: SageAttention 2's fp8 P·V kernels scale V per channel by amax / 448 over the whole sequence; a channel that is
exactly 0 everywhere gets scale 0, its quantized values are 0·inf = NaN, and that output channel comes out NaN
(kernel and emulation alike; docs/notes/sageattention2.md). Exact attention gives exactly 0 there (every weight
times 0), and so would the kernel with any positive scale for that channel: writing 0 into those channels is what
flooring the scale would give, bit for bit, while the other channels are untouched (P·V's columns are independent).
The ``sagev2`` fp8 backends therefore take V's per-channel amax (one read of V) and call this, which writes only the
flagged channels' elements -- no read of the output, no branch on the host -- so the common case (no zero channel)
costs one V read and a launch of programs that each load D flags and store nothing.

Importing this module decides whether Triton compiles or interprets (``TRITON_INTERPRET=1`` before the first import).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["zero_channels_", "aot_specs", "INTERPRETED", "CHUNK"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
CHUNK = 128


@triton.jit
def _zero_kernel(Out, Flags, s_len, d_len, H, Hf, sob, soh, sos, sod, BLK: tl.constexpr, BD: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = c * BLK + tl.arange(0, BLK)
    cols = tl.arange(0, BD)
    flag = tl.load(Flags + (b * Hf + h // (H // Hf)) * d_len + cols, mask=cols < d_len, other=0)
    mask = (rows[:, None] < s_len) & (flag[None, :] != 0)
    zero = tl.zeros((BLK, BD), dtype=Out.dtype.element_ty)
    tl.store(Out + b * sob + h * soh + rows[:, None] * sos + cols[None, :] * sod, zero, mask=mask)


def zero_channels_(out: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``out[b, h, :, c] = 0`` wherever ``flags[b, h // (H // Hf), c]``; ``out`` (B, H, S, D) any strides, ``flags``
    (B, Hf, D) bool with Hf dividing H (grouped-query attention: one flag row per K/V head). Returns ``out``."""
    b, h, s, d = out.shape
    hf = flags.shape[1]
    if flags.shape != (b, hf, d) or h % hf:
        raise ValueError(f"zero_channels_: flags {tuple(flags.shape)} for an output of shape {tuple(out.shape)}")
    f8 = flags.to(torch.uint8).contiguous()
    _zero_kernel[(triton.cdiv(s, CHUNK), h, b)](out, f8, s, d, h, hf, *out.stride(), BLK=CHUNK,
                                               BD=triton.next_power_of_2(d), num_warps=4)
    return out


def aot_specs(d: int = 128, causal: bool = False, config: dict | None = None) -> dict:
    """label -> (jit function, pointer types by name (others: i32), constexprs by name, compile options) of the
    guard at BD 128, what ``vdbench.kernels.aot --helpers`` compiles (the arguments are the attention kernels')."""
    return {"channels.zero": (_zero_kernel, {"Out": "*bf16", "Flags": "*u8"}, dict(BLK=CHUNK, BD=128),
                              dict(num_warps=4))}
