"""The family's own transformer-block forward (``Family.block_forward``), installed by a patch on every block of its
models beside the attention processors (``--fused_block``): the block's elementwise passes -- modulations, gated
residuals -- run as :mod:`vdbench.kernels.block`'s kernels where they can serve the call, else as the family's eager
expressions, each call counted (``PatchStats.block``), with why the first eager one could not be fused.

The block's layer norms (diffusers' ``FP32LayerNorm`` of the hidden state's fp32 copy) join the kernels too: torch's
layer norm computes the statistics of the bf16 hidden state itself, and a kernel normalizes it and modulates (or casts)
the result in one pass, the fp32 copy and the norm's fp32 output never written. That is exact only where torch's
statistics of the bf16 tensor equal those of its fp32 copy and its normalization is the kernel's arithmetic -- true
of torch's CUDA kernel where both calls take its vectorized path (:mod:`vdbench.kernels.block` says why), but a
property of torch's build and of the tensors' alignment, not a promise. So the first call of each form (the pass, the
shape, dtype and device, and whether torch's kernel vectorizes it) runs diffusers' norm on its real data beside the
fused one, compares the statistics and the outputs bit for bit and keeps the verdict: that call returns diffusers'
values, the later ones the kernel's where they were equal, diffusers' otherwise, with why (``PatchStats.block_norm_*``).
One layer norm more per form, per patch.

How it is installed: a block's forward is found where ``nn.Module.__call__`` reaches it -- the class's method, or,
where diffusers' hooks wrap the block (its context parallelism's split of the sequence on the first block, a step
cache's), the innermost reference their registry keeps to that method -- and replaced there alone, so every hook
still runs around it; removal puts the references back. Nothing global changes: other models, and other instances of
the block class, keep diffusers' forward.
"""

from __future__ import annotations

