"""FA3 fp8's quantization pre-pass in Triton: e4m3 Q, K, V with one scale per (batch, head), K and V smoothing
optional.

Why: ``fav3_fp8`` hands FA3 e4m3 inputs with per-(batch, head) descales. Quantized eagerly in torch that costs
~36 bytes of traffic per element (fp32 copy, abs, amax, division, clamp, cast): on an H200 it took the Wan 1.3B call
from the kernel's 7.26 ms to 9.01 ms. Here each tensor is read twice and written once in e4m3 (5 bytes per bf16
element): one reduction launch (per-chunk amax, or per-channel max and min of K when smoothing) and one quantization
launch. A single read is not possible with a per-(batch, head) scale: the first value can only be written once the
whole head's amax is known, which needs a grid-wide barrier between the two phases (not expressible safely in
Triton: spinning programs deadlock when a head's chunks are not all resident, and always under the interpreter).

Q, K and V go through one amax launch and one quantization launch (``quantize_qkv``: program axis 2 picks the
tensor, the amax is an atomic max into a (3, B, H) buffer, one ``fp8_descale`` call between the two launches scales
all three; a smoothed tensor's mean, taken by torch beforehand, subtracted in both launches): at Wan 1.3B the
per-tensor form's six launches and the torch ops between them (the amax of the partials, ``fp8_descale`` three
times) cost more than its bytes (0.58 ms a call where its traffic takes ~0.2 ms, H200).

Exactly ``vdbench.numerics.fp8_bh_inputs`` -- the eager path used where Triton does not run -- bit for bit:

* the amax is a max (exact in any order), taken over chunks here and finished by a torch max over the chunk
  partials; with smoothing, amax |K - mean| = max over channels of max(|kmax - mean|, |kmin - mean|), equal to the
  eager ``(k - mean).abs().amax()`` because fp32 rounding is monotonic and symmetric;
* the descale is ``numerics.fp8_descale(amax)`` and the K mean ``numerics.smoothing_mean(k)`` -- the same torch
  calls in both paths;
* values are ``(x [- mean]) / descale`` with an IEEE division (``div_rn``), clamped to ±448 and rounded to nearest
  even in e4m3 (under the interpreter through ``quant.to_e4m3``'s pre-rounding; see ``quant._round_to_e4m3_grid``).

Every launch goes through ``vdbench.kernels.ahead.launch``: inside ``ahead.compile_only`` a call on meta tensors of
a render's shapes compiles the specializations its real calls will use, without a GPU launch (``fav3_fp8``'s
prewarm, ``vdbench.backends.prewarm``).

The outputs keep the inputs' shapes and memory layout (``empty_like``), so FA3 sees what it would see from a caller
who quantized the tensors themselves. As with the other kernel modules, importing this one decides whether Triton
compiles or interprets (``TRITON_INTERPRET=1`` before the first import: CPU tests).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from vdbench import numerics as N
from vdbench.kernels.ahead import launch as _launch
from vdbench.kernels.quant import to_e4m3

__all__ = ["quantize_bh", "quantize_qkv", "prepass", "aot_specs", "CHUNK", "WARPS", "INTERPRETED"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
CHUNK = 64  # rows per program: a 64 x D tile, 16 KiB of bf16 per program at D 128
WARPS = 8  # 32 fp32 values per thread at D 128: ~110 registers (sm_90), two programs of 256 threads per SM


@triton.jit
def _load_tile(X, b, s_len, d_len, sxb, sxh, sxs, sxd, BLK: tl.constexpr, BD: tl.constexpr):
    """Chunk ``program_id(0)`` of head ``program_id(1)`` of batch ``b`` of a strided (B, H, S, D) tensor in fp32
    (0 outside), its row indices inside the chunk, its column indices and mask. The tile's base offset is one
    64-bit scalar; the offsets inside it stay 32-bit (a 64-bit offset per element would cost two registers each)."""
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLK)
    cols = tl.arange(0, BD)
    inside = ((c * BLK + r)[:, None] < s_len) & (cols[None, :] < d_len)
    base = X + b * sxb + h * sxh + (c * BLK).to(tl.int64) * sxs
    x = tl.load(base + r[:, None] * sxs + cols[None, :] * sxd, mask=inside, other=0.0)
    return x.to(tl.float32), r, cols, inside


@triton.jit
def _tile(X, s_len, d_len, sxb, sxh, sxs, sxd, BLK: tl.constexpr, BD: tl.constexpr):
    """This program's (chunk, head, batch) tile of a strided (B, H, S, D) tensor in fp32 (0 outside)."""
    return _load_tile(X, tl.program_id(2).to(tl.int64), s_len, d_len, sxb, sxh, sxs, sxd, BLK, BD)


