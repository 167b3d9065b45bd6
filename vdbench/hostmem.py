"""Host memory for weights that travel between the host and a GPU: one flat buffer per set of weights, its pages
faulted in by several threads at once, then pinned (page-locked) in place where a CUDA device is there, and each
weight an aligned view of it.

Why not one ``torch.empty(..., pin_memory=True)`` per weight: torch's caching host allocator rounds each allocation
up to a power of two (up to twice the weights' bytes) and maps each one's pages in on one thread; a fresh page costs
a fault, and one thread faults a few GB/s at most. Here the buffer is pageable first (``torch.empty``), its pages
touched by a pool of threads (one byte a page each, in numpy, which lets go of the GIL), then registered with the
CUDA driver (``cudaHostRegister``), which pins what is already mapped (H200 host: threads fault about 20 GB/s
against 1.7 on one; registering faulted pages about 16 GB/s; bench/lab/host_memory.py), the whole buffer in one
registration: a copy may not span two. :class:`HostBuffer` records each part's seconds, so a render's record
shows where the host's time went. On a machine without CUDA the buffer is not pinned: it is the host copy as is.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Optional

import torch

__all__ = ["ALIGN", "CHUNK", "HOST_BUFFER", "HUGE_PAGES", "HostBuffer", "layout", "nbytes", "weights", "cores",
           "fault", "advise_huge_pages", "pin", "unpin", "move_into", "held", "HostMemoryError", "available",
           "check_room", "block_list"]

#: Each weight's offset in a buffer is a multiple of this (what a copy engine and every dtype's view want).
ALIGN = 256

#: The attribute of a module whose weights are views of a :class:`HostBuffer` (that buffer).
HOST_BUFFER = "vdbench_host_buffer"

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_HUGE, _MADV_HUGEPAGE = 2 << 20, 14

#: Whether a buffer asks for huge pages before its fault: a fault a 2 MiB page (several times fewer, faster where
#: the kernel has them free), but a kernel short of them compacts memory first, which can cost more than it saves:
#: ``bench/lab/host_memory.py`` measures both on a machine.
HUGE_PAGES = False

#: A buffer is made (faulted in, pinned) this many bytes at a time, so that copies into it start behind the first.
CHUNK = 1 << 30


class HostMemoryError(ValueError):
    """Host buffers that would not fit in the host's available memory (refused before any is made)."""


def available() -> Optional[int]:
    """The host's available memory in bytes (``MemAvailable`` of /proc/meminfo, which counts what the kernel can
    reclaim), or None where the system doesn't say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


#: The share of the available memory host buffers may take: the rest is the process's own (torch, the loader's
#: copies, the frames) and the system's; past it the kernel's OOM killer ends the render without a word.
ROOM = 0.9


def check_room(sizes: dict, what: str, hint: str) -> None:
    """Refuse host buffers of ``sizes`` (name -> bytes) together over :data:`ROOM` of :func:`available`, with a
    one-line reason naming ``what`` asks for them and ``hint`` on the next line; nothing is allocated here."""
    need, have = sum(sizes.values()), available()
    if have is not None and need > ROOM * have:
        raise HostMemoryError(f"{what} keeps {need / 1e9:.1f} GB of weights in host memory "
                              f"({', '.join(f'{k} {v / 1e9:.1f} GB' for k, v in sizes.items())}); this host has "
                              f"{have / 1e9:.1f} GB available\n{hint}")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers (what its weights are), in the order a host buffer lays them out."""
    return [*module.parameters(), *module.buffers()]


def block_list(model: torch.nn.Module) -> tuple[Optional[str], list]:
    """(its attribute, the blocks) of a denoiser's list of repeated blocks -- what a host buffer is filled a block at a
    time by, an offload swaps or shards by, a regional compile compiles -- or (None, []) where it has none (diffusers'
    Wan transformers keep them in ``blocks``, CogVideoX's in ``transformer_blocks``)."""
    for attr in ("blocks", "transformer_blocks"):
        blocks = getattr(model, attr, None)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
            return attr, list(blocks)
    return None, []


