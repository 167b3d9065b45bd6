"""vdbench: compare attention kernels and VAE decode paths inside real video diffusion pipelines.

As a library::

    import vdbench
    with vdbench.use_backend(pipe, "sagev1_emu") as patch:   # a diffusers Wan / CogVideoX pipeline
        pipe("a cat", num_frames=9, height=64, width=96)
    print(patch.stats.calls)                                 # attention calls by the kernel that ran

``use_backend`` and ``list_backends`` (``vdbench.api``), ``BackendUnavailable`` and ``UnsupportedCall`` (what
they raise) are loaded on first use, so ``import vdbench`` stays cheap (no torch import). The modules, one per
concern, are described in docs/ARCHITECTURE.md.
"""

import importlib
import time

#: The host clock (``time.perf_counter``) when vdbench was first imported: the earliest mark a render run from the
#: CLI can take itself, what ``end_to_end_s`` counts from where the process's start can't be read
#: (:func:`vdbench.timing.process_start`).
IMPORTED_AT = time.perf_counter()

__version__ = "0.1.0"

# public name -> the submodule that defines it, imported when the name is first read
_LAZY = {"use_backend": "api", "list_backends": "api", "BackendUnavailable": "backends",
         "UnsupportedCall": "backends"}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
