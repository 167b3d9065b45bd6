"""The VAE encode mode switch: which encode turns a conditioning video into latents (``--vae_encode``, ``mode=``),
the twin of :mod:`vdbench.vae.decode`.

Why: image-to-video pipelines encode on every render -- Wan 2.1/2.2 I2V a whole conditioning video (the image,
then zero frames: 81 frames at 480p; on an H200 the Wan 2.1 VAE's bf16 encode of it takes 1.125 s, 62% of its
decode), CogVideoX I2V the image -- and the encode is where ROCm's MIOpen Find phase hangs as often as the decode.

Every mode is one entry of :data:`MODES` -- what it encodes (the VAE classes, else its refusal), which options
apply to it, how it runs -- checked in one place, :func:`check_encode` (over :func:`vdbench.vae.decode.check_mode`,
the checks the decode modes share): the render calls it before the model loads (from the family), every function
here before any work (from the VAE), the VAE bench for its encode configs.

``default``
    diffusers' own ``vae.encode``, untouched.
``fast`` (Wan VAEs, :data:`vdbench.vae.fast.FAST_VAES`)
    :func:`wan_encode_fast`: diffusers' ``AutoencoderKLWan._encode`` with the encoder driven as the fast decode
    drives the decoder -- the same modules and weights through :func:`vdbench.vae.fast.fast_layers` (``part="encoder"``,
    the lean layers the decode uses): causal convs without diffusers' ``F.pad`` copies, RMS norm -> SiLU written
    straight into each conv's input buffer (one Triton kernel where it runs, the conv biases folded into the next
    pass), the down-sampling pad as one copy in the input's layout, no clone of Wan 2.2's residual-down-block
    input, weights and activations channels_last; ``chunk_frames`` latent frames per encoder call (4 video frames
    each after the first frame; diffusers: 1 -- the encoder's causal caches make larger chunks exact, as the
    decoder's do), the chunks' latents concatenated once. Equal to the stock encode in fp32 to rounding (tested
    on CPU). Other VAE classes: refused by :func:`check_encode`, never silently replaced by ``default``.

In a pipeline the encode happens inside the diffusers call (``WanImageToVideoPipeline.prepare_latents`` calls
``vae.encode``): :func:`use_encode` installs the mode as a per-instance ``_encode`` of the VAE for its scope and
removes it on exit (also on error), as the fast decode swaps its layers; the pipeline's code is not touched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .. import families
from . import fast as V
from .decode import DecodeMode, check_mode

__all__ = ["EncodeOptions", "EncodeMode", "MODES", "FAST_ENCODE_DEFAULT_CHUNK", "check_encode", "encode_video",
           "use_encode", "wan_encode_fast", "wan_encode_chunked"]

#: Latent frames per encoder call of mode "fast" when no chunk size is given: diffusers' own 4 video frames per
#: call (the least memory; larger chunks are the bench's ``fast@K``, to be measured).
FAST_ENCODE_DEFAULT_CHUNK = 1
#: Video frames per latent frame in diffusers' ``AutoencoderKLWan._encode`` (it hard-codes ``1 + (F - 1) // 4``
#: calls: frames beyond the last ``1 + 4k`` are dropped, here too).
_FRAMES_PER_LATENT = 4


@dataclass(frozen=True)
class EncodeOptions:
    """How a mode runs (each applies to the modes whose :attr:`EncodeMode.options` name it; None or False asks for
    nothing and is never refused). ``chunk_frames``: latent frames per encoder call. ``channels_last``: None = the
    mode's default (on for the fast layers, off for diffusers' encode); True with ``default``: the conv weights in
    channels_last_3d (kept afterwards). ``compile_backend``: the fast path's norm/SiLU glue compiled.
    ``fused_glue``: the fast path's glue as Triton kernels (None: where they run; True: required; False: eager)."""

    chunk_frames: Optional[int] = None
    channels_last: Optional[bool] = None
    compile_backend: Optional[str] = None
    fused_glue: Optional[bool] = None


class EncodeMode(DecodeMode):
    """One encode mode, with a decode mode's fields (:class:`vdbench.vae.decode.DecodeMode`, so that one check serves
    both): ``vaes`` the VAE classes it encodes with (None: any), ``refusal`` why another VAE is refused (``{vae}``:
    its class), ``options`` the :class:`EncodeOptions` that apply, ``run(vae, x, options, info, watchdog)`` -> the
    moments diffusers' ``_encode`` returns (B, 2z, T', h, w); ``stock``: diffusers' encode untouched (nothing to
    install in a pipeline)."""