def layout(tensors) -> tuple[list[int], int]:
    """(each tensor's offset in a flat buffer, the buffer's bytes): packed in order, each offset aligned."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + nbytes(t)
    return offsets, end


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fault(buf: torch.Tensor, threads: Optional[int] = None, pool=None) -> int:
    """Map ``buf``'s pages in (one byte written a page), ``threads`` slices at once (None: a core each but one, left
    to the thread that launches the GPU's work, at most 16), on ``pool`` (a thread pool) where given; returns the
    threads used."""
    n = buf.numel()
    threads = max(1, min(threads or min(cores() - 1, 16), -(-n // _PAGE)))
    if n == 0:
        return threads
    a = buf.numpy()
    step = -(-n // threads // _PAGE) * _PAGE
    spans = [(i, min(i + step, n)) for i in range(0, n, step)]

    def touch(span):
        a[span[0]:span[1]:_PAGE] = 0

    if len(spans) == 1:
        touch(spans[0])
    else:
        with contextlib.nullcontext(pool) if pool is not None else _pool(len(spans)) as p:
            list(p.map(touch, spans))
    return len(spans)


def advise_huge_pages(buf: torch.Tensor) -> bool:
    """Ask the kernel for transparent huge pages (2 MiB) over ``buf``'s whole 2 MiB spans, before they are faulted in
    (``madvise(MADV_HUGEPAGE)``: what the kernel's ``madvise`` setting needs); whether it took the advice."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return False
    start = -(-buf.data_ptr() // _HUGE) * _HUGE
    size = (buf.data_ptr() + nbytes(buf) - start) // _HUGE * _HUGE
    return size > 0 and libc.madvise(start, size, _MADV_HUGEPAGE) == 0


def pin(buf: torch.Tensor) -> None:
    """Page-lock ``buf`` in place (``cudaHostRegister``, default flags); RuntimeError with the CUDA error otherwise."""
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes(buf), 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes(buf)} bytes failed with cudaError {err}")


def unpin(buf: torch.Tensor) -> None:
    """Undo :func:`pin` (``buf`` stays valid, pageable)."""
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class HostBuffer:
    """``size`` bytes of host memory, made (allocated, faulted in, pinned where ``pinned``) ``chunk`` bytes at a time
    on a thread of its own when ``background`` (what a load starts before it builds what fills it), else at once.

    :meth:`fill` copies tensors in (a GPU's on a side stream) once the part they lie in is made (a pageable buffer:
    chunk by chunk; a pinned one: once registered whole), and returns their views; the pinning is undone by
    :meth:`close`, or when the buffer is collected. The buffer starts on a 2 MiB boundary, so that huge pages fit it."""

    def __init__(self, size: int, *, pinned: bool, background: bool = False, threads: Optional[int] = None,
                 huge_pages: bool = HUGE_PAGES, chunk: int = CHUNK):
        self.size, self.pinned, self.huge_pages = int(size), bool(pinned and size), huge_pages
        self.chunk = max(_HUGE, chunk // _HUGE * _HUGE)
        self.parts: dict = {"bytes": self.size, "pinned": self.pinned, "huge_pages": None, "fault_threads": None,
                            "chunks": -(-self.size // self.chunk), "allocate_fault_s": None, "register_s": None,
                            "made_s": None, "waited_s": 0.0, "copy_s": None}
        self.buf: Optional[torch.Tensor] = None
        self._threads, self._error = threads, None
        self._made = 0  # bytes from the start made (faulted in, pinned)
        self._cond = threading.Condition()
        self._unpins: list = []
        self._thread = threading.Thread(target=self._make, daemon=True, name="vdbench-host-buffer")
        if background:
            self._thread.start()
        else:
            self._make()

    def _make(self) -> None:
        start = time.perf_counter()
        try:
            raw = torch.empty(self.size + _HUGE, dtype=torch.uint8)
            skip = -raw.data_ptr() % _HUGE
            buf = raw[skip:skip + self.size]
            self.parts["huge_pages"] = self.huge_pages and advise_huge_pages(buf)
            with self._cond:
                self.buf = buf
                self._cond.notify_all()
            faulted, registered = time.perf_counter() - start, 0.0
            threads = max(1, min(self._threads or min(cores() - 1, 16), -(-self.chunk // _PAGE)))
            self.parts["fault_threads"] = threads
            with _pool(threads) as pool:
                for lo in range(0, self.size, self.chunk):
                    piece = buf[lo:lo + self.chunk]
                    t0 = time.perf_counter()
                    fault(piece, threads, pool)
                    faulted += time.perf_counter() - t0
                    self._made_upto(lo + piece.numel() if not self.pinned else 0, faulted, registered, start)
            if self.pinned and self.size:
                # one registration for the whole buffer: a copy may not span two (on an H200 a D2H copy into a
                # weight lying across two registered chunks failed with cudaErrorInvalidValue); and from the
                # storage's first byte, not the aligned start: torch's is_pinned() asks the driver about a view's
                # storage start, and diffusers' group offload pins a copy of every weight it doesn't take as pinned
                # (on an H200 host: A14B's two experts pinned twice, the render killed for memory)
                t1 = time.perf_counter()
                pin(raw)
                self._unpins.append(weakref.finalize(self, unpin, raw))
                registered = time.perf_counter() - t1
                self._made_upto(self.size, faulted, registered, start)
            if not self.size:
                self.parts.update(allocate_fault_s=round(faulted, 4), made_s=round(time.perf_counter() - start, 4))
        except BaseException as exc:  # re-raised where the buffer is waited for
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _made_upto(self, made: int, faulted: float, registered: float, start: float) -> None:
        """The parts so far, then the first ``made`` bytes ready: final once all of them are."""
        with self._cond:
            self.parts["allocate_fault_s"] = round(faulted, 4)
            self.parts["register_s"] = round(registered, 4) if self.pinned else None
            self.parts["made_s"] = round(time.perf_counter() - start, 4)
            self._made = max(self._made, made)
            self._cond.notify_all()

    @property
    def ready(self) -> bool:
        """Whether the buffer is made (or failed)."""
        return (self.buf is not None and self._made >= self.size) or self._error is not None

    def wait(self, upto: Optional[int] = None) -> torch.Tensor:
        """The buffer once its first ``upto`` bytes are made (None: all of it; 0: once allocated), the seconds waited
        for it added to ``waited_s``; its making's error otherwise."""
        upto = self.size if upto is None else upto
        with self._cond:
            if self._error is None and (self.buf is None or self._made < upto):
                start = time.perf_counter()
                self._cond.wait_for(lambda: self._error is not None or (self.buf is not None and self._made >= upto))
                self.parts["waited_s"] = round(self.parts["waited_s"] + time.perf_counter() - start, 4)
        if self._error is not None:
            raise self._error
        return self.buf

    def views(self, tensors) -> list[torch.Tensor]:
        """Views of the buffer shaped and typed like ``tensors``, laid out by :func:`layout` (once it is allocated)."""
        offsets, end = layout(tensors)
        if end > self.size:
            raise ValueError(f"{end} bytes of tensors don't fit a host buffer of {self.size}")
        buf = self.wait(0)
        return [buf[o:o + nbytes(t)].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors)]

    def fill(self, tensors, device: Optional[torch.device] = None, after=None) -> list[torch.Tensor]:
        """``tensors`` copied into :meth:`views` of the buffer, each once the chunks it lies in are made (those on
        ``device``, a GPU, on a stream of their own behind ``after``, an event, or else the current stream's queued
        work, waited for once at the end); returns the views."""
        views = self.views(tensors)
        offsets = layout(tensors)[0]
        start = time.perf_counter()
        waited = self.parts["waited_s"]
        stream = None
        if device is not None and torch.device(device).type == "cuda":
            stream = torch.cuda.Stream(device)
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for o, v, t in zip(offsets, views, tensors):
                self.wait(o + nbytes(t))
                v.copy_(t.detach(), non_blocking=stream is not None and t.device.type == "cuda")
        if stream is not None:
            stream.synchronize()
        # the copies' own time: what was not spent waiting for the chunks
        self.parts["copy_s"] = round(time.perf_counter() - start - (self.parts["waited_s"] - waited), 4)
        return views

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this buffer (its storage's)."""
        return (self.buf is not None and t.device.type == "cpu"
                and t.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr())

    def close(self) -> None:
        """Unpin the buffer (its views stay valid, pageable); the caller has waited for any copy from it."""
        if self._thread.is_alive():
            self._thread.join()
        for unpin_chunk in self._unpins:
            unpin_chunk()


def _pool(threads: int):
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(threads, thread_name_prefix="vdbench-fault") if threads > 1 else contextlib.nullcontext()


def move_into(module: torch.nn.Module, buffer: "HostBuffer") -> None:
    """``module``'s weights moved into ``buffer`` (from a GPU on a side stream, the GPU's copies then freed), each
    weight a view of it; the module carries the buffer (:data:`HOST_BUFFER`): what copies to a device come from."""
    tensors = weights(module)
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    for t, view in zip(tensors, buffer.fill(tensors, device)):
        t.data = view
    setattr(module, HOST_BUFFER, buffer)


def held(module: torch.nn.Module) -> Optional["HostBuffer"]:
    """The :class:`HostBuffer` ``module`` carries if every weight of it is a view of that buffer, else None."""
    buffer = getattr(module, HOST_BUFFER, None)
    return buffer if buffer is not None and all(buffer.holds(t) for t in weights(module)) else None
