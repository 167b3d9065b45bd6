"""The numerics both sides of the registry share: exact attention, the quantizers, the quantized kernels' emulations.

Exact attention (fp64 by default, explicit softmax, chunked over queries) is the ground truth of every accuracy
figure. The quantizers (INT8 per block; fp8 e4m3 per tensor, per (batch, head) or per block) are the ones the real
kernels' wrappers feed them with, and the emulations reproduce each quantized kernel's arithmetic in pure torch on
any device, so its accuracy is tested on a CPU and compared with the real kernel on a GPU:

* ``sagev1_emulated``      SageAttention v1 (INT8 per-block Q/K, K smoothing, fp16 P·V);
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

import torch
import torch.nn.functional as F

__all__ = ["LOG2E", "FP8_E4M3_MAX", "P_SCALE", "SAGE_BLKQ", "SAGE_BLKK", "causal_mask", "query_chunk",
           "exact_attention", "reference_attention", "quantize_int8_per_block", "quantize_fp8",
           "quantize_fp8_per_block", "sagev1_emulated", "fp8_emulated", "fav3_sage_emulated", "fp8_triton_emulated"]

LOG2E = 1.4426950408889634
FP8_E4M3_MAX = 448.0
P_SCALE = 448.0  # the Triton kernels scale P by 448 before rounding it to e4m3 (P in [0, 1] would waste the range)
SAGE_BLKQ, SAGE_BLKK = 128, 64  # SageAttention v1's Q and K quantization blocks (tokens)


# ----------------------------------------------------------------------------------------------------------
# Exact references
# ----------------------------------------------------------------------------------------------------------

def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Boolean (sq, sk) mask of the keys each query may see."""
    # bottom-right aligned, as FlashAttention and sdpa (for sq == sk both conventions agree)
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def query_chunk(q: torch.Tensor, sk: int, itemsize: int, budget_bytes: int = 512 << 20) -> int:
    """Queries per chunk so that one chunk's (B, H, chunk, sk) scores fit in ``budget_bytes``."""
    b, h = q.shape[0], q.shape[1]
    per_row = max(1, b * h * sk * itemsize)
    return max(1, min(q.shape[2], budget_bytes // per_row))


def exact_attention(q, k, v, *, scale=None, is_causal=False, attn_mask=None, dtype=torch.float64,
                    return_lse=False):
    """Softmax attention computed explicitly in ``dtype`` (default fp64), chunked over queries.

    The ground truth for accuracy figures: no fused kernel, no online softmax, no reduced precision.
    Chunking bounds memory at about 512 MiB of scores whatever the sequence length.
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
            s = s.masked_fill(~causal_mask(sq, sk, q.device)[s0:s1], float("-inf"))
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
    descale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    x8 = (xf / descale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    fa3_descale = None
    if granularity in ("tensor", "bh"):
        fa3_descale = descale.reshape(descale.shape[0], descale.shape[1]).expand(b, h).contiguous()
    return x8, descale, fa3_descale


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


def fp8_emulated(q, k, v, *, scale=None, is_causal=False, granularity="bh"):
    """FA3 fp8 numerics in pure torch: e4m3 Q, K, V with the same scales ``fav3_fp8`` passes to FA3.

    S = Q8·K8ᵀ · q_descale · k_descale · scale in fp32; P = exp(S - max) in fp32, its row sum taken in
    fp32, then P rounded to e4m3 for the P·V product (as the FA3 fp8 kernel feeds P to its fp8 wgmma);
    O = (P8·V8) · v_descale / rowsum.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
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
