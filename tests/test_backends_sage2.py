"""The sagev2 backends (vdbench/backends/sage2.py) and their twin on a CPU, with stand-in sageattention packages.

Why stand-ins: the package runs only on CUDA after a source build, but everything around the kernel call is ours and
must be right before a GPU is rented: which version counts as installed (1.x must not pass for 2.x, nor the
reverse for sagev1), which function each entry calls with which options, that a function the build lacks is refused
by name, the log-sum-exp form ring attention needs (shape, dtype, natural log), the label that names the kernel the
dispatcher picked, the zero-V-channel guard, and that no input is written. The stand-ins' functions compute an
independent reference of the named kernels (tests/fake_packages.py), so outputs can be checked against exact
attention, and each entry's emulated twin against the stand-in.
"""

import importlib.util

import pytest
import torch

from vdbench import backends as B
from vdbench import numerics as N
from vdbench.backends import sage2 as S2

from tests import fake_packages as F
from tests.attention_data import qkv, rel_l2

SAGE2 = ("sagev2", "sagev2_fp8", "sagev2_fp16", "sagev2_triton")


@pytest.fixture
def hopper(monkeypatch):
    """Pretend a working sm90 GPU is present (availability only; the calls run on CPU tensors)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(S2, "_PICKED", {})
    monkeypatch.setattr(S2, "_SELF_CHECKED", {})
    monkeypatch.setattr(S2, "_self_check_device", lambda device: torch.device("cpu"))  # the calls run on the CPU


@pytest.fixture
def sage2(tmp_path, monkeypatch):
    F.install_sage2(tmp_path, monkeypatch)
    import sageattention.core as core

    yield core
    F.forget("sageattention")


@pytest.fixture
def sage1(tmp_path, monkeypatch):
    F.install_sage1(tmp_path, monkeypatch)
    yield
    F.forget("sageattention")


def bf16(**kw):
    return qkv(dtype=torch.bfloat16, **kw)


# ----- availability ----------------------------------------------------------------------------------------------

def test_without_the_package_each_entry_says_how_to_install_and_names_its_twin(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sageattention" else real(n, *a))
    for name in SAGE2:
        ok, reason = B.availability(name, "cuda")
        assert not ok and reason.startswith("package not installed: sageattention (no wheel on PyPI")
        assert "TORCH_CUDA_ARCH_LIST" in reason
        with pytest.raises(B.BackendUnavailable) as e:
            B.resolve(name).require("cuda", torch.bfloat16, [128])
        twin = B.resolve(name).twin
        assert f"'{twin}' emulates its numerics on any device" in str(e.value) and B.resolve(twin).emulated
    assert B.resolve("sagev2_fp16:gran=per_warp").twin == "sagev2_emu:pv=fp16+gran=per_warp"
    assert B.availability("sagev2_emu", "cpu", torch.float32, 128) == (True, "ok")


def test_sageattention_1x_is_not_taken_for_2x(sage1, hopper):
    for name in SAGE2:
        ok, reason = B.availability(name, "cuda")
        assert not ok and "needs sageattention 2.x; the installed one is 1.x (has no sageattn_qk_int8_* kernels)" \
            in reason, reason
    assert B.availability("sagev1", "cuda", torch.bfloat16, 128) == (True, "ok")


def test_sagev1_refuses_2x_rather_than_running_sage2_under_its_name(sage2, hopper):
    ok, reason = B.availability("sagev1", "cuda", torch.bfloat16, 128)
    assert not ok and "needs sageattention 1.x; the installed one is 2.x" in reason and "sagev2_triton" in reason
    for name in SAGE2:
        assert B.availability(name, "cuda", torch.bfloat16, 128) == (True, "ok"), name


def test_a_function_the_build_lacks_is_refused_by_name(tmp_path, monkeypatch, hopper):
    F.install_sage2(tmp_path, monkeypatch, omit=("sageattn_qk_int8_pv_fp8_cuda",))
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 9))  # sm89: the non-sm90 fp8
        ok, reason = B.availability("sagev2_fp8:gran=per_warp", "cuda")
        assert not ok and reason == "the installed sageattention (2.x) has no sageattn_qk_int8_pv_fp8_cuda"
        assert B.availability("sagev2_fp16", "cuda")[0]  # the others are there
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
        import sageattention.core as core

        monkeypatch.setattr(core, "SM90_ENABLED", False)  # the sm90 extension did not build
        ok, reason = B.availability("sagev2_fp8", "cuda")
        assert not ok and "built without the kernels of sageattn_qk_int8_pv_fp8_cuda_sm90 (SM90_ENABLED is False)" \
            in reason
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (10, 0))
        ok, reason = B.availability("sagev2", "cuda")
        assert not ok and "GPU is sm_100: use sagev2_fp8 or sagev2_fp16" in reason
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 6))
        assert "compute capability >= 8.9" in B.availability("sagev2_fp8", "cuda")[1]  # no fp8 MMA
    finally:
        F.forget("sageattention")


def test_a_broken_install_says_it_does_not_import(tmp_path, monkeypatch, hopper):
    F.install(tmp_path, monkeypatch, "sageattention", {"__init__.py": "from . import _fused\n"})
    try:
        ok, reason = B.availability("sagev2", "cuda")
        assert not ok and reason.startswith("sageattention does not import (ImportError") and "\n" not in reason
    finally:
        F.forget("sageattention")


# ----- the calls -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, function, kwargs", [
    ("sagev2", "sageattn", {}),
    ("sagev2_fp8", "sageattn_qk_int8_pv_fp8_cuda_sm90", dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32+fp32")),
    ("sagev2_fp8:gran=per_warp", "sageattn_qk_int8_pv_fp8_cuda_sm90",
     dict(qk_quant_gran="per_warp", pv_accum_dtype="fp32+fp32")),
    ("sagev2_fp16", "sageattn_qk_int8_pv_fp16_cuda", dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32")),
    ("sagev2_fp16:gran=per_warp", "sageattn_qk_int8_pv_fp16_cuda", dict(qk_quant_gran="per_warp",
                                                                       pv_accum_dtype="fp32")),
    ("sagev2_triton", "sageattn_qk_int8_pv_fp16_triton", {}),
])
def test_each_entry_calls_its_function_with_its_options_and_leaves_inputs_alone(sage2, hopper, name, function,
                                                                                 kwargs):
    q, k, v = bf16(s=150, d=64, k_bias=3.0)
    before = [t.clone() for t in (q, k, v)]
    b = B.resolve(name)
    b.check_call(q, k, v)
    sage2.CALLS.clear()
    out = b(q, k, v, scale=0.11)
    assert sage2.CALLS[-1 if function != "sageattn" else 0][0] == function
    called = dict(sage2.CALLS[0][1])
    assert called.pop("tensor_layout") == "HND" and called.pop("return_lse") is False
    assert called == kwargs
    assert all(torch.equal(a, t) for a, t in zip(before, (q, k, v)))
    ref = N.exact_attention(q, k, v, scale=0.11)
    assert out.dtype == q.dtype and out.shape == q.shape and rel_l2(out, ref) < 0.05
    twin = B.resolve(b.twin)(q, k, v, scale=0.11)  # vdbench's emulation of the kernel the stand-in references
    pv = "fp16" if "fp16" in function else "fp8"
    assert rel_l2(twin, out) < F.twin_bound(pv, q.dtype) * rel_l2(out, ref)


@pytest.mark.parametrize("lse", [False, True])
def test_bshd_memory_is_passed_as_nhd_and_the_output_keeps_it(sage2, hopper, lse):
    """diffusers' dispatcher hands BSHD tensors (as BHSD views): sagev2 calls the package with tensor_layout "NHD" so
    its output is BSHD memory too (no copy after the call), with the same result as the BHSD call."""
    q, k, v = bf16(s=150, d=64, k_bias=3.0)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert S2.tensor_layout(*views) == "NHD" and S2.tensor_layout(q, k, v) == "HND"
    b = B.resolve("sagev2")
    call = b.lse.fn if lse else b
    sage2.CALLS.clear()
    got = call(*views, scale=0.11) if not lse else call(*views, scale=0.11, is_causal=False)
    assert sage2.CALLS[0][1]["tensor_layout"] == "NHD"
    want = call(q, k, v, scale=0.11) if not lse else call(q, k, v, scale=0.11, is_causal=False)
    out, ref = (got[0], want[0]) if lse else (got, want)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous() and torch.equal(out, ref)
    if lse:
        assert got[1].shape == (1, q.shape[1], 150) and torch.equal(got[1], want[1])


BROKEN_SM90 = F.SAGE2_CORE + """
import torch as _torch


