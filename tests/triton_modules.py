"""The project's Triton kernel modules for a test module, decorated under Triton's interpreter when there is no GPU.

Triton decides at decoration time (the module's import) whether a kernel is compiled or interpreted, so the variable
must be set before the first import -- and a module imported earlier in compiled mode is re-imported. The variable
is restored afterwards, so no other test module sees the interpreter.
"""

import contextlib
import importlib
import os

import torch


@contextlib.contextmanager
def kernel_modules(*names: str):
    """``with kernel_modules("quant", "attention") as (quant, attention, device):`` -- ``vdbench.kernels.<name>``
    for each name (in import order: a module's dependencies first), and the device the tests run on."""
    old = os.environ.get("TRITON_INTERPRET")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = [importlib.import_module(f"vdbench.kernels.{n}") for n in names]
        if not on_gpu and not all(m.INTERPRETED for m in mods):  # imported earlier in compiled mode: re-decorate
            mods = [importlib.reload(m) for m in mods]
        yield (*mods, torch.device("cuda" if on_gpu else "cpu"))
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
