"""diffusers' step caches as a render option (``--cache KIND[:key=value,...]``): the kinds, their parsing, the
checks before the load, their application to the loaded denoisers and the count of what each step computed.

Why diffusers' hooks and not a cache of our own: the caches are the library's (``transformer.enable_cache``), so a
render measures what a diffusers user gets; vdbench only chooses the config, fills in what the pipeline provides
(the current timestep, the step count), refuses what can't apply before any weight loads, and counts.

A kind is one :class:`CacheKind`: its short name, diffusers' config class, the parameters a user may set (taken
from the config dataclass: its fields of a type the command line can spell, with the dataclass's defaults), the
defaults vdbench sets where diffusers' own match nothing in these families, what the render fills in, and a
check against the family. A spec's canonical spelling (:attr:`CacheSpec.name`) names only the parameters given,
in the dataclass's order: ``fbc``, ``fbc:threshold=0.1``; sequences join their items with ``+``
(``pab:spatial_attention_timestep_skip_range=-1+900``).

Counting (:class:`CacheCounter`): the modules a cache hooks (whole blocks for ``fbc``/``mag``/``sea``, attention
modules for ``pab``/``faster``/``taylor``) are its units. Each unit's own ``forward`` is wrapped with a counter
before ``enable_cache``, so diffusers' hook, which calls it only when it computes, leaves it uncalled when the
output comes from the cache; a pre-hook counts every call of the unit. Per denoising step: computed = inner
calls, reused = outer - inner, and the denoiser calls this process computed (``forwards_per_step``: Wan's two guidance
passes on one process; under a CFG split one per rank, the other branch's call answered by the split's gather, which
the summary's ``guidance_split`` says), and which denoiser ran the step (``denoiser_per_step``: Wan 2.2's expert).

Two experts (Wan 2.2 A14B): each denoiser gets a config of its own (:func:`apply_cache`), and diffusers' hooks keep
each one's state apart, so the low-noise expert's first step starts from an empty cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .pipelines import DENOISERS, step_denoisers

__all__ = ["CacheKind", "CacheSpec", "CacheCounter", "KINDS", "parse_cache", "check_cache", "apply_cache",
           "share_decisions", "CACHE_HELP"]

#: the separator of a sequence's items in a value (``,`` separates the parameters, ``:`` the kind)
ITEM_SEP = "+"

# diffusers' TaylorSeer default patterns (``^blocks.*attn``) are matched with ``re.fullmatch``, so they match no
# Wan or CogVideoX module (their attention modules are ``attn1``/``attn2``); the same patterns with the index
_TAYLOR_ATTENTION = ["^blocks.*attn\\d*", "^transformer_blocks.*attn\\d*"]


@dataclasses.dataclass(frozen=True)
class CacheKind:
    """One step cache: ``name`` (the ``--cache`` kind), ``config`` (the diffusers.hooks config class name),
    ``description`` (one line), ``needs`` (what the pipeline must provide), ``defaults`` (vdbench's values where
    diffusers' match nothing here; recorded with the params), ``provided(pipe, steps, family) -> dict`` (what the
    render fills in), ``hidden`` (fields a user does not set: filled in, or not spellable), ``refusal(family,
    params, pipeline_class) -> reason | None`` (before the load), ``files`` (parameter -> reader of a file's path
    -> the value: the parameters a user may give as ``@PATH``), ``inside_blocks`` (its hooks sit on modules inside
    the blocks -- the attention modules -- where a regionally compiled block would trace them), ``per_expert``
    (parameters the second of two experts -- Wan 2.2's ``transformer_2`` -- takes a value of its own for, spelled
    ``<name>_2`` as diffusers spells ``guidance_scale_2``), ``first_call_refusal(params, denoiser, timestep) ->
    reason | None`` (after the load, for each denoiser's first step: each denoiser's hooks start empty there, the
    low-noise expert's at the experts' switch), ``across_calls`` (its hooks keep one state per module for every
    call of the denoiser, no cache context: where guidance is two calls a step -- Wan -- the unconditional call
    reuses what the conditional call of the same step left, which a CFG split's rank, holding one branch, can't)."""

    name: str
    config: str
    description: str
    needs: str
    defaults: dict = dataclasses.field(default_factory=dict)
    provided: Callable[..., dict] = lambda pipe, steps, family: {}
    hidden: tuple[str, ...] = ()
    refusal: Callable[..., Optional[str]] = lambda family, params, pipeline_class: None
    files: dict = dataclasses.field(default_factory=dict)
    inside_blocks: bool = False
    per_expert: tuple[str, ...] = ()
    across_calls: bool = False
    first_call_refusal: Callable[..., Optional[str]] = lambda params, denoiser, timestep: None

    def config_class(self):
        import diffusers.hooks

        return getattr(diffusers.hooks, self.config)

    def parameters(self) -> dict[str, tuple[Callable[[str], Any], Any]]:
        """Settable parameter -> (parser of its command-line text, default): the config dataclass's fields whose
        type the command line can spell, minus the hidden ones; the default vdbench's where it sets one; then the
        second expert's own values of the :attr:`per_expert` ones (``<name>_2``, default None: unset)."""
        cls = self.config_class()
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            if f.name.startswith("_") or f.name in self.hidden:
                continue
            parse = _parser(hints.get(f.name, f.type))
            if parse is None:
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            out[f.name] = (parse, self.defaults.get(f.name, default))
        for name in self.per_expert:
            out[f"{name}_2"] = (out[name][0], None)
        return out


def _timestep(pipe, steps, family) -> dict:
    return {"current_timestep_callback": lambda: pipe.current_timestep}


_FASTER_RANGES = ("spatial_attention_timestep_skip_range", "temporal_attention_timestep_skip_range")


