"""Triton kernels of the fp8 Ulysses exchange (``--ulysses_fp8_exchange``): a tensor crosses the all-to-all as e4m3
with one fp32 scale per (token, head) row of ``D`` values, half the bytes of bf16.

Each kernel also does the layout copy the exchange needs anyway, so the quantization costs no pass of its own:

* ``quantize_rows``: the rows of a strided 5-D view (four row dims, then ``D``: the projection's (B, S_loc, P, h, D)
  split by destination, or the attention output) -> e4m3 rows and their scales at the positions a second view of the
  same shape names (the send buffer).
* ``dequantize_rows``: the reverse, e4m3 rows and scales -> the model's dtype, into any strided view of that shape
  (the kernel's BSHD input, or this rank's tokens with every head in order).

Scale = amax(|row|) / 448 (1 for a row of zeros), so every row uses e4m3's whole range; the value is rounded to
nearest. ``vdbench.numerics`` has no emulation of its own: :func:`reference_quantize_rows` is the same arithmetic in
torch, which the tests compare the kernels with bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .quant import FP8_MAX, to_e4m3

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

__all__ = ["quantize_rows", "dequantize_rows", "reference_quantize_rows"]


@triton.jit
def _row_offsets(r, n1, n2, n3, s0, s1, s2, s3):
    """The offset of row ``r`` (row-major over the first four dims of sizes (., n1, n2, n3)) in a view with these
    strides."""
    i3 = r % n3
    i2 = (r // n3) % n2
    i1 = (r // (n3 * n2)) % n1
    i0 = r // (n3 * n2 * n1)
    return i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2 + i3.to(tl.int64) * s3


@triton.jit
def _tile(n_rows, D, ROWS: tl.constexpr, BD: tl.constexpr):
    """This program's rows, the columns, which rows exist, and the (row, column) mask."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BD)
    live = r < n_rows
    return r, d, live, live[:, None] & (d[None, :] < D)


@triton.jit
def _load_rows(P, r, d, mask, n1, n2, n3, s0, s1, s2, s3):
    """Rows ``r`` of a strided view, in fp32 (masked entries 0)."""
    return tl.load(P + _row_offsets(r, n1, n2, n3, s0, s1, s2, s3)[:, None] + d[None, :], mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _quantize_kernel(X, Y, Sc, n_rows, n1, n2, n3,
                     sx0, sx1, sx2, sx3, sy0, sy1, sy2, sy3, ss0, ss1, ss2, ss3, D,
                     ROWS: tl.constexpr, BD: tl.constexpr, FIX: tl.constexpr):
    r, d, live, mask = _tile(n_rows, D, ROWS, BD)
    x = _load_rows(X, r, d, mask, n1, n2, n3, sx0, sx1, sx2, sx3)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0), FIX)
    tl.store(Y + _row_offsets(r, n1, n2, n3, sy0, sy1, sy2, sy3)[:, None] + d[None, :], q, mask=mask)
    tl.store(Sc + _row_offsets(r, n1, n2, n3, ss0, ss1, ss2, ss3), scale, mask=live)


@triton.jit
def _dequantize_kernel(Y, Sc, Out, n_rows, n1, n2, n3,
                       sy0, sy1, sy2, sy3, ss0, ss1, ss2, ss3, so0, so1, so2, so3, D,
                       ROWS: tl.constexpr, BD: tl.constexpr, ROUND_BF16: tl.constexpr):
    r, d, live, mask = _tile(n_rows, D, ROWS, BD)
    q = _load_rows(Y, r, d, mask, n1, n2, n3, sy0, sy1, sy2, sy3)
    scale = tl.load(Sc + _row_offsets(r, n1, n2, n3, ss0, ss1, ss2, ss3), mask=live, other=1.0)
    x = q * scale[:, None]
    if ROUND_BF16:  # the interpreter truncates fp32 -> bf16: put the value on the bf16 grid first (ties to even)
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(Out + _row_offsets(r, n1, n2, n3, so0, so1, so2, so3)[:, None] + d[None, :],
             x.to(Out.dtype.element_ty), mask=mask)


def _check(view: torch.Tensor, what: str, dims: int = 5) -> None:
    if view.dim() != dims or (dims == 5 and view.stride(-1) != 1):
        raise ValueError(f"{what}: expected a {dims}-D view whose last dim is contiguous, got shape "
                         f"{tuple(view.shape)} strides {view.stride()}")


def _launch_shape(x: torch.Tensor):
    n0, n1, n2, n3, d = x.shape
    rows = n0 * n1 * n2 * n3
    block_rows = 16
    return rows, (n1, n2, n3), d, triton.next_power_of_2(d), block_rows, (triton.cdiv(rows, block_rows),)


def quantize_rows(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> None:
    """``x`` (5-D view, rows of ``D`` in the last dim) -> ``y`` (e4m3, a 5-D view of the same shape) and ``scale``
    (fp32, 4-D: one per row), each written at its own strides: the layout change is free."""
    _check(x, "quantize_rows x")
    _check(y, "quantize_rows y")
    _check(scale, "quantize_rows scale", 4)
    if y.shape != x.shape or scale.shape != x.shape[:4]:
        raise ValueError(f"quantize_rows: shapes {tuple(x.shape)}, {tuple(y.shape)}, {tuple(scale.shape)} disagree")
    rows, (n1, n2, n3), d, bd, block_rows, grid = _launch_shape(x)
    _quantize_kernel[grid](x, y, scale, rows, n1, n2, n3, *x.stride()[:4], *y.stride()[:4], *scale.stride(), d,
                           ROWS=block_rows, BD=bd, FIX=INTERPRETED, num_warps=4)


def dequantize_rows(y: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """The reverse of :func:`quantize_rows`: e4m3 rows ``y`` times their ``scale`` into ``out`` (the model's dtype,
    any 5-D view of the same shape)."""
    _check(y, "dequantize_rows y")
    _check(out, "dequantize_rows out")
    _check(scale, "dequantize_rows scale", 4)
    if out.shape != y.shape or scale.shape != y.shape[:4]:
        raise ValueError(f"dequantize_rows: shapes {tuple(y.shape)}, {tuple(scale.shape)}, {tuple(out.shape)} "
                         "disagree")
    rows, (n1, n2, n3), d, bd, block_rows, grid = _launch_shape(y)
    _dequantize_kernel[grid](y, scale, out, rows, n1, n2, n3, *y.stride()[:4], *scale.stride(), *out.stride()[:4],
                             d, ROWS=block_rows, BD=bd, ROUND_BF16=INTERPRETED and out.dtype == torch.bfloat16,
                             num_warps=4)


def reference_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' arithmetic in torch: (e4m3 rows, fp32 scales) of ``x`` (rows in the last dim)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
