"""vdbench.kernels.glue: the VAE fast path's norm -> SiLU -> conv-input glue as one Triton kernel, checked on
CPU under Triton's interpreter (tests/conftest.py turns it on) against the eager glue and the stock decode."""

import pytest
import torch

pytest.importorskip("triton")

from vdbench import kernels as K  # noqa: E402
from vdbench import vae as V  # noqa: E402
from vdbench.pipelines import _WAN21_VAE, _WAN22_VAE  # noqa: E402



@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """On a machine without a GPU: Triton's interpreter for this module's duration (the kernel module decorated
    under it; see tests/test_kernels.py for why the variable is scoped)."""
    import importlib
    import os

    old = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import vdbench.kernels.glue as G

        if not torch.cuda.is_available() and not getattr(G, "INTERPRETED", False):
            importlib.reload(G)
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old





def _eager(x, ctx, g):
    n = torch.linalg.vector_norm(x.float(), dim=1, keepdim=True).clamp_min(1e-12)
    return torch.cat([ctx, torch.nn.functional.silu(x.float() / n * g.view(1, -1, 1, 1, 1)).to(x.dtype)], 2)



@pytest.mark.parametrize("c,dtype", [(12, torch.float32), (96, torch.float32), (40, torch.bfloat16)])
def test_norm_silu_cat_matches_eager(c, dtype):
    from vdbench.kernels.glue import norm_silu_cat

    g = torch.Generator().manual_seed(c)
    x = (torch.randn(2, c, 3, 5, 7, generator=g) * 3).to(dtype).contiguous(memory_format=torch.channels_last_3d)
    ctx = torch.randn(2, c, 2, 5, 7, generator=g).to(dtype)
    gain = torch.rand(c, generator=g) + 0.5
    out = norm_silu_cat(x, ctx, gain)
    assert out.is_contiguous(memory_format=torch.channels_last_3d) and out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, _eager(x, ctx, gain), **tol)
    assert torch.equal(out[:, :, :2], ctx)  # the context frames are copied as they are



def test_norm_silu_cat_layouts():
    from vdbench.kernels.glue import norm_silu_cat, rms_silu_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 8, 2, 3, 4, generator=g)  # contiguous NCDHW (CPU convs): rows strided by T*H*W
    ctx, gain = torch.zeros(1, 8, 2, 3, 4), torch.rand(8, generator=g) + 0.5
    out = norm_silu_cat(x, ctx, gain)
    assert out.is_contiguous()
    torch.testing.assert_close(out, _eager(x, ctx, gain), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one strided dimension"):  # voxels that don't form one dimension
        norm_silu_cat(torch.randn(1, 8, 2, 5, 4)[:, :, :, :3], ctx, gain)
    with pytest.raises(ValueError, match="gain has 3 values for 8"):
        rms_silu_rows(torch.randn(5, 8), torch.ones(3), torch.empty(5, 8))



@pytest.mark.parametrize("cfg", [_WAN21_VAE, _WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_fast_decode_with_fused_glue_equals_stock_fp32(cfg):
    torch.manual_seed(0)
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**cfg).eval()
    z = torch.randn(1, vae.config.z_dim, 4, 3, 5, generator=torch.Generator().manual_seed(1))
    ref = vae.decode(z, return_dict=False)[0]
    info = {}
    out = V.decode_video(vae, z, mode="fast", fused_glue=True, info=info)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)
    assert info["glue"].startswith("triton") and V._GLUE.get() is None


def test_fused_glue_refusals():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**_WAN21_VAE).eval()
    z = torch.randn(1, vae.config.z_dim, 2, 3, 5)
    for kw in (dict(mode="default"), dict(mode="fast", compile_backend="eager"),
               dict(mode="fast", max_memory_gib=1.0)):
        with pytest.raises(ValueError, match="fused_glue"):
            V.decode_video(vae, z, fused_glue=True, **kw)
