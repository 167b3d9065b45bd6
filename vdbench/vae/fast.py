"""The fast decode of Wan VAEs (``mode="fast"`` of :mod:`vdbench.vae.decode`, the VAE mode switch) and the latents
preparation every decode starts from.

The pipelines are called with ``output_type="latent"``; :func:`prepare_latents` repeats exactly what each
diffusers pipeline does after its loop (Wan: un-normalize with the VAE's latents_mean/std; CogVideoX: divide by
the scaling factor and move frames to the channel-first layout), so the video is the one the pipeline would have
produced. Which decode then runs (diffusers' own, this module's, the band-parallel one) is
:mod:`vdbench.vae.decode`'s choice; this module holds the mechanics of the fast one (:func:`wan_decode_fast`):

``fast`` (Wan VAEs: ``AutoencoderKLWan``, Wan 2.1 and 2.2)
    The same diffusers modules and weights, driven differently (see :func:`wan_decode_chunked`):

    * **the output is written into one preallocated tensor** instead of diffusers' ``torch.cat`` of the growing
      output after every frame (quadratic copying, and two copies of the output alive at once); clamped in place.
    * **lean layers** (:func:`fast_layers`): for the duration of the decode this VAE's decoder instances get
      their own ``forward`` (set on the instance, deleted on exit, also on error; the class, other VAEs and a
      later stock decode are untouched -- tested bit-exact), the same ops in the same order without diffusers'
      glue copies:

      - ``WanCausalConv3d``: diffusers concatenates the cache and then pads time *and* space with ``F.pad``:
        two full copies of the activation per conv. Here the spatial zero padding is the conv's own
        (``padding=(0, ph, pw)``, same weights) and only the causal time context (cached frames; zero frames
        for the first chunk) is concatenated in front, in the input's memory format.
      - ``WanResidualBlock`` and the decoder head: norm -> SiLU is written straight into the conv's input
        buffer behind the cached frames (no separate SiLU output, no cat, no pad); the old cache is released
        before the conv instead of after; the conv1 output is released before conv2 runs; the residual is
        added in place. ``WanUpBlock.forward`` is inlined in the decoder so that no caller keeps a block's input
        alive (one full-size activation less at the peak).
      - ``WanRMS_norm``: diffusers upcasts to fp32 (``x.float()``, fp32 quotient) and then does three more
        full-size passes (cast, ``* scale``, ``* gamma``). Here: the norm is an fp32-accumulated reduction (on
        CUDA read straight from bf16, no fp32 copy), ``x / norm`` is computed in fp32 and rounded once into
        the output, then ``* (gamma * sqrt(dim))`` in place: fewer roundings than diffusers, PSNR vs the fp32
        decode unchanged (tiny and real-width CPU checks: within 0.1 dB of diffusers' bf16).
      - ``WanResample`` (upsampling): the frame interleave of ``time_conv``'s output (diffusers: ``stack`` then
        ``permute().reshape()``, two copies, the first dropping channels_last) is one copy straight into the
        per-frame buffer of the 2-D stage; in channels_last the per-frame view is free.
      - ``WanResidualUpBlock`` (Wan 2.2): no ``clone()`` of the block input (nothing writes into it), and the
        ``DupUp3D`` shortcut added in place into the block output through an 8-D view (not materialized).
      - ``WanAttentionBlock`` (the mid block's single head of 1024 or 384 channels over a frame): two GEMMs and a
        softmax with fp32 scores in place of SDPA, whose only kernel for such a head is the memory-efficient one,
        and the 1x1 q/k/v and output convs as GEMMs over the frame's rows (no permute copies).
    * **the glue as Triton row kernels** (``fused_glue``; by default on a GPU where they run, see
      :func:`resolve_glue`): RMS norm -> gain -> SiLU read once and written once into the conv's input buffer
      (:mod:`vdbench.kernels.glue`), and every conv run *without* its bias, which is added where the output is
      read next (inside that glue, with the residual in one pass, or in one vectorized row pass): PyTorch's own
      bias add is a non-vectorized broadcast pass over channels_last rows. On an H200 the glue went from 543 to
      85 ms of a Wan 2.1 480p x 81 decode (docs/PERFORMANCE.md §8.1).
    * **nearest upsampling in the working dtype**: diffusers' ``WanUpsample`` upcasts to fp32 before a
      ``nearest-exact`` interpolation and casts back. Nearest interpolation only copies values, so the result
      is bit-identical in bf16, without the fp32 temporary.
    * **channels_last**: conv weights in channels_last(_3d) for the duration of the decode (put back afterwards)
      and activations in that layout throughout, unless ``channels_last=False``.
    * **chunks of latent frames per decoder call** (``chunk_frames``). Every temporal op of the Wan decoder is a
      causal convolution whose cache holds the last ``CACHE_T`` (2) input frames, and every norm/attention is
      per frame, so a chunk of K frames after the first gives the same result as K single-frame calls (tested
      in fp32 on CPU against the stock decode).

    **Default chunk** (``FAST_DEFAULT_CHUNK`` = 4, ``FAST_DEFAULT_TAIL`` = (2, 1), what ``--vae_decode fast`` uses):
    four latent frames a decoder call through the latent-resolution stages, the up blocks past the first temporal
    upsampling two latent frames at a time and the decoder's tail (the up blocks past the last one, and the head,
    whose full-resolution activations make the peak) one at a time within the chunk (exact, like the chunks:
    :func:`vdbench.vae.lean._lean_decoder`). Peak memory grows with the frames of a call (the activations of K latent
    frames = 4K output frames are live at once, on top of the fixed causal caches); the stages before the tail are
    small and the latent-resolution convs run faster over four frames a call than over two. Peak live-tensor bytes
    counted op by op on the meta device (no cuDNN workspace), 5 latent frames at 416x240 (tests/test_vae_memory.py):
    Wan 2.1 diffusers 0.951 GiB, fast (4/2/1) 0.822, 2/1 0.809, 4/1 0.876, 2/2 0.950, one latent frame a call 0.735;
    Wan 2.2 (TI2V-5B VAE) 1.012, 0.792, 0.772, 0.863, 0.961, 0.675; the TI2V-5B VAE at 1280x704 (7 latent frames):
    9.15, 7.15, 7.01, 7.79, 8.71, 6.13. Measured on an H200 (docs/PERFORMANCE.md §8.1): the default is faster than
    two latent frames a call (0.5% for the TI2V-5B VAE at 1280x704x121, 9.23 against 8.98 GiB) and peaks below
    diffusers'; ``chunk_frames`` / ``tail_frames`` (the bench's ``fast@K/S`` and ``fast@K/S1/S2``) trade memory for
    speed explicitly. Without the Triton glue (a CPU, or ``--vae_glue eager``) the default is one latent frame a
    call (``FAST_EAGER_CHUNK``): no speed was measured there, and a CPU's convolutions over two frames round
    differently from two calls of one, so a CPU render's frames stay the bytes they were.

    The dtype is the VAE's: load it in bf16 (``--vae_dtype bf16``) for speed.
    Other VAE classes (not in :data:`FAST_VAES`): ``fast`` is refused by :func:`vdbench.vae.decode.check_decode`,
    never silently replaced by ``default``.

**The fast encode** (:mod:`vdbench.vae.encode`) drives the encoder with the same lean layers
(:func:`fast_layers` with ``part="encoder"``): the causal convs, RMS norms and residual blocks above, the encoder's
head through the fused conv input buffer, its down-sampling pad as one copy into the stride-2 conv's input in the
input's layout (diffusers: a ``permute().reshape()`` copy, then ``ZeroPad2d``'s), and Wan 2.2's residual down
blocks without the ``clone()`` of their input.

``max_memory_gib`` bounds the decode's activation memory: the temporal chunk size is chosen from it (on CUDA
from the measured peak of a one-latent-frame chunk, elsewhere from a coarse analytic estimate) and, if even one
frame does not fit, the frame is split into diffusers' spatial tiles (same geometry and blending as
``enable_tiling()``, tile shrunk until it fits) and each tile is decoded in temporal chunks; ``info["path"]``
says which happened.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from .. import families
from .lean import nearest_native, fast_layers

__all__ = ["wan_decode_fast", "wan_decode_chunked", "choose_chunk_frames", "prepare_latents", "FAST_VAES",
           "channels_last_3d", "fast_layers", "FAST_DEFAULT_CHUNK", "FAST_EAGER_CHUNK", "FAST_DEFAULT_TAIL",
           "fast_chunking", "resolve_glue"]

#: The VAE classes this module's fast decode (and its memory bound) drives: the Wan decoder's causal-conv cache is
#: what makes chunking exact.
FAST_VAES = ("AutoencoderKLWan",)
FAST_DEFAULT_CHUNK = 4  # latent frames per decoder call in mode "fast" with the Triton glue, unless given (module doc)
FAST_EAGER_CHUNK = 1  # ... with the eager or compiled glue (a CPU: its renders' frames kept as they were; module doc)
# latent frames per call of the blocks past the decoder's last two temporal upsamplings within a chunk (module doc)
FAST_DEFAULT_TAIL = (2, 1)
_GIB = 1024 ** 3


def prepare_latents(vae, latents: torch.Tensor, family: "str | families.Family") -> torch.Tensor:
    """Pipeline latents -> what ``vae.decode`` takes, exactly as the diffusers pipeline does it.

    The family's :attr:`~vdbench.families.Family.prepare_latents` (Wan: ``latents * std + mean``, channel-first
    (B, C, T, H, W) already; CogVideoX: (B, T, C, H, W) -> (B, C, T, H, W) and divide by the scaling factor).
    ``family``: a registered family's name, or the family.
    """
    fam = family if isinstance(family, families.Family) else families.get(family)
    return fam.prepare_latents(vae, latents)


@torch.no_grad()
def wan_decode_fast(vae, z: torch.Tensor, *, chunk_frames: Optional[int] = None,
                    max_memory_gib: Optional[float] = None, channels_last: bool = True, watchdog=None,
                    info: Optional[dict] = None, compile_backend: Optional[str] = None,
                    fused_glue: Optional[bool] = None, tail_frames=None) -> torch.Tensor:
    """Decode VAE-space latents ``z`` (B, C, T, H, W) of a Wan VAE (:data:`FAST_VAES`) -> video in [-1, 1] by the
    fast path (module doc): ``chunk_frames`` latent frames per decoder call (default :data:`FAST_DEFAULT_CHUNK`),
    or, with ``max_memory_gib``, the chunk (and tiles) chosen from that budget. ``channels_last``: weights and
    activations in channels_last(_3d) for the duration. ``compile_backend`` / ``fused_glue``: the glue compiled /
    as Triton kernels (:func:`resolve_glue`; which one ran is in ``info["glue"]``). The combinations that apply
    are :func:`vdbench.vae.decode.check_decode`'s to refuse; this runs what it is given."""
    info = {} if info is None else info
    fused = resolve_glue(vae, fused_glue, compile_backend, info)
    if max_memory_gib is not None:
        return _wan_decode_bounded(vae, z, max_memory_gib, watchdog=watchdog, info=info, channels_last=channels_last,
                                   fused_glue=fused)
    k, tail = fast_chunking(chunk_frames, tail_frames, fused, z.shape[2])
    ran = min(tail, k) if isinstance(tail, int) else [min(s, k) for s in tail]
    info.update(path="chunked", chunk_frames=k, tail_frames=ran, channels_last=channels_last)
    if compile_backend:
        info["compile_backend"] = compile_backend
    return wan_decode_chunked(vae, z, k, watchdog=watchdog, lean=True, channels_last=channels_last,
                              compile_backend=compile_backend, fused_glue=fused, tail_frames=tail)


