"""A render's VAE one-time costs paid ahead, on a background thread, under work the render does anyway.

Why: a render decodes once, so its decode is always a *first* call. The fast Wan decode's glue kernels
(:mod:`vdbench.kernels.glue`, Triton) are compiled on their first launch: on an H200 with empty Triton caches the
fast decode's first call at Wan 720p x 81 took 9.41 s against 2.07 s warm, ~6.5 s of it Triton compiling the
glue -- enough to make ``--vae_decode fast`` slower end to end than diffusers' decode (4.72 s first call).

What :class:`Prewarm` does: while the GPU denoises (the render starts it when the load ends, from the VAE's
config alone; an image-to-video encode part at the load's start, since that encode runs before the denoising), a
daemon thread runs the fast path's decode (and, for image-to-video, first its encode) *on the meta device* --
a VAE of the same class and config with no storage, at the real spatial size, a first chunk and steady chunks,
convolutions keeping channels_last as cuDNN's do (:class:`cuda_layouts`) -- with the glue in
:func:`vdbench.kernels.glue.compile_only` mode: each kernel call compiles its variant for the real GPU through Triton's own JIT (``warmup``: the same
specialization and cache as a launch) and launches nothing; then it loads the compiled modules on the device and
builds their launchers (:func:`vdbench.kernels.glue.load_compiled`: the rest of a first launch's host work; the
module load releases the GIL, so if it waits for the denoising's queued work only this thread waits); last, on a GPU,
the same path at a tiny size on the device (:meth:`Prewarm._first_use`: a 2-frame 8x8 latent, a zero-weight copy of
the VAE, a few ms of GPU time and the copy's ~250 MB, freed) -- the process's first use of cuDNN's convolution
kernels, which no shape-free work covers. The thread touches neither the pipeline's VAE nor any stream of its own
(its few kernels queue on the default stream behind the denoising's). The real decode then finds every variant
compiled and loaded and cuDNN's kernels in use in the process. :meth:`Prewarm.wait` joins the thread (the render
calls it inside the decode stage, so any wait is counted there) and returns what it did; the decode records how many
glue variants were still compiled during the real call (0 when the prewarm covered them).

Not moved: cuDNN's execution plans for the real shapes (cached per thread and per shape in PyTorch): on an H200 they
cost the first call ~0.02-0.05 s once the kernels are in use (bench/cold_decode.py). The compile holds the GIL for tens
of ms at a time: beside a CPU-bound main thread (a load building random weights) it costs that thread about its own
length, beside the denoising loop (waiting on the GPU) next to nothing -- hence when the render starts it.
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
from torch.overrides import TorchFunctionMode

from .. import kernels as K
from . import encode as E
from . import fast as V
from .decode import DecodeMode, DecodeOptions
from .encode import EncodeMode, EncodeOptions

log = logging.getLogger(__name__)

__all__ = ["Prewarm", "PrewarmPlan", "plan", "start_thread", "meta_vae", "cuda_layouts"]

def _decode_frames(latent_frames: Optional[int], chunk: int) -> int:
    """Latent frames of the decode run for its shapes: the first alone, then two chunks (every causal cache and
    temporal upsampler in its steady state by the second: Wan 2.2's up blocks reach it later than Wan 2.1's), then
    the render's last, shorter chunk where it has one (its pieces are other shapes); the render's own count where
    that is fewer, two chunks where it is unknown."""
    whole = 1 + 2 * chunk
    if latent_frames is None:
        return whole
    if latent_frames <= whole:
        return latent_frames
    return whole + (latent_frames - 1) % chunk


#: Video frames of the encode run for its shapes: the first frame alone, then chunks of four (1 + 4k).
_ENCODE_FRAMES = 9


@dataclass(frozen=True)
class PrewarmPlan:
    """What one prewarm runs: the fast decode and/or the fast encode (each its mode entry and options, as the
    render's decode and encode will run them) of a ``vae_class`` VAE on ``device``, for a video of ``pixel_hw``;
    ``why_not``: why a part has nothing to prewarm."""

    vae_class: str
    decode: Optional[tuple[DecodeMode, DecodeOptions]]
    encode: Optional[tuple[EncodeMode, EncodeOptions]]
    pixel_hw: tuple[int, int]
    device: torch.device = torch.device("cuda")
    why_not: dict = field(default_factory=dict)
    #: end with the tiny GPU decode (:meth:`Prewarm._first_use`); off beside a compiled denoiser, whose CUDA graph
    #: captures another thread's kernels and allocations would break
    first_use: bool = True
    #: the render's video frames (its decode's chunks, the last one too, are what the prewarm's decode runs), or None
    frames: Optional[int] = None


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


def plan(*, vae_class: str, device, decode_mode: DecodeMode, decode_options: DecodeOptions,
         encode_mode: Optional[EncodeMode] = None, encode_options: EncodeOptions = EncodeOptions(),
         pixel_hw: tuple[int, int], first_use: bool = True, frames: Optional[int] = None) -> Optional[PrewarmPlan]:
    """The prewarm a render's decode (and encode, when ``encode_mode`` is given) of a ``vae_class`` VAE on
    ``device`` would profit from, or None: only the fast layers with the Triton glue have a compile to pay ahead
    (diffusers' own decode has none of vdbench's). The modes: their entries with their options, as checked by
    :func:`~vdbench.vae.decode.check_decode` / :func:`~vdbench.vae.encode.check_encode` (the render's, in its
    validation), so the prewarm compiles what the real decode and encode will run."""
    asked = {"decode": (decode_mode, decode_options)}
    if encode_mode is not None:
        asked["encode"] = (encode_mode, encode_options)
    parts, why = {}, {}
    for kind, (mode, options) in asked.items():
        parts[kind], why[kind] = _part(mode, options, vae_class, device)
    if not any(parts.values()):
        return None
    return PrewarmPlan(vae_class, parts["decode"], parts.get("encode"), pixel_hw, torch.device(device),
                       {k: v for k, v in why.items() if v}, first_use=first_use, frames=frames)


class cuda_layouts(TorchFunctionMode):
    """Within (this thread only): a convolution whose input or weight is channels_last(_3d) returns its output in
    that format, as cuDNN's do on a GPU -- the meta device's (and the CPU's 3-D) convolutions return contiguous
    outputs, and the glue's kernels specialize on the layout they are handed (row strides (C, 1) or (1, voxels))."""

    _CONVS = (torch.conv2d, torch.conv3d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._CONVS and isinstance(out, torch.Tensor):
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            fmt = torch.channels_last if out.dim() == 4 else torch.channels_last_3d
            if any(t.is_contiguous(memory_format=fmt) and not t.is_contiguous() for t in (x, w)):
                out = out.contiguous(memory_format=fmt)
        return out


def meta_vae(vae_class, config: dict):
    """A ``vae_class`` (a class or a diffusers class name) VAE of ``config`` on the meta device: its modules, shapes
    and dtypes, no storage -- what the kernels a decode compiles depend on."""
    import diffusers

    cls = getattr(diffusers, vae_class) if isinstance(vae_class, str) else vae_class
    with torch.device("meta"):
        vae = cls.from_config(config)
    return vae.eval().requires_grad_(False)


def _fast_path(vae, p: PrewarmPlan, make, device, *, encode_thw, decode_thw, jobs: Optional[dict] = None) -> None:
    """The plan's encode (first: image-to-video encodes before it denoises) and decode through the fast path, as the
    render's will run them, on ``vae`` with inputs ``make(shape, device=, dtype=)`` of ``encode_thw`` video frames x
    pixels and ``decode_thw`` latent frames x latent pixels; each part's seconds into ``jobs`` where given."""
    if p.encode is not None:
        t = time.perf_counter()
        _, o = p.encode
        x = make((1, 3, *encode_thw), device=device, dtype=vae.dtype)
        E.wan_encode_chunked(vae, x, o.chunk_frames or E.FAST_ENCODE_DEFAULT_CHUNK, lean=True,
                             channels_last=o.channels_last is not False, fused_glue=True)
        if jobs is not None:
            jobs["encode_s"] = time.perf_counter() - t
    if p.decode is not None:
        t = time.perf_counter()
        _, o = p.decode
        z = make((1, vae.config.z_dim, *decode_thw), device=device, dtype=vae.dtype)
        chunk, tail = V.fast_chunking(o.chunk_frames, o.tail_frames, True)
        V.wan_decode_chunked(vae, z, chunk, lean=True, channels_last=o.channels_last is not False, fused_glue=True,
                             tail_frames=tail)
        if jobs is not None:
            jobs["decode_s"] = time.perf_counter() - t


class Prewarm:
    """A :class:`PrewarmPlan` running on a daemon thread from construction, on the meta-device VAE ``make_vae()``
    builds there (:func:`meta_vae`); :meth:`wait` joins it. Never raises into the render: a failure is
    recorded (``status`` "failed" with the error) and the real call then pays its own first-call costs, as it would
    have without a prewarm."""

    def __init__(self, make_vae, p: PrewarmPlan):
        import diffusers

        from ..kernels import glue  # noqa: F401 - imported here, see below

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
        from ..kernels import glue

        rec, p = self.record, self.plan
        try:
            with torch.inference_mode(), glue.compile_only(p.device) as compiled, cuda_layouts():
                t = time.perf_counter()
                vae = self._make_vae()
                rec["jobs"]["meta_vae_s"] = time.perf_counter() - t
                ph, pw = p.pixel_hw
                s = int(vae.config.scale_factor_spatial)
                lat = None if p.frames is None else (p.frames - 1) // int(vae.config.scale_factor_temporal) + 1
                chunk = V.fast_chunking(p.decode[1].chunk_frames if p.decode else None, None, True)[0]
                _fast_path(vae, p, torch.empty, "meta", encode_thw=(_ENCODE_FRAMES, ph, pw),
                           decode_thw=(_decode_frames(lat, chunk), ph // s, pw // s), jobs=rec["jobs"])
            rec["compiled"] = K.compiled_variants("vae_glue")
            if compiled:  # the modules and launchers too: the rest of a first launch's host work
                t = time.perf_counter()
                rec["loaded"] = glue.load_compiled(compiled, p.device)
                rec["jobs"]["load_s"] = time.perf_counter() - t
            if p.device.type == "cuda" and p.first_use:
                t = time.perf_counter()
                self._first_use(p)
                rec["jobs"]["first_use_s"] = time.perf_counter() - t
            rec["status"] = "done"
        except Exception as e:  # recorded, never raised: the real call pays its own first-call costs instead
            rec["status"] = "failed"
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("VAE prewarm failed; the decode compiles its own kernels:\n%s", traceback.format_exc())
        finally:
            rec["seconds"] = time.perf_counter() - self._t0

    def _first_use(self, p: PrewarmPlan) -> None:
        """The same path run on the GPU at a tiny size: a decode (and encode) of a 2-frame, 8x8 latent by a copy of
        the VAE with zero weights (its own storage, freed after: the pipeline's VAE is never touched). What a first
        call paid beyond a warm one after the compiles was the process's first use of cuDNN's convolution kernels,
        whatever the shapes: on an H200 this tiny decode on another thread took the fast decode's first call at Wan
        720p x 81 from 2.37-2.42 s to 2.09-2.11 s (warm 2.06), where growing the allocator ahead changed nothing
        (``bench/cold_decode.py`` variants ``prewarm+tiny`` and ``prewarm+reserve``). Its GPU time is a few ms."""
        with torch.inference_mode():
            vae = self._make_vae().to_empty(device=p.device)
            for t in (*vae.parameters(), *vae.buffers()):
                t.zero_()
            _fast_path(vae, p, torch.zeros, p.device, encode_thw=(5, 64, 64), decode_thw=(2, 8, 8))
            if p.device.type == "cuda":
                torch.cuda.synchronize(p.device)
            del vae

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> dict:
        """Join the thread; the record: ``status`` (done / failed), ``seconds`` (the thread's wall time),
        ``waited_s`` (how long this call blocked), ``jobs`` (seconds per part), ``error`` where it failed."""
        t = time.perf_counter()
        self._thread.join()
        return {**self.record, "waited_s": time.perf_counter() - t}


def start_thread(make_vae, p: Optional[PrewarmPlan]) -> Optional[Prewarm]:
    """Start ``p`` (from :func:`plan`) on its thread with the VAE ``make_vae()`` builds, or None when there is
    nothing to prewarm."""
    return None if p is None else Prewarm(make_vae, p)
