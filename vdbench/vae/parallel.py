"""Multi-GPU (multi-process) VAE decode for Wan 2.1/2.2 and CogVideoX: each rank decodes a horizontal band of
every frame, exactly.

Why exact and not overlap-and-crop: approximate spatial tiling (decode overlapping tiles, blend or crop) changes
the result wherever a tile's receptive field was cut, and the Wan decoder's receptive field is large (dozens of
3x3 convs across four resolutions), so the seams stay visible. Here nothing is approximated: the latent is split
into bands of rows, one per rank, and every operation of diffusers' ``AutoencoderKLWan`` /
``AutoencoderKLCogVideoX`` decoder is run so that a band sees exactly the values the full-frame decode would have
given it:

* **3x3 (x3) convolutions** (``WanCausalConv3d`` with spatial padding 1, the ``nn.Conv2d`` of the up-samplers)
  receive their missing rows (*halo*, ``padding`` rows above and below) from the neighbouring ranks just before
  the convolution, at whatever resolution that layer runs; zero padding is applied only at the true top/bottom
  border of the frame (first and last rank), as the unsplit convolution does. The halo is exchanged *after* the
  temporal cache frames were concatenated, so the causal cache stays per rank (each rank caches its own band) and
  the halo covers the cached frames too. One buffer holds the band, the cached frames, the received halo rows and
  the zero padding (diffusers' own forward also builds one padded copy with ``F.pad``).
* **Per-pixel operations** (RMS norm over channels, SiLU, 1x1 convs, nearest 2x up-sampling, Wan 2.2's
  ``DupUp3D`` and ``unpatchify``, the clamp) are local: band rows ``[a, b)`` map to rows ``[2a, 2b)``.
* **The mid-block spatial attention** (Wan) needs the whole frame as keys/values: each rank computes q, k, v for
  its own rows (1x1 conv), all-gathers k and v (in rank order, which is the row order of the sequence), and
  attends with its own queries.
* **GroupNorm** (CogVideoX) normalizes with statistics over the whole frame (and the frames of the batch): per
  (batch, group) sums are all-reduced, mean first, then the squared deviations (two passes, fp32). CogVideoX's
  spatial norm interpolates the latent band to the feature band (nearest, integer factor: local). Its conv
  padding and conv caches are handled like Wan's (``CogVideoXSafeConv3d`` hooked; its time chunking kept).
* At the end the bands are all-gathered, so **every rank returns the whole video**.

How the decoder is driven is the VAE's family's (``Family.vae_frame_chunks``): Wan's by
:func:`vdbench.vae.fast.wan_decode_chunked` (diffusers' ``_decode`` loop, optionally several latent frames per decoder
call), CogVideoX's by its own ``decode`` (frame batches); the layers are hooked
by replacing ``forward`` on *this VAE's instances only* for the duration of the call (nothing global, restored
afterwards). The weights and the architecture are
diffusers'; only where rows come from changes. In fp32 on CPU (gloo) the result matches the single-process
decode to rounding, ~140 dB PSNR (tested with 2 and 3 ranks, uneven bands included).

Inputs: ``z`` is what ``vae.decode`` takes, i.e. *after* :func:`vdbench.vae.fast.prepare_latents` (Wan:
``latents * std + mean``), shape (B, z_dim, T, H, W), the same on every rank (checked with one small
collective), on the rank's device. The process group must already be initialized (torchrun + the render, or
the benchmark); this module never initializes one. CogVideoX: ``z`` is the pipeline latent permuted to
(B, C, T, H, W) and divided by the scaling factor (``prepare_latents``).
Other VAE classes (not in :data:`VAES`) are refused (NotImplementedError), as is a VAE with tiling enabled or
``replicate`` padding.

Self-check / benchmark: ``bench/bench_vae_parallel.py`` (run by python3 bench/suite.py vae_parallel)::

    torchrun --nproc_per_node=2 bench/bench_vae_parallel.py --case tiny-wan2.1 --case tiny-wan2.2 --json out.json
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .. import families

__all__ = ["decode_video_parallel", "band_sizes", "BandComm", "BandDecodeUnsupported", "VAES"]

#: The VAE classes whose decoder layers the band decode knows how to split (every H-coupled layer hooked).
VAES = ("AutoencoderKLWan", "AutoencoderKLCogVideoX")


class BandDecodeUnsupported(NotImplementedError):
    """A VAE, or a layer of it, the band decode has no exact split for (the message names it): refused, never decoded
    another way."""


def band_sizes(rows: int, world: int) -> list[int]:
    """Rows per rank: as equal as possible, the first ``rows % world`` ranks one row more. Every band needs at
    least one row (the 3x3 convs' halo is one row of the neighbour at every resolution)."""
    if rows < world:
        raise ValueError(f"cannot split {rows} latent rows over {world} ranks (each rank needs at least 1 row)")
    q, r = divmod(rows, world)
    return [q + (i < r) for i in range(world)]


class BandComm:
    """This rank's band of latent rows and the halo / gather communication of the band decode."""

    def __init__(self, latent_rows: int, group=None, *, zero_halo: bool = False):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sizes = band_sizes(latent_rows, self.world)
        self.start = sum(self.sizes[:self.rank])
        self.stop = self.start + self.sizes[self.rank]
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.up = glob(self.rank - 1) if self.rank > 0 else None  # band above (smaller row indices)
        self.down = glob(self.rank + 1) if self.rank < self.world - 1 else None
        # zero_halo: ablation for the tests only -- treat every band edge as an image border (no exchange), to
        # show that the comparison can see a missing halo.
        self.zero_halo = zero_halo
        self.exchanges = 0  # halo exchanges done (reported by the self-check)
        self.gathers = 0
        self.reductions = 0

    def scale_of(self, rows: int) -> int:
        """Resolution factor of a tensor whose band has ``rows`` rows (1 at latent resolution)."""
        own = self.sizes[self.rank]
        if rows % own:
            raise RuntimeError(f"band of {rows} rows is not a multiple of this rank's {own} latent rows")
        return rows // own

    def halo_buffer(self, x: torch.Tensor, halo: int, pad_w: int, pad_t: int = 0,
                    cache: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, C, T, H, W) band -> (B, C, pad_t + Tc + T, H + 2 halo, W + 2 pad_w): ``pad_t`` zero frames, the
        cached frames, ``x``; ``halo`` rows from the neighbouring bands above and below (zeros at the frame's
        true border) and ``pad_w`` zero columns each side. One allocation, one copy of the band."""
        b, c, t, h, w = x.shape
        if h < halo:
            raise RuntimeError(f"band of {h} rows is thinner than the halo ({halo})")
        tc = 0 if cache is None else cache.shape[2]
        out = x.new_empty((b, c, pad_t + tc + t, h + 2 * halo, w + 2 * pad_w))
        if pad_t:
            out[:, :, :pad_t].zero_()
        if pad_w:
            out[..., :pad_w].zero_()
            out[..., pad_w + w:].zero_()
        core = out[:, :, pad_t:, :, pad_w:pad_w + w]  # the frames that carry data, without the W padding
        if cache is not None:
            core[:, :, :tc, halo:halo + h] = cache.to(x.device)
        core[:, :, tc:, halo:halo + h] = x
        if halo:
            up = None if self.zero_halo else self.up
            down = None if self.zero_halo else self.down
            ops, recv_top, recv_bot = [], None, None
            if up is not None:
                recv_top = torch.empty_like(core[:, :, :, :halo], memory_format=torch.contiguous_format)
                ops += [self.dist.P2POp(self.dist.isend, core[:, :, :, halo:2 * halo].contiguous(), up, self.group),
                        self.dist.P2POp(self.dist.irecv, recv_top, up, self.group)]
            if down is not None:
                recv_bot = torch.empty_like(core[:, :, :, :halo], memory_format=torch.contiguous_format)
                ops += [self.dist.P2POp(self.dist.isend, core[:, :, :, h:h + halo].contiguous(), down, self.group),
                        self.dist.P2POp(self.dist.irecv, recv_bot, down, self.group)]
            if ops:
                for req in self.dist.batch_isend_irecv(ops):
                    req.wait()
                self.exchanges += 1
            if recv_top is None:
                core[:, :, :, :halo].zero_()
            else:
                core[:, :, :, :halo] = recv_top
            if recv_bot is None:
                core[:, :, :, h + halo:].zero_()
            else:
                core[:, :, :, h + halo:] = recv_bot
        return out

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self.dist.all_reduce(x, group=self.group)
        self.reductions += 1
        return x

    def all_gather_rows(self, x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order; rank i's part has ``sizes[i]`` entries
        there (uneven parts are padded to the largest for the collective, then cut)."""
        n = max(sizes)
        x = x.contiguous()
        if x.shape[dim] != n:
            pad_shape = list(x.shape)
            pad_shape[dim] = n - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad_shape)], dim)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(parts, x, group=self.group)
        self.gathers += 1
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