def _run_default(vae, x, o: EncodeOptions, info: dict, watchdog):
    """diffusers' encode (its tiling and slicing included), the posterior's parameters."""
    if o.channels_last:
        V.channels_last_3d(vae)
    info["path"] = "diffusers"
    return vae.encode(x.to(vae.dtype)).latent_dist.parameters


def _run_fast(vae, x, o: EncodeOptions, info: dict, watchdog):
    """The fast Wan encode (:func:`wan_encode_fast`), channels_last unless turned off."""
    return wan_encode_fast(vae, x, chunk_frames=o.chunk_frames, channels_last=o.channels_last is not False,
                           compile_backend=o.compile_backend, fused_glue=o.fused_glue, watchdog=watchdog, info=info)


#: The modes, by name: what each encodes with, which options apply, how it runs (module doc).
MODES: dict[str, EncodeMode] = {m.name: m for m in (
    EncodeMode("default", None, "", frozenset({"channels_last"}), _run_default, stock=True),
    EncodeMode("fast", V.FAST_VAES,
               "mode='fast' (the fast encode) is implemented for AutoencoderKLWan only, not {vae}; use "
               "mode='default' (optionally with a bf16 VAE)",
               frozenset({"chunk_frames", "channels_last", "compile_backend", "fused_glue"}), _run_fast,
               prewarm=True),
)}


def check_encode(mode: "str | EncodeMode", options: EncodeOptions = EncodeOptions(), *, vae=None,
                 family: "str | families.Family | None" = None, device=None) -> EncodeMode:
    """The one check of an encode request; returns its :data:`MODES` entry or raises with what would run instead.
    ``mode``: a name or the entry; ``family``: a name or the family (:func:`vdbench.vae.decode.check_mode`).

    Refused (ValueError): what :func:`vdbench.vae.decode.check_mode` refuses (an unknown mode, an option that doesn't
    apply or two that exclude each other, a VAE class the mode does not encode with -- from ``vae``, else from the
    ``family``'s VAE), ``chunk_frames`` below 1, and a mode other than diffusers' own on a VAE with tiling enabled
    (only diffusers' encode tiles). With ``device``: ``fused_glue=True`` where the Triton glue cannot run
    (``BackendUnavailable``)."""
    m, _cls, _given = check_mode(MODES, mode, options, kind="encode", vae=vae, family=family, device=device)
    if options.chunk_frames is not None and options.chunk_frames < 1:
        raise ValueError(f"chunk_frames must be >= 1 latent frame per encoder call, got {options.chunk_frames}")
    if vae is not None and not m.stock and getattr(vae, "use_tiling", False):
        raise ValueError(f"mode={m.name!r} does not tile, and this VAE has tiling enabled (enable_tiling()); use "
                         "mode='default' for diffusers' tiled encode, or disable_tiling()")
    return m


