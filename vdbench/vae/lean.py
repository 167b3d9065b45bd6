"""The lean layers of the fast Wan VAE path (:mod:`vdbench.vae.fast`'s module doc says what each one saves):
per-instance ``forward`` replacements for diffusers' causal convs, RMS norms, residual blocks, resamples, the decoder
and the encoder, installed for the duration of a decode or encode by :func:`fast_layers` and removed on exit."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["fast_layers"]

# ---------------------------------------------------------------------------------------------------------------
# Lean layers of the fast path (installed per instance by fast_layers(), removed on exit)
# ---------------------------------------------------------------------------------------------------------------

_CACHE_T = 2  # diffusers' CACHE_T: input frames a causal conv keeps for the next chunk

# The compiled norm -> SiLU -> conv-input builder in use inside fast_layers(compile_backend=...), else None.
_GLUE: contextvars.ContextVar = contextvars.ContextVar("vdbench_vae_glue", default=None)
_COMPILED_GLUE: dict = {}
# The Triton row kernels (vdbench.kernels.glue) inside fast_layers(fused_glue=True), else None: convs then run
# without their bias, added by those kernels where the output is read next (see _conv_valid_t).
_ROWS: contextvars.ContextVar = contextvars.ContextVar("vdbench_vae_rows", default=None)
# Latent frames per call of the up blocks past the decoder's last temporal upsamplings (a tuple, the last for the tail:
# those blocks and the head) inside fast_layers(tail_frames=...), else None: a chunk then runs in pieces (_lean_decoder).
_TAIL: contextvars.ContextVar = contextvars.ContextVar("vdbench_vae_tail", default=None)


def _norm_silu_cat(x, ctx, g):
    """The glue in front of every residual-block conv as one function for torch.compile: RMS norm over channels
    (fp32 math), * gamma*sqrt(dim), SiLU, rounded once, concatenated behind the causal context frames ``ctx``.
    Inductor fuses it into one kernel that writes straight into the conv's input buffer (layout kept)."""
    n = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32).clamp_min(1e-12)
    y = F.silu(x.float() / n * g).to(x.dtype)
    return torch.cat([ctx, y], 2)


def _compiled_glue(backend: str):
    """One compiled :func:`_norm_silu_cat` per backend and process (dynamic shapes: a handful of graphs for all
    stages and chunk sizes of a decoder -- size-1 frame counts and memory layouts are specialized -- and no graph
    breaks: a pure tensor function). :func:`fast_layers` raises dynamo's recompile limit while it is active."""
    fn = _COMPILED_GLUE.get(backend)
    if fn is None:
        fn = _COMPILED_GLUE[backend] = torch.compile(_norm_silu_cat, backend=backend, dynamic=True)
    return fn


def _fused_kernels(vae):
    """The Triton glue module (:mod:`vdbench.kernels.glue`: ``norm_silu_cat``, the Triton form of
    :func:`_norm_silu_cat`, and ``add_rows_`` for the conv biases), refused with the reason where it can't run on
    the VAE's device (no silent fallback to the eager glue)."""
    from .. import kernels as K

    dev = next(vae.parameters()).device
    if dev.type == "meta":  # shapes only: the kernels compiled for a GPU, nothing run (vdbench.vae.prewarm)
        from ..kernels import glue

        if glue.compiling_for() is not None:
            return glue
    ok, why = K.probe("vae_glue", dev)
    if not ok:
        raise RuntimeError(f"fused_glue can't run here (the VAE is on {dev}): {why}")
    from ..kernels import glue

    return glue


def _layout(x: torch.Tensor):
    """The memory format to give new tensors that meet ``x`` (channels_last_3d if ``x`` is in it)."""
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _lean_causal_conv3d(self, x, cache_x=None):
    """WanCausalConv3d.forward without its ``F.pad`` copy: the spatial zero padding is done by the convolution
    (``padding=(0, ph, pw)``, same weights, same result); only the causal time context is concatenated in front
    of ``x`` (the cached frames, and zero frames where the cache is short or absent, as ``F.pad`` adds them), in
    ``x``'s memory format."""
    pt = self._padding[4]
    if pt > 0:
        parts = []
        have = 0 if cache_x is None else cache_x.shape[2]
        if have > pt:  # F.pad with a negative front pad crops the cache
            cache_x, have = cache_x[:, :, have - pt:], pt
        if pt > have:
            b, c, _, h, w = x.shape
            parts.append(torch.empty((b, c, pt - have, h, w), dtype=x.dtype, device=x.device,
                                     memory_format=_layout(x)).zero_())
        if have:
            parts.append(cache_x.to(x.device))
        x = torch.cat([*parts, x], 2)
    return _conv_valid_t(self, x)


def _rms_norm_into(norm, x, out):
    """WanRMS_norm(x) written into ``out`` (a tensor of x's shape, any layout, e.g. a slice of a conv's input
    buffer) in one fp32-accumulated reduction and two passes in the input dtype: the norm over channels is
    accumulated in fp32 (on CUDA straight from bf16: no fp32 copy of ``x``), ``x / norm`` is computed in
    fp32 and rounded once into ``out``, then scaled by ``gamma * sqrt(dim)`` in place. diffusers materializes
    ``x.float()``, the fp32 quotient and three more full-size tensors (cast back, ``* scale``, ``* gamma``,
    ``+ bias``)."""
    dim = 1 if norm.channel_first else -1
    n = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32).clamp_min_(1e-12)
    torch.div(x, n, out=out)  # F.normalize's x / max(||x||, eps), in fp32, rounded once into out
    del n
    out.mul_(_gain(norm))
    if isinstance(norm.bias, torch.Tensor):
        out.add_(norm.bias)
    return out


def _gain(norm):
    """``gamma * sqrt(dim)`` in fp32, computed once per :func:`fast_layers` scope (cached on the instance)."""
    g = norm.__dict__.get("_vdbench_gain")
    if g is None:
        g = norm.gamma.detach().float() * norm.scale
    return g


