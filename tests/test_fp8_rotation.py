"""fav3_fp8's ``rotate=hadamard`` option and its emulation: Q and K multiplied by a ±1 Hadamard matrix before e4m3
(FlashAttention-3's incoherent processing).

Why: real Q and K carry outlier channels (the same channels in both), whose large products e4m3's 3-bit mantissa
rounds coarsely; rotating both by an orthogonal matrix leaves Q·Kᵀ unchanged and spreads each outlier over the head
dimension. The rotation by ±1 entries is exact in bf16; the 1/n it needs goes into the softmax scale. On Hopper the
rotation runs as two bf16 matmuls before the fused pre-pass; here the emulation and the backend with a stand-in FA3
(tests/fake_packages.py) are checked against exact attention.
"""

import pytest
import torch

from vdbench import backends as B
from vdbench import numerics as N

from tests.attention_data import rel_l2
from tests.test_backends_flash import fa3  # noqa: F401 - the stand-in FA3 fixture


def outlier_qkv(factor=10.0, channels=4, d=128, s=512, seed=0, k_bias=0.0):
    """Q, K, V (bf16) whose first ``channels`` channels of Q and K are ``factor`` times the others, Q rescaled so the
    logits keep a plain input's spread: the outliers are what changes, not the softmax's temperature."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4, s, d, generator=g) for _ in range(3))
    q[..., :channels] *= factor
    k[..., :channels] *= factor
    q = q / q.norm(dim=-1, keepdim=True).mean() * d ** 0.5
    return q.bfloat16(), (k + k_bias).bfloat16(), v.bfloat16()


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_the_signs_matrix_is_a_scaled_rotation_of_every_fa3_head_dim(d):
    s, n = N.hadamard_signs(d)
    assert s.shape == (d, d) and set(s.unique().tolist()) <= {-1.0, 0.0, 1.0} and n == d & -d
    assert torch.equal(s @ s.T, n * torch.eye(d)) and ((s != 0).sum(dim=1) == n).all()  # blocks of order n
    q, k = torch.randn(2, 3, 40, d).bfloat16(), torch.randn(2, 3, 50, d).bfloat16()
    qr, kr, n2 = N.rotate_qk(q, k)
    assert n2 == n and qr.dtype == torch.bfloat16
    exact = q.double() @ k.double().transpose(-1, -2)
    torch.testing.assert_close(qr.double() @ kr.double().transpose(-1, -2) / n, exact, rtol=0.03, atol=0.15)


def test_rotation_brings_outlier_channels_back_to_the_plain_inputs_error():
    plain = outlier_qkv(factor=1.0, channels=0)
    floor = rel_l2(B.resolve("fp8_emu")(*plain), N.exact_attention(*plain))
    for factor in (10.0, 30.0):
        q, k, v = outlier_qkv(factor=factor, k_bias=2.0)
        ref = N.exact_attention(q, k, v)
        err = {n: rel_l2(B.resolve(n)(q, k, v), ref)
               for n in ("fp8_emu", "fp8_emu:rotate=hadamard", "fp8_emu:smooth_k=1+rotate=hadamard")}
        assert err["fp8_emu"] > 3 * floor, err  # the outliers are what the error is about here
        assert err["fp8_emu:rotate=hadamard"] < 0.4 * err["fp8_emu"], err
        assert err["fp8_emu:smooth_k=1+rotate=hadamard"] < 1.6 * floor, (err, floor)
    # nothing lost where there is nothing to spread: e4m3's own floor
    assert rel_l2(B.resolve("fp8_emu:rotate=hadamard")(*plain), N.exact_attention(*plain)) < 1.1 * floor


@pytest.mark.parametrize("name", ["fav3_fp8:rotate=hadamard", "fav3_fp8:smooth_k=1+rotate=hadamard"])
def test_fav3_fp8_rotated_hands_fa3_rotated_operands_its_scale_and_an_exact_lse(fa3, name):  # noqa: F811
    q, k, v = outlier_qkv(factor=10.0, d=128, s=256, k_bias=2.0)
    before = [t.clone() for t in (q, k, v)]
    b = B.resolve(name)
    out = b(q, k, v)
    assert fa3.CALLS[-1] == dict(dtype="torch.float8_e4m3fn", descales=True, lse=False)
    assert all(torch.equal(a, t) for a, t in zip(before, (q, k, v)))  # the caller's tensors untouched
    ref, lref = N.exact_attention(q, k, v, return_lse=True)
    plain = rel_l2(B.resolve("fav3_fp8")(q, k, v), ref)
    assert rel_l2(out, ref) < 0.5 * plain  # the stand-in keeps P exact: the operands' rounding alone
    smooth = "smooth_k=1" in name
    o2, lse = b.lse.fn(q, k, v)
    _, lse_plain = B.resolve("fav3_fp8:smooth_k=1" if smooth else "fav3_fp8").lse.fn(q, k, v)
    err, err_plain = ((x.double() - lref).abs().max() for x in (lse, lse_plain))
    # natural log of the true scores: the scale's 1/n taken back (else off by a factor 128), the mean added back
    assert torch.equal(o2, out) and err < err_plain and err < 0.03 * lref.abs().max()
    assert b.kernel == "fa3.flash_attn_func[e4m3" + (",smooth_k" if smooth else "") + ",rotate=hadamard]"
    assert b.twin == "fp8_emu:" + ("smooth_k=1+" if smooth else "") + "rotate=hadamard" and B.resolve(b.twin).emulated
    x = b.bench.prepass(q, k, v, None)  # what the bench times as the pre-pass is what the call quantizes
    ref_x = N.fp8_bh_inputs(q, k, v, smooth_k=smooth, rotate=True)
    assert all(torch.equal(a.float(), c.float()) for a, c in zip(x[:6], ref_x[:6])) and x.qk_gain == 128.0
    assert b.bench.bytes_moved(1, 4, 256, 256, 128, 2).prepass > B.resolve(
        "fav3_fp8:smooth_k=1" if smooth else "fav3_fp8").bench.bytes_moved(1, 4, 256, 256, 128, 2).prepass