import threading
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
        self._verdicts: dict[tuple, tuple[Optional[str], bool]] = {}  # a norm's form -> (why not fused, fma)
        self._checking = threading.Lock()  # the guidance branches' threads (--guidance_overlap) check a form once
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

    def norm_modulate(self, x, norm, ln, table, temb, shift, scale, eager):
        """diffusers' ``(norm(x.float()) * (1 + scale) + shift).type_as(x)``: the norm fused with the modulation
        (:func:`~vdbench.kernels.block.norm_modulate`) where this call's form was checked equal, else the norm by
        diffusers and :meth:`modulate`. ``ln``: ``(eps, weight, bias)`` of the layer norm ``norm`` computes (torch's,
        of the fp32 copy, over the last dimension), None for another norm."""
        def unfused(n32):
            return self.modulate(n32, table, temb, shift, scale, x, eager)

        def fused(kernel, mean, rstd, fma):
            return kernel.norm_modulate(x, mean, rstd, table, temb, shift, scale)

        def why_not(kernel):
            if ln[1] is not None or ln[2] is not None:
                return "a norm with an affine before a modulation (the kernel normalizes without one)"
            return kernel.why_not_fused(x, table, temb)

        return self._norm("norm_modulate", x, norm, ln, unfused, fused, why_not)

    def norm(self, x, norm, ln):
        """diffusers' ``norm(x.float()).type_as(x)`` for a layer norm with a weight and a bias (Wan's cross-attention
        norm): one kernel (:func:`~vdbench.kernels.block.norm_affine`) where this call's form was checked equal, else
        diffusers'. ``ln`` as for :meth:`norm_modulate`."""
        def fused(kernel, mean, rstd, fma):
            return kernel.norm_affine(x, mean, rstd, ln[1], ln[2], fma=fma)

        def why_not(kernel):
            return kernel.why_not_normed(x, None, None, ln[1], ln[2])

        return self._norm("norm", x, norm, ln, lambda n32: n32.type_as(x), fused, why_not)

    def _norm(self, name, x, norm, ln, unfused, fused, why_not):
        """A norm pass: ``fused(kernel, mean, rstd, fma)`` where its form's verdict allows, else
        ``unfused(norm(x.float()))``; the first call of a form checks (:meth:`_check_norm`). ``why_not(kernel)``: why
        the kernel can't take this call's operands, None if it can."""
        kernel, fma = self._kernels(), True
        if ln is None:
            why = f"the norm is {type(norm).__name__}, not torch's layer norm of the fp32 copy"
        else:
            why = why_not(kernel)
        if why is None:
            key = (name, tuple(x.shape), x.dtype, x.device, kernel.layer_norm_paths(x, *ln[1:]))
            if key not in self._verdicts:
                with self._checking:
                    if key not in self._verdicts:
                        return self._check_norm(key, kernel, x, norm, ln, unfused, fused)
            why, fma = self._verdicts[key]
        if why is None:
            self._ready_once()
            mean, rstd = kernel.layer_norm_stats(x, ln[0])
            self._count(name, "fused")
            return fused(kernel, mean, rstd, fma)
        self._count(name, "eager")
        self._why_norm(why)
        return unfused(norm(x.float()))

    def _check_norm(self, key, kernel, x, norm, ln, unfused, fused):
        """The first call of a norm's form: diffusers' path on the real data (its values returned), beside the
        statistics of ``x`` and of its fp32 copy and the fused output from the former, compared bit for bit; the
        verdict kept (and recorded) for the form's later calls."""
        import torch

        eps, weight, bias = ln
        x32 = x.float()
        want = unfused(norm(x32))  # what the unfused path returns
        _, mean32, rstd32 = torch.native_layer_norm(x32, x.shape[-1:], weight, bias, eps)
        mean, rstd = kernel.layer_norm_stats(x, eps)
        why, fma = None, None
        if not (mean.dtype == mean32.dtype and torch.equal(mean, mean32.reshape(-1))
                and torch.equal(rstd, rstd32.reshape(-1))):
            why = f"layer norm statistics differ between {_name(x.dtype)} and fp32 inputs here" + (
                f" (torch's of the former in {_name(mean.dtype)})" if mean.dtype != mean32.dtype else "")
        why = why or kernel.why_not_normed(x, mean, rstd, *(() if weight is None else (weight, bias)))
        if why is None:
            self._ready_once()
            # an affine's product-sum: one fused multiply-add (what nvcc makes of torch's expression by default) or,
            # from a build that doesn't contract, two roundings
            fma = next((f for f in ((True, False) if weight is not None else (True,))
                        if torch.equal(fused(kernel, mean, rstd, f), want)), None)
            if fma is None:
                why = "the normalized values from torch's statistics differ from torch's layer norm here"
        self._verdicts[key] = (why, bool(fma))
        self.patch.stats.block_norm_checks.append(
            {"pass": key[0], "shape": list(key[1]), "dtype": _name(key[2]), "device": str(key[3]),
             "torch_paths": key[4], "fused": why is None, "fma": fma if why is None and weight is not None else None,
             "why": why})
        self._count(key[0], "eager")
        if why is not None:
            self._why_norm(why)
        return want

    def _kernels(self):
        """The kernels' module, imported once (Triton with it), not at every call."""
        if self._kernel is None:
            from ..kernels import block as kernel

            self._kernel = kernel
        return self._kernel

    def _ready_once(self) -> None:
        """The render's prewarm of the kernels, waited for before the first fused launch."""
        if self._ready is not None:
            ready, self._ready = self._ready, None
            ready()

    def _serving(self, x, table, temb, *rows):
        """The kernels' module where it serves this call (the render's prewarm waited for at the first), else None
        and why recorded (the first eager call's)."""
        kernel = self._kernels()
        why = kernel.why_not_fused(x, table, temb, *rows)
        if why is not None:
            if self.patch.stats.block_eager_why is None:
                self.patch.stats.block_eager_why = why
            return None
        self._ready_once()
        return kernel

    def _why_norm(self, why: str) -> None:
        if self.patch.stats.block_norm_why is None:
            self.patch.stats.block_norm_why = why

    def _count(self, kernel: str, form: str) -> None:
        self.patch.stats.block[kernel, form] += 1


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


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
