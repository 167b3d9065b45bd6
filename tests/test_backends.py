"""The backend registry: names, availability reasons, and every CPU-runnable backend against exact attention."""

import math

import pytest
import torch

from vdbench import backends as B

EXPECTED_NAMES = ["default", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "reference",
                  "sagev1", "fav2", "fav3", "fav3_fp8", "fav3_sage", "fp8_triton", "fav2_triton", "sagev1_emu",
                  "fp8_emu"]


def rel_l2(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def qkv(b=1, h=2, s=200, d=64, sk=None, dtype=torch.float32, k_bias=2.0, seed=0):
    """Random Q/K/V with a per-channel K bias, as real K has (SageAttention's reason to smooth K)."""
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, h, sk, d, generator=g) + k_bias * torch.randn(d, generator=g)
    v = torch.randn(b, h, sk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_names_are_the_shared_vocabulary():
    assert B.names() == EXPECTED_NAMES
    with pytest.raises(KeyError, match="valid: default, sdpa"):
        B.get_backend("nope")


def test_unavailable_backends_say_why_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, reason = B.availability("sdpa_cudnn", "cpu")
    assert not ok and "CUDA" in reason
    for name in ("fav3_sage", "fp8_triton", "fav2_triton"):  # the project's Triton kernels
        ok, reason = B.availability(name, "cpu")
        assert not ok and ("package not installed: triton" in reason or "TRITON_INTERPRET=1" in reason)
    for name in ("sagev1", "fav2", "fav3", "fav3_fp8"):
        ok, reason = B.availability(name, "cpu")
        assert not ok
        # either the package is missing or (if someone installed it) there is no CUDA here
        assert "package not installed" in reason or "CUDA" in reason


def test_head_dim_and_dtype_reasons(monkeypatch):
    # pretend the package is installed and a Hopper GPU is present: the remaining reasons are dtype/head dim
    monkeypatch.setattr(B.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert B.availability("fav3", "cuda", torch.bfloat16, 128) == (True, "ok")
    ok, reason = B.availability("fav3", "cuda", torch.float16, 128)
    assert not ok and "float16 unsupported" in reason
    ok, reason = B.availability("sagev1", "cuda", torch.bfloat16, 32)
    assert not ok and "head dim 32" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    ok, reason = B.availability("fav3", "cuda", torch.bfloat16, 128)
    assert not ok and "Hopper" in reason


def test_cpu_available_set(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # with it (and triton), the Triton kernels join the set
    assert B.available_names("cpu", torch.float32) == ["default", "sdpa", "sdpa_flash", "sdpa_math", "reference",
                                                      "sagev1_emu", "fp8_emu"]


def test_capability_table_lists_every_backend_with_reason():
    table = B.capability_table("cpu")
    for name in EXPECTED_NAMES:
        assert f"\n{name} " in table
    assert "needs a CUDA GPU" in table and "BHSD" in table


def test_reference_matches_fp64_exactly_enough():
    q, k, v = qkv(s=173, sk=91)  # odd, different lengths
    ref = B.exact_attention(q, k, v)
    out = B.get_backend("reference")(q, k, v)
    assert out.dtype == torch.float32
    assert rel_l2(out, ref) < 1e-6


def test_exact_attention_against_hand_computed_softmax():
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    # scores = [1, 0]/sqrt(2); weights = softmax
    w0 = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)
    expect = torch.tensor([w0 * 1 + (1 - w0) * 3, w0 * 2 + (1 - w0) * 4], dtype=torch.float64)
    assert torch.allclose(B.exact_attention(q, k, v)[0, 0, 0], expect, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_causal_and_scale(causal):
    q, k, v = qkv(s=64)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                                           scale=0.3)
    out = B.reference_attention(q, k, v, is_causal=causal, scale=0.3)
    assert rel_l2(out, ref) < 1e-6


# expected error of each CPU-runnable backend vs fp64, on bf16 inputs with K bias (float32 compute for emus)
CPU_BOUNDS = {"sdpa": 1e-2, "sdpa_flash": 1e-2, "sdpa_math": 1e-2, "reference": 1e-2, "default": 1e-2,
              "sagev1_emu": 3e-2, "fp8_emu": 1.5e-1}


@pytest.mark.parametrize("name", sorted(CPU_BOUNDS))
def test_cpu_backends_against_fp64(name):
    q, k, v = qkv(s=257, dtype=torch.bfloat16)  # not a block multiple
    ref = B.exact_attention(q, k, v)
    out = B.get_backend(name)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = rel_l2(out, ref)
    assert err < CPU_BOUNDS[name], f"{name}: rel L2 {err:.3e}"


def test_emulations_are_lossier_than_bf16_but_ordered():
    """SageAttention's INT8 with smoothing beats e4m3 everywhere; both are worse than plain bf16 sdpa."""
    q, k, v = qkv(s=300, d=128, dtype=torch.bfloat16, k_bias=4.0, seed=3)
    ref = B.exact_attention(q, k, v)
    e_sdpa = rel_l2(B.get_backend("sdpa")(q, k, v), ref)
    e_sage = rel_l2(B.sagev1_emulated(q, k, v), ref)
    e_fp8 = rel_l2(B.fp8_emulated(q, k, v), ref)
    assert e_sdpa < e_sage < e_fp8
    assert 1e-3 < e_sage < 3e-2
    assert 1e-2 < e_fp8 < 1.5e-1


def test_k_smoothing_is_what_keeps_sage_accurate():
    q, k, v = qkv(s=256, d=64, k_bias=8.0, seed=5)
    ref = B.exact_attention(q, k, v)
    smooth = rel_l2(B.sagev1_emulated(q, k, v), ref)
    raw = rel_l2(B.sagev1_emulated(q, k, v, smooth_k=False), ref)
    assert smooth < raw / 2


def test_int8_quantization_per_block():
    x = torch.zeros(1, 1, 5, 2)
    x[0, 0, :, 0] = torch.tensor([1.0, -2.0, 0.5, 4.0, -1.27])
    qv, scale = B.quantize_int8_per_block(x, block=3)
    # block 0 = tokens 0..2 (amax 2.0), block 1 = tokens 3..4 plus one padding row (amax 4.0)
    assert torch.allclose(scale.flatten(), torch.tensor([2.0 / 127, 4.0 / 127]))
    assert qv[0, 0, :5, 0].tolist() == [64.0, -127.0, 32.0, 127.0, -40.0]  # 63.5 -> 64 (half away from 0)
    assert qv.abs().max() <= 127


def test_fp8_scales_match_fa3_shapes():
    q, _, _ = qkv(b=2, h=3, s=70)
    x8, descale, fa3 = B.quantize_fp8(q, "bh")
    assert x8.dtype == torch.float8_e4m3fn and fa3.shape == (2, 3)
    assert torch.allclose(fa3, q.abs().amax(dim=(-1, -2)) / 448.0)
    back = x8.float() * descale
    assert rel_l2(back, q) < 0.05
    x8b, descale_b, fa3_b = B.quantize_fp8(q, "block", block=32)
    assert fa3_b is None and descale_b.shape == (2, 3, 70, 1)
    with pytest.raises(ValueError, match="granularity"):
        B.quantize_fp8(q, "row")


def test_fp8_emulation_quantizes_p_too():
    """Without rounding P to e4m3 the emulation would be closer to exact: the P rounding is modelled."""
    q, k, v = qkv(s=128, seed=7)
    ref = B.exact_attention(q, k, v)
    full = rel_l2(B.fp8_emulated(q, k, v), ref)
    q8, qd, _ = B.quantize_fp8(q)
    k8, kd, _ = B.quantize_fp8(k)
    v8, vd, _ = B.quantize_fp8(v)
    qkv_only = rel_l2(B.exact_attention(q8.float() * qd, k8.float() * kd, v8.float() * vd), ref)
    assert full > qkv_only


def test_check_call_refuses_what_backend_cannot_serve():
    q, k, v = qkv(s=16, d=32)
    sage = B.get_backend("sagev1_emu")
    with pytest.raises(B.UnsupportedCall, match="attention mask"):
        sage.check_call(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(B.UnsupportedCall, match="dropout"):
        sage.check_call(q, k, v, dropout_p=0.1)
    with pytest.raises(B.UnsupportedCall, match="head dim 32"):
        B.get_backend("sagev1").check_call(q, k, v)
    with pytest.raises(B.UnsupportedCall, match="float32"):
        B.get_backend("fav3").check_call(q, k, v)
    B.get_backend("sdpa").check_call(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))


def test_reserved_backend_cannot_be_called():
    q, k, v = qkv(s=8, d=32)
    reserved = B.Backend("future", "a kernel not built yet", fn=None, kernel="x", reserved="reserved for later")
    with pytest.raises(B.BackendUnavailable, match="reserved"):
        reserved(q, k, v)


def test_sdpa_kernel_choice_names_a_kernel():
    q, k, v = qkv(s=32, d=32)
    assert B.sdpa_kernel_choice(q, k, v) in {"flash", "math", "efficient", "cudnn"}


def test_forced_sdpa_kernel_raises_instead_of_falling_back():
    q, k, v = qkv(s=32, d=32)
    with pytest.raises(RuntimeError):
        B.get_backend("sdpa_efficient")(q, k, v)  # no memory-efficient kernel on CPU
