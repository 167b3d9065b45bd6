"""Ulysses attention with the all-to-all overlapped: heads in chunks, each chunk's exchange beside another chunk's
attention (``--ulysses_overlap N``; diffusers' context parallelism still splits the sequence and gathers it).

diffusers' Ulysses template exchanges Q, K and V whole, computes attention, then exchanges the output: the
exchanges and their layout copies sit between the kernels, unhidden (on 2 H200s at Wan 1.3B 480p, 22 ms of copies
and 26 ms of all-to-all in a 669 ms step). Each head's attention is independent, so the local heads can go in
``N`` chunks: chunk ``c + 1``'s Q/K/V travel while chunk ``c`` is computed, and chunk ``c``'s output travels while
chunk ``c + 1`` is computed (the head-chunked pipelining of Async Ulysses and HCMS). Each head is computed whole
by the same kernel as in the template, so the result is the template's, bit for bit for a kernel whose per-head
result doesn't depend on the number of heads in the call.

Layout: the sender's copy puts each destination's heads contiguous (``(P, B, S_loc, h, D)``), which with one
sample (B = 1, every Wan call) arrives as the whole sequence for ``h`` heads in BSHD order -- no copy after the
exchange; the output goes back the same way and is copied once into its heads' place. ``P``: the Ulysses degree.

:class:`UlyssesExchange` is the other way to hide the exchange (``--ulysses_async``): not beside attention, whose
persistent kernels hold every SM, but beside the projections, whose GEMMs leave room between their tiles. The model
family's processor (``Family.ulysses_self_attention``) hands Q to the exchange as soon as it is made, then projects
K while Q travels, and so on; and it writes Q and K into the send layout straight from the RoPE, so they take no
layout copy at all.

That leaves two exchanges of every call with nothing beside them: V's (the kernel needs it next) and the output's
(the out-projection needs it next). :func:`vdbench.parallel.interleaved` gives them the other guidance branch's
work instead (``--guidance_overlap``; the two-batch overlap of MoE inference engines, with classifier-free
guidance's two branches as the two batches): the step's two denoiser calls run on two host threads that take turns
at the processor's phase ends (:class:`vdbench.parallel.Baton`), so the GPU's one stream receives, per layer, one
branch's attention, then the other's projections, then the first's out-projection and feed-forward, then the
other's attention... and every exchange travels beside the other branch's GEMMs. Each branch's kernels are the ones it runs alone, on the same
shapes, so its output is the same bit for bit.
"""

from __future__ import annotations

import torch

from ..parallel import turn

__all__ = ["UlyssesExchange", "can_overlap", "overlapped_ulysses"]


