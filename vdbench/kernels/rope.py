"""Wan's rotary embedding as one Triton kernel, bit for bit the eager expressions diffusers runs.

diffusers' ``WanAttnProcessor`` rotates Q and K with ``out[..., 0::2] = x1 * cos - x2 * sin`` and ``out[..., 1::2] =
x1 * sin + x2 * cos`` (``x1, x2``: the even and odd channels of ``x``; ``cos``/``sin``: fp32 frequencies repeated
per pair). Eagerly that is four products and two sums, each a pass of its own over strided views, materializing
fp32 intermediates twice the size of ``x``, then two strided casts into ``out``: on an H200 at Wan 1.3B 480p 99 ms
of a 1.11 s step (0.82 ms a call, 120 calls; bench/rope_bench.py), for work that reads ``x`` once and writes it
once (0.074 ms a call here).

This kernel reads each row of ``x`` (one token's head) and its token's frequencies once and writes the rotated row
once. The arithmetic is the eager one: each product rounded to fp32, then the difference or sum rounded to fp32
(no fused multiply-add: ``enable_fp_fusion=False``), then one round-to-nearest-even into ``out``'s dtype -- so the
result equals diffusers' bit for bit, and a render's frames don't change.

``x`` and ``out`` may be any strided views with the channels contiguous (``out`` can be a permuted send buffer:
the Ulysses exchange's layout); the frequencies are (B or 1, S, 1.., D), fp32. Like the other kernels, importing
this module decides whether Triton compiles or interprets (``TRITON_INTERPRET=1`` before the first import: CPU
tests).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from . import bits
from .ahead import compile_ahead, compiling_for, launch

__all__ = ["rope_pairs", "why_not_fused", "prewarm", "aot_specs", "INTERPRETED"]

#: Whether this module's kernel was decorated under Triton's interpreter (read once, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_round = triton.jit(bits.round_rne)  # fp32 -> out's dtype, to nearest even (bf16 by the bits)


@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, o_ptr, n_rows, S, G1, G2,
                 xs_b, xs_s, xs_g1, xs_g2, os_b, os_s, os_g1, os_g2, fs_b, fs_s,
                 D: tl.constexpr, BLOCK_R: tl.constexpr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # int32 index arithmetic; the offsets below in int64
    # rows in (B, S, G1, G2) order, the heads of one token adjacent: its frequencies are read from cache
    g2 = (rows % G2).to(tl.int64)
    t = rows // G2
    g1 = (t % G1).to(tl.int64)
    t = t // G1
    s = (t % S).to(tl.int64)
    b = (t // S).to(tl.int64)
    cols = tl.arange(0, D)
    mask = (rows < n_rows)[:, None]
    # whole rows, loaded and stored contiguously (vectorized), split into their (even, odd) pairs in registers
    x = tl.load(x_ptr + (b * xs_b + s * xs_s + g1 * xs_g1 + g2 * xs_g2)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    fo = (b * fs_b + s * fs_s)[:, None] + cols[None, :]
    cos = tl.load(c_ptr + fo, mask=mask, other=0.0)
    sin = tl.load(s_ptr + fo, mask=mask, other=0.0)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_R, D // 2, 2)))
    cos, _ = tl.split(tl.reshape(cos, (BLOCK_R, D // 2, 2)))  # cos[..., 0::2]
    _, sin = tl.split(tl.reshape(sin, (BLOCK_R, D // 2, 2)))  # sin[..., 1::2]
    a = x1 * cos
    bb = x2 * sin
    c = x1 * sin
    d = x2 * cos
    out = tl.reshape(tl.join(_round(a - bb, OUT_BF16, o_ptr.dtype.element_ty),
                             _round(c + d, OUT_BF16, o_ptr.dtype.element_ty)), (BLOCK_R, D))
    tl.store(o_ptr + (b * os_b + s * os_s + g1 * os_g1 + g2 * os_g2)[:, None] + cols[None, :], out, mask=mask)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _as4(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` (B, S, H, D) or (B, S, P, h, D) as a view (B, S, G1, G2, D): one head dimension gets G1 = 1; None for
    any other rank."""
    if t.dim() == 4:
        return t.unsqueeze(2)
    if t.dim() == 5:
        return t
    return None


