"""Triton attention forward kernels: ``fav3_sage`` (INT8 Q·K, fp8 P·V), ``fp8_triton`` (e4m3 Q/K/V per block),
``fav2_triton`` (bf16/fp16). One kernel body, specialised at compile time by two constexpr modes:

* QK_MODE 0: half-precision Q/K straight from the caller's tensors (any strides, masked tails);
  1: INT8 Q/K from the pre-pass (tile-padded), S = (Q8·K8ᵀ in int32) · q_scale · k_scale;
  2: e4m3 Q/K from the pre-pass, S = (Q8·K8ᵀ in fp32) · q_scale · k_scale.
  Q is pre-multiplied by softmax_scale·log2 e (by the pre-pass, or via ``qk_scale`` in mode 0), so the
  online softmax is in base 2 (exp2).
* PV_MODE 0: P in V's dtype times the caller's V; 1: P and V in fp16 (SageAttention v1's P·V);
  2: e4m3 P·V on the transposed pre-pass V with a per-channel V scale applied once at the end;
  3: same with one V scale per BLOCK_N keys, applied to each tile's product.
  fp8 P is P·448 rounded to e4m3 (P ≤ 1, so the full e4m3 range is used); the row sum l is taken on the
  unrounded fp32 P. Each tile's fp8 product starts from a fresh fp32 accumulator and is added to the running
  one (two-level accumulation, as SageAttention 2 does against Hopper's reduced-precision fp8 accumulation),
  unless the config sets PV_ACC.

v2 config flags (per config, all off in v1's configs; see CONFIGS): TMA (tensor-descriptor loads, which on
Hopper also lets Triton software-pipeline the K/V loads: v1's pointer loads compile to an unpipelined loop),
PV_ACC (fp8 P·V accumulated in place), FOLD (score scale and P's 448 folded into the exp2 argument).

Non-causal tiles run unmasked except the last K tile when Sk is not a multiple of BLOCK_N; causal attention
(bottom-right aligned, as sdpa/FlashAttention) masks every tile and skips the tiles above the diagonal.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from vdbench import kernels
from vdbench.kernels import quant as Qz

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
LOG2E = 1.4426950408889634
P_SCALE = 448.0
P_SHIFT = math.log2(P_SCALE)  # FOLD with fp8 P: exp2(x - m + log2 448) = 448·exp2(x - m)

# Tile configs per (kernel, head dim) on a GPU. Keys: BLOCK_M, BLOCK_N, num_warps, num_stages, and the v2 flags
#   TMA     1: Q/K/V tiles through tensor descriptors (tl.make_tensor_descriptor: TMA loads on Hopper; needs the
#           scratch allocator set by _launch). Caller tensors whose strides TMA cannot take (last stride != 1,
#           other strides or base not 16-byte aligned) are loaded by pointers instead (fav2_triton, pv=fp16 V).
#   PV_ACC  1: fp8 P·V accumulated straight into the running accumulator (one fp32 accumulator, FA3-style);
#           0: a fresh accumulator per tile added to the running one (two-level, SageAttention 2). For
#           fp8_triton's per-block V scale, 1 keeps acc in units of the current tile's V scale (the ratio of
#           consecutive scales is folded into the softmax rescale factor), applied once at the end.
#   FOLD    1: the per-tile score scale (q_scale·k_scale, or softmax_scale·log2 e) folded into the exp2 argument
#           (row max taken on the raw products, exponent one FMA), and for fp8 P the ×448 folded into the
#           exponent too (log2 448 added; the row sum then carries the 448 and the final division cancels it).
#           Unmasked tiles only; masked ones keep the v1 order (scale, mask, max).
# These are the v1 defaults; vdbench/kernels/tuned_configs.json (the sweep's best_configs.json, copied there)
# replaces entries at import, and VDBENCH_KERNEL_CONFIGS=path.json after it.
CONFIG_FLAGS = ("TMA", "PV_ACC", "FOLD")
CONFIGS = {
    ("fav3_sage", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("fav3_sage", 64): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    ("fp8_triton", 128): dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    ("fp8_triton", 64): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    ("fav2_triton", 128): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("fav2_triton", 64): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
}
TUNED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_configs.json")


def _norm_config(cfg: dict) -> dict:
    out = {k: int(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    for f in CONFIG_FLAGS:
        out[f] = int(cfg.get(f, 0))
    return out


for _k in CONFIGS:
    CONFIGS[_k] = _norm_config(CONFIGS[_k])
CONFIG_SOURCE = {k: "builtin" for k in CONFIGS}


def _apply_config_file(path: str, source: str):
    """{"fav3_sage:128": {"BLOCK_M": .., "BLOCK_N": .., "num_warps": .., "num_stages": .., "TMA": 0/1,
    "PV_ACC": 0/1, (other keys such as ms/tflops ignored)}, ...} replaces entries of CONFIGS."""
    import json

    with open(path) as f:
        table = json.load(f)
    for key, cfg in table.items():
        name, d = key.split(":")
        CONFIGS[(name, int(d))] = _norm_config(cfg)
        CONFIG_SOURCE[(name, int(d))] = source


def _load_config_override():
    """The tuned table next to this file, then ``VDBENCH_KERNEL_CONFIGS=path.json`` (same format): how the
    sweep's winners (python3 bench/suite.py kernels, best_configs.json) become the backends' defaults."""
    if os.path.exists(TUNED_PATH):
        _apply_config_file(TUNED_PATH, "tuned_configs.json")
    path = os.environ.get("VDBENCH_KERNEL_CONFIGS")
    if path:
        _apply_config_file(path, path)


_load_config_override()

def _c(bm, bn, w, st, tma=0, pv_acc=0, fold=0):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, TMA=tma, PV_ACC=pv_acc, FOLD=fold)


# What the kernels suite's sweep run measures (and ``python -m vdbench.kernels.aot --sweep`` compiles),
# per head dim and kernel. The first entries are v1's configs (its measured best first, then v1's builtin
# default), so the sweep's winner can never be slower than v1; the v2 variants follow, each flag added on
# top of the previous so the sweep shows what each one buys.
SWEEP = {
    128: {
        "fav3_sage": [_c(128, 128, 8, 3), _c(128, 64, 8, 3),
                      _c(128, 128, 8, 3, 1), _c(128, 128, 8, 3, 1, 1), _c(128, 128, 8, 3, 1, 1, 1),
                      _c(128, 128, 8, 4, 1, 1, 1), _c(128, 128, 8, 2, 1, 1, 1), _c(128, 64, 8, 4, 1, 1, 1)],
        "fp8_triton": [_c(128, 128, 8, 4), _c(128, 128, 8, 3),
                       _c(128, 128, 8, 4, 1), _c(128, 128, 8, 4, 1, 1), _c(128, 128, 8, 4, 1, 1, 1),
                       _c(128, 128, 8, 3, 1, 1, 1), _c(128, 128, 8, 2, 1, 1, 1), _c(128, 64, 8, 4, 1, 1, 1)],
        "fav2_triton": [_c(128, 128, 8, 3), _c(128, 64, 8, 3),
                        _c(128, 128, 8, 3, 1), _c(128, 128, 8, 3, 1, 0, 1), _c(128, 128, 8, 2, 1, 0, 1),
                        _c(128, 64, 8, 3, 1, 0, 1), _c(128, 64, 8, 4, 1, 0, 1)],
    },
    64: {
        "fav3_sage": [_c(128, 64, 4, 3), _c(128, 64, 4, 3, 1, 1, 1), _c(128, 64, 4, 4, 1, 1, 1),
                      _c(128, 128, 8, 3, 1, 1, 1)],
        "fp8_triton": [_c(128, 64, 4, 3), _c(128, 64, 4, 3, 1, 1, 1), _c(128, 64, 4, 4, 1, 1, 1),
                       _c(128, 128, 8, 3, 1, 1, 1)],
        "fav2_triton": [_c(128, 64, 4, 3), _c(128, 64, 4, 3, 1, 0, 1), _c(128, 64, 4, 4, 1, 0, 1),
                        _c(128, 128, 8, 3, 1, 0, 1)],
    },
}


def config_label(cfg: dict) -> str:
    flags = "".join(f" {f.lower()}" for f in CONFIG_FLAGS if cfg.get(f))
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}{flags}"


# Small tiles under the interpreter: several K tiles and ragged tails even at tiny sequence lengths.
INTERPRET_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, TMA=0, PV_ACC=0, FOLD=0)


@triton.jit
def _attn_inner(acc, l_i, m_i, vs_run, q, q_scale, Kb, Vb, KSb, VSb, sks, skd, svs, svd,
                lo, hi, offs_m, sk_len, causal_shift, qk_scale,
                D: tl.constexpr, BLOCK_N: tl.constexpr, QK_MODE: tl.constexpr, PV_MODE: tl.constexpr,
                MASK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, P_SC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                FIX_FP8: tl.constexpr, TMA_QK: tl.constexpr, TMA_V: tl.constexpr, PV_ACC: tl.constexpr,
                FOLD: tl.constexpr, P_SHIFT: tl.constexpr):
    # Kb / Vb: base pointers of this (batch, head), or tensor descriptors when TMA_QK / TMA_V
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if TMA_QK:
            kt = Kb.load([start_n, 0]).T  # (D, BLOCK_N); rows past the descriptor's end read as zeros
        else:
            kt_ptrs = Kb + cols[None, :] * sks + offs_d[:, None] * skd  # K tile loaded as Kᵀ: (D, BLOCK_N)
            if QK_MODE == 0 and MASK_N:
                kt = tl.load(kt_ptrs, mask=cols[None, :] < sk_len, other=0.0)
            else:
                kt = tl.load(kt_ptrs)  # quantized K is tile-padded by the pre-pass: no mask
        if QK_MODE == 0:
            if UPCAST_DOT:  # interpreter workaround, see _launch
                raw = tl.dot(q.to(tl.float32), kt.to(tl.float32))
            else:
                raw = tl.dot(q, kt)
            s_tile = qk_scale
        else:
            s_tile = q_scale * tl.load(KSb + start_n // BLOCK_N)
            if QK_MODE == 1:
                raw = tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32)
            else:
                raw = tl.dot(q, kt)
        if FOLD and not MASK_N and not IS_CAUSAL:
            # s_tile >= 0 is one scalar per tile: rowmax(s·x) = s·rowmax(x), and the exponent is one FMA per
            # element; P_SHIFT = log2(448) puts the fp8 P scale into the exponent (l then carries it too)
            m_ij = tl.maximum(m_i, tl.max(raw, 1) * s_tile)
            p = tl.math.exp2(raw * s_tile - (m_ij - P_SHIFT)[:, None])
        else:
            qk = raw * s_tile
            if MASK_N:
                qk = tl.where(cols[None, :] < sk_len, qk, float("-inf"))
            if IS_CAUSAL:
                qk = tl.where(cols[None, :] <= offs_m[:, None] + causal_shift, qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - (m_ij - P_SHIFT)[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV_MODE == 3 and PV_ACC:
            # acc kept in units of the current tile's V scale: fold the ratio into the rescale factor
            vs_j = tl.load(VSb + start_n // BLOCK_N)
            vs_j = tl.where(vs_j > 0, vs_j, 1.0)  # an all-zero V block quantizes to zeros with any scale
            acc = acc * (alpha * (vs_run / vs_j))[:, None]
            vs_run = vs_j
        else:
            acc = acc * alpha[:, None]
        if PV_MODE <= 1:
            if TMA_V:
                v = Vb.load([start_n, 0])
            else:
                v_ptrs = Vb + cols[:, None] * svs + offs_d[None, :] * svd
                if MASK_N:
                    v = tl.load(v_ptrs, mask=cols[:, None] < sk_len, other=0.0)
                else:
                    v = tl.load(v_ptrs)
            if PV_MODE == 0:
                if UPCAST_DOT:  # same operand rounding (P to V's dtype), product taken in fp32
                    acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
                else:
                    acc = tl.dot(p.to(v.dtype), v, acc)
            else:
                acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
        else:
            if TMA_V:
                vt = Vb.load([0, start_n])  # (D, BLOCK_N) of the transposed, tile-padded V
            else:
                vt = tl.load(Vb + offs_d[:, None] * svd + cols[None, :] * svs)  # (D, BLOCK_N), keys contiguous
            if P_SHIFT == 0.0:
                p8 = Qz.to_e4m3(p * P_SC, FIX_FP8)
            else:  # already scaled through the exponent
                p8 = Qz.to_e4m3(p, FIX_FP8)
            if PV_ACC:
                acc = tl.dot(p8, tl.trans(vt), acc)
            else:
                pv = tl.dot(p8, tl.trans(vt))
                if PV_MODE == 3:
                    pv = pv * tl.load(VSb + start_n // BLOCK_N)
                acc += pv
        m_i = m_ij
    return acc, l_i, m_i, vs_run


@triton.jit
def _attn_fwd(Q, K, V, QS, KS, VS, Out, sq_len, sk_len, H, nq_blk, nk_blk,
              sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
              qk_scale, causal_shift,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_MODE: tl.constexpr,
              PV_MODE: tl.constexpr, IS_CAUSAL: tl.constexpr, P_SC: tl.constexpr, UPCAST_DOT: tl.constexpr,
              FIX_FP8: tl.constexpr, TMA_QK: tl.constexpr = False, TMA_V: tl.constexpr = False,
              PV_ACC: tl.constexpr = False, FOLD: tl.constexpr = False, P_SHIFT: tl.constexpr = 0.0):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = (off_bh // H).to(tl.int64)
    h = (off_bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    Qb = Q + b * sqb + h * sqh
    Kb = K + b * skb + h * skh
    Vb = V + b * svb + h * svh
    if TMA_QK:
        # one descriptor per (batch, head): the tile rows past the end read as zeros (QK_MODE 0: the caller's
        # ragged tail; 1, 2: the pre-pass buffers are already tile-padded). The host checked sqd == skd == 1.
        if QK_MODE == 0:
            q_rows = sq_len
            k_rows = sk_len
        else:
            q_rows = nq_blk * BLOCK_M
            k_rows = nk_blk * BLOCK_N
        q_desc = tl.make_tensor_descriptor(Qb, shape=[q_rows, D], strides=[sqs, 1], block_shape=[BLOCK_M, D])
        k_src = tl.make_tensor_descriptor(Kb, shape=[k_rows, D], strides=[sks, 1], block_shape=[BLOCK_N, D])
        q = q_desc.load([start_m * BLOCK_M, 0])
    else:
        k_src = Kb
        q_ptrs = Qb + offs_m[:, None] * sqs + offs_d[None, :] * sqd
        if QK_MODE == 0:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < sq_len, other=0.0)
        else:
            q = tl.load(q_ptrs)  # tile-padded by the pre-pass
    if TMA_V:
        if PV_MODE <= 1:  # caller's V (B, H, S, D), svd == 1 checked by the host
            v_src = tl.make_tensor_descriptor(Vb, shape=[sk_len, D], strides=[svs, 1], block_shape=[BLOCK_N, D])
        else:  # transposed pre-pass V (B, H, D, S_pad): svs == 1, svd == S_pad
            v_src = tl.make_tensor_descriptor(Vb, shape=[D, nk_blk * BLOCK_N], strides=[svd, 1],
                                              block_shape=[D, BLOCK_N])
    else:
        v_src = Vb
    if QK_MODE == 0:
        q_scale = 1.0
    else:
        q_scale = tl.load(QS + off_bh * nq_blk + start_m)
    KSb = KS + off_bh * nk_blk
    VSb = VS + off_bh * nk_blk
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    vs_run = tl.full([], 1.0, tl.float32)  # PV_MODE 3 with PV_ACC: the V scale acc is currently in units of
    n_round = tl.cdiv(sk_len, BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        last = (start_m + 1) * BLOCK_M + causal_shift  # one past the last key the tile's last row sees
        hi = tl.minimum(n_round, tl.cdiv(tl.maximum(last, 0), BLOCK_N) * BLOCK_N)
        acc, l_i, m_i, vs_run = _attn_inner(acc, l_i, m_i, vs_run, q, q_scale, k_src, v_src, KSb, VSb,
                                            sks, skd, svs, svd, 0, hi, offs_m, sk_len, causal_shift, qk_scale,
                                            D, BLOCK_N, QK_MODE, PV_MODE, True, True, P_SC, UPCAST_DOT, FIX_FP8,
                                            TMA_QK, TMA_V, PV_ACC, FOLD, P_SHIFT)
    else:
        n_full = (sk_len // BLOCK_N) * BLOCK_N
        acc, l_i, m_i, vs_run = _attn_inner(acc, l_i, m_i, vs_run, q, q_scale, k_src, v_src, KSb, VSb,
                                            sks, skd, svs, svd, 0, n_full, offs_m, sk_len, causal_shift, qk_scale,
                                            D, BLOCK_N, QK_MODE, PV_MODE, False, False, P_SC, UPCAST_DOT, FIX_FP8,
                                            TMA_QK, TMA_V, PV_ACC, FOLD, P_SHIFT)
        acc, l_i, m_i, vs_run = _attn_inner(acc, l_i, m_i, vs_run, q, q_scale, k_src, v_src, KSb, VSb,
                                            sks, skd, svs, svd, n_full, n_round, offs_m, sk_len, causal_shift,
                                            qk_scale, D, BLOCK_N, QK_MODE, PV_MODE, True, False, P_SC, UPCAST_DOT,
                                            FIX_FP8, TMA_QK, TMA_V, PV_ACC, FOLD, P_SHIFT)
    # fp8 P·V: undo P's 448 (unless P_SHIFT put it into l as well) and apply V's scale
    if P_SHIFT == 0.0:
        p_div = P_SC
    else:
        p_div = 1.0
    if PV_MODE == 2:
        vs = tl.load(VS + off_bh * D + offs_d)
        acc = acc * (vs / p_div)[None, :]
    elif PV_MODE == 3:
        if PV_ACC:
            acc = acc * (vs_run / p_div)
        elif P_SHIFT == 0.0:
            acc = acc / P_SC
    acc = acc / l_i[:, None]
    o_ptrs = Out + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :] * sod
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < sq_len)


# ----------------------------------------------------------------------------------------------------------
# Python entry points (BHSD in, BHSD out)
# ----------------------------------------------------------------------------------------------------------

def _check(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, heads, seq, head_dim)")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"bf16/fp16 q, k, v of one dtype required, got {q.dtype}, {k.dtype}, {v.dtype}")
    d = q.shape[-1]
    if d not in (64, 128) or k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"head dim must be 64 or 128 (q, k, v alike), got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("CPU tensors need Triton's interpreter: TRITON_INTERPRET=1 before triton is imported")


def config_for(kernel: str, d: int, device, override: dict | None = None) -> dict:
    cfg = dict(INTERPRET_CONFIG if INTERPRETED else CONFIGS[(kernel, d)])
    if override:
        cfg.update(override)
    return cfg


def _tma_ok(t: torch.Tensor, strides) -> bool:
    """Whether a TMA descriptor over ``t`` with these (element) strides is legal: 16-byte aligned base and
    leading strides, unit last stride (per-(batch, head) bases then stay aligned too)."""
    es = t.element_size()
    return (t.data_ptr() % 16 == 0 and strides[-1] == 1
            and all((st * es) % 16 == 0 for st in strides[:-1]))


def _scratch_alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cpu" if INTERPRETED else "cuda", dtype=torch.int8)


def _ensure_allocator():
    """tl.make_tensor_descriptor inside a kernel needs a global scratch allocator (Triton >= 3.3). Triton keeps
    it in a ContextVar (per thread / context), so this checks every launch and sets ours only where none is set
    (an allocator set by the caller is kept)."""
    if not _allocator_is_set():
        triton.set_allocator(_scratch_alloc)


def _allocator_is_set() -> bool:
    """Whether this thread/context already has a Triton allocator (False where Triton's internals differ:
    then ours is set)."""
    try:
        from triton.runtime import _allocation as _al

        return not isinstance(_al._allocator.get(), _al.NullAllocator)
    except (ImportError, AttributeError):
        return False


LAST_LAUNCH: dict = {}  # the specialisation the last launch used (tests and the sweep read it)


def _launch(q, kq, kk, vv, qs, ks, vs, *, sq, sk, nq_blk, nk_blk, v_strides, qk_scale, is_causal, qk_mode,
            pv_mode, cfg, out=None):
    b, h, _, d = q.shape
    if out is None:
        out = torch.empty((b, h, sq, d), device=q.device, dtype=q.dtype)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    # Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly (it multiplies the raw 16-bit
    # patterns: errors ~1e10), fp16/fp32/int8/e4m3 are right. Under the interpreter only, bf16 operands are
    # rounded to bf16 as the GPU kernel rounds them and then multiplied in fp32 (what a bf16 MMA does: exact
    # products, fp32 accumulation). The compiled GPU kernel never takes this path.
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    fix = INTERPRETED  # and its fp32 -> e4m3 conversion drops a carry: see quant._round_to_e4m3_grid
    tma = bool(cfg.get("TMA", 0))
    tma_qk = tma and _tma_ok(kq, kq.stride()) and _tma_ok(kk, kk.stride())
    tma_v = tma and _tma_ok(vv, vv.stride())  # (B, H, S, D) caller V, or (B, H, D, S_pad) transposed fp8 V
    if tma_qk or tma_v:
        _ensure_allocator()
    # FOLD needs a non-negative score scale (a negative user softmax scale keeps the v1 arithmetic)
    fold = bool(cfg.get("FOLD", 0)) and (qk_mode != 0 or qk_scale >= 0)
    pv_acc = bool(cfg.get("PV_ACC", 0)) and pv_mode >= 2
    LAST_LAUNCH.clear()
    LAST_LAUNCH.update(qk_mode=qk_mode, pv_mode=pv_mode, tma_qk=tma_qk, tma_v=tma_v, pv_acc=pv_acc, fold=fold)
    _attn_fwd[grid](kq, kk, vv, qs, ks, vs, out, sq, sk, h, nq_blk, nk_blk,
                    *kq.stride(), *kk.stride(), *v_strides, *out.stride(),
                    float(qk_scale), sk - sq,
                    D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], QK_MODE=qk_mode, PV_MODE=pv_mode,
                    IS_CAUSAL=bool(is_causal), P_SC=P_SCALE, UPCAST_DOT=upcast, FIX_FP8=fix,
                    TMA_QK=tma_qk, TMA_V=tma_v, PV_ACC=pv_acc,
                    FOLD=fold, P_SHIFT=P_SHIFT if fold and pv_mode >= 2 else 0.0,
                    num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"])
    return out


def _sage_prepass(q, k, v, scale, cfg, pv):
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    q8, qs = Qz.quant_blocks(q, cfg["BLOCK_M"], fp8=False, pre_scale=sm * LOG2E)
    k8, ks = Qz.quant_blocks(k, cfg["BLOCK_N"], fp8=False, mean=Qz.k_mean(k))
    if pv == "fp8":
        v8t, vs = Qz.quant_v_t(v, cfg["BLOCK_N"], per_channel=True)
        return q8, qs, k8, ks, v8t, vs
    return q8, qs, k8, ks, v, None


def fav3_sage(q, k, v, *, scale=None, is_causal=False, pv="fp8", config=None, out=None):
    """SageAttention-style INT8 Q·Kᵀ (per-block scales, K smoothed) with e4m3 P·V (per-channel V scale).

    ``pv="fp16"``: P·V in fp16 on the caller's V instead (SageAttention v1's numerics). The quantization
    pre-pass runs inside this call.
    """
    _check(q, k, v)
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    cfg = config_for("fav3_sage", q.shape[-1], q.device, config)
    q8, qs, k8, ks, vv, vs = _sage_prepass(q, k, v, scale, cfg, pv)
    sq, sk = q.shape[2], k.shape[2]
    if pv == "fp8":
        v_strides, pv_mode = (vv.stride(0), vv.stride(1), 1, vv.stride(2)), 2  # (B, H, D, S_pad)
    else:
        v_strides, pv_mode, vs = vv.stride(), 1, qs  # vs unused
    return _launch(q, q8, k8, vv, qs, ks, vs, sq=sq, sk=sk, nq_blk=qs.shape[-1], nk_blk=ks.shape[-1],
                   v_strides=v_strides, qk_scale=1.0, is_causal=is_causal, qk_mode=1, pv_mode=pv_mode, cfg=cfg,
                   out=out)


def _fp8_prepass(q, k, v, scale, cfg):
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    q8, qs = Qz.quant_blocks(q, cfg["BLOCK_M"], fp8=True, pre_scale=sm * LOG2E)
    k8, ks = Qz.quant_blocks(k, cfg["BLOCK_N"], fp8=True, mean=Qz.k_mean(k))
    v8t, vs = Qz.quant_v_t(v, cfg["BLOCK_N"], per_channel=False)
    return q8, qs, k8, ks, v8t, vs


def fp8_triton(q, k, v, *, scale=None, is_causal=False, config=None, out=None):
    """e4m3 Q, K, V with one scale per tile of tokens per head (K smoothed), e4m3 P. Pre-pass inside the call."""
    _check(q, k, v)
    cfg = config_for("fp8_triton", q.shape[-1], q.device, config)
    q8, qs, k8, ks, v8t, vs = _fp8_prepass(q, k, v, scale, cfg)
    return _launch(q, q8, k8, v8t, qs, ks, vs, sq=q.shape[2], sk=k.shape[2], nq_blk=qs.shape[-1],
                   nk_blk=ks.shape[-1], v_strides=(v8t.stride(0), v8t.stride(1), 1, v8t.stride(2)),
                   qk_scale=1.0, is_causal=is_causal, qk_mode=2, pv_mode=3, cfg=cfg, out=out)


def fav2_triton(q, k, v, *, scale=None, is_causal=False, config=None, out=None):
    """Plain flash-attention forward in the inputs' precision (bf16/fp16), fp32 softmax and accumulator."""
    _check(q, k, v)
    cfg = config_for("fav2_triton", q.shape[-1], q.device, config)
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    dummy = torch.empty(1, device=q.device, dtype=torch.float32)
    return _launch(q, q, k, v, dummy, dummy, dummy, sq=q.shape[2], sk=k.shape[2], nq_blk=0, nk_blk=0,
                   v_strides=v.stride(), qk_scale=sm * LOG2E, is_causal=is_causal, qk_mode=0, pv_mode=0, cfg=cfg,
                   out=out)