def can_overlap(query, key, value, attn_mask, world: int, chunks: int) -> bool:
    """Whether this call can go through :func:`overlapped_ulysses` with ``chunks`` head chunks: no mask, the same
    heads and head dim for Q, K and V, the local heads divisible into the chunks, one sample (B = 1: the exchanged
    buffers are then the kernel's BSHD inputs without a copy)."""
    if attn_mask is not None or chunks < 2 or query.shape[0] != 1:
        return False
    heads = query.shape[2]
    return (key.shape[2] == value.shape[2] == heads and heads % world == 0 and (heads // world) % chunks == 0
            and key.shape[1] == value.shape[1] == query.shape[1])


def _send_layout(x: torch.Tensor, world: int, chunks: int, c: int) -> torch.Tensor:
    """Chunk ``c`` of every destination's heads of the local ``x`` (B, S_loc, H, D), contiguous per destination:
    (P, B, S_loc, h, D)."""
    b, s, h_all, d = x.shape
    h = h_all // world // chunks
    return x.view(b, s, world, chunks, h, d)[:, :, :, c].permute(2, 0, 1, 3, 4).contiguous()


def overlapped_ulysses(query, key, value, group, world: int, chunks: int, attend):
    """Ulysses attention over ``group`` (``world`` ranks) in ``chunks`` head chunks. ``query``/``key``/``value``:
    this rank's sequence shard, BSHD (1, S_loc, H, D). ``attend(q, k, v)``: the kernel on BSHD tensors holding the
    whole sequence for some heads, returning BSHD. Returns this rank's shard of the output, BSHD (1, S_loc, H, D).

    Every exchange is issued asynchronously (NCCL's stream); the compute stream waits for a chunk's inputs only
    when it computes that chunk, so the next chunk's exchange runs beside it."""
    import torch.distributed as dist

    b, s_loc, heads, d = query.shape
    h = heads // world // chunks
    inputs, waits = [], []
    for c in range(chunks):
        got = []
        for x in (query, key, value):
            send = _send_layout(x, world, chunks, c)
            recv = torch.empty_like(send)
            waits.append(dist.all_to_all_single(recv, send, group=group, async_op=True))
            got.append(recv.view(b, world * s_loc, h, d))  # (P, 1, S_loc, h, D): the whole sequence in order
        inputs.append(got)
    outs, out_waits = [], []
    for c in range(chunks):
        for w in waits[3 * c:3 * c + 3]:
            w.wait()
        o = attend(*inputs[c]).contiguous()  # (1, S, h, D) = (P, 1, S_loc, h, D): each destination contiguous
        recv = torch.empty_like(o)
        out_waits.append(dist.all_to_all_single(recv, o, group=group, async_op=True))
        outs.append(recv.view(world, b, s_loc, h, d))
    out = torch.empty_like(query)
    placed = out.view(b, s_loc, world, chunks, h, d)
    for c in range(chunks):
        out_waits[c].wait()
        placed[:, :, :, c].copy_(outs[c].permute(1, 2, 0, 3, 4))  # from rank p: my tokens, p's heads of chunk c
    return out


class UlyssesExchange:
    """The all-to-alls of one Ulysses attention call, each issued when its tensor is ready (B = 1, no mask).

    ``send_buffer(x)``: a send buffer for ``x`` (B, S_loc, H, D) laid out per destination rank, (P, B, S_loc, h, D),
    and a view of it as (B, S_loc, P, h, D) for the producer to write ``x``'s heads into, split by destination (no
    copy after the write); ``start(buf)``: the asynchronous exchange; ``whole(handle)``: wait for it, the whole
    sequence of this rank's ``h`` heads, BSHD (contiguous: the ranks' shards arrive in sequence order);
    ``back_start(out)`` / ``back_wait(handle)``: the attention output (B, S, h, D) sent back to the sequence's
    owners, this rank's tokens for every head, (B, S_loc, H * D): one copy; ``turn()``: a phase's end, where an
    interleaved guidance branch takes over (:func:`vdbench.parallel.interleaved`; nothing outside one)."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world

    def send_buffer(self, x):
        b, s, heads, d = x.shape
        buf = torch.empty((self.world, b, s, heads // self.world, d), dtype=x.dtype, device=x.device)
        # (B, S_loc, H, D) is not one view of buf: the producer writes x split as (B, S_loc, P, h, D)
        return buf, buf.permute(1, 2, 0, 3, 4)

    def start(self, buf):
        import torch.distributed as dist

        recv = torch.empty_like(buf)
        work = dist.all_to_all_single(recv, buf, group=self.group, async_op=True)
        return work, recv, buf  # the send buffer held until the wait: the collective reads it until then

    def whole(self, handle):
        work, recv, _ = handle
        work.wait()
        p, b, s, h, d = recv.shape
        return recv.view(b, p * s, h, d)

    def back_start(self, out):
        """Start sending the attention output (B, S, h, D) back to the sequence's owners; :meth:`back_wait` ends it."""
        import torch.distributed as dist

        send = out.contiguous()  # (B, S, h, D) = (P, B, S_loc, h, D) for B = 1: each owner's tokens contiguous
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return work, recv, send  # the send buffer held until the wait, as in start

    def back_wait(self, handle):
        """This rank's tokens for every head, (B, S_loc, H * D)."""
        work, recv, _ = handle
        work.wait()
        b, s_all, h, d = recv.shape
        s = s_all // self.world
        # from rank p: my tokens for p's heads -> (B, S_loc, P, h, D), heads in order
        return recv.view(self.world, b, s, h, d).permute(1, 2, 0, 3, 4).reshape(b, s, self.world * h * d)

    #: a phase's end: under ``--guidance_overlap`` the other guidance branch's turn
    turn = staticmethod(turn)
