"""vdbench's SageAttention 2 emulation (vdbench.numerics.sagev2_emulated) against the tests' independent reference
(tests/fake_packages.sage2_reference, what the stand-in ``sageattention`` computes), kernel by kernel.

Why: the emulation is what vdbench renders and compares kernels with; the reference is written from upstream's
algorithm and launch constants without reading the emulation, so the two agreeing within ``twin_bound`` of the
kernel's own error says the emulation still computes SageAttention 2, every kernel's variant included (the benches
call only some of them on a CPU). The contrasts check that the bound is tight enough to see one step go wrong.
"""

import pytest
import torch

from vdbench.numerics import exact_attention, sagev2_emulated

from tests import fake_packages as F
from tests.attention_data import qkv, rel_l2

# (emulation options, reference options) of each kernel and option the stand-in's functions take
KERNELS = {
    "sm90 fp8": (dict(pv="fp8", arch="sm90"), dict(pv="fp8", groups="sm90", pv_accum="fp32+fp32")),
    "sm89 fp8 fp32+fp16": (dict(pv="fp8", arch="sm89", pv_accum="fp32+fp16"),
                           dict(pv="fp8", groups="sm89", pv_accum="fp32+fp16")),
    "sm89 fp8 fp32+fp32": (dict(pv="fp8", arch="sm89", pv_accum="fp32+fp32"),
                           dict(pv="fp8", groups="sm89", pv_accum="fp32+fp32")),
    "sm80 fp16 fp32": (dict(pv="fp16", arch="sm80", pv_accum="fp32"), dict(pv="fp16", groups="sm80", pv_accum="fp32")),
    "sm80 fp16 fp16+fp32": (dict(pv="fp16", arch="sm80", pv_accum="fp16+fp32"),
                            dict(pv="fp16", groups="sm80", pv_accum="fp16+fp32")),
}


def both(q, k, v, emu, ref, gran, **kw):
    return (sagev2_emulated(q, k, v, qk_gran=gran, **emu, **kw),
            F.sage2_reference(q, k, v, gran=gran, **ref, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gran", ["per_thread", "per_warp"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_the_emulation_computes_what_the_reference_does(kernel, gran, dtype):
    emu, ref = KERNELS[kernel]
    d = 128 if "fp16+fp32" in kernel else 64  # sm80's "fp16+fp32" takes 16-row Q groups at head dim 128 only
    q, k, v = qkv(s=150, d=d, k_bias=3.0, dtype=dtype)
    e, r = both(q, k, v, emu, ref, gran)
    err = rel_l2(r, exact_attention(q, k, v))
    assert 0.005 < err < 0.05 and abs(rel_l2(e, exact_attention(q, k, v)) / err - 1) < 0.05
    assert rel_l2(e, r) < F.twin_bound(emu["pv"], dtype) * err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_and_causal_masking(dtype):
    q, k, v = qkv(s=150, d=64, k_bias=3.0, dtype=dtype)
    e, r = both(q, k, v, dict(pv="fp16"), dict(pv="fp16", groups="triton"), "per_block")
    assert rel_l2(e, r) < F.twin_bound("fp16", dtype) * rel_l2(r, exact_attention(q, k, v))
    for emu, ref in (KERNELS["sm90 fp8"], KERNELS["sm80 fp16 fp32"]):
        e, r = both(q, k, v, emu, ref, "per_thread", is_causal=True)
        err = rel_l2(r, exact_attention(q, k, v, is_causal=True))
        assert rel_l2(e, r) < F.twin_bound(emu["pv"], dtype) * err


def test_the_lse_is_the_same_logsumexp():
    q, k, v = qkv(s=150, d=64, k_bias=3.0, dtype=torch.bfloat16)
    (_, le), (_, lr) = (f(q, k, v, return_lse=True, **o) for f, o in
                        ((sagev2_emulated, dict(pv="fp8")), (F.sage2_reference, dict(pv="fp8"))))
    exact = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / 8.0, dim=-1)
    err = (lr.double() - exact).abs().max().item()
    assert (le.double() - lr.double()).abs().max().item() < 0.1 * err  # both add core.py's bf16 q·mean(K)


@pytest.mark.parametrize("wrong, ref", [
    (dict(pv="fp8", arch="sm89", pv_accum="fp32+fp32"), KERNELS["sm89 fp8 fp32+fp16"][1]),  # V's range: 448, not 2.25
    (dict(pv="fp8", arch="sm89", smooth_k=False), KERNELS["sm89 fp8 fp32+fp16"][1]),  # K not smoothed
    (dict(pv="fp8", arch="sm90"), KERNELS["sm89 fp8 fp32+fp32"][1]),  # sm90's groups and blocks for sm89's
])
def test_the_bound_sees_one_step_go_wrong(wrong, ref):
    q, k, v = qkv(s=150, d=64, k_bias=3.0)
    e, r = both(q, k, v, wrong, ref, "per_thread")
    assert rel_l2(e, r) > 2 * F.twin_bound("fp8", q.dtype) * rel_l2(r, exact_attention(q, k, v))
