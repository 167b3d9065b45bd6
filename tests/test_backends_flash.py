"""fav3_fp8 (vdbench/backends/flash.py) on a CPU with a stand-in FA3 module: what it hands the kernel, its option,
its log-sum-exp form with smoothing, and the label that says which pre-pass ran.

Why: FA3 runs only on Hopper; the quantization, the option and the LSE correction around it are ours and are checked
here, against exact attention, with a stand-in that computes exact attention on the dequantized e4m3 operands
(tests/fake_packages.py). The Triton pre-pass itself is checked against the eager one in
tests/test_kernels_fp8_prepass.py; on a CPU the backend takes the eager one and says so in its label.
"""

import importlib.util
import sys

import pytest
import torch

from vdbench import backends as B
from vdbench import numerics as N

from tests import fake_packages as F
from tests.attention_data import qkv, rel_l2


@pytest.fixture
def fa3(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    # a real FA3 elsewhere on the path must not be picked up first
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "flash_attn_interface" else real(n, *a))
    F.install_fa3(tmp_path, monkeypatch)
    import fa3_fwd_interface

    yield fa3_fwd_interface
    F.forget("fa3_fwd_interface")


@pytest.mark.parametrize("name", ["fav3_fp8", "fav3_fp8:smooth_k=1"])
def test_fav3_fp8_hands_fa3_e4m3_operands_and_leaves_inputs_alone(fa3, name):
    q, k, v = qkv(s=140, d=64, k_bias=1.0, dtype=torch.bfloat16, seed=3)
    before = [t.clone() for t in (q, k, v)]
    b = B.resolve(name)
    out = b(q, k, v)
    assert fa3.CALLS[-1] == dict(dtype="torch.float8_e4m3fn", descales=True, lse=False)
    assert all(torch.equal(a, t) for a, t in zip(before, (q, k, v)))
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = N.exact_attention(q, k, v)
    assert rel_l2(out, ref) < 0.06  # e4m3 Q, K, V (the stand-in keeps P exact)
    assert b.call_label(q, k, v).endswith(",eager-prepass]")  # no Triton pre-pass on a CPU: the label says so


def test_smoothing_helps_with_a_k_bias_and_its_lse_is_corrected(fa3):
    q, k, v = qkv(s=200, d=64, k_bias=6.0, dtype=torch.bfloat16, seed=5)
    ref, lref = N.exact_attention(q, k, v, return_lse=True)
    plain = rel_l2(B.resolve("fav3_fp8")(q, k, v), ref)
    smooth = rel_l2(B.resolve("fav3_fp8:smooth_k=1")(q, k, v), ref)
    assert smooth < 0.7 * plain
    errs = {}
    for name in ("fav3_fp8", "fav3_fp8:smooth_k=1"):
        out, lse = B.resolve(name).lse.fn(q, k, v)
        assert lse.shape == (1, 2, 200) and lse.dtype == torch.float32
        errs[name] = (lse.double() - lref).abs().max().item()
        assert torch.equal(out, B.resolve(name)(q, k, v))
    # natural log, the mean added back: only the quantization error is left (e4m3 K with its bias: coarse)
    assert errs["fav3_fp8:smooth_k=1"] < 0.05 and errs["fav3_fp8:smooth_k=1"] < errs["fav3_fp8"] < 1.0
    # what the kernel itself returns for the smoothed K is short by q·mean·scale: the correction is doing the work
    x = N.fp8_bh_inputs(q, k, v, smooth_k=True)
    _, raw = sys.modules["fa3_fwd_interface"].flash_attn_func(
        x.q8.transpose(1, 2), x.k8.transpose(1, 2), x.v8.transpose(1, 2), softmax_scale=64 ** -0.5,
        q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale, return_attn_probs=True)
    assert (raw.double() - lref).abs().max() > 1.0


def test_v_smoothing_adds_the_mean_back_and_leaves_the_lse_alone(fa3):
    """V with a large per-channel mean (what pipeline V has): the kernel sees V - mean, the call adds the mean to its
    output (softmax rows sum to 1), so the result is attention of the caller's V, with V's e4m3 step set by the
    centred values; the log-sum-exp does not involve V."""
    q, k, v = qkv(s=200, d=64, dtype=torch.bfloat16, seed=9)
    v = (v.float() + 4.0 * torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(2))).to(v.dtype)
    ref = N.exact_attention(q, k, v)
    plain, smooth = B.resolve("fav3_fp8"), B.resolve("fav3_fp8:smooth_v=1")
    assert rel_l2(smooth(q, k, v), ref) < 0.8 * rel_l2(plain(q, k, v), ref)  # 0.67x here: bf16 output rounding stays
    x = smooth.bench.prepass(q, k, v, None)
    assert torch.equal(x.v_mean, N.smoothing_mean(v)) and x.k_mean is None
    assert x.v8.float().mean(dim=2).abs().max() < 0.05 * 448  # what the kernel got is centred
    (o1, l1), (o2, l2) = plain.lse.fn(q, k, v), smooth.lse.fn(q, k, v)
    assert torch.equal(l1, l2) and torch.equal(o2, smooth(q, k, v))
    assert smooth.twin == "fp8_emu:smooth_v=1" and "smooth_v" in smooth.kernel
    both = B.resolve("fav3_fp8:smooth_k=1+smooth_v=1")
    assert both.twin == "fp8_emu:smooth_k=1+smooth_v=1"
    emu = B.resolve(both.twin)(q, k, v)  # the twin quantizes the same way; the stand-in kernel keeps P exact
    assert rel_l2(both(q, k, v), emu) < 0.05


def test_the_prepass_the_bench_times_is_the_calls(fa3):
    q, k, v = qkv(s=70, d=64, dtype=torch.bfloat16)
    for name, smooth in (("fav3_fp8", False), ("fav3_fp8:smooth_k=1", True)):
        x = B.resolve(name).bench.prepass(q, k, v, None)
        ref = N.fp8_bh_inputs(q, k, v, smooth_k=smooth)
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(x[:6], ref[:6])) and (x.k_mean is None) != smooth


def test_the_fa3_module_is_looked_up_on_the_path_once(fa3, monkeypatch):
    """Each call used to search sys.path for flash_attn_interface (absent where fa3-fwd is the FA3 installed), tens
    of microseconds of host time on every attention call; once imported, the module comes from sys.modules."""
    q, k, v = qkv(s=64, d=64, dtype=torch.bfloat16, seed=1)
    b = B.resolve("fav3_fp8")
    b(q, k, v)

    def no_search(name, *a):
        raise AssertionError(f"searched the path for {name} on a later call")

    monkeypatch.setattr(importlib.util, "find_spec", no_search)
    out = b(q, k, v)
    assert fa3.CALLS[-1]["dtype"] == "torch.float8_e4m3fn" and out.shape == q.shape
