"""The VAE fast path's norm -> SiLU -> conv-input glue as one Triton kernel (issue: VAE, the <= 0.9 s goal).

Between two causal 3x3x3 convolutions of the Wan decoder sits ``conv_in = cat(cache, silu(rms_norm(x)))``.
Eagerly that is four memory-bound passes over the activation (the fp32-accumulated norm reduction, ``x / norm``
into the conv's input buffer, ``* gamma``, SiLU in place); on an H200 they cost about as much as the convolutions
themselves (docs/PERFORMANCE.md §8.1). The whole glue is a row-wise op over voxels: read ``x`` once, write
``silu(x / ||x|| * g)`` once, straight into the frames of the conv's input buffer behind the causal context.
In channels_last_3d (the GPU fast path) every voxel's channels are one contiguous row; the contiguous layout
(what CPU convolutions return) is handled by strides, for tests.

The convolutions' biases ride along: with the fused glue the fast path runs every conv without its bias and adds
it where the output is read next -- inside the glue (``bias=``) when a norm follows, together with the residual
(``add_rows_``) after a residual block's second conv, or in one vectorized row pass elsewhere. PyTorch's own
bias add is a pass of its own over the conv output, broadcast over channels_last rows on the non-vectorized
elementwise path (an H200 profile: ~110 ms of a 1.0 s decode).

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

from .ahead import compile_only, compiling_for, launch, load_compiled

__all__ = ["rms_silu_rows", "norm_silu_cat", "norm_silu_cat_keep", "add_rows_", "subpixel_bias", "add_dup_up_",
           "compile_only", "compiling_for", "load_compiled", "INTERPRETED"]

#: Whether this module's kernel was decorated under Triton's interpreter (read once, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _rms_silu_rows_kernel(x_ptr, b_ptr, g_ptr, out_ptr, tail_ptr, n_rows, C, xs_r, xs_c, os_r, os_c, eps,
                          per_batch, skip, keep, ts_r, ts_c,
                          HAS_BIAS: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows[:, None] * xs_r + cols[None, :] * xs_c, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # the producing conv's bias, added here instead of in a pass of its own
        x += tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
    g = tl.load(g_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    y = x / norm[:, None] * g[None, :]
    y = y / (1.0 + tl.exp(-y))
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * os_r + cols[None, :] * os_c, y, mask=mask)
    if HAS_TAIL:  # the rows of each batch's last frames also go to the causal cache (no clone pass after)
        k = rows % per_batch - skip
        tail_rows = (rows // per_batch) * keep + k
        tl.store(tail_ptr + tail_rows[:, None] * ts_r + cols[None, :] * ts_c, y, mask=mask & (k >= 0)[:, None])


@triton.jit
def _add_rows_kernel(y_ptr, b_ptr, r_ptr, n_rows, C, ys_r, ys_c, rs_r, rs_c,
                     HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < C)[None, :]
    ptr = y_ptr + rows[:, None] * ys_r + cols[None, :] * ys_c
    y = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    y += tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + rows[:, None] * rs_r + cols[None, :] * rs_c, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _subpixel_bias_kernel(y_ptr, b_ptr, out_ptr, s_ptr, n_pix, H, W, C, ys_n, ys_h, ys_w, ys_c, os_n, os_h, os_w, os_c,
                          T2, FT, FH, FW, ss_b, ss_c, ss_t, ss_ft, ss_h, ss_fh, ss_w, ss_fw,
                          HAS_ADD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # out[n, 2i + a, 2j + b, c] = y[n, i + a, j + b, (2a + b) C + c] + bias[c] (+ s at that voxel), a row of C per
    # output pixel; frame n of out is frame n % T2 of batch n // T2 for the 8-D s (B, C, T, FT, H', FH, W', FW)
    pid = tl.program_id(0)
    p = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    ox = p % (2 * W)
    q = p // (2 * W)
    oy = q % (2 * H)
    n = q // (2 * H)
    a = oy % 2
    b = ox % 2
    src = y_ptr + n * ys_n + (oy // 2 + a) * ys_h + (ox // 2 + b) * ys_w + (2 * a + b) * C * ys_c
    dst = out_ptr + n * os_n + oy * os_h + ox * os_w
    cols = tl.arange(0, BLOCK_C)
    mask = (p < n_pix)[:, None] & (cols < C)[None, :]
    v = tl.load(src[:, None] + cols[None, :] * ys_c, mask=mask, other=0.0).to(tl.float32)
    v += tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if HAS_ADD:  # the DupUp3D shortcut of the block, read through its strided view (no pass of its own)
        t2 = n % T2
        sp = (s_ptr + (n // T2) * ss_b + (t2 // FT) * ss_t + (t2 % FT) * ss_ft + (oy // FH) * ss_h
              + (oy % FH) * ss_fh + (ox // FW) * ss_w + (ox % FW) * ss_fw)
        v += tl.load(sp[:, None] + cols[None, :] * ss_c, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst[:, None] + cols[None, :] * os_c, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_dup_up_kernel(x_ptr, s_ptr, n_rows, T2, H2, W2, C, FT, FH, FW, xs_b, xs_t, xs_h, xs_w, xs_c,
                       ss_b, ss_c, ss_t, ss_ft, ss_h, ss_fh, ss_w, ss_fw, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # x[b, c, t', h', w'] += s[b, c, t' // FT, t' % FT, h' // FH, h' % FH, w' // FW, w' % FW], a row of C per voxel
    pid = tl.program_id(0)
    r = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    w2 = r % W2
    q = r // W2
    h2 = q % H2
    q = q // H2
    t2 = q % T2
    b = q // T2
    dst = x_ptr + b * xs_b + t2 * xs_t + h2 * xs_h + w2 * xs_w
    src = (s_ptr + b * ss_b + (t2 // FT) * ss_t + (t2 % FT) * ss_ft + (h2 // FH) * ss_h + (h2 % FH) * ss_fh
           + (w2 // FW) * ss_w + (w2 % FW) * ss_fw)
    cols = tl.arange(0, BLOCK_C)
    mask = (r < n_rows)[:, None] & (cols < C)[None, :]
    ptr = dst[:, None] + cols[None, :] * xs_c
    v = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    v += tl.load(src[:, None] + cols[None, :] * ss_c, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, v.to(x_ptr.dtype.element_ty), mask=mask)


# The compile-only mode (compile_only, compiling_for, load_compiled) and the launch that honours it are shared with
# the other kernels compiled ahead (vdbench.kernels.ahead); ``_launch`` is this module's name for it (a bench traces
# the glue's launches by replacing it).
_launch = launch


def _try_rows(t: torch.Tensor, dim: int = 0):
    """``t`` with its channel dimension ``dim`` moved last, as a (voxels, C) *view* (rows = voxels), or None where
    the voxels don't form one strided dimension. channels_last(_3d) (the GPU fast path): strides (C, 1), every row
    one contiguous load; contiguous: (1, voxels)."""
    try:
        return t.movedim(dim, -1).view(-1, t.shape[dim])
    except RuntimeError:
        return None


def _paired_rows(a: torch.Tensor, b: torch.Tensor | None, dim: int = 0):
    """(rows of ``a``, rows of ``b``) views of two tensors of one shape whose channels are dimension ``dim`` (0:
    (C, *S); 1: (B, C, *S)): one pair where both layouts allow it (channels_last: a batch of frames in one launch),
    else split along the first other dimension -- the batch, then voxel dimensions -- until both are one strided
    dimension (e.g. frames of a permuted 2-D conv output: one launch per frame). Never a copy: the rows alias the
    tensors written."""
    ra, rb = _try_rows(a, dim), (None if b is None else _try_rows(b, dim))
    if ra is not None and (b is None or rb is not None):
        yield ra, rb
        return
    split = 0 if dim == 1 else 1  # (C, L) always has a rows view: the recursion ends
    for j in range(a.shape[split]):
        yield from _paired_rows(a.select(split, j), None if b is None else b.select(split, j))


def _blocks(c: int) -> tuple[int, int, int]:
    block_c = triton.next_power_of_2(c)
    return block_c, max(1, min(64, 8192 // block_c)), 8 if block_c >= 512 else 4


def _vec(v: torch.Tensor, c: int, what: str, device) -> torch.Tensor:
    """A per-channel vector (gain, bias) as the kernels read it: flat, contiguous, on ``device``, in its own dtype
    (the kernels load it as fp32; no cast pass per call for a bf16 conv bias)."""
    v = v.reshape(-1).to(device=device).contiguous()
    if v.numel() != c:
        raise ValueError(f"{what} has {v.numel()} values for {c} channels")
    return v


def rms_silu_rows(x: torch.Tensor, g: torch.Tensor, out: torch.Tensor, eps: float = 1e-12,
                  bias: torch.Tensor | None = None, tail: tuple | None = None) -> torch.Tensor:
    """``out[r] = silu(z / max(||z||, eps) * g)`` with ``z = x[r] (+ bias)`` for the rows of the 2-D (rows, C)
    views ``x`` and ``out`` (any strides; ``out`` written in place); fp32 math, one rounding. ``tail``: ``(rows,
    per_batch, keep)``, a (rows, C) view that also gets the last ``keep`` of every ``per_batch`` rows (the frames
    a causal conv caches), written by the same pass."""
    if x.dim() != 2 or out.shape != x.shape:
        raise ValueError("rms_silu_rows: x and out must be (rows, C) views of one shape")
    n, c = x.shape
    g = _vec(g, c, "rms_silu_rows: gain", x.device)
    b = g if bias is None else _vec(bias, c, "rms_silu_rows: bias", x.device)
    t, per_batch, keep = tail if tail is not None else (out, 1, 0)
    if tail is not None and (n % per_batch or not 0 < keep <= per_batch or t.shape != (n // per_batch * keep, c)):
        raise ValueError(f"rms_silu_rows: a tail of {tuple(t.shape)} for {n} rows, {keep} of every {per_batch}")
    block_c, block_r, warps = _blocks(c)
    _launch(_rms_silu_rows_kernel, (triton.cdiv(n, block_r),),
        x, b, g, out, t, n, c, x.stride(0), x.stride(1), out.stride(0), out.stride(1), eps,
        per_batch, per_batch - keep, keep, t.stride(0), t.stride(1),
        HAS_BIAS=bias is not None, HAS_TAIL=tail is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def add_rows_(y: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """In place ``y += bias (+ residual)`` over channels (dim 1) of a (B, C, *S) tensor, in one pass, fp32 math
    rounded once: a convolution's bias (and a residual block's skip input) added after a conv run without its
    bias. PyTorch adds a conv bias in a pass of its own whose broadcast over channels_last rows takes the
    non-vectorized elementwise path (on an H200, ~11% of the fast Wan decode; docs/PERFORMANCE.md §8.1)."""
    c = y.shape[1]
    b = _vec(bias, c, "add_rows_: bias", y.device)
    if residual is not None and residual.shape != y.shape:
        raise ValueError(f"add_rows_: residual {tuple(residual.shape)} for output {tuple(y.shape)}")
    block_c, block_r, warps = _blocks(c)
    for yv, rv in _paired_rows(y, residual, dim=1):
        n = yv.shape[0]
        r = yv if rv is None else rv
        _launch(_add_rows_kernel, (triton.cdiv(n, block_r),),
            yv, b, r, n, c, yv.stride(0), yv.stride(1), r.stride(0), r.stride(1),
            HAS_RES=rv is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return y


def subpixel_bias(y4: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, add: torch.Tensor | None = None,
                  frames: int | None = None) -> torch.Tensor:
    """The sub-pixel upsample conv's interleave (``vdbench.vae.lean.upsample_conv``) in one pass: ``y4`` (N, 4C,
    H + 1, W + 1), the conv of the 2x2 kernels of the four output parities ``(a, b)`` (block ``2a + b``), written
    into ``out`` (N, C, 2H, 2W) as ``out[:, :, 2i + a, 2j + b] = y4[:, (2a + b) C : (2a + b + 1) C, i + a, j + b] +
    bias``: fp32 math, one rounding (what ``torch.add`` of the two does); any strides, a contiguous row of C per
    pixel in channels_last (the GPU path). Four strided adds eagerly, each on the non-vectorized elementwise path.

    ``add``: a residual added in the same pass (Wan 2.2's ``DupUp3D`` shortcut as :func:`add_dup_up_` takes it, the
    8-D (B, C, T, ft, H', fh, W', fw) view), the N frames of ``out`` being ``frames`` (= T ft) of each of its B
    batches: its own pass over the output saved, and the sum rounded once."""
    n, c, h2, w2 = out.shape
    if y4.shape != (n, 4 * c, h2 // 2 + 1, w2 // 2 + 1) or h2 % 2 or w2 % 2:
        raise ValueError(f"subpixel_bias: y4 {tuple(y4.shape)} for output {tuple(out.shape)}")
    b = _vec(bias, c, "subpixel_bias: bias", out.device)
    s, ss, f = out, (0,) * 8, (1, 1, 1, 1)
    if add is not None:
        sb, sc, st, ft, sh, fh, sw, fw = add.shape
        if frames is None or sb * frames != n or (sc, st * ft, sh * fh, sw * fw) != (c, frames, h2, w2):
            raise ValueError(f"subpixel_bias: add {tuple(add.shape)} for output {tuple(out.shape)} "
                             f"of {frames} frames a batch")
        s, ss, f = add, add.stride(), (frames, ft, fh, fw)
    block_c, block_r, warps = _blocks(c)
    n_pix = n * h2 * w2
    _launch(_subpixel_bias_kernel, (triton.cdiv(n_pix, block_r),),
        y4, b, out, s, n_pix, h2 // 2, w2 // 2, c, y4.stride(0), y4.stride(2), y4.stride(3), y4.stride(1),
        out.stride(0), out.stride(2), out.stride(3), out.stride(1), *f, ss[0], ss[1], ss[2], ss[3], ss[4], ss[5],
        ss[6], ss[7], HAS_ADD=add is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def add_dup_up_(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """In place ``x += src`` for Wan 2.2's ``DupUp3D`` shortcut: ``x`` (B, C, T', H', W') and ``src`` its 8-D
    (B, C, T, ft, H, fh, W, fw) form with ``T' = T ft`` and so on (``vdbench.vae.lean.dup_up_view``: a strided view
    of the block's input, strides 0 where a channel repeats) in one pass, fp32 math, one rounding. Eagerly: the add
    through 8-D views of both, on the non-vectorized elementwise path."""
    b, c, t2, h2, w2 = x.shape
    sb, sc, st, ft, sh, fh, sw, fw = src.shape
    if (sb, sc, st * ft, sh * fh, sw * fw) != (b, c, t2, h2, w2):
        raise ValueError(f"add_dup_up_: src {tuple(src.shape)} for x {tuple(x.shape)}")
    block_c, block_r, warps = _blocks(c)
    n_rows = b * t2 * h2 * w2
    _launch(_add_dup_up_kernel, (triton.cdiv(n_rows, block_r),),
        x, src, n_rows, t2, h2, w2, c, ft, fh, fw, x.stride(0), x.stride(2), x.stride(3), x.stride(4), x.stride(1),
        src.stride(0), src.stride(1), src.stride(2), src.stride(3), src.stride(4), src.stride(5), src.stride(6),
        src.stride(7), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return x


def norm_silu_cat(x: torch.Tensor, ctx: torch.Tensor, g: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The conv-input buffer alone (:func:`norm_silu_cat_keep` without a cache)."""
    return norm_silu_cat_keep(x, ctx, g, bias)[0]