@torch.no_grad()
def encode_video(vae, x: torch.Tensor, *, mode: str = "default", chunk_frames: Optional[int] = None,
                 channels_last: Optional[bool] = None, compile_backend: Optional[str] = None,
                 fused_glue: Optional[bool] = None, watchdog=None, info: Optional[dict] = None) -> torch.Tensor:
    """Encode a video ``x`` (B, 3, F, H, W) in [-1, 1] by ``mode`` (checked first, :func:`check_encode`) -> the
    latent distribution's mean (B, z, T', h, w): what Wan image-to-video conditions on
    (``retrieve_latents(..., sample_mode="argmax")``), in VAE space. The options: :class:`EncodeOptions`.
    ``watchdog``: its ``stage`` names each chunk, so a hang reports where. ``info`` (a dict, optional) receives
    what the encode did (path, chunk size, which glue ran)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    options = EncodeOptions(chunk_frames=chunk_frames, channels_last=channels_last, compile_backend=compile_backend,
                            fused_glue=fused_glue)
    m = check_encode(mode, options, vae=vae)
    moments = m.run(vae, x, options, {} if info is None else info, watchdog)
    return DiagonalGaussianDistribution(moments).mode()


@contextlib.contextmanager
def use_encode(vae, mode: "str | EncodeMode" = "default", options: EncodeOptions = EncodeOptions(), *,
               info: Optional[dict] = None):
    """For the scope, ``vae.encode`` -- called inside a pipeline (``WanImageToVideoPipeline.prepare_latents``) --
    encodes by ``mode``: diffusers' ``encode`` (slicing, offload hooks, the posterior) calls ``self._encode``, which
    is set on this instance to the mode's encode and deleted on exit, also on error; the class and every other VAE
    are untouched. A stock mode installs nothing. ``mode``: a name or its :data:`MODES` entry. Checked first
    (:func:`check_encode`); a VAE whose ``_encode`` is
    already replaced on the instance is refused (two swaps would undo each other). Yields ``info`` (a dict),
    which receives what the last encode did."""
    m = check_encode(mode, options, vae=vae)
    info = {} if info is None else info
    if m.stock:
        if options.channels_last:
            V.channels_last_3d(vae)
        info["path"] = "diffusers"
        yield info
        return
    if "_encode" in vae.__dict__:
        raise ValueError(f"this {type(vae).__name__}'s _encode is already replaced on the instance (another "
                         "use_encode scope?); leave that scope first")
    vae._encode = lambda x: m.run(vae, x, options, info, None)
    try:
        yield info
    finally:
        del vae._encode


@torch.no_grad()
def wan_encode_fast(vae, x: torch.Tensor, *, chunk_frames: Optional[int] = None, channels_last: bool = True,
                    compile_backend: Optional[str] = None, fused_glue: Optional[bool] = None, watchdog=None,
                    info: Optional[dict] = None) -> torch.Tensor:
    """The fast encode of a Wan VAE (module doc): ``x`` (B, C, F, H, W) in [-1, 1] -> the moments (B, 2z, T', h, w)
    diffusers' ``_encode`` returns, ``chunk_frames`` latent frames per encoder call (default
    :data:`FAST_ENCODE_DEFAULT_CHUNK`). ``compile_backend`` / ``fused_glue``: the glue compiled / as Triton kernels
    (:func:`vdbench.vae.fast.resolve_glue`; which ran is in ``info["glue"]``)."""
    info = {} if info is None else info
    fused = V.resolve_glue(vae, fused_glue, compile_backend, info)
    k = chunk_frames or FAST_ENCODE_DEFAULT_CHUNK
    info.update(path="chunked", chunk_frames=k, channels_last=channels_last)
    if compile_backend:
        info["compile_backend"] = compile_backend
    return wan_encode_chunked(vae, x, k, lean=True, channels_last=channels_last, compile_backend=compile_backend,
                              fused_glue=fused, watchdog=watchdog)


@torch.no_grad()
def wan_encode_chunked(vae, x: torch.Tensor, chunk_frames: int, *, lean: bool = False, channels_last: bool = False,
                       compile_backend: Optional[str] = None, fused_glue: bool = False,
                       watchdog=None) -> torch.Tensor:
    """diffusers' ``AutoencoderKLWan._encode`` (untiled) with ``chunk_frames`` latent frames -- 4 video frames each
    -- per encoder call after the first frame, -> the moments (B, 2z, T', h, w). Every temporal op of the Wan
    encoder is a causal conv whose cache holds the last input frames (the stride-2 temporal convs their last one)
    and every norm is per frame, so a chunk of K gives K single calls' result. ``lean`` / ``channels_last``: the
    fast layers / channels_last weights and activations for the duration (:func:`vdbench.vae.fast.fast_layers`,
    ``part="encoder"``); both off: diffusers' layers (the bench's ``chunked`` config). ``watchdog.stage`` names
    each chunk."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    if chunk_frames < 1:
        raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
    x = x.to(vae.dtype)
    if vae.config.patch_size is not None:
        x = patchify(x, patch_size=vae.config.patch_size)
    n = 1 + (x.shape[2] - 1) // _FRAMES_PER_LATENT * _FRAMES_PER_LATENT
    step = _FRAMES_PER_LATENT * chunk_frames
    parts = []
    with contextlib.ExitStack() as stack:
        if lean or channels_last:
            stack.enter_context(V.fast_layers(vae, channels_last=channels_last, lean=lean, part="encoder",
                                              compile_backend=compile_backend, fused_glue=fused_glue))
        vae.clear_cache()
        try:
            for s, e in [(0, 1), *((s, min(s + step, n)) for s in range(1, n, step))]:
                if watchdog is not None:
                    watchdog.stage(f"encode frames {s}..{e - 1}")
                chunk = x[:, :, s:e]
                if channels_last:
                    chunk = chunk.contiguous(memory_format=torch.channels_last_3d)
                vae._enc_conv_idx = [0]
                parts.append(vae.encoder(chunk, feat_cache=vae._enc_feat_map, feat_idx=vae._enc_conv_idx))
                del chunk
            out = torch.cat(parts, 2) if len(parts) > 1 else parts[0]
            parts.clear()
            enc = vae.quant_conv(out)
            del out
        finally:
            vae.clear_cache()
    return enc.contiguous()
