"""The project's own attention kernels, written in Triton (so they can also be built for AMD GPUs).

Every kernel is registered once, in ``KERNELS`` below: the backend entries (``vdbench.backends.triton_kernels``),
the availability probe and the ahead-of-time compile check (``vdbench.kernels.aot``) are derived from it, so a new
kernel is its module, its test and one ``Kernel(...)`` line there. Three forward kernels are attention backends
(BHSD in, BHSD out, bf16/fp16, D 64/128):

* ``fav3_sage``  INT8 Q·Kᵀ with one scale per block of tokens per head (Q pre-multiplied by scale·log2 e,
  K mean-smoothed over the sequence), exp2 online softmax, P·V in fp8 e4m3 with a per-channel V scale
  (P scaled by 448 before rounding); ``pv="fp16"`` keeps P·V in fp16 instead.
* ``fp8_triton`` e4m3 Q, K, V with one scale per block of tokens per head (Q and K blocks as the tiles,
  V per BLOCK_N keys), K mean-smoothed, e4m3 P (scaled by 448).
* ``fav2_triton`` plain bf16/fp16 flash-attention forward (no pre-pass).

The quantized kernels run a Triton pre-pass (``quant.py``) that writes tile-padded int8/e4m3 copies (V
transposed, so the fp8 P·V operand is K-major, as Hopper's fp8 MMA wants it); the backend callables run it
every call, so a benchmark of the backend includes the quantization time (``prepass()`` runs it alone). Their
pure-torch emulations are in ``vdbench.numerics``.

Two helpers of backends live here too: ``fa3_prepass`` (``fav3_fp8``'s fused per-(batch, head) e4m3 pre-pass,
bit-equal to ``numerics.fp8_bh_inputs``) and ``channels`` (the ``sagev2`` fp8 entries' zero-V-channel guard);
``fa3_fp8_prepass()`` and ``zero_channels_()`` import them on first use. ``exchange_fp8`` is Ulysses' fp8 exchange
(``--ulysses_fp8_exchange``: e4m3 rows with a scale each, quantized inside the exchange's layout copies), imported
by ``vdbench.patching.ulysses.Fp8Exchange`` on first use.

Importing this package never imports triton (``forward`` / ``prepass`` import the kernel modules on first use),
and Triton decides at *decoration* time whether a ``@triton.jit`` function is compiled or interpreted: to run them on
a CPU, ``TRITON_INTERPRET=1`` must be in the environment before ``vdbench.kernels.attention`` is first imported.
``probe()`` reports that (and refuses when the module was imported in the other mode).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Kernel:
    """One of the project's Triton kernels: the one place it is registered. The attention backend entry
    (``vdbench.backends.triton_kernels``), the availability probe and the ahead-of-time compile list
    (``vdbench.kernels.aot``) are all read from here.

    ``module`` holds the kernel (its decoration mode -- compiled or interpreted -- is the module's, read from its
    ``INTERPRETED``); ``min_capability`` is the compute capability it needs on NVIDIA (None: any GPU Triton supports).

    ``backend`` is the description of its attention backend; empty for a helper of backends (no entry of its own).
    An attention kernel's module defines a function of the kernel's name, ``fn(q, k, v, *, scale=None,
    is_causal=False)`` (BHSD in, BHSD out), and, where ``prepass_reads`` is given, ``prepass(name)`` -> the
    quantization pre-pass alone, ``fn(q, k, v, scale=None)``. ``widths`` / ``prepass_reads`` are the bytes model's
    (``backends.traffic``): the kernel's bytes per element of Q, K, V (None: the input's) and how many times the
    pre-pass reads each. A module that defines ``aot_specs()`` is compiled by ``python -m vdbench.kernels.aot``
    (see there).
    """

    name: str
    module: str
    min_capability: tuple[int, int] | None = None
    backend: str = ""
    dtypes: tuple = (torch.float16, torch.bfloat16)
    head_dims: tuple[int, ...] = (64, 128)
    widths: tuple = (None, None, None)
    prepass_reads: tuple[int, int, int] | None = None
    notes: str = ""


_ATTN = "vdbench.kernels.attention"
_PREPASS_NOTE = "quantization pre-pass (Triton) inside the call"

#: name -> Kernel, in registration order. ``vae_glue``: the VAE fast path's norm -> SiLU glue; ``fa3_prepass``:
#: fav3_fp8's quantization pre-pass; ``zero_channels``: the sagev2 fp8 backends' zero-V-channel guard; ``wan_rope``:
#: Wan's rotary embedding in one pass (--fused_rope); ``wan_block``: a Wan block's norms, modulations and gated
#: residuals (--fused_block) -- helpers, not attention backends themselves.
KERNELS: dict[str, Kernel] = {}
#: (module, name) of the ``added`` callable -> (added, removed): a module executed again replaces its listener
_LISTENERS: dict[tuple[str, str], tuple[Callable, Callable | None]] = {}


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` (refuses a name already taken) and tell the listeners (the backends' registry adds its entry)."""
    if kernel.name in KERNELS:
        raise ValueError(f"can't register Triton kernel '{kernel.name}': name already taken")
    KERNELS[kernel.name] = kernel
    for added, _ in list(_LISTENERS.values()):
        added(kernel)
    return kernel


