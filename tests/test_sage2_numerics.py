"""SageAttention 2's emulated numerics (vdbench/sage2_numerics.py) against fp64 attention and against each other.

Why these tests: the emulation is the yardstick the real sagev2 kernels are judged by on the GPU (its error should be
within ~10% of the kernel's), and the stand-in that renders SageAttention 2's error where the kernel can't run. So it
must (a) be close to exact attention by the amount the algorithm allows and no closer, (b) order its variants the
way their numerics imply (fp16 P·V beats fp8 P·V, finer scale groups beat coarser ones, smoothing beats no smoothing
when K has a bias, FP22-throughout accumulation loses mass that the fp32 buffer keeps), (c) use the library's LSE
convention exactly (natural log, K-mean correction included), and (d) be a well-behaved function: inputs untouched,
chunking-independent, causal/GQA/odd shapes right, unsupported variants refused by name.
"""

import math

import pytest
import torch

from vdbench import sage2_numerics as S
from vdbench.sage2_numerics import exact_attention_fp64, rel_l2, sagev2_emulated

SEEDS = range(4)


def make_qkv(seed, *, b=1, h=2, sq=320, sk=None, d=64, hkv=None, bias=3.0, dtype=torch.bfloat16):
    """Gaussian q, k, v with a per-channel bias on K (the case K smoothing exists for)."""
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    hkv = h if hkv is None else hkv
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g) + bias * torch.randn(d, generator=g)
    v = torch.randn(b, hkv, sk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def err(seed, **cfg):
    q, k, v = make_qkv(seed, **{key: cfg.pop(key) for key in list(cfg) if key in ("sq", "sk", "d", "bias", "h")})
    return rel_l2(sagev2_emulated(q, k, v, **cfg), exact_attention_fp64(q, k, v))


# ---- building blocks ------------------------------------------------------------------------------------------


def test_per_thread_groups_follow_the_mma_fragment_layout():
    # Q: inside each warp block, row r -> r mod 8; K: inside each block, row r -> (r mod 8) div 2
    gq = S.qk_group_index(64, "per_thread", 32, "q")
    assert gq[:16].tolist() == [0, 1, 2, 3, 4, 5, 6, 7] * 2
    assert gq[32:40].tolist() == list(range(8, 16))
    assert torch.bincount(gq).tolist() == [4] * 16  # 4 rows per Q scale at warp_q = 32
    gk = S.qk_group_index(256, "per_thread", 128, "k")
    assert gk[:10].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    assert torch.bincount(gk).tolist() == [32] * 8  # sm90: 32 rows per K scale
    assert S.qk_group_index(70, "per_warp", 16, "q").tolist() == [i // 16 for i in range(70)]


def test_int8_quantizers_match_their_rounding_rules():
    grp = torch.zeros(1, dtype=torch.long)
    ties = torch.tensor([[[127.0, 2.5, -2.5, 3.5]]])  # amax 127: scale 1, so x itself is the quantized value
    xi, sc = S.quantize_int8_groups(ties, grp, "cuda")  # cvt.rni: half to even
    assert sc.item() == 1.0 and xi.flatten().tolist() == [127, 2, -2, 4]
    xi, sc = S.quantize_int8_groups(ties, grp, "triton_block")  # +0.5*sign then truncate: half away from zero
    assert sc.item() == 1.0 and xi.flatten().tolist() == [127, 3, -3, 4]
    xi, sc = S.quantize_int8_groups(ties, grp, "triton_thread")  # same rounding, scale carries +1e-7
    assert sc.item() == pytest.approx(1.0 + 1e-7) and xi.abs().max().item() == 127
    # the CUDA rule floors amax at 1e-7 instead of adding it
    xi, sc = S.quantize_int8_groups(torch.full((1, 1, 4), 1e-9), grp, "cuda")
    assert sc.item() == pytest.approx(1e-7 / 127, rel=1e-6) and (xi == 1).all()  # 1e-9 / (1e-7/127) = 1.27
    # error bound: |x - int*scale| <= scale/2 (+ the epsilon of the Triton rule)
    xr = torch.randn(1, 2, 96, 64)
    g = S.qk_group_index(96, "per_thread", 32, "q")
    for rule in ("cuda", "triton_thread"):
        xi, sc = S.quantize_int8_groups(xr, g, rule)
        assert ((xi * sc.unsqueeze(-1) - xr).abs() <= sc.unsqueeze(-1) * 0.5001 + 1e-6).all()
        assert xi.abs().amax(dim=-1).max() == 127  # each group's largest row uses the full range


def test_all_zero_group_quantizes_to_zero():
    x = torch.zeros(1, 1, 8, 16)
    for rule in ("cuda", "triton_thread", "triton_block"):
        xi, sc = S.quantize_int8_groups(x, torch.zeros(8, dtype=torch.long), rule)
        assert torch.isfinite(sc).all() and (xi == 0).all()


def test_fp22_keeps_13_mantissa_bits_toward_zero():
    x = torch.tensor([1.0 + 2.0 ** -13, 1.0 + 2.0 ** -14 + 2.0 ** -20, -(1.0 + 2.0 ** -14), 3.0, 0.0])
    assert S.fp22_truncate(x).tolist() == [1.0 + 2.0 ** -13, 1.0, -1.0, 3.0, 0.0]
    r = torch.rand(1000) * 100
    t = S.fp22_truncate(r)
    assert (t <= r).all() and ((r - t) / r < 2.0 ** -13).all()


def test_e4m3_round_saturates_and_rounds_to_three_mantissa_bits():
    x = torch.tensor([448.0, 460.0, 1000.0, -1000.0, 1.0625, 1.1875, 17.0])
    assert S.e4m3_round(x).tolist() == [448.0, 448.0, 448.0, -448.0, 1.0, 1.25, 16.0]


def test_v_fp8_scale_is_per_channel_over_the_sequence():
    v = torch.randn(1, 2, 50, 8) * torch.arange(1, 9)
    v8, sc = S.quantize_v_fp8(v)
    assert sc.shape == (1, 2, 8)
    assert torch.allclose(sc, v.abs().amax(dim=-2) / 448)
    assert v8.abs().amax(dim=-2).eq(448).all()  # every channel uses the full e4m3 range
    assert rel_l2(v8 * sc.unsqueeze(-2), v) < 0.04
    v8, sc = S.quantize_v_fp8(v, S.V_SCALE_MAX_FP16_ACCUM)
    assert v8.abs().max().item() <= 2.25


def test_zero_v_channel_is_nan_like_upstream():
    q, k, v = make_qkv(0, sq=64, d=64)
    v = v.clone()
    v[..., 3] = 0
    o = sagev2_emulated(q, k, v)
    assert torch.isnan(o[..., 3]).all() and torch.isfinite(o[..., :3]).all() and torch.isfinite(o[..., 4:]).all()


# ---- smoothing and the LSE convention in exact arithmetic ---------------------------------------------------------


def test_k_smoothing_is_exact_in_fp64_and_shifts_lse_by_q_dot_mean():
    q, k, _ = make_qkv(1, sq=80, d=64, dtype=torch.float64)
    scale = 64 ** -0.5
    km = k.mean(dim=2, keepdim=True)
    s = q @ k.transpose(-1, -2) * scale
    s_smooth = q @ (k - km).transpose(-1, -2) * scale
    assert torch.allclose(torch.softmax(s, -1), torch.softmax(s_smooth, -1), atol=1e-12, rtol=1e-10)
    corr = (q @ km.transpose(-1, -2)).squeeze(-1) * scale
    assert torch.allclose(torch.logsumexp(s, -1), torch.logsumexp(s_smooth, -1) + corr, atol=1e-10)
    assert corr.abs().max() > 1.0  # the bias is big enough for the correction to matter


# ---- against fp64 ---------------------------------------------------------------------------------------------------

CONFIGS = {
    "sm90_per_thread": dict(pv="fp8", arch="sm90", qk_gran="per_thread"),
    "sm90_per_warp": dict(pv="fp8", arch="sm90", qk_gran="per_warp"),
    "sm89_fp32+fp16": dict(pv="fp8", arch="sm89", qk_gran="per_thread"),
    "sm89_fp32+fp32": dict(pv="fp8", arch="sm89", qk_gran="per_warp", pv_accum="fp32+fp32"),
    "sm89_fp32": dict(pv="fp8", arch="sm89", qk_gran="per_thread", pv_accum="fp32"),
    "sm89_fp32_fp22": dict(pv="fp8", arch="sm89", qk_gran="per_thread", pv_accum="fp32", mma_acc="fp22"),
    "sm80_fp32": dict(pv="fp16", qk_gran="per_thread"),
    "sm80_fp16+fp32": dict(pv="fp16", qk_gran="per_warp", pv_accum="fp16+fp32"),
    "triton": dict(pv="fp16", qk_gran="per_block"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_error_vs_fp64_is_the_algorithms(name):
    cfg = CONFIGS[name]
    q, k, v = make_qkv(0, sq=300, d=128)
    ref = exact_attention_fp64(q, k, v)
    o = sagev2_emulated(q, k, v, **cfg)
    assert o.dtype == q.dtype and o.shape == q.shape
    e = rel_l2(o, ref)
    floor = rel_l2(ref.to(q.dtype), ref)  # bf16 output rounding alone
    # fp8 P (3 mantissa bits, RMS relative rounding ~ 2^-4/sqrt(3) = 3.6%) dominates fp8 P·V; INT8 Q·K dominates fp16
    lo, hi = (0.025, 0.05) if cfg["pv"] == "fp8" else (0.006, 0.02)
    assert lo < e < hi, (name, e)
    assert e > 3 * floor


def test_fp16_pv_beats_fp8_pv():
    for seed in SEEDS:
        e16 = err(seed, pv="fp16", qk_gran="per_thread")
        e8 = err(seed, pv="fp8", qk_gran="per_thread")
        assert e16 < 0.5 * e8, (seed, e16, e8)


def test_per_thread_scales_beat_per_warp_and_per_block():
    for seed in SEEDS:
        thr, warp, blk = (err(seed, pv="fp16", qk_gran=g) for g in ("per_thread", "per_warp", "per_block"))
        assert thr < warp and thr < blk, (seed, thr, warp, blk)
        # with fp8 P·V the P rounding dominates, so only "not worse" holds
        assert err(seed, pv="fp8", qk_gran="per_thread") <= 1.02 * err(seed, pv="fp8", qk_gran="per_warp")


def test_k_smoothing_helps_when_k_has_a_bias():
    for seed in SEEDS:
        for pv in ("fp16", "fp8"):
            on, off = err(seed, pv=pv, smooth_k=True), err(seed, pv=pv, smooth_k=False)
            assert on < off, (seed, pv, on, off)


def test_fp22_throughout_loses_mass_the_fp32_buffer_keeps():
    # the paper's FP22 model (mma_acc="fp22"), positive V: every truncation toward zero lowers the numerator;
    # "fp32" (sm89, no fp32 buffer) truncates at all kv_len/32 steps, "fp32+fp32" only inside each 64-key block
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 512, 64, generator=g).bfloat16()
    k = torch.randn(1, 2, 1024, 64, generator=g).bfloat16()
    v = (torch.rand(1, 2, 1024, 64, generator=g) + 1).bfloat16()
    ref = exact_attention_fp64(q, k, v)
    full = sagev2_emulated(q, k, v, pv="fp8", arch="sm89", pv_accum="fp32", mma_acc="fp22").double()
    buf = sagev2_emulated(q, k, v, pv="fp8", arch="sm89", pv_accum="fp32+fp32", mma_acc="fp22").double()
    assert (full <= buf).all()
    bias_full, bias_buf = ((full - ref) / ref).mean().item(), ((buf - ref) / ref).mean().item()
    assert bias_full < bias_buf < 0 and bias_full < -5e-4


def test_fp32_mma_accumulator_makes_the_fp32_buffer_a_no_op():
    # what the H200 measures: sm89's "fp32" (no buffer) and "fp32+fp32" outputs agree to 1e-6 in rel L2 vs fp64
    q, k, v = make_qkv(12, sq=256, sk=1024, d=64)
    a = sagev2_emulated(q, k, v, pv="fp8", arch="sm89", pv_accum="fp32")
    b = sagev2_emulated(q, k, v, pv="fp8", arch="sm89", pv_accum="fp32+fp32")
    assert torch.equal(a, b)
    c = sagev2_emulated(q, k, v, pv="fp8", arch="sm89", pv_accum="fp32+fp32", mma_acc="fp22")
    assert not torch.equal(b, c) and rel_l2(c, b) < 2e-3  # in-block truncation: small but not nothing


# ---- the LSE --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_lse_is_natural_log_with_the_mean_correction(pv):
    # fp32 inputs: the (q @ km) correction carries no bf16 rounding, so what is left is the INT8 score error
    q, k, v = make_qkv(2, sq=200, d=64, dtype=torch.float32)
    _, lref = exact_attention_fp64(q, k, v, return_lse=True)
    o, lse = sagev2_emulated(q, k, v, pv=pv, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert (lse.double() - lref).abs().max() < 0.01  # base 2 would be off by ~lse*0.44, no correction by ~|q·km|/8
    _, lse_nosmooth = sagev2_emulated(q, k, v, pv=pv, smooth_k=False, return_lse=True)
    assert (lse_nosmooth.double() - lref).abs().max() < 0.2  # right convention, but INT8 K with its bias is coarse
    assert o.shape == q.shape


def test_lse_correction_in_bf16_costs_what_the_notes_say():
    q, k, v = make_qkv(2, sq=200, d=64)
    _, lref = exact_attention_fp64(q, k, v, return_lse=True)
    _, lse = sagev2_emulated(q, k, v, return_lse=True)
    km = k.double().mean(dim=2, keepdim=True)
    bound = (2.0 ** -8 * (q.double() @ km.transpose(-1, -2)).abs().squeeze(-1) * 64 ** -0.5 + 0.01)
    e = (lse.double() - lref).abs()
    assert (e <= bound).all() and e.max() > 0.005  # the bf16 correction is the visible part of the error


# ---- shapes, masks, purity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sq,sk,d", [(77, 131, 40), (200, 333, 72), (129, 65, 128)])
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_causal_odd_lengths_and_sq_ne_sk(sq, sk, d, pv):
    q, k, v = make_qkv(4, sq=sq, sk=sk, d=d)
    ref, lref = exact_attention_fp64(q, k, v, is_causal=True, return_lse=True)
    o, lse = sagev2_emulated(q, k, v, pv=pv, is_causal=True, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    # row 0 sees only key 0: P = 448 (or 1) exactly, so the row is V[0] up to V's own rounding
    assert rel_l2(o[:, :, 0], v[:, :, 0]) < (0.04 if pv == "fp8" else 0.01)
    assert rel_l2(o, ref) < (0.05 if pv == "fp8" else 0.02)
    assert (lse.double() - lref).abs().max() < 0.1
    non = sagev2_emulated(q, k, v, pv=pv)
    assert rel_l2(non, ref) > 0.3  # the mask is really applied


def test_q_offset_emulates_a_slice_of_rows():
    q, k, v = make_qkv(5, sq=512, d=64)
    full = sagev2_emulated(q, k, v, is_causal=True)
    part = sagev2_emulated(q[:, :, 128:384], k, v, is_causal=True, q_offset=128)
    assert torch.equal(part, full[:, :, 128:384])


def test_gqa_equals_repeated_kv_heads():
    q, k, v = make_qkv(6, h=4, hkv=2, sq=150, d=64)
    for cfg in (dict(pv="fp8"), dict(pv="fp16", qk_gran="per_warp")):
        a, la = sagev2_emulated(q, k, v, return_lse=True, **cfg)
        b, lb = sagev2_emulated(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), return_lse=True, **cfg)
        assert torch.equal(a, b) and torch.allclose(la, lb, atol=1e-6)


def test_chunking_does_not_change_the_result():
    q, k, v = make_qkv(7, sq=260, d=64)
    for cfg in (dict(pv="fp8"), dict(pv="fp8", arch="sm89", pv_accum="fp32", mma_acc="fp22"), dict(pv="fp16"),
                dict(pv="fp8", arch="sm89")):
        a, la = sagev2_emulated(q, k, v, return_lse=True, **cfg)
        b, lb = sagev2_emulated(q, k, v, return_lse=True, chunk_bytes=1, **cfg)  # one row at a time
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=0) and rel_l2(a, b) < 1e-3
        assert torch.allclose(la, lb, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inputs_are_not_modified(name):
    q, k, v = make_qkv(8, sq=96, d=64)
    before = [t.clone() for t in (q, k, v)]
    sagev2_emulated(q, k, v, return_lse=True, is_causal=True, **CONFIGS[name])
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


def test_batch_and_head_rows_are_independent():
    q, k, v = make_qkv(9, b=2, h=3, sq=70, d=64)
    both = sagev2_emulated(q, k, v)
    one = sagev2_emulated(q[1:, 2:], k[1:, 2:], v[1:, 2:])
    assert torch.equal(both[1:, 2:], one)


def test_scale_argument_is_used():
    q, k, v = make_qkv(10, sq=64, d=64, bias=0.0)
    ref = exact_attention_fp64(q, k, v, scale=0.3)
    assert rel_l2(sagev2_emulated(q, k, v, scale=0.3, pv="fp16"), ref) < 0.02
    assert rel_l2(sagev2_emulated(q, k, v, pv="fp16"), ref) > 0.1


# ---- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,words", [
    (dict(pv="fp8", arch="sm90", pv_accum="fp32"), ["fp32+fp32"]),
    (dict(pv="fp16", pv_accum="fp16"), ["fp32", "fp16+fp32"]),
    (dict(pv="fp8", arch="sm100"), ["sm89", "sm90"]),
    (dict(pv="fp8", qk_gran="per_block"), ["Triton", "fp16"]),
    (dict(qk_gran="per_lane"), ["per_thread"]),
    (dict(pv="int4"), ["fp8"]),
    (dict(mma_acc="fp16"), ["fp32", "fp22"]),
])
def test_unemulated_variants_are_refused_by_name(cfg, words):
    q, k, v = make_qkv(0, sq=16, d=64)
    with pytest.raises(ValueError) as exc:
        sagev2_emulated(q, k, v, **cfg)
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_head_dim_over_128_is_refused_like_the_kernel():
    q, k, v = make_qkv(0, sq=16, d=160)
    with pytest.raises(ValueError, match="128"):
        sagev2_emulated(q, k, v)


def test_default_accumulation_is_each_kernels_default():
    q, k, v = make_qkv(11, sq=64, d=64)
    for cfg, default in ((dict(pv="fp8", arch="sm89"), "fp32+fp16"), (dict(pv="fp8"), "fp32+fp32"),
                         (dict(pv="fp16"), "fp32"), (dict(pv="fp16", qk_gran="per_block"), "fp16+fp32")):
        assert torch.equal(sagev2_emulated(q, k, v, **cfg), sagev2_emulated(q, k, v, pv_accum=default, **cfg))
    assert math.isclose(S.FP8_EXP_OFFSET, math.log2(448), abs_tol=1e-3)
