"""The VAE fast path's norm -> SiLU -> conv-input glue as one Triton kernel (issue: VAE, the <= 0.9 s goal).

Between two causal 3x3x3 convolutions of the Wan decoder sits ``conv_in = cat(cache, silu(rms_norm(x)))``.
Eagerly that is four memory-bound passes over the activation (the fp32-accumulated norm reduction, ``x / norm``
into the conv's input buffer, ``* gamma``, SiLU in place); on an H200 they cost about as much as the convolutions
themselves (docs/PERFORMANCE.md §6). The whole glue is a row-wise op over voxels: read ``x`` once, write
``silu(x / ||x|| * g)`` once, straight into the frames of the conv's input buffer behind the causal context.
In channels_last_3d (the GPU fast path) every voxel's channels are one contiguous row; the contiguous layout
(what CPU convolutions return) is handled by strides, for tests.

Numerics: fp32 throughout, rounded once into the output dtype (the eager path rounds after the division and
again after the gain; ``torch.compile`` of the same function rounds once too).

Like the attention kernels, importing this module decides whether Triton compiles or interprets
(``TRITON_INTERPRET=1`` before the first import: CPU tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["rms_silu_rows", "norm_silu_cat", "INTERPRETED"]

#: Whether this module's kernel was decorated under Triton's interpreter (read once, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _rms_silu_rows_kernel(x_ptr, g_ptr, out_ptr, n_rows, C, xs_r, xs_c, os_r, os_c, eps,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows[:, None] * xs_r + cols[None, :] * xs_c, mask=mask, other=0.0).to(tl.float32)
    norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
    g = tl.load(g_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    y = x / norm[:, None] * g[None, :]
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + rows[:, None] * os_r + cols[None, :] * os_c, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(C, T, H, W) -> a (T*H*W, C) *view* (rows = voxels): strides (C, 1) in channels_last_3d (the GPU fast
    path: every row one contiguous load), (1, T*H*W) in the contiguous layout. Never a copy: the output rows
    must alias the conv's input buffer."""
    c = t.shape[0]
    try:
        return t.permute(1, 2, 3, 0).view(-1, c)
    except RuntimeError as e:
        raise ValueError(f"the fused VAE glue needs the voxels of a (C, T, H, W) tensor to form one strided "
                         f"dimension; got strides {t.stride()} for shape {tuple(t.shape)}") from e


def rms_silu_rows(x: torch.Tensor, g: torch.Tensor, out: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``out[r] = silu(x[r] / max(||x[r]||, eps) * g)`` for the rows of the 2-D (rows, C) views ``x`` and ``out``
    (any strides; ``out`` written in place); fp32 math, one rounding."""
    if x.dim() != 2 or out.shape != x.shape:
        raise ValueError("rms_silu_rows: x and out must be (rows, C) views of one shape")
    n, c = x.shape
    g = g.reshape(-1).to(device=x.device, dtype=torch.float32).contiguous()
    if g.numel() != c:
        raise ValueError(f"rms_silu_rows: gain has {g.numel()} values for {c} channels")
    block_c = triton.next_power_of_2(c)
    block_r = max(1, min(64, 8192 // block_c))
    grid = (triton.cdiv(n, block_r),)
    _rms_silu_rows_kernel[grid](x, g, out, n, c, x.stride(0), x.stride(1), out.stride(0), out.stride(1), eps,
                                BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8 if block_c >= 512 else 4)
    return out


def norm_silu_cat(x: torch.Tensor, ctx: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The fast path's glue contract (``vdbench.vae._norm_silu_cat``): a new conv-input buffer
    ``cat([ctx, silu(rms_norm(x) * g)], dim=2)`` in ``x``'s memory format, the norm over channels (dim 1).

    ``x``: (B, C, T, H, W), channels_last_3d (what the GPU fast path has: coalesced rows) or contiguous;
    ``ctx``: (B, C, P, H, W) causal context frames (any layout); ``g``: (C,) or broadcastable gain
    (gamma * sqrt(C)).
    """
    b, c, t, h, w = x.shape
    p = ctx.shape[2]
    cl = x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d)
    fmt = torch.channels_last_3d if cl else torch.contiguous_format
    buf = torch.empty((b, c, p + t, h, w), dtype=x.dtype, device=x.device, memory_format=fmt)
    if p:
        buf[:, :, :p].copy_(ctx)
    for i in range(b):  # one launch per batch element (B = 1 in the decoders)
        rms_silu_rows(_rows(x[i]), g, _rows(buf[i, :, p:]))
    return buf
