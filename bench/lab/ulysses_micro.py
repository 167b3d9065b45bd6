#!/usr/bin/env python3
"""What one Ulysses self-attention layer's pieces cost, apart, on the real shapes: the kernel, the exchanges, the
layout copies, the projections, and the ways to hide the exchanges behind the kernel.

    torchrun --nproc_per_node=2 bench/lab/ulysses_micro.py -o outputs/ulysses_micro.json       # Wan 1.3B 480p×81

Each rank holds its sequence shard (S / P tokens, all H heads) as under Ulysses; random bf16 inputs (never zeros),
CUDA events around each piece after warm-up, the ranks lined up by a barrier before each sample, median of ``--reps``
samples with p20-p80 (rank 0's clock). Pieces:

* ``attn_whole``: FA3 on the whole sequence for this rank's H / P heads (what the template calls);
  ``attn_12heads_half``: half of FA3's time on all H heads (a one-GPU layer's kernel, halved): the kernel's own
  loss at fewer heads.
* ``attn_rows_split``: the same kernel called once per destination's query rows (P calls, same K/V), and whether the
  output equals the whole call's bit for bit; ``..._margin_M``: each call leaving M SMs to NCCL (FA3's
  ``sm_margin``).
* ``exchange``: one all-to-all of a (P, S / P, H / P, D) tensor (what each of Q, K, V and the output takes).
* ``rows_overlapped_M``: the destinations' rows computed first, each one's output sent (point to point) while the
  next is computed, this rank's own rows last with M SMs left: the output exchange hidden behind the kernel.
  ``serial``: kernel then exchange, the template's order.
* ``copy_v_send`` / ``copy_out_recv``: the layout copies left around the exchanges; ``*_wide``: the same copies on
  8-byte words, as the render makes them (``copy_wide``), with the output's checked against the plain copy.
* ``proj_whole`` / ``proj_per_dest``: the V projection as one GEMM, and as P GEMMs each writing a destination's
  heads straight into the send buffer (and whether the values are the same).
* ``transport``: two carriers of the exchange over the Ulysses group of a diffusers-style device mesh, as a render
  makes it -- NCCL's all-to-all and copies into the peers' memory by the copy engines (:class:`PeerPool` over
  torch's symmetric memory: no SMs, two barriers per exchange): ``transport_equal`` (the copy-engine exchange delivers what
  NCCL's all-to-all does, bit for bit), ``xchg_nccl`` / ``xchg_ce`` alone, ``gemms`` (three projection GEMMs of the
  layer, what an exchange travels beside) alone and ``gemms_beside_nccl`` / ``gemms_beside_ce`` with an exchange
  issued just before.
* ``gather``: the ring form with K and V gathered whole (every rank keeps its own query rows and all H heads):
  ``xchg_a2a_x4`` (Ulysses' four all-to-alls of a layer, issued together) against ``xchg_gather_x2`` (K's and V's
  all-gathers, in place, issued together); ``attn_local_rows`` (FA3 on this rank's S / P query rows, all H heads,
  the whole K and V) and whether it equals those rows of the one-GPU call bit for bit; ``gemms_beside_gather``
  (the three projection GEMMs with one gather issued before them); ``layer_gathered`` (V projected into its gather
  slot and sent, then K, then Q projected while they travel, the kernel, the output projection: no output exchange)
  against ``layer_async``.
* ``remote``: the exchange folded into the kernels that produce it, over torch's symmetric memory (each rank's
  receive buffers mapped into its peers): FA3 writes the other ranks' query rows straight into their output
  buffers (``out=`` a view of the peer's memory; SM stores over NVLink, spread through the kernel) and its own rows
  locally, then one barrier (``o_remote``, against ``serial``, and whether what arrived equals NCCL's exchange bit
  for bit: ``o_remote_equal``); the projections write each destination's heads straight into its receive buffer
  (``proj_remote``, against ``proj_per_dest`` + ``exchange``; ``proj_remote_equal``); ``barrier`` alone; and a whole
  layer in that form (``layer_remote``) against ``layer_async``.

Writes one JSON (rank 0) with the device, the shapes and every piece's spread; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vdbench.helptext import DefaultsHelpFormatter
from vdbench.timing import spread, system_info


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--seq", type=int, default=32760, help="tokens (Wan 1.3B 480p×81: 32760; 14B 720p×81: 75600)")
    p.add_argument("--heads", type=int, default=12, help="attention heads (1.3B: 12, 14B: 40)")
    p.add_argument("--head_dim", type=int, default=128, help="head dimension")
    p.add_argument("--margins", default="8,16,24", help="SMs left to NCCL, comma-separated")
    p.add_argument("--reps", type=int, default=20, help="timed samples per piece")
    p.add_argument("--only", default="", help="comma-separated groups: attn, exchange, copies, layer, ce, transport, "
                   "gather, remote (default: all of them)")
    p.add_argument("--hang_s", type=float, default=0, help="print every thread's Python stack after this many seconds "
                   "(a hang's whereabouts; 0: never)")
    p.add_argument("-o", "--output", default="outputs/ulysses_micro.json", help="the JSON written by rank 0")
    return p.parse_args(argv)


def timed(fn, reps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        xs.append(a.elapsed_time(b))
    return spread(xs)


def attn_pieces(res, fa, q, k, v, q12, k12, v12, args, S, s, P, rank, dev):
    h, D = q.shape[2], q.shape[3]
    res["attn_whole"] = timed(lambda: fa(q, k, v), args.reps)
    t12 = timed(lambda: fa(q12, k12, v12), args.reps)
    res["attn_12heads_half"] = {key: (val / 2 if isinstance(val, float) else val) for key, val in t12.items()}

    whole = fa(q, k, v)
    rows = [slice(p * s, (p + 1) * s) for p in range(P)]

    def by_rows(margin=0):
        return [fa(q[:, r], k, v, margin) for r in rows]

    split = torch.cat(by_rows(), dim=1)
    res["rows_split_equal"] = bool(torch.equal(split, whole))
    res["attn_rows_split"] = timed(by_rows, args.reps)
    margins = [int(m) for m in args.margins.split(",") if m]
    for m in margins:
        res[f"attn_rows_split_margin_{m}"] = timed(lambda m=m: by_rows(m), args.reps)
        res[f"attn_whole_margin_{m}"] = timed(lambda m=m: fa(q, k, v, m), args.reps)



def layer_pieces(res, fa, hs, args, S, s, h, D, P, rank, dev):
    dim = hs.shape[-1]
    # one self-attention layer, projections to output projection: the exchange beside the projections (Q, K, V
    # in that order, the kernel on the whole sequence, the output exchanged after it) against the rows form (V, K,
    # Q; this rank's own query rows, which need no exchange, split in two around the other ranks' rows: the first
    # half hides Q's exchange, the second the output's)
    wq, wk, wv, wo = (torch.nn.Linear(dim, dim, device=dev, dtype=torch.bfloat16).requires_grad_(False)
                      for _ in range(4))

    def sent(x):
        buf = torch.empty(P, 1, s, h, D, device=dev, dtype=torch.bfloat16)
        buf.copy_(x.view(1, s, P, h, D).permute(2, 0, 1, 3, 4))
        recv = torch.empty_like(buf)
        return buf, recv, dist.all_to_all_single(recv, buf, async_op=True)

    def whole_of(handle):
        handle[2].wait()
        return handle[1].view(1, S, h, D)

    def layer_async():
        qh, kh, vh = sent(wq(hs)), sent(wk(hs)), sent(wv(hs))
        o = fa(whole_of(qh), whole_of(kh), whole_of(vh))
        recv = torch.empty_like(o)
        dist.all_to_all_single(recv, o)
        return wo(recv.view(P, 1, s, h, D).permute(1, 2, 0, 3, 4).reshape(1, s, dim))

    others = [p for p in range(P) if p != rank]
    half = s // 2

    def layer_rows(margin):
        vh, kh = sent(wv(hs)), sent(wk(hs))
        qh = sent(wq(hs))
        kk, vv = whole_of(kh), whole_of(vh)
        mine = qh[0][rank]  # (1, s, h, D): my rows of my heads, never exchanged
        out = torch.empty(1, s, P, h, D, device=dev, dtype=torch.bfloat16)
        out[:, :half, rank] = fa(mine[:, :half], kk, vv, margin)
        qh[2].wait()
        send = torch.stack([fa(qh[1][p], kk, vv, margin) for p in others])  # (P-1, 1, s, h, D)
        got = torch.empty_like(send)
        work = dist.all_to_all_single(got, send, [1 if p != rank else 0 for p in range(P)],
                                      [1 if p != rank else 0 for p in range(P)], async_op=True)
        out[:, half:, rank] = fa(mine[:, half:], kk, vv, margin)
        work.wait()
        out[:, :, others] = got.permute(1, 2, 0, 3, 4)
        return wo(out.view(1, s, dim))

    ref_layer = layer_async()
    res["layer_rows_equal"] = bool(torch.equal(layer_rows(0), ref_layer))
    res["layer_async"] = timed(layer_async, args.reps)
    res["layer_rows_0"] = timed(lambda: layer_rows(0), args.reps)


def ce_pieces(res, fa, q, k, v, send, args, s, h, D, P, rank, dev):
    """The exchange as copies into the peers' memory (torch's symmetric memory: copy engines over NVLink, no SMs),
    alone and beside the kernel."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty((P, 1, s, h, D), dtype=torch.bfloat16, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peers = [p for p in range(P) if p != rank]
    remote = {p: hdl.get_buffer(p, (P, 1, s, h, D), torch.bfloat16) for p in peers}
    side = torch.cuda.Stream()

    def put():
        for p in peers:
            remote[p][rank].copy_(send[p])

    res["ce_put"] = timed(put, args.reps)

    def put_barrier():
        put()
        hdl.barrier(channel=0)

    res["ce_put_barrier"] = timed(put_barrier, args.reps)

    def attn_beside_ce():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            put()
        o = fa(q, k, v)
        torch.cuda.current_stream().wait_stream(side)
        return o

    res["attn_beside_ce"] = timed(attn_beside_ce, args.reps)
    put_barrier()
    torch.cuda.synchronize()
    dist.barrier()
    # what each peer wrote into my buffer is that peer's send slot for me
    got = torch.empty(P, 1, s, h, D, device=dev, dtype=torch.bfloat16)
    dist.all_to_all_single(got, send)
    res["ce_equal"] = bool(all(torch.equal(buf[p], got[p]) for p in peers))


