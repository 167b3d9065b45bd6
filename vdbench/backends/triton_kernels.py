"""The project's own Triton attention kernels (vdbench.kernels): one entry per kernel of ``vdbench.kernels.KERNELS``
that has a ``backend`` description, derived from it (this file names no kernel). Availability through the
kernel's probe (a GPU, or Triton's interpreter on a CPU); the forward and the quantization pre-pass imported at call
time -- importing ``vdbench.kernels`` never imports triton, its kernel modules do."""

from __future__ import annotations

from typing import Callable

from vdbench import kernels

from . import registry
from .registry import Backend, BenchProfile, probe, register, requires_package, traffic, unregister

ORDER = 30

_NO_LSE = "vdbench's Triton kernels do not write the log-sum-exp"


def _forward(name: str) -> Callable:
    def fn(q, k, v, *, scale=None, is_causal=False):
        return kernels.forward(name)(q, k, v, scale=scale, is_causal=is_causal)

    fn.__name__ = name
    return fn


def _prepass(name: str) -> Callable:
    """The kernel's quantization pre-pass alone (the same Triton pass its call runs first), to time it apart."""

    def fn(q, k, v, scale=None):
        return kernels.prepass(name)(q, k, v, scale)

    fn.__name__ = f"{name}_prepass"
    return fn


def _probe(name: str) -> Callable:
    def check(device):
        return kernels.probe(name, device)

    return check


def entry(kernel: kernels.Kernel) -> Backend:
    """The backend entry of one registered kernel (with a ``backend`` description)."""
    quantized = kernel.prepass_reads is not None
    return Backend(kernel.name, kernel.backend, fn=_forward(kernel.name), kernel=f"vdbench.{kernel.name}",
                   dtypes=kernel.dtypes, head_dims=kernel.head_dims,
                   constraints=(requires_package("triton", hint="pip install -e '.[test]'"),
                                probe(_probe(kernel.name))),
                   no_lse_reason=_NO_LSE, notes=kernel.notes,
                   bench=BenchProfile(traffic(kernel.widths, kernel.prepass_reads or (0, 0, 0)),
                                      prepass=_prepass(kernel.name) if quantized else None))


def _added(kernel: kernels.Kernel) -> None:
    if kernel.backend:
        register(entry(kernel), order=ORDER)


def _removed(kernel: kernels.Kernel) -> None:
    # the registry's table looked up at call time: a re-run of this module (tests/test_backends.py does, with the
    # tables swapped) replaces this listener, and a table bound at import would be the swapped one
    if kernel.backend and kernel.name in registry.BACKENDS:
        unregister(kernel.name)


kernels.on_register(_added, _removed)
