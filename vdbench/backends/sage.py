"""SageAttention 1.x (the ``sageattention`` package, Triton): INT8 Q·K per block with K smoothing, fp16 P·V; and the
probe of which major version of the package is installed, which ``sagev1`` and the ``sagev2*`` entries share.

Why a version probe: 1.x and 2.x install the same module, ``sageattention``, with a ``sageattn`` of the same
signature, but 2.x's ``sageattn`` runs SageAttention 2's kernels (on Hopper INT8 Q·Kᵀ + fp8 P·V). Calling it for
``sagev1`` would run another algorithm under the old name, so ``sagev1`` needs 1.x and says so when 2.x is there
(pointing at ``sagev2_triton``, 2.x's Triton kernel of the same INT8 + fp16 P·V algorithm); the ``sagev2*``
entries need 2.x. The major version is read off the API (2.x defines the explicit ``sageattn_qk_int8_*`` kernels,
1.x only ``sageattn``), not off package metadata, which an in-place build on PYTHONPATH doesn't have; the version
string, where metadata exists, is only for messages. Which explicit kernels a 2.x build has is the entries' own
check (``sage2.SageFunction``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Optional

from .registry import ANY_FLOAT, Backend, BenchProfile, cuda, register, requires_package, traffic

ORDER = 10

V2_PREFIX = "sageattn_qk_int8_"  # sageattention >= 2.0 defines its explicit kernels so; 1.x has sageattn only


def import_sageattention():
    """(module, None) or (None, why it can't be used): not installed, or failing to import (2.x without its compiled
    ``_fused`` extension raises ImportError). Imported once; the import system caches it."""
    if importlib.util.find_spec("sageattention") is None:
        return None, "package not installed: sageattention"
    try:
        return importlib.import_module("sageattention"), None
    except Exception as e:  # an ImportError of a half-built 2.x, or whatever a broken install raises
        return None, f"sageattention does not import ({type(e).__name__}: {str(e).splitlines()[0][:160]})"


def sage_major(module) -> int:
    return 2 if any(n.startswith(V2_PREFIX) for n in dir(module)) else 1


def sage_version(module) -> str:
    """The installed version for messages: package metadata, else ``1.x``/``2.x`` from the API."""
    try:
        return importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        return getattr(module, "__version__", None) or f"{sage_major(module)}.x"


def describe_install() -> str:
    """One line for logs: which sageattention imports here (version, 1.x or 2.x, where from, its public kernels) or
    why none does -- what a device script prints before it measures anything."""
    mod, why = import_sageattention()
    if mod is None:
        return why
    kernels = sorted(n for n in dir(mod) if n.startswith("sageattn"))
    return (f"sageattention {sage_version(mod)} ({sage_major(mod)}.x) from {getattr(mod, '__file__', '?')}: "
            + ", ".join(kernels))


@dataclass(frozen=True)
class SageMajor:
    """A check: the ``sageattention`` that imports here is major version ``major``; ``advice`` says what to use
    instead when it is the other one."""

    major: int
    advice: str = ""

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        mod, why = import_sageattention()
        if mod is None:
            return why
        found = sage_major(mod)
        if found == self.major:
            return None
        return (f"needs sageattention {self.major}.x; the installed one is {sage_version(mod)} "
                f"({'defines' if found == 2 else 'has no'} {V2_PREFIX}* kernels)"
                + (f": {self.advice}" if self.advice else ""))


def _sagev1(q, k, v, *, scale=None, is_causal=False):
    from sageattention import sageattn

    # sageattn smooths K in place (k -= mean): give it a copy so the caller's tensor is untouched.
    return sageattn(q, k.clone(), v, tensor_layout="HND", is_causal=is_causal, sm_scale=scale)


register(Backend(
    "sagev1", "SageAttention 1.x (sageattention package, Triton): INT8 Q·K, fp16 P·V", fn=_sagev1,
    kernel="sageattention.sageattn",
    constraints=(requires_package("sageattention", hint="pip install -e '.[sage]'"),
                 SageMajor(1, "2.x's sageattn runs SageAttention 2's kernels; use sagev2, or sagev2_triton for "
                              "1.x's algorithm (INT8 Q·K per block, fp16 P·V)"),
                 cuda(min_arch=(8, 0))),
    head_dims=(64, 96, 128), dtypes=ANY_FLOAT, twin="sagev1_emu",
    aliases=("sage", "sage_attn", "_sage_qk_int8_pv_fp16_triton"),
    no_lse_reason="sageattention 1.0.6's sageattn() has no log-sum-exp output",
    # int8 Q/K, fp16 V; its pre-pass (reads Q/K, writes int8) runs inside sageattn(), which exposes no way to
    # run it alone: counted in the bytes, not timed apart
    bench=BenchProfile(traffic((1, 1, 2), (1, 1, 0))),
    notes="quantization inside sageattn() (not timed apart)"))
