"""--ulysses_fp8_exchange's kernels (vdbench/kernels/exchange_fp8.py) against the same arithmetic in torch, bit for
bit, in the layouts the exchange uses them in (under Triton's interpreter where there is no GPU); the render itself
is in tests/test_parallel.py."""

import pytest
import torch

from tests.conftest import triton_interpreter

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def ex():
    with triton_interpreter("vdbench.kernels.exchange_fp8") as (mod,):
        yield mod


def _x(*shape, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[-2])[:, None]).to(dtype)
    x[..., 0, :] = 0  # a row of zeros: scale 1, zeros back
    return x


@pytest.mark.parametrize("d", [16, 24, 128])
def test_v_into_the_send_layout_and_back(ex, d):
    """V (1, S_loc, H, D) -> e4m3 in the send layout (P, 1, S_loc, h, D) with a scale per (token, head), then back
    into the kernel's BSHD input: the torch arithmetic's values, each row within e4m3's rounding of the input."""
    p, s, h = 2, 5, 3
    x = _x(1, s, p * h, d)
    y = torch.empty(p, 1, s, h, d, dtype=torch.float8_e4m3fn)
    sc = torch.empty(p, 1, s, h)
    ex.quantize_rows(x.view(1, s, p, h, d).permute(2, 0, 1, 3, 4), y, sc)
    q, ref_sc = ex.reference_quantize_rows(x.view(1, s, p, h, d).permute(2, 0, 1, 3, 4))
    assert torch.equal(y.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc, ref_sc)
    assert torch.equal(sc[0, 0, :, 0], torch.ones(s))  # head 0 (on rank 0) is all zeros
    out = torch.empty(1, s, p * h, d, dtype=torch.bfloat16)
    ex.dequantize_rows(y, sc, out.view(1, s, p, h, d).permute(2, 0, 1, 3, 4))
    assert torch.equal(out.view(1, s, p, h, d).permute(2, 0, 1, 3, 4), (q.float() * ref_sc[..., None]).bfloat16())
    err = (out.float() - x.float()).abs().amax(-1) / x.float().abs().amax(-1).clamp_min(1e-30)
    assert err.max() <= 1 / 16 and out[..., 0, :].abs().sum() == 0  # e4m3: 3 mantissa bits, half a step


def test_refused_views_say_what_they_got(ex):
    with pytest.raises(ValueError, match="last dim is contiguous"):
        ex.quantize_rows(torch.zeros(2, 1, 3, 2, 8).transpose(3, 4), torch.zeros(2, 1, 3, 8, 2,
                                                                                  dtype=torch.float8_e4m3fn),
                         torch.zeros(2, 1, 3, 8))
    with pytest.raises(ValueError, match="disagree"):
        ex.dequantize_rows(torch.zeros(2, 1, 3, 2, 8, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 3, 2),
                           torch.zeros(2, 1, 3, 2, 4))


def test_refused_where_it_cant_run():
    from vdbench import parallel as P

    with pytest.raises(ValueError, match="--ulysses_fp8_exchange on quantizes the exchanges of --ulysses_async"):
        P.ParallelSpec("diffusers", 2, 2, fp8_exchange=True).validate()
    with pytest.raises(ValueError, match="--ulysses_fp8_exchange on quantizes"):
        P.ParallelSpec("diffusers", 2, 1, async_exchange=False, fp8_exchange=True).validate()
    spec = P.ParallelSpec("diffusers", 2, 1, async_exchange=False, fp8_exchange=True)
    assert "no vdbench Ulysses self-attention" in P.fp8_exchange_refusal(spec, "cpu")
    assert P.resolve_engine(P.ParallelSpec("auto", 2, 1, fp8_exchange=True), torch.device("cpu")).engine == \
        "diffusers"


def test_packed_buffer_keeps_the_scales_aligned_for_any_row_count():
    """Rows and scales share one byte buffer per destination (one all-to-all); the rows' bytes are rounded up to 4,
    so the fp32 scales after them are aligned whatever the count (a tiny model's head dim, an odd token count)."""
    from vdbench.patching.ulysses import Fp8Exchange

    for shape in [(1, 3, 1, 5), (1, 16380, 6, 128)]:
        b, s, h, d = shape
        n = b * s * h * d
        buf = torch.zeros(2, Fp8Exchange._data_bytes(n) + 4 * b * s * h, dtype=torch.uint8)
        data, scale = Fp8Exchange._views(buf, shape)
        assert data.shape == (2, b, s, h, d) and scale.shape == (2, b, s, h)
        scale[1].fill_(2.0)  # the scales don't overlap the rows
        assert data.view(torch.uint8).sum() == 0 and scale.data_ptr() % 4 == 0
