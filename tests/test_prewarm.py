"""vdbench.vae.prewarm: the fast VAE path's first-call compiles paid on a thread, from a decode on the meta device with
the glue in compile-only mode. Checked on CPU under Triton's interpreter: every kernel call the thread compiles is
compared, argument by argument, with the calls the real decode (and encode) makes -- the real one run with a GPU's
convolution layouts (``cuda_layouts``), since the CPU's differ; that the GPU's decode compiles nothing more is
what the decode records (``glue_compiled_in_call``) and bench/cold_decode.py measures."""

import pytest
import torch

pytest.importorskip("triton")

from vdbench import families  # noqa: E402
from vdbench.vae import decode as D  # noqa: E402
from vdbench.vae import encode as E  # noqa: E402
from vdbench.vae import prewarm as W  # noqa: E402
from vdbench.vae import fast as V  # noqa: E402
from vdbench.vae import lean as L  # noqa: E402
from vdbench.vae.decode import DecodeOptions  # noqa: E402
from vdbench.vae.encode import EncodeOptions  # noqa: E402
from vdbench.families.wan import WAN21_VAE, WAN22_VAE  # noqa: E402

from tests.conftest import triton_interpreter  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton_interpreter("vdbench.kernels.glue"):
        yield


MOD = 16  # the divisibility Triton specializes integers and pointers on


def _vae(cfg=WAN21_VAE):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**cfg).eval().requires_grad_(False)


def _plan(vae, pixel_hw, encode=False, fused=True, frames=None):
    dec, enc = DecodeOptions(fused_glue=fused), EncodeOptions(fused_glue=fused)
    return W.plan(vae_class=type(vae).__name__, device="cpu", decode_mode=D.check_decode("fast", dec),
                  decode_options=dec, encode_mode=E.check_encode("fast", enc) if encode else None,
                  encode_options=enc, pixel_hw=pixel_hw, frames=frames)


def _start(vae, p):
    return W.start_thread(lambda: W.meta_vae(type(vae), dict(vae.config)).to(vae.dtype), p)


def test_nothing_to_prewarm_without_the_triton_glue():
    vae = _vae()
    # on a CPU without fused_glue the fast path runs the eager glue: no compile to pay ahead
    assert _plan(vae, (64, 64), fused=None) is None
    # diffusers' own decode compiles none of vdbench's kernels; nor does the fast mode for a VAE it doesn't drive
    assert W.plan(vae_class="AutoencoderKLWan", device="cpu", decode_mode=D.MODES["default"],
                  decode_options=DecodeOptions(), pixel_hw=(64, 64)) is None
    assert W.plan(vae_class="AutoencoderKLCogVideoX", device="cpu", decode_mode=D.MODES["fast"],
                  decode_options=DecodeOptions(fused_glue=True), pixel_hw=(64, 64)) is None
    assert D.MODES["fast"].prewarm and not D.MODES["default"].prewarm


def _launch_recorder(monkeypatch):
    """Record, per glue launch, what Triton specializes a compiled kernel on: each tensor's dtype and alignment,
    each int's value class (1, divisible by the modulus, other) and 32/64-bit width, the constexprs and warps.
    Launches and compile-only calls (Triton's ``warmup``) are only recorded, never run: what Triton specializes a
    kernel on is in its launch arguments (above), not in the values the kernel would write, and the glue run under
    the interpreter costs seconds a decode (its numbers: tests/test_vae_glue.py)."""
    from vdbench.kernels import glue

    seen = set()
    loaded = {}  # one compiled kernel per specialization, as Triton's cache returns: its handles set up once

    class Compiled:
        def __init__(self, key):
            self.key, self.inits = key, 0

        def _init_handles(self):
            self.inits += 1

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
                self.record(args, kw)
            return launch

        def record(self, args, kw):
            key = (self.name, tuple(spec(a) for a in args), tuple(sorted(kw.items())))
            seen.add(key)
            return key

        def warmup(self, *args, grid, **kw):
            key = self.record(args, kw)
            return loaded.setdefault(key, Compiled(key))

    for name in ("_rms_silu_rows_kernel", "_add_rows_kernel"):
        monkeypatch.setattr(glue, name, Recorder(name, getattr(glue, name)))
    return seen, loaded


@pytest.mark.parametrize("cfg", [WAN21_VAE, WAN22_VAE], ids=["wan2.1", "wan2.2"])
def test_the_meta_decode_compiles_every_variant_the_real_decode_launches(cfg, monkeypatch):
    """The real decode finds nothing left to compile: every specialization it launches was compiled by the
    prewarm's meta-device decode (which launches nothing and never touches the real VAE)."""
    seen, compiled = _launch_recorder(monkeypatch)
    vae = _vae(cfg)
    s = vae.config.scale_factor_spatial
    h, w, t = 5, 7, 7  # 7 latent frames: the first, a chunk of 4, then one of 2 (its pieces other shapes)
    p = _plan(vae, (h * s, w * s), frames=(t - 1) * vae.config.scale_factor_temporal + 1)
    assert p is not None and p.decode is not None and p.encode is None
    rec = _start(vae, p).wait()
    assert rec["status"] == "done", rec
    assert set(rec["jobs"]) == {"meta_vae_s", "decode_s", "load_s"} and rec["waited_s"] >= 0
    warmed = set(seen)
    # and each compiled variant's module and launcher set up once: the first launch's host work done ahead
    assert rec["loaded"] == len(compiled) == len(warmed) and all(k.inits == 1 for k in compiled.values())
    assert warmed, "the prewarm launched no glue kernel"
    seen.clear()
    z = torch.randn(1, vae.config.z_dim, t, h, w, generator=torch.Generator().manual_seed(0))
    with W.cuda_layouts():  # the CPU's 3-D convolutions return contiguous outputs; a GPU's keep channels_last
        D.decode_video(vae, z, mode="fast", fused_glue=True)
    assert seen and seen <= warmed, f"launches the prewarm did not make: {seen - warmed}"


