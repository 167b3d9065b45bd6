"""The project's own Triton attention kernels (vdbench.kernels): availability through their probe (a GPU, or
Triton's interpreter on a CPU), the forward and the quantization pre-pass imported at call time -- importing
``vdbench.kernels`` never imports triton, its kernel modules do."""

from __future__ import annotations

from typing import Callable

from vdbench import kernels

from .registry import HALF, Backend, probe, register, requires_package, traffic

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


def _entry(name: str, description: str, **kw) -> Backend:
    return Backend(name, description, fn=_forward(name), kernel=f"vdbench.{name}", dtypes=HALF, head_dims=(64, 128),
                   constraints=(requires_package("triton", hint="pip install -e '.[test]'"),
                                probe(_probe(name))),
                   no_lse_reason=_NO_LSE, **kw)


register(_entry(
    "fav3_sage", "the project's Triton kernel: INT8 Q·K per block (K smoothed), exp2 softmax, e4m3 P·V with a "
    "per-channel V scale",
    # int8 Q/K, e4m3 V; the pre-pass reads Q once, K twice (its mean, then the quantization), V twice (its
    # per-channel amax, then the quantization), and writes each in one byte
    bytes_model=traffic((1, 1, 1), (1, 2, 2)), prepass=_prepass("fav3_sage"),
    notes="quantization pre-pass (Triton) inside the call"))
register(_entry(
    "fp8_triton", "the project's Triton kernel: e4m3 Q/K/V with one scale per tile of tokens (K smoothed), e4m3 P",
    # e4m3 Q/K/V; the pre-pass reads K twice (its mean), V once (per-block scales computed in the pass)
    bytes_model=traffic((1, 1, 1), (1, 2, 1)), prepass=_prepass("fp8_triton"),
    notes="quantization pre-pass (Triton) inside the call"))
register(_entry("fav2_triton", "the project's Triton kernel: plain bf16/fp16 flash-attention forward"))
