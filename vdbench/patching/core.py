"""``AttentionPatch``: install a backend into a model's attention processors, count what ran, remove it after.

For each attention module of the model (``module.processor``), the patch makes a copy of the processor whose
``__call__`` is the *same code* rebound to a globals dict of its own, in which the processor's route to attention
is ours. The route is read from the processor's code and served by one adapter (``adapter.py``): diffusers'
dispatcher, ``F.scaled_dot_product_attention`` or xfuser's registry. Nothing global is mutated (xfuser's
registry aside, which the patch restores): other models of the process keep their attention, and removing the
patch is putting the original processor objects back. The rebound copy keeps the original signature, so
diffusers' keyword filtering of processor arguments sees no difference, and the cost per call is one extra
Python function call.

Here live the parts every route shares: install / remove, the bookkeeping (counts by kernel, kind and step, block
pairs computed, timing, observers), the refusal of calls the backend can't serve (``serve``) and the path under
torch.compile (one opaque ``vdbench::attention`` op per call). A patch holds a :class:`~.schedule.Schedule` -- one
backend, or several chosen per call by (step, layer) -- and ``backend`` is the one serving the call in progress;
backends that need the token grid get their calls through the model's grid hooks (``grids.py``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import threading
import time
import types
from collections import Counter
from typing import Any, Callable, Optional

import torch

from .. import families
from ..backends import Backend, BackendUnavailable, LSEForm, UnsupportedCall
from ..sparse import BlockStats
from .adapter import Adapter
from .blocks import BlockForwards
from .calls import CallInfo, PatchStats, call_args, torch_sdpa
from .calls import call_kind as default_call_kind
from .dispatcher import DispatcherAdapter
from .grids import GridStates
from .schedule import Schedule, as_schedule, layer_index
from .sdpa import SdpaAdapter
from .targets import as_models, availability_problem
from .xfuser import XfuserAdapter

__all__ = ["AttentionPatch", "install_backend", "attention_modules", "adapter_for", "ADAPTERS",
           "ON_UNSUPPORTED_CHOICES"]

ON_UNSUPPORTED_CHOICES = ("error", "fallback:sdpa")

# Tried in this order: an xfuser processor may read F too, a dispatcher processor may too (F.gelu ...), so the
# sdpa route is asked last.
ADAPTERS: tuple[type[Adapter], ...] = (XfuserAdapter, DispatcherAdapter, SdpaAdapter)


def family_of(models) -> Optional[families.Family]:
    """The one registered model family whose transformer classes all of ``models`` are; None when a model is no
    family's (or they are several families')."""
    found = set()
    for _, model in models:
        try:
            found.add(families.for_transformer(model))
        except ValueError:
            return None
    return found.pop() if len(found) == 1 else None


def no_grid_hooks(model, spec, **kwargs):
    """The grid hooks of a transformer whose family has none (or no registered family claims it): refused."""
    raise TypeError(f"{type(model).__name__} has no known token grid (no registered model family with grid hooks "
                    "uses its class)")


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules of ``model`` that carry a diffusers attention processor."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "processor", None) is not None
            and callable(getattr(m, "processor"))]


def adapter_for(proc) -> type[Adapter]:
    """The adapter of the route by which this processor reaches attention (read from its code, not guessed)."""
    names = type(proc).__call__.__code__.co_names
    for adapter in ADAPTERS:
        if adapter.reaches(names):
            return adapter
    raise TypeError(f"don't know how attention processor {type(proc).__name__} calls attention "
                    "(neither dispatch_attention_fn nor F.scaled_dot_product_attention in its code)")


class AttentionPatch:
    """Context manager: ``with AttentionPatch(pipe, "sagev1_emu") as patch: pipe(...)``.

    ``models``: a diffusers pipeline (its ``transformer`` and ``transformer_2``), one transformer, or
    ``(name, module)`` pairs, e.g. ``[("transformer", pipe.transformer), ("transformer_2", ...)]``.
    ``observers``: callables receiving a ``CallInfo`` after every call (capture uses this).
    ``time_attention``: time every attention call (CUDA events on GPU, a host clock on CPU where calls are
    synchronous); ``finish_timing()`` sums them after the run.

    ``install()`` refuses (``BackendUnavailable``, with the reason) a backend that can't run on the models'
    device, dtype or head dim, before touching them. A call the backend cannot serve exactly as asked (a mask,
    dropout, a dtype or head dim it lacks) raises ``UnsupportedCall`` -- there is no silent fallback -- unless
    ``on_unsupported="fallback:sdpa"``, in which case the call runs on torch sdpa and is counted under
    ``fallback:sdpa`` so the report shows it.

    ``backend``: a name (options allowed: ``sta:window=3x3x3``), an entry, or a schedule (``"fav3@steps:0-9,sta"``,
    :mod:`vdbench.patching.schedule`). ``call_kind``: the model family's classifier of a processor call
    (``Family.call_kind``); ``grid_hooks``: its token-grid hooks (``Family.grid_hooks``) for backends that need
    the grid. ``family``: the model family (:class:`vdbench.families.Family`) these come from, with its Ulysses
    self-attention (``--ulysses_async``). Neither given: the family of the patched transformers is asked
    (``families.for_transformer``, by their class); for a transformer no registered family claims, calls are
    classified by the attention module alone (:func:`vdbench.patching.calls.call_kind`) and a grid backend is
    refused.
    ``tile_order_once``: allow the once-per-forward tile order (False under torch.compile, beside a step cache and
    under context parallelism: per call).
    ``before_first_call``: called once, before the first call a backend serves (the render waits there for the
    backend's first-call kernels compiled ahead: :mod:`vdbench.backends.prewarm`).
    ``fused_rope``: the family's processor (``Family.self_attention`` on one GPU, its Ulysses form under context
    parallelism) rotates Q and K with :mod:`vdbench.kernels.rope` (:meth:`rope`; the RoPE's values unchanged, bit for
    bit); ``rope_ready``: called once before the first such call (the render's compile of it ahead).
    ``fused_block``: every transformer block runs the family's own forward (``Family.block_forward``), its norms,
    modulations and gated residuals in :mod:`vdbench.kernels.block` (:class:`~.blocks.BlockForwards`; the values
    unchanged, bit for bit), counted in ``stats.block``; ``block_ready``: as ``rope_ready``, for those kernels.

    What the adapters use: ``serve`` (run one call on the backend), ``timed``, ``record``, ``compiled_call``,
    ``passthrough`` / ``backend`` (of the call in progress) and ``context`` (model, layer, kind of the processor
    call in progress).
    """

    def __init__(self, models, backend: str | Backend | Schedule, on_unsupported: str = "error",
                 observers: Optional[list[Callable[[CallInfo], Any]]] = None, time_attention: bool = False,
                 call_kind: Optional[Callable[[str, Any, Any], str]] = None,
                 grid_hooks: Optional[Callable[..., Any]] = None, tile_order_once: bool = True,
                 before_first_call: Optional[Callable[[], Any]] = None, family: Optional[families.Family] = None,
                 fused_rope: bool = False, rope_ready: Optional[Callable[[], Any]] = None,
                 fused_block: bool = False, block_ready: Optional[Callable[[], Any]] = None):
        if on_unsupported not in ON_UNSUPPORTED_CHOICES:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED_CHOICES}, got {on_unsupported!r}")
        self.schedule = as_schedule(backend)
        self._single = self.schedule.rules[0].backend if self.schedule.is_single else None
        self.models = as_models(models)
        if family is None and not (call_kind and grid_hooks):
            family = family_of(self.models)
        self._ulysses_self_attention = family.ulysses_self_attention if family else None
        # the family's one-GPU self-attention, run instead of diffusers' processor only for its fused RoPE
        self._self_attention = family.self_attention if family and fused_rope else None
        self.fused_rope = fused_rope
        self._rope_ready = rope_ready  # called once before the first fused RoPE (the render's kernel prewarm)
        if fused_block and (family is None or family.block_forward is None):
            raise ValueError(f"fused_block: {'model family ' + repr(family.name) if family else 'this model'} has no "
                             "block forward of its own (Family.block_forward); diffusers' blocks run as they are")
        self.blocks = BlockForwards(self, family, block_ready) if fused_block else None
        self.call_kind = call_kind or (family.call_kind if family else default_call_kind)
        self.grid_hooks = grid_hooks or (family.grid_hooks if family and family.grid_hooks else no_grid_hooks)
        self.tile_order_once = tile_order_once
        self._grids = GridStates()
        self._lse: dict[tuple[str, str], LSEForm] = {}  # (backend, device type) -> its LSE form, at first use
        self.on_unsupported = on_unsupported
        self.observers = list(observers or [])
        self.time_attention = time_attention
        self.stats = PatchStats(self.schedule.name)
        self.step = 0
        self._now = _InProgress()  # the processor call in progress: layer_index, context, _sub (per thread)
        self.adapters: dict[str, Adapter] = {}  # by mode, those this patch's processors use
        self._saved: list[tuple[torch.nn.Module, Any]] = []
        self._events: list = []
        self._host_time = 0.0
        self._classes: dict[type, type] = {}
        self._modules: list[str] = []  # sys.modules entries holding the rebound globals (see _patched_processor)
        self.installed = False
        self._before_first_call = before_first_call

    # the processor call in progress, per host thread (two guidance branches interleave their calls under
    # --guidance_overlap): its block index (None: unknown), (model, layer, kind), and the attention calls made so far
    layer_index = property(lambda self: self._now.layer_index, lambda self, v: setattr(self._now, "layer_index", v))
    context = property(lambda self: self._now.context, lambda self, v: setattr(self._now, "context", v))
    _sub = property(lambda self: self._now.sub, lambda self, v: setattr(self._now, "sub", v))

    @property
    def calls(self) -> Counter:
        """Calls so far by the label of the kernel that ran (``stats.calls``)."""
        return self.stats.calls

    @property
    def backend(self) -> Backend:
        """The backend serving the call in progress (the schedule's choice for this step and block)."""
        if self._single is not None:
            return self._single
        return self.schedule.at(self.step, self.layer_index, self.context[2])

    @property
    def passthrough(self) -> bool:
        """A pass-through entry ('default') serves this call: the pipeline's own attention runs, counted."""
        return self.backend.passthrough

    # ----- install / remove -----

    def __enter__(self):
        if not self.installed:  # install_backend() hands back a patch already installed
            self.install()
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def install(self):
        if self.installed:
            raise RuntimeError("AttentionPatch is already installed")
        for backend in self.schedule.members:
            problem = availability_problem(backend, self.models)
            if problem is not None:
                target, reason = problem
                raise BackendUnavailable(f"attention backend '{backend.name}' can't run on {target}: {reason}")
        self.schedule.check_layers(layer_index(layer) for _, model in self.models
                                   for layer, _ in attention_modules(model))
        n = 0
        try:
            if any(b.sparse is not None for b in self.schedule.members):
                self._grids.install(self.models, self.schedule, self.grid_hooks, lambda: self.step,
                                    self.tile_order_once)
            for model_name, model in self.models:
                for layer, module in attention_modules(model):
                    self._saved.append((module, module.processor))
                    module.processor = self._patched_processor(module.processor, model_name, layer)
                    n += 1
            if n == 0:
                raise RuntimeError("no attention processors found in " + ", ".join(m for m, _ in self.models))
            for adapter in self.adapters.values():
                adapter.install()
            if self.blocks is not None:
                self.blocks.install(self.models)
        except BaseException:
            self.remove()
            raise
        self._op_id = next(_OP_IDS)
        _LIVE_PATCHES[self._op_id] = self
        self.installed = True
        self.n_modules = n

    def remove(self):
        if self.blocks is not None:
            self.blocks.remove()
        for module, proc in reversed(self._saved):
            module.processor = proc
        self._saved.clear()
        self._grids.remove()
        for adapter in self.adapters.values():
            adapter.remove()
        self.adapters.clear()
        _LIVE_PATCHES.pop(getattr(self, "_op_id", None), None)
        for name in self._modules:
            sys.modules.pop(name, None)
        self._modules.clear()
        self._classes.clear()
        self.installed = False

    def _patched_processor(self, proc, model_name: str, layer: str):
        cls = type(proc)
        if cls not in self._classes:
            route = adapter_for(proc)
            adapter = self.adapters.get(route.mode)
            if adapter is None:
                adapter = self.adapters[route.mode] = route(self)
            orig_call = cls.__call__
            # The copied globals live in a module of their own, registered in sys.modules under a unique
            # name: torch.compile (dynamo) guards globals through ``sys.modules[__name__]``, and with the
            # original module's name its guards would read the *unpatched* module and fail.
            mod_name = f"vdbench._patched_{id(self):x}_{cls.__module__.replace('.', '_')}_{cls.__name__}"
            mod = types.ModuleType(mod_name)
            g = mod.__dict__
            g.update(orig_call.__globals__)
            g["__name__"] = mod_name
            adapter.rebind(g)
            sys.modules[mod_name] = mod
            self._modules.append(mod_name)
            rebound = types.FunctionType(orig_call.__code__, g, orig_call.__name__, orig_call.__defaults__,
                                         orig_call.__closure__)
            rebound.__kwdefaults__ = orig_call.__kwdefaults__
            # A closure-free copy of _patched_call per class, so it can carry the original signature (diffusers
            # filters processor kwargs by it) and torch.compile can trace it (it can't guard such closures).
            call = types.FunctionType(_patched_call.__code__, _patched_call.__globals__, "__call__")
            call.__signature__ = inspect.signature(orig_call)
            # the family's own self-attention under --ulysses_async (its exchange beside the projections), where
            # the route and the family have one; it declines (NotImplemented) the calls it doesn't cover
            make, plain = self._ulysses_self_attention, self._self_attention
            fast = (functools.partial(adapter.family_call, make, plain) if (make or plain) is not None
                    and hasattr(adapter, "family_call") else None)
            self._classes[cls] = type(f"Patched{cls.__name__}", (cls,), {
                "__call__": call, "_vd_rebound": staticmethod(rebound), "_vd_mode": adapter.mode,
                "_vd_fast": staticmethod(fast) if fast is not None else None})
        new = object.__new__(self._classes[cls])
        new.__dict__.update(proc.__dict__)
        new._vd_model, new._vd_layer, new._vd_patch = model_name, layer, self
        new._vd_layer_index = layer_index(layer)
        return new

    # ----- serving one call -----

    def serve(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, need_lse=False, tag=""):
        """Run one call (BHSD) on the backend and count it; with ``need_lse``, return (out, lse) from the
        kernel's own log-sum-exp form (ring attention), or refuse. ``tag``: the parallel path (``path_tag``)."""
        if self._before_first_call is not None:
            hook, self._before_first_call = self._before_first_call, None
            hook()
        b = self.backend
        if need_lse:  # ring attention: the kernel's own log-sum-exp, or a refusal (never recomputed beside it)
            form = self._lse_form(b, q.device)
            b.check_call(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         enable_gqa=enable_gqa)
            lse_fn = form.fn
            res = self.timed(lambda: lse_fn(q, k, v, scale=scale, is_causal=is_causal), q)
            self.record(form.call_label(q) + tag, q, k, v, res[0], bshd=False,
                        args=call_args(None, dropout_p, is_causal, scale))
            return res
        args = call_args(attn_mask, dropout_p, is_causal, scale)
        try:
            b.check_call(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         enable_gqa=enable_gqa)
        except UnsupportedCall as e:
            where = f"{self.context[0]}.{self.context[1]} ({self.context[2]}-attention), step {self.step}"
            if b.sparse is not None and self._grids.tile_ordered(b, self.context[0]):
                raise UnsupportedCall(f"{e} — in {where}, whose tokens are in the pattern's tile order (padded), "
                                      "where torch sdpa can't stand in; no fallback is possible") from None
            if self.on_unsupported == "error":
                raise UnsupportedCall(f"{e} — in {where}. Refusing rather than falling back silently; "
                                      "pass --on_unsupported fallback:sdpa (on_unsupported='fallback:sdpa' in "
                                      "vdbench.use_backend) to run such calls on torch sdpa "
                                      "(they are counted and reported)") from None
            self.stats.fallbacks += 1
            out = self.timed(lambda: torch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa), q)
            self.record("fallback:sdpa", q, k, v, out, bshd=False, args=args)
            return out
        if b.sparse is not None:  # the pattern needs the grid: through the model's grid hooks
            model, kind = self.context[0], self.context[2]
            if self._grids.tile_ordered(b, model):  # observers (captures) see tokens in the pattern's tile order
                args = {**args, "tile_order": str(b.sparse.spec)}
            out, label, blocks = self.timed(
                lambda: self._grids.attend(b, model, kind, q, k, v, scale, is_causal), q)
            self.record(label + tag, q, k, v, out, bshd=False, args=args, blocks=blocks)
            return out
        label = b.call_label(q, k, v, None, 0.0, is_causal, scale)
        kernel_fn = b.fn  # a local: torch.compile can't guard a function read off the frozen dataclass
        out = self.timed(lambda: kernel_fn(q, k, v, scale=scale, is_causal=is_causal), q)
        self.record(label + tag, q, k, v, out, bshd=False, args=args)
        return out

    def _lse_form(self, backend: Backend, device: torch.device) -> LSEForm:
        """The backend's log-sum-exp form on ``device``, looked up once per patch (not per ring-attention call)."""
        key = (backend.name, device.type)
        form = self._lse.get(key)
        if form is None:
            try:
                form = self._lse[key] = backend.lse_form(device)
            except BackendUnavailable as e:
                raise UnsupportedCall(f"ring attention needs the log-sum-exp: {e}") from None
        return form

    def compiled_call(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, mode: str,
                      parallel: bool = False):
        """Under torch.compile: one opaque ``vdbench::attention`` op per call (BSHD in, BSHD out).

        Why an op: dynamo would otherwise trace the bookkeeping (counters, events, observers) into the graph,
        guard on the counters' values and recompile on every call, and the kernel packages' Python wrappers
        are not all traceable. An opaque op keeps the kernel and its bookkeeping running for real at every
        call, with no graph break around it. What the op needs to label the call (model, kind) is resolved
        here, at trace time, where it is a constant of the call site -- not the layer name, which differs per
        block and would make dynamo recompile each repeated block (captures therefore run eagerly).

        ``parallel``: the call is a context-parallel one (the shard of the sequence this rank holds): the op's body
        runs the route's whole parallel attention -- its collectives and our kernel inside -- eagerly, as one op.
        """
        model = self.context[0]
        kind = self._next_kind()
        return torch.ops.vdbench.attention(q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                                           None if scale is None else float(scale), bool(enable_gqa),
                                           self._op_id, model, kind, mode, bool(parallel))

    def _op_call(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, model, kind, mode, parallel):
        """The eager body of ``vdbench::attention`` (runs at every call of a compiled graph)."""
        self.context = (model, "?", kind)
        out = self.adapters[mode].op_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          parallel=parallel)
        return out.contiguous()  # the layout the op's fake implementation promises

    # ----- bookkeeping -----

    def rope(self, x, freqs_cos, freqs_sin, dst, eager) -> None:
        """The rotary embedding of ``x`` into ``dst`` for the family's processor: the fused kernel
        (:func:`vdbench.kernels.rope.rope_pairs`, the eager values bit for bit) under ``fused_rope`` where it can
        serve the call, else ``eager`` (the family's expressions); counted either way, with why the first eager
        one could not be fused."""
        why = "off (--fused_rope off)"
        if self.fused_rope:
            kernel = self.__dict__.get("_rope_kernel")
            if kernel is None:  # imported once (Triton with it), not at every call
                from ..kernels import rope as kernel

                self._rope_kernel = kernel
            why = kernel.why_not_fused(x, freqs_cos, freqs_sin, dst)
            if why is None:
                if self._rope_ready is not None:
                    ready, self._rope_ready = self._rope_ready, None
                    ready()
                kernel.rope_pairs(x, freqs_cos, freqs_sin, out=dst)
                self.stats.rope["fused"] += 1
                return
        eager(x, freqs_cos, freqs_sin, dst)
        self.stats.rope["eager"] += 1
        if self.stats.rope_eager_why is None:
            self.stats.rope_eager_why = why

    def timed(self, fn, like: torch.Tensor):
        """Run ``fn()``; when timing was asked, time it (CUDA events on ``like``'s GPU, else a host clock)."""
        if not self.time_attention:
            return fn()
        if like.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn()
        self._host_time += time.perf_counter() - t0
        return out

    def finish_timing(self) -> Optional[float]:
        """Total attention time in seconds (synchronizes the device once, after the run)."""
        if not self.time_attention:
            return None
        total = self._host_time
        if self._events:
            torch.cuda.synchronize()
            total += sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        self.stats.attention_time_s = total
        return total

    def reset_counts(self):
        """Start a new repetition: counts, timing and step back to zero."""
        self.stats = PatchStats(self.schedule.name)
        self._events.clear()
        self._host_time = 0.0
        self.step = 0

    def _next_kind(self) -> str:
        """The kind of the attention call in progress; counts it within its processor call. A processor call the
        family classifies "cross+img" makes two calls, image context first (-> cross_img, cross)."""
        kind = self.context[2]
        if kind == "cross+img":
            kind = "cross_img" if self._sub == 0 else "cross"
        self._sub += 1
        return kind

    def record(self, label, q, k, v, out, *, bshd: bool, args: dict, blocks: Optional[BlockStats] = None):
        """Count one call under ``label``, its kind and the step, tally its block pairs (``blocks``: a sparse
        call's own; else dense on the call's lengths), and hand it to the observers (as BHSD)."""
        model, layer, _ = self.context
        kind = self._next_kind()
        self.stats.calls[label] += 1
        self.stats.calls_by_kind[kind] += 1
        self.stats.calls_by_step[self.step][label] += 1
        self.stats.calls_by_denoiser[model][label] += 1
        seq = 1 if bshd else 2
        self.stats.tally(label, kind, blocks or BlockStats.dense_call(q.shape[seq], k.shape[seq]))
        if self.observers:
            tr = (lambda t: t.transpose(1, 2)) if bshd else (lambda t: t)
            info = CallInfo(index=sum(self.stats.calls.values()) - 1, layer=layer, kind=kind, step=self.step,
                            model=model, kernel=label, query=tr(q), key=tr(k), value=tr(v), output=tr(out),
                            args=args)
            for obs in self.observers:
                obs(info)


