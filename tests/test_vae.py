"""vdbench.vae.fast: the fast Wan decode path is the stock decode (fp32: to float rounding; bf16 upsampling:
bit-identical; bf16 lean layers: as close to fp32 as diffusers' bf16), its lean layers and channels_last weights
are swapped in for the duration of a decode only (restored on error too, foreign hooks left alone), the
memory-bounded mode picks its chunk/tile from the budget, modes that can't run say so, and a decode can run under
the watchdog. Peak memory: tests/test_vae_memory.py."""

import time
import types

import pytest
import torch
from diffusers import AutoencoderKLCogVideoX, AutoencoderKLWan
from diffusers.video_processor import VideoProcessor

from vdbench import families
from vdbench.vae import decode as D
from vdbench.vae import fast as V
from vdbench.vae import lean as L
from vdbench.families.cogvideox import COG_VAE as _COG_VAE
from vdbench.families.wan import WAN21_VAE as _WAN21_VAE, WAN22_VAE as _WAN22_VAE
from vdbench.watchdog import WatchdogTimeout


def _wan(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    return AutoencoderKLWan(**cfg).eval().to(dtype)


@pytest.fixture(scope="module")
def wan21():
    return _wan(_WAN21_VAE)


def _z(vae, t=5, h=4, w=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, vae.config.z_dim, t, h, w, generator=g)


@pytest.mark.parametrize("cfg", [_WAN21_VAE, _WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_chunked_decode_equals_stock_fp32(cfg):
    vae = _wan(cfg)
    z = _z(vae)
    ref = vae.decode(z, return_dict=False)[0]
    for k in (1, 2, 3, 4, 8):
        out = V.wan_decode_chunked(vae, z, k)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
        if k == 1:
            assert torch.equal(out, ref)  # same calls as diffusers: bit-identical


def test_native_dtype_upsample_is_bit_identical_in_bf16(wan21):
    vae = _wan(_WAN21_VAE, torch.bfloat16)
    z = _z(vae, t=3).bfloat16()
    ref = vae.decode(z, return_dict=False)[0]
    assert torch.equal(V.wan_decode_chunked(vae, z, 1, native_upsample=True), ref)
    # and the instance patch is removed afterwards
    assert not any("forward" in m.__dict__ for m in vae.modules() if type(m).__name__ == "WanUpsample")


def test_decode_video_modes(wan21):
    z = _z(wan21)
    ref = D.decode_video(wan21, z, mode="default")
    info = {}
    fast = D.decode_video(wan21, z, mode="fast", chunk_frames=2, info=info)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=0)
    assert info == {"path": "chunked", "chunk_frames": 2, "tail_frames": [2, 1], "channels_last": True,
                    "glue": "eager (Triton glue not used: the VAE is on cpu)"}
    with pytest.raises(ValueError, match="unknown VAE decode mode"):
        D.decode_video(wan21, z, mode="turbo")


def test_channels_last_3d_same_result(wan21):
    vae = _wan(_WAN21_VAE)
    z = _z(vae, t=3)
    ref = vae.decode(z, return_dict=False)[0]
    V.channels_last_3d(vae)
    conv3d = [m for m in vae.modules() if isinstance(m, torch.nn.Conv3d)]
    assert conv3d and all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) for m in conv3d)
    torch.testing.assert_close(V.wan_decode_chunked(vae, z, 2), ref, atol=1e-4, rtol=0)


def test_fast_and_memory_refused_for_other_vaes():
    torch.manual_seed(0)
    cog = AutoencoderKLCogVideoX(**_COG_VAE).eval()
    z = torch.randn(1, 16, 3, 4, 6)
    with pytest.raises(ValueError, match="AutoencoderKLWan only"):
        D.decode_video(cog, z, mode="fast")
    with pytest.raises(ValueError, match="AutoencoderKLWan only"):
        D.decode_video(cog, z, max_memory_gib=1.0)