#: name -> forward of the kernels this module holds (the registry, ``vdbench.kernels.KERNELS``, says which)
KERNELS = {name: globals()[name] for name in kernels.names(module=__name__)}


def prepass(kernel: str, config=None):
    """The quantization pre-pass alone, ``fn(q, k, v, scale=None)`` (what the backend call runs before the attention
    kernel)."""
    if kernel == "fav3_sage":
        return lambda q, k, v, scale=None: _sage_prepass(q, k, v, scale, config_for(kernel, q.shape[-1], q.device,
                                                                                     config), "fp8")
    if kernel == "fp8_triton":
        return lambda q, k, v, scale=None: _fp8_prepass(q, k, v, scale, config_for(kernel, q.shape[-1], q.device,
                                                                                    config))
    if kernel == "fav2_triton":
        return None
    raise KeyError(kernel)


# The specializations the ahead-of-time check compiles (python -m vdbench.kernels.aot):
# label -> (Q/K/V/Out element types, QK_MODE, PV_MODE, the kernel whose CONFIGS entry gives the tiles)
AOT_VARIANTS = {
    "fav2_triton[bf16]": (("bf16", "bf16", "bf16", "bf16"), 0, 0, "fav2_triton"),
    "fav2_triton[fp16]": (("fp16", "fp16", "fp16", "fp16"), 0, 0, "fav2_triton"),
    "fav3_sage": (("i8", "i8", "fp8e4nv", "bf16"), 1, 2, "fav3_sage"),
    "fav3_sage[pv=fp16]": (("i8", "i8", "bf16", "bf16"), 1, 1, "fav3_sage"),
    "fp8_triton": (("fp8e4nv", "fp8e4nv", "fp8e4nv", "bf16"), 2, 3, "fp8_triton"),
}


