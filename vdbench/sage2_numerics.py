"""SageAttention 2's numerics in pure torch: the twin the ``sagev2*`` backends are checked against.

Why an emulation: SageAttention 2 runs only on CUDA GPUs after a from-source build, yet what users trade for
its speed is its accuracy -- what INT8 Q·Kᵀ with K smoothing and an fp8 (e4m3) P·V with a per-channel V scale
do to an attention output. Reproducing that arithmetic step by step in torch lets the
numerics be tested on a CPU, lets a pipeline be rendered with SageAttention 2's error on any device
(``sagev2_emu``), and lets the GPU bench tell the algorithm's error from a kernel bug: the emulation's rel L2
against fp64 should be within ~10% of the kernel's own (on an H200 it is within 0.05% for every variant at the
Wan and CogVideoX shapes, docs/notes/sageattention2.md).

What each step does and where it comes from (thu-ml/SageAttention 2.2.0) is written up in
docs/notes/sageattention2.md; in short, per kernel (``geometry``):

1. K smoothing: ``km = mean_seq(K)`` in the input dtype; K - km is what gets quantized.
2. Q and K to INT8 with one fp32 scale per row group -- per warp (contiguous rows) or per thread (the rows an MMA
   fragment thread holds: Q row r -> group r mod 8 inside its warp's rows, K row r -> (r mod 8) div 2 inside its
   block) -- with the rounding rule of the quantizer the kernel uses.
3. Base-2 scores ``s = (Q_int·K_intᵀ) * q_scale * k_scale * sm_scale * log2(e)``, exact integer dot products.
4. Online softmax over blocks of ``block_kv`` keys: the running max per block; for fp8 P·V the max is lowered by
   log2(448) so that P = exp2(s - m) fills e4m3's range, then P is rounded to e4m3 (or to fp16 for fp16 P·V).
5. P·V with the kernel's accumulation: an fp16 accumulator rounded after every MMA k-step and flushed into fp32
   every block ("fp32+fp16", "fp16+fp32"), or fp32 ("fp32", "fp32+fp32"; with ``mma_acc="fp22"`` the fp8 MMA
   accumulator keeps 13 mantissa bits, the SageAttention 2 paper's account, which the H200 does not show).
6. ``O = num / den`` (the denominator sums unrounded P for the fp8 kernels and the Triton one, rounded P for the
   sm80 fp16 kernel), times the per-channel V scale, rounded to the input dtype.
7. LSE in the library's convention: natural log of sum exp(scale·q·k), i.e. ``(log2(den) + m) / 1.44269504`` plus
   the smoothing correction ``(q @ kmᵀ) * scale`` computed, like the library does, in the input dtype.

All of it is chunked over query rows (``chunk_bytes`` bounds the temporaries), so it runs at the real video
shapes on a GPU without O(S²) memory. It is slow by construction and never used to report speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "SageGeometry",
    "geometry",
    "EMULATED",
    "qk_group_index",
    "quantize_int8_groups",
    "quantize_v_fp8",
    "e4m3_round",
    "fp22_truncate",
    "sagev2_emulated",
]

LOG2E_KERNEL = 1.44269504088896340736  # math::log2e, what the CUDA kernels multiply sm_scale by
LOG2E_PY = 1.44269504  # what core.py divides the kernels' base-2 LSE by (and the Triton quantizer multiplies by)
FP8_EXP_OFFSET = 8.807  # S_FP8_OFFSET: log2(448), P = exp2(s - (max - 8.807)) lies in (0, 448]
E4M3_MAX = 448.0
V_SCALE_MAX_FP16_ACCUM = 2.25  # V's fp8 range with an fp16 accumulator: 448 * 2.25 * 64 keys < 65504
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
EMULATED = {
    ("fp8", "sm90"): ("fp32+fp32",),
    ("fp8", "sm89"): ("fp32+fp16", "fp32+fp32", "fp32"),
    ("fp16", "sm80"): ("fp32", "fp16+fp32"),
    ("fp16", "triton"): ("fp16+fp32",),
}


def geometry(pv: str, arch: str, pv_accum: str, head_dim: int) -> SageGeometry:
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
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def fp22_truncate(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded toward zero to 13 mantissa bits: the paper's FP22 fp8-MMA accumulator (``mma_acc="fp22"``).

    The SageAttention 2 paper reports 1 sign, 8 exponent and 13 mantissa bits (measured on Ada); truncation rather
    than rounding is our assumption. On an H200 neither shows: see ``sagev2_emulated``'s ``mma_acc``.
    """
    return (x.float().contiguous().view(torch.int32) & _FP22_MASK).view(torch.float32)


def quantize_v_fp8(v: torch.Tensor, scale_max: float = E4M3_MAX):
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
    modes = EMULATED.get((pv, family))
    if modes is None:
        valid = sorted({a for p, a in EMULATED if p == pv and a != "triton"})
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
    g = geometry(pv, family, pv_accum, q.shape[-1])
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
        qx = q.float() * (scale * LOG2E_PY)
    else:
        q_rule = k_rule = "cuda" if qk_gran == "per_warp" else "triton_thread"
        qx = q.float()
    gq = qk_group_index(sq, qk_gran, g.warp_q, "q", dev)
    gk = qk_group_index(sk, qk_gran, g.block_k, "k", dev)
    q_int, q_sc = quantize_int8_groups(qx, gq, q_rule)
    k_int, k_sc = quantize_int8_groups(ks, gk, k_rule)
    s_mult = 1.0 if qk_gran == "per_block" else scale * LOG2E_KERNEL

    if pv == "fp8":
        vq, v_sc = quantize_v_fp8(v, V_SCALE_MAX_FP16_ACCUM if pv_accum == "fp32+fp16" else E4M3_MAX)
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
                off = FP8_EXP_OFFSET if g.p_fp8 else 0.0
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
                    lv = l2 / LOG2E_PY
                    if corr is not None:
                        lv = lv + corr[b, h, r0:r1]
                    lse[b, h, r0:r1] = lv
    return (out, lse) if return_lse else out


def exact_attention_fp64(q, k, v, *, scale: Optional[float] = None, is_causal: bool = False, q_offset: int = 0,
                         return_lse: bool = False, chunk_bytes: int = 512 << 20):
    """fp64 softmax attention, chunked over queries, with the same causal convention as the emulation.

    Kept here (not imported from vdbench.backends) so this module and the GPU bench stand alone while the
    backends package is being restructured; the lead may fold it into vdbench.numerics' exact reference.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    rep = q.shape[1] // k.shape[1]
    kd = k.double().repeat_interleave(rep, 1) if rep > 1 else k.double()
    vd = v.double().repeat_interleave(rep, 1) if rep > 1 else v.double()
    sq, sk = q.shape[2], k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float64, device=q.device) if return_lse else None
    step = max(1, min(sq, chunk_bytes // max(1, 8 * sk * q.shape[0] * q.shape[1])))
    key_idx = torch.arange(sk, device=q.device)
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        s = torch.matmul(q[:, :, r0:r1].double(), kd.transpose(-1, -2)) * scale
        if is_causal:
            rows = torch.arange(r0, r1, device=q.device) + q_offset
            s = s.masked_fill(key_idx[None, :] > rows[:, None], float("-inf"))
        if return_lse:
            lse[:, :, r0:r1] = torch.logsumexp(s, dim=-1)
        out[:, :, r0:r1] = torch.matmul(torch.softmax(s, dim=-1), vd)
    return (out, lse) if return_lse else out


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64: the accuracy figure every vdbench comparison uses."""
    ref = ref.double()
    return (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


__all__ += ["exact_attention_fp64", "rel_l2"]
