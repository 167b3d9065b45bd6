"""The family's own transformer-block forward (``Family.block_forward``), installed by a patch on every block of its
models beside the attention processors (``--fused_block``): the block's elementwise passes -- modulations, gated
residuals -- run as :mod:`vdbench.kernels.block`'s kernels where they can serve the call, else as the family's eager
expressions, each call counted (``PatchStats.block``), with why the first eager one could not be fused.

How it is installed: a block's forward is found where ``nn.Module.__call__`` reaches it -- the class's method, or,
where diffusers' hooks wrap the block (its context parallelism's split of the sequence on the first block, a step
cache's), the innermost reference their registry keeps to that method -- and replaced there alone, so every hook
still runs around it; removal puts the references back. Nothing global changes: other models, and other instances of
the block class, keep diffusers' forward.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch

__all__ = ["BlockForwards"]

_ABSENT = object()  # the block had no forward of its own (the class's ran): removal deletes ours


class BlockForwards:
    """``family``'s block forward on the blocks of a patch's models (:meth:`install`, :meth:`remove`), and the passes
    it hands over (:meth:`modulate`, :meth:`residual`), counted in ``patch.stats``. ``ready``: called once before
    the first fused call (the render's compile of the kernels ahead). ``unhooked``: blocks whose forward could not
    be found under the hooks that wrap them (they keep diffusers' forward), with why."""

    def __init__(self, patch, family, ready: Optional[Callable[[], Any]] = None):
        self.patch, self.family, self._ready = patch, family, ready
        self._saved: list[tuple[Any, str, Any]] = []  # (holder, attribute, what it held)
        self._kernel = None
        self.installed = 0
        self.unhooked: dict[str, int] = {}

    # ----- install / remove -----

    def install(self, models) -> int:
        """Install the family's forward on every block (a module whose class is one of ``family.block_classes``) of
        ``models`` (``(name, module)`` pairs); returns how many."""
        for _, model in models:
            for _, module in model.named_modules():
                if type(module).__name__ in self.family.block_classes:
                    self._install(module)
        return self.installed

    def _install(self, block: torch.nn.Module) -> None:
        original = types.MethodType(type(block).forward, block)
        forward_of = self.family.block_forward
        ours = _forward(self, block, original, forward_of)
        slots = _forward_slots(block)
        if not slots:
            why = "its forward is wrapped by hooks whose registry holds no reference to the block's method"
            self.unhooked[why] = self.unhooked.get(why, 0) + 1
            return
        for holder, attr in slots:
            self._saved.append((holder, attr, _ABSENT if holder is block else getattr(holder, attr)))
            setattr(holder, attr, ours)
        self.installed += 1

    def remove(self) -> None:
        for holder, attr, old in reversed(self._saved):
            if old is _ABSENT:
                holder.__dict__.pop(attr, None)
            else:
                setattr(holder, attr, old)
        self._saved.clear()
        self.installed = 0
        self.unhooked.clear()

    # ----- the passes the family's forward hands over -----

    def modulate(self, norm, table, temb, shift, scale, like, eager):
        """diffusers' modulation of ``norm`` (its fp32 output), rounded to ``like``'s dtype: the kernel where it can
        serve the call, else ``eager(norm, table, temb, shift, scale, like)``."""
        kernel = self._serving(like, table, temb, norm)
        if kernel is None:
            self._count("modulate", "eager")
            return eager(norm, table, temb, shift, scale, like)
        self._count("modulate", "fused")
        return kernel.modulate(norm, table, temb, shift, scale, like.dtype)

    def residual(self, x, y, table, temb, gate, eager):
        """diffusers' gated residual ``x + y * gate`` in ``x``'s dtype: the kernel where it can serve the call, else
        ``eager(x, y, table, temb, gate)``."""
        kernel = self._serving(x, table, temb, y)
        if kernel is None:
            self._count("residual", "eager")
            return eager(x, y, table, temb, gate)
        self._count("residual", "fused")
        return kernel.gated_residual(x, y, table, temb, gate)

    def _serving(self, x, table, temb, *rows):
        """The kernels' module where it serves this call (the render's prewarm waited for at the first), else None
        and why recorded (the first eager call's)."""
        kernel = self._kernel
        if kernel is None:  # imported once (Triton with it), not at every call
            from ..kernels import block as kernel

            self._kernel = kernel
        why = kernel.why_not_fused(x, table, temb, *rows)
        if why is not None:
            if self.patch.stats.block_eager_why is None:
                self.patch.stats.block_eager_why = why
            return None
        if self._ready is not None:
            ready, self._ready = self._ready, None
            ready()
        return kernel

    def _count(self, kernel: str, form: str) -> None:
        self.patch.stats.block[kernel, form] += 1


def _forward(ops: BlockForwards, block, original, forward_of):
    """The installed forward: the family's, with ``ops``; under torch.compile diffusers' own (``original``), whose
    expressions inductor fuses itself, and which dynamo traces without our kernels' launches and counters."""

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        return forward_of(block, *args, ops=ops, **kwargs)

    return forward


def _forward_slots(block) -> list[tuple[Any, str]]:
    """Where ``nn.Module.__call__`` reaches the block's own forward: the block's ``forward`` where nothing wraps it
    (no instance attribute: the class's method runs), else the references to the block's method that diffusers'
    hook registry keeps (``_diffusers_hook._fn_refs``: ``forward`` of the innermost hook, or ``original_forward`` of
    one that replaces the call); none found: []."""
    if "forward" not in block.__dict__:
        return [(block, "forward")]
    registry = getattr(block, "_diffusers_hook", None)
    cls_forward = type(block).forward
    slots = []
    for ref in getattr(registry, "_fn_refs", ()):
        for attr in ("forward", "original_forward"):
            f = getattr(ref, attr, None)
            if getattr(f, "__func__", None) is cls_forward and getattr(f, "__self__", None) is block:
                slots.append((ref, attr))
    return slots