def test_parallel_mode_runs_the_band_decode(monkeypatch, wan21):
    """mode='parallel' is vdbench.vae.parallel's band decode (stubbed here: it needs a process group), given the
    chunk size and the info dict; what does not apply to a band decode is refused before it runs."""
    from vdbench.vae import parallel as vae_parallel

    calls = []

    def fake(vae, z, chunk_frames=None, info=None, family=None):
        calls.append((z.shape, chunk_frames))
        info["rank"] = 0
        return torch.zeros(1)

    monkeypatch.setattr(vae_parallel, "decode_video_parallel", fake)
    info = {}
    D.decode_video(wan21, _z(wan21), mode="parallel", chunk_frames=2, info=info)
    assert calls == [(torch.Size([1, 16, 5, 4, 6]), 2)] and info == {"path": "parallel", "rank": 0}
    with pytest.raises(ValueError, match=r"max_memory_gib \(--vae_max_memory\) needs --vae_decode default or fast"):
        D.decode_video(wan21, _z(wan21), mode="parallel", max_memory_gib=1.0)
    assert len(calls) == 1


def test_check_decode_is_the_one_check(wan21):
    """One function refuses every decode request that can't run -- from the VAE (decode_video) or, before any
    model is loaded, from the family (the render) -- with what to use instead."""
    assert D.check_decode("fast", vae=wan21) is D.MODES["fast"]
    assert D.check_decode("parallel", family="cogvideox").name == "parallel"
    assert D.check_decode("default", D.DecodeOptions(max_memory_gib=2.0, fused_glue=False), family="wan").stock
    refused = [
        (("turbo",), {}, "unknown VAE decode mode 'turbo'; valid: default, fast, parallel"),
        (("fast",), dict(family="cogvideox"), "mode='fast' is implemented for AutoencoderKLWan only, not "
                                               "AutoencoderKLCogVideoX"),
        (("parallel",), dict(vae=type("AutoencoderKLHunyuanVideo", (), {})()),
         "not AutoencoderKLHunyuanVideo; use mode='default'"),
        (("default", D.DecodeOptions(max_memory_gib=1.0)), dict(family="cogvideox"),
         "max_memory_gib is implemented for AutoencoderKLWan only"),
        (("default", D.DecodeOptions(fused_glue=True)), dict(family="wan"),
         "fused_glue (--vae_glue triton) needs --vae_decode fast, not mode 'default'"),
        (("default", D.DecodeOptions(chunk_frames=2)), {}, "chunk_frames needs --vae_decode fast or parallel"),
        (("fast", D.DecodeOptions(compile_backend="eager", max_memory_gib=1.0)), {}, "exclude each other"),
        (("default",), dict(family="sd"), "Unknown model family 'sd'; expected one of wan, cogvideox"),
    ]
    for args, kw, msg in refused:
        with pytest.raises(ValueError) as e:
            D.check_decode(*args, **kw)
        assert msg in str(e.value), (args, kw, str(e.value))
    # the render's device check: the Triton glue where it can't run is refused like an unavailable backend
    from vdbench.backends import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="--vae_glue triton can't run on meta"):
        D.check_decode("fast", D.DecodeOptions(fused_glue=True), family="wan", device="meta")


def test_choose_chunk_frames():
    assert V.choose_chunk_frames(10e9, 1e9, 21) == 10
    assert V.choose_chunk_frames(100e9, 1e9, 21) == 20  # never more than the frames after the first
    assert V.choose_chunk_frames(0.5e9, 1e9, 21) == 0  # below one frame: tile
    assert V.choose_chunk_frames(-1, 1e9, 21) == 0


def test_memory_bounded_picks_chunk_then_tiles(wan21):
    z = _z(wan21)
    ref = D.decode_video(wan21, z)
    per = V._wan_frame_bytes_estimate(wan21, 4, 6)
    big, small = {}, {}
    out = D.decode_video(wan21, z, max_memory_gib=100.0, info=big)
    assert big["path"] == "chunked" and big["chunk_frames"] == 4
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    out = D.decode_video(wan21, z, max_memory_gib=(2.5 * per + 3 * 17 * 32 * 48 * 4) / 2 ** 30, info=small)
    assert small["path"] == "chunked" and small["chunk_frames"] == 2
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    tiny = {}
    out = D.decode_video(wan21, z, max_memory_gib=1e-6, info=tiny)
    assert tiny["path"] == "tiled+chunked" and tiny["tile_px"] == 64 and out.shape == ref.shape
    assert wan21.use_tiling is False


