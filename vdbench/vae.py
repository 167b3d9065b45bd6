"""VAE decode of a pipeline's latents, separated from the denoising loop so it can be timed on its own.

The pipelines are called with ``output_type="latent"``; decoding here repeats exactly what each diffusers
pipeline does after its loop (Wan: un-normalize with the VAE's latents_mean/std; CogVideoX: divide by the
scaling factor and move frames to the channel-first layout), so the video is the one the pipeline would
have produced.

Decode modes (``mode=``):

``default``
    diffusers' own ``vae.decode``, untouched.
``fast`` (Wan VAEs: ``AutoencoderKLWan``, Wan 2.1 and 2.2)
    The same diffusers modules and weights, driven differently (see :func:`wan_decode_chunked`):

    * **several latent frames per decoder call** instead of one. Every temporal op of the Wan decoder is a
      causal convolution whose cache holds the last ``CACHE_T`` (2) input frames, and every norm/attention is
      per frame, so a chunk of K frames after the first gives the same result as K single-frame calls (tested
      in fp32 on CPU against the stock decode). Fewer, larger kernels; K x fewer cache copies and ``clear_cache``.
    * **the output is written into one preallocated tensor** instead of diffusers' ``torch.cat`` of the growing
      output after every frame (quadratic copying, and two copies of the output alive at once).
    * **nearest upsampling in the working dtype**: diffusers' ``WanUpsample`` upcasts to fp32 before a
      ``nearest-exact`` interpolation and casts back. Nearest interpolation only copies values, so the result
      is bit-identical in bf16, without the fp32 temporary that is the single largest tensor of a bf16 decode
      (2x the size of the upsampled activation).
    * conv3d weights in ``channels_last_3d`` when ``channels_last=True``.

    The dtype is the VAE's: load it in bf16 (``--vae_dtype bf16``) for speed. Its RMS norms already normalize
    in fp32 (diffusers does that for half dtypes), which is where bf16 loses precision otherwise.
    Other VAE classes: ``fast`` is refused (ValueError), never silently replaced by ``default``.
``parallel``
    Multi-GPU decode (every rank computes a band of rows), :func:`vdbench.vae_parallel.decode_video_parallel`;
    needs an initialized ``torch.distributed`` process group (torchrun), which this module does not create.

``max_memory_gib`` bounds the decode's activation memory: the temporal chunk size is chosen from it (on CUDA
from the measured peak of a one-latent-frame chunk, elsewhere from a coarse analytic estimate) and, if even one
frame does not fit, the frame is split into diffusers' spatial tiles (same geometry and blending as
``enable_tiling()``, tile shrunk until it fits) and each tile is decoded in temporal chunks; ``info["path"]``
says which happened. ``timeout_s`` runs the decode under :class:`vdbench.watchdog.Watchdog`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["decode_latents", "decode_video", "wan_decode_chunked", "choose_chunk_frames", "prepare_latents",
           "MODES", "channels_last_3d"]

MODES = ("default", "fast", "parallel")
FAST_DEFAULT_CHUNK = 2  # latent frames per decoder call in mode "fast" when no chunk size is given
_GIB = 1024 ** 3


def _is_wan(vae) -> bool:
    return type(vae).__name__ == "AutoencoderKLWan"


def prepare_latents(vae, latents: torch.Tensor, family: str) -> torch.Tensor:
    """Pipeline latents -> what ``vae.decode`` takes, exactly as the diffusers pipeline does it.

    Wan: ``latents * std + mean`` (channel-first (B, C, T, H, W) already). CogVideoX: (B, T, C, H, W) ->
    (B, C, T, H, W) and divide by the scaling factor. HunyuanVideo: divide by the scaling factor.
    """
    if family == "wan":
        latents = latents.to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean
    if family == "cogvideox":
        return (latents.permute(0, 2, 1, 3, 4) / vae.config.scaling_factor).to(vae.dtype)
    if family == "hunyuanvideo":
        return (latents / vae.config.scaling_factor).to(vae.dtype)
    raise ValueError(f"unknown pipeline family {family!r}")


@torch.no_grad()
def decode_latents(pipe, latents: torch.Tensor, family: str, num_frames: int | None = None, *,
                   mode: str = "default", max_memory_gib: Optional[float] = None, timeout_s: Optional[float] = None,
                   chunk_frames: Optional[int] = None, info: Optional[dict] = None):
    """Latents from ``pipe(..., output_type="latent")`` -> float frames (T, H, W, 3) in [0, 1] (numpy).

    ``num_frames`` (CogVideoX only): the requested frame count, to drop the padding latent frames that
    CogVideoX 1.5 (temporal patch size) adds, as its pipeline does before decoding.
    ``mode``, ``max_memory_gib``, ``chunk_frames``: see the module doc. ``timeout_s``: the decode runs under a
    :class:`~vdbench.watchdog.Watchdog`; on expiry all stacks are dumped and
    :class:`~vdbench.watchdog.WatchdogTimeout` is raised (its ``report`` names the last completed stage).
    ``info`` (a dict, optional) receives what the decode did (path, chunk size, tiles).
    """
    from vdbench.watchdog import Watchdog

    if mode not in MODES:
        raise ValueError(f"unknown VAE decode mode {mode!r}; valid: {', '.join(MODES)}")
    vae = pipe.vae
    info = {} if info is None else info
    with Watchdog(timeout_s, label=f"vae decode ({mode})") as wd:
        wd.stage("prepare latents")
        if family == "cogvideox":
            patch_t = getattr(pipe.transformer.config, "patch_size_t", None)
            if patch_t and num_frames is not None:
                latent_frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
                extra = (patch_t - latent_frames % patch_t) % patch_t
                latents = latents[:, extra:]
            if mode == "default" and max_memory_gib is None:
                wd.stage("decode")
                video = pipe.decode_latents(latents.to(vae.dtype))  # the pipeline's own method, untouched
            else:
                z = prepare_latents(vae, latents, family)
                wd.stage("decode")
                video = decode_video(vae, z, mode=mode, max_memory_gib=max_memory_gib, chunk_frames=chunk_frames,
                                     watchdog=wd, info=info)
        elif family == "wan":
            z = prepare_latents(vae, latents, family)
            wd.stage("decode")
            video = decode_video(vae, z, mode=mode, max_memory_gib=max_memory_gib, chunk_frames=chunk_frames,
                                 watchdog=wd, info=info)
        else:
            raise ValueError(f"unknown pipeline family {family!r}")
        wd.stage("postprocess")
        frames = pipe.video_processor.postprocess_video(video, output_type="np")[0]
    return frames


@torch.no_grad()
def decode_video(vae, z: torch.Tensor, *, mode: str = "default", chunk_frames: Optional[int] = None,
                 max_memory_gib: Optional[float] = None, channels_last: bool = False, watchdog=None,
                 info: Optional[dict] = None) -> torch.Tensor:
    """Decode VAE-space latents ``z`` (B, C, T, H, W) -> video (B, 3, F, H', W') in [-1, 1]."""
    info = {} if info is None else info
    if mode == "parallel":
        try:
            from vdbench import vae_parallel
        except ImportError as e:
            raise NotImplementedError(f"mode='parallel' needs vdbench.vae_parallel ({e})") from None
        fn = getattr(vae_parallel, "decode_video_parallel", None)
        if fn is None:
            raise NotImplementedError("mode='parallel': vdbench.vae_parallel has no decode_video_parallel(vae, z, ...)")
        info["path"] = "parallel"
        if max_memory_gib is not None:
            raise ValueError("max_memory_gib is not supported with mode='parallel' (each rank decodes a band)")
        return fn(vae, z, chunk_frames=chunk_frames, info=info)
    if mode not in ("default", "fast"):
        raise ValueError(f"unknown VAE decode mode {mode!r}; valid: {', '.join(MODES)}")
    if channels_last:
        channels_last_3d(vae)
    if not _is_wan(vae):
        if mode == "fast":
            raise ValueError(f"mode='fast' is implemented for AutoencoderKLWan only, not {type(vae).__name__}; "
                             "use mode='default' (optionally with a bf16 VAE)")
        if max_memory_gib is not None:
            raise ValueError(f"max_memory_gib is implemented for AutoencoderKLWan only, not {type(vae).__name__}; "
                             "use the VAE's enable_tiling()")
        info["path"] = "diffusers"
        return vae.decode(z.to(vae.dtype), return_dict=False)[0]
    if max_memory_gib is not None:
        return _wan_decode_bounded(vae, z, max_memory_gib, watchdog=watchdog, info=info)
    if mode == "default":
        info["path"] = "diffusers"
        return vae.decode(z, return_dict=False)[0]
    # Default chunk: 2 latent frames per call -- measured on an H200 (Wan 2.1 VAE, 480p, 81 frames, bf16): 1.70 s
    # vs diffusers' 1.83 s at 6.6 GiB; larger chunks gain little (K=4: 1.66 s) and cost memory (K=4 10.6 GiB, all
    # 21 frames far more), so a render never takes the unbounded choice by default (docs/PERFORMANCE.md §6).
    k = chunk_frames or min(FAST_DEFAULT_CHUNK, z.shape[2])
    info.update(path="chunked", chunk_frames=k)
    return wan_decode_chunked(vae, z, k, watchdog=watchdog)


def channels_last_3d(vae) -> None:
    """Put every 5-D conv weight in ``channels_last_3d`` (``Module.to(memory_format=...)`` refuses the 4-D
    weights of the 2-D convs that the same VAEs contain)."""
    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)


def _nearest_native(self, x):
    # WanUpsample.forward without its fp32 round trip: nearest-exact only copies values (bit-identical).
    return F.interpolate(x, size=self.size, scale_factor=self.scale_factor, mode=self.mode,
                         align_corners=self.align_corners)


@contextlib.contextmanager
def _native_dtype_upsample(vae):
    """Temporarily replace the nearest-upsample forward of this VAE's instances only (nothing global)."""
    patched = []
    for m in vae.modules():
        if type(m).__name__ == "WanUpsample" and m.mode in ("nearest", "nearest-exact"):
            m.forward = _nearest_native.__get__(m)
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def _chunk_bounds(num_frames: int, k: int):
    """Frame 0 alone (the decoder's ``first_chunk``), then chunks of ``k`` latent frames."""
    yield 0, 1
    start = 1
    while start < num_frames:
        yield start, min(start + k, num_frames)
        start += k


