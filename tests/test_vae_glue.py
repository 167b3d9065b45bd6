"""vdbench.kernels.glue: the VAE fast path's norm -> SiLU -> conv-input glue as one Triton kernel, checked on
CPU under Triton's interpreter (tests/conftest.py turns it on) against the eager glue and the stock decode."""

import pytest
import torch

pytest.importorskip("triton")

from vdbench import kernels as K  # noqa: E402
from vdbench.vae import decode as D  # noqa: E402
from vdbench.vae import fast as V  # noqa: E402
from vdbench.vae import lean as L  # noqa: E402
from vdbench.families.wan import WAN21_VAE as _WAN21_VAE, WAN22_VAE as _WAN22_VAE  # noqa: E402

from tests.conftest import triton_interpreter  # noqa: E402



@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """On a machine without a GPU: Triton's interpreter for this module's duration (the kernel module decorated
    under it; see tests/conftest.py for why the variable is scoped)."""
    with triton_interpreter("vdbench.kernels.glue"):
        yield





#: Where the kernel runs: the GPU when there is one (compiled Triton), else the CPU under the interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def exact_fp32():
    """fp32 references on a GPU: no TF32 in cuDNN's convolutions or matmuls for the comparison's duration."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _eager(x, ctx, g):
    n = torch.linalg.vector_norm(x.float(), dim=1, keepdim=True).clamp_min(1e-12)
    return torch.cat([ctx, torch.nn.functional.silu(x.float() / n * g.view(1, -1, 1, 1, 1)).to(x.dtype)], 2)



@pytest.mark.parametrize("c,dtype", [(12, torch.float32), (96, torch.float32), (40, torch.bfloat16)])
def test_norm_silu_cat_matches_eager(c, dtype):
    from vdbench.kernels.glue import norm_silu_cat

    g = torch.Generator().manual_seed(c)
    x = (torch.randn(2, c, 3, 5, 7, generator=g) * 3).to(DEV, dtype).contiguous(memory_format=torch.channels_last_3d)
    ctx = torch.randn(2, c, 2, 5, 7, generator=g).to(DEV, dtype)
    gain = (torch.rand(c, generator=g) + 0.5).to(DEV)
    out = norm_silu_cat(x, ctx, gain)
    assert out.is_contiguous(memory_format=torch.channels_last_3d) and out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, _eager(x, ctx, gain), **tol)
    assert torch.equal(out[:, :, :2], ctx)  # the context frames are copied as they are



@pytest.mark.parametrize("b,fmt", [(1, torch.channels_last_3d), (1, torch.contiguous_format),
                                   (2, torch.channels_last_3d)], ids=["cl", "contiguous", "cl_batch2"])
def test_norm_silu_cat_keep_writes_the_cache_in_the_same_pass(b, fmt, monkeypatch):
    """The causal cache (the normalized part's last frames) comes out of the glue's own pass where every rows
    view is one strided dimension (a batch of one, what the decode has: one launch, no copy of the buffer's
    tail), else is copied after it; either way it equals the buffer's tail and owns its memory."""
    from vdbench.kernels import glue

    g = torch.Generator().manual_seed(b)
    x = torch.randn(b, 16, 4, 3, 5, generator=g).to(DEV).contiguous(memory_format=fmt)
    ctx, gain, bias = torch.randn(b, 16, 2, 3, 5, generator=g).to(DEV), torch.rand(16).to(DEV) + 0.5, torch.randn(16)
    launches, copies = [], []
    monkeypatch.setattr(glue, "_launch", lambda k, grid, *a, f=glue._launch, **kw: launches.append(kw) or f(k, grid, *a, **kw))
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, *a, **kw: copies.append(tuple(t.shape)) or real_copy(t, src, *a, **kw))
    buf, cache = glue.norm_silu_cat_keep(x, ctx, gain, bias.to(DEV), keep=2)
    monkeypatch.undo()
    torch.testing.assert_close(buf, glue.norm_silu_cat(x, ctx, gain, bias=bias.to(DEV)), atol=0, rtol=0)
    assert torch.equal(cache, buf[:, :, -2:]) and cache.data_ptr() != buf[:, :, -2:].data_ptr()
    assert cache.shape == (b, 16, 2, 3, 5) and cache.is_contiguous(memory_format=fmt)
    fused = b == 1  # a batch of two: the buffer's frames after the context are two row blocks
    assert [kw["HAS_TAIL"] for kw in launches] == ([True] if fused else [False] * b)
    assert copies.count((b, 16, 2, 3, 5)) == (1 if fused else 2)  # the context; and the cache where not fused
    with pytest.raises(ValueError, match="keep=5 of 4 frames"):
        glue.norm_silu_cat_keep(x, ctx, gain, keep=5)