class _InProgress(threading.local):
    """An :class:`AttentionPatch`'s processor call in progress, one per host thread."""

    def __init__(self):
        self.layer_index: Optional[int] = None
        self.context = ("?", "?", "?")
        self.sub = 0


_LIVE_PATCHES: dict[int, "AttentionPatch"] = {}
_OP_IDS = itertools.count(1)


@torch.library.custom_op("vdbench::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool, patch_id: int,
                  model: str, kind: str, mode: str, parallel: bool) -> torch.Tensor:
    """An installed patch's attention as one op torch.compile does not trace into (BSHD in and out)."""
    patch = _LIVE_PATCHES.get(patch_id)
    if patch is None:
        raise RuntimeError(f"vdbench::attention called for patch {patch_id}, which is no longer installed "
                           "(a compiled graph outlived its AttentionPatch)")
    return patch._op_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, model, kind, mode, parallel)


@_attention_op.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, patch_id, model, kind, mode, parallel):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _patched_call(self_, attn, hidden_states, *args, **kwargs):
    """The patched processors' ``__call__``: note where we are (model, layer, kind), run the rebound original."""
    ehs = kwargs.get("encoder_hidden_states", args[0] if args else None)
    patch = self_._vd_patch
    kind = patch.call_kind(self_._vd_mode, attn, ehs)
    # Under compile the layer name is not read: it differs per repeated block and dynamo would guard on it.
    compiling = torch.compiler.is_compiling()
    layer = "?" if compiling else self_._vd_layer
    patch.layer_index = None if compiling else self_._vd_layer_index
    patch.context = (self_._vd_model, layer, kind)
    patch._sub = 0
    fast = type(self_)._vd_fast
    if fast is not None and not compiling and kind == "self":
        out = fast(self_, attn, hidden_states, *args, **kwargs)
        if out is not NotImplemented:
            return out
    return type(self_)._vd_rebound(self_, attn, hidden_states, *args, **kwargs)


def install_backend(models, backend: str | Backend, **kwargs) -> AttentionPatch:
    """Build and install an ``AttentionPatch`` now; ``remove()`` it after (or use it in a ``with`` block, which
    removes it on exit). ``vdbench.use_backend`` is the context-manager form for library callers."""
    p = AttentionPatch(models, backend, **kwargs)
    p.install()
    return p
