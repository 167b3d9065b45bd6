"""Install an attention backend into a pipeline for the duration of a run, count what ran, remove it after.

One mechanism serves both ways diffusers' video models call attention:

* **dispatcher** — Wan's ``WanAttnProcessor`` calls ``dispatch_attention_fn(query, key, value, ...)`` with
  BSHD tensors (diffusers' attention dispatcher);
* **sdpa** — CogVideoX's ``CogVideoXAttnProcessor2_0`` calls ``F.scaled_dot_product_attention(query=...,
  key=..., value=...)`` directly, by keyword, with BHSD tensors.

For each attention module of the model (``module.processor``), the patch makes a copy of the processor whose
``__call__`` is the *same code* rebound to a globals dict in which ``dispatch_attention_fn`` (or ``F``) is
ours. Nothing global is mutated: ``torch.nn.functional`` stays untouched for every other module of the
process, other models in the process keep their attention, and removing the patch is putting the original
processor objects back. The rebound copy keeps the original signature, so diffusers' keyword filtering of
processor arguments sees no difference, and the cost per call is one extra Python function call.

Every call is counted by the kernel that actually ran (``PatchStats.calls``). A call the backend cannot
serve exactly as asked (a mask, dropout, a dtype or head dim it lacks) raises ``UnsupportedCall`` — there is
no silent fallback — unless ``on_unsupported="fallback:sdpa"``, in which case the call runs on torch sdpa and
is counted under ``fallback:sdpa`` so the report shows it.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from .backends import Backend, UnsupportedCall, get_backend, sdpa_kernel_choice
from .parallel import sequence_layout

__all__ = ["AttentionPatch", "CallInfo", "PatchStats", "install_backend", "attention_modules",
           "ON_UNSUPPORTED_CHOICES"]

ON_UNSUPPORTED_CHOICES = ("error", "fallback:sdpa")


@dataclass
class CallInfo:
    """What an observer (capture, bench recorders) sees of one attention call. Tensors are BHSD."""

    index: int
    layer: str
    kind: str  # "self", "cross", "cross_img" (Wan i2v image context), "joint" (CogVideoX text+video)
    step: int
    model: str  # "transformer" / "transformer_2"
    kernel: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    args: dict  # the call's non-tensor arguments (scale, is_causal, dropout_p, has_mask, ...)


@dataclass
class PatchStats:
    backend: str
    calls: Counter = field(default_factory=Counter)  # by kernel label
    calls_by_kind: Counter = field(default_factory=Counter)
    fallbacks: int = 0
    attention_time_s: Optional[float] = None  # filled by ``finish_timing`` when timing was asked

    def as_dict(self) -> dict:
        return {"backend": self.backend, "calls_by_kernel": dict(self.calls),
                "calls_by_kind": dict(self.calls_by_kind), "total_calls": sum(self.calls.values()),
                "fallback_calls": self.fallbacks, "attention_time_s": self.attention_time_s}


class _FProxy:
    """Stands in for ``torch.nn.functional`` inside one rebound processor: everything but sdpa delegates."""

    def __init__(self, sdpa: Callable):
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name):
        return getattr(F, name)


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules of ``model`` that carry a diffusers attention processor."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "processor", None) is not None
            and callable(getattr(m, "processor"))]


def _call_mode(proc) -> str:
    """How this processor reaches attention: 'dispatcher' or 'sdpa' (read from its code, not guessed)."""
    code = type(proc).__call__.__code__
    if ("attention_function" in code.co_names or "USP" in code.co_names) and "dispatch_attention_fn" not in code.co_names:
        return "xfuser"  # xDiT's processors call USP (directly, or as self.attention_function) -> its registry
    if "dispatch_attention_fn" in code.co_names:
        return "dispatcher"
    if "F" in code.co_names or "scaled_dot_product_attention" in code.co_names:
        return "sdpa"
    raise TypeError(f"don't know how attention processor {type(proc).__name__} calls attention "
                    "(neither dispatch_attention_fn nor F.scaled_dot_product_attention in its code)")


class AttentionPatch:
    """Context manager: ``with AttentionPatch(models, "sagev1_emu") as patch: pipe(...)``.

    ``models``: (name, module) pairs, e.g. ``[("transformer", pipe.transformer), ("transformer_2", ...)]``.
    ``observers``: callables receiving a ``CallInfo`` after every call (capture uses this).
    ``time_attention``: time every attention call (CUDA events on GPU, a host clock on CPU where calls are
    synchronous); ``finish_timing()`` sums them after the run.
    ``call_kind``: ``(mode, attn, encoder_hidden_states) -> 'self' | 'cross' | 'joint'`` for one processor call,
    the model family's classifier (``vdbench.families.Family.call_kind``); default :func:`_call_kind`, which
    tells the two families' modules apart by their ``is_cross_attention``.
    """

    def __init__(self, models: Iterable[tuple[str, torch.nn.Module]], backend: str | Backend,
                 on_unsupported: str = "error", observers: Optional[list[Callable[[CallInfo], Any]]] = None,
                 time_attention: bool = False, call_kind: Optional[Callable[[str, Any, Any], str]] = None):
        if on_unsupported not in ON_UNSUPPORTED_CHOICES:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED_CHOICES}, got {on_unsupported!r}")
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend)
        self.models = list(models)
        self.on_unsupported = on_unsupported
        self.observers = list(observers or [])
        self.time_attention = time_attention
        self.call_kind = call_kind or _call_kind
        self.stats = PatchStats(self.backend.name)
        self.step = 0
        self._saved: list[tuple[torch.nn.Module, Any]] = []
        self._ctx = ("?", "?", "?")  # (model, layer, kind) of the processor call in progress
        self._sub = 0  # attention calls so far inside the current processor call
        self._events: list = []
        self._host_time = 0.0
        self._classes: dict[tuple[type, str], type] = {}
        self._modules: list[str] = []  # sys.modules entries holding the rebound globals (see _patched_processor)
        self.installed = False

    # ----- install / remove -----

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def install(self):
        if self.installed:
            raise RuntimeError("AttentionPatch is already installed")
        n = 0
        for model_name, model in self.models:
            for layer, module in attention_modules(model):
                self._saved.append((module, module.processor))
                module.processor = self._patched_processor(module.processor, model_name, layer)
                n += 1
        if n == 0:
            raise RuntimeError("no attention processors found in " + ", ".join(m for m, _ in self.models))
        if any(getattr(m.processor, "_vd_mode", None) == "xfuser" for m, _ in self._saved):
            self._install_xfuser()
        self._op_id = next(_OP_IDS)
        _LIVE_PATCHES[self._op_id] = self
        self.installed = True
        self.n_modules = n

    def remove(self):
        for module, proc in reversed(self._saved):
            module.processor = proc
        self._saved.clear()
        for registry, key, fn in reversed(getattr(self, "_registry_saved", [])):
            registry[key] = fn
        self._registry_saved = []
        _LIVE_PATCHES.pop(getattr(self, "_op_id", None), None)
        for name in self._modules:
            sys.modules.pop(name, None)
        self._modules.clear()
        self._classes.clear()
        self.installed = False

    def _patched_processor(self, proc, model_name: str, layer: str):
        mode = _call_mode(proc)
        cls = type(proc)
        key = (cls, mode)
        if key not in self._classes:
            orig_call = cls.__call__
            # The copied globals live in a module of their own, registered in sys.modules under a unique
            # name: torch.compile (dynamo) guards globals through ``sys.modules[__name__]``, and with the
            # original module's name its guards would read the *unpatched* module and fail.
            mod_name = f"vdbench._patched_{id(self):x}_{cls.__module__.replace('.', '_')}_{cls.__name__}"
            mod = types.ModuleType(mod_name)
            g = mod.__dict__
            g.update(orig_call.__globals__)
            g["__name__"] = mod_name
            if mode == "dispatcher":
                g["dispatch_attention_fn"] = self._dispatch
            elif mode == "xfuser":
                pass  # its kernel is reached through xfuser's registry, swapped in install() (_install_xfuser)
            else:
                g["F"] = _FProxy(self._sdpa)
            sys.modules[mod_name] = mod
            self._modules.append(mod_name)
            rebound = types.FunctionType(orig_call.__code__, g, orig_call.__name__, orig_call.__defaults__,
                                         orig_call.__closure__)
            rebound.__kwdefaults__ = orig_call.__kwdefaults__
            # A closure-free copy of _patched_call per class, so it can carry the original signature (diffusers
            # filters processor kwargs by it) and torch.compile can trace it (it can't guard such closures).
            call = types.FunctionType(_patched_call.__code__, _patched_call.__globals__, "__call__")
            call.__signature__ = inspect.signature(orig_call)
            self._classes[key] = type(f"Patched{cls.__name__}", (cls,), {
                "__call__": call, "_vd_rebound": staticmethod(rebound), "_vd_mode": mode})
        new = object.__new__(self._classes[key])
        new.__dict__.update(proc.__dict__)
        new._vd_model, new._vd_layer, new._vd_patch = model_name, layer, self
        return new

    # ----- the replacements -----

    def _dispatch(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        """Replacement for diffusers' ``dispatch_attention_fn``: BSHD in, BSHD out."""
        if torch.compiler.is_compiling():
            if parallel_config is not None or attention_kwargs or backend is not None:
                raise UnsupportedCall("under torch.compile the patch routes plain attention calls only (got "
                                      "parallel_config/attention_kwargs/backend)")
            return self._compiled_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                       mode="dispatcher")
        if self.backend.name == "default":
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn

            name = backend if backend is not None else _AttentionBackendRegistry.get_active_backend()[0]
            name = getattr(name, "value", str(name))
            label = f"diffusers.{name}"
            if name == "native" and parallel_config is None:
                label += f"[{sdpa_kernel_choice(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p, is_causal, scale, enable_gqa)}]"

            def run():
                return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                             attention_kwargs=attention_kwargs, backend=backend,
                                             parallel_config=parallel_config)

            out = self._timed(run, query)
            self._record(label, query, key, value, out, bshd=True,
                         args=dict(scale=scale, is_causal=is_causal, dropout_p=dropout_p,
                                   has_mask=attn_mask is not None))
            return out
        if parallel_config is not None:
            if attention_kwargs:
                raise UnsupportedCall(f"backend '{self.backend.name}' got attention_kwargs {sorted(attention_kwargs)}")
            # diffusers context parallelism: its own Ulysses / ring / unified templates run, with our kernel as
            # the forward op (what a registered diffusers backend does); ring asks it for the log-sum-exp.
            from diffusers.models.attention_dispatch import _templated_context_parallel_attention

            return _templated_context_parallel_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False,
                forward_op=self._cp_forward_op, backward_op=None, _parallel_config=parallel_config)
        if attention_kwargs:
            raise UnsupportedCall(f"backend '{self.backend.name}' got attention_kwargs {sorted(attention_kwargs)}")
        out = self._serve(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                          dropout_p, is_causal, scale, enable_gqa)
        return out.transpose(1, 2)

    def _cp_forward_op(self, ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        """diffusers' context-parallel forward op: BSHD in, BSHD out (+ LSE (B, S, H) when asked)."""
        cp = _parallel_config.context_parallel_config if _parallel_config is not None else None
        tag = _path_tag(cp.ulysses_degree, cp.ring_degree) if cp is not None else ""
        out = self._serve(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p,
                          is_causal, scale, enable_gqa, need_lse=return_lse, tag=tag)
        if return_lse:
            out, lse = out
            return out.transpose(1, 2), lse.transpose(1, 2)
        return out.transpose(1, 2)

    def _install_xfuser(self):
        """Put our kernel behind xfuser's attention registry for its configured backends (self and cross).

        xfuser's USP calls ``ATTENTION_FUNCTION_REGISTRY[backend]`` for the Ulysses path *and* hands the same
        function to torch's templated ring attention, so one swap covers Ulysses, ring and hybrid (patching
        only the Ulysses call site would leave ring on xfuser's default kernel).
        """
        from xfuser.core.distributed import get_runtime_state
        from xfuser.core.distributed.attention_backend import ATTENTION_FUNCTION_REGISTRY as reg

        state = get_runtime_state()
        keys = {state.attention_backend}
        cross = getattr(state, "get_cross_attention_backend", lambda: None)()
        if cross is not None:
            keys.add(cross)
        self._registry_saved = []
        for key in keys:
            self._registry_saved.append((reg, key, reg.get(key)))
            reg[key] = self._xfuser_attention

    def _xfuser_attention(self, query, key, value, dropout_p=0.0, is_causal=False, attention_kwargs=None, **_):
        """xfuser's attention-function contract: BHSD in, (out, lse or None) out; LSE only on the ring path."""
        if self.backend.name == "default":
            raise UnsupportedCall("backend 'default' can't be installed into xfuser's registry: name a backend")
        if attention_kwargs and attention_kwargs.get("attn_mask") is not None:
            raise UnsupportedCall(f"backend '{self.backend.name}' got an attention mask through xfuser")
        from xfuser.core.distributed import get_ring_parallel_world_size, get_ulysses_parallel_world_size

        # xfuser's Wan cross-attention calls the registry without USP (local); self-attention goes through USP
        local = self._ctx[2].startswith("cross")
        need_lse = not local and get_ring_parallel_world_size() > 1
        tag = "" if local else _path_tag(get_ulysses_parallel_world_size(), get_ring_parallel_world_size())
        res = self._serve(query, key, value, None, dropout_p, is_causal, None, False, need_lse=need_lse, tag=tag)
        return res if need_lse else (res, None)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        """Replacement for ``F.scaled_dot_product_attention`` (keyword or positional): BHSD."""
        if torch.compiler.is_compiling():
            out = self._compiled_call(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                      attn_mask, dropout_p, is_causal, scale, enable_gqa, mode="sdpa")
            return out.transpose(1, 2)
        if self.backend.name == "default":
            label = f"sdpa[{sdpa_kernel_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)}]"
            kw = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
            if enable_gqa:
                kw["enable_gqa"] = True
            out = self._timed(lambda: F.scaled_dot_product_attention(query, key, value, **kw), query)
            self._record(label, query, key, value, out, bshd=False,
                         args=dict(scale=scale, is_causal=is_causal, dropout_p=dropout_p,
                                   has_mask=attn_mask is not None))
            return out
        return self._serve(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def _compiled_call(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, mode: str):
        """Under torch.compile: one opaque ``vdbench::attention`` op per call (BSHD in, BSHD out).

        Why an op: dynamo would otherwise trace the bookkeeping (counters, events, observers) into the graph,
        guard on the counters' values and recompile on every call, and the kernel packages' Python wrappers
        are not all traceable. An opaque op keeps the kernel and its bookkeeping running for real at every
        call, with no graph break around it. What the op needs to label the call (model, kind) is resolved
        here, at trace time, where it is a constant of the call site -- not the layer name, which differs per
        block and would make dynamo recompile each repeated block (captures therefore run eagerly).
        """
        model = self._ctx[0]
        kind = self._next_kind()
        return torch.ops.vdbench.attention(q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                                           None if scale is None else float(scale), bool(enable_gqa),
                                           self._op_id, model, kind, mode)

    def _op_call(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, model, kind, mode):
        """The eager body of ``vdbench::attention`` (runs at every call of a compiled graph)."""
        self._ctx = (model, "?", kind)
        if mode == "dispatcher":
            out = self._dispatch(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        else:
            out = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, dropout_p,
                             is_causal, scale, enable_gqa).transpose(1, 2)
        return out.contiguous()  # the layout the op's fake implementation promises

    def _serve(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, need_lse=False, tag=""):
        b = self.backend
        if need_lse:  # ring attention: the kernel's own log-sum-exp, or a refusal (never recomputed beside it)
            from .backends import lse_function

            fn, label, why = lse_function(b.name, q.device)
            if fn is None:
                raise UnsupportedCall(f"ring attention needs the log-sum-exp: {why}")
            b.check_call(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         enable_gqa=enable_gqa)
            res = self._timed(lambda: fn(q, k, v, scale=scale, is_causal=is_causal), q)
            self._record(label + tag, q, k, v, res[0], bshd=False,
                         args=dict(scale=scale, is_causal=is_causal, dropout_p=dropout_p, has_mask=False))
            return res
        args = dict(scale=scale, is_causal=is_causal, dropout_p=dropout_p, has_mask=attn_mask is not None)
        try:
            b.check_call(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         enable_gqa=enable_gqa)
        except UnsupportedCall as e:
            where = f"{self._ctx[0]}.{self._ctx[1]} ({self._ctx[2]}-attention), step {self.step}"
            if self.on_unsupported == "error":
                raise UnsupportedCall(f"{e} — in {where}. Refusing rather than falling back silently; "
                                      "pass --on_unsupported fallback:sdpa to run such calls on torch sdpa "
                                      "(they are counted and reported)") from None
            self.stats.fallbacks += 1
            out = self._timed(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                **({"enable_gqa": True} if enable_gqa else {})), q)
            self._record("fallback:sdpa", q, k, v, out, bshd=False, args=args)
            return out
        label = b.kernel
        if b.name == "sdpa":
            label = f"sdpa[{sdpa_kernel_choice(q, k, v, None, 0.0, is_causal, scale)}]"
        kernel_fn = b.fn  # a local: torch.compile can't guard a function read off the frozen dataclass
        out = self._timed(lambda: kernel_fn(q, k, v, scale=scale, is_causal=is_causal), q)
        self._record(label + tag, q, k, v, out, bshd=False, args=args)
        return out

    # ----- bookkeeping -----

    def _timed(self, fn, like: torch.Tensor):
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
        self.stats = PatchStats(self.backend.name)
        self._events.clear()
        self._host_time = 0.0
        self.step = 0

    def _next_kind(self) -> str:
        """The kind of the attention call in progress; counts it within its processor call. A Wan i2v
        cross-attention processor makes two calls, image context first ("cross+img" -> cross_img, cross)."""
        kind = self._ctx[2]
        if kind == "cross+img":
            kind = "cross_img" if self._sub == 0 else "cross"
        self._sub += 1
        return kind

    def _record(self, label, q, k, v, out, *, bshd: bool, args: dict):
        model, layer, _ = self._ctx
        kind = self._next_kind()
        self.stats.calls[label] += 1
        self.stats.calls_by_kind[kind] += 1
        if self.observers:
            tr = (lambda t: t.transpose(1, 2)) if bshd else (lambda t: t)
            info = CallInfo(index=sum(self.stats.calls.values()) - 1, layer=layer, kind=kind, step=self.step,
                            model=model, kernel=label, query=tr(q), key=tr(k), value=tr(v), output=tr(out),
                            args=args)
            for obs in self.observers:
                obs(info)


_LIVE_PATCHES: dict[int, "AttentionPatch"] = {}
_OP_IDS = itertools.count(1)


@torch.library.custom_op("vdbench::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool, patch_id: int,
                  model: str, kind: str, mode: str) -> torch.Tensor:
    """An installed patch's attention as one op torch.compile does not trace into (BSHD in and out)."""
    patch = _LIVE_PATCHES.get(patch_id)
    if patch is None:
        raise RuntimeError(f"vdbench::attention called for patch {patch_id}, which is no longer installed "
                           "(a compiled graph outlived its AttentionPatch)")
    return patch._op_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, model, kind, mode)