def _lean_rms_norm(self, x):
    """WanRMS_norm.forward via :func:`_rms_norm_into` (a fresh tensor in x's dtype and layout)."""
    return _rms_norm_into(self, x, torch.empty_like(x))


def _cached_conv(conv, x, feat_cache, feat_idx):
    """The cache bookkeeping diffusers repeats before each causal conv (last CACHE_T input frames kept)."""
    if feat_cache is None:
        return conv(x)
    idx = feat_idx[0]
    cache_x = x[:, :, -_CACHE_T:].clone()
    if cache_x.shape[2] < _CACHE_T and feat_cache[idx] is not None:
        cache_x = torch.cat([feat_cache[idx][:, :, -1:].to(cache_x.device), cache_x], dim=2)
    x = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return x


def _lean_norm_ok(norm, act, conv) -> bool:
    """The fused norm -> SiLU -> causal conv applies: this VAE's modules, swapped by fast_layers (not hooked
    by anyone else), SiLU activation, eval mode."""
    return (norm.__dict__.get("forward") is not None and getattr(norm.forward, "__func__", None) is _lean_rms_norm
            and getattr(conv.__dict__.get("forward"), "__func__", None) is _lean_causal_conv3d
            and type(act) is torch.nn.SiLU and not norm.training)


def _norm_act_conv_input(norm, act, conv, x, feat_cache, feat_idx, x_bias=None):
    """The input buffer of ``conv(act(norm(x)))`` with diffusers' cache bookkeeping, built without the
    intermediate tensors: one buffer of ``pad_t + T`` frames gets the causal context (cached frames of the
    previous chunk, zero frames where there are fewer than ``pad_t``) and the norm output written straight
    into its last ``T`` frames (SiLU in place there); the new cache (last CACHE_T frames: written by the same
    pass with the Triton glue, else cloned from the buffer) replaces the old one before the conv runs. Returns the
    buffer for :func:`_conv_valid_t`. ``x_bias``: the bias of the conv that produced ``x`` and ran without it (fused
    glue only), added before the norm."""
    b, c, t, h, w = x.shape
    pt = conv._padding[4]
    old = None
    if feat_cache is not None:
        idx = feat_idx[0]
        old = feat_cache[idx]
    have = 0 if old is None else min(old.shape[2], pt)
    glue, rows, cache_x = _GLUE.get(), _ROWS.get(), None
    if glue is not None and norm.channel_first and not isinstance(norm.bias, torch.Tensor):
        if have and have == pt:
            ctx = old[:, :, old.shape[2] - pt:]
        else:
            ctx = torch.empty((b, c, pt - have, h, w), dtype=x.dtype, device=x.device,
                              memory_format=_layout(x)).zero_()
            if have:
                ctx = torch.cat([ctx, old[:, :, -have:].to(x.device)], 2)
        if rows is not None and glue is rows.norm_silu_cat and feat_cache is not None and t >= _CACHE_T:
            # the Triton glue writes the next chunk's cache in the same pass (no clone of the buffer's tail)
            buf, cache_x = rows.norm_silu_cat_keep(x, ctx, _gain(norm), x_bias, keep=_CACHE_T)
        else:
            buf = glue(x, ctx, _gain(norm)) if x_bias is None else glue(x, ctx, _gain(norm), bias=x_bias)
        del ctx
    else:
        if x_bias is not None:
            x = rows.add_rows_(x, x_bias)
        buf = torch.empty((b, c, pt + t, h, w), dtype=x.dtype, device=x.device, memory_format=_layout(x))
        if pt > have:
            buf[:, :, :pt - have].zero_()
        if have:
            buf[:, :, pt - have:pt].copy_(old[:, :, -have:])
        _rms_norm_into(norm, x, buf[:, :, pt:])
        F.silu(buf[:, :, pt:], inplace=True)
    y = buf[:, :, pt:]
    if feat_cache is not None:
        if cache_x is None:
            cache_x = y[:, :, -_CACHE_T:].clone()
        if cache_x.shape[2] < _CACHE_T and old is not None:
            cache_x = torch.cat([old[:, :, -1:].to(cache_x.device), cache_x], dim=2)
        feat_cache[idx] = cache_x
        feat_idx[0] += 1
    return buf


def _pointwise_gemm(conv, x):
    """A 1x1x1 conv (the residual shortcuts, ``post_quant_conv``) on channels_last_3d ``x`` as one GEMM over its
    rows, the bias in the GEMM's epilogue: output channels_last_3d on every device, or None where ``x``'s layout
    or the conv's shape doesn't allow it.

    Why not the conv: on a GPU a pointwise conv's output layout is cuDNN's choice (on an H200 it returned a
    contiguous tensor for a channels_last_3d input), so the glue after it ran a strided variant, slower than its
    channels_last one, which :mod:`vdbench.vae.prewarm`'s meta-device decode -- whose conv keeps channels_last -- never
    compiled (2 of the fast decode's 18 variants). A GEMM's (rows, C_out) output is that layout by construction,
    and its bias costs no pass of its own."""
    w = conv.weight
    if (w.dim() != 5 or tuple(w.shape[2:]) != (1, 1, 1) or tuple(conv.stride) != (1, 1, 1) or conv.groups != 1
            or x.dim() != 5 or x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last_3d)):
        return None
    b, c, t, h, ww = x.shape
    rows = x.permute(0, 2, 3, 4, 1).view(-1, c)  # channels_last_3d: a free (voxels, C) view
    w2 = w.reshape(w.shape[0], c).t()
    y = rows @ w2 if conv.bias is None else torch.addmm(conv.bias, rows, w2)
    return y.view(b, t, h, ww, -1).permute(0, 4, 1, 2, 3)


