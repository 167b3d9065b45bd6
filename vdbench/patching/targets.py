"""What a patch is installed into, and whether its backend can run there.

A patch takes a diffusers pipeline, one transformer, or ``(name, module)`` pairs; ``as_models`` turns each into
the pairs. ``target_of`` reads where a model runs attention -- device, dtype, head dim -- from the model itself,
so the backend's availability is checked at install whatever the entry point (the CLIs check it earlier, before
the model loads; a library caller gets the same refusal before the first call instead of torch's "No viable
backend" halfway through a run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..backends import Backend
from ..offload import EXECUTION_DEVICE
from ..pipelines import transformers_of

__all__ = ["Target", "as_models", "target_of", "runs_on", "availability_problem"]

_ACCEPTED = "a diffusers pipeline, a transformer (torch.nn.Module) or (name, module) pairs"


@dataclass(frozen=True)
class Target:
    """Where one model runs attention. None: not found on the model (no parameters, no config)."""

    model: str
    device: Optional[torch.device]
    dtype: Optional[torch.dtype]
    head_dim: Optional[int]

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "dtype unknown"
        head = f", head dim {self.head_dim}" if self.head_dim is not None else ""
        device = self.device if self.device is not None else "default device"
        return f"{self.model} ({device}, {dtype}{head})"


def as_models(obj) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` pairs from a pipeline (its ``transformer`` and ``transformer_2``), one module (named
    "transformer", the name observers and captures see) or the pairs themselves."""
    if isinstance(obj, torch.nn.Module):
        return [("transformer", obj)]
    if hasattr(obj, "components") or hasattr(obj, "transformer"):  # a diffusers pipeline
        models = transformers_of(obj)
        if not models:
            raise TypeError(f"{type(obj).__name__} has no transformer (pipe.transformer / pipe.transformer_2) to "
                            "install an attention backend into")
        return models
    try:
        pairs = list(obj)
    except TypeError:
        raise TypeError(f"expected {_ACCEPTED}, got {type(obj).__name__}") from None
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.nn.Module)):
            raise TypeError(f"expected {_ACCEPTED}; an item of the sequence is {pair!r:.80}")
    return [tuple(pair) for pair in pairs]


def target_of(name: str, model: torch.nn.Module) -> Target:
    """Device, dtype and head dim of one model's attention.

    Device: where accelerate's CPU offload runs the model (its hook's ``execution_device``: the weights sit on
    the CPU until the forward), or vdbench's offload (:data:`vdbench.offload.EXECUTION_DEVICE`), else diffusers'
    ``model.device``, else the first parameter's. Dtype: diffusers'
    ``model.dtype`` (which skips ``_keep_in_fp32_modules`` and honours layerwise casting), else the first
    floating parameter's. Head dim: ``config.attention_head_dim``.
    """
    device = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    if device is None:  # vdbench's own offload (an expert waiting on the host, diffusers' group offload)
        device = getattr(model, EXECUTION_DEVICE, None)
    if device is None:
        device = getattr(model, "device", None)
    if not isinstance(device, (torch.device, str, int)):
        device = next((p.device for p in model.parameters()), None)
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    head_dim = getattr(getattr(model, "config", None), "attention_head_dim", None)
    return Target(name, torch.device(device) if device is not None else None, dtype,
                  head_dim if isinstance(head_dim, int) else None)


def runs_on(backend: Backend, target: Target) -> tuple[bool, str]:
    """(available, the registry's reason) for one backend on one target (unknown fields are not checked; an
    unknown device is the default one: CUDA when there is one)."""
    return backend.availability(target.device, target.dtype, target.head_dim)


def availability_problem(backend: Backend, models) -> Optional[tuple[Target, str]]:
    """The first model the backend can't run on, with the registry's reason; None when it runs on all."""
    for name, model in models:
        target = target_of(name, model)
        ok, reason = runs_on(backend, target)
        if not ok:
            return target, reason
    return None
