"""A Wan block's elementwise passes as Triton kernels, bit for bit the eager expressions diffusers runs.

diffusers' ``WanTransformerBlock.forward`` modulates each norm's output and adds each branch back through a gate, all
in fp32 over the whole hidden state: ``(norm(x.float()) * (1 + scale) + shift).type_as(x)`` before the self-attention
and the feed-forward, ``(x.float() + out * gate).type_as(x)`` after them, where ``shift, scale, gate`` are chunks of
``scale_shift_table + temb.float()``. Eagerly each operator is a pass of its own writing an fp32 tensor (three for a
modulation, four or five for a residual, ~90 bytes moved per element of the hidden state per block where the work
reads and writes ~12); on an H200 about 150 ms of a Wan 1.3B step.

Two kernels, each one pass:

* :func:`modulate` -- reads the norm's fp32 output and the two rows of the table and of ``temb`` (one per sample,
  or per token: Wan 2.2 TI2V's 4-D ``temb``), writes ``n * (1 + scale) + shift`` in the hidden state's dtype;
* :func:`gated_residual` -- reads ``x`` and the branch's output ``y`` and the gate's rows, writes ``x + y * gate``.

The arithmetic is the eager one: ``table + temb`` rounded to fp32, ``1 + scale`` rounded to fp32, each product and
each sum rounded to fp32 on its own (no fused multiply-add: ``enable_fp_fusion=False``), then one
round-to-nearest-even into the output's dtype -- so the result equals diffusers' bit for bit, and a render's frames
don't change.

The norms' reductions stay in torch; their elementwise half joins the kernels. Each of the block's norms is
diffusers' ``FP32LayerNorm(x.float())``: a bf16 -> fp32 copy, then torch's layer norm reading and writing fp32 (and,
for the cross-attention's norm, ``.type_as(x)``): 14 bytes moved an element, 20 with the modulation's or the
cast's read of the fp32 output. Two more kernels take the bf16 ``x`` with the statistics torch's layer norm computes
for it (:func:`layer_norm_stats`: 4 bytes an element, its bf16 output dropped) and finish in one pass (4 more): 8 in
all.

* :func:`norm_modulate` -- ``(x - mean) * rstd``, then :func:`modulate`'s arithmetic (Wan's norm1 and norm3, no
  affine);
* :func:`norm_affine` -- ``weight * ((x - mean) * rstd) + bias`` in the hidden state's dtype (norm2, the
  cross-attention's, ``.type_as(x)``), its product-sum as one fused multiply-add or two roundings (``fma``).

They equal diffusers' values only where the statistics of the bf16 tensor are those of its fp32 copy. In torch's CUDA
layer norm (aten/src/ATen/native/cuda/layer_norm_kernel.cu) they are where both calls take its vectorized kernel: the
row's length a multiple of 4 (and at most 2**24), the input, output, weight and bias pointers aligned to 4 elements
(8 bytes in bf16, 16 in fp32), a non-contiguous input copied first. That kernel's vector width is 4 elements for every
dtype (kept so, its comment says, for equal results between fp32 and the 16-bit types), so both calls feed the same
fp32 values -- a bf16 -> fp32 conversion is exact -- to the same threads in the same Welford order, combined by the
same warp and block tree, and ``rsqrt`` of the same variance: the same mean and rstd bit for bit. A misaligned bf16
view takes the row-wise Welford kernel instead (another order) and its statistics differ (where both take it -- a
row length not a multiple of 4 -- the order is again the same); so do torch's CPU ones (a bf16 input's statistics
come back in bf16). :func:`layer_norm_paths` names the kernels a call and its fp32 copy take. Torch's kernel then
writes ``rstd * (x - mean)`` (a difference, then a product: nothing to contract) and, with an affine, ``gamma * that
+ beta``, which nvcc contracts into one fused multiply-add by default (torch's CPU kernel computes the same fma). None
of this is promised by torch: the family's block forward (vdbench.patching.blocks) compares both statistics and the
outputs on the first call of each form and runs diffusers' norm wherever they differ.

Like the other kernels, importing this module decides whether Triton compiles or interprets (``TRITON_INTERPRET=1``
before the first import: CPU tests).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from . import bits
from .ahead import compile_ahead, compiling_for, launch

__all__ = ["modulate", "gated_residual", "norm_modulate", "norm_affine", "layer_norm_stats", "layer_norm_paths",
           "why_not_fused", "why_not_normed", "prewarm", "aot_specs", "INTERPRETED"]

#: Whether this module's kernels were decorated under Triton's interpreter (read once, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

_round = triton.jit(bits.round_rne)


@triton.jit
def _tile(pid_r, pid_d, n_rows, S, D, ts_b, ts_s, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's rows as (batch, token) and its columns: the rows' int64 indices, the columns, the tile's mask and
    each row's offset into the per-sample (``ts_s`` = 0) or per-token rows of ``temb``."""
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    b = (rows // S).to(tl.int64)
    s = (rows % S).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    return b, s, cols, mask, (b * ts_b + s * ts_s)[:, None] + cols[None, :]


@triton.jit
def _modulated(n, sc_tab, sc_t, sh_tab, sh_t, cols, mask, t_off, D):
    """``n * (1 + scale) + shift`` in fp32, each chunk ``table + temb`` rounded first (diffusers' order)."""
    cmask = cols < D
    scale = (tl.load(sc_tab + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
             + tl.load(sc_t + t_off, mask=mask, other=0.0).to(tl.float32))
    shift = (tl.load(sh_tab + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
             + tl.load(sh_t + t_off, mask=mask, other=0.0).to(tl.float32))
    return n * (1.0 + scale) + shift


@triton.jit
def _normalized(x_ptr, mean_ptr, rstd_ptr, b, s, S, n_rows, cols, mask, xs_b, xs_s):
    """``(x - mean) * rstd`` in fp32 (torch's ``rstd * (x - mean)``: a difference, then a product) for a tile of
    rows, the statistics one per row (row ``b * S + s``)."""
    x = tl.load(x_ptr + (b * xs_b + s * xs_s)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    row = b * S + s
    mean = tl.load(mean_ptr + row, mask=row < n_rows, other=0.0)
    rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
    return (x - mean[:, None]) * rstd[:, None]


@triton.jit
def _modulate_kernel(n_ptr, sc_tab, sc_t, sh_tab, sh_t, o_ptr, n_rows, S, D, ns_b, ns_s, ts_b, ts_s, os_b, os_s,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr):
    b, s, cols, mask, t_off = _tile(tl.program_id(0), tl.program_id(1), n_rows, S, D, ts_b, ts_s, BLOCK_R, BLOCK_D)
    n = tl.load(n_ptr + (b * ns_b + s * ns_s)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    v = _modulated(n, sc_tab, sc_t, sh_tab, sh_t, cols, mask, t_off, D)
    tl.store(o_ptr + (b * os_b + s * os_s)[:, None] + cols[None, :], _round(v, OUT_BF16, o_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _norm_modulate_kernel(x_ptr, mean_ptr, rstd_ptr, sc_tab, sc_t, sh_tab, sh_t, o_ptr, n_rows, S, D, xs_b, xs_s,
                          ts_b, ts_s, os_b, os_s, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                          OUT_BF16: tl.constexpr):
    b, s, cols, mask, t_off = _tile(tl.program_id(0), tl.program_id(1), n_rows, S, D, ts_b, ts_s, BLOCK_R, BLOCK_D)
    n = _normalized(x_ptr, mean_ptr, rstd_ptr, b, s, S, n_rows, cols, mask, xs_b, xs_s)
    v = _modulated(n, sc_tab, sc_t, sh_tab, sh_t, cols, mask, t_off, D)
    tl.store(o_ptr + (b * os_b + s * os_s)[:, None] + cols[None, :], _round(v, OUT_BF16, o_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _norm_affine_kernel(x_ptr, mean_ptr, rstd_ptr, w_ptr, bias_ptr, o_ptr, n_rows, S, D, xs_b, xs_s, os_b, os_s,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr, FMA: tl.constexpr):
    b, s, cols, mask, _ = _tile(tl.program_id(0), tl.program_id(1), n_rows, S, D, 0, 0, BLOCK_R, BLOCK_D)
    n = _normalized(x_ptr, mean_ptr, rstd_ptr, b, s, S, n_rows, cols, mask, xs_b, xs_s)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    bias = tl.load(bias_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if FMA:
        v = tl.fma(w, n, bias)
    else:
        v = w * n + bias
    tl.store(o_ptr + (b * os_b + s * os_s)[:, None] + cols[None, :], _round(v, OUT_BF16, o_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _residual_kernel(x_ptr, y_ptr, g_tab, g_t, o_ptr, n_rows, S, D, xs_b, xs_s, ys_b, ys_s, ts_b, ts_s, os_b, os_s,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr):
    b, s, cols, mask, t_off = _tile(tl.program_id(0), tl.program_id(1), n_rows, S, D, ts_b, ts_s, BLOCK_R, BLOCK_D)
    x = tl.load(x_ptr + (b * xs_b + s * xs_s)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + (b * ys_b + s * ys_s)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = (tl.load(g_tab + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
            + tl.load(g_t + t_off, mask=mask, other=0.0).to(tl.float32))
    v = x + y * gate
    tl.store(o_ptr + (b * os_b + s * os_s)[:, None] + cols[None, :], _round(v, OUT_BF16, o_ptr.dtype.element_ty),
             mask=mask)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WARPS = 8  # 16 elements a thread: ~58 registers on sm_90 (~95 at four warps): occupancy for a memory-bound pass


def _as4(temb: torch.Tensor) -> Optional[torch.Tensor]:
    """``temb`` (K, D), (B, K, D) or (B, S, K, D) as a (B or 1, S or 1, K, D) view; None for any other rank."""
    if temb.dim() == 2:
        return temb[None, None]
    if temb.dim() == 3:
        return temb[:, None]
    return temb if temb.dim() == 4 else None


def _why_operands(x: torch.Tensor, *others: torch.Tensor) -> Optional[str]:
    """Why the kernels can't read ``x`` and ``others`` at all (their device, their dtypes), or None."""
    if x.device.type != "cuda" and not INTERPRETED and not (x.device.type == "meta" and compiling_for()):
        return f"{x.device.type} tensors (the kernels run on CUDA)"
    if any(t.dtype not in _DTYPES for t in (x, *others)):
        return f"dtypes {', '.join(str(t.dtype) for t in (x, *others))} (bf16, fp16, fp32 only)"
    if any(t.device != x.device for t in others):
        return "operands on several devices"
    return None


def why_not_fused(x: torch.Tensor, table: torch.Tensor, temb: torch.Tensor, *rows: torch.Tensor) -> Optional[str]:
    """Why :func:`modulate` / :func:`gated_residual` can't serve this call (None: they can): the eager expressions then
    run instead. ``x``: the hidden state (B, S, D); ``rows``: the call's other (B, S, D) operands (the norm's output,
    the branch's); ``table`` (K, D); ``temb`` (K, D), (B or 1, K, D) or (B or 1, S or 1, K, D)."""
    why = _why_operands(x, table, temb, *rows)
    if why is not None:
        return why
    t4 = _as4(temb)
    if x.dim() != 3 or any(r.shape != x.shape for r in rows) or t4 is None:
        return (f"shapes {tuple(x.shape)}, temb {tuple(temb.shape)}, "
                f"{', '.join(str(tuple(r.shape)) for r in rows)} (B, S, D), temb (B, [S,] K, D)")
    b, s, d = x.shape
    if (table.dim() != 2 or table.shape[1] != d or t4.shape[2:] != table.shape or t4.shape[0] not in (1, b)
            or t4.shape[1] not in (1, s)):
        return f"table {tuple(table.shape)} and temb {tuple(temb.shape)} for x of {tuple(x.shape)}"
    if any(t.stride(-1) != 1 for t in (x, table, temb, *rows) if t.shape[-1] > 1):
        return "channels not contiguous"
    return None


def why_not_normed(x: torch.Tensor, mean: Optional[torch.Tensor], rstd: Optional[torch.Tensor],
                   *params: Optional[torch.Tensor]) -> Optional[str]:
    """Why :func:`norm_modulate` / :func:`norm_affine` can't normalize ``x`` (B, S, D) with these statistics -- one
    fp32 a row, ``B * S`` contiguous, :func:`layer_norm_stats`' on CUDA; None: not checked -- and per-channel
    ``params`` (the norm's weight and bias, (D,) each), or None (the modulation's operands: :func:`why_not_fused`)."""
    if any(p is None for p in params):
        return "a layer norm without both a weight and a bias"
    why = _why_operands(x, *params)
    if why is not None:
        return why
    if x.dim() != 3 or any(p.shape != x.shape[-1:] for p in params):
        return f"shapes {tuple(x.shape)}, {', '.join(str(tuple(p.shape)) for p in params)} (B, S, D), (D,)"
    if any(t.stride(-1) != 1 for t in (x, *params) if t.shape[-1] > 1):
        return "channels not contiguous"
    for t in (t for t in (mean, rstd) if t is not None):
        if t.dtype != torch.float32:
            return f"layer norm statistics in {t.dtype} (the kernels take fp32)"
        if t.numel() != x.shape[0] * x.shape[1] or not t.is_contiguous() or t.device != x.device:
            return f"statistics of {tuple(t.shape)} on {t.device} for x of {tuple(x.shape)} (one a row, contiguous)"
    return None


def layer_norm_paths(x: torch.Tensor, *params: Optional[torch.Tensor]) -> str:
    """Which of torch's CUDA layer norm kernels computes the statistics of ``x`` (no affine: :func:`layer_norm_stats`)
    and which those of diffusers' call on its fp32 copy with ``params`` (the weight and bias, or None), as
    ``"<x's>/<fp32 copy's>"``, each ``vectorized`` or ``rowwise``: the vectorized kernel needs a row length that is
    a multiple of 4 (at most 2**24) and every pointer aligned to 4 elements -- a non-contiguous input is copied
    first, the output and the fp32 copy are new (aligned) tensors, an fp32 weight is read where it lies. The
    statistics are the same where both are ``vectorized`` (or both ``rowwise``), another order otherwise."""
    d = x.shape[-1]
    fits = d % 4 == 0 and d <= 2 ** 24

    def aligned(t):
        return not t.is_contiguous() or t.data_ptr() % (4 * t.element_size()) == 0

    ours = fits and aligned(x)
    theirs = fits and all(p is None or p.dtype != torch.float32 or aligned(p) for p in params)
    return f"{'vectorized' if ours else 'rowwise'}/{'vectorized' if theirs else 'rowwise'}"


def layer_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) of each row of ``x`` (B, S, D), flattened to (B * S,), as torch's layer norm computes them for
    ``x`` itself (fp32 on CUDA for a bf16 ``x``; bf16 on a CPU). No torch op returns a layer norm's statistics alone:
    ``native_layer_norm`` also writes the normalized tensor in ``x``'s dtype (2 bytes an element for bf16, dropped
    here) -- the least of the ways, since ``var_mean`` reduces in another order and ``rsqrt`` of its variance is
    another op, so neither gives the layer norm's values."""
    _, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], None, None, eps)
    return mean.reshape(-1), rstd.reshape(-1)


def _blocks(d: int) -> tuple[int, int]:
    """(rows, columns) of a program's tile: whole power-of-two column blocks where ``d`` has one of 128 or more as a
    divisor (Wan's 1536, 3072, 5120: no masked lane), about 4096 elements a program."""
    block_d = min(1024, d & -d)
    if block_d < 128:
        block_d = min(1024, triton.next_power_of_2(d))
    return max(1, 4096 // block_d), block_d


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, token) strides of a (B, S, D) operand; a dimension of one reads as stride 0 (broadcast)."""
    return (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)


def _check(x, table, temb, rows, k: tuple[int, ...], name: str) -> torch.Tensor:
    """``temb`` as (B or 1, S or 1, K, D) for a call :func:`why_not_fused` accepts, with chunks ``k`` in the table;
    ValueError otherwise."""
    why = why_not_fused(x, table, temb, *rows)
    if why is None and any(not 0 <= i < table.shape[0] for i in k):
        why = f"chunks {k} of a table of {table.shape[0]}"
    if why is not None:
        raise ValueError(f"{name}: {why}")
    return _as4(temb)


def modulate(norm: torch.Tensor, table: torch.Tensor, temb: torch.Tensor, shift: int, scale: int,
             dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(norm * (1 + (table[scale] + temb[.., scale, :].float())) + (table[shift] + temb[.., shift, :].float()))``
    rounded to ``dtype`` (into ``out``, a new tensor if None), diffusers' values bit for bit: ``norm`` (B, S, D) the
    norm's output, ``table`` (K, D) the block's modulation table, ``temb`` its timestep rows (see
    :func:`why_not_fused`). Raises ValueError for a call :func:`why_not_fused` refuses."""
    out = torch.empty(norm.shape, device=norm.device, dtype=dtype) if out is None else out
    t4 = _check(out, table, temb, (norm,), (shift, scale), "modulate")
    b, s, d = norm.shape
    if norm.numel() == 0:
        return out
    block_r, block_d = _blocks(d)
    launch(_modulate_kernel, (triton.cdiv(b * s, block_r), triton.cdiv(d, block_d)),
           norm, table[scale], t4[:, :, scale], table[shift], t4[:, :, shift], out, b * s, s, d,
           *_row_strides(norm), *_row_strides(t4), *_row_strides(out),
           BLOCK_R=block_r, BLOCK_D=block_d, OUT_BF16=out.dtype == torch.bfloat16, num_warps=_WARPS,
           enable_fp_fusion=False)
    return out


def gated_residual(x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, temb: torch.Tensor, gate: int,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(x.float() + y.float() * (table[gate] + temb[.., gate, :].float()))`` rounded to ``x``'s dtype (into
    ``out``, a new tensor if None), diffusers' values bit for bit: ``x`` the hidden state (B, S, D), ``y`` the
    branch's output. Raises ValueError for a call :func:`why_not_fused` refuses."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if out.dtype != x.dtype:
        raise ValueError(f"gated_residual: out in {out.dtype} for x in {x.dtype}")
    t4 = _check(x, table, temb, (y, out), (gate,), "gated_residual")
    b, s, d = x.shape
    if x.numel() == 0:
        return out
    block_r, block_d = _blocks(d)
    launch(_residual_kernel, (triton.cdiv(b * s, block_r), triton.cdiv(d, block_d)),
           x, y, table[gate], t4[:, :, gate], out, b * s, s, d, *_row_strides(x), *_row_strides(y), *_row_strides(t4),
           *_row_strides(out), BLOCK_R=block_r, BLOCK_D=block_d, OUT_BF16=x.dtype == torch.bfloat16, num_warps=_WARPS,
           enable_fp_fusion=False)
    return out


def _check_normed(x, mean, rstd, params, out, name: str) -> None:
    """ValueError for a call :func:`why_not_normed` refuses, or whose ``out`` isn't shaped as ``x``."""
    why = why_not_normed(x, mean, rstd, *params) or _why_operands(x, out)
    if why is None and (out.shape != x.shape or out.stride(-1) != 1):
        why = f"out of {tuple(out.shape)} for x of {tuple(x.shape)} (channels contiguous)"
    if why is not None:
        raise ValueError(f"{name}: {why}")


def norm_modulate(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, table: torch.Tensor,
                  temb: torch.Tensor, shift: int, scale: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`modulate` of ``(x - mean) * rstd`` -- diffusers' ``FP32LayerNorm(x.float())`` without an affine, from
    the statistics of :func:`layer_norm_stats` -- rounded to ``x``'s dtype (into ``out``, a new tensor if None): the
    norm's fp32 output never written. Raises ValueError for a call :func:`why_not_fused` or :func:`why_not_normed`
    refuses."""
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype) if out is None else out
    t4 = _check(out, table, temb, (x,), (shift, scale), "norm_modulate")
    _check_normed(x, mean, rstd, (), out, "norm_modulate")
    b, s, d = x.shape
    if x.numel() == 0:
        return out
    block_r, block_d = _blocks(d)
    launch(_norm_modulate_kernel, (triton.cdiv(b * s, block_r), triton.cdiv(d, block_d)),
           x, mean, rstd, table[scale], t4[:, :, scale], table[shift], t4[:, :, shift], out, b * s, s, d,
           *_row_strides(x), *_row_strides(t4), *_row_strides(out),
           BLOCK_R=block_r, BLOCK_D=block_d, OUT_BF16=out.dtype == torch.bfloat16, num_warps=_WARPS,
           enable_fp_fusion=False)
    return out


def norm_affine(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                fma: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``weight * ((x - mean) * rstd) + bias`` rounded to ``x``'s dtype (into ``out``, a new tensor if None):
    diffusers' ``FP32LayerNorm(x.float()).type_as(x)`` with an affine, from the statistics of
    :func:`layer_norm_stats`; the product-sum one fused multiply-add (``fma``: what torch's CUDA and CPU kernels
    compute) or a product and a sum rounded each. Raises ValueError for a call :func:`why_not_fused` or
    :func:`why_not_normed` refuses."""
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype) if out is None else out
    _check_normed(x, mean, rstd, (weight, bias), out, "norm_affine")
    b, s, d = x.shape
    if x.numel() == 0:
        return out
    block_r, block_d = _blocks(d)
    launch(_norm_affine_kernel, (triton.cdiv(b * s, block_r), triton.cdiv(d, block_d)),
           x, mean, rstd, weight, bias, out, b * s, s, d, *_row_strides(x), *_row_strides(out),
           BLOCK_R=block_r, BLOCK_D=block_d, OUT_BF16=out.dtype == torch.bfloat16, FMA=bool(fma), num_warps=_WARPS,
           enable_fp_fusion=False)
    return out


def prewarm(tokens: int, dim: int, dtype: torch.dtype, device, temb_dtype: Optional[torch.dtype] = None,
            per_token: bool = False, table_dtype: torch.dtype = torch.float32) -> int:
    """Compile ahead, and load, the four kernels' specializations for a render's blocks: ``tokens`` of ``dim``
    channels a call (a rank's share of the sequence under context parallelism), the hidden state in ``dtype``, ``temb``
    in ``temb_dtype`` (default ``dtype``) one row per sample or (``per_token``) per token, the table in
    ``table_dtype``, the norms' weights in fp32 (an affine's product-sum one fused multiply-add).
    Meta tensors: no GPU work; the first real call finds the kernels in the JIT's cache (Triton's specialization key:
    the same dtypes, alignments and integer properties). Returns how many kernels it compiled or found."""
    meta = dict(device="meta")
    x = torch.empty(1, tokens, dim, dtype=dtype, **meta)
    table = torch.empty(6, dim, dtype=table_dtype, **meta)
    temb = torch.empty(1, *((tokens,) if per_token else ()), 6, dim, dtype=temb_dtype or dtype, **meta)
    stats = torch.empty(tokens, dtype=torch.float32, **meta)
    norm_params = torch.empty(dim, dtype=torch.float32, **meta)  # diffusers keeps the norms in fp32
    def calls():
        modulate(torch.empty(1, tokens, dim, dtype=torch.float32, **meta), table, temb, 0, 1, dtype)
        gated_residual(x, torch.empty_like(x), table, temb, 2)
        norm_modulate(x, stats, stats, table, temb, 0, 1)
        norm_affine(x, stats, stats, norm_params, norm_params)

    return compile_ahead(device, calls)


def aot_specs(d: int = 128, causal: bool = False, config: dict | None = None) -> dict:
    """label -> (jit function, pointer types by name (others: i32), constexprs by name, compile options): the four
    kernels for a bf16 model with an fp32 table, fp32 norms and bf16 ``temb``, at Wan 1.3B's width (1536), what
    ``vdbench.kernels.aot --helpers`` compiles."""
    block_r, block_d = _blocks(1536)
    consts = dict(BLOCK_R=block_r, BLOCK_D=block_d, OUT_BF16=True)
    opts = dict(num_warps=_WARPS, enable_fp_fusion=False)
    strides = {k: "i64" for k in ("ns_b", "ns_s", "xs_b", "xs_s", "ys_b", "ys_s", "ts_b", "ts_s", "os_b", "os_s")}
    mod = {"n_ptr": "*fp32", "sc_tab": "*fp32", "sc_t": "*bf16", "sh_tab": "*fp32", "sh_t": "*bf16", "o_ptr": "*bf16"}
    res = {"x_ptr": "*bf16", "y_ptr": "*bf16", "g_tab": "*fp32", "g_t": "*bf16", "o_ptr": "*bf16"}
    normed = {"x_ptr": "*bf16", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "w_ptr": "*fp32", "bias_ptr": "*fp32"}
    return {"block.modulate.bf16": (_modulate_kernel, {**mod, **strides}, consts, opts),
            "block.residual.bf16": (_residual_kernel, {**res, **strides}, consts, opts),
            "block.norm_modulate.bf16": (_norm_modulate_kernel, {**mod, **normed, **strides}, consts, opts),
            "block.norm_affine.bf16": (_norm_affine_kernel, {**normed, "o_ptr": "*bf16", **strides},
                                       {**consts, "FMA": True}, opts)}
