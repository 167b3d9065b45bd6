"""Triton kernels compiled ahead of their first call: launches that compile instead of running.

Why: Triton compiles a kernel's specialization at its first launch (the JIT: seconds for a handful of variants on an
empty cache), so whichever call comes first pays it. Code that can run the same calls *for their shapes alone* --
tensors on the meta device, on a background thread or in a worker process, while the GPU or the load does other work
-- compiles them there instead: inside :func:`compile_only`, every kernel launched through :func:`launch` is
compiled for the CUDA device by Triton's own ``warmup`` (the JIT's own specialization key and caches, in memory and
on disk: the real call finds it), nothing is launched and outputs stay unwritten; :func:`load_compiled` then does the
rest of a first launch's host work (module load, launcher) without launching. Used by the VAE fast path's glue
(:mod:`vdbench.vae.prewarm`) and by ``fav3_fp8``'s pre-pass (:mod:`vdbench.backends.prewarm`).

Never imports triton: the kernel objects come from the callers' modules.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["compile_only", "compiling_for", "load_compiled", "launch", "compile_ahead"]

# (the CUDA device, the kernels compiled so far) inside compile_only() (per thread: a context variable), else None.
_COMPILE_FOR: contextvars.ContextVar = contextvars.ContextVar("vdbench_compile_for", default=None)


@contextlib.contextmanager
def compile_only(device):
    """Within (this thread only): every kernel launched through :func:`launch` compiles its variant for the CUDA
    ``device`` -- Triton's ``warmup``: the JIT's own specialization and cache, no launch, no GPU work -- and leaves
    its output unwritten; the tensors may be on the meta device (a call run for its shapes alone). Yields the list
    of the compiled kernels (for :func:`load_compiled`)."""
    compiled: list = []
    token = _COMPILE_FOR.set((torch.device(device), compiled))
    try:
        yield compiled
    finally:
        _COMPILE_FOR.reset(token)


def compile_ahead(device, calls) -> int:
    """The kernels that ``calls()`` launches (on meta tensors, for their shapes alone) compiled for the CUDA
    ``device`` (:func:`compile_only`) and loaded (:func:`load_compiled`); returns how many it compiled or found."""
    with compile_only(device) as compiled:
        calls()
    load_compiled(compiled, device)
    return len(compiled)


def compiling_for():
    """The CUDA device of an enclosing :func:`compile_only` in this thread, or None."""
    state = _COMPILE_FOR.get()
    return None if state is None else state[0]


def load_compiled(kernels, device) -> int:
    """Do the rest of each compiled kernel's first-launch work ahead, without launching it: its module loaded on
    ``device`` and its launcher built (Triton's ``CompiledKernel._init_handles``; a Triton without it leaves that
    to the first launch). On an H200 that work was ~0.75 s of the fast Wan decode's first call with every variant
    compiled ahead (bench/cold_decode.py's "glue host"). The module load releases the GIL while it waits for the
    driver, so a thread doing this beside a denoising loop holds up only itself. Returns how many were loaded."""
    seen, n = set(), 0
    device = torch.device(device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for k in kernels:
            init = getattr(k, "_init_handles", None)
            if init is None or id(k) in seen:
                continue
            seen.add(id(k))
            init()
            n += 1
    return n


def launch(kernel, grid, *args, **kw):
    """``kernel[grid](*args, **kw)``, or inside :func:`compile_only` its compile alone (``kernel.warmup``)."""
    state = _COMPILE_FOR.get()
    if state is None:
        kernel[grid](*args, **kw)
        return
    dev, compiled = state
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        k = kernel.warmup(*args, grid=grid, **kw)
    if k is not None:
        compiled.append(k)