def _faster_refusal(family, params, pipeline_class) -> Optional[str]:
    for key in _FASTER_RANGES:
        # a range holding the first step's timestep (1000 flow-matching, 999 DDPM-style) skips the first call,
        # before anything is cached: diffusers fails there (indexes an empty cache)
        if params.get(key) is not None and params[key][1] >= 999:
            return (f"{key} ends at {params[key][1]}: FasterCache would skip the first step, before anything is "
                    f"cached (diffusers fails there)\nend it below the first step's timestep, e.g. {key}=-1+900")
    if family is not None and not family.guidance_in_one_batch and not params.get("is_guidance_distilled"):
        return (f"diffusers' FasterCache skips the unconditional half of one guidance batch; the {family.name} "
                "pipeline runs the conditional and unconditional passes as two calls\nuse "
                "faster:is_guidance_distilled=true (the attention cache alone), or another kind")
    return None


def _faster_first_call(params, denoiser: str, timestep: float) -> Optional[str]:
    """FasterCache's attention hooks skip a call inside a timestep range from their second call on, and their first
    call is skipped too where its timestep is inside (the hook's counter starts at 0, its cache empty): diffusers
    fails there. Each denoiser's hooks are their own, so Wan 2.2's low-noise expert starts empty at the switch, at a
    timestep a range reaching past the first step's may well hold."""
    for key in _FASTER_RANGES:
        lo, hi = params.get(key) or (None, None)
        if lo is not None and lo < timestep < hi:
            return (f"{key} {lo}..{hi} holds {denoiser}'s first timestep ({timestep:g}): FasterCache would skip that "
                    f"denoiser's first call, before anything is cached (diffusers fails there)\nend it at or below "
                    f"{math.floor(timestep)}, e.g. {key}={lo}{ITEM_SEP}{math.floor(timestep)}")
    return None


def _taylor_refusal(family, params, pipeline_class) -> Optional[str]:
    # TaylorSeer counts each module's calls from its first (per cache context, each denoiser's modules their own):
    # a first call that is neither warm-up (disable_cache_before_step), a compute interval nor cool-down predicts
    # from nothing, and diffusers fails there ("Cannot predict without prior initialization")
    before, every, after = (params.get(k) for k in ("disable_cache_before_step", "cache_interval",
                                                   "disable_cache_after_step"))
    if before > 0 or (after is not None and after <= 0) or (every and (-before - 1) % every == 0):
        return None
    return (f"disable_cache_before_step={before} with cache_interval={every}: TaylorSeer would predict each "
            "denoiser's first call (each of Wan 2.2's experts its own), before anything is computed (diffusers "
            "fails there)\ngive disable_cache_before_step=1 or more")


def _sea_refusal(family, params, pipeline_class) -> Optional[str]:
    # without the step index, sigma and step count SeaCache runs "fail-open": every block computed, nothing cached
    if family is not None and pipeline_class and pipeline_class not in family.step_context_pipelines:
        return (f"diffusers' SeaCache needs the step index, sigma and step count from the pipeline's cache_context; "
                f"{pipeline_class} passes none (SeaCache would cache nothing)\nuse another kind (fbc, mag)")
    return None


def _mag_refusal(family, params, pipeline_class) -> Optional[str]:
    if params.get("mag_ratios") is None and not params.get("calibrate"):
        return ("MagCache needs the model's magnitude ratios (model-dependent)\ngive mag:mag_ratios=R0+R1+... "
                "(interpolated to the step count; two experts: mag_ratios_2 too), or mag:calibrate=true to measure "
                "them (nothing reused)")
    return None


def _textkv_refusal(family, params, pipeline_class) -> Optional[str]:
    # diffusers' apply_text_kv_cache hooks the denoiser itself and every NucleusMoEImageTransformerBlock, and only
    # those blocks use what it caches: on any other model the hook runs and nothing is cached
    why = family.text_kv if family is not None and family.text_kv else (
        f"{family.name if family is not None else 'this'} model's text tokens pass through every block beside the "
        "video's, so their K/V change with each step and can't be cached exactly")
    return ("diffusers' TextKVCacheConfig applies only to NucleusMoE image transformer blocks "
            f"(NucleusMoEImageTransformerBlock), no module of these families; {why}\nuse another kind (fbc, mag, "
            "taylor, pab)")


#: the logger diffusers' MagCache calibration reports its ratios on, and the message's start (``_advance_step``)
_MAG_LOGGER = "diffusers.hooks.mag_cache"
_CALIBRATION_PREFIX = "MagCache Calibration Results:"


def _no_constant(name):
    raise ValueError(f"{name} is not a finite number")


def _strict_json(text: str):
    """``text`` read as JSON, NaN and Infinity refused (JSON has neither); ValueError("not JSON (why)")."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # a decode error, or NaN/Infinity
        raise ValueError(f"not JSON ({getattr(e, 'msg', e)})") from None


def _ratios(value) -> list[float]:
    """``value`` as magnitude ratios: a non-empty list of finite numbers (booleans are not numbers here);
    ValueError otherwise."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"not a non-empty list of numbers (a {type(value).__name__})")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"not a list of numbers (holds {v!r})")
        out.append(float(v))
    return out


def _ratios_of_message(message: str) -> list[float]:
    """The ratios of diffusers' ``MagCache Calibration Results: [...]``: the bracketed text read as JSON (never
    evaluated), numbers only; ValueError otherwise."""
    start, end = message.find("["), message.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no bracketed list")
    return _ratios(_strict_json(message[start:end + 1]))


