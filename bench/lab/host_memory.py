#!/usr/bin/env python3
"""How fast does this machine make pinned host memory, and copy through it? What ``vdbench.hostmem`` does, by parts.

    python3 bench/lab/host_memory.py            # 8 GiB
    python3 bench/lab/host_memory.py --gib 28 --repeat 1

For ``--gib`` GiB, each on fresh pages (a new ``torch.empty``), host clock unless said:

* ``fault_1_thread`` / ``fault_threads``: one byte written a page (``vdbench.hostmem.fault``), one thread / a pool;
* ``fault_threads_hugepages``: the same after ``madvise(MADV_HUGEPAGE)`` on the range (the kernel's transparent
  huge pages setting is recorded: in ``madvise`` mode only this asks for them);
* ``fault_torch_zero``: torch's own parallel fill (``zero_()``, its intra-op threads, every byte written);
* ``register_faulted``: ``cudaHostRegister`` of the threaded-faulted buffer (and ``unregister``);
* ``register_unfaulted``: ``cudaHostRegister`` of a buffer never touched (the driver maps its pages itself);
* ``register_gil_free``: the share of a register's time (on a thread) the main thread ran Python in (its loop's
  turns against its rate alone): near 1, the register lets go of the GIL; near 0, a load's imports stall behind it;
* ``pin_memory_empty``: ``torch.empty(pin_memory=True)`` of the same size (torch's caching host allocator);
* ``host_buffer`` / ``host_buffer_hugepages``: ``vdbench.hostmem.HostBuffer`` made as a render makes it (1 GiB
  chunks, each faulted in by the pool then registered), its parts' seconds;
* ``h2d`` / ``d2h``: copy rate between the registered buffer and the GPU (CUDA events): one copy of it all, and the
  same in 256 MiB copies.

Prints one JSON line: each measure's seconds per repetition and its GB/s (1e9 bytes a second) at the best one.
Needs CUDA for the register and copy parts (on a CPU: the fault parts only, and it says so).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

from vdbench import hostmem
from vdbench.timing import system_info  # noqa: E402

def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fresh(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


def _gil_free(buf: torch.Tensor) -> dict:
    """Register ``buf`` on a thread while this one counts loop turns: many turns, the GIL was let go."""
    done = threading.Event()
    ticks = 0

    def register():
        hostmem.pin(buf)
        done.set()

    start = time.perf_counter()
    while time.perf_counter() - start < 0.2:  # the loop's rate alone
        ticks += 1
    rate, ticks = ticks / (time.perf_counter() - start), 0
    t = threading.Thread(target=register)
    start = time.perf_counter()
    t.start()
    while not done.is_set():
        ticks += 1
    t.join()
    seconds = time.perf_counter() - start
    hostmem.unpin(buf)
    return {"seconds": round(seconds, 4), "main_thread_share": round(ticks / rate / seconds, 3)}


def _copy_rates(buf: torch.Tensor, device, chunk: int) -> dict:
    gpu = torch.empty(buf.numel(), dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"h2d": (gpu, buf), "d2h": (buf, gpu)}.items():
        for label, step in (("one_copy", buf.numel()), (f"{chunk >> 20}MiB_copies", chunk)):
            dst[:step].copy_(src[:step], non_blocking=True)  # warm
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(0, buf.numel(), step):
                dst[i:i + step].copy_(src[i:i + step], non_blocking=True)
            b.record()
            b.synchronize()
            s = a.elapsed_time(b) / 1e3
            out[f"{name}_{label}"] = {"seconds": round(s, 4), "GB_s": round(buf.numel() / s / 1e9, 2)}
    del gpu
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="buffer size, GiB (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=2, help="repetitions of each host measure (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="fault threads (default: hostmem's, a core each, <=16)")
    ap.add_argument("--chunk_mib", type=int, default=256, help="the chunked copies' size, MiB (default: %(default)s)")
    args = ap.parse_args(argv)
    size = int(args.gib * (1 << 30))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else None
    if cuda:
        torch.empty(0, device=device)  # the context, outside every measure
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = None
    times: dict = {}

    def add(name, seconds):
        times.setdefault(name, []).append(round(seconds, 4))

    threads_used = None
    for _ in range(args.repeat):
        buf = _fresh(size)
        add("fault_1_thread", _timed(lambda: hostmem.fault(buf, 1)))
        del buf
        buf = _fresh(size)
        start = time.perf_counter()
        threads_used = hostmem.fault(buf, args.threads)
        add("fault_threads", time.perf_counter() - start)
        del buf
        buf = _fresh(size)
        advice = hostmem.advise_huge_pages(buf)
        add("fault_threads_hugepages", _timed(lambda: hostmem.fault(buf, args.threads)))
        del buf
        buf = _fresh(size)
        add("fault_torch_zero", _timed(buf.zero_))
        del buf
        if not cuda:
            continue
        buf = _fresh(size)
        hostmem.fault(buf, args.threads)
        add("register_faulted", _timed(lambda: hostmem.pin(buf)))
        add("unregister", _timed(lambda: hostmem.unpin(buf)))
        del buf
        buf = _fresh(size)
        add("register_unfaulted", _timed(lambda: hostmem.pin(buf)))
        hostmem.unpin(buf)
        del buf
        add("pin_memory_empty", _timed(lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True)))
        torch._C._host_emptyCache()  # each repetition's pinned allocation a fresh one
    result = {"tool": "host_memory", "bytes": size, "fault_threads": threads_used, "transparent_hugepage": thp,
              "madvise_hugepage_taken": advice,
              "measures": {k: {"seconds": v, "GB_s": round(size / min(v) / 1e9, 2)} for k, v in times.items()}}
    for huge in (False, True):  # the path a render takes: vdbench.hostmem.HostBuffer, chunk by chunk
        made = hostmem.HostBuffer(size, pinned=cuda, threads=args.threads, huge_pages=huge)
        result[f"host_buffer{'_hugepages' if huge else ''}"] = made.parts
        made.close()
        del made
    if cuda:
        buf = _fresh(size)
        result["register_gil_free"] = _gil_free(buf)
        hostmem.fault(buf, args.threads)
        hostmem.pin(buf)
        result["copies"] = _copy_rates(buf, device, args.chunk_mib << 20)
        hostmem.unpin(buf)
    else:
        result["note"] = "no CUDA device: the fault measures only"
    result["system"] = system_info(device or "cpu")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