def _conv_valid_t(conv, buf, defer_bias: bool = False):
    """The causal conv on a buffer that already holds its time context (spatial padding by the conv). With the
    fused glue (:data:`_ROWS` set) the conv runs without its bias, which is added by one Triton row pass, or not
    at all with ``defer_bias`` (the caller adds it where it reads the output next: the glue, the residual)."""
    pw, _, ph, _, _, _ = conv._padding
    rows = _ROWS.get()
    # with the Triton glue only: its variants are what the layout decides (the eager glue's output is unchanged)
    y = _pointwise_gemm(conv, buf) if rows is not None and pw == ph == 0 and not defer_bias else None
    if y is not None:
        return y
    if rows is None or conv.bias is None:
        return F.conv3d(buf, conv.weight, conv.bias, conv.stride, (0, ph, pw), conv.dilation, conv.groups)
    y = F.conv3d(buf, conv.weight, None, conv.stride, (0, ph, pw), conv.dilation, conv.groups)
    return y if defer_bias else rows.add_rows_(y, conv.bias)


def _match_weight_layout(x: torch.Tensor, conv) -> torch.Tensor:
    """``x`` in channels_last_3d where ``conv``'s weight is and ``x`` is not (one copy), else ``x`` itself.

    Why: a block's input can arrive contiguous from a layer the lean path doesn't own -- the mid block's
    attention (diffusers' ``WanAttentionBlock``) on a GPU -- and every conv, glue kernel and residual of the
    block would then follow that layout: the glue's strided variants (slower than its channels_last ones) and,
    in a fresh process, Triton variants that :mod:`vdbench.vae.prewarm`'s meta-device decode, whose attention
    keeps channels_last, never compiled (on an H200, 3 of the fast decode's 18). One layout on every device."""
    w = getattr(conv, "weight", None)
    if (x.dim() == 5 and isinstance(w, torch.Tensor) and w.dim() == 5 and not w.is_contiguous()
            and w.is_contiguous(memory_format=torch.channels_last_3d)
            and not x.is_contiguous(memory_format=torch.channels_last_3d)):
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x


