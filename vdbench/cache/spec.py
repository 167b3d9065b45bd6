"""A step cache's kinds and their parameters, as ``--cache`` spells them: :class:`CacheKind` (one of diffusers'
configs, its settable fields, vdbench's defaults, what the render fills in, its refusals), :data:`KINDS`,
:class:`CacheSpec` and :func:`parse_cache` (the parameters read from the command line, or from a calibrating render's
timing.json). See :mod:`vdbench.cache`."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..pipelines import DENOISERS

__all__ = ["CacheKind", "CacheSpec", "KINDS", "parse_cache", "CACHE_HELP", "ITEM_SEP"]

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


def _no_constant(name):
    raise ValueError(f"{name} is not a finite number")


def strict_json(text: str):
    """``text`` read as JSON, NaN and Infinity refused (JSON has neither); ValueError("not JSON (why)")."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # a decode error, or NaN/Infinity
        raise ValueError(f"not JSON ({getattr(e, 'msg', e)})") from None


def ratios_of(value) -> list[float]:
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
        data = strict_json(text)
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
            return ratios_of(lists[0])
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
