"""A render's VAE one-time costs paid ahead, on a background thread, under work the render does anyway.

Why: a render decodes once, so its decode is always a *first* call. The fast Wan decode's glue kernels
(:mod:`vdbench.kernels.glue`, Triton) are compiled on their first launch: on an H200 with empty Triton caches the
fast decode's first call at Wan 720p x 81 took 9.41 s against 2.07 s warm, ~6.5 s of it Triton compiling the
glue -- enough to make ``--vae_decode fast`` slower end to end than diffusers' decode (4.72 s first call).

What :class:`Prewarm` does: while the pipeline loads (the render starts it before the weights, from the VAE's
config alone) and then while the GPU denoises, a daemon thread decodes (and, for image-to-video, first encodes) a
*small* clip through the same fast path, on a scratch VAE (same class, config, dtype and device; seeded random
weights; freed afterwards -- the pipeline's VAE is never touched, so an encode or decode running meanwhile is not
disturbed). The small clip's spatial size is congruent to the real one modulo 16 at the
latent level (128 in pixels for the encoder, whose deepest level is 1/8), with a first chunk and steady chunks, so
every Triton launch has the real call's specialization -- dtypes, channel counts, layouts and the divisibility of
every size and stride by 16 -- and the real decode finds each kernel compiled in the process. Its GPU work is a
few milliseconds. :meth:`Prewarm.wait` joins the thread (the render calls it inside the decode stage, so any wait
is counted there) and returns what it did; the decode records how many glue variants were still compiled during
the real call (0 when the prewarm covered them).

Costs not moved: cuDNN's execution plans are cached per thread and per shape in PyTorch, so a warm-up on another
thread, or at another size, does not make the real call's convolutions warm; ``real_frames`` > 0 adds a decode of
that many latent frames at the real size on the thread, to measure what of the remaining first-call work moves
(bench/cold_decode.py). The CPU work of compiling runs under the GIL beside the denoising loop's kernel launches.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import vae as V
from .decode import DecodeMode, DecodeOptions, check_decode
from .encode import EncodeMode, EncodeOptions, check_encode

log = logging.getLogger(__name__)

__all__ = ["Prewarm", "PrewarmPlan", "plan", "start", "small_size", "scratch_vae", "scratch_like", "SPEC_MODULUS"]

#: Latent frames of the small decode: the first chunk alone, then chunks until every causal cache and temporal
#: upsampler is in its steady state (Wan 2.2's up blocks reach it later than Wan 2.1's).
_DECODE_FRAMES = 5
#: The divisibility Triton specializes integer arguments and pointers on.
SPEC_MODULUS = 16
#: Video frames of the small encode: the first frame alone, then chunks of four (1 + 4k).
_ENCODE_FRAMES = 9


def small_size(size: int, modulus: int) -> int:
    """The smallest size >= ``modulus`` congruent to ``size`` modulo ``modulus``: every product of it with the other
    sizes of a level has the same divisibility by ``modulus`` as the real one's (Triton specializes on divisibility
    by :data:`SPEC_MODULUS`)."""
    return modulus + size % modulus


@dataclass(frozen=True)
class PrewarmPlan:
    """What one prewarm runs: the fast decode and/or the fast encode (each its mode entry and options, as the
    render's decode and encode will run them) of a clip whose real size is ``pixel_hw``; ``real_frames`` latent
    frames decoded at the real size after the small clip (0: none); ``why_not``: why a part has nothing to
    prewarm."""

    vae_class: str
    decode: Optional[tuple[DecodeMode, DecodeOptions]]
    encode: Optional[tuple[EncodeMode, EncodeOptions]]
    pixel_hw: tuple[int, int]
    real_frames: int = 0
    why_not: dict = field(default_factory=dict)


def _part(mode, options, vae_class: str, device):
    """(mode, options) where ``mode`` drives ``vae_class`` and would run the Triton glue on ``device`` (the one-time
    cost worth paying ahead), else (None, why)."""
    if not mode.prewarm or (mode.vaes is not None and vae_class not in mode.vaes):
        return None, f"mode {mode.name!r} compiles nothing ahead for {vae_class}"
    info: dict = {}
    try:
        used = V.glue_for(device, options.fused_glue, options.compile_backend, info)
    except RuntimeError as e:  # fused_glue=True where it can't run: the decode itself refuses, with the reason
        return None, str(e)
    return ((mode, options), "") if used else (None, info.get("glue", ""))


def plan(*, vae_class: str, device, decode_mode: str, decode_options: DecodeOptions,
         encode_mode: Optional[str] = None, encode_options: EncodeOptions = EncodeOptions(),
         pixel_hw: tuple[int, int], real_frames: int = 0) -> Optional[PrewarmPlan]:
    """The prewarm a render's decode (and encode, when ``encode_mode`` is given) of a ``vae_class`` VAE on
    ``device`` would profit from, or None: only the fast layers with the Triton glue have a compile to pay ahead
    (diffusers' own decode has none of vdbench's)."""
    why: dict = {}
    dec, why["decode"] = _part(check_decode(decode_mode, decode_options), decode_options, vae_class, device)
    enc = None
    if encode_mode is not None:
        enc, why["encode"] = _part(check_encode(encode_mode, encode_options), encode_options, vae_class, device)
    if dec is None and enc is None:
        return None
    return PrewarmPlan(vae_class, dec, enc, pixel_hw, real_frames, {k: v for k, v in why.items() if v})


def scratch_vae(vae_class, config: dict, device, dtype):
    """A ``vae_class`` (a class or a diffusers class name) VAE of ``config`` on ``device`` in ``dtype``, seeded random
    weights: the kernels a decode compiles depend on shapes, dtypes and layouts only, never on the weights."""
    import diffusers

    cls = getattr(diffusers, vae_class) if isinstance(vae_class, str) else vae_class
    with torch.device("meta"):
        scratch = cls.from_config(config)
    scratch = scratch.to_empty(device=device).to(dtype)
    gen = torch.Generator(device).manual_seed(0)
    for t in scratch.state_dict().values():
        if t.is_floating_point():
            t.normal_(0.0, 0.02, generator=gen)
    return scratch.eval().requires_grad_(False)


def scratch_like(vae):
    """:func:`scratch_vae` of ``vae``'s class, config, device and dtype."""
    return scratch_vae(type(vae), dict(vae.config), next(vae.parameters()).device, vae.dtype)


class Prewarm:
    """A :class:`PrewarmPlan` running on a daemon thread from construction, on the VAE ``make_vae()`` builds there
    (:func:`scratch_vae`, :func:`scratch_like`); :meth:`wait` joins it. Never raises into the render: a failure is
    recorded (``status`` "failed" with the error) and the real call then pays its own first-call costs, as it would
    have without a prewarm."""

    def __init__(self, make_vae, p: PrewarmPlan):
        import diffusers

        from .kernels import glue  # noqa: F401 - imported here, see below

        # Every module the thread needs is imported here, on the calling thread: the render loads the pipeline
        # meanwhile, and an import of one of diffusers' lazy modules from two threads at once fails in the second.
        importlib.import_module(getattr(diffusers, p.vae_class).__module__)
        self.plan = p
        self.record: dict = {"status": "running", "jobs": {}}
        self._make_vae = make_vae
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="vdbench-vae-prewarm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rec = self.record
        try:
            with torch.inference_mode():
                t = time.perf_counter()
                scratch = self._make_vae()
                dev = next(scratch.parameters()).device
                rec["jobs"]["scratch_vae_s"] = time.perf_counter() - t
                gen = torch.Generator(dev).manual_seed(0)
                ph, pw = self.plan.pixel_hw
                s = int(scratch.config.scale_factor_spatial)
                h, w = ph // s, pw // s
                if self.plan.encode is not None:  # image-to-video encodes before it denoises: warm that first
                    t = time.perf_counter()
                    x = torch.rand((1, 3, _ENCODE_FRAMES, small_size(ph, 8 * SPEC_MODULUS),
                                    small_size(pw, 8 * SPEC_MODULUS)), device=dev,
                                   dtype=scratch.dtype, generator=gen) * 2 - 1
                    mode, options = self.plan.encode
                    mode.run(scratch, x, options, {}, None)
                    rec["jobs"]["encode_s"] = time.perf_counter() - t
                if self.plan.decode is not None:
                    mode, options = self.plan.decode
                    t = time.perf_counter()
                    z_dim = scratch.config.z_dim
                    z = torch.randn((1, z_dim, _DECODE_FRAMES, small_size(h, SPEC_MODULUS),
                                     small_size(w, SPEC_MODULUS)), device=dev,
                                    dtype=scratch.dtype, generator=gen)
                    mode.run(scratch, z, options, {}, None)
                    rec["jobs"]["decode_s"] = time.perf_counter() - t
                    if self.plan.real_frames:
                        t = time.perf_counter()
                        z = torch.randn((1, z_dim, self.plan.real_frames, h, w), device=dev, dtype=scratch.dtype,
                                        generator=gen)
                        mode.run(scratch, z, options, {}, None)
                        rec["jobs"]["decode_real_size_s"] = time.perf_counter() - t
                del scratch
            rec["status"] = "done"
        except Exception as e:  # recorded, never raised: the real call pays its own first-call costs instead
            rec["status"] = "failed"
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("VAE prewarm failed; the decode compiles its own kernels:\n%s", traceback.format_exc())
        finally:
            rec["seconds"] = time.perf_counter() - self._t0

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> dict:
        """Join the thread; the record: ``status`` (done / failed), ``seconds`` (the thread's wall time),
        ``waited_s`` (how long this call blocked), ``jobs`` (seconds per part), ``error`` where it failed."""
        t = time.perf_counter()
        self._thread.join()
        return {**self.record, "waited_s": time.perf_counter() - t}


def start(make_vae, p: Optional[PrewarmPlan]) -> Optional[Prewarm]:
    """Start ``p`` (from :func:`plan`) on its thread with the VAE ``make_vae()`` builds, or None when there is
    nothing to prewarm."""
    return None if p is None else Prewarm(make_vae, p)