def fast_chunking(chunk_frames: Optional[int], tail_frames, fused: bool, latent_frames: Optional[int] = None):
    """``(chunk, tail)`` the fast decode runs: the given ones, else the defaults (module doc, "Default chunk":
    :data:`FAST_DEFAULT_CHUNK` with the Triton glue, :data:`FAST_EAGER_CHUNK` without, no more than the
    ``latent_frames`` where known; :data:`FAST_DEFAULT_TAIL`). The decode's and the prewarm's one rule."""
    k = chunk_frames
    if not k:
        k = FAST_DEFAULT_CHUNK if fused else FAST_EAGER_CHUNK
        k = min(k, latent_frames) if latent_frames else k
    return k, FAST_DEFAULT_TAIL if tail_frames is None else tail_frames


#: ``info["glue"]`` of the fast path's Triton glue (what the bench and timing.json record).
GLUE_TRITON = "triton (vdbench.kernels.glue)"


def resolve_glue(vae, fused_glue: Optional[bool], compile_backend: Optional[str], info: dict) -> bool:
    """Which norm/SiLU glue the fast path runs (see :func:`vdbench.vae.decode.decode_video`'s ``fused_glue``),
    recorded in ``info["glue"]``: the Triton kernels where asked for (refused with the reason where they can't
    run) or, by default, where the VAE is on a GPU they run on; else the eager glue (with why, when by default)
    or the compiled one."""
    return glue_for(next(vae.parameters()).device, fused_glue, compile_backend, info)


