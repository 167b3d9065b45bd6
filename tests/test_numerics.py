"""vdbench.numerics: exact attention against hand-computed values, the quantizers, and the emulations' error."""

import math

import pytest
import torch

from vdbench import numerics as N

from tests.attention_data import qkv, rel_l2


def test_exact_attention_against_hand_computed_softmax():
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    # scores = [1, 0]/sqrt(2); weights = softmax
    w0 = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)
    expect = torch.tensor([w0 * 1 + (1 - w0) * 3, w0 * 2 + (1 - w0) * 4], dtype=torch.float64)
    assert torch.allclose(N.exact_attention(q, k, v)[0, 0, 0], expect, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_causal_and_scale(causal):
    q, k, v = qkv(s=64)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                                           scale=0.3)
    out = N.reference_attention(q, k, v, is_causal=causal, scale=0.3)
    assert rel_l2(out, ref) < 1e-6


def test_causal_mask_is_bottom_right_aligned():
    m = N.causal_mask(2, 4, "cpu")
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert N.query_chunk(torch.empty(1, 2, 10, 4), sk=8, itemsize=4, budget_bytes=2 * 8 * 4 * 3) == 3


def test_emulations_are_lossier_than_bf16_but_ordered():
    """SageAttention's INT8 with smoothing beats e4m3 everywhere; both are worse than plain bf16 sdpa."""
    q, k, v = qkv(s=300, d=128, dtype=torch.bfloat16, k_bias=4.0, seed=3)
    ref = N.exact_attention(q, k, v)
    e_sdpa = rel_l2(torch.nn.functional.scaled_dot_product_attention(q, k, v), ref)
    e_sage = rel_l2(N.sagev1_emulated(q, k, v), ref)
    e_fp8 = rel_l2(N.fp8_emulated(q, k, v), ref)
    assert e_sdpa < e_sage < e_fp8
    assert 1e-3 < e_sage < 3e-2
    assert 1e-2 < e_fp8 < 1.5e-1


def test_k_smoothing_is_what_keeps_sage_accurate():
    q, k, v = qkv(s=256, d=64, k_bias=8.0, seed=5)
    ref = N.exact_attention(q, k, v)
    smooth = rel_l2(N.sagev1_emulated(q, k, v), ref)
    raw = rel_l2(N.sagev1_emulated(q, k, v, smooth_k=False), ref)
    assert smooth < raw / 2


def test_int8_quantization_per_block():
    x = torch.zeros(1, 1, 5, 2)
    x[0, 0, :, 0] = torch.tensor([1.0, -2.0, 0.5, 4.0, -1.27])
    qv, scale = N.quantize_int8_per_block(x, block=3)
    # block 0 = tokens 0..2 (amax 2.0), block 1 = tokens 3..4 plus one padding row (amax 4.0)
    assert torch.allclose(scale.flatten(), torch.tensor([2.0 / 127, 4.0 / 127]))
    assert qv[0, 0, :5, 0].tolist() == [64.0, -127.0, 32.0, 127.0, -40.0]  # 63.5 -> 64 (half away from 0)
    assert qv.abs().max() <= 127


def test_fp8_scales_match_fa3_shapes():
    q, _, _ = qkv(b=2, h=3, s=70)
    x8, descale, fa3 = N.quantize_fp8(q, "bh")
    assert x8.dtype == torch.float8_e4m3fn and fa3.shape == (2, 3)
    assert torch.allclose(fa3, q.abs().amax(dim=(-1, -2)) / 448.0)
    back = x8.float() * descale
    assert rel_l2(back, q) < 0.05
    x8b, descale_b, fa3_b = N.quantize_fp8(q, "block", block=32)
    assert fa3_b is None and descale_b.shape == (2, 3, 70, 1)
    with pytest.raises(ValueError, match="granularity"):
        N.quantize_fp8(q, "row")


def test_fp8_per_block_scales_and_values():
    x = torch.zeros(1, 1, 3, 2)
    x[0, 0, :, 0] = torch.tensor([448.0, -224.0, 2.0])
    vals, scale = N.quantize_fp8_per_block(x, block=2)
    assert scale.shape == (1, 1, 2) and torch.allclose(scale.flatten(), torch.tensor([1.0, 2.0 / 448]))
    assert vals.shape == x.shape and vals[0, 0, :, 0].tolist() == [448.0, -224.0, 448.0]


def test_fp8_emulation_quantizes_p_too():
    """Without rounding P to e4m3 the emulation would be closer to exact: the P rounding is modelled."""
    q, k, v = qkv(s=128, seed=7)
    ref = N.exact_attention(q, k, v)
    full = rel_l2(N.fp8_emulated(q, k, v), ref)
    q8, qd, _ = N.quantize_fp8(q)
    k8, kd, _ = N.quantize_fp8(k)
    v8, vd, _ = N.quantize_fp8(v)
    qkv_only = rel_l2(N.exact_attention(q8.float() * qd, k8.float() * kd, v8.float() * vd), ref)
    assert full > qkv_only


@pytest.mark.parametrize("emulation, bound", [(N.fav3_sage_emulated, 6e-2), (N.fp8_triton_emulated, 9e-2)])
def test_triton_kernel_emulations_are_close_to_exact(emulation, bound):
    q, k, v = qkv(s=130, d=64, dtype=torch.bfloat16, seed=9)
    err = rel_l2(emulation(q, k, v, is_causal=True), N.exact_attention(q, k, v, is_causal=True))
    assert 1e-3 < err < bound


def test_numerics_imports_nothing_of_vdbench():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(N))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("vdbench")]