@_attention_op.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, patch_id, model, kind, mode):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _path_tag(ulysses: int, ring: int) -> str:
    """Suffix of a call's kernel label under sequence parallelism: which path ran it ('@ulysses2', '@ring2',
    '@ulysses2xring2', named by vdbench.parallel.sequence_layout); nothing for a local call."""
    layout = sequence_layout(ulysses, ring)
    return "@" + layout if layout else ""


def _call_kind(mode: str, attn, encoder_hidden_states) -> str:
    """'self', 'cross' or 'joint' for one processor call.

    CogVideoX's processors attend over text and video tokens together (joint) although they are handed the text as
    ``encoder_hidden_states``; their ``Attention`` says ``is_cross_attention=False``. Wan's cross-attention modules
    say True. The stock CogVideoX processor (F.scaled_dot_product_attention, mode 'sdpa') is always joint.
    Under xfuser the kind decides the path: cross-attention is local, joint/self goes through USP (Ulysses, ring).
    """
    if mode == "sdpa":
        return "joint"
    if encoder_hidden_states is None:
        return "self"
    return "joint" if getattr(attn, "is_cross_attention", True) is False else "cross"


def _patched_call(self_, attn, hidden_states, *args, **kwargs):
    """The patched processors' ``__call__``: note where we are (model, layer, kind), run the rebound original."""
    ehs = kwargs.get("encoder_hidden_states", args[0] if args else None)
    patch = self_._vd_patch
    kind = patch.call_kind(self_._vd_mode, attn, ehs)
    # Wan i2v: a cross-attention module with add_k_proj makes two calls, image context first.
    if kind == "cross" and getattr(attn, "add_k_proj", None) is not None:
        kind = "cross+img"
    # Under compile the layer name is not read: it differs per repeated block and dynamo would guard on it.
    layer = "?" if torch.compiler.is_compiling() else self_._vd_layer
    patch._ctx = (self_._vd_model, layer, kind)
    patch._sub = 0
    return type(self_)._vd_rebound(self_, attn, hidden_states, *args, **kwargs)


def install_backend(models, backend: str, **kwargs) -> AttentionPatch:
    """Convenience: build and install an ``AttentionPatch`` (remember to ``remove()`` it, or use ``with``)."""
    p = AttentionPatch(models, backend, **kwargs)
    p.install()
    return p
