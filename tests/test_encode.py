"""vdbench.vae.encode: the fast Wan encode is the stock encode (fp32: to rounding; chunks of 1 with diffusers' layers:
bit-identical) and runs the lean layers, swapped in for the encode only; the pipeline swap (use_encode) is scoped to
its block, also on error, and refuses a second one; one check refuses what can't apply; a watchdog sees each
chunk. The fused (Triton) glue: tests/test_vae_glue.py."""

import pytest
import torch
from diffusers import AutoencoderKLCogVideoX, AutoencoderKLWan

from vdbench.vae import encode as E
from vdbench.vae import fast as V
from vdbench.vae import lean as L
from vdbench.families.cogvideox import COG_VAE
from vdbench.families.wan import WAN21_VAE, WAN21_VAE_REAL, WAN22_VAE
from vdbench.watchdog import Watchdog


def _wan(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    return AutoencoderKLWan(**cfg).eval().to(dtype).requires_grad_(False)


def _video(t=9, h=32, w=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, t, h, w, generator=g) * 2 - 1


@pytest.mark.parametrize("cfg", [WAN21_VAE, WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_fast_encode_equals_stock_fp32(cfg):
    vae = _wan(cfg)
    x = _video(t=11)  # 1 + 4 * 2 frames encoded, the last 2 dropped -- by diffusers and here alike
    with torch.no_grad():
        ref = vae._encode(x)
    assert torch.equal(E.wan_encode_chunked(vae, x, 1), ref)  # diffusers' calls and layers: bit-identical
    for k in (1, 2, 3):
        torch.testing.assert_close(E.wan_encode_chunked(vae, x, k), ref, atol=1e-5, rtol=0)
        for cl in (True, False):
            info = {}
            out = E.wan_encode_fast(vae, x, chunk_frames=k, channels_last=cl, info=info)
            assert out.shape == ref.shape and out.is_contiguous()
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
            assert info == {"path": "chunked", "chunk_frames": k, "channels_last": cl,
                            "glue": "eager (Triton glue not used: the VAE is on cpu)"}
    # nothing left behind: every forward is the class's again, every conv weight contiguous again
    assert not any("forward" in m.__dict__ for m in vae.modules())
    assert all(m.weight.is_contiguous() for m in vae.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)))


def test_fast_encode_runs_the_lean_layers(monkeypatch):
    """Not a silent stock encode: the encoder's lean forwards run, once per chunk (downsamples once per stage)."""
    calls = {"encoder": 0, "downsample": 0, "block": 0}

    def spy(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(L, "_lean_encoder", spy("encoder", L._lean_encoder))
    monkeypatch.setattr(L, "_lean_downsample", spy("downsample", L._lean_downsample))
    monkeypatch.setattr(L, "_lean_residual_block", spy("block", L._lean_residual_block))
    vae = _wan(WAN21_VAE)
    E.wan_encode_fast(vae, _video(t=9), chunk_frames=1)
    assert calls == {"encoder": 3, "downsample": 3 * 3, "block": 3 * 6}  # 3 chunks, 3 stages, 6 blocks


def test_fast_encode_in_bf16_is_as_close_to_fp32_as_diffusers():
    """The real Wan 2.1 VAE width in bf16: the fast encode's latents (fp32 norm, one rounding) are no further from
    the fp32 encode's than diffusers' bf16 encode's."""
    x = _video(t=5, h=16, w=16)
    ref = E.encode_video(_wan(WAN21_VAE_REAL), x)
    vae = _wan(WAN21_VAE_REAL, torch.bfloat16)

    def rel(a):
        return float((a.double() - ref.double()).norm() / ref.double().norm())

    stock, fast = rel(E.encode_video(vae, x)), rel(E.encode_video(vae, x, mode="fast", chunk_frames=1))
    assert 0 < fast < 0.05 and fast <= stock * 1.25, (stock, fast)


def test_encode_video_is_the_posterior_mean_for_any_vae():
    vae = _wan(WAN21_VAE)
    x = _video()
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mode()
    info = {}
    assert torch.equal(E.encode_video(vae, x, info=info), want) and info == {"path": "diffusers"}
    torch.manual_seed(0)
    cog = AutoencoderKLCogVideoX(**COG_VAE).eval().requires_grad_(False)
    with torch.no_grad():
        assert torch.equal(E.encode_video(cog, x), cog.encode(x).latent_dist.mode())
    with pytest.raises(ValueError, match="AutoencoderKLWan only, not AutoencoderKLCogVideoX"):
        E.encode_video(cog, x, mode="fast")


def test_use_encode_swaps_this_instance_for_its_scope_only():
    """What a pipeline calls (vae.encode) runs the fast encode inside the block; the class, another VAE and the same
    VAE after the block (also after an error) run diffusers' own; a second swap of the same VAE is refused."""
    vae, other = _wan(WAN21_VAE), _wan(WAN21_VAE)
    x = _video()
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mode()
        info = {}
        with E.use_encode(vae, "fast", E.EncodeOptions(chunk_frames=2), info=info) as got:
            assert got is info and "_encode" in vae.__dict__ and "_encode" not in other.__dict__
            out = vae.encode(x).latent_dist.mode()
            with pytest.raises(ValueError, match="already replaced"):
                with E.use_encode(vae, "fast"):
                    pass
        assert "_encode" not in vae.__dict__
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        assert info["path"] == "chunked" and info["chunk_frames"] == 2
        with pytest.raises(RuntimeError, match="boom"):
            with E.use_encode(vae, "fast"):
                raise RuntimeError("boom")
        assert "_encode" not in vae.__dict__
        with E.use_encode(vae, "default") as got:
            assert got == {"path": "diffusers"} and "_encode" not in vae.__dict__


def test_check_encode_is_the_one_check():
    assert E.check_encode("fast", family="wan") is E.MODES["fast"]
    assert E.check_encode("default", family="cogvideox").stock
    refused = [
        (("turbo",), {}, "unknown VAE encode mode 'turbo'; valid: default, fast"),
        (("fast",), dict(family="cogvideox"), "mode='fast' (the fast encode) is implemented for AutoencoderKLWan "
                                              "only, not AutoencoderKLCogVideoX; use mode='default'"),
        (("default", E.EncodeOptions(chunk_frames=2)), {}, "chunk_frames needs --vae_encode fast, not mode 'default'"),
        (("default", E.EncodeOptions(fused_glue=True)), dict(family="wan"),
         "fused_glue (--vae_glue triton) needs --vae_encode fast, not mode 'default'"),
        (("fast", E.EncodeOptions(compile_backend="eager", fused_glue=True)), {}, "exclude each other"),
        (("fast", E.EncodeOptions(chunk_frames=0)), {}, "chunk_frames must be >= 1"),
    ]
    for args, kw, msg in refused:
        with pytest.raises(ValueError) as e:
            E.check_encode(*args, **kw)
        assert msg in str(e.value), (args, kw, str(e.value))
    tiled = _wan(WAN21_VAE)
    tiled.enable_tiling()
    with pytest.raises(ValueError, match="does not tile, and this VAE has tiling enabled"):
        E.check_encode("fast", vae=tiled)
    assert E.check_encode("default", vae=tiled).stock  # diffusers' tiled encode
    from vdbench.backends import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="--vae_glue triton can't run on meta"):
        E.check_encode("fast", E.EncodeOptions(fused_glue=True), family="wan", device="meta")


def test_watchdog_sees_each_encode_chunk():
    with Watchdog(None, label="encode") as wd:
        E.encode_video(_wan(WAN21_VAE), _video(t=9), mode="fast", chunk_frames=1, watchdog=wd)
    assert [s for s, _ in wd.stages] == ["encode frames 0..0", "encode frames 1..4", "encode frames 5..8"]