class PeerPool:
    """The receive buffers and side streams of the copy-engine exchange over one process group, kept for the
    process: a buffer per (host thread, exchange of the call, shape, dtype), allocated and made symmetric at its
    first use -- a collective, met in the same order on every rank because every rank runs the same code path (the
    interleaved guidance branches too). A buffer is reused by the
    same exchange of the next layer only: the first barrier of that exchange says the peers consumed it.

    ``transport``: the device primitives, :class:`SymmetricMemory` on CUDA; a test gives a stand-in."""

    def __init__(self, transport):
        self.t = transport
        self.rank, self.world = transport.rank, transport.world
        self._buffers: dict = {}

    def exchange(self, slot: int, send):
        """Send ``send`` (P, ...): part ``p`` to rank ``p``; returns (the receive buffer (P, ...), part ``p`` from
        rank ``p`` once the returned event is waited for; the event)."""
        import threading

        key = (threading.get_ident(), slot, tuple(send.shape), send.dtype)
        got = self._buffers.get(key)
        if got is None:
            got = self._buffers[key] = self.t.allocate(tuple(send.shape), send.dtype, send.device)
        recv, peers, barrier = got
        with self.t.side(send.device) as done:
            recv[self.rank].copy_(send[self.rank])
            barrier()
            for step in range(1, self.world):  # each rank starts with its successor: no peer is written by all at once
                p = (self.rank + step) % self.world
                peers[p][self.rank].copy_(send[p])
            barrier()
        return recv, (done, send.device)

    def wait(self, done) -> None:
        self.t.wait(*done)

