"""The attention backends: the registry (``registry.py``) and its entries, one module per kernel family.

Importing the package imports every module in it (pkgutil): each registers its entries next to their wrappers,
and its module-level ``ORDER`` places them in ``names()`` (torch_sdpa, sage, sage2, flash, flash4, flashinfer_prefill,
triton_kernels, sparse, neighborhood, emulated).
Adding a kernel is one ``register(Backend(...))`` in a new or existing module here; no caller changes, because
callers ask the entry (``resolve(name)``) instead of comparing names. Optional kernel packages (sageattention,
flash_attn, FA3, FA4's flash_attn.cute, flashinfer, natten, triton) are imported at call time only: importing this
package imports none of them.
"""

from __future__ import annotations

import importlib
import pkgutil

from vdbench.numerics import exact_attention, reference_attention

from .registry import (ANY_FLOAT, BACKENDS, HALF, Backend, BackendUnavailable, BenchProfile, BytesMoved, CallShape,
                       LSEForm, Option, RequiresPackage, SparseUse, UnsupportedCall, aliases, availability,
                       available_names, canonical_name, capability_table, cuda, cuda_dtypes, get_backend, names, probe,
                       register, registered, require_here, requires_package, resolve, traffic, unregister)
from .torch_sdpa import sdpa_kernel_choice

__all__ = ["Backend", "BenchProfile", "CallShape", "SparseUse", "BackendUnavailable", "UnsupportedCall", "LSEForm",
           "Option", "BytesMoved", "traffic", "HALF", "ANY_FLOAT", "RequiresPackage", "requires_package", "cuda",
           "cuda_dtypes", "probe", "register", "unregister", "registered", "resolve", "get_backend", "canonical_name",
           "names", "aliases", "availability", "available_names", "capability_table", "require_here", "BACKENDS",
           "sdpa_kernel_choice",
           "exact_attention", "reference_attention"]


# the modules of this package that hold no entries: the registry itself and the prewarm runner
SUPPORT_MODULES = ("registry", "prewarm")


def _import_entry_modules() -> None:
    """Every module of this package but the support modules registers entries when imported; their order is
    ORDER's."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in SUPPORT_MODULES:
            importlib.import_module(f"{__name__}.{info.name}")


_import_entry_modules()