def _uninitialized(q, k, v, tensor_layout="HND", **kwargs):  # what the 2.2.0 tag's sm90 call returns: no attention
    return _torch.empty_like(q).normal_(generator=_torch.Generator().manual_seed(1))


sageattn_qk_int8_pv_fp8_cuda_sm90 = _uninitialized
"""

NHD_ONLY_BROKEN = F.SAGE2_CORE.replace("        nhd = tensor_layout == \"NHD\"", "        nhd = False")


@pytest.mark.parametrize("core, bad, layout", [(BROKEN_SM90, ("sagev2", "sagev2_fp8"), "HND"),
                                               (NHD_ONLY_BROKEN, SAGE2, "NHD")])
def test_a_build_that_computes_wrong_attention_is_refused_with_the_figure(tmp_path, monkeypatch, hopper, core, bad,
                                                                          layout):
    assert core != F.SAGE2_CORE
    F.install_sage2(tmp_path, monkeypatch, core=core)
    try:
        for name in SAGE2:
            ok, reason = B.availability(name, "cuda", torch.bfloat16, 128)
            if name in bad:
                assert not ok and "self-check" in reason and f"layout {layout}" in reason and "rel L2" in reason
                with pytest.raises(B.BackendUnavailable, match="computes wrong attention"):
                    B.resolve(name).require("cuda", torch.bfloat16, [128])
            else:
                assert (ok, reason) == (True, "ok"), name
        # a bound variant checks its own options' call (per_warp runs another quantization kernel)
        ok, _ = B.availability("sagev2_fp8:gran=per_warp", "cuda", torch.bfloat16, 128)
        assert ok is ("sagev2_fp8" not in bad)
    finally:
        F.forget("sageattention")


def test_the_self_check_runs_once_per_gpu_function_and_options(sage2, hopper):
    sage2.CALLS.clear()
    for _ in range(3):
        assert B.availability("sagev2_fp16", "cuda", torch.bfloat16, 128) == (True, "ok")
    assert [c[0] for c in sage2.CALLS] == ["sageattn_qk_int8_pv_fp16_cuda"] * 2  # HND and NHD, once
    assert B.availability("sagev2_fp16:gran=per_warp", "cuda", torch.bfloat16, 128) == (True, "ok")
    assert len(sage2.CALLS) == 4 and sage2.CALLS[-1][1]["qk_quant_gran"] == "per_warp"


def test_the_dispatchers_kernel_is_observed_and_counted_by_name(sage2, hopper):
    q, k, v = bf16(s=64, d=64)
    b = B.resolve("sagev2")
    assert b.call_label(q, k, v) == "sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert b.lse_form("cuda").call_label(q) == "sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90[lse]"
    assert B.resolve("sagev2_fp8:gran=per_warp").call_label(q, k, v) == \
        "sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90[gran=per_warp]"
    assert B.resolve("sagev2_fp16").call_label(q, k, v) == \
        "sageattention.sageattn_qk_int8_pv_fp16_cuda[gran=per_thread]"
    sage2.CALLS.clear()
    b.call_label(q, k, v)
    assert sage2.CALLS == []  # observed once per device, not per call


@pytest.mark.parametrize("name", [*SAGE2, "sagev2_fp8:gran=per_warp", "sagev2_emu", "sagev2_emu:pv=fp16"])
def test_lse_forms_are_natural_log_per_query_with_the_mean_correction(sage2, hopper, name):
    q, k, v = qkv(s=130, d=64, k_bias=3.0, dtype=torch.bfloat16, seed=4)
    b = B.resolve(name)
    out, lse = b.lse.fn(q, k, v, scale=None, is_causal=False)
    assert lse.shape == (1, 2, 130) and lse.dtype == torch.float32
    _, lref = N.exact_attention(q, k, v, return_lse=True)
    # base 2 would be off by ~lse * 0.44, a missing K-mean correction by ~|q·mean| / 8 (several units here)
    assert (lse.double() - lref).abs().max() < 0.05
    assert torch.equal(out, b(q, k, v))


def test_the_zero_v_channel_guard(sage2, hopper):
    q, k, v = bf16(s=100, d=64)
    v = v.clone()
    v[0, 1, :, 9] = 0
    raw = sage2.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v)
    assert torch.isnan(raw[0, 1, :, 9]).all()  # what the fp8 kernels give there
    keep = torch.ones_like(raw, dtype=torch.bool)
    keep[0, 1, :, 9] = False
    err = rel_l2(raw[keep], N.exact_attention(q, k, v)[keep])
    for name in ("sagev2", "sagev2_fp8", "sagev2_fp8:gran=per_warp", "sagev2_emu"):
        out = B.resolve(name)(q, k, v)
        assert torch.isfinite(out).all() and (out[0, 1, :, 9] == 0).all(), name
        if name in ("sagev2", "sagev2_fp8"):
            assert torch.equal(out[keep], raw[keep])  # the other channels are the kernel's, untouched
        elif name == "sagev2_emu":  # its other channels: the emulation's, as close to the kernel's as anywhere
            assert rel_l2(out[keep], raw[keep]) < F.twin_bound("fp8", q.dtype) * err
        o2, lse = B.resolve(name).lse.fn(q, k, v)
        assert torch.equal(o2, out) and torch.isfinite(lse).all()
    fp16 = B.resolve("sagev2_fp16")(q, k, v)
    assert torch.isfinite(fp16).all() and (fp16[0, 1, :, 9] == 0).all()  # no guard needed: no NaN there


def test_causal_with_unequal_lengths_is_refused_not_misaligned(sage2, hopper):
    q, k, v = bf16(s=64, sk=96, d=64)
    with pytest.raises(B.UnsupportedCall, match="top-left aligned"):
        B.resolve("sagev2")(q, k, v, is_causal=True)
    q, k, v = bf16(s=96, d=64)
    out = B.resolve("sagev2_fp16")(q, k, v, is_causal=True)
    assert rel_l2(out, N.exact_attention(q, k, v, is_causal=True)) < 0.02


def test_the_entries_carry_what_the_bench_and_ring_attention_ask(sage2, hopper):
    for name in SAGE2:
        b = B.resolve(name)
        assert b.has_lse("cuda") and not b.has_lse("cpu") and b.bench.prepass is None and b.max_head_dim == 128
        assert b.dtypes == B.HALF and b.install_hint.startswith("no wheel on PyPI")
        moved = b.bench.bytes_moved(1, 2, 256, 256, 64, 2)
        assert moved.kernel < 4 * 2 * 256 * 64 * 2 and moved.prepass > 0
    assert B.resolve("sagev2_emu").has_lse("cpu")  # ring attention runs the emulation on a CPU


@pytest.mark.parametrize("name", ["sagev2", "sagev2_fp16", "sagev2_emu"])
def test_ring_style_merge_of_two_key_halves_with_the_lse_form(sage2, hopper, name):
    """What ring attention does with the LSE form: attend to each half of the keys, merge by exp(lse_i - lse).
    Natural log and the K-mean correction make the merge land on full attention (each half smooths K with its own
    mean: without the correction the halves' weights would be off by q·(mean_1 - mean_2))."""
    q, k, v = qkv(s=256, d=64, k_bias=3.0, dtype=torch.bfloat16, seed=6)
    fn = B.resolve(name).lse.fn
    (o1, l1), (o2, l2) = fn(q, k[:, :, :128], v[:, :, :128]), fn(q, k[:, :, 128:], v[:, :, 128:])
    lse = torch.logaddexp(l1, l2)
    merged = (torch.exp(l1 - lse)[..., None] * o1.float() + torch.exp(l2 - lse)[..., None] * o2.float())
    ref, lref = N.exact_attention(q, k, v, return_lse=True)
    whole = rel_l2(B.resolve(name)(q, k, v), ref)
    assert rel_l2(merged, ref) < 1.5 * whole + 2e-3 and (lse.double() - lref).abs().max() < 0.05


def test_the_listing_says_how_to_install_and_which_emulation_runs_instead(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sageattention" else real(n, *a))
    table = B.capability_table("cpu")
    line = next(ln for ln in table.splitlines() if ln.startswith("sagev2_fp16 "))
    assert "package not installed: sageattention (no wheel on PyPI" in line and line.endswith(
        "; emulation: sagev2_emu:pv=fp16")
    assert "  sagev2_fp8: gran=per_thread|per_warp (default per_thread)" in table