def unregister(name: str) -> Kernel:
    """Remove a kernel (a plugin's, a test's) and tell the listeners (the backends' registry drops its entry)."""
    kernel = KERNELS.pop(name)
    for _, removed in list(_LISTENERS.values()):
        if removed is not None:
            removed(kernel)
    return kernel


def on_register(added: Callable, removed: Callable | None = None) -> None:
    """Call ``added(kernel)`` for every kernel registered, now and later (and ``removed(kernel)`` on unregister): how
    a layer above derives its entries from this table without this package importing it."""
    _LISTENERS[(added.__module__, added.__qualname__)] = (added, removed)
    for kernel in list(KERNELS.values()):
        added(kernel)


def names(backends_only: bool = False, module: str | None = None) -> tuple[str, ...]:
    """The registered kernels' names, in order; ``backends_only``: those with an attention backend; ``module``: those
    that ``module`` holds."""
    return tuple(n for n, k in KERNELS.items()
                 if (k.backend or not backends_only) and (module is None or k.module == module))


for _kernel in (
    Kernel("fav3_sage", _ATTN, (8, 9),
           "the project's Triton kernel: INT8 Q·K per block (K smoothed), exp2 softmax, e4m3 P·V with a "
           "per-channel V scale",
           # int8 Q/K, e4m3 V; the pre-pass reads Q once, K twice (its mean, then the quantization), V twice (its
           # per-channel amax, then the quantization), and writes each in one byte
           widths=(1, 1, 1), prepass_reads=(1, 2, 2), notes=_PREPASS_NOTE),
    Kernel("fp8_triton", _ATTN, (8, 9),
           "the project's Triton kernel: e4m3 Q/K/V with one scale per tile of tokens (K smoothed), e4m3 P",
           # e4m3 Q/K/V; the pre-pass reads K twice (its mean), V once (per-block scales computed in the pass)
           widths=(1, 1, 1), prepass_reads=(1, 2, 1), notes=_PREPASS_NOTE),
    Kernel("fav2_triton", _ATTN, (8, 0), "the project's Triton kernel: plain bf16/fp16 flash-attention forward"),
    Kernel("vae_glue", "vdbench.kernels.glue"),
    Kernel("fa3_prepass", "vdbench.kernels.fa3_prepass", (8, 9)),
    Kernel("zero_channels", "vdbench.kernels.channels"),
    Kernel("wan_rope", "vdbench.kernels.rope"),
    Kernel("wan_block", "vdbench.kernels.block"),
):
    register(_kernel)
del _kernel

