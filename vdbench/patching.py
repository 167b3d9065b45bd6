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
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from .backends import Backend, UnsupportedCall, get_backend, sdpa_kernel_choice

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
    """

    def __init__(self, models: Iterable[tuple[str, torch.nn.Module]], backend: str | Backend,
                 on_unsupported: str = "error", observers: Optional[list[Callable[[CallInfo], Any]]] = None,
                 time_attention: bool = False):
        if on_unsupported not in ON_UNSUPPORTED_CHOICES:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED_CHOICES}, got {on_unsupported!r}")
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend)
        self.models = list(models)
        self.on_unsupported = on_unsupported
        self.observers = list(observers or [])
        self.time_attention = time_attention
        self.stats = PatchStats(self.backend.name)
        self.step = 0
        self._saved: list[tuple[torch.nn.Module, Any]] = []
        self._ctx = ("?", "?", "?")  # (model, layer, kind) of the processor call in progress
        self._sub = 0  # attention calls so far inside the current processor call
        self._events: list = []
        self._host_time = 0.0
        self._classes: dict[tuple[type, str], type] = {}
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
        self.installed = True
        self.n_modules = n

    def remove(self):
        for module, proc in reversed(self._saved):
            module.processor = proc
        self._saved.clear()
        self.installed = False

    def _patched_processor(self, proc, model_name: str, layer: str):
        mode = _call_mode(proc)
        cls = type(proc)
        key = (cls, mode)
        if key not in self._classes:
            orig_call = cls.__call__
            g = dict(orig_call.__globals__)
            if mode == "dispatcher":
                g["dispatch_attention_fn"] = self._dispatch
            else:
                g["F"] = _FProxy(self._sdpa)
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
            raise UnsupportedCall(f"backend '{self.backend.name}' was asked to run under diffusers context "
                                  "parallelism, which this patch does not route (use the distributed engine's "
                                  "integration)")
        if attention_kwargs:
            raise UnsupportedCall(f"backend '{self.backend.name}' got attention_kwargs {sorted(attention_kwargs)}")
        out = self._serve(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                          dropout_p, is_causal, scale, enable_gqa)
        return out.transpose(1, 2)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        """Replacement for ``F.scaled_dot_product_attention`` (keyword or positional): BHSD."""
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

    def _serve(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        b = self.backend
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
        self._record(label, q, k, v, out, bshd=False, args=args)
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

    def _record(self, label, q, k, v, out, *, bshd: bool, args: dict):
        model, layer, kind = self._ctx
        if kind == "cross+img":
            kind = "cross_img" if self._sub == 0 else "cross"
        self._sub += 1
        self.stats.calls[label] += 1
        self.stats.calls_by_kind[kind] += 1
        if self.observers:
            tr = (lambda t: t.transpose(1, 2)) if bshd else (lambda t: t)
            info = CallInfo(index=sum(self.stats.calls.values()) - 1, layer=layer, kind=kind, step=self.step,
                            model=model, kernel=label, query=tr(q), key=tr(k), value=tr(v), output=tr(out),
                            args=args)
            for obs in self.observers:
                obs(info)


def _patched_call(self_, attn, hidden_states, *args, **kwargs):
    """The patched processors' ``__call__``: note where we are (model, layer, kind), run the rebound original."""
    ehs = kwargs.get("encoder_hidden_states", args[0] if args else None)
    kind = "joint" if self_._vd_mode == "sdpa" else ("cross" if ehs is not None else "self")
    # Wan i2v: a cross-attention module with add_k_proj makes two calls, image context first.
    if kind == "cross" and getattr(attn, "add_k_proj", None) is not None:
        kind = "cross+img"
    patch = self_._vd_patch
    patch._ctx = (self_._vd_model, self_._vd_layer, kind)
    patch._sub = 0
    return type(self_)._vd_rebound(self_, attn, hidden_states, *args, **kwargs)


def install_backend(models, backend: str, **kwargs) -> AttentionPatch:
    """Convenience: build and install an ``AttentionPatch`` (remember to ``remove()`` it, or use ``with``)."""
    p = AttentionPatch(models, backend, **kwargs)
    p.install()
    return p