def test_norm_silu_cat_layouts():
    from vdbench.kernels.glue import norm_silu_cat, rms_silu_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 8, 2, 3, 4, generator=g).to(DEV)  # contiguous NCDHW (CPU convs): rows strided by T*H*W
    ctx, gain = torch.zeros(1, 8, 2, 3, 4, device=DEV), (torch.rand(8, generator=g) + 0.5).to(DEV)
    out = norm_silu_cat(x, ctx, gain)
    assert out.is_contiguous()
    torch.testing.assert_close(out, _eager(x, ctx, gain), atol=1e-5, rtol=1e-5)
    # voxels that don't form one strided dimension (a column slice; the frames of a permuted 2-D conv output,
    # as the upsamplers give in the contiguous layout): split into row blocks, still exact
    for odd in (torch.randn(1, 8, 2, 3, 6, device=DEV)[..., :4],
                torch.randn(2, 8, 3, 4, device=DEV).view(1, 2, 8, 3, 4).permute(0, 2, 1, 3, 4)):
        torch.testing.assert_close(norm_silu_cat(odd, ctx, gain), _eager(odd, ctx, gain), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gain has 3 values for 8"):
        rms_silu_rows(torch.randn(5, 8), torch.ones(3), torch.empty(5, 8))



@pytest.mark.parametrize("cl", [None, False], ids=["channels_last", "contiguous"])
@pytest.mark.parametrize("cfg", [_WAN21_VAE, _WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_fast_decode_with_fused_glue_equals_stock_fp32(cfg, cl, exact_fp32):
    torch.manual_seed(0)
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**cfg).eval().to(DEV)
    z = torch.randn(1, vae.config.z_dim, 4, 3, 5, generator=torch.Generator().manual_seed(1)).to(DEV)
    ref = vae.decode(z, return_dict=False)[0]
    info = {}
    stages, folded = [], []
    with pytest.MonkeyPatch.context() as mp:  # the upsamplers' 2-D stages all take the sub-pixel form
        mp.setattr(L, "upsample_conv", lambda frames, conv, f=L.upsample_conv, **kw: stages.append(conv)
                   or folded.append(kw.get("add") is not None) or f(frames, conv, **kw))
        out = D.decode_video(vae, z, mode="fast", fused_glue=True, info=info, channels_last=cl)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)
    assert info["glue"] == V.GLUE_TRITON and L._GLUE.get() is None and L._ROWS.get() is None
    upsamplers = [m for m in vae.decoder.modules() if type(m).__name__ == "WanResample" and "up" in m.mode]
    assert upsamplers and {id(c) for c in stages} == {id(m.resample[1]) for m in upsamplers}
    # Wan 2.2's up blocks: the DupUp3D shortcut added by the interleave's pass, on every call (first chunk too)
    assert all(folded) if cfg is _WAN22_VAE else not any(folded)


@pytest.mark.parametrize("chunk,tail,t", [(3, 1, 7), (4, (2, 1), 5)], ids=["3-1", "4-2-1"])
@pytest.mark.parametrize("cfg", [_WAN21_VAE, _WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_the_decoders_stages_in_pieces_equal_the_stock_decode_fp32(cfg, chunk, tail, t, exact_fp32, monkeypatch):
    """Chunks of three latent frames with the tail (the up blocks past the last temporal upsampling, and the head)
    one latent frame at a time, and chunks of four with the blocks past the first temporal upsampling two at a time
    and the tail one: the stock decode's video; each stage ran in its pieces (the first chunk whole)."""
    torch.manual_seed(0)
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**cfg).eval().to(DEV)
    z = torch.randn(1, vae.config.z_dim, t, 3, 5, generator=torch.Generator().manual_seed(2)).to(DEV)
    ref = vae.decode(z, return_dict=False)[0]
    calls = []
    staged = L._staged
    monkeypatch.setattr(L, "_staged", lambda self, box, lo, splits, n, *a: calls.append((lo, box[0].shape[2]))
                        or staged(self, box, lo, splits, n, *a))
    info = {}
    out = D.decode_video(vae, z, mode="fast", fused_glue=True, chunk_frames=chunk, tail_frames=tail, info=info)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)
    first, last = L._segment_starts(vae.decoder)
    assert 0 < first < last < len(vae.decoder.up_blocks)
    if tail == 1:  # per chunk of 3: the chunk (3 latent frames), then 3 tail pieces of 4 frames
        assert calls == [(0, 1)] + ([(0, 3)] + [(last, 4)] * 3) * 2 and info["tail_frames"] == 1
    else:  # the chunk of 4: the chunk, 2 pieces of 2 latent frames (4 frames there), each 2 tail pieces of 4 frames
        assert calls == [(0, 1), (0, 4)] + ([(first, 4)] + [(last, 4)] * 2) * 2
        assert info["tail_frames"] == [2, 1]


@pytest.mark.parametrize("cl", [True, False], ids=["channels_last", "contiguous"])
@pytest.mark.parametrize("cfg", [_WAN21_VAE, _WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_fast_encode_with_fused_glue_equals_stock_fp32(cfg, cl, exact_fp32):
    """The fast encode (vdbench.vae.encode) runs the same Triton glue: convs without their bias, norm -> SiLU in one
    pass, the down-sampling conv's bias in a row pass."""
    from diffusers import AutoencoderKLWan

    from vdbench.vae import encode as E

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**cfg).eval().to(DEV)
    x = (torch.rand(1, 3, 5, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1).to(DEV)
    with torch.no_grad():
        ref = vae._encode(x)
    info = {}
    out = E.wan_encode_fast(vae, x, chunk_frames=1, channels_last=cl, fused_glue=True, info=info)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)
    assert info["glue"] == V.GLUE_TRITON and L._GLUE.get() is None and L._ROWS.get() is None


def test_fused_glue_refusals():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**_WAN21_VAE).eval()
    z = torch.randn(1, vae.config.z_dim, 2, 3, 5)
    for kw in (dict(mode="default"), dict(mode="fast", compile_backend="eager")):
        with pytest.raises(ValueError, match="fused_glue"):
            D.decode_video(vae, z, fused_glue=True, **kw)


def test_memory_bounded_decode_with_fused_glue_equals_stock_fp32(exact_fp32):
    """The memory-bounded mode runs the same Triton glue (chunks sized from the budget), recorded in info."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**_WAN21_VAE).eval().to(DEV)
    z = torch.randn(1, vae.config.z_dim, 3, 3, 5, generator=torch.Generator().manual_seed(3)).to(DEV)
    ref = vae.decode(z, return_dict=False)[0]
    info = {}
    out = D.decode_video(vae, z, mode="fast", max_memory_gib=4.0, fused_glue=True, info=info)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)
    assert info["glue"] == V.GLUE_TRITON and info["path"] == "chunked"


@pytest.mark.parametrize("shape,fmt", [((1, 40, 3, 5, 7), torch.channels_last_3d), ((2, 12, 3, 5, 7), None),
                                       ((6, 24, 5, 7), torch.channels_last), ((3, 8, 5, 7), None)],
                         ids=["5d-cl", "5d-contig", "4d-cl", "4d-contig"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rows_matches_eager(shape, fmt, with_residual):
    """y += bias (+ residual) in one pass, any batch size and layout (channels_last: one launch for the batch)."""
    from vdbench.kernels.glue import add_rows_

    g = torch.Generator().manual_seed(len(shape) * 10 + shape[1])
    y = torch.randn(*shape, generator=g).to(DEV)
    res = torch.randn(*shape, generator=g).to(DEV)
    bias = torch.randn(shape[1], generator=g).to(DEV)
    if fmt is not None:
        y, res = y.contiguous(memory_format=fmt), res.contiguous(memory_format=fmt)
    if with_residual:  # the residual in the other layout than y: per batch element, still right
        res = res.contiguous()
    view = [1, -1] + [1] * (len(shape) - 2)
    want = y + bias.view(view) + (res if with_residual else 0)
    ptr = y.data_ptr()
    out = add_rows_(y, bias, res if with_residual else None)
    assert out is y and y.data_ptr() == ptr  # in place
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rows_(y, bias, res[:1] if shape[0] > 1 else res[:, :, :1])
    with pytest.raises(ValueError, match="bias has 3 values"):
        add_rows_(y, bias[:3])


def test_norm_silu_cat_with_bias_matches_eager():
    from vdbench.kernels.glue import norm_silu_cat

    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 24, 3, 4, 5, generator=g).to(DEV).contiguous(memory_format=torch.channels_last_3d)
    ctx = torch.randn(1, 24, 2, 4, 5, generator=g).to(DEV)
    gain, bias = (torch.rand(24, generator=g) + 0.5).to(DEV), torch.randn(24, generator=g).to(DEV)
    out = norm_silu_cat(x, ctx, gain, bias=bias)
    torch.testing.assert_close(out, _eager(x + bias.view(1, -1, 1, 1, 1), ctx, gain), atol=1e-5, rtol=1e-5)


def test_fused_decode_runs_convs_without_bias(monkeypatch):
    """With the fused glue every 3-D conv of the decoder and the upsamplers' 3x3 2-D convs run without their bias
    (added by the row kernels): the mechanism behind the speed-up is in effect. (The mid-block attention's 1x1
    projections keep theirs: latent resolution, a negligible pass.)"""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**_WAN21_VAE).eval().to(DEV)
    z = torch.randn(1, vae.config.z_dim, 3, 3, 5, generator=torch.Generator().manual_seed(2)).to(DEV)
    seen = {"with_bias": 0, "without": 0}
    for name in ("conv3d", "conv2d"):
        real = getattr(V.F, name)

        def spy(inp, weight, bias=None, *a, _real=real, **kw):
            if weight.dim() == 5 or weight.shape[-1] > 1:
                seen["without" if bias is None else "with_bias"] += 1
            return _real(inp, weight, bias, *a, **kw)

        monkeypatch.setattr(V.F, name, spy)
    with torch.no_grad():
        D.decode_video(vae, z, mode="fast", fused_glue=True)
    assert seen["without"] > 10 and seen["with_bias"] == 0, seen


@pytest.mark.parametrize("contiguous", [False, True], ids=["channels_last", "contiguous"])
def test_the_upsamplers_2d_stage_as_one_conv_of_2x2_kernels_equals_upsample_then_conv(contiguous):
    """Nearest 2x then a 3x3 conv, computed without the upsampled tensor: the same values (fp64), odd sizes, both
    input layouts; the output channels_last; the stage recognized only where it is that exact form."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

    g = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(6, 5, 3, padding=1).double()
    seq = torch.nn.Sequential(WanUpsample(scale_factor=(2.0, 2.0), mode="nearest-exact"), conv)
    x = torch.randn(3, 6, 5, 7, generator=g, dtype=torch.float64)
    if not contiguous:
        x = x.contiguous(memory_format=torch.channels_last)
    out = L.upsample_conv(x, conv)
    assert out.shape == (3, 5, 10, 14) and out.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():  # WanUpsample rounds through fp32: the reference is its interpolation in fp64
        ref = conv(torch.nn.functional.interpolate(x, scale_factor=(2.0, 2.0), mode="nearest-exact"))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert L._subpixel_ok(seq)
    assert not L._subpixel_ok(torch.nn.Sequential(WanUpsample(scale_factor=(2.0, 2.0), mode="bilinear"), conv))
    assert not L._subpixel_ok(torch.nn.Sequential(seq[0], torch.nn.Conv2d(6, 5, 3, padding=1, bias=False)))
    assert not L._subpixel_ok(torch.nn.Sequential(seq[0], torch.nn.Conv2d(6, 5, 3, padding=1, stride=2)))
    w4 = L.subpixel_weight(conv.weight)
    assert w4.shape == (20, 6, 2, 2)  # 4 parities x C_out, 2x2 taps: 16 multiply-adds per input pixel, not 36


@pytest.mark.parametrize("cin,cout,ft,fs,view", [(16, 16, 2, 2, True), (16, 8, 1, 2, True), (8, 8, 1, 2, True),
                                                 (6, 12, 2, 1, False)])
def test_dup_up_as_a_view_equals_diffusers_dup_up(cin, cout, ft, fs, view):
    """Wan 2.2's DupUp3D shortcut read through a strided view of its input: the same values as diffusers' module
    (which repeats and copies), a view where the repeats are a suffix of the factors; channels_last input too."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    up = DupUp3D(cin, cout, ft, fs)
    x = torch.randn(2, cin, 3, 4, 5, generator=torch.Generator().manual_seed(cin + cout))
    for inp in (x, x.contiguous(memory_format=torch.channels_last_3d)):
        v = L.dup_up_view(inp, up)
        b, co, t, ft_, h, fs_, w, _ = v.shape
        torch.testing.assert_close(v.reshape(b, co, t * ft_, h * fs_, w * fs_), up(inp), atol=0, rtol=0)
        assert (v.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()) == view


@pytest.mark.parametrize("c,dtype", [(5, torch.float32), (40, torch.bfloat16)])
def test_subpixel_bias_kernel_equals_the_four_strided_adds(c, dtype):
    """The Triton interleave of the sub-pixel conv's output (bias added, one rounding) equals the eager form."""
    from vdbench.kernels.glue import subpixel_bias

    g = torch.Generator().manual_seed(c)
    n, h, w = 2, 3, 5
    y4 = torch.randn(n, 4 * c, h + 1, w + 1, generator=g).to(DEV, dtype).contiguous(memory_format=torch.channels_last)
    bias = torch.randn(c, generator=g).to(DEV, dtype)
    out = torch.empty(n, c, 2 * h, 2 * w, device=DEV, dtype=dtype).contiguous(memory_format=torch.channels_last)
    subpixel_bias(y4, bias, out)
    ref = torch.empty_like(out)
    for a in (0, 1):
        for b in (0, 1):
            k = 2 * a + b
            ref[:, :, a::2, b::2] = y4[:, k * c:(k + 1) * c, a:a + h, b:b + w] + bias.view(1, -1, 1, 1)
    if DEV == "cpu" and dtype == torch.bfloat16:  # the interpreter's cast to bf16 truncates: one unit in the last place
        torch.testing.assert_close(out, ref, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="subpixel_bias: y4"):
        subpixel_bias(y4[:, :, :-1], bias, out)


@pytest.mark.parametrize("cin,cout,ft,fs,first", [(16, 16, 2, 2, False), (16, 16, 2, 2, True), (16, 8, 1, 2, False)])
def test_add_dup_up_kernel_equals_the_eager_add(cin, cout, ft, fs, first):
    """The Triton add of Wan 2.2's DupUp3D shortcut (read through its strided view) equals diffusers' module added
    eagerly, also for the first chunk (its last duplicated frame only)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    from vdbench.kernels.glue import add_dup_up_

    up = DupUp3D(cin, cout, ft, fs)
    g = torch.Generator().manual_seed(cin + cout + first)
    t = 1 if first else 3
    x_in = torch.randn(2, cin, t, 3, 4, generator=g).to(DEV).contiguous(memory_format=torch.channels_last_3d)
    t2 = 1 if first else t * ft
    x = torch.randn(2, cout, t2, 3 * fs, 4 * fs, generator=g).to(DEV).contiguous(memory_format=torch.channels_last_3d)
    src = L.dup_up_view(x_in, up)
    if first:
        src = src[:, :, :, ft - 1:]
    ref = x + up(x_in, first_chunk=first)
    torch.testing.assert_close(add_dup_up_(x, src), ref, atol=0, rtol=0)


@pytest.mark.parametrize("first", [False, True])
def test_subpixel_bias_adds_the_dup_up_shortcut_in_its_pass(first):
    """The interleave with the up block's DupUp3D shortcut (its 8-D view, frames of two batches) equals the
    interleave then the shortcut's add, summed in fp32 and rounded once; a shortcut of another shape is refused."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    from vdbench.kernels.glue import add_dup_up_, subpixel_bias

    c, b, h, w, ft = 8, 2, 3, 5, 2
    up = DupUp3D(4 * c, c, ft, 2)
    g = torch.Generator().manual_seed(7 + first)
    t = 1 if first else 3
    x_in = torch.randn(b, 4 * c, t, h, w, generator=g).to(DEV).contiguous(memory_format=torch.channels_last_3d)
    src = L.dup_up_view(x_in, up)
    if first:
        src = src[:, :, :, ft - 1:]
    frames = src.size(2) * src.size(3)
    y4 = torch.randn(b * frames, 4 * c, h + 1, w + 1, generator=g).to(DEV).contiguous(memory_format=torch.channels_last)
    bias = torch.randn(c, generator=g).to(DEV)
    out = torch.empty(b * frames, c, 2 * h, 2 * w, device=DEV).contiguous(memory_format=torch.channels_last)
    ref = subpixel_bias(y4, bias, torch.empty_like(out))
    ref5 = ref.view(b, frames, c, 2 * h, 2 * w).permute(0, 2, 1, 3, 4)
    ref5 = add_dup_up_(ref5.contiguous(memory_format=torch.channels_last_3d), src)
    got = subpixel_bias(y4, bias, out, add=src, frames=frames).view(b, frames, c, 2 * h, 2 * w).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(got, ref5, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="subpixel_bias: add"):
        subpixel_bias(y4, bias, out, add=src, frames=frames + 1)