@pytest.mark.parametrize("cfg", [_WAN21_VAE, _WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_tiled_chunked_equals_diffusers_tiling(cfg):
    vae = _wan(cfg)
    sp = cfg["scale_factor_spatial"]
    g = torch.Generator().manual_seed(2)
    z = torch.randn(1, vae.config.z_dim, 2, 64 // sp * 2, 64 // sp * 3, generator=g)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                      tile_sample_stride_width=48)
    ref = vae.decode(z, return_dict=False)[0]
    out = V.wan_decode_tiled_chunked(vae, z, 64, 48, 2)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def _pipe(vae):
    return types.SimpleNamespace(vae=vae, video_processor=VideoProcessor(vae_scale_factor=8))


def test_decode_latents_fast_matches_default(wan21):
    pipe = _pipe(wan21)
    lat = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(3))
    a = D.decode_latents(pipe, lat, families.get("wan"))
    info = {}
    b = D.decode_latents(pipe, lat, families.get("wan"), mode="fast", chunk_frames=2, info=info)
    assert a.shape == b.shape == (9, 32, 48, 3) and abs(a - b).max() < 1e-4 and info["path"] == "chunked"


def test_decode_latents_timeout_catches_stall(monkeypatch, wan21):
    pipe = _pipe(wan21)
    lat = torch.randn(1, 16, 2, 4, 6)
    monkeypatch.setattr(wan21.decoder, "forward", lambda *a, **k: time.sleep(30))
    t0 = time.monotonic()
    with pytest.raises(WatchdogTimeout) as ei:
        D.decode_latents(pipe, lat, families.get("wan"), mode="fast", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert ei.value.report.last_completed_stage == "decode"  # decode_video started; chunk 0 is the stall
    assert ei.value.report.current_stage == "decode latent frames 0..0"


# ------------------------------------------------------------------------------------------------------------
# fast path: lean layers (fast_layers) and channels_last, scoped
# ------------------------------------------------------------------------------------------------------------

def _instance_forwards(vae):
    return [n for n, m in vae.named_modules() if "forward" in m.__dict__]


def _weight_layouts(vae):
    return [m.weight.is_contiguous() for m in vae.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]


@pytest.mark.parametrize("cfg", [_WAN21_VAE, _WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_fast_path_equals_stock_fp32_and_is_undone(cfg, monkeypatch):
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    vae = _wan(cfg)
    # 1 chunk after frame 0; uneven chunks (5 latent frames -> 17 video frames); odd latent sizes
    zs = {t: _z(vae, t=t, h=3, w=5, seed=t) for t in (2, 5)}
    refs = {t: vae.decode(z, return_dict=False)[0] for t, z in zs.items()}
    # Wan 2.2: the DupUp3D shortcut must go through the in-place 8-D add, not diffusers' module
    monkeypatch.setattr(W.DupUp3D, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("DupUp3D")))
    for t, z in zs.items():
        for k in (1, 2, 3):
            for cl in (True, False):
                info = {}
                out = D.decode_video(vae, z, mode="fast", chunk_frames=k, channels_last=None if cl else False,
                                     info=info)
                assert out.shape == refs[t].shape and out.is_contiguous()
                torch.testing.assert_close(out, refs[t], atol=5e-5, rtol=0, msg=f"t={t} K={k} channels_last={cl}")
                assert info == {"path": "chunked", "chunk_frames": k, "tail_frames": [min(2, k), 1],
                                "channels_last": cl,
                                "glue": "eager (Triton glue not used: the VAE is on cpu)"}
                assert _instance_forwards(vae) == [] and all(_weight_layouts(vae))
    monkeypatch.undo()
    for t, z in zs.items():  # a later stock decode: bit-identical to the one before
        assert torch.equal(vae.decode(z, return_dict=False)[0], refs[t])


def test_fast_layers_swap_and_restore_even_on_error(wan21):
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    vae = _wan(_WAN21_VAE)
    z = _z(vae, t=3)
    ref = vae.decode(z, return_dict=False)[0]
    before = [p.detach().clone() for p in vae.parameters()]
    with V.fast_layers(vae) as patched:
        kinds = {type(m).__name__ for m in patched}
        assert {"WanCausalConv3d", "WanRMS_norm", "WanResidualBlock", "WanDecoder3d", "WanResample"} <= kinds
        convs = [m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d)]
        assert all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) for m in convs)
        assert not any("forward" in m.__dict__ for m in vae.encoder.modules())  # only the decode path
    assert _instance_forwards(vae) == [] and all(_weight_layouts(vae))
    # an error inside the decode (here: in the third decoder call) still restores everything
    calls = []

    class Boom:
        def stage(self, name):
            calls.append(name)
            if len(calls) == 3:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        V.wan_decode_chunked(vae, z, 1, lean=True, channels_last=True, watchdog=Boom())
    assert _instance_forwards(vae) == [] and all(_weight_layouts(vae))
    assert all(torch.equal(a, b) for a, b in zip(before, vae.parameters()))
    assert torch.equal(vae.decode(z, return_dict=False)[0], ref)
    # the class is never touched; another VAE is never touched
    other = _wan(_WAN21_VAE)
    with V.fast_layers(vae):
        assert W.WanCausalConv3d.forward is not L._lean_causal_conv3d and _instance_forwards(other) == []


def test_fast_layers_leave_foreign_hooks_alone(wan21):
    """A module that already has an instance forward (another hook) is neither replaced nor bypassed."""
    vae = _wan(_WAN21_VAE)
    z = _z(vae, t=2)
    conv = vae.decoder.up_blocks[0].resnets[0].conv1
    seen = []

    def hook(x, cache_x=None):
        seen.append(x.shape)
        return type(conv).forward(conv, x, cache_x)

    conv.forward = hook
    ref = vae.decode(z, return_dict=False)[0]
    n_stock = len(seen)
    out = D.decode_video(vae, z, mode="fast", chunk_frames=1)
    assert len(seen) == 2 * n_stock and conv.forward is hook  # called for every chunk, still installed
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)