def _calibrated_ratios(path_text: str, denoiser: str = DENOISERS[0]) -> list[float]:
    """``mag_ratios=@PATH`` (``mag_ratios_2=@PATH``: ``denoiser`` the second expert): the ratios a calibrating render
    (``mag:calibrate=true``) recorded in its timing.json for ``denoiser`` -- the last entry with a calibration (the
    file appends every render's repetitions), its ``cache.calibration.by_denoiser[denoiser][0]`` (that denoiser's
    first cache context's: see :meth:`CacheCounter.summary`; a record without ``by_denoiser``: ``ratios[0]``, the
    first denoiser's). ValueError (one line, then a hint) for a missing or unreadable file, one without a
    calibration of ``denoiser``, or ratios that are not numbers."""
    hint = ("give the timing.json of a render with --cache mag:calibrate=true, or the ratios "
            f"({'mag_ratios' if denoiser == DENOISERS[0] else 'mag_ratios_2'}=R0+R1+...)")
    path = Path(path_text).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"no such file\n{hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"can't read it ({type(e).__name__}: {e})\n{hint}") from None
    try:
        data = _strict_json(text)
    except ValueError as e:
        raise ValueError(f"{e}\n{hint}") from None
    entries = data if isinstance(data, list) else [data]  # a timing.json is a list; one entry taken as it is
    for entry in reversed(entries):
        cal = ((entry.get("cache") if isinstance(entry, dict) else None) or {})
        cal = cal.get("calibration") if isinstance(cal, dict) else None
        if not isinstance(cal, dict) or "ratios" not in cal:
            continue
        by = cal.get("by_denoiser")
        where, lists = (f"by_denoiser.{denoiser}", by.get(denoiser)) if isinstance(by, dict) else ("ratios", (
            cal["ratios"] if denoiser == DENOISERS[0] else None))
        if lists is None:
            raise ValueError(f"its calibration holds no ratios of {denoiser}\ngive the timing.json of a calibrating "
                             f"render of a model with two experts")
        if not isinstance(lists, list):
            raise ValueError(f"its cache.calibration.{where} is not a list (a {type(lists).__name__})\n{hint}")
        if not lists:
            raise ValueError("its calibration holds no ratios (diffusers logged none)\ndiffusers logs them when "
                             "a denoiser has run all its steps")
        try:
            return _ratios(lists[0])
        except ValueError as e:
            raise ValueError(f"its cache.calibration.{where}[0] is {e}\n{hint}") from None
    raise ValueError(f"no entry with a MagCache calibration (cache.calibration.ratios)\n{hint}")


KINDS: dict[str, CacheKind] = {k.name: k for k in (
    CacheKind("fbc", "FirstBlockCacheConfig",
              "First Block Cache: the first block's residual changed less than threshold -> the other blocks reuse "
              "their last residual", needs="a transformer with a list of blocks"),
    CacheKind("mag", "MagCacheConfig",
              "MagCache: blocks skipped while the accumulated residual-magnitude error stays under threshold; "
              "calibrate=true measures mag_ratios, mag_ratios=@FILE reads them from that render's timing.json; "
              "two experts (Wan 2.2 A14B) each run their own steps with their own ratios (mag_ratios_2: the "
              "low-noise expert's)",
              needs="the model's magnitude ratios (mag_ratios; two experts: mag_ratios_2 too) or calibrate=true; "
                    "the step count of each denoiser (filled in)",
              provided=lambda pipe, steps, family: {"num_inference_steps": steps}, hidden=("num_inference_steps",),
              refusal=_mag_refusal, per_expert=("mag_ratios",),
              files={"mag_ratios": _calibrated_ratios,
                     "mag_ratios_2": functools.partial(_calibrated_ratios, denoiser=DENOISERS[1])}),
    CacheKind("taylor", "TaylorSeerCacheConfig",
              "TaylorSeer: the attention outputs computed every cache_interval steps, predicted by a Taylor series "
              "in between", needs="attention modules under the block list (matched by vdbench's patterns)",
              defaults={"cache_identifiers": _TAYLOR_ATTENTION},
              hidden=("cache_identifiers", "skip_predict_identifiers", "taylor_factors_dtype"), inside_blocks=True,
              refusal=_taylor_refusal),
    CacheKind("pab", "PyramidAttentionBroadcastConfig",
              "Pyramid Attention Broadcast: self-attention outputs reused for block_skip_range-1 of every "
              "block_skip_range calls inside the timestep range", needs="the pipeline's current timestep "
              "(filled in)", defaults={"spatial_attention_block_skip_range": 2}, provided=_timestep,
              inside_blocks=True, across_calls=True),
    CacheKind("faster", "FasterCacheConfig",
              "FasterCache: attention outputs reused with a frequency-weighted correction, the unconditional "
              "batch's skipped", needs="the pipeline's current timestep (filled in); guidance as one batch (or "
              "is_guidance_distilled=true); the latent layout (filled in)",
              # attention_weight_callback: diffusers' own default (0.5 at every timestep), given so that its
              # warning isn't printed by every render
              provided=lambda pipe, steps, family: {**_timestep(pipe, steps, family),
                                                    "tensor_format": family.latent_format,
                                                    "attention_weight_callback": lambda _: 0.5},
              hidden=("tensor_format",), refusal=_faster_refusal, inside_blocks=True, across_calls=True,
              first_call_refusal=_faster_first_call),
    CacheKind("sea", "SeaCacheConfig",
              "SeaCache: blocks skipped while the spectrum-weighted input change stays under threshold",
              needs="the step index, sigma and step count passed to cache_context (the family's "
                    "step_context_pipelines)", refusal=_sea_refusal),
    CacheKind("textkv", "TextKVCacheConfig",
              "text K/V cache: the text keys and values projected once; diffusers applies it to NucleusMoE image "
              "blocks only, so it is refused for Wan and CogVideoX", needs="NucleusMoE image transformer blocks",
              refusal=_textkv_refusal),
)}