@triton.jit
def _reduce_kernel(X, Amax, CMax, CMin, s_len, d_len, H, n_chunk, sxb, sxh, sxs, sxd,
                   BLK: tl.constexpr, BD: tl.constexpr, CHANNEL: tl.constexpr):
    x, r, cols, inside = _tile(X, s_len, d_len, sxb, sxh, sxs, sxd, BLK, BD)
    part = (tl.program_id(2) * H + tl.program_id(1)) * n_chunk + tl.program_id(0)
    if CHANNEL:  # per-channel max and min of the chunk (K smoothing: the amax of K - mean follows from them)
        tl.store(CMax + part * d_len + cols, tl.max(tl.where(inside, x, float("-inf")), axis=0), mask=cols < d_len)
        tl.store(CMin + part * d_len + cols, tl.min(tl.where(inside, x, float("inf")), axis=0), mask=cols < d_len)
    else:  # what lies outside loads as 0, which never raises a max of absolute values
        tl.store(Amax + part, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def _quant_kernel(X, Out, Descale, Mean, s_len, d_len, H, sxb, sxh, sxs, sxd, sob, soh, sos, sod,
                  BLK: tl.constexpr, BD: tl.constexpr, HAS_MEAN: tl.constexpr, FIX: tl.constexpr):
    x, r, cols, inside = _tile(X, s_len, d_len, sxb, sxh, sxs, sxd, BLK, BD)
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    bh = b * H + h
    if HAS_MEAN:
        x = x - tl.load(Mean + bh * d_len + cols, mask=cols < d_len, other=0.0)[None, :]
    _store_e4m3(Out, b, h, c, sob, soh, sos, sod, x, tl.load(Descale + bh), r, cols, inside, BLK, FIX)


@triton.jit
def _store_e4m3(Out, b, h, c, sob, soh, sos, sod, x, d, r, cols, inside, BLK: tl.constexpr, FIX: tl.constexpr):
    """``x / d`` clamped to ±448 and rounded to e4m3, stored at chunk ``c`` of head ``h`` of batch ``b`` (both
    quantization kernels: one copy of the numerics that must match the eager path bit for bit)."""
    y = tl.math.div_rn(x, tl.zeros_like(x) + d)  # IEEE division: the eager path's x / descale, bit for bit
    yq = to_e4m3(tl.clamp(y, -448.0, 448.0), FIX)
    base = Out + b * sob + h.to(tl.int64) * soh + (c * BLK).to(tl.int64) * sos
    tl.store(base + r[:, None] * sos + cols[None, :] * sod, yq, mask=inside)


@triton.jit
def _slot(bt, Q, K, V, sq, sk, sv, hq, hk, hv,
          sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd):
    """Which of Q, K, V program axis 2 (batch * 3 + tensor) points at: (tensor index, batch, pointer, length,
    heads, strides)."""
    t = bt % 3
    b = (bt // 3).to(tl.int64)
    if t == 0:
        X, s_len, n_h, sxb, sxh, sxs, sxd = Q, sq, hq, sqb, sqh, sqs, sqd
    elif t == 1:
        X, s_len, n_h, sxb, sxh, sxs, sxd = K, sk, hk, skb, skh, sks, skd
    else:
        X, s_len, n_h, sxb, sxh, sxs, sxd = V, sv, hv, svb, svh, svs, svd
    return t, b, X, s_len, n_h, sxb, sxh, sxs, sxd


@triton.jit
def _centred(x, Mean, t, b, h, B, HM, d_len, cols, inside, HAS_MEAN: tl.constexpr):
    """``x`` minus its tensor's (batch, head) mean row where the pre-pass smooths (``Mean``: (3, B, HM, D) fp32,
    zeros for a tensor not smoothed: x - 0 is x exactly), 0 outside the tile."""
    if HAS_MEAN:
        m = tl.load(Mean + ((t * B + b) * HM + h) * d_len + cols, mask=cols < d_len, other=0.0)
        x = tl.where(inside, x - m[None, :], 0.0)
    return x


@triton.jit
def _qkv_amax_kernel(Q, K, V, Amax, Mean, sq, sk, sv, hq, hk, hv, d_len, B, HM,
                     sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                     BLK: tl.constexpr, BD: tl.constexpr, HAS_MEAN: tl.constexpr):
    t, b, X, s_len, n_h, sxb, sxh, sxs, sxd = _slot(tl.program_id(2), Q, K, V, sq, sk, sv, hq, hk, hv,
                                                    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd)
    h = tl.program_id(1)
    if (tl.program_id(0) * BLK < s_len) & (h < n_h):
        x, r, cols, inside = _load_tile(X, b, s_len, d_len, sxb, sxh, sxs, sxd, BLK, BD)
        x = _centred(x, Mean, t, b, h, B, HM, d_len, cols, inside, HAS_MEAN)
        # |x| >= 0, so a float max is order-free and exact: the head's amax whatever order the chunks land in
        tl.atomic_max(Amax + (t * B + b) * HM + h, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def _qkv_quant_kernel(Q, K, V, QO, KO, VO, Descale, Mean, sq, sk, sv, hq, hk, hv, d_len, B, HM,
                      sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                      oqb, oqh, oqs, oqd, okb, okh, oks, okd, ovb, ovh, ovs, ovd,
                      BLK: tl.constexpr, BD: tl.constexpr, FIX: tl.constexpr, HAS_MEAN: tl.constexpr):
    t, b, X, s_len, n_h, sxb, sxh, sxs, sxd = _slot(tl.program_id(2), Q, K, V, sq, sk, sv, hq, hk, hv,
                                                    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd)
    _, _, O, _, _, sob, soh, sos, sod = _slot(tl.program_id(2), QO, KO, VO, sq, sk, sv, hq, hk, hv,
                                              oqb, oqh, oqs, oqd, okb, okh, oks, okd, ovb, ovh, ovs, ovd)
    c = tl.program_id(0)
    h = tl.program_id(1)
    if (c * BLK < s_len) & (h < n_h):
        x, r, cols, inside = _load_tile(X, b, s_len, d_len, sxb, sxh, sxs, sxd, BLK, BD)
        x = _centred(x, Mean, t, b, h, B, HM, d_len, cols, inside, HAS_MEAN)
        _store_e4m3(O, b, h, c, sob, soh, sos, sod, x, tl.load(Descale + (t * B + b) * HM + h), r, cols, inside,
                    BLK, FIX)


def _grid(x: torch.Tensor):
    b, h, s, _ = x.shape
    return (triton.cdiv(s, CHUNK), h, b)


def _bd(d: int) -> int:
    return triton.next_power_of_2(d)  # FA3's head dims 96 and 192 run in 128- and 256-wide tiles, masked


def _amax(x: torch.Tensor, mean: Optional[torch.Tensor]) -> torch.Tensor:
    """max |x [- mean]| per (batch, head), (B, H) fp32, from one read of ``x``."""
    b, h, s, d = x.shape
    n = triton.cdiv(s, CHUNK)
    if mean is None:
        part = torch.empty((b, h, n), device=x.device, dtype=torch.float32)
        _launch(_reduce_kernel, _grid(x), x, part, part, part, s, d, h, n, *x.stride(), BLK=CHUNK, BD=_bd(d),
                CHANNEL=False, num_warps=WARPS)
        return part.amax(dim=-1)
    cmax = torch.empty((b, h, n, d), device=x.device, dtype=torch.float32)
    cmin = torch.empty_like(cmax)
    _launch(_reduce_kernel, _grid(x), x, cmax, cmax, cmin, s, d, h, n, *x.stride(), BLK=CHUNK, BD=_bd(d),
            CHANNEL=True, num_warps=WARPS)
    m = mean.reshape(b, h, d)
    return torch.maximum((cmax.amax(dim=2) - m).abs(), (cmin.amin(dim=2) - m).abs()).amax(dim=-1)


def quantize_bh(x: torch.Tensor, mean: Optional[torch.Tensor] = None):
    """(e4m3 tensor of x's shape and layout, descale (B, H) fp32): ``numerics.quantize_fp8(x [- mean], "bh")``'s
    values and FA3-shaped descale. ``mean``: (B, H, 1, D) fp32 subtracted first (``numerics.smoothing_mean``)."""
    if x.dim() != 4:
        raise ValueError(f"quantize_bh takes (B, H, S, D), got {tuple(x.shape)}")
    b, h, s, d = x.shape
    descale = N.fp8_descale(_amax(x, mean)).contiguous()
    out = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    mean_arg = descale if mean is None else mean.reshape(b, h, d).contiguous()
    _launch(_quant_kernel, _grid(x), x, out, descale, mean_arg, s, d, h, *x.stride(), *out.stride(), BLK=CHUNK,
            BD=_bd(d), HAS_MEAN=mean is not None, FIX=INTERPRETED, num_warps=WARPS)
    return out, descale


def _fusable(q, k, v) -> bool:
    return (q.dim() == k.dim() == v.dim() == 4 and q.dtype == k.dtype == v.dtype
            and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[-1] == k.shape[-1] == v.shape[-1])


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_mean: Optional[torch.Tensor] = None,
                 v_mean: Optional[torch.Tensor] = None) -> N.Fp8Inputs:
    """Q, K and V together in two kernel launches (one amax, one quantization), a memset and one ``fp8_descale``
    for the three, where ``prepass``'s per-tensor form takes six launches and ~15 small torch ops: at Wan 1.3B the
    launches, not the bytes, were most of its 0.58 ms. Same values and scales, bit for bit (the amax is an atomic
    float max of non-negative values: exact in any order; the scales come from the eager path's own function).
    ``k_mean`` / ``v_mean`` ((B, H, 1, D) fp32, ``numerics.smoothing_mean``): subtracted in both launches, the
    same fp32 subtraction as the eager path's."""
    b, d = q.shape[0], q.shape[-1]
    heads = [t.shape[1] for t in (q, k, v)]
    lens = [t.shape[2] for t in (q, k, v)]
    hm = max(heads)
    amax = torch.zeros((3, b, hm), device=q.device, dtype=torch.float32)
    outs = [torch.empty_like(t, dtype=torch.float8_e4m3fn) for t in (q, k, v)]
    smooth = k_mean is not None or v_mean is not None
    mean = amax  # an unused pointer without smoothing
    if smooth:
        mean = torch.zeros((3, b, hm, d), device=q.device, dtype=torch.float32)
        for i, m in ((1, k_mean), (2, v_mean)):
            if m is not None:
                mean[i, :, :m.shape[1]] = m.reshape(b, m.shape[1], d)
    grid = (triton.cdiv(max(lens), CHUNK), hm, 3 * b)
    common = (*lens, *heads, d, b, hm, *q.stride(), *k.stride(), *v.stride())
    _launch(_qkv_amax_kernel, grid, q, k, v, amax, mean, *common, BLK=CHUNK, BD=_bd(d), HAS_MEAN=smooth,
            num_warps=WARPS)
    # the scales by the same torch call as the eager path, once for the three tensors: CUDA's tensor / scalar is
    # a multiplication by the reciprocal, so an IEEE division in the kernel would differ in the last bit
    descale = N.fp8_descale(amax)
    _launch(_qkv_quant_kernel, grid, q, k, v, *outs, descale, mean, *common, *outs[0].stride(), *outs[1].stride(),
            *outs[2].stride(), BLK=CHUNK, BD=_bd(d), FIX=INTERPRETED, HAS_MEAN=smooth, num_warps=WARPS)
    scales = [descale[i, :, :n].contiguous() for i, n in enumerate(heads)]  # a copy only for fewer (GQA) heads
    return N.Fp8Inputs(*outs, *scales, k_mean, v_mean=v_mean)


def prepass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_k: bool = False,
            smooth_v: bool = False) -> N.Fp8Inputs:
    """``numerics.fp8_bh_inputs(q, k, v, smooth_k=..., smooth_v=...)`` in Triton: Q, K, V read twice each (K or V
    once more for its mean when smoothed), written once in e4m3, all three in one pair of launches
    (``quantize_qkv``) where their shapes allow; else each tensor through its own pair."""
    km = N.smoothing_mean(k) if smooth_k else None
    vm = N.smoothing_mean(v) if smooth_v else None
    if _fusable(q, k, v):
        return quantize_qkv(q, k, v, km, vm)
    q8, qd = quantize_bh(q)
    k8, kd = quantize_bh(k, km)
    v8, vd = quantize_bh(v, vm)
    return N.Fp8Inputs(q8, k8, v8, qd, kd, vd, km, v_mean=vm)


def aot_specs(d: int = 128, causal: bool = False, config: dict | None = None) -> dict:
    """label -> (jit function, pointer types by name (others: i32), constexprs by name, compile options) of the
    pre-pass kernels at BD 128, what ``vdbench.kernels.aot --helpers`` compiles (the arguments are the attention
    kernels' and mean nothing here)."""
    red = {"X": "*bf16", "Amax": "*fp32", "CMax": "*fp32", "CMin": "*fp32"}
    quant = {"X": "*bf16", "Out": "*fp8e4nv", "Descale": "*fp32", "Mean": "*fp32"}
    qkv = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "QO": "*fp8e4nv", "KO": "*fp8e4nv", "VO": "*fp8e4nv",
           "Amax": "*fp32", "Descale": "*fp32", "Mean": "*fp32"}
    opts = dict(num_warps=8)
    return {
        "fa3_prepass.reduce": (_reduce_kernel, red, dict(BLK=CHUNK, BD=128, CHANNEL=False), opts),
        "fa3_prepass.reduce[channel]": (_reduce_kernel, red, dict(BLK=CHUNK, BD=128, CHANNEL=True), opts),
        "fa3_prepass.quant": (_quant_kernel, quant, dict(BLK=CHUNK, BD=128, HAS_MEAN=False, FIX=False), opts),
        "fa3_prepass.quant[mean]": (_quant_kernel, quant, dict(BLK=CHUNK, BD=128, HAS_MEAN=True, FIX=False), opts),
        "fa3_prepass.qkv_amax": (_qkv_amax_kernel, qkv, dict(BLK=CHUNK, BD=128, HAS_MEAN=False), opts),
        "fa3_prepass.qkv_quant": (_qkv_quant_kernel, qkv, dict(BLK=CHUNK, BD=128, FIX=False, HAS_MEAN=False), opts),
        "fa3_prepass.qkv_amax[mean]": (_qkv_amax_kernel, qkv, dict(BLK=CHUNK, BD=128, HAS_MEAN=True), opts),
        "fa3_prepass.qkv_quant[mean]": (_qkv_quant_kernel, qkv, dict(BLK=CHUNK, BD=128, FIX=False, HAS_MEAN=True),
                                        opts),
    }
