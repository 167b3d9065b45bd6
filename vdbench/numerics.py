"""The numerics both sides of the registry share: exact attention, the quantizers, the quantized kernels' emulations.

Exact attention (fp64 by default, explicit softmax, chunked over queries) is the ground truth of every accuracy
figure. The quantizers (INT8 per block; fp8 e4m3 per tensor, per (batch, head) or per block) are the ones the real
kernels' wrappers feed them with, and the emulations reproduce each quantized kernel's arithmetic in pure torch on
any device, so its accuracy is tested on a CPU and compared with the real kernel on a GPU:

* ``sagev1_emulated``      SageAttention v1 (INT8 per-block Q/K, K smoothing, fp16 P·V);
* ``sagev2_emulated``      SageAttention 2 (INT8 Q/K per warp or per thread with K smoothing, fp8 P·V with a
                           per-channel V scale or fp16 P·V, each kernel's accumulation; docs/notes/sageattention2.md);
* ``fp8_emulated``         FA3 fp8 (e4m3 Q/K/V with ``fav3_fp8``'s per-(batch, head) scales, e4m3 P);
* ``fav3_sage_emulated``   the project's Triton ``fav3_sage`` (same blocks and rounding as its pre-pass);
* ``fp8_triton_emulated``  the project's Triton ``fp8_triton``.

The Triton kernels round P relative to the *running* row max of the online softmax, these emulations relative
to the final row max, so kernel and emulation agree closely but not bit for bit once a row spans several K tiles.
Emulations are slow by construction and never used to report speed.

Why one module below both the registry (``vdbench.backends``) and the kernels (``vdbench.kernels``): each side
needs the same quantizers and references, and neither may import the other's private helpers. This module
imports nothing of vdbench.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

__all__ = ["LOG2E", "FP8_E4M3_MAX", "P_SCALE", "SAGE_BLKQ", "SAGE_BLKK", "causal_mask", "query_chunk",
           "exact_attention", "reference_attention", "quantize_int8_per_block", "quantize_fp8", "fp8_descale",
           "smoothing_mean", "Fp8Inputs", "fp8_bh_inputs", "fp8_prepass_reads", "quantize_fp8_per_block",
           "sagev1_emulated", "fp8_emulated", "fav3_sage_emulated", "fp8_triton_emulated",
           "SageGeometry", "sage2_geometry", "SAGE2_EMULATED", "SAGE2_P_OFFSET", "SAGE2_LSE_LOG2E",
           "SAGE2_V_MAX_FP16_ACCUM", "qk_group_index", "quantize_int8_groups", "quantize_v_fp8", "e4m3_round",
           "fp22_truncate", "sagev2_emulated", "zero_v_channels", "zero_channels_"]

LOG2E = 1.4426950408889634
FP8_E4M3_MAX = 448.0
P_SCALE = 448.0  # the Triton kernels scale P by 448 before rounding it to e4m3 (P in [0, 1] would waste the range)
SAGE_BLKQ, SAGE_BLKK = 128, 64  # SageAttention v1's Q and K quantization blocks (tokens)


# ----------------------------------------------------------------------------------------------------------
# Exact references
# ----------------------------------------------------------------------------------------------------------

def causal_mask(sq: int, sk: int, device, q_offset=None) -> torch.Tensor:
    """Boolean (sq, sk) mask of the keys each query may see: query i sees keys j <= i + q_offset.

    ``q_offset`` None: bottom-right aligned (sk - sq), as FlashAttention; 0: top-left aligned, as SageAttention's
    kernels (and the rows of a slice starting at ``q_offset``). For sq == sk both conventions agree.
    """
    off = (sk - sq) if q_offset is None else q_offset
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + off


def query_chunk(q: torch.Tensor, sk: int, itemsize: int, budget_bytes: int = 512 << 20) -> int:
    """Queries per chunk so that one chunk's (B, H, chunk, sk) scores fit in ``budget_bytes``."""
    b, h = q.shape[0], q.shape[1]
    per_row = max(1, b * h * sk * itemsize)
    return max(1, min(q.shape[2], budget_bytes // per_row))


def exact_attention(q, k, v, *, scale=None, is_causal=False, attn_mask=None, dtype=torch.float64,
                    return_lse=False, q_offset=None):
    """Softmax attention computed explicitly in ``dtype`` (default fp64), chunked over queries.

    The ground truth for accuracy figures: no fused kernel, no online softmax, no reduced precision.
    Chunking bounds memory at about 512 MiB of scores whatever the sequence length. ``q_offset``: the causal
    alignment (``causal_mask``); ``return_lse``: also the natural-log logsumexp of the scaled scores.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    if kd.shape[1] != qd.shape[1]:  # grouped-query attention: repeat K/V heads
        rep = qd.shape[1] // kd.shape[1]
        kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    sq, sk = qd.shape[2], kd.shape[2]
    out = torch.empty(qd.shape[:-1] + (vd.shape[-1],), dtype=dtype, device=q.device)
    lse = torch.empty(qd.shape[:-1], dtype=dtype, device=q.device) if return_lse else None
    step = query_chunk(qd, sk, torch.finfo(dtype).bits // 8)
    kt = kd.transpose(-1, -2)
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        s = torch.matmul(qd[:, :, s0:s1], kt) * scale
        if is_causal:
            s = s.masked_fill(~causal_mask(sq, sk, q.device, q_offset)[s0:s1], float("-inf"))
        if attn_mask is not None:
            m = attn_mask[..., s0:s1, :] if attn_mask.shape[-2] == sq else attn_mask
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(dtype)
        if return_lse:
            lse[:, :, s0:s1] = torch.logsumexp(s, dim=-1)
        out[:, :, s0:s1] = torch.matmul(torch.softmax(s, dim=-1), vd)
    return (out, lse) if return_lse else out


def reference_attention(q, k, v, *, scale=None, is_causal=False):
    """The ``reference`` backend: exact fp32 math-softmax attention, output cast back to q's dtype."""
    return exact_attention(q, k, v, scale=scale, is_causal=is_causal, dtype=torch.float32).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Quantizers (shared by the real kernels' wrappers, the emulations and the Triton pre-pass tests)
# ----------------------------------------------------------------------------------------------------------

def quantize_int8_per_block(x: torch.Tensor, block: int, pre_scale: float = 1.0):
    """SageAttention v1's per-block INT8 quantization of a (B, H, S, D) tensor.

    One scale per ``block`` consecutive tokens per head: scale = max|x·pre_scale| / 127, values rounded
    half away from zero (as the Triton kernel does: ``x/scale + 0.5·sign`` then truncation).
    Returns (int-valued float32 tensor of the padded length, scales of shape (B, H, n_blocks, 1)).
    """
    b, h, s, d = x.shape
    xs = x.float() * pre_scale
    pad = (-s) % block
    if pad:
        xs = F.pad(xs, (0, 0, 0, pad))
    xb = xs.view(b, h, -1, block, d)
    scale = xb.abs().amax(dim=(-1, -2)) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    qv = xb / safe[..., None, None]
    qv = torch.trunc(qv + 0.5 * torch.sign(qv)).clamp_(-127, 127)
    return qv.view(b, h, -1, d), scale[..., None]


def quantize_fp8(x: torch.Tensor, granularity: str = "bh", block: int = 128):
    """Quantize a (B, H, S, D) tensor to fp8 e4m3 with scales as FA3's fp8 path takes them.

    ``granularity``: ``"tensor"`` (one scale), ``"bh"`` (one per batch and head: the shape of FA3's
    ``q_descale``/``k_descale``/``v_descale``, (B, H)) or ``"block"`` (one per ``block`` tokens per head,
    finer than FA3 can take; used by the emulation to show what finer scales buy).
    Returns (e4m3 tensor, descale broadcastable to x, the descale in FA3's (B, H) shape or None).
    """
    xf = x.float()
    b, h, s, d = x.shape
    if granularity == "tensor":
        amax = xf.abs().amax().reshape(1, 1, 1, 1)
    elif granularity == "bh":
        amax = xf.abs().amax(dim=(-1, -2), keepdim=True)
    elif granularity == "block":
        pad = (-s) % block
        xp = F.pad(xf, (0, 0, 0, pad)) if pad else xf
        amax = xp.view(b, h, -1, block, d).abs().amax(dim=(-1, -2), keepdim=True)
        amax = amax.expand(b, h, xp.shape[2] // block, block, 1).reshape(b, h, -1, 1)[:, :, :s]
    else:
        raise ValueError(f"unknown fp8 scale granularity {granularity!r} (tensor, bh, block)")
    descale = fp8_descale(amax)
    x8 = (xf / descale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    fa3_descale = None
    if granularity in ("tensor", "bh"):
        fa3_descale = descale.reshape(descale.shape[0], descale.shape[1]).expand(b, h).contiguous()
    return x8, descale, fa3_descale


def fp8_descale(amax: torch.Tensor) -> torch.Tensor:
    """e4m3 descale from an amax: amax / 448, and 1 where the amax is 0 (an all-zero tensor quantizes to zeros).
    One function, so every path that quantizes per (batch, head) -- eager or Triton -- gets bit-equal scales."""
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


def smoothing_mean(k: torch.Tensor) -> torch.Tensor:
    """K's mean over the sequence, (B, H, 1, D) fp32: K smoothing subtracts it (softmax is shift-invariant per
    query row, so exact attention is unchanged; only the log-sum-exp moves, by q·mean·scale). One function, so the
    eager and the Triton pre-pass subtract the same fp32 mean."""
    return k.mean(dim=2, keepdim=True, dtype=torch.float32)


class Fp8Inputs(NamedTuple):
    """FA3 fp8's operands: e4m3 Q, K, V (the inputs' shapes and memory layout), their descales in FA3's (B, H)
    shape (fp32, contiguous), and the K mean that was subtracted ((B, H, 1, D) fp32), or None without smoothing."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    k_mean: Optional[torch.Tensor]
    #: Q8·K8ᵀ over-counts Q·Kᵀ by this factor (the ±1 Hadamard rotation's n, :func:`rotate_qk`): the kernel's softmax
    #: scale is divided by it.
    qk_gain: float = 1.0
    #: V's mean over the sequence ((B, H, 1, D) fp32) subtracted before quantizing, or None: softmax rows sum to 1,
    #: so the caller adds it back to the kernel's output.
    v_mean: Optional[torch.Tensor] = None


@functools.lru_cache(maxsize=None)
def hadamard_signs(d: int) -> tuple[torch.Tensor, int]:
    """(S, n): the d×d matrix of ±1 with S·Sᵀ = n·I -- Sylvester's Hadamard matrix of order n, the largest power of
    two dividing d, repeated on the diagonal (d = 96: three of order 32). ±1 is exact in every float format, so a
    rotation by S in bf16 stays orthogonal up to the product's rounding (a bf16 1/√n would scale Q·Kᵀ by up to
    0.4%); the 1/n goes into the softmax scale. Cached: treat the matrix as read-only."""
    n = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h] * (d // n)), n


def rotate_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(Q·S, K·S, n) for :func:`hadamard_signs` of the head dimension: Q·Kᵀ times n, each outlier channel spread over
    n channels before a coarse quantization (FlashAttention-3's incoherent processing). In the inputs' dtype, the
    product accumulated in fp32 by the matmul, as on the GPU."""
    n = hadamard_signs(q.shape[-1])[1]
    return (torch.matmul(q, _signs_on(q.shape[-1], q.device, q.dtype)),
            torch.matmul(k, _signs_on(k.shape[-1], k.device, k.dtype)), n)


@functools.lru_cache(maxsize=None)
def _signs_on(d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`hadamard_signs`'s matrix on ``device`` in ``dtype``, made once: the rotation runs on every attention
    call, and a host-to-device copy per call would stall the host's run-ahead."""
    return hadamard_signs(d)[0].to(device=device, dtype=dtype)


def fp8_bh_inputs(q, k, v, *, smooth_k: bool = False, rotate: bool = False, smooth_v: bool = False) -> Fp8Inputs:
    """``fav3_fp8``'s quantization, eagerly: one e4m3 scale per (batch, head) of each of Q, K, V (the finest FA3's
    descale arguments take), K smoothed first when ``smooth_k``. The Triton pre-pass
    (``vdbench.kernels.fa3_prepass``) computes exactly this -- bit-equal values and scales -- in two reads.
    ``rotate``: Q and K rotated first (:func:`rotate_qk`; ``qk_gain`` says by how much Q8·K8ᵀ over-counts; the
    K mean stays in the unrotated coordinates, where the caller's Q is). ``smooth_v``: V's mean over the sequence
    subtracted first (``v_mean``; the caller adds it to the output): what P·V accumulates is then centred on 0,
    where a channel with a large mean would otherwise grow the accumulator and lose the small terms' low bits."""
    if rotate:
        return rotated_fp8_inputs(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v, quantize=fp8_bh_inputs)
    km = smoothing_mean(k) if smooth_k else None
    vm = smoothing_mean(v) if smooth_v else None
    q8, _, qd = quantize_fp8(q, "bh")
    k8, _, kd = quantize_fp8(k.float() - km if smooth_k else k, "bh")
    v8, _, vd = quantize_fp8(v.float() - vm if smooth_v else v, "bh")
    return Fp8Inputs(q8, k8, v8, qd, kd, vd, km, v_mean=vm)


def fp8_prepass_reads(*, smooth_k: bool = False, rotate: bool = False,
                      smooth_v: bool = False) -> tuple[int, int, int]:
    """How many times :func:`fp8_bh_inputs`' pre-pass reads Q, K and V (the bytes model of ``fav3_fp8`` and its
    emulation): twice each (the amax, then the quantization), once more for a smoothed tensor's mean, and Q and K
    twice more when rotated (the rotation reads and writes each once at the input's width)."""
    extra = 2 if rotate else 0
    return 2 + extra, (3 if smooth_k else 2) + extra, 3 if smooth_v else 2


def rotated_fp8_inputs(q, k, v, *, smooth_k: bool, quantize, smooth_v: bool = False) -> Fp8Inputs:
    """``quantize(Q·S, K·S, V, smooth_k=..., smooth_v=...)`` (an fp8 pre-pass: eager or Triton) of the rotated Q and
    K, with its ``qk_gain`` set to the rotation's n and the K mean it subtracted taken back to the unrotated
    coordinates (the log-sum-exp correction adds q·mean with the caller's Q)."""
    qr, kr, n = rotate_qk(q, k)
    x = quantize(qr, kr, v, smooth_k=smooth_k, smooth_v=smooth_v)
    km = x.k_mean
    if km is not None:  # mean(K·S) = mean(K)·S, and S⁻¹ = Sᵀ / n
        km = torch.matmul(km, _signs_on(q.shape[-1], km.device, km.dtype).T) / n
    return x._replace(k_mean=km, qk_gain=float(n))


def quantize_fp8_per_block(x: torch.Tensor, block: int, pre_scale: float = 1.0):
    """e4m3 per ``block`` tokens per head, as the Triton pre-pass does (``kernels.quant.quant_blocks(fp8=True)``).

    Returns (the e4m3 values as fp32, (B, H, S, D); the scales, (B, H, n_blocks)).
    """
    b, h, s, d = x.shape
    xs = x.float() * pre_scale
    pad = (-s) % block
    xp = F.pad(xs, (0, 0, 0, pad)) if pad else xs
    xb = xp.view(b, h, -1, block, d)
    scale = xb.abs().amax(dim=(-1, -2)) / FP8_E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = (xb / safe[..., None, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    return q8.view(b, h, -1, d)[:, :, :s], scale


# ----------------------------------------------------------------------------------------------------------
# Emulations (pure torch, any device)
# ----------------------------------------------------------------------------------------------------------

def sagev1_emulated(q, k, v, *, scale=None, is_causal=False, smooth_k=True):
    """SageAttention v1 numerics in pure torch.

    K is mean-smoothed over the sequence (softmax is invariant to it), Q (pre-multiplied by
    scale·log2 e) and K are quantized to INT8 per block of 128 / 64 tokens, S = Q8·K8ᵀ is exact integer
    arithmetic times the two scales, the softmax uses exp2, and P·V takes P and V rounded to fp16 with an
    fp32 accumulator — the operand precisions of the Triton kernel. Chunked over query blocks.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kf = k.float()
    if smooth_k:
        kf = kf - kf.mean(dim=2, keepdim=True)
    sq, sk = q.shape[2], k.shape[2]
    q8, qs = quantize_int8_per_block(q, SAGE_BLKQ, pre_scale=scale * LOG2E)
    k8, ks = quantize_int8_per_block(kf, SAGE_BLKK)
    k8, ks = k8[:, :, :sk], ks.repeat_interleave(SAGE_BLKK, dim=2)[:, :, :sk, 0]  # per-key scale
    vh = v.to(torch.float16).float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    step = max(SAGE_BLKQ, query_chunk(q, sk, 4) // SAGE_BLKQ * SAGE_BLKQ)
    k8t = k8.transpose(-1, -2)
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        qblk = q8[:, :, s0:s1]
        qsc = qs.repeat_interleave(SAGE_BLKQ, dim=2)[:, :, s0:s1]  # (B,H,n,1)
        s = torch.matmul(qblk, k8t) * qsc * ks[:, :, None, :]  # log2-domain scores
        if is_causal:
            s = s.masked_fill(~causal_mask(sq, sk, q.device)[s0:s1], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp2(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        out[:, :, s0:s1] = torch.matmul(p.to(torch.float16).float(), vh) / denom
    return out.to(q.dtype)


def fp8_emulated(q, k, v, *, scale=None, is_causal=False, granularity="bh", smooth_k=False, rotate=False,
                 smooth_v=False):
    """FA3 fp8 numerics in pure torch: e4m3 Q, K, V with the same scales ``fav3_fp8`` passes to FA3.

    S = Q8·K8ᵀ · q_descale · k_descale · scale in fp32; P = exp(S - max) in fp32, its row sum taken in
    fp32, then P rounded to e4m3 for the P·V product (as the FA3 fp8 kernel feeds P to its fp8 wgmma);
    O = (P8·V8) · v_descale / rowsum. ``smooth_k``: K's mean subtracted before quantizing (``fav3_fp8:smooth_k=1``);
    ``rotate``: Q and K rotated by :func:`rotate_qk` first, the softmax scale divided by its n
    (``fav3_fp8:rotate=hadamard``); ``smooth_v``: V's mean subtracted before quantizing and added to the output
    (``fav3_fp8:smooth_v=1``). The products are summed exactly here: what Hopper's fp8 tensor-core accumulator
    loses over a long key loop (the kernel's error on inputs whose V has a large mean) is not emulated.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    vm = smoothing_mean(v) if smooth_v else None
    if smooth_v:
        v = v.float() - vm
    if rotate:  # as the backend: rotated in the inputs' dtype, then smoothed and quantized
        q, k, n = rotate_qk(q, k)
        scale = scale / n
    if smooth_k:
        k = k.float() - smoothing_mean(k)
    q8, qd, _ = quantize_fp8(q, granularity)
    k8, kd, _ = quantize_fp8(k, granularity)
    v8, vd, _ = quantize_fp8(v, granularity)
    qf, kf, vf = q8.float() * qd, k8.float() * kd, v8.float()
    sq, sk = q.shape[2], k.shape[2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    step = query_chunk(q, sk, 4)
    kt = kf.transpose(-1, -2)
    v_descale = vd if vd.shape[2] == 1 else None
    if v_descale is None:  # per-block V scales: fold them into V (what a per-block kernel does per tile)
        vf = vf * vd
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        s = torch.matmul(qf[:, :, s0:s1], kt) * scale
        if is_causal:
            s = s.masked_fill(~causal_mask(sq, sk, q.device)[s0:s1], float("-inf"))
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(p.to(torch.float8_e4m3fn).float(), vf)
        if v_descale is not None:
            o = o * v_descale
        out[:, :, s0:s1] = o / denom
    if vm is not None:
        out += vm
    return out.to(q.dtype)


def _rep(scale_blocks: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """(B, H, n_blocks) -> (B, H, n) per-token scale."""
    return scale_blocks.repeat_interleave(block, dim=2)[:, :, :n]


def _softmax_pv(s, v_f, v_scale_tok, v_scale_ch, pv, is_causal, sq, sk, device):
    """exp2 softmax of log2-domain scores ``s`` times V, with P·V at the precision ``pv`` names (fp8: P×448 and V
    in e4m3, V's per-token or per-channel scale applied; fp16; exact)."""
    if is_causal:
        s = s.masked_fill(~causal_mask(sq, sk, device), float("-inf"))
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    if pv == "fp8":
        p8 = (p * P_SCALE).to(torch.float8_e4m3fn).float()
        vv = v_f if v_scale_tok is None else v_f * v_scale_tok[..., None]
        o = torch.matmul(p8, vv) / P_SCALE
        if v_scale_ch is not None:
            o = o * v_scale_ch[:, :, None, :]
    elif pv == "fp16":
        o = torch.matmul(p.half().float(), v_f)
    else:  # exact P
        o = torch.matmul(p, v_f)
    return o / denom


def fav3_sage_emulated(q, k, v, *, scale=None, is_causal=False, block_m=128, block_n=64, pv="fp8"):
    """fav3_sage's numerics: INT8 per-block Q (×scale·log2 e) and smoothed K, exp2 softmax, e4m3 P×448 and
    e4m3 V with a per-channel scale (``pv="fp8"``), or fp16 P and V (``pv="fp16"``). Not chunked: small inputs."""
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    sq, sk = q.shape[2], k.shape[2]
    kf = k.float() - k.float().mean(dim=2, keepdim=True)
    q8, qs = quantize_int8_per_block(q, block_m, pre_scale=sm * LOG2E)
    k8, ks = quantize_int8_per_block(kf, block_n)
    s = torch.matmul(q8[:, :, :sq], k8[:, :, :sk].transpose(-1, -2))
    s = s * _rep(qs[..., 0], block_m, sq)[..., None] * _rep(ks[..., 0], block_n, sk)[:, :, None, :]
    if pv == "fp8":
        vc = v.float().abs().amax(dim=2) / FP8_E4M3_MAX
        vc = torch.where(vc > 0, vc, torch.ones_like(vc))
        v8 = (v.float() / vc[:, :, None, :]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
        o = _softmax_pv(s, v8, None, vc, "fp8", is_causal, sq, sk, q.device)
    else:
        o = _softmax_pv(s, v.half().float(), None, None, "fp16", is_causal, sq, sk, q.device)
    return o.to(q.dtype)


def fp8_triton_emulated(q, k, v, *, scale=None, is_causal=False, block_m=128, block_n=128, smooth_k=True,
                        pv="fp8"):
    """fp8_triton's numerics: e4m3 Q (×scale·log2 e), smoothed K and V, one scale per tile of tokens; e4m3 P×448.
    ``pv="exact"`` keeps P and V unrounded (to split the error between Q·K and P·V)."""
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    sq, sk = q.shape[2], k.shape[2]
    kf = k.float() - k.float().mean(dim=2, keepdim=True) if smooth_k else k.float()
    q8, qs = quantize_fp8_per_block(q, block_m, pre_scale=sm * LOG2E)
    k8, ks = quantize_fp8_per_block(kf, block_n)
    s = torch.matmul(q8, k8.transpose(-1, -2)) * _rep(qs, block_m, sq)[..., None] * _rep(ks, block_n, sk)[:, :, None, :]
    if pv == "fp8":
        v8, vs = quantize_fp8_per_block(v, block_n)
        o = _softmax_pv(s, v8, _rep(vs, block_n, sk), None, "fp8", is_causal, sq, sk, q.device)
    else:
        o = _softmax_pv(s, v.float(), None, None, "exact", is_causal, sq, sk, q.device)
    return o.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# SageAttention 2 (the sageattention package >= 2.0): its numerics step by step
# ----------------------------------------------------------------------------------------------------------
# Why: SageAttention 2 runs only on CUDA GPUs after a from-source build, yet what users trade for its speed is its
# accuracy -- what INT8 Q·Kᵀ with K smoothing and an fp8 (e4m3) P·V with a per-channel V scale do to an attention
# output. Reproducing that arithmetic in torch tests it on a CPU, renders a pipeline with SageAttention 2's error on
# any device (``sagev2_emu``), and tells the algorithm's error from a kernel bug on the GPU (on an H200 the
# emulation's rel L2 is within 0.05% of every kernel's at the three video shapes). Where each step comes from
# (thu-ml/SageAttention 2.2.0) is written up in docs/notes/sageattention2.md; in short, per kernel
# (``sage2_geometry``):
#
# 1. K smoothing: ``km = mean_seq(K)`` in the input dtype; K - km is what gets quantized.
# 2. Q and K to INT8 with one fp32 scale per row group -- per warp (contiguous rows) or per thread (the rows an MMA
#    fragment thread holds: Q row r -> group r mod 8 inside its warp's rows, K row r -> (r mod 8) div 2 inside its
#    block) -- with the rounding rule of the quantizer the kernel uses.
# 3. Base-2 scores ``s = (Q_int·K_intᵀ) * q_scale * k_scale * sm_scale * log2(e)``, exact integer dot products.
# 4. Online softmax over blocks of ``block_kv`` keys: the running max per block; for fp8 P·V the max is lowered by
#    log2(448) so that P = exp2(s - m) fills e4m3's range, then P is rounded to e4m3 (or to fp16 for fp16 P·V).
# 5. P·V with the kernel's accumulation: an fp16 accumulator rounded after every MMA k-step and flushed into fp32
#    every block ("fp32+fp16", "fp16+fp32"), or fp32 ("fp32", "fp32+fp32"; with ``mma_acc="fp22"`` the fp8 MMA
#    accumulator keeps 13 mantissa bits, the SageAttention 2 paper's account, which the H200 does not show).
# 6. ``O = num / den`` (the denominator sums unrounded P for the fp8 kernels and the Triton one, rounded P for the
#    sm80 fp16 kernel), times the per-channel V scale, rounded to the input dtype.
# 7. LSE in the library's convention: natural log of sum exp(scale·q·k), i.e. ``(log2(den) + m) / 1.44269504`` plus
#    the smoothing correction ``(q @ kmᵀ) * scale`` computed, like the library does, in the input dtype.
#
# Chunked over query rows (``chunk_bytes`` bounds the temporaries): it runs at the real video shapes on a GPU
# without O(S²) memory. Slow by construction, never used to report speed.

SAGE2_LSE_LOG2E = 1.44269504  # what sageattention's core.py divides the base-2 LSE by (its Triton quantizer x by)
SAGE2_P_OFFSET = 8.807  # S_FP8_OFFSET: log2(448), P = exp2(s - (max - 8.807)) lies in (0, 448]
SAGE2_V_MAX_FP16_ACCUM = 2.25  # V's fp8 range with an fp16 accumulator: 448 * 2.25 * 64 keys < 65504
_FP22_MASK = -(1 << 10)  # clears the low 10 of fp32's 23 mantissa bits, keeping FP22's 13


@dataclass(frozen=True)
class SageGeometry:
    """The block sizes of one SageAttention 2 kernel: they decide which rows share a scale and where P·V rounds.

    kernel: the public function whose kernel these numbers describe.
    warp_q: rows of Q sharing a per-warp scale (per-thread splits each such block 8 ways by row mod 8).
    block_k: rows of K sharing a per-warp/per-block scale (per-thread splits each 4 ways by (row mod 8) div 2).
    block_kv: keys per online-softmax step (one max update; where a partial P·V is added to the fp32 buffer).
    mma_k: keys per MMA instruction, i.e. how often the low-precision accumulator rounds.
    p_fp8: P is scaled to (0, 448] and rounded to e4m3 (else P in (0, 1] is rounded to fp16).
    den_rounded_p: the softmax denominator sums the rounded P (tensor-core row sum) rather than fp32 P.
    """

    kernel: str
    warp_q: int
    block_k: int
    block_kv: int
    mma_k: int
    p_fp8: bool
    den_rounded_p: bool


# (pv, arch, qk_gran family) -> the pv_accum modes the emulation reproduces, the first being the kernel's default.
SAGE2_EMULATED = {
    ("fp8", "sm90"): ("fp32+fp32",),
    ("fp8", "sm89"): ("fp32+fp16", "fp32+fp32", "fp32"),
    ("fp16", "sm80"): ("fp32", "fp16+fp32"),
    ("fp16", "triton"): ("fp16+fp32",),
}


def sage2_geometry(pv: str, arch: str, pv_accum: str, head_dim: int) -> SageGeometry:
    """The block sizes of the kernel that ``(pv, arch, pv_accum)`` names (see docs/notes/sageattention2.md)."""
    if pv == "fp8" and arch == "sm90":
        return SageGeometry("sageattn_qk_int8_pv_fp8_cuda_sm90", 16, 128, 128, 32, True, False)
    if pv == "fp8" and arch == "sm89":
        return SageGeometry("sageattn_qk_int8_pv_fp8_cuda", 32, 64, 64, 32, True, False)
    if pv == "fp16" and arch == "sm80":
        # the sm80 launcher uses 16-row warps for "fp16+fp32" at (padded) head dim 128
        padded = 64 if head_dim <= 64 else 128
        warp_q = 16 if (padded == 128 and pv_accum == "fp16+fp32") else 32
        return SageGeometry("sageattn_qk_int8_pv_fp16_cuda", warp_q, 64, 64, 16, False, True)
    if pv == "fp16" and arch == "triton":
        return SageGeometry("sageattn_qk_int8_pv_fp16_triton", 128, 64, 64, 16, False, False)
    raise ValueError(f"no SageAttention 2 kernel with pv={pv!r} on arch={arch!r}")


def qk_group_index(n: int, gran: str, rows: int, which: str, device=None) -> torch.Tensor:
    """Scale-group id of each of ``n`` rows of Q (``which="q"``) or K (``"k"``).

    per_warp / per_block: contiguous blocks of ``rows``. per_thread: inside each block of ``rows``, Q row r is in
    group r mod 8 and K row r in group (r mod 8) div 2 -- the rows one thread of the MMA fragment holds, which is
    why these groups interleave instead of being contiguous.
    """
    r = torch.arange(n, device=device)
    if gran in ("per_warp", "per_block"):
        return r // rows
    if gran != "per_thread":
        raise ValueError(f"unknown quantization granularity {gran!r}")
    if which == "q":
        return (r // rows) * 8 + r % 8
    return (r // rows) * 4 + (r % 8) // 2


def quantize_int8_groups(x: torch.Tensor, group: torch.Tensor, rule: str):
    """INT8 values (as fp32 integers) and the per-row fp32 scale of ``x`` (..., S, D), one scale per group.

    ``rule`` is the upstream quantizer's: "cuda" (_fused.QuantInt8Kernel: amax floored at 1e-7, scale = amax/127,
    x·(127/amax) rounded half to even, saturated), "triton_thread" (quant_per_thread.py: scale = amax/127 + 1e-7,
    x/scale rounded half away from zero) or "triton_block" (quant_per_block.py: scale = amax/127, same rounding;
    an all-zero group, undefined upstream, quantizes to 0 here).
    """
    x = x.float()
    row_amax = x.abs().amax(dim=-1)
    n_groups = int(group.max().item()) + 1 if group.numel() else 0
    idx = group.expand_as(row_amax)
    amax = row_amax.new_zeros(row_amax.shape[:-1] + (n_groups,)).scatter_reduce(
        -1, idx, row_amax, reduce="amax", include_self=True)
    amax_row = amax.gather(-1, idx)
    if rule == "cuda":
        amax_row = amax_row.clamp_min(1e-7)
        scale = amax_row / 127.0
        xi = torch.round(x * (127.0 / amax_row).unsqueeze(-1)).clamp(-128, 127)
        return xi, scale
    if rule == "triton_thread":
        scale = amax_row / 127.0 + 1e-7
    elif rule == "triton_block":
        scale = amax_row / 127.0
    else:
        raise ValueError(f"unknown quantizer rule {rule!r}")
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    y = torch.where(scale.unsqueeze(-1) > 0, x / safe, torch.zeros_like(x))
    xi = torch.trunc(y + 0.5 * torch.where(y >= 0, 1.0, -1.0)).clamp(-128, 127)
    return xi, scale


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 (round to nearest even, saturating like cvt.rn.satfinite) -> fp32."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


def fp22_truncate(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded toward zero to 13 mantissa bits: the paper's FP22 fp8-MMA accumulator (``mma_acc="fp22"``).

    The SageAttention 2 paper reports 1 sign, 8 exponent and 13 mantissa bits (measured on Ada); truncation rather
    than rounding is our assumption. On an H200 neither shows: see ``sagev2_emulated``'s ``mma_acc``.
    """
    return (x.float().contiguous().view(torch.int32) & _FP22_MASK).view(torch.float32)


def zero_v_channels(v: torch.Tensor) -> torch.Tensor:
    """(B, H, D) bool: the channels of V (B, H, S, D) that are exactly 0 over the whole sequence -- those an fp8 P·V
    kernel with a per-channel V scale turns into NaN (``quantize_v_fp8``). One read of V, no temporary of its size."""
    return torch.linalg.vector_norm(v, ord=float("inf"), dim=2) == 0


def zero_channels_(out: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``out[b, h, :, c] = 0`` where ``flags[b, h // (H // Hf), c]`` (``flags`` (B, Hf, D), Hf the K/V heads): the
    exact output of a zero V channel, in place. Eager form of ``vdbench.kernels.channels.zero_channels_``."""
    rep = out.shape[1] // flags.shape[1]
    f = flags.repeat_interleave(rep, dim=1) if rep > 1 else flags
    return out.masked_fill_(f[:, :, None, :], 0)


def quantize_v_fp8(v: torch.Tensor, scale_max: float = FP8_E4M3_MAX):
    """V (..., S, D) to e4m3 with one scale per channel over the whole sequence (per_channel_fp8).

    Returns (V8 as fp32, v_scale (..., D)). A channel that is exactly 0 everywhere gets scale 0 and NaN values, as
    upstream's 0·inf does (the NaN stays in that output channel).
    """
    vf = v.float()
    amax = vf.abs().amax(dim=-2)
    v8 = e4m3_round(vf * (scale_max / amax).unsqueeze(-2))
    return v8, amax / scale_max


def _round_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _pv_numerators(pq, vq, g: SageGeometry, pv_accum: str, m: torch.Tensor, mma_acc: str):
    """Sum of rounded P times rounded V with the kernel's accumulation, relative to the last running max.

    pq: (R, nb, block_kv) rounded P; vq: (nb*block_kv, D) rounded V; m: (R, nb) running max after each block.
    Returns (R, D).
    """
    rows, nb, bkv = pq.shape
    d = vq.shape[-1]
    w = torch.exp2(m - m[:, -1:])  # what the block-by-block rescaling of the fp32 buffer multiplies each block by
    if pv_accum in ("fp32", "fp32+fp32") and (not g.p_fp8 or mma_acc == "fp32"):
        # an fp32 MMA accumulator (fp16 MMAs; fp8 MMAs as measured on H200): a plain fp32 product per block, and
        # whether it is flushed into a separate fp32 buffer every block changes nothing
        blocks = torch.bmm(pq.transpose(0, 1), vq.view(nb, bkv, d))  # (nb, R, D)
        return torch.einsum("rb,brd->rd", w, blocks)
    steps = bkv // g.mma_k
    chunks = torch.bmm(pq.reshape(rows, nb * steps, g.mma_k).transpose(0, 1),
                       vq.view(nb * steps, g.mma_k, d))  # (nb*steps, R, D): one MMA k-step each, exact-ish fp32
    chunks = chunks.view(nb, steps, rows, d)
    if pv_accum == "fp32":
        # fp8 on sm89 without the fp32 buffer: FP22 rounding at every step, fp32 rescale between blocks
        acc = torch.zeros(rows, d, dtype=torch.float32, device=pq.device)
        m_prev = m[:, :1]
        for b in range(nb):
            acc = acc * torch.exp2(m_prev - m[:, b:b + 1])
            m_prev = m[:, b:b + 1]
            for s in range(steps):
                acc = fp22_truncate(acc + chunks[b, s])
        return acc
    rnd = fp22_truncate if pv_accum == "fp32+fp32" else _round_fp16
    acc = rnd(chunks[:, 0])
    for s in range(1, steps):
        acc = rnd(acc + chunks[:, s])
    return torch.einsum("rb,brd->rd", w, acc)


def _check_args(q, k, v, qk_gran, pv, arch, pv_accum, mma_acc):
    if mma_acc not in ("fp32", "fp22"):
        raise ValueError(f"mma_acc must be 'fp32' or 'fp22', got {mma_acc!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, heads, seq, head_dim)")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > 128 or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"SageAttention 2 supports one head_dim <= 128 for q, k, v; got "
                         f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"incompatible shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if k.shape[2] == 0:
        raise ValueError("kv_len must be at least 1")
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    if qk_gran not in ("per_warp", "per_thread", "per_block"):
        raise ValueError(f"qk_gran must be 'per_warp', 'per_thread' or 'per_block', got {qk_gran!r}")
    if qk_gran == "per_block" and pv != "fp16":
        raise ValueError("qk_gran='per_block' is the Triton kernel's (sageattn_qk_int8_pv_fp16_triton): pv='fp16'")
    family = "triton" if qk_gran == "per_block" else arch
    modes = SAGE2_EMULATED.get((pv, family))
    if modes is None:
        valid = sorted({a for p, a in SAGE2_EMULATED if p == pv and a != "triton"})
        raise ValueError(f"pv={pv!r} has no kernel for arch={arch!r}; emulated: {valid}")
    pv_accum = modes[0] if pv_accum is None else pv_accum
    if pv_accum not in modes:
        raise ValueError(f"pv_accum={pv_accum!r} is not emulated for pv={pv!r} on {family}; emulated: {list(modes)}")
    return family, pv_accum


def sagev2_emulated(q, k, v, *, scale: Optional[float] = None, is_causal: bool = False,
                    qk_gran: str = "per_thread", pv: str = "fp8", arch: Optional[str] = None,
                    pv_accum: Optional[str] = None, smooth_k: bool = True, return_lse: bool = False,
                    mma_acc: str = "fp32", q_offset: int = 0, chunk_bytes: int = 512 << 20):
    """SageAttention 2 attention computed with the kernel's numerics; q, k, v and the output are (B, H, S, D).

    qk_gran: "per_thread" (the library's default), "per_warp", or "per_block" (the Triton fp16 kernel).
    pv: "fp8" (e4m3 P·V, the sm89/sm90 kernels) or "fp16" (the sm80 CUDA kernel, or Triton with per_block).
    arch: which fp8 kernel -- "sm90" (default; what sageattn runs on H100/H200) or "sm89" (also what sm120
        runs); for pv="fp16" always "sm80" (or Triton when qk_gran="per_block").
    pv_accum: the upstream ``pv_accum_dtype``; None is the kernel's default ("fp32+fp32" sm90, "fp32+fp16"
        sm89, "fp32" sm80, "fp16+fp32" Triton). Not emulated: "fp16" (fp16 throughout) and smooth_v.
    is_causal: top-left aligned like the kernels (query i sees keys j <= i + q_offset).
    return_lse: also return the fp32 (B, H, Sq) natural-log logsumexp of scale·q·kᵀ in the library's convention
        (base-2 kernel LSE / 1.44269504 plus the smoothing correction (q @ kmᵀ)·scale in the input dtype).
    mma_acc: the fp8 MMA's accumulator. "fp32" (default) is what an H200 shows: its sm89 kernel without the fp32
        buffer (pv_accum "fp32") has the same error as with it, to 1e-6 at the three video shapes. "fp22" is the
        SageAttention 2 paper's account (13 mantissa bits; modelled as truncation after every 32-key MMA step), which
        on the H200 overstates the "fp32" mode's error by 6-20%; kept for GPUs where it may hold (Ada).
    q_offset: absolute index of q's first row, so a caller can emulate a slice of the rows (at a multiple of
        128, Q's scale groups are the kernel's; only the causal mask reads it).
    chunk_bytes: budget for the per-chunk temporaries; the output does not depend on it beyond fp32 rounding.
    Inputs are never modified.
    """
    arch = (("sm80" if pv == "fp16" else "sm90") if arch is None else arch)
    family, pv_accum = _check_args(q, k, v, qk_gran, pv, arch, pv_accum, mma_acc)
    g = sage2_geometry(pv, family, pv_accum, q.shape[-1])
    bsz, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    rep = hq // hkv
    scale = dim ** -0.5 if scale is None else float(scale)
    dev = q.device
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=dev) if return_lse else None
    if sq == 0:
        return (out, lse) if return_lse else out

    # K smoothing: the mean in the input dtype; subtracted in the input dtype by the Triton quantizers, in fp32
    # by the CUDA one
    km = k.mean(dim=2, keepdim=True) if smooth_k else None
    if smooth_k and qk_gran != "per_warp":
        ks = (k - km).float()
    elif smooth_k:
        ks = k.float() - km.float()
    else:
        ks = k.float()

    if qk_gran == "per_block":
        q_rule = k_rule = "triton_block"
        qx = q.float() * (scale * SAGE2_LSE_LOG2E)
    else:
        q_rule = k_rule = "cuda" if qk_gran == "per_warp" else "triton_thread"
        qx = q.float()
    gq = qk_group_index(sq, qk_gran, g.warp_q, "q", dev)
    gk = qk_group_index(sk, qk_gran, g.block_k, "k", dev)
    q_int, q_sc = quantize_int8_groups(qx, gq, q_rule)
    k_int, k_sc = quantize_int8_groups(ks, gk, k_rule)
    s_mult = 1.0 if qk_gran == "per_block" else scale * LOG2E

    if pv == "fp8":
        vq, v_sc = quantize_v_fp8(v, SAGE2_V_MAX_FP16_ACCUM if pv_accum == "fp32+fp16" else FP8_E4M3_MAX)
    else:
        vq, v_sc = _round_fp16(v), None

    bkv = g.block_kv
    nb = -(-sk // bkv)
    skp = nb * bkv
    vq = torch.nn.functional.pad(vq, (0, 0, 0, skp - sk))  # padded keys are masked; their V is 0 like upstream
    # bytes per query row: scores, P, rounded P (fp32, padded keys) and the per-MMA-step partial sums
    per_row = 4 * (3 * skp + (skp // 16 + 4) * dim)
    rows_per_chunk = max(1, min(sq, chunk_bytes // per_row))
    key_idx = torch.arange(skp, device=dev)
    corr = None
    if return_lse and smooth_k:
        kmq = km.repeat_interleave(rep, dim=1) if rep > 1 else km
        corr = torch.matmul(q, kmq.transpose(-1, -2)).squeeze(-1).float() * scale  # input dtype, like core.py

    for b in range(bsz):
        for h in range(hq):
            hk = h // rep
            kt = k_int[b, hk].transpose(0, 1)
            ksc = k_sc[b, hk]
            vh = vq[b, hk]
            for r0 in range(0, sq, rows_per_chunk):
                r1 = min(sq, r0 + rows_per_chunk)
                s_int = q_int[b, h, r0:r1] @ kt  # exact: |sum| < 127² · 128 < 2^24
                s = s_int * ((q_sc[b, h, r0:r1, None] * ksc[None, :]) * s_mult)
                s = torch.nn.functional.pad(s, (0, skp - sk), value=float("-inf"))
                if is_causal:
                    rows_abs = torch.arange(r0, r1, device=dev) + q_offset
                    s = s.masked_fill(key_idx[None, :] > rows_abs[:, None], float("-inf"))
                s = s.view(r1 - r0, nb, bkv)
                off = SAGE2_P_OFFSET if g.p_fp8 else 0.0
                m = torch.cummax(s.amax(dim=-1) - off, dim=-1).values  # running max after each block
                p = torch.exp2(s - m.unsqueeze(-1))
                pq = e4m3_round(p) if g.p_fp8 else _round_fp16(p)
                den_blocks = (pq if g.den_rounded_p else p).sum(dim=-1)
                den = (den_blocks * torch.exp2(m - m[:, -1:])).sum(dim=-1)
                num = _pv_numerators(pq, vh, g, pv_accum, m, mma_acc)
                o = num * (1.0 / den).unsqueeze(-1)
                if v_sc is not None:
                    o = o * v_sc[b, hk]
                out[b, h, r0:r1] = o.to(q.dtype)
                if return_lse:
                    l2 = torch.log2(den) + m[:, -1]
                    lv = l2 / SAGE2_LSE_LOG2E
                    if corr is not None:
                        lv = lv + corr[b, h, r0:r1]
                    lse[b, h, r0:r1] = lv
    return (out, lse) if return_lse else out