# ---------------------------------------------------------------------------------------------------------------
# Layer hooks (bound to one module instance each, installed by _band_hooks)
# ---------------------------------------------------------------------------------------------------------------

def _causal_conv3d_forward(comm: BandComm):
    def forward(self, x, cache_x=None):
        # WanCausalConv3d.forward with the H padding replaced by the neighbours' rows (see module doc).
        pad_w, _, halo, _, pad_t, _ = self._padding
        cache = cache_x if (cache_x is not None and pad_t > 0) else None
        if cache is not None:
            pad_t -= cache.shape[2]
        buf = comm.halo_buffer(x, halo, pad_w, pad_t, cache)
        return torch.nn.Conv3d.forward(self, buf)  # self.padding is (0, 0, 0): padding is all in buf
    return forward


def _conv2d_forward(comm: BandComm):
    def forward(self, x):
        # nn.Conv2d(k=3, padding=1) of WanResample, input (N, C, H, W) = (b*t) frames of the band.
        halo, pad_w = self.padding
        buf = comm.halo_buffer(x.unsqueeze(2), halo, pad_w).squeeze(2)
        return F.conv2d(buf, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
    return forward


def _attention_forward(comm: BandComm):
    def forward(self, x):
        # WanAttentionBlock.forward; keys/values of the whole frame gathered from all bands.
        identity = x
        batch_size, channels, time, height, width = x.size()
        x = x.permute(0, 2, 1, 3, 4).reshape(batch_size * time, channels, height, width)
        x = self.norm(x)
        qkv = self.to_qkv(x)
        qkv = qkv.reshape(batch_size * time, 1, channels * 3, -1)
        qkv = qkv.permute(0, 1, 3, 2).contiguous()
        q, kv = qkv[..., :channels], qkv[..., channels:]
        scale = comm.scale_of(height)
        kv = comm.all_gather_rows(kv, 2, [s * scale * width for s in comm.sizes])
        k, v = kv.chunk(2, dim=-1)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.squeeze(1).permute(0, 2, 1).reshape(batch_size * time, channels, height, width)
        x = self.proj(x)
        x = x.view(batch_size, time, channels, height, width)
        x = x.permute(0, 2, 1, 3, 4)
        return x + identity
    return forward


def _safe_conv3d_forward(comm: BandComm):
    def forward(self, x):
        # CogVideoXSafeConv3d (the conv of CogVideoXCausalConv3d): its H padding (set to 0 while hooked) replaced
        # by the neighbours' rows; then diffusers' own forward (time-chunking for memory, W padding).
        buf = comm.halo_buffer(x, self._vdbench_halo, 0)
        return type(self).forward(self, buf)
    return forward


def _group_norm_forward(comm: BandComm):
    def forward(self, x):
        # nn.GroupNorm with the statistics of the whole frame: per (batch, group) sums over every band,
        # all-reduced; two passes (mean, then squared deviations) in fp32, as torch accumulates them. Applied as
        # torch's CUDA kernel does (y = a x + b with a = rstd gamma, b = beta - mean a, in fp32, one cast), so
        # half-precision outputs round the same way as far as possible.
        b, c = x.shape[:2]
        g = self.num_groups
        xf = x.float().reshape(b, g, -1)
        count = xf.shape[-1] * sum(comm.sizes) // comm.sizes[comm.rank]  # band rows scale the same way
        mean = comm.all_reduce_sum(xf.sum(-1)) / count
        d = xf - mean[..., None]
        var = comm.all_reduce_sum((d * d).sum(-1)) / count
        del d
        rstd = torch.rsqrt(var + self.eps)
        a = rstd.repeat_interleave(c // g, dim=1)  # (b, c)
        mean_c = mean.repeat_interleave(c // g, dim=1)
        if self.affine:
            a = a * self.weight.float()
            shift = self.bias.float() - mean_c * a
        else:
            shift = -mean_c * a
        y = xf.view(b, c, -1) * a[..., None] + shift[..., None]
        return y.view(x.shape).to(x.dtype)
    return forward


def _check_same_padding(name: str, kernel: int, pad: int, stride: int, dilation: int) -> None:
    if kernel != 2 * pad + 1 or stride != 1 or dilation != 1:
        raise BandDecodeUnsupported(f"{name}: band decode handles 'same' convs along H (kernel 2p+1, stride 1, "
                                  f"dilation 1); got kernel {kernel}, padding {pad}, stride {stride}, "
                                  f"dilation {dilation}")


@contextlib.contextmanager
def _band_hooks(vae, comm: BandComm):
    """Replace ``forward`` of this VAE decoder's H-coupled layers (instances only) for the duration."""
    from diffusers.models.autoencoders import autoencoder_kl_cogvideox as C
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    patched, paddings = [], []
    try:
        for name, m in vae.decoder.named_modules():
            if isinstance(m, C.CogVideoXSafeConv3d):
                if m.kernel_size[1] == 1 and m.padding[1] == 0:
                    continue
                if m.padding_mode != "zeros":
                    raise BandDecodeUnsupported(f"{name}: padding_mode {m.padding_mode!r}")
                _check_same_padding(name, m.kernel_size[1], m.padding[1], m.stride[1], m.dilation[1])
                paddings.append((m, m.padding))
                m._vdbench_halo = m.padding[1]
                m.padding = (m.padding[0], 0, m.padding[2])
                m.forward = _safe_conv3d_forward(comm).__get__(m)
            elif isinstance(m, torch.nn.GroupNorm):
                m.forward = _group_norm_forward(comm).__get__(m)
            elif isinstance(m, W.WanCausalConv3d):
                halo = m._padding[2]
                if halo == 0 and m.kernel_size[1] == 1:
                    continue  # 1x1 spatially (shortcut, time_conv): local
                _check_same_padding(name, m.kernel_size[1], halo, m.stride[1], m.dilation[1])
                m.forward = _causal_conv3d_forward(comm).__get__(m)
            elif isinstance(m, torch.nn.Conv2d):
                if m.kernel_size[0] == 1 and m.padding[0] == 0:
                    continue  # 1x1 (attention's to_qkv / proj): local
                if m.padding_mode != "zeros":
                    raise BandDecodeUnsupported(f"{name}: padding_mode {m.padding_mode!r}")
                _check_same_padding(name, m.kernel_size[0], m.padding[0], m.stride[0], m.dilation[0])
                m.forward = _conv2d_forward(comm).__get__(m)
            elif isinstance(m, W.WanAttentionBlock):
                m.forward = _attention_forward(comm).__get__(m)
            elif isinstance(m, (torch.nn.Conv3d, torch.nn.Conv1d, torch.nn.BatchNorm2d, torch.nn.LayerNorm,
                                torch.nn.MultiheadAttention)):
                raise BandDecodeUnsupported(f"{name}: {type(m).__name__} is not handled by the band decode")
            else:
                continue
            patched.append(m)
        yield patched
    finally:
        for m in patched:
            del m.forward
        for m, pad in paddings:
            m.padding = pad
            del m._vdbench_halo


def _check_same_input(comm: BandComm, z: torch.Tensor) -> None:
    """Every rank must decode the same latents: compare shape and two float64 checksums (one all-gather)."""
    zf = z.detach().to(torch.float64)
    sig = torch.tensor([*z.shape, zf.sum().item(), (zf * zf).sum().item()], dtype=torch.float64, device=z.device)
    sig = sig.view(1, -1)
    allsig = comm.all_gather_rows(sig, 0, [1] * comm.world)
    comm.gathers -= 1  # not part of the decode's communication
    if not torch.equal(allsig, sig.expand_as(allsig)):
        raise ValueError("decode_video_parallel: the ranks hold different latents (shape/checksum per rank: "
                         f"{allsig.cpu().tolist()}); every rank must pass the same z")


@torch.no_grad()
def decode_video_parallel(vae, z: torch.Tensor, *, group=None, chunk_frames: Optional[int] = None,
                          native_upsample: bool = True, info: Optional[dict] = None,
                          family: Optional[families.Family] = None, _zero_halo: bool = False) -> torch.Tensor:
    """Decode VAE-space latents ``z`` (B, C, T, H, W) -> video (B, C_out, F, H', W') on **every** rank, each rank
    computing one band of rows (see the module doc). Same output as ``vae.decode(z).sample`` (Wan: clamped to
    [-1, 1] as diffusers does; CogVideoX: unclamped, as its ``decode`` returns it).

    ``group``: an initialized process group (default: the world); not created here. ``z`` must be identical on
    all ranks and on this rank's device (cuda:LOCAL_RANK with NCCL, cpu with gloo).
    ``chunk_frames`` (families with ``vae_frame_chunks``: Wan): latent frames per decoder call, as in
    :func:`vdbench.vae.fast.wan_decode_chunked` (None: all frames after the first in one call, like ``mode='fast'``; 1:
    diffusers' own per-frame loop). The others (CogVideoX) run diffusers' own ``decode`` loop (its frame batches)
    on the band.
    ``native_upsample`` (Wan only): see :mod:`vdbench.vae.fast` (bit-identical nearest up-sampling, no fp32 copy).
    ``info`` (dict) receives the band, the chunk size and the communication counts. ``family``: the VAE's family
    (how its decoder is driven on a band) where the caller holds it (a render); by default the one using its class.
    """
    import torch.distributed as dist

    from .fast import wan_decode_chunked

    name = type(vae).__name__
    if name not in VAES:
        raise BandDecodeUnsupported(f"parallel VAE decode is implemented for AutoencoderKLWan (Wan 2.1/2.2) and "
                                  f"AutoencoderKLCogVideoX only, not {name}; use --vae_decode default")
    # how the decoder is driven on a band is the family's: a few latent frames per call, or the VAE's own decode
    family = family if family is not None else families.for_vae(vae)
    if not family.vae_frame_chunks and chunk_frames is not None:
        chunked = [f.name for f in map(families.get, families.names()) if f.vae_frame_chunks]
        raise ValueError(f"chunk_frames applies to the VAEs decoded a few latent frames per call "
                         f"({', '.join(chunked) or 'none registered'}); {family.name}'s decodes in its own frame "
                         "batches")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("decode_video_parallel needs an initialized torch.distributed process group "
                           "(run under torchrun; the caller initializes it)")
    if z.dim() != 5:
        raise ValueError(f"z must be (B, C, T, H, W), got shape {tuple(z.shape)}")
    if vae.use_tiling:
        raise ValueError("decode_video_parallel: disable the VAE's tiling (vae.disable_tiling()); the band decode "
                         "is exact and replaces it")
    info = {} if info is None else info
    comm = BandComm(z.shape[3], group, zero_halo=_zero_halo)
    _check_same_input(comm, z)
    band = z[:, :, :, comm.start:comm.stop].contiguous()
    k = None
    with _band_hooks(vae, comm) as patched:
        if family.vae_frame_chunks:
            k = chunk_frames or max(1, z.shape[2] - 1)
            part = wan_decode_chunked(vae, band, k, native_upsample=native_upsample)
        else:
            part = vae.decode(band.to(vae.dtype), return_dict=False)[0]
    s = part.shape[3] // band.shape[3]  # spatial factor of the whole decoder (8, or 16 with Wan 2.2's patchify)
    video = comm.all_gather_rows(part, 3, [r * s for r in comm.sizes])
    info.update(path="parallel", world=comm.world, rank=comm.rank, band_rows=[comm.start, comm.stop],
                band_sizes=comm.sizes, chunk_frames=k, halo_exchanges=comm.exchanges, gathers=comm.gathers,
                reductions=comm.reductions, hooked_layers=len(patched))
    return video