def norm_silu_cat_keep(x: torch.Tensor, ctx: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None = None,
                       keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fast path's glue contract (``vdbench.vae.lean._norm_silu_cat``): a new conv-input buffer
    ``cat([ctx, silu(rms_norm(x (+ bias)) * g)], dim=2)`` in ``x``'s memory format, the norm over channels
    (dim 1); ``bias``: the bias of the conv that produced ``x``, when that conv ran without it.

    ``x``: (B, C, T, H, W), channels_last_3d (what the GPU fast path has: coalesced rows) or contiguous;
    ``ctx``: (B, C, P, H, W) causal context frames (any layout); ``g``: (C,) or broadcastable gain
    (gamma * sqrt(C)).

    ``keep`` (1 to T): also returns the last ``keep`` frames of the normalized part as a tensor of their own
    (the causal conv's cache for the next chunk), written by the same pass where the rows of ``x``, the buffer
    and the cache each form one strided dimension (channels_last_3d, or a batch of one), else cloned after it.
    Returns ``(buf, cache or None)``.
    """
    b, c, t, h, w = x.shape
    p = ctx.shape[2]
    if keep and not 0 < keep <= t:
        raise ValueError(f"norm_silu_cat_keep: keep={keep} of {t} frames")
    cl = x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d)
    fmt = torch.channels_last_3d if cl else torch.contiguous_format
    buf = torch.empty((b, c, p + t, h, w), dtype=x.dtype, device=x.device, memory_format=fmt)
    if p:
        buf[:, :, :p].copy_(ctx)
    pairs = list(_paired_rows(x, buf[:, :, p:], dim=1))  # one pair where the layouts allow: one launch
    cache = torch.empty((b, c, keep, h, w), dtype=x.dtype, device=x.device, memory_format=fmt) if keep else None
    tail = None if cache is None else _try_rows(cache, 1)
    if tail is not None and len(pairs) == 1:
        (xr, outr), = pairs
        rms_silu_rows(xr, g, outr, bias=bias, tail=(tail, t * h * w, keep * h * w))
        return buf, cache
    for xr, outr in pairs:
        rms_silu_rows(xr, g, outr, bias=bias)
    if cache is not None:
        cache.copy_(buf[:, :, p + t - keep:])
    return buf, cache