#: the ``--cache`` help: the kinds with their one line
CACHE_HELP = ("diffusers' step cache on the denoiser(s): KIND[:key=value,...], KIND one of "
              + "; ".join(f"{k.name} ({k.description})" for k in KINDS.values())
              + "; a sequence value joins its items with '+'; counted per step in timing.json (default: none)")


def _parser(tp) -> Optional[Callable[[str], Any]]:
    """The parser of a value's command-line text for a config field's type; None for a type it can't spell
    (callbacks, module-name patterns, dtypes)."""
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None) and a is not torch.Tensor]  # mag_ratios: a list or tensor
        inner = _parser(rest[0]) if len(rest) == 1 else None
        if inner is None:
            return None
        return _named(lambda s: None if s.lower() == "none" else inner(s), f"{_type_name(inner)} or none")
    if tp is bool:
        def boolean(s):
            if s.lower() in ("true", "1", "yes"):
                return True
            if s.lower() in ("false", "0", "no"):
                return False
            raise ValueError("not true or false")
        return boolean
    if tp in (int, float):
        return tp
    if tp is str:
        return str
    if origin in (tuple, list) and args:
        item = args[0]
        if item not in (int, float):
            return None
        n = None if (origin is list or Ellipsis in args) else len(args)

        def seq(s, item=item, n=n, origin=origin):
            vals = [item(x) for x in s.split(ITEM_SEP)]
            if n is not None and len(vals) != n:
                raise ValueError(f"needs {n} items joined by '{ITEM_SEP}'")
            return origin(vals)
        return _named(seq, f"{item.__name__}s joined by '{ITEM_SEP}'")
    return None


def _named(fn, name: str):
    fn.__name__ = name  # what an error names as the type expected
    return fn


def _show(v) -> str:
    if isinstance(v, (list, tuple)):
        return ITEM_SEP.join(_show(x) for x in v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return "none" if v is None else str(v)


def _type_name(parse) -> str:
    return getattr(parse, "__name__", "value")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """A parsed ``--cache``: the kind, the parameters given (``given``, in the dataclass's order), every
    settable parameter's value (``params``: given, else vdbench's default, else diffusers') and how the name spells
    the values read from a file (``shown``: parameter -> ``@`` and a digest of the values)."""

    kind: CacheKind
    given: dict
    params: dict
    shown: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """The canonical spelling: ``fbc``, ``fbc:threshold=0.1``; a value read from a file (``@PATH``) as ``@``
        and the first 8 hex digits of the SHA-256 of its spelling (``mag:mag_ratios=@1f0c3a9e``) -- the values
        themselves are in ``params``. Not the path: the name is part of the output file's name (a path's ``/``
        can't be, and a calibration's 50 ratios would pass the file-name length limit), and the same ratios read
        from two files name the same configuration."""
        opts = ",".join(f"{k}={self.shown.get(k) or _show(v)}" for k, v in self.given.items())
        return self.kind.name + (f":{opts}" if opts else "")

    def as_dict(self) -> dict:
        return {"kind": self.kind.name, "spec": self.name, "config": self.kind.config,
                "params": {k: _show(v) if isinstance(v, (list, tuple)) else v for k, v in self.params.items()}}

    def for_denoiser(self, denoiser: str = DENOISERS[0]) -> dict:
        """The parameters ``denoiser`` runs with: the second expert (``transformer_2``) its own values of the
        kind's :attr:`~CacheKind.per_expert` parameters (``<name>_2``) where given, every denoiser the others."""
        own = {f"{n}_2" for n in self.kind.per_expert}
        out = {k: v for k, v in self.params.items() if k not in own}
        if denoiser == DENOISERS[1]:
            out.update({n: self.params[f"{n}_2"] for n in self.kind.per_expert if self.params.get(f"{n}_2") is not None})
        return out

    def build(self, pipe=None, steps: int = 1, family=None, denoiser: str = DENOISERS[0]):
        """diffusers' config object for ``denoiser``, with what the render fills in (``pipe``: the loaded pipeline;
        None for the check before the load, which fills in stand-ins; ``steps``: the steps this denoiser runs)."""
        provided = self.kind.provided(pipe, steps, family) if family is not None else {}
        cls = self.kind.config_class()
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in {**self.kind.defaults, **self.for_denoiser(denoiser), **provided}.items()
              if k in fields}
        return cls(**kw)