def why_not_fused(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why :func:`rope_pairs` can't serve this call (None: it can): the eager expressions then run instead."""
    if x.device.type != "cuda" and not INTERPRETED and not (x.device.type == "meta" and compiling_for()):
        return f"{x.device.type} tensors (the kernel runs on CUDA)"
    if x.dtype not in _DTYPES or (out is not None and out.dtype != x.dtype):
        return f"dtype {x.dtype} -> {None if out is None else out.dtype}"
    if freqs_cos.dtype != torch.float32 or freqs_sin.dtype != torch.float32:
        return f"frequencies in {freqs_cos.dtype} (the kernel's arithmetic is fp32's)"
    d = x.shape[-1]
    if _as4(x) is None or d < 2 or d & (d - 1) or x.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        return (f"shape {tuple(x.shape)} / strides {x.stride()} (B, S, heads.., D a power of two, the channels "
                "contiguous)")
    for f in (freqs_cos, freqs_sin):
        if (f.dim() != x.dim() or f.shape[1] != x.shape[1] or f.shape[-1] != x.shape[-1] or f.stride(-1) != 1
                or f.shape[0] not in (1, x.shape[0]) or any(n != 1 for n in f.shape[2:-1])):
            return f"frequencies of shape {tuple(f.shape)} for x of {tuple(x.shape)}"
    if freqs_cos.stride()[:2] != freqs_sin.stride()[:2]:
        return "cos and sin laid out differently"
    return None


def rope_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Wan's RoPE of ``x`` (B, S, H, D) or (B, S, P, h, D) into ``out`` (same shape, any strides with the channels
    contiguous; a new tensor of ``x``'s dtype if None): ``out[..., 0::2] = x1 * cos - x2 * sin``, ``out[..., 1::2]
    = x1 * sin + x2 * cos``, diffusers' values bit for bit. Raises ValueError for a call :func:`why_not_fused`
    refuses."""
    why = why_not_fused(x, freqs_cos, freqs_sin, out)
    if why is not None:
        raise ValueError(f"rope_pairs: {why}")
    if out is None:
        out = torch.empty_like(x)
    if out.shape != x.shape:
        raise ValueError(f"rope_pairs: out {tuple(out.shape)} for x {tuple(x.shape)}")
    x5, o5 = _as4(x), _as4(out)
    b, s, g1, g2, d = x5.shape
    n = b * s * g1 * g2
    if n == 0:
        return out
    fb = freqs_cos.stride(0) if freqs_cos.shape[0] > 1 else 0
    block_r = max(1, 2048 // d)
    launch(_rope_kernel, (triton.cdiv(n, block_r),),
           x5, freqs_cos, freqs_sin, o5, n, s, g1, g2, *x5.stride()[:4], *o5.stride()[:4], fb, freqs_cos.stride(1),
           D=d, BLOCK_R=block_r, OUT_BF16=out.dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=False)
    return out


def prewarm(seq: int, heads: int, head_dim: int, dtype: torch.dtype, device, ulysses: int = 1) -> int:
    """Compile ahead, and load, the kernel's specialization for a render's self-attention calls (``seq`` tokens,
    ``heads`` x ``head_dim``), in the form vdbench's processors call it: on one GPU a contiguous ``x`` into a new
    tensor; at Ulysses degree ``ulysses`` a rank's ``seq / ulysses`` tokens into the exchange's send layout ((P, B,
    S_loc, h, D) written as (B, S_loc, P, h, D)). Meta tensors: no GPU work; the first real call finds the kernel in
    the JIT's cache (Triton's specialization key: the same dtypes, alignments and integer properties). Returns how
    many kernels it compiled or found."""
    meta = dict(device="meta", dtype=dtype)
    s, h = seq // ulysses, heads // ulysses
    x = torch.empty(1, s, heads * head_dim, **meta).unflatten(2, (heads, head_dim))
    freqs = torch.empty(1, s, 1, head_dim, device="meta", dtype=torch.float32)
    if ulysses == 1:
        form = (x, freqs, freqs, torch.empty_like(x))
    else:
        dst = torch.empty(ulysses, 1, s, h, head_dim, **meta).permute(1, 2, 0, 3, 4)
        form = (x.unflatten(2, (ulysses, h)), freqs.unsqueeze(2), freqs.unsqueeze(2), dst)
    return compile_ahead(device, lambda: rope_pairs(form[0], form[1], form[2], out=form[3]))


def aot_specs(d: int = 128, causal: bool = False, config: dict | None = None) -> dict:
    """label -> (jit function, pointer types by name (others: i32), constexprs by name, compile options): the bf16
    kernel at Wan's head dim 128, what ``vdbench.kernels.aot --helpers`` compiles."""
    ptrs = {"x_ptr": "*bf16", "c_ptr": "*fp32", "s_ptr": "*fp32", "o_ptr": "*bf16",
            **{k: "i64" for k in ("xs_b", "xs_s", "xs_g1", "xs_g2", "os_b", "os_s", "os_g1", "os_g2", "fs_b",
                                  "fs_s")}}
    return {"rope.bf16": (_rope_kernel, ptrs, dict(D=d, BLOCK_R=max(1, 2048 // d), OUT_BF16=True),
                          dict(num_warps=4, enable_fp_fusion=False))}