class SymmetricMemory:
    """:class:`PeerPool`'s primitives on CUDA: torch's symmetric memory (``torch.distributed._symmetric_memory``)
    for the buffers and their barrier, a side stream per host thread for the copies."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group_name = group.group_name
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._streams: dict = {}

    def allocate(self, shape, dtype, device):
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(shape, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buf, self.group_name)
        peers = [buf if p == self.rank else handle.get_buffer(p, shape, dtype) for p in range(self.world)]
        return buf, peers, lambda: handle.barrier(channel=0)

    def side(self, device):
        """A context on this thread's side stream of ``device``, which first waits for the compute stream (the
        thread's current one: an interleaved branch's thread shares its caller's); yields the event recorded at its
        end."""
        from contextlib import contextmanager
        import threading

        stream = self._streams.get(threading.get_ident())
        if stream is None:
            stream = self._streams[threading.get_ident()] = torch.cuda.Stream(device=device)

        @contextmanager
        def on_side():
            compute = torch.cuda.current_stream(device)
            stream.wait_stream(compute)
            done = torch.cuda.Event()
            with torch.cuda.stream(stream):
                yield done
                done.record(stream)

        return on_side()

    @staticmethod
    def wait(done, device) -> None:
        torch.cuda.current_stream(device).wait_event(done)


def transport_pieces(res, args, s, h, D, P, rank, dev, dim, rnd):
    """The exchange carried by NCCL and by the copy engines (:class:`PeerPool`), alone and beside the
    projections' GEMMs, over a diffusers-style mesh's Ulysses group."""
    from torch.distributed.device_mesh import init_device_mesh

    group = init_device_mesh("cuda", (1, P), mesh_dim_names=("ring", "ulysses"))["ulysses"].get_group()
    send = rnd(P, 1, s, h, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    print(f"rank {rank}: nccl exchange done", flush=True)
    pool = PeerPool(SymmetricMemory(group))
    got, done = pool.exchange(0, send)
    print(f"rank {rank}: copy-engine exchange issued", flush=True)
    pool.wait(done)
    torch.cuda.synchronize()
    print(f"rank {rank}: copy-engine exchange done", flush=True)
    res["transport_equal"] = bool(torch.equal(got, recv))

    def nccl():
        dist.all_to_all_single(recv, send, group=group, async_op=True).wait()

    def ce():
        pool.wait(pool.exchange(0, send)[1])

    res["xchg_nccl"] = timed(nccl, args.reps)
    res["xchg_ce"] = timed(ce, args.reps)
    x = rnd(s, dim)
    ws = [rnd(dim, dim) for _ in range(3)]

    def gemms():
        for w in ws:
            x @ w

    res["gemms"] = timed(gemms, args.reps)

    def beside(start):
        def run():
            handle = start()
            gemms()
            handle()
        return run

    def start_nccl():
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        return work.wait

    def start_ce():
        _, d = pool.exchange(0, send)
        return lambda: pool.wait(d)

    res["gemms_beside_nccl"] = timed(beside(start_nccl), args.reps)
    res["gemms_beside_ce"] = timed(beside(start_ce), args.reps)


def gather_pieces(res, fa, hs, q12, k12, v12, args, S, s, H, D, P, rank, dev, rnd):
    """The ring form with K and V all-gathered whole against Ulysses' all-to-alls, on one layer's shapes."""
    dim = H * D
    h = H // P
    sends = [rnd(P, 1, s, h, D) for _ in range(4)]
    recvs = [torch.empty_like(x) for x in sends]
    kv = [rnd(1, S, H, D) for _ in range(2)]  # each rank's slot [rank * s, (rank + 1) * s) is its own

    def a2a_x4():
        for w in [dist.all_to_all_single(r, x, async_op=True) for r, x in zip(recvs, sends)]:
            w.wait()

    def gather_x2():
        for w in [dist.all_gather_into_tensor(x, x[:, rank * s:(rank + 1) * s], async_op=True) for x in kv]:
            w.wait()

    res["xchg_a2a_x4"] = timed(a2a_x4, args.reps)
    res["xchg_gather_x2"] = timed(gather_x2, args.reps)
    mine = slice(rank * s, (rank + 1) * s)
    res["attn_local_rows"] = timed(lambda: fa(q12[:, mine], k12, v12), args.reps)
    res["attn_local_rows_equal"] = bool(torch.equal(fa(q12[:, mine], k12, v12), fa(q12, k12, v12)[:, mine]))
    x = rnd(s, dim)
    ws = [rnd(dim, dim) for _ in range(3)]

    def gemms():
        for w in ws:
            x @ w

    def beside_gather():
        work = dist.all_gather_into_tensor(kv[0], kv[0][:, mine], async_op=True)
        gemms()
        work.wait()

    res["gemms_beside_gather"] = timed(beside_gather, args.reps)
    wq, wk, wv, wo = (torch.nn.Linear(dim, dim, device=dev, dtype=torch.bfloat16).requires_grad_(False)
                      for _ in range(4))

    def layer_gathered():
        k_all, v_all = (torch.empty(1, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        torch.addmm(wv.bias, hs[0], wv.weight.t(), out=v_all[0, mine].view(s, dim))
        wv_ = dist.all_gather_into_tensor(v_all, v_all[:, mine], async_op=True)
        torch.addmm(wk.bias, hs[0], wk.weight.t(), out=k_all[0, mine].view(s, dim))
        wk_ = dist.all_gather_into_tensor(k_all, k_all[:, mine], async_op=True)
        qq = wq(hs).view(1, s, H, D)
        wk_.wait()
        wv_.wait()
        return wo(fa(qq, k_all, v_all).reshape(1, s, dim))

    res["layer_gathered"] = timed(layer_gathered, args.reps)


def remote_pieces(res, hs, q, k, v, args, S, s, H, D, P, rank, dev):
    """The exchange as remote stores by the producing kernels (symmetric memory), against NCCL's."""
    import torch.distributed._symmetric_memory as symm_mem

    def _flash_attn_forward(qq, kk, vv, out_=None):
        """FA3's forward op with its output written into ``out_`` (the interface's custom op refuses an output
        that aliases a given tensor, so its registered op is called as the interface calls it)."""
        return torch.ops.fa3_fwd.fwd(qq, kk, vv, None, None, None, out_, *([None] * 16), qq.shape[-1] ** -0.5,
                                     False, -1, -1, 0, 0.0, True, None, 1, None, 0)

    h, dim = H // P, H * D
    group = dist.group.WORLD.group_name
    bf = torch.bfloat16

    def symmetric(shape):
        buf = symm_mem.empty(shape, dtype=bf, device=dev)
        hdl = symm_mem.rendezvous(buf, group)
        return buf, hdl, [buf if p == rank else hdl.get_buffer(p, shape, bf) for p in range(P)]

    obuf, ohdl, opeer = symmetric((1, s, H, D))  # my tokens, every head: slot r's heads written by rank r
    rows = [slice(p * s, (p + 1) * s) for p in range(P)]

    def attend_to_owners(qq, kk, vv):
        """FA3 on each rank's query rows, written into that rank's output buffer (the other ranks' rows first, this
        rank's own last, locally: ``opeer[rank]`` is ``obuf``), then the barrier that makes them visible."""
        for i in range(1, P + 1):
            p = (rank + i) % P
            _flash_attn_forward(qq[:, rows[p]], kk, vv, out_=opeer[p][:, :, rank * h:(rank + 1) * h])
        ohdl.barrier(channel=0)

    attend_to_owners(q, k, v)
    torch.cuda.synchronize()
    dist.barrier()
    whole = _flash_attn_forward(q, k, v)[0].contiguous()  # (1, S, h, D) = (P, 1, s, h, D)
    got = torch.empty_like(whole)
    dist.all_to_all_single(got, whole)
    res["o_remote_equal"] = bool(torch.equal(obuf.view(1, s, P, h, D), got.view(P, 1, s, h, D).permute(1, 2, 0, 3, 4)))
    res["o_remote"] = timed(lambda: attend_to_owners(q, k, v), args.reps)
    res["barrier"] = timed(lambda: ohdl.barrier(channel=0), args.reps)

    # Q, K, V: each destination's heads written straight into its receive buffer (the whole sequence of its heads)
    recv, rhdl, rpeer = symmetric((3, P, s, h * D))
    lins = [torch.nn.Linear(dim, dim, device=dev, dtype=bf).requires_grad_(False) for _ in range(4)]
    x = hs[0]

    def proj_remote():
        for j in range(3):
            w, b = lins[j].weight.view(P, h * D, dim), lins[j].bias.view(P, h * D)
            for i in range(1, P + 1):
                p = (rank + i) % P  # own heads last
                torch.addmm(b[p], x, w[p].t(), out=rpeer[p][j, rank])
        rhdl.barrier(channel=0)

    proj_remote()
    torch.cuda.synchronize()
    dist.barrier()
    ok = True
    for j in range(3):
        full = lins[j](hs).view(1, s, P, h * D).permute(2, 0, 1, 3).contiguous()  # (P, 1, s, hD): per destination
        arrived = torch.empty_like(full)
        dist.all_to_all_single(arrived, full)
        ok = ok and bool(torch.equal(recv[j], arrived.view(P, s, h * D)))
    res["proj_remote_equal"] = ok
    res["proj_remote"] = timed(proj_remote, args.reps)
    wo = lins[3]

    def layer_remote():
        proj_remote()
        attend_to_owners(*(recv[j].view(1, S, h, D) for j in range(3)))
        return wo(obuf.view(1, s, dim))

    res["layer_remote"] = timed(layer_remote, args.reps)


