"""Triton quantization pre-pass for the project's attention kernels.

Every quantized tensor is written into a buffer padded to a whole number of tiles (padding rows are zeros,
so the attention kernel loads K/V tiles without masks) and contiguous:

* ``quant_blocks``: (B, H, S, D) -> (B, H, S_pad, D) int8 or e4m3, plus one fp32 scale per ``block`` tokens per
  head, (B, H, n_blocks). Optional mean subtraction (K smoothing) and pre-scale (softmax scale·log2 e on Q).
  INT8 rounds half away from zero (``x/scale ± 0.5`` then truncation), as SageAttention's kernel and
  ``vdbench.numerics.quantize_int8_per_block`` do; e4m3 rounds to nearest (saturating at ±448).
* ``quant_v_t``: V -> e4m3 **transposed**, (B, H, D, S_pad), so the P·V operand is K-major (what Hopper's fp8
  MMA takes without a shared-memory transpose), with either a per-channel scale (B, H, D) computed by a torch
  reduction, or one scale per ``block`` keys (B, H, n_blocks) computed in the kernel.

The sequence reductions (K's mean, V's per-channel amax) are torch reductions (one read of K or V each); the
rest is one Triton pass per tensor. All of it runs inside the backend call, so its time is in the figure.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
INT8_MAX = 127.0
FP8_MAX = 448.0


@triton.jit
def _round_to_e4m3_grid(x):
    """fp32 -> the nearest e4m3 value (ties to even), still in fp32; |x| <= 448 assumed.

    Only used under Triton 3.9's interpreter, whose fp32 -> e4m3 conversion drops the carry when rounding up
    crosses a power of two (127.7 -> 64 instead of 128); converting an already representable value is exact
    there. Normal range: round the fp32 mantissa to 3 bits; below 2^-6 (e4m3 subnormals, spacing 2^-9):
    add and subtract 1.5·2^14, whose fp32 spacing is 2^-9, on |x| with x's sign put back (a tiny negative value
    rounds to -0, as the hardware conversion and torch's do).
    """
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) != 0
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    sub = (tl.abs(x) + 24576.0) - 24576.0
    sub = tl.where(neg, -sub, sub)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def to_e4m3(x, FIX: tl.constexpr):
    """fp32 (|x| <= 448) -> e4m3; ``FIX``: pre-round for the interpreter (see ``_round_to_e4m3_grid``)."""
    if FIX:
        x = _round_to_e4m3_grid(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _load_block(X, s_len, H, sxb, sxh, sxs, sxd, BLK: tl.constexpr, D: tl.constexpr):
    """This program's (block, head, batch) tile of a strided (B, H, S, D) tensor, in fp32 (rows past the end: 0).
    Returns (tile, block index, b*H + h, row indices, column indices, in-sequence mask)."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = blk * BLK + tl.arange(0, BLK)
    cols = tl.arange(0, D)
    inside = rows[:, None] < s_len
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :] * sxd, mask=inside, other=0.0)
    return x.to(tl.float32), blk, b * H + h, rows, cols, inside


@triton.jit
def _quant_blocks_kernel(X, Out, Scale, Mean, s_len, s_pad, n_blk, H, pre_scale,
                         sxb, sxh, sxs, sxd,
                         BLK: tl.constexpr, D: tl.constexpr, HAS_MEAN: tl.constexpr, FP8: tl.constexpr,
                         FIX: tl.constexpr):
    x, blk, bh, rows, cols, inside = _load_block(X, s_len, H, sxb, sxh, sxs, sxd, BLK, D)
    if HAS_MEAN:
        mu = tl.load(Mean + bh * D + cols)
        x = tl.where(inside, x - mu[None, :], 0.0)
    x = x * pre_scale
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    if FP8:
        scale = amax / 448.0
    else:
        scale = amax / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    y = x / safe
    if FP8:
        yq = to_e4m3(tl.clamp(y, -448.0, 448.0), FIX)
    else:
        yq = (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8)  # fptosi truncates: half away from zero
    tl.store(Out + (bh.to(tl.int64) * s_pad + rows[:, None]) * D + cols[None, :], yq)
    tl.store(Scale + bh * n_blk + blk, scale)


