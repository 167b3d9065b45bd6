"""The VAE decode mode switch: which decode turns a pipeline's latents into frames (``--vae_decode``, ``mode=``).

Every mode is one entry of :data:`MODES` -- what it decodes (the VAE classes, else its refusal), which options
apply to it, and how it runs -- and a mode is checked in one place, :func:`check_decode`: the render calls it
before the model loads (from the family: nothing is loaded for a decode that would be refused after the
denoising), :func:`decode_video` / :func:`decode_latents` before any work (from the VAE itself), the VAE bench for
its decode configs. No caller keys on a mode's name. The checks every VAE mode switch shares are
:func:`check_mode`'s (the encode modes of :mod:`vdbench.vae.encode` go through it too).

``default``
    diffusers' own ``vae.decode``, untouched (CogVideoX: the pipeline's own ``decode_latents``). With
    ``max_memory_gib`` on a Wan VAE: the fast layers with the chunk (and tiles) chosen from the budget.
``fast`` (Wan VAEs, :data:`vdbench.vae.fast.FAST_VAES`)
    :func:`vdbench.vae.fast.wan_decode_fast`: the same diffusers modules and weights without diffusers' copies,
    channels_last, a preallocated output, a chunk of latent frames per decoder call (see :mod:`vdbench.vae.fast`).
``parallel`` (Wan and CogVideoX VAEs, :data:`vdbench.vae.parallel.VAES`)
    :func:`vdbench.vae.parallel.decode_video_parallel`: every rank of an initialized ``torch.distributed`` process
    group (torchrun) decodes a band of rows, exactly; this module does not create the group.

This module sits above both decode modules (:mod:`vdbench.vae.fast`: the fast decode's mechanics;
:mod:`vdbench.vae.parallel`: the band decode); neither imports it. ``timeout_s`` of :func:`decode_latents` runs
the decode under :class:`vdbench.watchdog.Watchdog`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import backends as B
from .. import families
from .. import kernels as K
from ..video import frames_to_rgb_uint8
from ..watchdog import Watchdog
from . import fast as V
from . import parallel

__all__ = ["DecodeOptions", "DecodeMode", "MODES", "GLUES", "check_decode", "check_mode", "decode_video",
           "decode_latents"]

#: ``--vae_glue`` choices -> :class:`DecodeOptions`' ``fused_glue`` (None: the Triton glue where it runs).
GLUES = {"auto": None, "triton": True, "eager": False}


@dataclass(frozen=True)
class DecodeOptions:
    """How a mode runs (each applies to the modes whose :attr:`DecodeMode.options` name it; None or False asks for
    nothing and is never refused).

    ``chunk_frames``: latent frames per decoder call. ``max_memory_gib``: bound the decode's activations (the
    chunk, and below one frame the tiles, chosen from it; Wan VAEs). ``channels_last``: None = the mode's default
    (on for the fast layers, off for diffusers' decode); True with ``default``: the conv weights in
    channels_last_3d (kept afterwards); False: off. ``compile_backend``: the fast path's norm/SiLU glue compiled.
    ``fused_glue``: the fast path's glue as Triton kernels (None: where they run; True: required; False: eager).
    ``tail_frames``: latent frames per call of the decoder's full-resolution tail within a chunk, or a pair: of the
    blocks past its last two temporal upsamplings (:func:`vdbench.vae.lean.fast_layers`; None: the fast path's
    default, :data:`vdbench.vae.fast.FAST_DEFAULT_TAIL`).
    """

    chunk_frames: Optional[int] = None
    max_memory_gib: Optional[float] = None
    channels_last: Optional[bool] = None
    compile_backend: Optional[str] = None
    fused_glue: Optional[bool] = None
    tail_frames: "Optional[int | tuple[int, int]]" = None


#: What a user passes for each option (the messages name both spellings: the argument and the render's flag); the
#: encode options (:mod:`vdbench.vae.encode`) are a subset.
_OPTION_NAMES = {"chunk_frames": "chunk_frames", "max_memory_gib": "max_memory_gib (--vae_max_memory)",
                 "channels_last": "channels_last", "compile_backend": "compile_backend",
                 "fused_glue": "fused_glue (--vae_glue triton)", "tail_frames": "tail_frames"}
#: Options that exclude each other in every mode (the compiled glue has no memory-bounded or Triton variant).
_EXCLUSIVE = (("compile_backend", "max_memory_gib"), ("compile_backend", "fused_glue"))


@dataclass(frozen=True)
class DecodeMode:
    """One decode mode: ``vaes`` the VAE classes it decodes (None: any VAE diffusers decodes), ``refusal`` why
    another VAE is refused (``{vae}``: its class) and what to use instead, ``options`` the :class:`DecodeOptions`
    that apply to it, ``run(vae, z, options, info, watchdog, family=None)`` -> video (B, 3, F, H, W) in [-1, 1]
    (``family``: the VAE's :class:`~vdbench.families.Family` where the caller holds it, else the one using its
    class; the band decode asks it how the decoder is driven); ``stock``:
    without ``max_memory_gib`` it is diffusers' decode untouched, so a pipeline's own decode method (CogVideoX's
    ``decode_latents``, bit for bit what the pipeline returns) may stand in for it; ``prewarm``: its first call
    compiles kernels that :mod:`vdbench.vae.prewarm` can compile ahead (the fast layers' Triton glue)."""

    name: str
    vaes: Optional[tuple[str, ...]]
    refusal: str
    options: frozenset
    run: Callable[..., torch.Tensor]
    stock: bool = False
    prewarm: bool = False


def _run_default(vae, z, o: DecodeOptions, info: dict, watchdog, family=None):
    """diffusers' decode; memory-bounded (Wan): the fast layers with the chunk chosen from the budget."""
    if o.channels_last:
        V.channels_last_3d(vae)
    if o.max_memory_gib is not None:
        return V.wan_decode_fast(vae, z, max_memory_gib=o.max_memory_gib, channels_last=o.channels_last is not False,
                                 watchdog=watchdog, info=info, fused_glue=o.fused_glue)
    info["path"] = "diffusers"
    return vae.decode(z.to(vae.dtype), return_dict=False)[0]


def _run_fast(vae, z, o: DecodeOptions, info: dict, watchdog, family=None):
    """The fast Wan decode (:func:`vdbench.vae.fast.wan_decode_fast`), channels_last unless turned off."""
    return V.wan_decode_fast(vae, z, chunk_frames=o.chunk_frames, max_memory_gib=o.max_memory_gib,
                             channels_last=o.channels_last is not False, watchdog=watchdog, info=info,
                             compile_backend=o.compile_backend, fused_glue=o.fused_glue,
                             tail_frames=o.tail_frames)


def _run_parallel(vae, z, o: DecodeOptions, info: dict, watchdog, family=None):
    """The band decode over the ranks of the current process group (each rank gets the whole video)."""
    info["path"] = "parallel"
    return parallel.decode_video_parallel(vae, z, chunk_frames=o.chunk_frames, info=info, family=family)


#: The modes, by name: what each decodes, which options apply, how it runs (module doc).
MODES: dict[str, DecodeMode] = {m.name: m for m in (
    DecodeMode("default", None, "", frozenset({"max_memory_gib", "channels_last"}), _run_default, stock=True),
    DecodeMode("fast", V.FAST_VAES,
               "mode='fast' is implemented for AutoencoderKLWan only, not {vae}; use mode='default' (optionally "
               "with a bf16 VAE)",
               frozenset({"chunk_frames", "max_memory_gib", "channels_last", "compile_backend", "fused_glue",
                          "tail_frames"}),
               _run_fast, prewarm=True),
    DecodeMode("parallel", parallel.VAES,
               "mode='parallel' (the band decode) is implemented for " + " and ".join(parallel.VAES)
               + " only, not {vae}; use mode='default'",
               frozenset({"chunk_frames"}), _run_parallel),
)}


def check_mode(modes: dict, mode: "str | DecodeMode", options, *, kind: str, vae=None,
               family: "str | families.Family | None" = None, device=None):
    """What every VAE mode switch checks (this module's decode modes, :mod:`vdbench.vae.encode`'s encode modes): returns
    (the ``modes`` entry, the VAE class name or None, the options given) or raises with what to use instead.

    ``mode``: a name, or an entry of ``modes`` already found (its options and VAE are checked, its name is not
    looked up again). ``family``: a name or the :class:`vdbench.families.Family`.
    ``kind``: "decode" or "encode" (the flag the messages name: ``--vae_<kind>``). Refused (ValueError): an
    unknown mode; an option that does not apply to the mode, or two that exclude each other; a VAE class the mode
    does not drive (from ``vae``, else from the pipeline ``family``'s VAE). With ``device`` (the render, before
    the model loads): ``fused_glue=True`` where the Triton glue cannot run there (``BackendUnavailable``, as an
    attention backend that cannot run is refused)."""
    m = mode if isinstance(mode, DecodeMode) else modes.get(mode)
    if m is None:
        raise ValueError(f"unknown VAE {kind} mode {mode!r}; valid: {', '.join(modes)}")
    mode = m.name
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    given = [k for k, v in values.items() if v is not None and v is not False]
    for opt in given:
        if opt not in m.options:
            where = " or ".join(n for n, e in modes.items() if opt in e.options)
            raise ValueError(f"{_OPTION_NAMES[opt]} needs --vae_{kind} {where}, not mode {mode!r}")
    for a, b in _EXCLUSIVE:
        if a in given and b in given:
            raise ValueError(f"{_OPTION_NAMES[a]} and {_OPTION_NAMES[b]} exclude each other")
    if vae is not None:
        cls = type(vae).__name__
    elif family is not None:
        fam = family if isinstance(family, families.Family) else families.get(family)
        cls = fam.vae_class  # the family's VAE: what the render checks before the load
    else:
        cls = None
    if cls is not None and m.vaes is not None and cls not in m.vaes:
        raise ValueError(m.refusal.format(vae=cls))
    if device is not None and options.fused_glue:
        ok, why = K.probe("vae_glue", device)
        if not ok:
            raise B.BackendUnavailable(f"--vae_glue triton can't run on {device}: {why}")
    return m, cls, given


def check_decode(mode: "str | DecodeMode", options: DecodeOptions = DecodeOptions(), *, vae=None,
                 family: "str | families.Family | None" = None, device=None) -> DecodeMode:
    """The one check of a decode request; returns its :data:`MODES` entry or raises with what would run instead.
    ``mode``: a name or the entry; ``family``: a name or the family (:func:`check_mode`).

    Refused (ValueError): what :func:`check_mode` refuses, and ``max_memory_gib`` on a VAE the fast decode does
    not drive. With ``device``: ``fused_glue=True`` where the Triton glue cannot run there
    (``BackendUnavailable``)."""
    m, cls, given = check_mode(MODES, mode, options, kind="decode", vae=vae, family=family, device=device)
    if cls is not None and "max_memory_gib" in given and cls not in V.FAST_VAES:
        raise ValueError(f"max_memory_gib is implemented for {' and '.join(V.FAST_VAES)} only, not {cls}; use the "
                         "VAE's enable_tiling()")
    return m


@torch.no_grad()
def decode_video(vae, z: torch.Tensor, *, mode: str = "default", chunk_frames: Optional[int] = None,
                 max_memory_gib: Optional[float] = None, channels_last: Optional[bool] = None, watchdog=None,
                 info: Optional[dict] = None, compile_backend: Optional[str] = None,
                 fused_glue: Optional[bool] = None, tail_frames=None) -> torch.Tensor:
    """Decode VAE-space latents ``z`` (B, C, T, H, W) -> video (B, 3, F, H', W') in [-1, 1] by ``mode``, checked
    first (:func:`check_decode`). The options: :class:`DecodeOptions`. ``watchdog``: its ``stage`` names each
    chunk or tile, so a hang reports where. ``info`` (a dict, optional) receives what the decode did (path,
    chunk size, tiles, which glue ran)."""
    options = DecodeOptions(chunk_frames=chunk_frames, max_memory_gib=max_memory_gib, channels_last=channels_last,
                            compile_backend=compile_backend, fused_glue=fused_glue, tail_frames=tail_frames)
    m = check_decode(mode, options, vae=vae)
    return m.run(vae, z, options, {} if info is None else info, watchdog)


@torch.no_grad()
def decode_latents(pipe, latents: torch.Tensor, family: families.Family, num_frames: int | None = None, *,
                   mode: "str | DecodeMode" = "default", max_memory_gib: Optional[float] = None,
                   timeout_s: Optional[float] = None, chunk_frames: Optional[int] = None, info: Optional[dict] = None,
                   fused_glue: Optional[bool] = None, prewarm=None, options: Optional[DecodeOptions] = None,
                   uint8: bool = False):
    """Latents from ``pipe(..., output_type="latent")`` -> float frames (T, H, W, 3) in [0, 1] (numpy), decoded
    as the pipeline would have (:func:`vdbench.vae.fast.prepare_latents`) by ``mode`` (checked before any work).

    ``family``: the pipeline's :class:`~vdbench.families.Family` (how its latents reach the VAE, and whether the
    default decode is the pipeline's own ``decode_latents``; a loaded pipeline's is
    ``vdbench.pipelines.model_of(pipe).family``). ``mode``: a name or its :data:`MODES` entry.
    ``options``: the :class:`DecodeOptions` whole, in place of ``chunk_frames``, ``max_memory_gib`` and
    ``fused_glue``. ``num_frames``: the requested frame count, for the family's
    ``trim_latents`` (CogVideoX 1.5 drops the padding latent frames its temporal patch size adds). ``timeout_s``: the decode
    runs under a :class:`~vdbench.watchdog.Watchdog`; on expiry all stacks are dumped and
    :class:`~vdbench.watchdog.WatchdogTimeout` is raised (its ``report`` names the last completed stage).
    ``max_memory_gib``, ``chunk_frames``, ``fused_glue``, ``info``: see :func:`decode_video`. ``prewarm``: a
    :class:`vdbench.vae.prewarm.Prewarm` started for this decode; it is waited for here (the wait is part of the
    decode), its status goes to ``info["prewarm"]``, its thread's time to ``info["prewarm_s"]`` and the wait to
    ``info["one_time"]``. With the
    Triton glue, ``info["glue_compiled_in_call"]`` counts the glue variants compiled during this call (0 when
    none was left to compile). ``uint8``: the frames as the video encoder takes them instead, (T, H, W, 3) uint8,
    converted where the decode ran (:func:`vdbench.video.frames_to_rgb_uint8`: the same bytes, a quarter of the
    copy, no host conversion).
    """
    vae = pipe.vae
    if options is None:
        options = DecodeOptions(chunk_frames=chunk_frames, max_memory_gib=max_memory_gib, fused_glue=fused_glue)
    elif (chunk_frames, max_memory_gib, fused_glue) != (None, None, None):
        raise TypeError("decode_latents: pass the options whole (options=) or one by one, not both")
    m = check_decode(mode, options, vae=vae)
    info = {} if info is None else info
    if prewarm is not None:
        rec = prewarm.wait()
        info["prewarm"] = rec["status"] + (f" ({rec['error']})" if rec.get("error") else "")
        info["prewarm_s"] = rec["seconds"]  # on its thread, beside the denoising: not a cost of the decode's
        info.setdefault("one_time", {})["prewarm_wait_s"] = rec["waited_s"]  # what the decode waited for it
    compiled_before = K.compiled_variants("vae_glue")
    with Watchdog(timeout_s, label=f"vae decode ({m.name})") as wd:
        wd.stage("prepare latents")
        video = None
        latents = family.trim_latents(pipe, latents, num_frames)
        if family.pipeline_decode and m.stock and options.max_memory_gib is None:
            wd.stage("decode")
            video = pipe.decode_latents(latents.to(vae.dtype))  # the pipeline's own method, untouched
        if video is None:
            z = family.prepare_latents(vae, latents)  # as the pipeline does it (vdbench.vae.fast.prepare_latents)
            wd.stage("decode")
            video = m.run(vae, z, options, info, wd, family=family)
        wd.stage("postprocess")
        if uint8:  # diffusers' own denormalization, in the video's dtype; then the writer's conversion, here
            frames = frames_to_rgb_uint8(pipe.video_processor.postprocess_video(video, output_type="pt")[0]
                                         .permute(0, 2, 3, 1))
        else:
            frames = pipe.video_processor.postprocess_video(video, output_type="np")[0]
    if info.get("glue") == V.GLUE_TRITON and compiled_before is not None:
        info["glue_compiled_in_call"] = K.compiled_variants("vae_glue") - compiled_before
    return frames