def test_fast_path_bf16_quality_matches_stock_bf16():
    """Lean RMS norm (fp32-accumulated, native-dtype passes): as close to fp32 as diffusers' bf16 decode."""
    vae = _wan(_WAN21_VAE)
    z = _z(vae, t=3, h=8, w=12)
    ref = vae.decode(z, return_dict=False)[0]
    vb = _wan(_WAN21_VAE, torch.bfloat16)
    stock = vb.decode(z.bfloat16(), return_dict=False)[0]
    fast = D.decode_video(vb, z.bfloat16(), mode="fast")

    def psnr(a):
        return float(10 * torch.log10(1 / (((a.float() - ref) / 2) ** 2).mean().detach()))

    assert psnr(fast) > 45 and psnr(fast) > psnr(stock) - 1.0


def test_fast_default_chunk_is_four_with_the_triton_glue_and_one_without(wan21):
    """The measured default (four latent frames a call, the blocks past the first temporal upsampling two at a time,
    the tail one) where the Triton glue runs; one latent frame a call with the eager glue (a CPU render's frames
    unchanged)."""
    assert (V.FAST_DEFAULT_CHUNK, V.FAST_EAGER_CHUNK, V.FAST_DEFAULT_TAIL) == (4, 1, (2, 1))
    info = {}
    D.decode_video(wan21, _z(wan21, t=3), mode="fast", info=info)
    assert (info["chunk_frames"], info["tail_frames"]) == (1, [1, 1]) and info["glue"].startswith("eager")
    from tests.conftest import triton_interpreter

    with triton_interpreter("vdbench.kernels.glue"):
        info = {}
        D.decode_video(wan21, _z(wan21, t=3), mode="fast", fused_glue=True, info=info)
    assert (info["chunk_frames"], info["tail_frames"]) == (3, [2, 1]) and info["glue"] == V.GLUE_TRITON


def test_fast_path_compiled_glue_equals_stock_fp32():
    """compile_backend: the norm -> SiLU -> conv-input glue through torch.compile ('eager' backend here: the
    same traced graph, no C++ toolchain needed); same result, no graph break, nothing left installed."""
    from torch._dynamo.utils import counters

    vae = _wan(_WAN21_VAE)
    z = _z(vae, t=4, h=3, w=5)
    ref = vae.decode(z, return_dict=False)[0]
    breaks = sum(counters["graph_break"].values())
    info = {}
    out = D.decode_video(vae, z, mode="fast", compile_backend="eager", info=info)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)
    assert info["compile_backend"] == "eager" and sum(counters["graph_break"].values()) == breaks
    assert L._GLUE.get() is None and _instance_forwards(vae) == []
    with pytest.raises(ValueError, match="compile_backend"):
        D.decode_video(vae, z, mode="default", compile_backend="eager")