def glue_for(device, fused_glue: Optional[bool], compile_backend: Optional[str], info: dict) -> bool:
    """:func:`resolve_glue` for a VAE on ``device`` (also before any VAE exists: :mod:`vdbench.vae.prewarm`)."""
    from .. import kernels as K

    dev = torch.device(device)
    if compile_backend:
        info["glue"] = f"torch.compile ({compile_backend})"
        return False
    if fused_glue is False:
        info["glue"] = "eager (asked for)"
        return False
    if fused_glue is None:
        ok, why = K.probe("vae_glue", dev) if dev.type == "cuda" else (False, f"the VAE is on {dev.type}")
        if not ok:
            info["glue"] = f"eager (Triton glue not used: {why})"
            return False
    ok, why = K.probe("vae_glue", dev)
    if not ok:  # required: refused with the reason (no silent fallback to the eager glue)
        raise RuntimeError(f"fused_glue can't run here (the VAE is on {dev}): {why}")
    info["glue"] = GLUE_TRITON
    return True


def channels_last_3d(vae) -> None:
    """Put every 5-D conv weight in ``channels_last_3d`` (``Module.to(memory_format=...)`` refuses the 4-D
    weights of the 2-D convs that the same VAEs contain)."""
    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)


@contextlib.contextmanager
def _native_dtype_upsample(vae):
    """Temporarily replace the nearest-upsample forward of this VAE's instances only (nothing global)."""
    patched = []
    for m in vae.modules():
        if (type(m).__name__ == "WanUpsample" and m.mode in ("nearest", "nearest-exact")
                and "forward" not in m.__dict__):
            m.forward = nearest_native.__get__(m)
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
                       lean: bool = False, channels_last: bool = False, compile_backend: Optional[str] = None,
                       fused_glue: bool = False, on_chunk=None, finalize: bool = True,
                       tail_frames=None) -> torch.Tensor:
    """diffusers' ``AutoencoderKLWan._decode`` (untiled) with ``chunk_frames`` latent frames per decoder call and
    a preallocated output (see the module doc for why this is equivalent). ``on_chunk(i, start, end)`` is called
    after each chunk (memory calibration); ``watchdog.stage`` names each chunk, so a hang reports where.

    ``lean``: the fast path's layers (:func:`fast_layers`: no ``F.pad`` copies, native-dtype RMS norm, in-place
    SiLU/residual adds, one-copy frame interleave) for the duration of the call; ``channels_last``: conv weights
    and activations in channels_last(_3d) for the duration. Both default off here (diffusers' layers: what the
    bench's ``chunked`` config and the band-parallel decode drive); :func:`wan_decode_fast` turns them on.
    ``compile_backend``, ``fused_glue``, ``tail_frames`` (with ``lean``): see :func:`fast_layers`.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    if chunk_frames < 1:
        raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
    z = z.to(vae.dtype)
    n = z.shape[2]
    out = None
    t_out = 0
    with contextlib.ExitStack() as stack:
        if native_upsample:
            stack.enter_context(_native_dtype_upsample(vae))
        if lean or channels_last:
            stack.enter_context(fast_layers(vae, channels_last=channels_last, lean=lean,
                                            compile_backend=compile_backend, fused_glue=fused_glue,
                                            tail_frames=tail_frames if lean else None))
        if any(isinstance(m, torch.nn.Conv3d) and m.weight.is_contiguous(memory_format=torch.channels_last_3d)
               and not m.weight.is_contiguous() for m in vae.modules()):
            z = z.contiguous(memory_format=torch.channels_last_3d)
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
            x = None
    out = out[:, :, :t_out]
    if not finalize:  # raw decoder output (tiles are blended before unpatchify/clamp, as diffusers does)
        return out
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    # in place: ``out`` is this function's own tensor (the preallocated buffer, a cat, or the decoder's output)
    return out.contiguous().clamp_(min=-1.0, max=1.0)


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


def _wan_decode_bounded(vae, z, max_memory_gib: float, *, watchdog=None, info: dict,
                        channels_last: bool = True, fused_glue: bool = False) -> torch.Tensor:
    """Temporal chunk (and, below one frame, spatial tile) chosen from the memory budget."""
    budget = float(max_memory_gib) * _GIB
    dev = z.device
    n, h, w = z.shape[2], z.shape[3], z.shape[4]
    elem = torch.finfo(vae.dtype).bits // 8
    out_bytes = 3 * ((n - 1) * 4 + 1) * h * w * vae.config.scale_factor_spatial ** 2 * elem
    key = (h, w, str(vae.dtype), str(dev), channels_last, fused_glue)
    fast = dict(lean=True, channels_last=channels_last, fused_glue=fused_glue)
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
        _ = wan_decode_chunked(vae, z[:, :, :probe], 1, watchdog=watchdog, **fast)
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
        return wan_decode_chunked(vae, z, k, watchdog=watchdog, **fast)
    # Below one frame at full size: spatial tiles (diffusers' tiling geometry and blending), each decoded in
    # temporal chunks sized from the budget scaled by the tile's area.
    sp = vae.config.scale_factor_spatial
    tile_px, stride_px = 256, 192
    while tile_px > 64 and per_frame * (tile_px / sp) ** 2 / (h * w) > avail:
        tile_px, stride_px = tile_px - 64, stride_px - 48
    per_tile = per_frame * min(1.0, (tile_px / sp) ** 2 / (h * w))
    k = max(1, choose_chunk_frames(avail, per_tile, n))
    info.update(path="tiled+chunked", tile_px=tile_px, stride_px=stride_px, chunk_frames=k)
    return wan_decode_tiled_chunked(vae, z, tile_px, stride_px, k, watchdog=watchdog, **fast)


@torch.no_grad()
def wan_decode_tiled_chunked(vae, z: torch.Tensor, tile_px: int, stride_px: int, chunk_frames: int, *,
                             watchdog=None, lean: bool = False, channels_last: bool = False,
                             fused_glue: bool = False) -> torch.Tensor:
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
    # one swap for all tiles (the per-tile calls find the layers swapped and the weights converted already)
    with fast_layers(vae, channels_last=channels_last, lean=lean, fused_glue=fused_glue) if (lean or channels_last) \
            else contextlib.nullcontext():
        for i in range(0, height, sl):
            row = []
            for j in range(0, width, sl):
                if watchdog is not None:
                    watchdog.stage(f"tile {i},{j}")
                row.append(wan_decode_chunked(vae, z[:, :, :, i:i + tl, j:j + tl], chunk_frames, finalize=False,
                                              lean=lean, channels_last=channels_last, fused_glue=fused_glue))
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
