"""FA3 fp8's fused Triton pre-pass (vdbench/kernels/fa3_prepass.py) and the zero-V-channel guard
(vdbench/kernels/channels.py) on CPU under Triton's interpreter, against their eager forms in vdbench.numerics.

Why bit-equality: ``fav3_fp8`` runs the Triton pre-pass where Triton runs and the eager one elsewhere (and its
emulation ``fp8_emu`` quantizes eagerly); a render must not change with the path, so the e4m3 values and the descales
must be the same bits, not merely close -- at odd lengths, FA3's non-power-of-two head dims, strided (BSHD-memory)
inputs, with and without K and V smoothing, and for an all-zero head. The guard must write exactly the flagged channels.
"""

import importlib.util

import pytest
import torch

from vdbench import numerics as N

from tests.conftest import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton not installed (pip install -e '.[test]' installs it)")


@pytest.fixture(scope="module")
def K():
    """(fa3_prepass module, channels module, device), interpreted when there is no GPU."""
    with triton_interpreter("vdbench.kernels.quant", "vdbench.kernels.fa3_prepass",
                            "vdbench.kernels.channels") as (_, fa3_prepass, channels):
        yield fa3_prepass, channels, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(b, h, s, d, *, sk=None, bshd=False, seed=0, device="cpu"):
    """bf16 Q, K, V with a per-channel K bias and a few large K channels; ``bshd``: BHSD views of BSHD memory, the
    layout a diffusers pipeline hands the backends."""
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    q = torch.randn(b, h, s, d, generator=g) * 2
    k = torch.randn(b, h, sk, d, generator=g) + 3 * torch.randn(1, h, 1, d, generator=g)
    k[..., :2] *= 8
    v = torch.randn(b, h, sk, d, generator=g)
    out = []
    for t in (q, k, v):
        t = t.to(device=device, dtype=torch.bfloat16)
        out.append(t.transpose(1, 2).contiguous().transpose(1, 2) if bshd else t)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("s, d", [(1, 64), (37, 128), (130, 96), (300, 64)])
@pytest.mark.parametrize("smooth_k, smooth_v", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("bshd", [False, True])
def test_triton_prepass_is_the_eager_one_bit_for_bit(K, s, d, smooth_k, smooth_v, bshd):
    P, _, dev = K
    q, k, v = inputs(2, 3, s, d, sk=s + 5, bshd=bshd, seed=s, device=dev)
    eager = N.fp8_bh_inputs(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    fused = P.prepass(q, k, v, smooth_k, smooth_v)
    for name in ("q8", "k8", "v8"):
        a, b = getattr(eager, name), getattr(fused, name)
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert same_bits(a, b), (name, (a.float() != b.float()).sum().item())
    for name in ("q_descale", "k_descale", "v_descale"):
        a, b = getattr(eager, name), getattr(fused, name)
        assert b.shape == (2, 3) and b.dtype == torch.float32 and b.is_contiguous()
        assert torch.equal(a, b), name  # bit-equal scales
    assert (fused.k_mean is None) == (not smooth_k)
    if smooth_k:
        assert torch.equal(fused.k_mean, eager.k_mean)
    assert (fused.v_mean is None) == (not smooth_v)
    if smooth_v:
        assert torch.equal(fused.v_mean, eager.v_mean)
    for t, t8 in zip((q, k, v), fused[:3]):  # FA3 gets the caller's layout, as from its own quantization
        assert t8.stride() == t.stride()


def test_the_per_tensor_form_smooths_as_the_fused_one(K):
    """Q, K and V of different head dims can't share the fused launches: each goes through its own pair, with the
    same values (K's amax from its per-channel extremes, V's likewise)."""
    P, _, dev = K
    q, k, v = inputs(1, 2, 90, 64, device=dev)
    v = torch.cat([v, v[..., :32]], dim=-1) + 4.0  # head dim 96, a large mean
    eager = N.fp8_bh_inputs(q, k, v, smooth_k=True, smooth_v=True)
    split = P.prepass(q, k, v, True, True)
    for name in ("q8", "k8", "v8"):
        assert same_bits(getattr(eager, name), getattr(split, name)), name
    assert torch.equal(eager.v_descale, split.v_descale) and torch.equal(eager.v_mean, split.v_mean)


def test_every_value_uses_the_head_scale_and_the_range(K):
    P, _, dev = K
    q, k, v = inputs(1, 2, 200, 64, device=dev)
    x8, descale = P.quantize_bh(q)
    amax = q.float().abs().amax(dim=(-1, -2))
    assert torch.equal(descale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    assert (x8.float().abs().amax(dim=(-1, -2)) == 448).all()  # each head's largest value maps to e4m3's max
    back = x8.float() * descale[..., None, None]
    assert ((back - q.float()).norm() / q.float().norm()).item() < 0.05


def test_an_all_zero_head_and_a_zero_tensor(K):
    P, _, dev = K
    q, k, v = inputs(1, 2, 70, 64, device=dev)
    q = q.clone()
    q[:, 1] = 0
    x8, descale = P.quantize_bh(q)
    assert descale[0, 1] == 1 and (x8[:, 1].float() == 0).all() and descale[0, 0] != 1
    e8, e_descale = N.quantize_fp8(q, "bh")[::2]
    assert same_bits(x8, e8) and torch.equal(descale, e_descale)


def test_the_chunk_partials_cover_long_sequences(K):
    """More chunks than one program's tile, a ragged last chunk and a batch: the max is over all of them."""
    P, _, dev = K
    q, k, v = inputs(2, 1, 3 * P.CHUNK + 17, 64, device=dev)
    q = q.clone()
    q[1, 0, -1, 5] = 100.0  # the largest value in the ragged last chunk of batch 1
    _, descale = P.quantize_bh(q)
    assert descale[1, 0].item() == pytest.approx(100.0 / 448, rel=1e-6)
    assert descale[0, 0].item() < 100.0 / 448


@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 64), (4, 2, 72), (6, 3, 128)])
def test_zero_channel_guard_writes_exactly_the_flagged_channels(K, hq, hkv, d):
    _, C, dev = K
    g = torch.Generator().manual_seed(hq + d)
    out = torch.randn(2, hq, 150, d, generator=g).to(device=dev, dtype=torch.bfloat16)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # BHSD view of BSHD memory
    flags = torch.zeros(2, hkv, d, dtype=torch.bool, device=dev)
    flags[1, hkv - 1, 3] = flags[0, 0, d - 1] = True
    a = C.zero_channels_(out.clone(), flags)
    b = N.zero_channels_(out.clone(), flags)
    assert torch.equal(a, b)
    rep = hq // hkv
    assert (a[1, hq - rep:, :, 3] == 0).all() and (a[0, :rep, :, d - 1] == 0).all()
    assert (a != out).sum() <= 2 * rep * 150 and (a == 0).sum() >= 2 * rep * 150
    none = C.zero_channels_(out.clone(), torch.zeros_like(flags))
    assert torch.equal(none, out)  # no zero channel: nothing written
    with pytest.raises(ValueError, match="flags"):
        C.zero_channels_(out.clone(), flags[:, :, :-1])