def test_the_prewarm_decodes_two_chunks_and_the_renders_last_one():
    """The meta decode's latent frames: the first, two chunks, and the render's last shorter chunk where it has one;
    the render's own count where that is fewer; two chunks where it is unknown."""
    assert W._decode_frames(None, 4) == 9 and W._decode_frames(None, 2) == 5
    assert W._decode_frames(5, 4) == 5 and W._decode_frames(9, 4) == 9  # fewer or as many: the render's own
    assert W._decode_frames(31, 4) == 11 and W._decode_frames(21, 4) == 9  # 1 + 7 x 4 + 2; 1 + 5 x 4
    assert W._decode_frames(12, 4) == 12  # 1 + 2 x 4 + 3


def test_a_contiguous_attention_output_changes_no_variant(monkeypatch):
    """On a GPU the mid block's attention (diffusers' own layer, before the lean one) handed the next block a
    contiguous tensor where the meta device's kept channels_last (an H200's fast decode compiled 3 variants the
    prewarm had not); the lean blocks put their input back in their weights' layout, so the decode launches the same
    variants whatever layout an attention hands them."""
    seen, _ = _launch_recorder(monkeypatch)
    vae = _vae()
    s = vae.config.scale_factor_spatial
    p = _plan(vae, (5 * s, 7 * s), frames=9)  # 3 latent frames, as decoded below
    assert _start(vae, p).wait()["status"] == "done"
    warmed = set(seen)
    seen.clear()
    from vdbench.vae import lean as L

    forward = L._gemm_attention
    outs = []

    def contiguous_out(self, x):
        y = forward(self, x).contiguous()
        outs.append(y.is_contiguous(memory_format=torch.channels_last_3d))
        return y

    monkeypatch.setattr(L, "_gemm_attention", contiguous_out)
    z = torch.randn(1, vae.config.z_dim, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    with W.cuda_layouts():
        D.decode_video(vae, z, mode="fast", fused_glue=True)
    assert outs and not any(outs)  # the attention's output really was contiguous
    assert seen and seen <= warmed, f"launches the prewarm did not make: {seen - warmed}"
    # and the guard is a no-op where the layouts already agree (no copy)
    x = torch.randn(1, 4, 2, 3, 5).contiguous(memory_format=torch.channels_last_3d)
    conv = torch.nn.Conv3d(4, 4, 3)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    assert L._match_weight_layout(x, conv) is x
    c = L._match_weight_layout(x.contiguous(), conv)
    assert c.is_contiguous(memory_format=torch.channels_last_3d) and torch.equal(c, x)
    assert L._match_weight_layout(x.contiguous(), torch.nn.Conv3d(4, 4, 3)).is_contiguous()  # weights contiguous


def test_the_prewarm_leaves_the_pipeline_vae_untouched_and_covers_the_encode(monkeypatch):
    seen, _ = _launch_recorder(monkeypatch)
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
    from vdbench.vae import encode as E

    x = torch.rand(1, 3, 9, 40, 56, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with W.cuda_layouts():
        E.wan_encode_fast(vae, x, fused_glue=True)
    assert seen and seen <= warmed


def test_a_failed_prewarm_is_recorded_and_the_decode_still_runs(monkeypatch):
    vae = _vae()
    p = _plan(vae, (32, 32))

    def boom():
        raise RuntimeError("CUDA out of memory.\nmore")

    pw = W.start_thread(boom, p)

    class Pipe:  # what decode_latents reads of a pipeline
        pass

    pipe = Pipe()
    pipe.vae = vae
    from diffusers.video_processor import VideoProcessor

    pipe.video_processor = VideoProcessor(vae_scale_factor=8)
    latents = torch.randn(1, vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    info = {}
    frames = D.decode_latents(pipe, latents, families.get("wan"), mode="fast", fused_glue=True, info=info,
                              prewarm=pw)
    assert frames.shape[-1] == 3
    assert info["prewarm"] == "failed (RuntimeError: CUDA out of memory.)"
    assert set(info["one_time"]) == {"prewarm_wait_s"} and info["prewarm_s"] >= 0
    assert pw.done


def test_the_first_use_runs_the_path_on_a_zero_weight_copy_and_leaves_the_vae_untouched(monkeypatch):
    """The prewarm's last part (on a GPU: the process's first use of cuDNN's kernels) decodes and encodes a tiny
    latent with its own zero-weight copy of the VAE, through the same fused path, never the pipeline's VAE."""
    seen, _ = _launch_recorder(monkeypatch)
    vae = _vae()
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    p = _plan(vae, (40, 56), encode=True)
    made = []

    def make():
        made.append(W.meta_vae(type(vae), dict(vae.config)).to(vae.dtype))
        return made[-1]

    pw = W.start_thread(make, p)
    assert pw.wait()["status"] == "done"
    seen.clear()
    pw._first_use(p)  # on a CPU plan the thread skips it (no cuDNN); called here as the GPU's thread calls it
    assert len(made) == 2 and made[1] is not vae  # a second copy of its own, built from the meta VAE
    assert seen, "the tiny decode / encode launched no glue kernel: not the fast path"
    after = vae.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any("forward" in m.__dict__ for m in vae.modules())