@triton.jit
def _quant_v_t_kernel(X, Out, Scale, ChanScale, s_len, s_pad, n_blk, H,
                      sxb, sxh, sxs, sxd,
                      BLK: tl.constexpr, D: tl.constexpr, PER_CHANNEL: tl.constexpr, FIX: tl.constexpr):
    x, blk, bh, rows, cols, inside = _load_block(X, s_len, H, sxb, sxh, sxs, sxd, BLK, D)
    if PER_CHANNEL:
        sc = tl.load(ChanScale + bh * D + cols)  # already safe (> 0)
        y = x / sc[None, :]
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = amax / 448.0
        y = x / tl.where(scale > 0, scale, 1.0)
        tl.store(Scale + bh * n_blk + blk, scale)
    yq = to_e4m3(tl.clamp(y, -448.0, 448.0), FIX)
    # transposed store: element (row, col) -> Out[b, h, col, row]
    tl.store(Out + (bh.to(tl.int64) * D + cols[None, :]) * s_pad + rows[:, None], yq)


def _grid(s, block, b, h):
    return (triton.cdiv(s, block), h, b)


def quant_blocks(x: torch.Tensor, block: int, *, fp8: bool, pre_scale: float = 1.0, mean: torch.Tensor = None):
    """Per-block INT8 (``fp8=False``) or e4m3 (``fp8=True``) quantization of a (B, H, S, D) tensor.

    Returns (padded quantized tensor (B, H, S_pad, D), scales (B, H, n_blocks) fp32). ``mean`` (B, H, D) fp32
    is subtracted first (K smoothing). Any strides are accepted (no copy of x).
    """
    b, h, s, d = x.shape
    n_blk = triton.cdiv(s, block)
    s_pad = n_blk * block
    out = torch.empty((b, h, s_pad, d), device=x.device, dtype=torch.float8_e4m3fn if fp8 else torch.int8)
    scale = torch.empty((b, h, n_blk), device=x.device, dtype=torch.float32)
    has_mean = mean is not None
    mean_arg = mean.contiguous() if has_mean else scale  # dummy pointer when unused
    _quant_blocks_kernel[_grid(s, block, b, h)](
        x, out, scale, mean_arg, s, s_pad, n_blk, h, float(pre_scale), *x.stride(),
        BLK=block, D=d, HAS_MEAN=has_mean, FP8=fp8, FIX=INTERPRETED, num_warps=4)
    return out, scale


def v_channel_scale(v: torch.Tensor) -> torch.Tensor:
    """Per-(batch, head, channel) e4m3 scale of V: amax over the sequence / 448 (1 where the channel is 0)."""
    # inf-norm: one pass over V without an |V| temporary
    sc = torch.linalg.vector_norm(v, ord=float("inf"), dim=2, dtype=torch.float32) / FP8_MAX
    return torch.where(sc > 0, sc, torch.ones_like(sc)).contiguous()


def quant_v_t(v: torch.Tensor, block: int, *, per_channel: bool):
    """V -> e4m3, transposed and padded: (B, H, D, S_pad). Returns (v8t, scale) where scale is (B, H, D)
    (per channel) or (B, H, n_blocks) (per block of ``block`` keys)."""
    b, h, s, d = v.shape
    n_blk = triton.cdiv(s, block)
    s_pad = n_blk * block
    out = torch.empty((b, h, d, s_pad), device=v.device, dtype=torch.float8_e4m3fn)
    if per_channel:
        scale = v_channel_scale(v)
        blk_scale = scale  # unused by the kernel
    else:
        scale = torch.empty((b, h, n_blk), device=v.device, dtype=torch.float32)
        blk_scale = scale
    _quant_v_t_kernel[_grid(s, block, b, h)](
        v, out, blk_scale, scale, s, s_pad, n_blk, h, *v.stride(),
        BLK=block, D=d, PER_CHANNEL=per_channel, FIX=INTERPRETED, num_warps=4)
    return out, scale


def k_mean(k: torch.Tensor) -> torch.Tensor:
    """K's mean over the sequence, (B, H, D) fp32: subtracting it is softmax-invariant (SageAttention's smoothing)."""
    return k.mean(dim=2, dtype=torch.float32).contiguous()


@triton.jit
def _to_e4m3_kernel(X, Y, n, BLK: tl.constexpr, FIX: tl.constexpr):
    r = tl.program_id(0) * BLK + tl.arange(0, BLK)
    x = tl.load(X + r, mask=r < n, other=0.0)
    tl.store(Y + r, to_e4m3(tl.clamp(x, -448.0, 448.0), FIX), mask=r < n)


def to_e4m3_tensor(x: torch.Tensor, fix: bool = INTERPRETED) -> torch.Tensor:
    """The kernels' fp32 -> e4m3 conversion as a standalone op (tests compare it with torch's)."""
    x = x.float().contiguous()
    y = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    _to_e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLK=1024, FIX=fix)
    return y
