"""The project's own attention kernels, written in Triton (so they can also be built for AMD GPUs).

Three forward kernels, registered as backends in ``vdbench.backends.triton_kernels`` (BHSD in, BHSD out,
bf16/fp16, D 64/128):

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
``fa3_fp8_prepass()`` and ``zero_channels_()`` import them on first use.

Importing this package never imports triton (``forward`` / ``prepass`` import the kernel modules on first use),
and Triton decides at *decoration* time whether a ``@triton.jit`` function is compiled or interpreted: to run them on
a CPU, ``TRITON_INTERPRET=1`` must be in the environment before ``vdbench.kernels.attention`` is first imported.
``probe()`` reports that (and refuses when the module was imported in the other mode).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

KERNEL_NAMES = ("fav3_sage", "fp8_triton", "fav2_triton")
#: Which module holds each kernel (its decoration mode -- compiled or interpreted -- is the module's), and the
#: compute capability it needs on NVIDIA (None: any GPU Triton supports). ``vae_glue``: the VAE fast path's
#: norm -> SiLU glue (vdbench.kernels.glue); ``fa3_prepass``: fav3_fp8's quantization pre-pass; ``zero_channels``:
#: the sagev2 fp8 backends' zero-V-channel guard -- helpers of backends, not attention backends themselves.
_MODULES = {"fav3_sage": "vdbench.kernels.attention", "fp8_triton": "vdbench.kernels.attention",
            "fav2_triton": "vdbench.kernels.attention", "vae_glue": "vdbench.kernels.glue",
            "fa3_prepass": "vdbench.kernels.fa3_prepass", "zero_channels": "vdbench.kernels.channels"}
_MIN_CAPABILITY = {"fav3_sage": (8, 9), "fp8_triton": (8, 9), "fav2_triton": (8, 0), "vae_glue": None,
                   "fa3_prepass": (8, 9), "zero_channels": None}


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def probe(kernel: str, device) -> tuple[bool, str]:
    """(available, reason) for one of the Triton kernels (``KERNEL_NAMES`` or ``vae_glue``) on ``device`` (never
    imports triton)."""
    if importlib.util.find_spec("triton") is None:
        return False, "package not installed: triton"
    dev = torch.device(device)
    mod_name = _MODULES[kernel]
    mod = sys.modules.get(mod_name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False, "needs a CUDA/HIP GPU (torch.cuda.is_available() is False) or TRITON_INTERPRET=1 on CPU"
        if mod is not None and mod.INTERPRETED:
            return False, (f"{mod_name} was imported with TRITON_INTERPRET=1 (interpreter mode): "
                           "it cannot launch on the GPU in this process")
        need = _MIN_CAPABILITY[kernel]
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


def compiled_variants(kernel: str):
    """How many compiled variants (specializations x devices) the JIT functions of ``kernel``'s module hold in
    this process -- what a first call pays to compile -- (0 before the module is imported: nothing compiled yet)
    or None where that can't be read (interpreted, or a Triton whose JIT cache is laid out otherwise). Never imports
    triton."""
    mod = sys.modules.get(_MODULES[kernel])
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
    """One kernel's forward, ``fn(q, k, v, *, scale=None, is_causal=False)`` (imports triton on first use)."""
    from vdbench.kernels import attention

    return attention.KERNELS[kernel]


def prepass(kernel: str):
    """The quantization pre-pass of a kernel alone, ``fn(q, k, v, scale=None)`` (None for ``fav2_triton``), to time
    it apart."""
    from vdbench.kernels import attention

    return attention.prepass(kernel)


def fa3_fp8_prepass(q, k, v, smooth_k: bool = False):
    """``fav3_fp8``'s pre-pass in Triton (``vdbench.kernels.fa3_prepass``): a ``numerics.Fp8Inputs``, bit-equal to
    ``numerics.fp8_bh_inputs`` (imports triton on first use)."""
    from vdbench.kernels import fa3_prepass

    return fa3_prepass.prepass(q, k, v, smooth_k)


def zero_channels_(out, flags):
    """Zero ``out``'s channels flagged per (batch, K/V head) in place (``vdbench.kernels.channels``; imports triton
    on first use)."""
    from vdbench.kernels import channels

    return channels.zero_channels_(out, flags)