@torch.no_grad()
def wan_decode_chunked(vae, z: torch.Tensor, chunk_frames: int, *, watchdog=None, native_upsample: bool = True,
                       on_chunk=None, finalize: bool = True) -> torch.Tensor:
    """diffusers' ``AutoencoderKLWan._decode`` (untiled) with ``chunk_frames`` latent frames per decoder call and
    a preallocated output (see the module doc for why this is equivalent). ``on_chunk(i, start, end)`` is called
    after each chunk (memory calibration); ``watchdog.stage`` names each chunk, so a hang reports where."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    if chunk_frames < 1:
        raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
    z = z.to(vae.dtype)
    if any(isinstance(m, torch.nn.Conv3d) and m.weight.is_contiguous(memory_format=torch.channels_last_3d)
           and not m.weight.is_contiguous() for m in vae.modules()):
        z = z.contiguous(memory_format=torch.channels_last_3d)
    n = z.shape[2]
    ctx = _native_dtype_upsample(vae) if native_upsample else contextlib.nullcontext()
    out = None
    t_out = 0
    with ctx:
        vae.clear_cache()
        try:
            x = vae.post_quant_conv(z)
            for i, (s, e) in enumerate(_chunk_bounds(n, chunk_frames)):
                if watchdog is not None:
                    watchdog.stage(f"decode latent frames {s}..{e - 1}")
                vae._conv_idx = [0]
                part = vae.decoder(x[:, :, s:e], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                   first_chunk=(s == 0))
                if out is None:  # frame 0: keep it until the per-frame output count is known
                    out, t_out = part, part.shape[2]
                    continue
                if t_out == out.shape[2] and (n - 1) > (e - s):  # second chunk: allocate the whole output once
                    total = t_out + part.shape[2] // (e - s) * (n - 1)
                    buf = torch.empty((*part.shape[:2], total, *part.shape[3:]), dtype=part.dtype, device=part.device)
                    buf[:, :, :t_out] = out
                    out = buf
                elif t_out == out.shape[2]:  # a single chunk after frame 0: one cat, nothing to preallocate
                    out = torch.cat([out, part], 2)
                    t_out = out.shape[2]
                    del part
                    if on_chunk is not None:
                        on_chunk(i, s, e)
                    continue
                out[:, :, t_out:t_out + part.shape[2]] = part
                t_out += part.shape[2]
                del part
                if on_chunk is not None:
                    on_chunk(i, s, e)
        finally:
            vae.clear_cache()
    out = out[:, :, :t_out]
    if not finalize:  # raw decoder output (tiles are blended before unpatchify/clamp, as diffusers does)
        return out
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)


def _wan_frame_bytes_estimate(vae, h: int, w: int) -> int:
    """Coarse activation bytes of decoding one latent frame (4 output frames) at latent size h x w: ~8 live
    tensors of the widest full-resolution stage. Used only where memory can't be measured (CPU)."""
    s = vae.config.scale_factor_spatial
    dims = getattr(vae.config, "decoder_base_dim", None) or vae.config.base_dim
    elem = torch.finfo(vae.dtype).bits // 8
    widest = dims * max(vae.config.dim_mult)  # at 1/8 resolution; the full-res stage has base_dim channels
    full = dims * vae.config.dim_mult[0] * 4 * (h * s) * (w * s)
    low = widest * 4 * (h * s // 4) * (w * s // 4)
    return int(8 * max(full, low) * elem)


def choose_chunk_frames(budget_bytes: float, per_frame_bytes: float, num_frames: int) -> int:
    """Largest chunk (latent frames per decoder call) whose activations fit ``budget_bytes``; 0 if even one
    frame does not fit (then tile spatially)."""
    if per_frame_bytes <= 0:
        return max(1, num_frames - 1)
    return int(max(0, min(num_frames - 1 if num_frames > 1 else 1, budget_bytes // per_frame_bytes)))


def _wan_decode_bounded(vae, z, max_memory_gib: float, *, watchdog=None, info: dict) -> torch.Tensor:
    """Temporal chunk (and, below one frame, spatial tile) chosen from the memory budget."""
    budget = float(max_memory_gib) * _GIB
    dev = z.device
    n, h, w = z.shape[2], z.shape[3], z.shape[4]
    elem = torch.finfo(vae.dtype).bits // 8
    out_bytes = 3 * ((n - 1) * 4 + 1) * h * w * vae.config.scale_factor_spatial ** 2 * elem
    key = (h, w, str(vae.dtype), str(dev))
    cache = vae.__dict__.setdefault("_vdbench_frame_bytes", {})
    if key in cache:
        per_frame = cache[key]
        info["per_frame_source"] = "measured earlier on this VAE (cached)"
    elif dev.type == "cuda":
        # Measure: decode latent frame 1 alone (after frame 0), read the peak above what was allocated before.
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        probe = min(n, 2)
        _ = wan_decode_chunked(vae, z[:, :, :probe], 1, watchdog=watchdog)
        torch.cuda.synchronize(dev)
        per_frame = torch.cuda.max_memory_allocated(dev) - base
        del _
        info["per_frame_source"] = "measured (CUDA peak of a 1-latent-frame chunk)"
        cache[key] = per_frame
    else:
        per_frame = _wan_frame_bytes_estimate(vae, h, w)
        info["per_frame_source"] = "estimated (no memory measurement on this device)"
    avail = budget - out_bytes - (torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0)
    k = choose_chunk_frames(avail, per_frame, n)
    info.update(per_frame_bytes=int(per_frame), budget_bytes=int(budget), output_bytes=int(out_bytes))
    if k >= 1:
        info.update(path="chunked", chunk_frames=k)
        return wan_decode_chunked(vae, z, k, watchdog=watchdog)
    # Below one frame at full size: spatial tiles (diffusers' tiling geometry and blending), each decoded in
    # temporal chunks sized from the budget scaled by the tile's area.
    sp = vae.config.scale_factor_spatial
    tile_px, stride_px = 256, 192
    while tile_px > 64 and per_frame * (tile_px / sp) ** 2 / (h * w) > avail:
        tile_px, stride_px = tile_px - 64, stride_px - 48
    per_tile = per_frame * min(1.0, (tile_px / sp) ** 2 / (h * w))
    k = max(1, choose_chunk_frames(avail, per_tile, n))
    info.update(path="tiled+chunked", tile_px=tile_px, stride_px=stride_px, chunk_frames=k)
    return wan_decode_tiled_chunked(vae, z, tile_px, stride_px, k, watchdog=watchdog)


@torch.no_grad()
def wan_decode_tiled_chunked(vae, z: torch.Tensor, tile_px: int, stride_px: int, chunk_frames: int, *,
                             watchdog=None) -> torch.Tensor:
    """diffusers' ``AutoencoderKLWan.tiled_decode`` (same tiles, same blending) with each tile decoded by
    :func:`wan_decode_chunked` instead of one latent frame per call."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    _, _, _, height, width = z.shape
    sp = vae.config.scale_factor_spatial
    p = vae.config.patch_size
    tl, sl = tile_px // sp, stride_px // sp
    ts = stride_px // p if p else stride_px
    blend = (tile_px - stride_px) // p if p else tile_px - stride_px
    sample_h, sample_w = height * sp // (p or 1), width * sp // (p or 1)
    rows = []
    for i in range(0, height, sl):
        row = []
        for j in range(0, width, sl):
            if watchdog is not None:
                watchdog.stage(f"tile {i},{j}")
            row.append(wan_decode_chunked(vae, z[:, :, :, i:i + tl, j:j + tl], chunk_frames, finalize=False))
        rows.append(row)
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = vae.blend_v(rows[i - 1][j], tile, blend)
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, blend)
            result_row.append(tile[:, :, :, :ts, :ts])
        result_rows.append(torch.cat(result_row, dim=-1))
    dec = torch.cat(result_rows, dim=3)[:, :, :, :sample_h, :sample_w]
    if p is not None:
        dec = unpatchify(dec, patch_size=p)
    return torch.clamp(dec, min=-1.0, max=1.0)


def add_vae_args(p, fast_ok: bool = True) -> None:
    """VAE decode flags shared by both render CLIs (see this module and vdbench.vae_parallel)."""
    modes = ["default", "fast", "parallel"] if fast_ok else ["default", "parallel"]
    p.add_argument("--vae_decode", choices=modes, default="default",
                   help="default: diffusers' decode; fast: several latent frames per decoder call into one "
                        "preallocated output (Wan VAEs); parallel: split rows across the torchrun ranks with "
                        "halo exchange (matches the one-GPU decode)")
    p.add_argument("--vae_max_memory", type=float, default=None, metavar="GIB",
                   help="bound the decode's memory: the frame chunk (or tiles) is chosen from this budget (Wan VAEs)")
    p.add_argument("--vae_timeout", type=float, default=None, metavar="S",
                   help="watchdog: a decode running longer is reported as hung (stacks dumped, exit 124)")


def vae_kwargs(args) -> dict:
    """RenderConfig fields from the flags of ``add_vae_args``."""
    return dict(vae_decode=args.vae_decode, vae_max_memory=args.vae_max_memory, vae_timeout=args.vae_timeout)