def parse_cache(text: Optional[str]) -> Optional[CacheSpec]:
    """``KIND[:key=value,...]`` -> :class:`CacheSpec`; None for none. ValueError (one line, then the valid choices)
    for an unknown kind, key or a value of the wrong type.

    A parameter the kind reads from a file (:attr:`CacheKind.files`) may be given as ``@PATH``:
    ``mag:mag_ratios=@results/wan/timing.json`` takes the ratios a ``mag:calibrate=true`` render recorded there.
    The file is read here, so a missing one, one without a calibration or one whose ratios are not numbers is
    refused before any model loads; the spec records the numbers (``params``) and names them by a digest
    (:attr:`CacheSpec.name`)."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    kind_name, _, rest = text.strip().partition(":")
    kind = KINDS.get(kind_name.strip().lower())
    if kind is None:
        raise ValueError(f"unknown --cache kind {kind_name!r}\nvalid: none, {', '.join(KINDS)}")
    params = kind.parameters()
    given, shown = {}, {}
    for piece in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = piece.partition("=")
        key = key.strip()
        if key not in params:
            raise ValueError(f"--cache {kind.name}: unknown parameter {key!r}\nvalid: "
                             + ", ".join(f"{k}={_show(d)}" for k, (_, d) in params.items()))
        if not eq:
            raise ValueError(f"--cache {kind.name}: {key} needs a value ({key}=VALUE)")
        parse = params[key][0]
        if value.strip().startswith("@") and key in kind.files:
            try:
                given[key] = kind.files[key](value.strip()[1:])
            except ValueError as e:
                raise ValueError(f"--cache {kind.name}: {key}={value.strip()}: {e}") from None
            shown[key] = "@" + hashlib.sha256(_show(given[key]).encode()).hexdigest()[:8]
            continue
        try:
            given[key] = parse(value.strip())
        except (ValueError, TypeError) as e:
            raise ValueError(f"--cache {kind.name}: {key}={value.strip()!r}: expected {_type_name(parse)} ({e})"
                             f"\ndefault: {key}={_show(params[key][1])}") from None
        shown.pop(key, None)  # given again, spelled out: the last one counts
    order = list(params)
    given = {k: given[k] for k in order if k in given}
    return CacheSpec(kind, given, {k: given.get(k, d) for k, (_, d) in params.items()},
                     {k: v for k, v in shown.items() if k in given})


def check_cache(spec: Optional[CacheSpec], family, denoisers: Optional[dict] = None, *,
                compiled: bool = False, cfg_split: bool = False, steps: int = 1,
                pipeline_class: Optional[str] = None) -> None:
    """Refuse (ValueError, one line and a hint) a cache that can't run: the kind's own refusal against the family
    and its parameters, diffusers' config refusing the values, torch.compile of a kind whose hooks sit inside the
    blocks (their per-call Python would be traced: a graph break, which the regional compile's fullgraph refuses;
    the whole-block kinds wrap the compiled blocks from outside), FasterCache's skip of
    the unconditional half of a guidance batch whose halves are on two ranks (``cfg_split``: ``--use_cfg_parallel``),
    and, where the denoisers' configs are known without weights (``denoisers``: name -> (class name, config)), a
    second expert's own value (``<name>_2``) given to a model of one denoiser or a value of one expert alone given to
    a model of two (:func:`_expert_refusal`), a cache diffusers can't apply to them or that would hook no module
    (built on the meta device). Under torchrun otherwise every kind runs: :func:`apply_cache` makes the ranks'
    decisions one (``group``)."""
    if spec is None:
        return
    why = spec.kind.refusal(family, spec.params, pipeline_class)
    if why:
        raise ValueError(f"--cache {spec.name}: {why}")
    if cfg_split and spec.kind.name == "faster" and not spec.params.get("is_guidance_distilled"):
        raise ValueError(f"--cache {spec.name} with --use_cfg_parallel: FasterCache skips the unconditional half of "
                         "each guidance batch, and the CFG split puts the two halves on two ranks\nuse "
                         "faster:is_guidance_distilled=true (the attention cache alone), or drop --use_cfg_parallel")
    if cfg_split and spec.kind.across_calls and family is not None and not family.guidance_in_one_batch:
        raise ValueError(f"--cache {spec.name} with --use_cfg_parallel: diffusers' {spec.kind.config} keeps one state "
                         f"per attention module for every denoiser call, so on one process the {family.name} "
                         "pipeline's unconditional call of a step reuses its conditional call's output; a CFG split's "
                         "rank holds one branch and would reuse its previous step's instead (another render than one "
                         "process's)\nuse a cache whose state is per guidance branch (fbc, mag, taylor, sea), or "
                         "drop --use_cfg_parallel")
    if compiled and spec.kind.inside_blocks:
        raise ValueError(f"--cache {spec.name} with --use_torch_compile: its hooks sit on the attention modules "
                         "inside the compiled blocks and decide per call in Python (a graph break the regional "
                         "compile refuses)\nuse a cache of whole blocks (fbc, mag, sea) with the compile, or drop one")
    try:
        spec.build(_Stand(), steps, family)
    except (ValueError, TypeError) as e:
        lines = str(e).strip().splitlines()
        raise ValueError(f"--cache {spec.name}: diffusers refuses it: {lines[0]}\n"
                         + " ".join(ln.strip() for ln in lines[1:])) from None
    if denoisers:
        _expert_refusal(spec, list(denoisers))
    for name, (cls_name, config) in (denoisers or {}).items():
        import diffusers

        cls = getattr(diffusers, cls_name or "", None)
        if cls is None:
            continue
        with torch.device("meta"):
            model = cls.from_config(config)
        _hooked_or_refuse(spec, model, name, family, steps)


class _Stand:
    """A pipeline stand-in for building a config before the load (its callbacks are not called)."""

    current_timestep = None


def _hooked(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and getattr(getattr(m, "_diffusers_hook", None), "hooks", None)]


def _expert_refusal(spec: CacheSpec, names: list[str]) -> None:
    """A kind's per-expert parameter (:attr:`CacheKind.per_expert`): its second expert's value (``<name>_2``) is
    refused for a model of one denoiser, and on a model of two experts a value given for one alone -- the other
    would run with a value fitted to nothing of its own (MagCache's ratios are each expert's)."""
    two = DENOISERS[1] in names
    for name in spec.kind.per_expert:
        first, second = (spec.given.get(k) is not None for k in (name, f"{name}_2"))
        if second and not two:
            raise ValueError(f"--cache {spec.name}: {name}_2 is the second expert's (Wan 2.2's {DENOISERS[1]}); this "
                             f"model has one denoiser\ndrop {name}_2")
        if two and first != second:
            given, missing = (name, f"{name}_2") if first else (f"{name}_2", name)
            raise ValueError(f"--cache {spec.name}: this model has two experts, each with its own {name}; {given} "
                             f"is given, {missing} not\ngive {name} ({DENOISERS[0]}'s, the high-noise expert) and "
                             f"{name}_2 ({DENOISERS[1]}'s), e.g. both from a calibrating render's timing.json "
                             f"({name}=@FILE,{name}_2=@FILE)")


def _hooked_or_refuse(spec, model, name, family, steps, pipe=None) -> list[str]:
    if not hasattr(model, "enable_cache"):
        raise ValueError(f"--cache {spec.name}: {name} ({type(model).__name__}) has no diffusers cache support "
                         "(CacheMixin)\nrender without --cache")
    try:
        model.enable_cache(spec.build(pipe if pipe is not None else _Stand(), steps, family, denoiser=name))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--cache {spec.name}: diffusers can't apply it to {name} ({type(model).__name__}): "
                         f"{str(e).strip().splitlines()[0]}\nrender without --cache or with another kind") from None
    hooked = _hooked(model)
    if not hooked:
        raise ValueError(f"--cache {spec.name}: diffusers' {spec.kind.config} hooks no module of {name} "
                         f"({type(model).__name__}): nothing would be cached\nrender without --cache or with "
                         "another kind")
    return hooked


def apply_cache(spec: CacheSpec, pipe, models, *, steps: int, family,
                group: Optional[Callable[[], Any]] = None) -> "CacheCounter":
    """``enable_cache`` on every denoiser (Wan 2.2's ``transformer_2`` too), its units' forwards counted; returns
    the counter (its :meth:`CacheCounter.summary` is timing.json's ``cache``).

    Each denoiser's config is its own: the steps it runs (of Wan 2.2's ``steps``, the high-noise expert's first
    share and the low-noise expert's rest: :func:`vdbench.pipelines.step_denoisers`) and its own values of the
    kind's per-expert parameters; diffusers' hooks keep each denoiser's state apart (no residual crosses the
    experts' switch), and a MagCache counts each expert's steps from its first, reads its own ratios and logs its
    own calibration at its last step. A kind's refusal of a denoiser's first call (:attr:`CacheKind.first_call_refusal`,
    at that denoiser's first timestep) comes before any hook goes on.

    ``group`` (torchrun, where each rank computes a shard of the denoiser's calls): the process group of the ranks
    sharing a call (:func:`vdbench.parallel.shard_group`), asked when a decision is reduced; a decision read from the
    data would be each rank's own, :func:`share_decisions` makes it one for them. The hooks must see the shard:
    under diffusers' context parallelism the cache goes on before ``enable_parallelism``, whose split and gather
    hooks then wrap it (the render's order)."""
    names = [name for name, _ in models]
    _expert_refusal(spec, names)
    by_step = step_denoisers(pipe, steps)
    own = {name: [t for d, t in by_step if d == name] for name in names}
    for name in names:
        why = own[name] and spec.kind.first_call_refusal(spec.for_denoiser(name), name, own[name][0])
        if why:
            raise ValueError(f"--cache {spec.name}: {why}")
    counter = CacheCounter(spec)
    for name, model in models:
        counter.wrap_candidates(model, name)
        try:  # an expert that runs no step (a boundary past every timestep) is configured for one: never called
            hooked = _hooked_or_refuse(spec, model, name, family, max(1, len(own[name])), pipe)
        except ValueError:
            counter.remove()
            raise
        counter.keep(model, name, hooked)
    if group is not None:
        counter.shared = (share_decisions([m for _, m in models], group)
                          or {spec.kind.name: "a schedule (timestep, step or call counts): alike on every rank"})
    return counter


# ----- under torchrun: one decision for all ranks -----
#
# Under sequence parallelism every rank runs every block on its shard of the tokens, and the blocks' attention is a
# collective: a rank that skips a block while another computes it leaves the other waiting. So a skip decided from
# the data must be the same on every rank of the call. What each kind's decision reads:
#   fbc    -- the first block's relative residual change, measured on the block's output: a shard -> reduced (the
#             two sums of the change, over the ranks: every rank compares the one global figure with threshold).
#   mag    -- skips by the step index and the given ratios: a schedule, alike on every rank. Its calibration
#             (calibrate=true: nothing skipped) measures residual norms on the shard -> the logged ratio reduced
#             (the token-weighted mean over the ranks), so the ratios are the one-process render's.
#   sea    -- its indicator is built from the denoiser's input latents, which every rank holds whole (the split
#             comes at the first block): alike already. Its gate is voted all the same (computed wherever one rank
#             computes), so that a last-bit difference can't leave one rank skipping the collectives another runs.
#   pab, faster, taylor -- by the timestep and their call counters: schedules, alike on every rank.


def share_decisions(models, group: Callable[[], Any]) -> dict:
    """Make the data-dependent decisions of the cache hooks on ``models`` one for the ranks of ``group()`` (a
    torch.distributed process group, asked at each reduction; None: the default group), by wrapping each decision
    function on the hook object (diffusers' code runs unchanged around it). Returns what it wrapped (timing.json's
    ``cache.shared_decisions``)."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook
    from diffusers.hooks.mag_cache import MagCacheBlockHook
    from diffusers.hooks.sea_cache import SeaCacheLeaderBlockHook

    done: dict = {}
    voted: set = set()
    for model in models:
        for m in model.modules():
            for hook in list(getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values()):
                if isinstance(hook, FBCHeadBlockHook):
                    hook._should_compute_remaining_blocks = _reduced_fbc_decision(hook, group)
                    done["fbc"] = "first-block residual change summed over the ranks"
                elif isinstance(hook, MagCacheBlockHook) and hook.is_tail and hook.config.calibrate:
                    hook._perform_calibration_step = _reduced_calibration(hook._perform_calibration_step, group)
                    done["mag"] = "calibration ratio averaged over the ranks' tokens"
                elif isinstance(hook, SeaCacheLeaderBlockHook) and id(hook.shared_state) not in voted:
                    voted.add(id(hook.shared_state))
                    hook.shared_state.resolve_gate = _voted_gate(hook.shared_state.resolve_gate, group)
                    done["sea"] = "gate voted (computed where any rank computes)"
    return done


def _reduced_fbc_decision(hook, group):
    """FirstBlockCache's decision on the whole sequence: the relative mean change of the first block's residual
    (mean |now - before| / mean |before|, the figure diffusers compares with ``threshold``) from the two sums over
    every rank's tokens. The shards are equal in size, so the ratio of the sums is the ratio of the means (xfuser
    pads a sequence to a multiple of its degree: there the padding tokens count too)."""
    import torch.distributed as dist

    from .parallel import maybe_inject_failure

    @torch.compiler.disable
    def should_compute(residual: torch.Tensor) -> bool:
        before = hook.state_manager.get_state().head_block_residual
        if before is None:  # the first call of a context: nothing to compare with, on every rank alike
            return True
        # the tests of a rank failing inside the cache's hook, its peers waiting in this all_reduce
        maybe_inject_failure(dist.get_rank(), "cache")
        sums = torch.stack([(residual - before).abs().sum(dtype=torch.float32),
                            before.abs().sum(dtype=torch.float32)]).double()
        dist.all_reduce(sums, group=group())
        return (sums[0] / sums[1]).item() > hook.threshold

    return should_compute


def _reduced_calibration(step, group):
    """MagCache's calibration step, whose ratio (the mean over tokens of |residual| now / before) diffusers
    appends from this rank's tokens, replaced by the mean over every rank's tokens."""
    import torch.distributed as dist

    def calibration_step(state, residual: torch.Tensor):
        step(state, residual)
        tokens = residual.numel() // residual.shape[-1]
        t = torch.tensor([state.calibration_ratios[-1] * tokens, tokens], dtype=torch.float64,
                         device=residual.device)
        dist.all_reduce(t, group=group())
        state.calibration_ratios[-1] = (t[0] / t[1]).item()

    return calibration_step


def _voted_gate(resolve_gate, group):
    """SeaCache's gate, computed on every rank where any rank computes: its accumulated distance reset there as
    diffusers resets it on a computed step."""
    import torch.distributed as dist

    def voted(state, metadata, indicator, config):
        compute = resolve_gate(state, metadata, indicator, config)
        like = state.gen_input if state.gen_input is not None else (indicator[0] if indicator else None)
        vote = torch.tensor([int(compute)], dtype=torch.int32, device=like.device if like is not None else "cpu")
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group())
        if vote.item() and not compute:
            state.accumulated_distance = 0.0
            state.gate_should_compute = True
            return True
        return compute

    return voted


class _CalibrationLog(logging.Handler):
    """The ratios of diffusers' MagCache calibration messages, one list per message in the order they come (each
    cache context's state logs its own when its denoiser has run all its steps), with the denoiser whose call logged
    it (``denoiser``: set by the counter as each denoiser call begins); a message that names itself a calibration
    but holds no list of numbers is kept in ``ignored`` (why, and its start), never evaluated."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.ratios: list[list[float]] = []
        self.denoisers: list[str] = []
        self.ignored: list[str] = []
        self.denoiser = DENOISERS[0]

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception as e:  # a record whose arguments don't format: not diffusers' calibration message
            self.ignored.append(f"unformattable record ({type(e).__name__})")
            return
        if not message.startswith(_CALIBRATION_PREFIX):
            return
        try:
            self.ratios.append(_ratios_of_message(message))
            self.denoisers.append(self.denoiser)
        except ValueError as e:
            self.ignored.append(f"{e}: {message[:80]!r}")

    def clear(self) -> None:
        self.ratios, self.denoisers, self.ignored = [], [], []


class CacheCounter:
    """Per denoising step, how many cache units were computed and how many reused (see the module doc); for a
    calibrating MagCache (``mag:calibrate=true``), the ratios diffusers logs (:meth:`listening`)."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        calibrating = spec.kind.name == "mag" and bool(spec.params.get("calibrate"))
        self.calibration: Optional[_CalibrationLog] = _CalibrationLog() if calibrating else None
        self.units: list[str] = []
        self.models: list[torch.nn.Module] = []
        self._wrapped: dict[int, tuple[torch.nn.Module, Any]] = {}
        self._handles: list = []
        self.inner = self.outer = self.forwards = 0
        self.computed: list[int] = []
        self.reused: list[int] = []
        self.forwards_per_step: list[int] = []
        self.denoiser_per_step: list[Optional[str]] = []
        self._ran: set = set()  # the denoisers called in the step in progress
        self.shared: Optional[dict] = None  # under torchrun: the decisions made one for the ranks (share_decisions)
        self.guidance: Optional[dict] = None  # under a CFG split: what this rank computes (split_guidance)
        self._served: Callable[[], int] = lambda: 0
        self._served_at = 0

    def wrap_candidates(self, model: torch.nn.Module, name: str = DENOISERS[0]) -> None:
        """Wrap the forward of every module a cache may hook (the blocks of a block list and their children), as
        an instance attribute that diffusers' hook then takes as the original forward; each call of the denoiser
        (``name``) counted, and named as the one running."""
        for n, m in model.named_modules():
            parts = n.split(".")
            if len(parts) in (2, 3) and parts[1].isdigit() and isinstance(getattr(model, parts[0], None),
                                                                           torch.nn.ModuleList):
                inner = m.forward
                own = m.__dict__.get("forward")  # a forward of its own (the compiled block's) is put back after

                def counted(*a, _f=inner, **k):
                    self.inner += 1
                    return _f(*a, **k)

                m.forward = counted
                self._wrapped[id(m)] = (m, own)
        self._handles.append(model.register_forward_pre_hook(functools.partial(self._forward, name)))

    def keep(self, model: torch.nn.Module, name: str, hooked: list[str]) -> None:
        """Keep the counters of the modules the cache hooked, unwrap the rest."""
        mods = dict(model.named_modules())
        keep = {id(mods[h]) for h in hooked if h in mods}
        for key, (m, own) in list(self._wrapped.items()):
            if key in keep:
                self._handles.append(m.register_forward_pre_hook(self._outer))
            elif any(m is x for x in mods.values()):
                _unwrap(m, own)
                del self._wrapped[key]
        self.units += [f"{name}.{h}" for h in hooked if h in mods and id(mods[h]) in keep]
        self.models.append(model)

    def split_guidance(self, note: dict, served: Optional[Callable[[], int]] = None) -> None:
        """Under a CFG split each rank computes one guidance branch per step: ``served()`` counts the denoiser
        calls answered without computing (the other rank's branch, handed over by the split's gather), left out of
        ``forwards_per_step`` so that it counts what this rank computed; ``note`` says the split in the summary."""
        self.guidance = note
        if served is not None:
            self._served = served
            self._served_at = served()

    def _outer(self, module, args):
        self.outer += 1

    def _forward(self, name, module, args):
        self.forwards += 1
        self._ran.add(name)
        if self.calibration is not None:
            self.calibration.denoiser = name

    def reset(self) -> None:
        """A new pipeline call: the counts zeroed and the hooks' state too -- diffusers' pipelines don't reset it
        on a call, so a repetition would start from the last one's residuals and step index."""
        from diffusers.hooks import HookRegistry

        for m in self.models:
            HookRegistry.check_if_exists_or_initialize(m).reset_stateful_hooks(recurse=True)
        self.inner = self.outer = self.forwards = 0
        self._served_at = self._served()
        self.computed, self.reused, self.forwards_per_step, self.denoiser_per_step = [], [], [], []
        self._ran = set()
        if self.calibration is not None:
            self.calibration.clear()

    @contextlib.contextmanager
    def listening(self):
        """While the pipeline is called: a calibrating MagCache's ratios recorded. diffusers only prints them and
        logs them at INFO on its ``diffusers.hooks.mag_cache`` logger (below the library's default WARNING), so
        that logger alone is raised to INFO and given a handler for the duration, both undone on the way out,
        an exception included. Nothing for any other cache."""
        if self.calibration is None:
            yield
            return
        logger = logging.getLogger(_MAG_LOGGER)
        level = logger.level
        raise_level = logger.getEffectiveLevel() > logging.INFO
        logger.addHandler(self.calibration)
        try:
            if raise_level:
                logger.setLevel(logging.INFO)
            yield
        finally:
            logger.removeHandler(self.calibration)
            if raise_level:
                logger.setLevel(level)

    def end_step(self) -> None:
        """A denoising step ended: its counts appended, the counters zeroed."""
        self.computed.append(self.inner)
        self.reused.append(self.outer - self.inner)
        served = self._served()
        self.forwards_per_step.append(self.forwards - (served - self._served_at))
        self.denoiser_per_step.append("+".join(sorted(self._ran)) or None)
        self._served_at = served
        self.inner = self.outer = self.forwards = 0
        self._ran = set()

    def summary(self) -> dict:
        total = sum(self.computed) + sum(self.reused)
        per = {}
        for u in self.units:
            per[u.split(".")[0]] = per.get(u.split(".")[0], 0) + 1
        return {**self.spec.as_dict(), "units": len(self.units), "units_per_denoiser": per,
                "unit": "block" if all(u.split(".")[-1].isdigit() for u in self.units) else "attention module",
                "computed_blocks_per_step": list(self.computed), "reused_blocks_per_step": list(self.reused),
                "forwards_per_step": list(self.forwards_per_step), "denoiser_per_step": list(self.denoiser_per_step),
                "skipped_share": (sum(self.reused) / total) if total else None,
                "calibration": self._calibration(), "shared_decisions": self.shared, "guidance_split": self.guidance}

    def _calibration(self) -> Optional[dict]:
        """A calibrating MagCache's ratios, one list per cache context in the order they came (Wan's "cond", then
        "uncond"; CogVideoX's one batch; Wan 2.2's high-noise expert's, then the low-noise one's), rounded to 4
        decimals; ``by_denoiser``: the same lists under the denoiser that logged them (each expert's over its own
        steps); and ``use``: the spec to give next time (the other parameters given kept, ``calibrate`` dropped) --
        with each denoiser's first list (``mag_ratios``, the second expert's ``mag_ratios_2``). diffusers' config
        takes one list for every context of a denoiser, and the first is the conditional pass's (the pipeline calls
        it first each step, so its state finishes first): the prompt's prediction, which guidance scales up. None
        for another cache."""
        if self.calibration is None:
            return None
        ratios = [[round(r, 4) for r in rs] for rs in self.calibration.ratios]
        by: dict[str, list] = {}
        for name, rs in zip(self.calibration.denoisers, ratios):
            by.setdefault(name, []).append(rs)
        use = None
        if DENOISERS[0] in by:
            given = {k: v for k, v in self.spec.given.items() if k != "calibrate"}
            given["mag_ratios"] = by[DENOISERS[0]][0]
            if DENOISERS[1] in by:
                given["mag_ratios_2"] = by[DENOISERS[1]][0]
            order = list(self.spec.kind.parameters())
            use = CacheSpec(self.spec.kind, {k: given[k] for k in order if k in given}, {}).name
        return {"ratios": ratios, "by_denoiser": by, "use": use, "ignored": list(self.calibration.ignored)}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m, own in self._wrapped.values():
            if "forward" in m.__dict__:
                _unwrap(m, own)
        self._wrapped = {}


def _unwrap(module: torch.nn.Module, own) -> None:
    """The counter's wrapper taken off ``module``: its own forward (``own``, the compiled one) put back, else the
    class's."""
    if own is not None:
        module.forward = own
    else:
        del module.forward
