"""The library entry point: run a diffusers video pipeline with another attention kernel, and see what ran.

    import vdbench
    with vdbench.use_backend(pipe, "sagev1_emu") as patch:
        video = pipe("a cat", num_frames=9, height=64, width=96).frames
    print(patch.stats.calls)            # calls by the kernel that ran: {"emu.sagev1": 16}

``use_backend`` takes a diffusers pipeline (Wan, CogVideoX: its ``transformer`` and ``transformer_2``) or a
transformer module, refuses a backend that can't run on the model's device, dtype or head dim before any call
(one line: what can't run, why, what to try), and removes itself on exit, error or not. ``list_backends`` says
which names run where. The CLIs use the same machinery (``vdbench.patching``) with their own wording.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from .backends import Backend, BackendUnavailable, RequiresPackage, resolve, names
from .patching import AttentionPatch, CallInfo
from .patching.targets import Target, as_models, availability_problem, runs_on

__all__ = ["use_backend", "list_backends"]


@contextmanager
def use_backend(pipe_or_module, backend: str, on_unsupported: str = "error", *, time_attention: bool = False,
                observers: Optional[list[Callable[[CallInfo], Any]]] = None,
                fused_rope: bool = False, fused_block: bool = False) -> Iterator[AttentionPatch]:
    """Install ``backend`` into the pipeline's (or module's) attention for the ``with`` block; yields the patch.

    ``backend``: a name, a name with options (``"sta:window=3x3x3,tile=6x8x8"``) or a schedule
    (``"fav3@steps:0-9,sta"``; set ``patch.step`` as the denoising steps advance, as the render does from its
    step callback -- the library call alone does not know the step).

    ``patch.stats.calls`` / ``patch.calls``: calls by kernel label; ``patch.stats.calls_by_kind``: by self /
    cross / joint. ``on_unsupported="fallback:sdpa"`` runs the calls the backend can't serve (a mask, a head
    dim) on torch sdpa and counts them, instead of raising ``UnsupportedCall``. ``time_attention``: the summed
    attention time is in ``patch.stats.attention_time_s`` after the block. ``observers``: callables receiving a
    ``vdbench.patching.CallInfo`` (BHSD tensors) after every call. ``fused_rope``: a Wan transformer's
    self-attention rotates Q and K with one Triton kernel (``vdbench.kernels.rope``: diffusers' values bit for bit,
    on CUDA; the render's ``--fused_rope``), counted in ``patch.stats.rope``. ``fused_block``: a Wan transformer's
    blocks run the family's own forward, their modulations and gated residuals in Triton kernels
    (``vdbench.kernels.block``: diffusers' values bit for bit, on CUDA; the render's ``--fused_block``), counted in
    ``patch.stats.block``; a model whose family has no block forward is refused (ValueError). Under torch.compile the
    blocks run diffusers' forward (inductor fuses it), uncounted.

    Raises ``BackendUnavailable`` on entry, before the model is touched, when the backend can't run here.
    """
    patch = AttentionPatch(pipe_or_module, backend, on_unsupported, observers=observers,
                           time_attention=time_attention, fused_rope=fused_rope, fused_block=fused_block)
    for member in patch.schedule.members:  # a schedule ("fav3@steps:0-9,sta"): every backend it names
        problem = availability_problem(member, patch.models)
        if problem is not None:
            raise BackendUnavailable(unavailable_message(member, *problem, patch.models))
    patch.install()
    try:
        yield patch
        patch.finish_timing()  # a no-op unless time_attention; skipped on error (no device sync over a failure)
    finally:
        patch.remove()


def list_backends(pipe_or_module=None, *, device=None, dtype=None, head_dim=None) -> dict[str, tuple[bool, str]]:
    """Every backend name -> (runs here, why not / "ok"). With a pipeline or transformer: on its device, dtype and
    head dims; otherwise on ``device`` (default: CUDA when there is one, else the CPU), ``dtype`` and
    ``head_dim`` where given."""
    if pipe_or_module is None:
        target = Target("", device, dtype, head_dim)
        return {name: runs_on(resolve(name), target) for name in names()}
    models = as_models(pipe_or_module)
    out = {}
    for name in names():
        problem = availability_problem(resolve(name), models)
        out[name] = (True, "ok") if problem is None else (False, f"{problem[0]}: {problem[1]}")
    return out


def unavailable_message(backend: Backend, target: Target, reason: str, models) -> str:
    """One line for a library user: what can't run and why, then what to try -- the entry's emulated twin, its
    install hint (registry fields where present), the backends that do run on this model."""
    tries = []
    twin = backend.twin
    if twin:
        tries.append(f"'{twin}' (its numerics emulated in torch, runs anywhere)")
    if _installing_would_help(backend, target):
        tries.append(f"installing it ({backend.install_hint})")
    here = [name for name, (ok, _) in list_backends(models).items() if ok]
    tries.append(f"one that runs here: {', '.join(here)}" if here else "vdbench.list_backends() on another device")
    return (f"vdbench.use_backend: '{backend.name}' ({backend.description}) can't run on {target}: {reason}. "
            f"Try {'; or '.join(tries)}.")


def _installing_would_help(backend: Backend, target: Target) -> bool:
    """Whether the missing piece is the kernel's package: none of its modules is importable, and the model is on
    a device the kernel can use at all (no point suggesting a CUDA-only package for a CPU model)."""
    device = target.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    missing = [c for c in backend.constraints if isinstance(c, RequiresPackage) and c(device, None, None)]
    others = [c for c in backend.constraints if not isinstance(c, RequiresPackage)]
    return bool(missing) and not any(c(device, target.dtype, target.head_dim) for c in others)