def test_a_pointwise_conv_runs_as_one_gemm_and_keeps_channels_last():
    """1x1x1 convs (residual shortcuts, post_quant_conv) on channels_last_3d input: one GEMM over the rows with the
    bias in its epilogue, the output channels_last_3d whatever the device's conv would choose; the conv's result
    to rounding; not taken where the layout or the conv's shape doesn't allow a rows view."""
    from vdbench.vae import fast as V
    from vdbench.vae import lean as L

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(8, 12, 1)
    x = torch.randn(2, 8, 3, 5, 7).contiguous(memory_format=torch.channels_last_3d)
    y = L._pointwise_gemm(conv, x)
    ref = torch.nn.functional.conv3d(x, conv.weight, conv.bias)
    assert y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert L._pointwise_gemm(torch.nn.Conv3d(8, 12, 1, bias=False), x).shape == ref.shape
    assert L._pointwise_gemm(conv, x.contiguous()) is None  # contiguous input: the conv as it is
    assert L._pointwise_gemm(torch.nn.Conv3d(8, 12, 3), x) is None
    assert L._pointwise_gemm(torch.nn.Conv3d(8, 12, 1, stride=2), x) is None

@pytest.mark.parametrize("budget", [None, 4 * 35 * 35 * 2, 4 * 35 * 8], ids=["whole", "frames", "queries"])
@pytest.mark.parametrize("cl", [True, False], ids=["channels_last", "contiguous"])
def test_lean_attention_block_equals_diffusers_attention(cl, budget, monkeypatch):
    """The mid block's attention as two GEMMs and a softmax (fp32 scores): diffusers' module's values, whether the
    scores fit whole, in blocks of frames (two at a time) or of a frame's queries (8 at a time), either layout; the
    output channels_last_3d; the fast layers install it for the decode, where it runs with the Triton glue (diffusers'
    own forward with the eager glue: a CPU render's frames unchanged)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock

    torch.manual_seed(0)
    blk = WanAttentionBlock(32).eval()
    for p in blk.parameters():
        p.data.normal_(0, 0.2)  # away from the init's zero biases and unit gains
    x = torch.randn(3, 32, 3, 5, 7, generator=torch.Generator().manual_seed(1))
    if cl:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    if budget is not None:
        monkeypatch.setattr(L, "_ATTN_SCORE_BYTES", budget)
    calls = []
    real = L._scores
    monkeypatch.setattr(L, "_scores", lambda q, k: calls.append(tuple(q.shape)) or real(q, k))
    with torch.no_grad():
        ref = blk(x)
        out = L._gemm_attention(blk, x)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    want = {None: [(9, 35, 32)], 4 * 35 * 35 * 2: [(2, 35, 32)] * 4 + [(1, 35, 32)] * 1,
            4 * 35 * 8: [(1, 8, 32)] * 4 * 9 + [(1, 3, 32)] * 9}[budget]
    assert sorted(calls) == sorted(want)
    vae = _wan(_WAN21_VAE)
    with L.fast_layers(vae):
        attn = [m for m in vae.decoder.modules() if type(m) is WanAttentionBlock]
        assert attn and all(m.forward.__func__ is L._lean_attention_block for m in attn)
    blk.forward = L._lean_attention_block.__get__(blk)
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(blk(x), ref, atol=0, rtol=0)  # the eager glue: diffusers' forward
    assert not calls
    token = L._ROWS.set(object())  # the Triton glue's scope (the attention uses none of its kernels)
    try:
        with torch.no_grad():
            torch.testing.assert_close(blk(x), out, atol=0, rtol=0)
    finally:
        L._ROWS.reset(token)
    assert calls


def test_fast_layers_refuse_a_tail_of_no_frames():
    vae = _wan(_WAN21_VAE)
    for bad, lean in ((0, True), ((2, 0), True), ((), True), (1, False)):
        with pytest.raises(ValueError, match="tail_frames needs lean=True"):
            with L.fast_layers(vae, lean=lean, tail_frames=bad):
                pass
    assert not any("forward" in m.__dict__ for m in vae.modules())  # nothing left installed