def reported(res: dict, group: str, pieces, *args) -> None:
    """``pieces(*args)``, where a group that can't run here (no symmetric memory, no peer access) is reported as
    ``<group>_error`` and the other groups go on."""
    try:
        pieces(*args)
    except Exception as exc:  # noqa: BLE001 - a piece that can't run here is reported, the others go on
        res[f"{group}_error"] = f"{type(exc).__name__}: {exc}"[:300]


def main(argv=None) -> int:
    args = parse(argv)
    if args.hang_s > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.hang_s, exit=True)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    from vdbench.backends.flash import _fa3_module

    fa3 = _fa3_module()
    from fa3_fwd_interface import _flash_attn_forward  # noqa: F401  (checks the low-level entry exists)

    S, H, D, P = args.seq, args.heads, args.head_dim, world
    s, h = S // P, H // P
    dim = H * D
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = rnd(1, S, h, D), rnd(1, S, h, D), rnd(1, S, h, D)
    q12, k12, v12 = rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, H, D)
    res: dict = {}

    def fa(qq, kk, vv, margin=0):
        out = fa3.flash_attn_func(qq, kk, vv, sm_margin=margin)
        return out[0] if isinstance(out, tuple) else out

    want = lambda group: not args.only or group in args.only.split(",")  # noqa: E731
    if want("attn"):
        attn_pieces(res, fa, q, k, v, q12, k12, v12, args, S, s, P, rank, dev)
    margins = [int(m) for m in args.margins.split(",") if m]
    rows = [slice(p * s, (p + 1) * s) for p in range(P)]
    send = rnd(P, 1, s, h, D)
    recv = torch.empty_like(send)
    if want("exchange"):
        res["exchange"] = timed(lambda: dist.all_to_all_single(recv, send), args.reps)

        def serial():
            o = fa(q, k, v)
            r = torch.empty_like(o)
            dist.all_to_all_single(r, o)
            return r

        res["serial"] = timed(serial, args.reps)
        # the other ranks' rows first (rank + 1, rank + 2, ...), each sent as soon as it is computed; own rows last
        order = [(rank + i) % P for i in range(1, P)]

        def overlapped(margin):
            got = torch.empty(P, 1, s, h, D, device=dev, dtype=torch.bfloat16)  # from each rank: my rows, its heads
            works = []
            for i, dst in enumerate(order):
                o = fa(q[:, rows[dst]], k, v, margin)
                src = (rank - 1 - i) % P
                ops = [dist.P2POp(dist.isend, o, dst), dist.P2POp(dist.irecv, got[src], src)]
                works += dist.batch_isend_irecv(ops)
            got[rank].copy_(fa(q[:, rows[rank]], k, v, margin))
            for w in works:
                w.wait()
            return got

        for m in [0] + margins:
            res[f"rows_overlapped_{m}"] = timed(lambda m=m: overlapped(m), args.reps)

        def attn_beside_nccl():  # the kernel with an all-to-all of the same size issued just before, on NCCL's stream
            work = dist.all_to_all_single(recv, send, async_op=True)
            o = fa(q, k, v)
            work.wait()
            return o

        res["attn_beside_nccl"] = timed(attn_beside_nccl, args.reps)

    if want("ce"):
        reported(res, "ce", ce_pieces, res, fa, q, k, v, send, args, s, h, D, P, rank, dev)

    if want("transport"):
        reported(res, "transport", transport_pieces, res, args, s, h, D, P, rank, dev, dim, rnd)

    hs = rnd(1, s, dim)
    if want("copies"):
        x = rnd(1, s, H, D)
        buf = torch.empty(P, 1, s, h, D, device=dev, dtype=torch.bfloat16)
        res["copy_v_send"] = timed(lambda: buf.copy_(x.view(1, s, P, h, D).permute(2, 0, 1, 3, 4)), args.reps)
        res["copy_out_recv"] = timed(lambda: buf.permute(1, 2, 0, 3, 4).reshape(1, s, dim), args.reps)
        # the same two copies on 8-byte words (vdbench.patching.ulysses.copy_wide: what the render runs)
        from vdbench.patching.ulysses import copy_wide

        res["copy_v_send_wide"] = timed(
            lambda: copy_wide(buf.permute(1, 2, 0, 3, 4), x.view(1, s, P, h, D)), args.reps)
        out = torch.empty(1, s, dim, device=dev, dtype=torch.bfloat16)
        res["copy_out_recv_wide"] = timed(
            lambda: copy_wide(out.view(1, s, P, h * D), buf.view(P, 1, s, h * D).permute(1, 2, 0, 3)), args.reps)
        res["copy_out_recv_wide_equal"] = bool(torch.equal(out, buf.permute(1, 2, 0, 3, 4).reshape(1, s, dim)))
        lin = torch.nn.Linear(dim, dim, device=dev, dtype=torch.bfloat16).requires_grad_(False)
        res["proj_whole"] = timed(lambda: lin(hs), args.reps)
        sendv = torch.empty(P, s, dim // P, device=dev, dtype=torch.bfloat16)
        w_parts = lin.weight.view(P, dim // P, dim)
        b_parts = lin.bias.view(P, dim // P)

        def per_dest():
            for p in range(P):
                torch.addmm(b_parts[p], hs[0], w_parts[p].t(), out=sendv[p])

        res["proj_per_dest"] = timed(per_dest, args.reps)
        per_dest()
        ref = lin(hs)[0].view(s, P, dim // P).permute(1, 0, 2)
        res["proj_per_dest_equal"] = bool(torch.equal(sendv, ref))

    if want("layer"):
        layer_pieces(res, fa, hs, args, S, s, h, D, P, rank, dev)

    if want("remote"):
        reported(res, "remote", remote_pieces, res, hs, q, k, v, args, S, s, H, D, P, rank, dev)

    if want("gather"):
        gather_pieces(res, fa, hs, q12, k12, v12, args, S, s, H, D, P, rank, dev, rnd)

    if rank == 0:
        out = {"device": system_info(dev), "world": P, "shape": {"S": S, "H": H, "D": D}, "pieces": res}
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))
        for key, val in res.items():
            if isinstance(val, dict):
                print(f"{key:32s} {val['median']:9.3f} ms  [{val['p20']:.3f}-{val['p80']:.3f}] n={val['n']}")
            else:
                print(f"{key:32s} {val}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