def aot_specs(d: int = 128, causal: bool = False, config: dict | None = None) -> dict:
    """label -> (jit function, argument types by name (others: i32), constexprs by name, compile options) of each
    of ``AOT_VARIANTS`` at head dim ``d`` with the backends' tiles (``config`` overriding them): what
    ``vdbench.kernels.aot`` compiles."""
    out = {}
    for label, ((qt, kt, vt, ot), qkm, pvm, key) in AOT_VARIANTS.items():
        cfg = dict(CONFIGS[(key, d)], **(config or {}))
        tma = bool(cfg.get("TMA", 0))
        types = {"Q": "*" + qt, "K": "*" + kt, "V": "*" + vt, "Out": "*" + ot, "QS": "*fp32", "KS": "*fp32",
                 "VS": "*fp32", "qk_scale": "fp32"}
        consts = dict(D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], QK_MODE=qkm, PV_MODE=pvm,
                      IS_CAUSAL=causal, P_SC=P_SCALE, UPCAST_DOT=False, FIX_FP8=False,
                      TMA_QK=tma, TMA_V=tma, PV_ACC=bool(cfg.get("PV_ACC", 0)) and pvm >= 2,
                      FOLD=bool(cfg.get("FOLD", 0)),
                      P_SHIFT=P_SHIFT if cfg.get("FOLD", 0) and pvm >= 2 else 0.0)
        out[label] = (_attn_fwd, types, consts, dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return out
