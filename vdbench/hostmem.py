"""Host memory for weights that travel between the host and a GPU: one flat buffer per set of weights, its pages
faulted in by several threads at once, then pinned (page-locked) in place where a CUDA device is there, and each
weight an aligned view of it.

Why not one ``torch.empty(..., pin_memory=True)`` per weight: torch's caching host allocator rounds each allocation
up to a power of two (up to twice the weights' bytes) and maps each one's pages in on one thread; a fresh page costs
a fault, and one thread faults a few GB/s at most. Here the buffer is pageable first (``torch.empty``), its pages
touched by a pool of threads (one byte a page each, in numpy, which lets go of the GIL), then registered with the
CUDA driver (``cudaHostRegister``), which pins what is already mapped. :class:`HostBuffer` records each part's
seconds, so a render's record shows where the host's time went. On a machine without CUDA the buffer is not pinned:
it is the host copy as is.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Optional

import torch

__all__ = ["ALIGN", "HOST_BUFFER", "HUGE_PAGES", "HostBuffer", "layout", "nbytes", "cores", "fault", "advise_huge_pages",
           "pin", "unpin"]

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


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def fault(buf: torch.Tensor, threads: Optional[int] = None) -> int:
    """Map ``buf``'s pages in (one byte written a page), ``threads`` slices at once (None: a core each but one, left
    to the thread that launches the GPU's work, at most 16); returns the threads used."""
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
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(spans), thread_name_prefix="vdbench-fault") as pool:
            list(pool.map(touch, spans))
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
    """``size`` bytes of host memory, made (allocated, faulted in, pinned where ``pinned``) on a thread of its own
    when ``background`` (what a load starts before it builds what fills it), else at once.

    :meth:`fill` copies tensors in (a GPU's on a side stream, in one pass) and returns their views; the pinning is
    undone by :meth:`close`, or when the buffer is collected (the registration holds the memory until then)."""

    def __init__(self, size: int, *, pinned: bool, background: bool = False, threads: Optional[int] = None,
                 huge_pages: bool = HUGE_PAGES):
        self.size, self.pinned, self.huge_pages = int(size), bool(pinned and size), huge_pages
        self.parts: dict = {"bytes": self.size, "pinned": self.pinned, "huge_pages": None, "fault_threads": None,
                            "allocate_fault_s": None, "register_s": None, "waited_s": 0.0, "copy_s": None}
        self.buf: Optional[torch.Tensor] = None
        self._threads, self._error = threads, None
        self._unpin = None
        self._thread = threading.Thread(target=self._make, daemon=True, name="vdbench-host-buffer")
        if background:
            self._thread.start()
        else:
            self._make()

    def _make(self) -> None:
        try:
            start = time.perf_counter()
            buf = torch.empty(self.size, dtype=torch.uint8)
            self.parts["huge_pages"] = self.huge_pages and advise_huge_pages(buf)
            self.parts["fault_threads"] = fault(buf, self._threads)
            self.parts["allocate_fault_s"] = round(time.perf_counter() - start, 4)
            if self.pinned:
                start = time.perf_counter()
                pin(buf)
                self._unpin = weakref.finalize(self, unpin, buf)
                self.parts["register_s"] = round(time.perf_counter() - start, 4)
            self.buf = buf
        except BaseException as exc:  # re-raised where the buffer is waited for
            self._error = exc

    @property
    def ready(self) -> bool:
        return self.buf is not None or self._error is not None

    def wait(self) -> torch.Tensor:
        """The buffer, once made (the seconds waited for it added to ``waited_s``); its making's error otherwise."""
        if self._thread.is_alive():
            start = time.perf_counter()
            self._thread.join()
            self.parts["waited_s"] = round(self.parts["waited_s"] + time.perf_counter() - start, 4)
        if self._error is not None:
            raise self._error
        return self.buf

    def views(self, tensors) -> list[torch.Tensor]:
        """Views of the buffer shaped and typed like ``tensors``, laid out by :func:`layout`."""
        offsets, end = layout(tensors)
        buf = self.wait()
        if end > self.size:
            raise ValueError(f"{end} bytes of tensors don't fit a host buffer of {self.size}")
        return [buf[o:o + nbytes(t)].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors)]

    def fill(self, tensors, device: Optional[torch.device] = None, after=None) -> list[torch.Tensor]:
        """``tensors`` copied into :meth:`views` of the buffer (those on ``device``, a GPU, on a stream of their own
        behind ``after``, an event, or else the current stream's queued work, waited for once at the end); returns
        the views."""
        views = self.views(tensors)
        start = time.perf_counter()
        stream = None
        if device is not None and torch.device(device).type == "cuda":
            stream = torch.cuda.Stream(device)
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for v, t in zip(views, tensors):
                v.copy_(t.detach(), non_blocking=stream is not None and t.device.type == "cuda")
        if stream is not None:
            stream.synchronize()
        self.parts["copy_s"] = round(time.perf_counter() - start, 4)
        return views

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this buffer (its storage's)."""
        return (self.buf is not None and t.device.type == "cpu"
                and t.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr())

    def close(self) -> None:
        """Unpin the buffer (its views stay valid, pageable); the caller has waited for any copy from it."""
        if self._unpin is not None:
            self._unpin()