def _lean_residual_block(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006 - diffusers' signature
    """WanResidualBlock.forward with norm -> SiLU written straight into each conv's input buffer (no SiLU
    output, no cat with the cache, no padded copy), the old cache released before the conv instead of after,
    the conv1 output released before conv2 runs, and the residual added in place into conv2's output."""
    if _ROWS.get() is not None:  # with the Triton glue, whose variants the layout decides
        x = _match_weight_layout(x, self.conv1)
    h = self.conv_shortcut(x)
    if not (_lean_norm_ok(self.norm1, self.nonlinearity, self.conv1)
            and _lean_norm_ok(self.norm2, self.nonlinearity, self.conv2)
            and (not self.dropout.training or self.dropout.p == 0)):
        x = self.nonlinearity(self.norm1(x))
        x = _cached_conv(self.conv1, x, feat_cache, feat_idx)
        x = self.dropout(self.nonlinearity(self.norm2(x)))
        x = _cached_conv(self.conv2, x, feat_cache, feat_idx)
        return x + h
    rows = _ROWS.get()
    buf = _norm_act_conv_input(self.norm1, self.nonlinearity, self.conv1, x, feat_cache, feat_idx)
    y = _conv_valid_t(self.conv1, buf, defer_bias=rows is not None)
    del buf
    buf = _norm_act_conv_input(self.norm2, self.nonlinearity, self.conv2, y, feat_cache, feat_idx,
                               x_bias=self.conv1.bias if rows is not None else None)
    del y
    y = _conv_valid_t(self.conv2, buf, defer_bias=rows is not None)
    del buf
    if rows is not None and self.conv2.bias is not None:
        return rows.add_rows_(y, self.conv2.bias, h)  # y + bias + h in one pass
    return y.add_(h)


#: The most bytes of fp32 attention scores :func:`_lean_attention_block` holds at once (frames, or a frame's queries,
#: in blocks under it).
_ATTN_SCORE_BYTES = 256 * 2 ** 20


def _scores(q, k):
    """``q @ k^T`` (batched) in fp32: bf16/fp16 operands on CUDA accumulate into an fp32 output (cuBLAS), elsewhere
    the operands are taken in fp32."""
    kt = k.transpose(-1, -2)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(q, kt, out_dtype=torch.float32)
    return torch.bmm(q.float(), kt.float())


def _lean_attention_block(self, x):
    """WanAttentionBlock.forward: :func:`_gemm_attention` with the Triton glue (a GPU), diffusers' own forward with the
    eager glue (a CPU: its renders' frames stay the bytes they were, as with ``FAST_EAGER_CHUNK``)."""
    if _ROWS.get() is None:
        return type(self).forward(self, x)
    return _gemm_attention(self, x)


def _gemm_attention(self, x):
    """WanAttentionBlock.forward (the mid block's single-head self-attention over a frame's H*W positions) with the
    attention as two GEMMs and a softmax: scores in fp32, the softmax in fp32, the probabilities rounded to the
    input dtype for the second GEMM (what SDPA's kernels do), in blocks of frames -- or of a frame's queries -- of
    at most :data:`_ATTN_SCORE_BYTES` of scores; the q/k/v and output 1x1 convs as GEMMs over the frame's rows (a
    channels_last input: no permute copies), their biases in the GEMMs, the residual added in place.

    Why: a head of 1024 channels (384 for Wan 2.1's VAE) is beyond the flash and cuDNN kernels, so SDPA runs the
    memory-efficient one, ~1 ms a frame of 3520 positions on an H200 (17 ms of the TI2V-5B decode at 1280x704x121)
    for ~51 GFLOP that a GEMM does in a tenth of it."""
    b, c, t, h, w = x.shape
    n, m = b * t, h * w
    frames = x.permute(0, 2, 1, 3, 4).reshape(n, c, h, w)
    xn = self.norm(frames)
    del frames
    rows = xn.permute(0, 2, 3, 1).reshape(n, m, c)  # a view for channels_last frames
    qkv = F.linear(rows, self.to_qkv.weight.view(3 * c, c), self.to_qkv.bias)
    del xn, rows
    q, k, v = qkv.split(c, dim=-1)
    out = torch.empty((n, m, c), dtype=x.dtype, device=x.device)
    scale = c ** -0.5
    per_frame = 4 * m * m
    group = max(1, _ATTN_SCORE_BYTES // per_frame)
    block = m if group > 1 or per_frame <= _ATTN_SCORE_BYTES else max(1, _ATTN_SCORE_BYTES // (4 * m))
    for f0 in range(0, n, group):
        fs = slice(f0, f0 + group)
        for q0 in range(0, m, block):
            qs = slice(q0, q0 + block)
            p = torch.softmax(_scores(q[fs, qs], k[fs]).mul_(scale), dim=-1).to(v.dtype)
            torch.bmm(p, v[fs], out=out[fs, qs])
            del p
    del qkv, q, k, v
    y = F.linear(out, self.proj.weight.view(c, c), self.proj.bias)
    del out
    return y.view(b, t, h, w, c).permute(0, 4, 1, 2, 3).add_(x)


def _lean_decoder(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):  # noqa: B006
    """WanDecoder3d.forward with the head (norm_out -> SiLU -> conv_out) through the fused conv input buffer; with
    ``fast_layers(tail_frames=...)`` the up blocks past a temporal upsampling (:func:`_segment_starts`) run in pieces of
    fewer latent frames than the chunk: ``S`` for the tail (the up blocks past the last temporal upsampling, then the
    head), ``(S1, S2)`` for the blocks past the last two, each piece of the first split into pieces of the second.

    Why in pieces: the full-resolution activations are what a chunk's peak memory is made of, while the stages before
    them are small and run faster over more frames a call (on an H200 cuDNN's 1024-channel 3x3x3 conv at the latent
    grid runs 4 frames a call at 802 TFLOP/s and 2 at 699; at 88x160 2 frames a call at 676, 4 at 798): a chunk of
    4 latent frames with pieces of 2 past the first temporal upsampling and 1 past the second gives each stage
    about the frames it runs best at and keeps each piece's activations the size of one latent frame's at full
    resolution. Exact: every op past a split is per frame or a causal conv, whose cache carries the frames from one
    piece to the next as from one chunk to the next (each piece re-enters its blocks' cache slots, ``feat_idx``
    reset to where they start)."""
    t_lat = x.shape[2]
    x = _cached_conv(self.conv_in, x, feat_cache, feat_idx)
    x = self.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    tail = _TAIL.get()
    splits = []
    if tail is not None and feat_cache is not None and not first_chunk:
        starts = _segment_starts(self)
        n = min(len(tail), len(starts))
        splits = list(zip(starts[len(starts) - n:], tail[len(tail) - n:]))
    box = [x]
    del x  # the callees take their input out of the box: no frame here keeps it while they run
    return _staged(self, box, 0, splits, t_lat, feat_cache, feat_idx, first_chunk)


def _staged(self, box, lo, splits, t_lat, feat_cache, feat_idx, first_chunk):
    """The up blocks from ``lo`` on and the head on the tensor in ``box`` (``t_lat`` latent frames' worth), the
    blocks from each split's start on in pieces of its latent frames (:func:`_lean_decoder`)."""
    if not splits:
        return _decoder_tail(self, box, lo, feat_cache, feat_idx, first_chunk)
    (start, frames), rest = splits[0], splits[1:]
    x = _up_blocks(self, box, lo, start, feat_cache, feat_idx, first_chunk)
    per = x.shape[2] // t_lat  # frames a latent frame is here
    if frames >= t_lat or x.shape[2] % t_lat:
        box.append(x)
        del x
        return _staged(self, box, start, rest, t_lat, feat_cache, feat_idx, first_chunk)
    idx, parts, pieces = feat_idx[0], [], list(x.split(per * frames, dim=2))
    del x  # the pieces hold it (views of one storage, freed with the last piece)
    while pieces:
        feat_idx[0] = idx
        piece = pieces.pop(0)
        n = piece.shape[2] // per
        parts.append(_staged(self, [piece], start, rest, n, feat_cache, feat_idx, first_chunk))
        del piece
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def _segment_starts(decoder) -> list:
    """The index of the first up block past each of the decoder's temporal upsamplings (an ``upsample3d`` resample or
    a ``DupUp3D`` shortcut with a time factor), in order: from the last on every layer keeps the frame count."""
    starts = []
    for i, block in enumerate(decoder.up_blocks):
        if any((type(m).__name__ == "WanResample" and m.mode == "upsample3d")
               or (type(m).__name__ == "DupUp3D" and m.factor_t > 1) for m in block.modules()):
            starts.append(i + 1)
    return starts


def _up_blocks(self, box, lo, hi, feat_cache, feat_idx, first_chunk):
    """The decoder's up blocks ``lo`` to ``hi`` (exclusive) on the tensor in the one-element list ``box``, taken out
    of it: the caller keeps no reference to a block's input while the blocks run (one full-size activation less at
    the peak)."""
    x = box.pop()
    for up_block in self.up_blocks[lo:hi]:
        if type(up_block).__name__ == "WanUpBlock" and "forward" not in up_block.__dict__:
            # WanUpBlock.forward inlined, so that no frame keeps the block's input alive while its residual
            # blocks run (a called block's caller would hold it: one full-size activation more at the peak)
            for resnet in up_block.resnets:
                x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
            if up_block.upsamplers is not None:
                x = up_block.upsamplers[0](x, feat_cache=feat_cache, feat_idx=feat_idx)
        else:
            x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
    return x


def _decoder_tail(self, box, start, feat_cache, feat_idx, first_chunk):
    """The up blocks from ``start`` on, then the head, on the tensor in ``box`` (:func:`_up_blocks`)."""
    x = _up_blocks(self, box, start, len(self.up_blocks), feat_cache, feat_idx, first_chunk)
    if not _lean_norm_ok(self.norm_out, self.nonlinearity, self.conv_out):
        return _cached_conv(self.conv_out, self.nonlinearity(self.norm_out(x)), feat_cache, feat_idx)
    buf = _norm_act_conv_input(self.norm_out, self.nonlinearity, self.conv_out, x, feat_cache, feat_idx)
    del x
    return _conv_valid_t(self.conv_out, buf)


def nearest_native(self, x):
    # WanUpsample.forward without its fp32 round trip: nearest-exact only copies values (bit-identical).
    return F.interpolate(x, size=self.size, scale_factor=self.scale_factor, mode=self.mode,
                         align_corners=self.align_corners)


def _subpixel_ok(seq) -> bool:
    """Whether ``seq`` is the Wan upsampler's 2-D stage :func:`upsample_conv` computes: a nearest 2x upsample, then
    a 3x3 conv (stride 1, padding 1 with zeros, no dilation, no groups) with a bias, neither hooked (the upsample's
    own dtype-native forward, :func:`_native_dtype_upsample`, is the same upsample)."""
    if len(seq) != 2 or type(seq[0]).__name__ != "WanUpsample" or type(seq[1]) is not torch.nn.Conv2d:
        return False
    up, conv = seq
    return (up.mode in ("nearest", "nearest-exact") and up.size is None
            and tuple(float(s) for s in up.scale_factor) == (2.0, 2.0) and tuple(conv.kernel_size) == (3, 3)
            and tuple(conv.stride) == (1, 1) and tuple(conv.padding) == (1, 1) and tuple(conv.dilation) == (1, 1)
            and conv.groups == 1 and conv.padding_mode == "zeros" and conv.bias is not None
            and getattr(up.__dict__.get("forward"), "__func__", nearest_native) is nearest_native
            and "forward" not in conv.__dict__)


def subpixel_weight(weight: torch.Tensor) -> torch.Tensor:
    """The 2x2 kernels that compute a 3x3 conv (padding 1) of a nearest 2x upsample from the input itself:
    ``(4 * C_out, C_in, 2, 2)``, the output parity ``(a, b)`` (row, column) in block ``2a + b``.

    Output row ``2i + a`` of the upsample's conv reads upsampled rows ``2i + a - 1 .. 2i + a + 1``, i.e. input rows
    ``i - 1, i, i`` (a = 0) or ``i, i, i + 1`` (a = 1): two input rows, the 3x3 kernel's rows summed where they meet
    the same one; columns alike. The zero padding maps to the input's (an upsampled border row is a copy of the
    input's). So 4 kernels of 2x2 taps replace 9 taps on 4x the pixels: 2.25x fewer multiply-adds. The sums are
    taken in fp32 (or the weight's wider dtype) and rounded once into the weight's dtype."""
    w = weight.to(torch.promote_types(weight.dtype, torch.float32))

    def halves(t, dim):
        lo, mid, hi = t.unbind(dim)
        return torch.stack([lo, mid + hi], dim), torch.stack([lo + mid, hi], dim)

    blocks = [wb for wa in halves(w, 2) for wb in halves(wa, 3)]
    return torch.cat(blocks, 0).to(weight.dtype).contiguous(memory_format=torch.channels_last)


def upsample_conv(frames: torch.Tensor, conv: torch.nn.Conv2d, add: Optional[torch.Tensor] = None,
                  per_batch: Optional[int] = None) -> torch.Tensor:
    """``conv(nearest_2x(frames))`` (the Wan upsampler's 2-D stage, :func:`_subpixel_ok`) without the upsampled
    tensor: one conv of :func:`subpixel_weight`'s kernels over ``frames`` (padding 1: ``(H + 1) x (W + 1)``
    positions), each output parity read from its block at its offset and written, bias added, into the
    interleaved channels_last output (with the Triton glue in one pass: ``vdbench.kernels.glue.subpixel_bias``).
    The same sums as the upsample's conv in another order (fp32 accumulation either way); the 2-D stages are 14% of
    the Wan 2.2 decoder's multiply-adds. ``add`` (with the Triton glue only): the up block's ``DupUp3D`` shortcut,
    added by the same pass (:func:`vdbench.kernels.glue.subpixel_bias`; ``frames`` holds ``per_batch`` frames of
    each batch)."""
    w4 = getattr(conv, "_vdbench_subpixel", None)
    if w4 is None or w4.device != conv.weight.device or w4.dtype != conv.weight.dtype:
        w4 = conv._vdbench_subpixel = subpixel_weight(conv.weight.detach())
    n, _, h, w = frames.shape
    co = conv.out_channels
    y4 = F.conv2d(frames, w4, None, 1, 1)
    out = torch.empty((n, co, 2 * h, 2 * w), dtype=y4.dtype, device=y4.device, memory_format=torch.channels_last)
    rows = _ROWS.get()
    if rows is not None:  # the Triton glue: one pass
        return rows.subpixel_bias(y4, conv.bias.detach(), out, add=add, frames=per_batch)
    if add is not None:
        raise ValueError("upsample_conv adds a shortcut with the Triton glue only")
    parts = y4.permute(0, 2, 3, 1).unflatten(3, (2, 2, co))  # (N, H+1, W+1, a, b, C_out): views
    grid = out.permute(0, 2, 3, 1).view(n, h, 2, w, 2, co)
    for a in (0, 1):
        for b in (0, 1):
            torch.add(parts[:, a:a + h, b:b + w, a, b], conv.bias.detach(), out=grid[:, :, a, :, b])
    return out


def dup_up_view(x: torch.Tensor, up) -> torch.Tensor:
    """Diffusers' ``DupUp3D`` of ``x`` (repeat each channel ``up.repeats`` times, then read the channels as
    ``(C_out, factor_t, factor_s, factor_s)`` and move those factors next to time, height and width) as an 8-D
    ``(B, C_out, T, factor_t, H, factor_s, W, factor_s)`` tensor: a strided view of ``x`` (no copy) where the repeats
    are a suffix of the factors -- every Wan 2.2 decoder's case: 8 repeats of all three, or 2 of the last --
    else the materialized form.

    Repeated channel ``r = ((c * ft + i) * fs + j) * fs + k`` is input channel ``r // repeats``; with ``repeats`` the
    product of the last factors, the factors inside it don't move the input channel (stride 0) and each outer one
    moves it by its weight over ``repeats``."""
    b, ci, t, h, w = x.shape
    ft, fs, co, reps = up.factor_t, up.factor_s, up.out_channels, up.repeats
    weights, sizes = [ft * fs * fs, fs * fs, fs, 1], [co, ft, fs, fs]  # of (c, i, j, k) in r
    inner = 1
    for d in (3, 2, 1, 0):
        if inner == reps:
            break
        inner *= sizes[d]
    if inner != reps or ci * reps != co * ft * fs * fs:
        return x.repeat_interleave(reps, dim=1).view(b, co, ft, fs, fs, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    sb, sc, st, sh, sw = x.stride()
    cs = [0 if weights[d] < reps else weights[d] // reps * sc for d in range(4)]
    return x.as_strided((b, co, t, ft, h, fs, w, fs), (sb, cs[0], st, cs[1], sh, cs[2], sw, cs[3]), x.storage_offset())


def _lean_resample(self, x, feat_cache=None, feat_idx=[0], shortcut=None):  # noqa: B006
    """WanResample.forward (upsample modes) with the frame interleave of ``time_conv``'s output (diffusers:
    reshape, ``torch.stack``, then ``permute(...).reshape`` for the 2-D conv: two copies, the first of which
    drops channels_last) done as one copy straight into the (B*T, C, H, W) buffer the 2-D stage reads, in the
    input's layout (for channels_last_3d input the per-frame view is then free).

    ``shortcut`` (:func:`_lean_residual_up_block`'s, with the Triton glue): ``(src, finish)``, the block's
    ``DupUp3D`` shortcut as its 8-D view and what adds it otherwise: added by the sub-pixel conv's interleave where
    the output is the view's shape, else the output is returned through ``finish``."""
    b, c, t, h, w = x.shape
    cl = _layout(x) is torch.channels_last_3d
    frames = None
    if self.mode == "upsample3d" and feat_cache is not None:
        idx = feat_idx[0]
        if feat_cache[idx] is None:
            feat_cache[idx] = "Rep"
            feat_idx[0] += 1
        else:
            rep = isinstance(feat_cache[idx], str)
            cache_x = x[:, :, -_CACHE_T:].clone()
            if cache_x.shape[2] < 2 and not rep:
                cache_x = torch.cat([feat_cache[idx][:, :, -1:].to(cache_x.device), cache_x], dim=2)
            if cache_x.shape[2] < 2 and rep:
                cache_x = torch.cat([torch.zeros_like(cache_x), cache_x], dim=2)
            y = self.time_conv(x) if rep else self.time_conv(x, feat_cache[idx])
            feat_cache[idx] = cache_x
            feat_idx[0] += 1
            # frame 2i+j of the result = channels [j*c, (j+1)*c) of y's frame i
            t = 2 * t
            frames = torch.empty((b * t, c, h, w), dtype=y.dtype, device=y.device,
                                 memory_format=torch.channels_last if cl else torch.contiguous_format)
            frames.view(b, t // 2, 2, c, h, w).copy_(y.unflatten(1, (2, c)).permute(0, 3, 1, 2, 4, 5))
            del y
    if frames is None:
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)  # a view for channels_last_3d input
    rows = _ROWS.get()
    seq = self.resample
    if rows is not None and _subpixel_ok(seq):
        src = None if shortcut is None else shortcut[0]
        co, hh, ww = seq[1].out_channels, 2 * frames.size(2), 2 * frames.size(3)
        if src is not None and (src.size(0), src.size(1), src.size(2) * src.size(3), src.size(4) * src.size(5),
                                src.size(6) * src.size(7)) == (b, co, t, hh, ww):
            x, shortcut = upsample_conv(frames, seq[1], add=src, per_batch=t), None
        else:
            x = upsample_conv(frames, seq[1])
        del frames, src
    elif (rows is not None and len(seq) == 2 and type(seq[1]) is torch.nn.Conv2d and seq[1].bias is not None
            and seq[1].padding_mode == "zeros" and "forward" not in seq[1].__dict__):
        conv = seq[1]  # upsample, then the 2-D conv without its bias; the bias in one Triton row pass
        up = seq[0](frames)
        del frames
        x = rows.add_rows_(F.conv2d(up, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups),
                           conv.bias)
        del up
    else:
        x = self.resample(frames)
        del frames
    x = x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)
    return x if shortcut is None else shortcut[1](x)


def _lean_residual_up_block(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):  # noqa: B006
    """WanResidualUpBlock.forward (Wan 2.2) without the ``x.clone()`` of the block input (nothing writes into
    it: every in-place op of the lean layers is on a tensor they just made), with the ``DupUp3D`` shortcut
    added in place into the block output through an 8-D view (no materialized shortcut, no layout mismatch);
    with the Triton glue by the upsampler's last pass (:func:`_lean_resample`'s ``shortcut``)."""
    x_in, up = x, self.avg_shortcut
    for resnet in self.resnets:
        x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx) if feat_cache is not None else resnet(x)
    src = None
    if (up is not None and self.upsampler is not None and feat_cache is not None and _ROWS.get() is not None
            and getattr(self.upsampler.__dict__.get("forward"), "__func__", None) is _lean_resample):
        src = _dup_up_src(up, x_in, first_chunk)
    if src is not None:  # the upsampler adds the shortcut: in its interleave's pass, or through the add where it can't
        return self.upsampler(x, feat_cache=feat_cache, feat_idx=feat_idx,
                              shortcut=(src, lambda y: _add_dup_up(up, y, x_in, first_chunk)))
    if self.upsampler is not None:
        x = self.upsampler(x, feat_cache=feat_cache, feat_idx=feat_idx) if feat_cache is not None else self.upsampler(x)
    return x if up is None else _add_dup_up(up, x, x_in, first_chunk)


def _dup_up_src(up, x_in, first_chunk):
    """The ``DupUp3D`` shortcut ``up(x_in, first_chunk)`` as an 8-D strided view of ``x_in`` (:func:`dup_up_view`;
    the first chunk: the last of the duplicated frames), or None where a first chunk has more than one frame."""
    if first_chunk and x_in.shape[2] != 1:
        return None
    src = dup_up_view(x_in, up)
    return src[:, :, :, up.factor_t - 1:] if first_chunk else src


def _add_dup_up(up, x, x_in, first_chunk):
    """``x + up(x_in, first_chunk)`` (the block's output and its ``DupUp3D`` shortcut) in place into ``x`` through
    the shortcut's 8-D view where the shapes are the Wan 2.2 decoder's, else diffusers' way."""
    b, _, t, h, w = x_in.shape
    ft, fs, co = up.factor_t, up.factor_s, up.out_channels
    src = None if x is x_in else _dup_up_src(up, x_in, first_chunk)
    if src is None or x.shape != (b, co, src.size(2) * src.size(3), h * fs, w * fs):
        return x + up(x_in, first_chunk=first_chunk)  # not the shapes of the Wan 2.2 decoder: diffusers' way
    rows = _ROWS.get()
    if rows is not None:  # the Triton glue: one pass
        return rows.add_dup_up_(x, src)
    x8 = x.unflatten(4, (w, fs)).unflatten(3, (h, fs)).unflatten(2, (t, ft) if not first_chunk else (1, 1))
    x8.add_(src)
    return x


# The encoder's lean layers (the fast encode, vdbench.vae.encode): the same pieces as the decoder's -- the lean causal
# conv, RMS norm and residual block above serve both -- plus the encoder's own down-sampling and head.

def _lean_encoder(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006 - diffusers' signature
    """WanEncoder3d.forward with the head (norm_out -> SiLU -> conv_out) through the fused conv input buffer, as
    the decoder's (:func:`_lean_decoder`); the down blocks and the mid block are this VAE's swapped modules."""
    x = _cached_conv(self.conv_in, x, feat_cache, feat_idx)
    for layer in self.down_blocks:
        x = layer(x, feat_cache=feat_cache, feat_idx=feat_idx) if feat_cache is not None else layer(x)
    x = self.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if not _lean_norm_ok(self.norm_out, self.nonlinearity, self.conv_out):
        return _cached_conv(self.conv_out, self.nonlinearity(self.norm_out(x)), feat_cache, feat_idx)
    buf = _norm_act_conv_input(self.norm_out, self.nonlinearity, self.conv_out, x, feat_cache, feat_idx)
    del x
    return _conv_valid_t(self.conv_out, buf)


def _pad_conv_ok(seq) -> bool:
    """``seq`` is diffusers' down-sampling pair, untouched: ZeroPad2d((0, 1, 0, 1)) then a zero-padded Conv2d."""
    return (len(seq) == 2 and type(seq[0]) is torch.nn.ZeroPad2d and tuple(seq[0].padding) == (0, 1, 0, 1)
            and type(seq[1]) is torch.nn.Conv2d and seq[1].padding_mode == "zeros"
            and not any("forward" in m.__dict__ for m in seq))


def _lean_downsample(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006
    """WanResample.forward (downsample modes) with the frames of ``x`` copied once, straight into the
    right/bottom zero-padded (B*T, C, H+1, W+1) buffer the stride-2 conv reads, in the input's layout, only the pad
    row and column zeroed (diffusers: ``permute().reshape()`` copies -- and drops channels_last -- then
    ``ZeroPad2d`` copies again); with the fused glue the conv runs without its bias, added by one Triton row pass;
    the temporal stride-2 conv (downsample3d) reads its cached frame through the lean causal conv."""
    b, c, t, h, w = x.shape
    seq = self.resample
    if not _pad_conv_ok(seq):
        y = seq(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))  # not diffusers' pair: diffusers' way
    else:
        conv = seq[1]
        cl = _layout(x) is torch.channels_last_3d
        buf = torch.empty((b * t, c, h + 1, w + 1), dtype=x.dtype, device=x.device,
                          memory_format=torch.channels_last if cl else torch.contiguous_format)
        buf[:, :, h].zero_()
        buf[:, :, :h, w].zero_()
        buf.view(b, t, c, h + 1, w + 1)[:, :, :, :h, :w].copy_(x.permute(0, 2, 1, 3, 4))
        rows = _ROWS.get()
        if rows is not None and conv.bias is not None:
            y = rows.add_rows_(F.conv2d(buf, conv.weight, None, conv.stride, conv.padding, conv.dilation,
                                        conv.groups), conv.bias)
        else:
            y = F.conv2d(buf, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        del buf
    x = y.view(b, t, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4)
    del y
    if self.mode == "downsample3d" and feat_cache is not None:
        idx = feat_idx[0]
        if feat_cache[idx] is None:  # the first chunk passes through; its last frame is the next one's context
            feat_cache[idx] = x[:, :, -1:].clone()
        else:
            cache_x = x[:, :, -1:].clone()
            x = self.time_conv(torch.cat([feat_cache[idx][:, :, -1:].to(x.device), x], 2))
            feat_cache[idx] = cache_x
        feat_idx[0] += 1
    return x


def _lean_residual_down_block(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006
    """WanResidualDownBlock.forward (Wan 2.2) without the ``x.clone()`` of the block input (nothing writes into
    it: every in-place op of the lean layers is on a tensor they just made) and with the ``AvgDown3D`` shortcut
    added in place into the block output."""
    x_in = x
    for resnet in self.resnets:
        x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if self.downsampler is not None:
        x = self.downsampler(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if x is x_in:  # no layer ran: never write into the caller's tensor
        return x + self.avg_shortcut(x_in)
    return x.add_(self.avg_shortcut(x_in))


def _weights_channels_last(vae, modules):
    """Conv3d weights -> channels_last_3d and Conv2d weights -> channels_last where they are not already;
    returns the converted parameters (to be made contiguous again on exit)."""
    changed = []
    for m in modules:
        if isinstance(m, torch.nn.Conv3d):
            fmt = torch.channels_last_3d
        elif isinstance(m, torch.nn.Conv2d):
            fmt = torch.channels_last
        else:
            continue
        w = m.weight
        if w.is_contiguous(memory_format=fmt) and not w.is_contiguous():
            continue
        changed.append(w)
        w.data = w.data.contiguous(memory_format=fmt)
    return changed


@contextlib.contextmanager
def fast_layers(vae, *, channels_last: bool = True, lean: bool = True, compile_backend: Optional[str] = None,
                fused_glue: bool = False, part: str = "decoder", tail_frames=None):
    """Scoped swap of the fast path (Wan VAEs): for the duration, this VAE's decoder instances (and its
    ``post_quant_conv``; with ``part="encoder"``: its encoder and ``quant_conv``, the fast encode of
    :mod:`vdbench.vae.encode`) run the lean forwards above instead of diffusers' (``forward`` set on the instance,
    deleted on exit -- also on error -- so the class and every other VAE are untouched); ``channels_last``:
    conv weights in channels_last(_3d) for the duration, put back in their original (contiguous) layout on exit
    (bit-exact copies both ways). A module that already has an instance-level ``forward`` (another hook, e.g.
    the band-parallel decode's) is left alone. ``compile_backend`` (with ``lean``): the norm -> SiLU -> conv
    input glue of the residual blocks and the head runs as one function compiled by ``torch.compile``
    (:func:`_norm_silu_cat`; convs stay cuDNN's). ``fused_glue`` (with ``lean``): the same
    glue as one Triton kernel, conv biases added by the Triton row pass (:func:`_fused_kernels`). ``tail_frames``
    (with ``lean``): latent frames a call for the decoder's tail (an int), or for the blocks past its last two temporal
    upsamplings (a pair), within a chunk (:func:`_lean_decoder`). Yields the list of swapped modules."""
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    swaps = {}
    if lean:
        swaps = {W.WanCausalConv3d: _lean_causal_conv3d, W.WanRMS_norm: _lean_rms_norm,
                 W.WanResidualBlock: _lean_residual_block, W.WanDecoder3d: _lean_decoder,
                 W.WanEncoder3d: _lean_encoder, W.WanAttentionBlock: _lean_attention_block}
        if hasattr(W, "WanResidualUpBlock"):
            swaps[W.WanResidualUpBlock] = _lean_residual_up_block
        if hasattr(W, "WanResidualDownBlock"):
            swaps[W.WanResidualDownBlock] = _lean_residual_down_block
    roots = {"decoder": (vae.decoder, vae.post_quant_conv), "encoder": (vae.encoder, vae.quant_conv)}
    if part not in roots:
        raise ValueError(f"part must be one of {', '.join(roots)}, not {part!r}")
    modules = [m for root in roots[part] for m in root.modules()]
    patched, weights = [], []
    if fused_glue and (not lean or compile_backend):
        raise ValueError("fused_glue needs lean=True and excludes compile_backend")
    rows = _fused_kernels(vae) if fused_glue else None
    glue = rows.norm_silu_cat if fused_glue else _compiled_glue(compile_backend) if (lean and compile_backend) else None
    tail = None if tail_frames is None else (tail_frames,) if isinstance(tail_frames, int) else tuple(tail_frames)
    if tail is not None and (not lean or not tail or not all(isinstance(s, int) and s >= 1 for s in tail)):
        raise ValueError(f"tail_frames needs lean=True and latent frames of at least 1, got {tail_frames}")
    token = _GLUE.set(glue)
    rows_token = _ROWS.set(rows)
    tail_token = _TAIL.set(tail)
    limit = contextlib.nullcontext()
    if lean and compile_backend:
        import torch._dynamo

        key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        limit = torch._dynamo.config.patch(**{key: max(64, getattr(torch._dynamo.config, key))})
    try:
        limit.__enter__()
        for m in modules:
            if "forward" in m.__dict__:
                continue
            fn = swaps.get(type(m))
            if type(m) is W.WanCausalConv3d and m.padding_mode != "zeros":
                fn = None
            if lean and type(m) is W.WanResample and m.mode in ("upsample2d", "upsample3d"):
                fn = _lean_resample
            elif lean and type(m) is W.WanResample and m.mode in ("downsample2d", "downsample3d"):
                fn = _lean_downsample
            if fn is not None:
                m.forward = fn.__get__(m)
                patched.append(m)
                if fn is _lean_rms_norm:
                    m._vdbench_gain = m.gamma.detach().float() * m.scale
        if channels_last:
            weights = _weights_channels_last(vae, modules)
        yield patched
    finally:
        limit.__exit__(None, None, None)
        _GLUE.reset(token)
        _ROWS.reset(rows_token)
        _TAIL.reset(tail_token)
        for m in patched:
            del m.forward
            m.__dict__.pop("_vdbench_gain", None)
        for m in modules:
            m.__dict__.pop("_vdbench_subpixel", None)
        for w in weights:
            w.data = w.data.contiguous()