def test_the_helper_kernels_compile_for_hopper_without_a_gpu():
    """Ahead-of-time compile for sm_90 (Triton's own ptxas): the GPU code of the pre-pass, the guard, Wan's fused
    RoPE and the Wan block's modulation and gated residual builds.
    In a subprocess without TRITON_INTERPRET (interpreted functions can't be compiled)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "vdbench.kernels.aot", "--target", "cuda:90", "--helpers"],
                         capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("OK", "ERR"))]
    if res.returncode and "ptxas" in (res.stdout + res.stderr) and not any(ln.startswith("OK") for ln in lines):
        pytest.skip(f"no usable ptxas for ahead-of-time compilation: {res.stderr[-300:]}")
    assert res.returncode == 0 and len(lines) == 12 and all(ln.startswith("OK") for ln in lines), \
        res.stdout + res.stderr[-2000:]


@pytest.mark.parametrize("hq, hkv, sq, skv", [(4, 4, 70, 70), (4, 2, 130, 37), (3, 1, 5, 200)])
def test_the_one_launch_qkv_form_equals_the_per_tensor_form(K, hq, hkv, sq, skv):
    """``quantize_qkv`` (Q, K, V in one amax and one quantization launch, GQA head counts and lengths that differ)
    gives the per-tensor kernels' values and scales bit for bit, in the callers' layouts, with (B, H) scales."""
    P, _, dev = K
    g = torch.Generator().manual_seed(hq * 100 + skv)
    q = (torch.randn(2, sq, hq, 64, generator=g) * 3).to(device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k = (torch.randn(2, hkv, skv, 64, generator=g) + 2).to(device=dev, dtype=torch.bfloat16)
    v = torch.randn(2, skv, hkv, 64, generator=g).to(device=dev, dtype=torch.bfloat16).transpose(1, 2)
    v = v.clone()
    v[1, -1] = 0  # an all-zero head: descale 1
    fused = P.quantize_qkv(q, k, v)
    via = P.prepass(q, k, v)  # prepass() without smoothing is this form
    assert all(same_bits(a, b) for a, b in zip(via[:3], fused[:3])) and torch.equal(via.k_descale, fused.k_descale)
    for t, t8, d in zip((q, k, v), fused[:3], fused[3:6]):
        e8, ed = P.quantize_bh(t)
        assert same_bits(t8, e8) and t8.stride() == t.stride()
        assert torch.equal(d, ed) and d.shape == (2, t.shape[1]) and d.is_contiguous()
    assert fused.v_descale[1, -1] == 1 and fused.k_mean is None
