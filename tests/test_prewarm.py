"""vdbench.prewarm: the fast VAE path's first-call compiles paid on a thread, on a scratch VAE, at a small size that
gives every Triton launch the real call's specialization. Checked on CPU under Triton's interpreter: the thread runs
the real code path; which launches it makes is compared, argument by argument, with the real call's."""

import pytest
import torch

pytest.importorskip("triton")

from vdbench import decode as D  # noqa: E402
from vdbench import prewarm as W  # noqa: E402
from vdbench import vae as V  # noqa: E402
from vdbench.decode import DecodeOptions  # noqa: E402
from vdbench.encode import EncodeOptions  # noqa: E402
from vdbench.families.wan import WAN21_VAE, WAN22_VAE  # noqa: E402

from tests.conftest import triton_interpreter  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton_interpreter("vdbench.kernels.glue"):
        yield


#: The interpreter is slow at the sizes where congruence mod 16 differs from equality (latents >= 32): the tests
#: scale the rule down to divisibility by 4 -- the prewarm's small size and the recorded specialization alike.
MOD = 4


@pytest.fixture
def small_modulus(monkeypatch):
    monkeypatch.setattr(W, "SPEC_MODULUS", MOD)


def _vae(cfg=WAN21_VAE):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**cfg).eval().requires_grad_(False)


def _plan(vae, pixel_hw, encode=False, fused=True):
    return W.plan(vae_class=type(vae).__name__, device="cpu", decode_mode="fast",
                  decode_options=DecodeOptions(fused_glue=fused), encode_mode="fast" if encode else None,
                  encode_options=EncodeOptions(fused_glue=fused), pixel_hw=pixel_hw)


def _start(vae, p):
    return W.start(lambda: W.scratch_like(vae), p)


@pytest.mark.parametrize("size,modulus", [(60, 16), (104, 16), (90, 16), (160, 16), (7, 16), (480, 128), (836, 128)])
def test_small_size_keeps_every_product_congruent_mod_16(size, modulus):
    small = W.small_size(size, modulus)
    assert modulus <= small < 2 * modulus
    for scale in (1, 2, 4, 8):  # the decoder's levels (upsampled x2 three times)
        for other in (1, 3, 16, 27, 96, 384):  # the other sizes and channel counts a size or stride multiplies
            assert (small * scale * other) % 16 == (size * scale * other) % 16


def test_nothing_to_prewarm_without_the_triton_glue():
    vae = _vae()
    # on a CPU without fused_glue the fast path runs the eager glue: no compile to pay ahead
    assert _plan(vae, (64, 64), fused=None) is None
    # diffusers' own decode compiles none of vdbench's kernels; nor does the fast mode for a VAE it doesn't drive
    assert W.plan(vae_class="AutoencoderKLWan", device="cpu", decode_mode="default", decode_options=DecodeOptions(),
                  pixel_hw=(64, 64)) is None
    assert W.plan(vae_class="AutoencoderKLCogVideoX", device="cpu", decode_mode="fast",
                  decode_options=DecodeOptions(fused_glue=True), pixel_hw=(64, 64)) is None
    assert D.MODES["fast"].prewarm and not D.MODES["default"].prewarm


def _launch_recorder(monkeypatch):
    """Record, per glue launch, what Triton specializes a compiled kernel on: each tensor's dtype and alignment,
    each int's value class (1, divisible by the modulus, other) and 32/64-bit width, the constexprs and warps
    (with the modulus scaled down to :data:`MOD`, as the prewarm's small size is in these tests)."""
    from vdbench.kernels import glue

    seen = set()

    def spec(a):
        if isinstance(a, torch.Tensor):
            return ("ptr", str(a.dtype), a.data_ptr() % MOD == 0)
        if isinstance(a, bool):
            return ("bool", a)
        if isinstance(a, int):
            return ("int", a == 1, a % MOD == 0, -2**31 <= a < 2**31)
        if isinstance(a, float):
            return ("fp",)
        return (type(a).__name__,)

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.add((self.name, tuple(spec(a) for a in args), tuple(sorted(kw.items()))))
                return self.fn[grid](*args, **kw)
            return launch

    for name in ("_rms_silu_rows_kernel", "_add_rows_kernel"):
        monkeypatch.setattr(glue, name, Recorder(name, getattr(glue, name)))
    return seen


@pytest.mark.parametrize("cfg", [WAN21_VAE, WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_the_small_decode_makes_every_launch_the_real_decode_makes(cfg, monkeypatch, small_modulus):
    """The point of the small size: the real decode finds nothing left to compile. Both decodes' launches are
    recorded; every specialization the real one uses must have been made by the prewarm."""
    seen = _launch_recorder(monkeypatch)
    vae = _vae(cfg)
    s = vae.config.scale_factor_spatial
    h, w = 9, 11  # a latent size whose small twin (5, 7) differs from it
    p = _plan(vae, (h * s, w * s))
    assert p is not None and p.decode is not None and p.encode is None
    rec = _start(vae, p).wait()
    assert rec["status"] == "done", rec
    assert set(rec["jobs"]) == {"scratch_vae_s", "decode_s"} and rec["waited_s"] >= 0
    warmed = set(seen)
    assert warmed, "the prewarm launched no glue kernel"
    seen.clear()
    z = torch.randn(1, vae.config.z_dim, 7, h, w, generator=torch.Generator().manual_seed(0))
    D.decode_video(vae, z, mode="fast", fused_glue=True)
    assert seen and seen <= warmed, f"launches the prewarm did not make: {seen - warmed}"


def test_the_prewarm_leaves_the_pipeline_vae_untouched_and_covers_the_encode(monkeypatch, small_modulus):
    seen = _launch_recorder(monkeypatch)
    vae = _vae()
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    p = _plan(vae, (40, 56), encode=True)
    assert p.encode is not None
    rec = _start(vae, p).wait()
    assert rec["status"] == "done" and {"encode_s", "decode_s"} <= set(rec["jobs"])
    after = vae.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any("forward" in m.__dict__ for m in vae.modules())  # no lean layer left on the real VAE
    warmed = set(seen)
    seen.clear()
    from vdbench import encode as E

    x = torch.rand(1, 3, 9, 40, 56, generator=torch.Generator().manual_seed(2)) * 2 - 1
    E.wan_encode_fast(vae, x, fused_glue=True)
    assert seen and seen <= warmed


def test_a_failed_prewarm_is_recorded_and_the_decode_still_runs(monkeypatch):
    vae = _vae()
    p = _plan(vae, (32, 32))

    def boom():
        raise RuntimeError("CUDA out of memory.\nmore")

    pw = W.start(boom, p)

    class Pipe:  # what decode_latents reads of a pipeline
        pass

    pipe = Pipe()
    pipe.vae = vae
    from diffusers.video_processor import VideoProcessor

    pipe.video_processor = VideoProcessor(vae_scale_factor=8)
    latents = torch.randn(1, vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    info = {}
    frames = D.decode_latents(pipe, latents, "wan", mode="fast", fused_glue=True, info=info, prewarm=pw)
    assert frames.shape[-1] == 3
    assert info["prewarm"] == "failed (RuntimeError: CUDA out of memory.)"
    assert set(info["one_time"]) == {"prewarm_wait_s"} and info["prewarm_s"] >= 0
    assert pw.done
