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
(the out-projection needs it next). V's gets a GEMM of its own call beside it: V is projected per destination
(:meth:`UlyssesExchange.send_projected`), the other ranks' heads first and sent, then this rank's own heads, which
never travel, while they do. :func:`vdbench.parallel.interleaved` gives them the other guidance branch's
work instead (``--guidance_overlap``; the two-batch overlap of MoE inference engines, with classifier-free
guidance's two branches as the two batches): the step's two denoiser calls run on two host threads that take turns
at the processor's phase ends (:class:`vdbench.parallel.Baton`), so the GPU's one stream receives, per layer, one
branch's attention, then the other's projections, then the first's out-projection and feed-forward, then the
other's attention... and every exchange travels beside the other branch's GEMMs. Each branch's kernels are the ones
it runs alone, on the same shapes, so its output is the same bit for bit.

:class:`Fp8Exchange` (``--ulysses_fp8_exchange``) shrinks those two instead: V and the output cross as e4m3 rows with
a scale each, quantized inside the layout copies they take anyway; lossy, so off by default.
"""

from __future__ import annotations

import torch

from ..parallel import turn

__all__ = ["UlyssesExchange", "Fp8Exchange", "can_overlap", "overlapped_ulysses", "copy_wide"]


def _as_words(t: torch.Tensor):
    """``t``'s bytes as int64 words along its last dimension (a bf16 row of 768 as 192 words), or None where the
    last dimension isn't contiguous whole words."""
    size = t.element_size()
    if size >= 8 or (t.shape[-1] * size) % 8 or t.stride(-1) != 1 or (t.storage_offset() * size) % 8 or any(
            (st * size) % 8 for st in t.stride()[:-1]):
        return None
    return t.view(torch.int64)


def copy_wide(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a permuting copy of one dtype, done on 8-byte words where both tensors' rows are whole
    words: the same bytes, bit for bit, in a quarter of the elements (bf16) -- a strided copy's kernel moves one
    element per lane, so wider elements move the same bytes several times faster. Any other pair: ``copy_``."""
    if dst.dtype == src.dtype and dst.shape == src.shape:
        wd, ws = _as_words(dst), _as_words(src)
        if wd is not None and ws is not None:
            wd.copy_(ws)
            return dst
    return dst.copy_(src)


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
    src = x.view(b, s, world, chunks, h, d)[:, :, :, c].permute(2, 0, 1, 3, 4)
    return copy_wide(torch.empty(src.shape, dtype=x.dtype, device=x.device), src)


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
        copy_wide(placed[:, :, :, c], outs[c].permute(1, 2, 0, 3, 4))  # from rank p: my tokens, p's heads of chunk c
    return out


class _Placed(tuple):
    """:meth:`UlyssesExchange.send_projected`'s exchange in flight: (work, the whole receive buffer (P, B, S_loc, h,
    D), the send buffer held until the wait); ``apart``: for a rank whose slot lies between its peers', (where the
    peers' slots arrived, this rank's index), placed by :meth:`UlyssesExchange.whole`."""

    def __new__(cls, work, recv, send, apart):
        out = super().__new__(cls, (work, recv, send))
        out.apart = apart
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

    def __init__(self, group, world: int, v_per_rank: bool = True):
        self.group, self.world, self.v_per_rank = group, world, v_per_rank

    def send_projected(self, linear, hidden_states, heads: int):
        """Start exchanging ``linear(hidden_states)`` (B, S_loc, H * D; V, which nothing transforms before the
        exchange) with its heads made per destination rank (``v_per_rank``): the other ranks' heads first, each
        projected straight into its send slot (no layout copy) and sent, then this rank's own heads projected
        straight into their place in the receive buffer while the others travel -- they never cross the wire, so
        the exchange that nothing hides loses its own share's copy and has a GEMM beside it. Each head's values
        are the same projection's (the weight's rows for those heads, the same ``addmm`` as ``nn.Linear``);
        :meth:`whole` ends it. Falls back to :meth:`send` of the whole projection where the projection is not a
        plain ``nn.Linear`` (a quantized or wrapped one) or B > 1."""
        import torch.distributed as dist

        b, s, c = hidden_states.shape
        if (not self.v_per_rank or type(linear) is not torch.nn.Linear or b != 1 or torch.is_autocast_enabled()
                or type(linear.weight) not in (torch.Tensor, torch.nn.Parameter)  # a quantized weight's subclass
                or linear.weight.dtype != hidden_states.dtype
                or (torch.is_grad_enabled() and linear.weight.requires_grad)):  # out= has no autograd
            return self.send(linear(hidden_states).unflatten(2, (heads, -1)))
        p_all, me = self.world, dist.get_rank(self.group)
        rows = linear.weight.shape[0] // p_all  # this destination's heads x D
        x = hidden_states.reshape(s, c)
        kwargs = dict(dtype=hidden_states.dtype, device=hidden_states.device)
        whole = torch.empty((p_all, s, rows), **kwargs)  # the whole sequence of this rank's heads, rank order
        # the peers' slots of the receive buffer are one run where this rank's slot is at an end (any rank of 2)
        ends = me in (0, p_all - 1)
        recv = (whole[1:] if me == 0 else whole[:-1]) if ends else torch.empty((p_all - 1, s, rows), **kwargs)
        send = torch.empty((p_all - 1, s, rows), **kwargs)
        peers = [q for q in range(p_all) if q != me]

        def project(q, out):
            w = linear.weight[q * rows:(q + 1) * rows]
            if linear.bias is None:
                torch.mm(x, w.t(), out=out)
            else:
                torch.addmm(linear.bias[q * rows:(q + 1) * rows], x, w.t(), out=out)

        for i, q in enumerate(peers):
            project(q, send[i])
        splits = [0 if q == me else s * rows for q in range(p_all)]
        work = dist.all_to_all_single(recv.view(-1), send.view(-1), splits, splits, group=self.group,
                                      async_op=True)
        project(me, whole[me])
        d = rows // (heads // p_all)
        return _Placed(work, whole.view(p_all, 1, s, rows // d, d), send, None if ends else (recv, me))

    def send_buffer(self, x):
        b, s, heads, d = x.shape
        buf = torch.empty((self.world, b, s, heads // self.world, d), dtype=x.dtype, device=x.device)
        # (B, S_loc, H, D) is not one view of buf: the producer writes x split as (B, S_loc, P, h, D)
        return buf, buf.permute(1, 2, 0, 3, 4)

    def send(self, x):
        """Start exchanging ``x`` (B, S_loc, H, D) as it is (one layout copy into the send buffer); :meth:`whole`
        ends it."""
        buf, dst = self.send_buffer(x)
        copy_wide(dst, x.unflatten(2, dst.shape[2:4]))
        return self.start(buf)

    def start(self, buf):
        import torch.distributed as dist

        recv = torch.empty_like(buf)
        work = dist.all_to_all_single(recv, buf, group=self.group, async_op=True)
        return work, recv, buf  # the send buffer held until the wait: the collective reads it until then

    def whole(self, handle):
        work, recv, _ = handle
        work.wait()
        if isinstance(handle, _Placed) and handle.apart is not None:  # a middle rank: the peers' slots around its own
            arrived, me = handle.apart
            recv[:me].copy_(arrived[:me].view(recv[:me].shape))
            recv[me + 1:].copy_(arrived[me:].view(recv[me + 1:].shape))
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
        # from rank p: my tokens for p's heads -> (B, S_loc, P, h * D), heads in order
        out = torch.empty((b, s, self.world * h * d), dtype=recv.dtype, device=recv.device)
        copy_wide(out.view(b, s, self.world, h * d), recv.view(self.world, b, s, h * d).permute(1, 2, 0, 3))
        return out

    #: a phase's end: under ``--guidance_overlap`` the other guidance branch's turn
    turn = staticmethod(turn)


class _Fp8Handle:
    """An exchange in flight as e4m3 rows and their scales, one packed byte buffer per destination; ``send`` is held
    until the wait, as in :meth:`UlyssesExchange.start` (the collective reads it until then)."""

    def __init__(self, work, recv, send, shape, dtype):
        self.work, self.recv, self.send, self.shape, self.dtype = work, recv, send, shape, dtype


class Fp8Exchange(UlyssesExchange):
    """:class:`UlyssesExchange` with V and the attention output crossing as e4m3 (``--ulysses_fp8_exchange``): the
    two exchanges nothing hides (the kernel needs V next, the out-projection the output) at half their bytes. Each
    (token, head) row of ``D`` values gets its own fp32 scale (amax / 448); the rows and their scales travel in
    one byte buffer per destination, so it is still one all-to-all. The quantization is the layout copy the
    exchange needed anyway (``vdbench.kernels.exchange_fp8``): V goes from the projection into the send layout
    as e4m3, and the output is dequantized straight into this rank's tokens with every head in order. Q and K
    travel beside the projections in the model's dtype. The output is no longer the one-GPU render's bit for bit:
    its quality against that render is what the option costs."""

    def _packed(self, x5, dtype):
        """Quantize ``x5`` (P, B, S, h, D view, row per (token, head)) into a packed send buffer and start its
        exchange."""
        from ..kernels.exchange_fp8 import quantize_rows
        import torch.distributed as dist

        p, b, s, h, d = x5.shape
        buf = torch.empty((p, self._data_bytes(b * s * h * d) + 4 * b * s * h), dtype=torch.uint8, device=x5.device)
        data, scale = self._views(buf, (b, s, h, d))
        quantize_rows(x5, data, scale)
        recv = torch.empty_like(buf)
        work = dist.all_to_all_single(recv, buf, group=self.group, async_op=True)
        return _Fp8Handle(work, recv, buf, (b, s, h, d), dtype)

    @staticmethod
    def _data_bytes(n: int) -> int:
        """The rows' bytes in a packed buffer, rounded up to 4 so the fp32 scales after them are aligned."""
        return (n + 3) // 4 * 4

    @classmethod
    def _views(cls, buf, shape):
        """(e4m3 rows (P, B, S, h, D), fp32 scales (P, B, S, h)) of a packed buffer."""
        b, s, h, d = shape
        n = b * s * h * d
        p = buf.shape[0]
        return (buf[:, :n].view(torch.float8_e4m3fn).view(p, b, s, h, d),
                buf[:, cls._data_bytes(n):].view(torch.float32).view(p, b, s, h))

    def send_projected(self, linear, hidden_states, heads: int):
        """V quantized from the whole projection (the quantization is its layout copy)."""
        return self.send(linear(hidden_states).unflatten(2, (heads, -1)))

    def send(self, x):
        b, s, heads, d = x.shape
        return self._packed(x.view(b, s, self.world, heads // self.world, d).permute(2, 0, 1, 3, 4), x.dtype)

    def whole(self, handle):
        if not isinstance(handle, _Fp8Handle):  # Q and K: sent in the model's dtype
            return super().whole(handle)
        b, s, h, d = handle.shape
        # from rank p: its tokens of my heads -> the whole sequence in rank order, BSHD
        return self._unpacked(handle, (b, self.world * s, h, d),
                              lambda out: out.view(b, self.world, s, h, d).permute(1, 0, 2, 3, 4))

    def back_start(self, out):
        b, s_all, h, d = out.shape
        s = s_all // self.world
        return self._packed(out.view(b, self.world, s, h, d).permute(1, 0, 2, 3, 4), out.dtype)

    def back_wait(self, handle):
        b, s, h, d = handle.shape
        # from rank p: my tokens for p's heads -> (B, S_loc, P, h, D), heads in order
        return self._unpacked(handle, (b, s, self.world * h * d),
                              lambda out: out.view(b, s, self.world, h, d).permute(2, 0, 1, 3, 4))

    def _unpacked(self, handle, shape, placed):
        """Wait for ``handle``'s exchange and dequantize what arrived into a new tensor of ``shape`` (the model's
        dtype), each source rank's rows where ``placed(out)`` (a (P, B, S, h, D) view of it) puts them."""
        from ..kernels.exchange_fp8 import dequantize_rows

        handle.work.wait()
        data, scale = self._views(handle.recv, handle.shape)
        out = torch.empty(shape, dtype=handle.dtype, device=data.device)
        dequantize_rows(data, scale, placed(out))
        return out