#: The attention kernels (those registered as backends) at import.
KERNEL_NAMES = names(backends_only=True)


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def probe(kernel: str, device) -> tuple[bool, str]:
    """(available, reason) for one of the registered Triton kernels (``KERNELS``) on ``device`` (never
    imports triton)."""
    if importlib.util.find_spec("triton") is None:
        return False, "package not installed: triton"
    dev = torch.device(device)
    mod_name = KERNELS[kernel].module
    mod = sys.modules.get(mod_name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False, "needs a CUDA/HIP GPU (torch.cuda.is_available() is False) or TRITON_INTERPRET=1 on CPU"
        if mod is not None and mod.INTERPRETED:
            return False, (f"{mod_name} was imported with TRITON_INTERPRET=1 (interpreter mode): "
                           "it cannot launch on the GPU in this process")
        need = KERNELS[kernel].min_capability
        if torch.version.hip is None and need is not None:
            cap = torch.cuda.get_device_capability(dev)
            if cap < need:
                what = "fp8 e4m3" if need == (8, 9) else "bf16 MMA"
                return False, f"needs compute capability >= {need[0]}.{need[1]} ({what}), GPU is {cap[0]}.{cap[1]}"
        return True, "ok"
    if dev.type == "cpu":
        if not interpret_requested():
            return False, ("needs a CUDA/HIP GPU; on CPU only under Triton's interpreter "
                           "(set TRITON_INTERPRET=1 before triton is imported)")
        if mod is not None and not mod.INTERPRETED:
            return False, (f"TRITON_INTERPRET=1 is set but {mod_name} was already imported without it "
                           "(compiled mode): restart the process with the variable set")
        return True, "ok (Triton interpreter on CPU: correctness only, very slow)"
    return False, f"needs a CUDA/HIP GPU or the Triton interpreter on CPU (device is {dev.type})"


def _fused_choice(setting: bool | None, flag: str, kernel: str, device, compiled: bool, family_lacks: str | None,
                  inductor: str) -> str | None:
    """Why one of the render's fused kernels (``--fused_rope``, ``--fused_block``: diffusers' values bit for bit) does
    not run, None where it does. ``auto`` (``setting`` None) runs it on CUDA where Triton can (:func:`probe` of the
    registered ``kernel``), for a family with the code that calls it (``family_lacks``: why not, else None), except
    under torch.compile (``inductor``: what inductor fuses itself); ``on`` runs it there too, and on a CPU under
    Triton's interpreter (tests); ``on`` where it can't: ValueError with the reason (one line, then a hint)."""
    if setting is False:
        return f"off ({flag} off)"
    why = family_lacks or (f"compiled blocks ({inductor})" if compiled else None)
    device = torch.device(device)
    if why is None and device.type != "cuda" and setting is None:
        why = f"a {device.type} device (the kernel runs on CUDA)"
    if why is None:
        ok, reason = probe(kernel, device)
        why = None if ok else reason
    if why is not None and setting is True:
        raise ValueError(f"{flag} on: not here: {why}\n{flag} auto uses it where it can")
    return why


def fused_rope_choice(setting: bool | None, device, family, compiled: bool = False) -> str | None:
    """Why a render's RoPE is not fused (``--fused_rope`` = ``setting``: :func:`vdbench.kernels.rope.rope_pairs`),
    None where it is (:func:`_fused_choice`): for a model family with a processor of its own
    (``Family.self_attention``)."""
    return _fused_choice(setting, "--fused_rope", "wan_rope", device, compiled,
                         "the model family runs diffusers' own processor" if family.self_attention is None else None,
                         "inductor fuses the RoPE itself")


def fused_block_choice(setting: bool | None, device, family, compiled: bool = False) -> str | None:
    """Why a render's blocks don't run their elementwise passes fused (``--fused_block`` = ``setting``:
    :mod:`vdbench.kernels.block`), None where they do (:func:`_fused_choice`): for a model family with a block forward
    of its own (``Family.block_forward``)."""
    return _fused_choice(setting, "--fused_block", "wan_block", device, compiled,
                         "the model family runs diffusers' own block forward" if family.block_forward is None else None,
                         "inductor fuses the block's elementwise passes itself")


def compiled_variants(kernel: str):
    """How many compiled variants (specializations x devices) the JIT functions of ``kernel``'s module hold in
    this process -- what a first call pays to compile -- (0 before the module is imported: nothing compiled yet)
    or None where that can't be read (interpreted, or a Triton whose JIT cache is laid out otherwise). Never imports
    triton."""
    mod = sys.modules.get(KERNELS[kernel].module)
    if mod is None:
        return 0
    if mod.INTERPRETED:
        return None
    total = 0
    for obj in vars(mod).values():
        caches = getattr(obj, "device_caches", None)
        if caches is None:
            continue
        try:
            total += sum(len(entry[0]) for entry in caches.values())
        except (TypeError, IndexError, KeyError):
            return None
    return total


def forward(kernel: str):
    """One kernel's forward, ``fn(q, k, v, *, scale=None, is_causal=False)``: the function of its name in its module
    (imports triton on first use)."""
    return getattr(importlib.import_module(KERNELS[kernel].module), kernel)


def prepass(kernel: str):
    """The quantization pre-pass of a kernel alone, ``fn(q, k, v, scale=None)`` (None for a kernel that quantizes
    nothing: no ``prepass_reads``), to time it apart."""
    if KERNELS[kernel].prepass_reads is None:
        return None
    return importlib.import_module(KERNELS[kernel].module).prepass(kernel)


def fa3_fp8_prepass(q, k, v, smooth_k: bool = False, smooth_v: bool = False):
    """``fav3_fp8``'s pre-pass in Triton (``vdbench.kernels.fa3_prepass``): a ``numerics.Fp8Inputs``, bit-equal to
    ``numerics.fp8_bh_inputs`` (imports triton on first use)."""
    from vdbench.kernels import fa3_prepass

    return fa3_prepass.prepass(q, k, v, smooth_k, smooth_v)


def zero_channels_(out, flags):
    """Zero ``out``'s channels flagged per (batch, K/V head) in place (``vdbench.kernels.channels``; imports triton
    on first use)."""
    from vdbench.kernels import channels

    return channels.zero_channels_(out, flags)
