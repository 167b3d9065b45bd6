"""Where a render's time goes: the stages of a pipeline call timed from the outside, and the breakdown that adds
them up against the render's total (timing.json's ``stages`` and ``unaccounted``).

Why: an image-to-video render pays for more than its denoising steps -- Wan 2.1 I2V runs a CLIP image encoder and
VAE-encodes a whole conditioning video (the image, then zero frames: 81 frames at 480p), CogVideoX I2V encodes
the image -- and nobody could see what those cost. The pipeline's code is not changed to time them: each stage is
timed by hooks on its module. :class:`CallTimer` records a (start, end) pair of :class:`vdbench.timing.Clock`
around every call -- forward hooks on a module (the text and image encoders), or a wrapper of an instance method
set on the instance and removed afterwards (``vae.encode`` is a method, not a forward) -- and reads them once at
the end, so nothing synchronizes during the run. :class:`StageTimers` holds a pipeline's timers and the mark of its
first denoiser call, where the denoising (and its first step) starts.

:func:`breakdown` adds the stages up against the render's ``total_time`` (the pipeline call, then the decode):
what no stage covers is ``unaccounted``, named by where it lies -- before the first denoising step outside the
encoders (tokenization, image preprocessing, the initial latents, the scheduler's timesteps) and after the last
step until the pipeline returns; the two parts are measured on their own, so their sum equals ``unaccounted`` only
if the stages neither overlap nor leave a gap elsewhere (tests/test_stages.py). :func:`describe` is the line the
render prints.

The same for the whole render, from the process's start to the video on disk (timing.json's ``end_to_end_s`` and
``end_to_end``): :func:`end_to_end` adds :data:`END_TO_END_STAGES` -- the startup, the load, the untimed warm-up
calls, the repetitions' stages summed, the write -- and names the rest ``unaccounted``, so the stages and
``unaccounted`` add up to ``end_to_end_s`` by construction (:func:`render_end_to_end`: from a render's marks,
:class:`Wall`, and its entries). :func:`one_time` completes each repetition's
``one_time`` section (what a render pays once, apart from its steady work) and ``steady_s``;
:func:`merge_one_time` takes the one-time costs a stage reports itself (``info["one_time"]`` of the decode or the
encode) into it under the stage's prefix; :func:`describe_end_to_end` is the render's end-to-end line.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .timing import Clock, WallStart

__all__ = ["STAGES", "END_TO_END_STAGES", "CallTimer", "StageTimers", "breakdown", "describe", "end_to_end",
           "merge_one_time", "reported_since", "stage_reports", "one_time", "describe_end_to_end", "Wall",
           "render_end_to_end"]

#: The stages of a render, in pipeline order (timing.json ``stages``; None where the pipeline has no such stage).
STAGES = ("text_encode", "image_encode", "vae_encode", "denoise", "vae_decode")
_LABELS = {"text_encode": "text encode", "image_encode": "image encode", "vae_encode": "VAE encode",
           "denoise": "denoising", "vae_decode": "VAE decode", "startup": "startup", "load": "load",
           "warmup_calls": "warm-up calls", "write": "write"}

#: The stages of a whole render, from the process's start to the video on disk (timing.json ``end_to_end.stages``):
#: ``startup`` (the process's start until the load: the interpreter, the imports, the argument parsing, the checks
#: that need no weights), ``load`` (the pipeline's weights, the checks of the loaded model, the parallel engine,
#: the speed options), ``warmup_calls`` (``--warmup_calls``' untimed calls), the :data:`STAGES` of every repetition
#: summed, ``write`` (the video, and the raw frames with ``--save_frames``).
END_TO_END_STAGES = ("startup", "load", "warmup_calls", *STAGES, "write")

#: The stages that may report one-time costs of their own (``info["one_time"]``), merged under their name.
ONE_TIME_STAGES = ("vae_decode", "vae_encode")


class CallTimer:
    """The (start, end) clocks of every call of ``obj``'s forward (forward pre/post hooks) or, with ``method``, of
    that method of the instance (wrapped on the instance; :meth:`remove` deletes the wrapper, so the class and other
    instances are untouched; an instance whose ``method`` is already replaced is refused). ``around``: a context
    manager factory entered around each wrapped call (the render's watchdog of the VAE encode)."""

    def __init__(self, obj, device, *, method: Optional[str] = None, around: Optional[Callable] = None):
        self.device = torch.device(device)
        self.spans: list[tuple[Clock, Clock]] = []
        self._open: Optional[Clock] = None
        self._obj, self._method, self._handles = obj, method, []
        if method is None:
            self._handles = [obj.register_forward_pre_hook(self._pre), obj.register_forward_hook(self._post)]
            return
        if method in obj.__dict__:
            raise ValueError(f"{type(obj).__name__}.{method} is already replaced on this instance; a timer would "
                             "hide it")
        original = getattr(obj, method)

        def timed(*args, **kwargs):
            self._pre()
            with around() if around is not None else contextlib.nullcontext():
                out = original(*args, **kwargs)
            self._post()
            return out

        setattr(obj, method, timed)

    def _pre(self, *_):
        self._open = Clock(self.device)

    def _post(self, *_):
        if self._open is not None:
            self.spans.append((self._open, Clock(self.device)))
            self._open = None

    def reset(self) -> None:
        self.spans, self._open = [], None

    def seconds(self) -> Optional[float]:
        """The calls' total time since the last :meth:`reset`; None if nothing was called (no such stage)."""
        return sum(a.seconds_until(b) for a, b in self.spans) if self.spans else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if self._method is not None:
            self._obj.__dict__.pop(self._method, None)


class StageTimers:
    """A pipeline's stage timers: its text encoder, image encoder and VAE encode (each absent where the pipeline
    has no such module), and the clock of the first call of any of its ``denoisers`` since :meth:`reset` (where the
    denoising starts). ``encode_around``: see :class:`CallTimer`."""

    def __init__(self, pipe, denoisers, device, *, encode_around: Optional[Callable] = None):
        self.device = torch.device(device)
        self.timers: dict[str, CallTimer] = {}
        for stage, name in (("text_encode", "text_encoder"), ("image_encode", "image_encoder")):
            if getattr(pipe, name, None) is not None:
                self.timers[stage] = CallTimer(getattr(pipe, name), device)
        if getattr(pipe, "vae", None) is not None:
            self.timers["vae_encode"] = CallTimer(pipe.vae, device, method="encode", around=encode_around)
        self.denoise_start: Optional[Clock] = None
        self._hooks = [m.register_forward_pre_hook(self._mark) for m in denoisers]

    def _mark(self, *_):
        if self.denoise_start is None:
            self.denoise_start = Clock(self.device)

    def reset(self) -> None:
        for t in self.timers.values():
            t.reset()
        self.denoise_start = None

    def seconds(self, stage: str) -> Optional[float]:
        """A timed stage's total since the last reset; None where the pipeline has no such module or ran none."""
        timer = self.timers.get(stage)
        return timer.seconds() if timer is not None else None

    def entry(self, *, start: Clock, after_pipe: Clock, after_decode: Clock, last_step: Optional[Clock],
              step_times: list, vae_decode: float) -> dict:
        """timing.json's fields of one repetition: ``text_encode_time``, ``image_encode_time``, ``vae_encode_time``
        and the :func:`breakdown` of ``start`` -> ``after_decode``. ``step_times`` must start at
        :attr:`denoise_start` (:meth:`vdbench.timing.StepTimer.starts_at`); ``last_step``: the last step's mark."""
        enc = {s: self.seconds(s) for s in ("text_encode", "image_encode", "vae_encode")}
        before = after = None
        if self.denoise_start is not None and last_step is not None:
            before = start.seconds_until(self.denoise_start) - sum(v for v in enc.values() if v is not None)
            after = last_step.seconds_until(after_pipe)
        stages = {**enc, "denoise": sum(step_times) if step_times else None, "vae_decode": vae_decode}
        return {"text_encode_time": enc["text_encode"], "image_encode_time": enc["image_encode"],
                "vae_encode_time": enc["vae_encode"],
                **breakdown(start.seconds_until(after_decode), stages, before_denoise=before, after_denoise=after)}

    def close(self) -> None:
        """The hooks taken off the pipeline and its denoisers (what the watch's other parts do on ``close`` too)."""
        for t in self.timers.values():
            t.remove()
        for h in self._hooks:
            h.remove()


def _split(total: float, stages: dict, names) -> dict:
    """``stages`` (seconds by name of ``names``; an unknown name refused) in ``names``' order, and ``total`` minus
    them as ``unaccounted`` (with its share of ``total``): the one arithmetic of both breakdowns."""
    unknown = set(stages) - set(names)
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))}; valid: {', '.join(names)}")
    rest = total - sum(v for v in stages.values() if v is not None)
    return {"stages": {s: stages.get(s) for s in names}, "unaccounted": rest,
            "unaccounted_share": rest / total if total > 0 else None}


def breakdown(total: float, stages: dict, *, before_denoise: Optional[float] = None,
              after_denoise: Optional[float] = None) -> dict:
    """A render's ``total`` seconds broken into ``stages`` (seconds by :data:`STAGES` name, None: no such stage):
    ``stages``, ``unaccounted`` (``total`` minus the stages), ``unaccounted_share`` (of ``total``) and
    ``unaccounted_where`` -- ``before_denoise`` (inside the pipeline call before its first denoising step, outside
    the encoders) and ``after_denoise`` (after the last step until the pipeline returns), None where unmeasured."""
    out = _split(total, stages, STAGES)
    out["unaccounted_where"] = {"before_denoise": before_denoise, "after_denoise": after_denoise}
    return out


def describe(entry: dict) -> str:
    """One line for a person: ``stages: text encode 0.012 s, VAE encode 1.104 s, denoising 30.1 s (3 steps), VAE
    decode 1.80 s; unaccounted 0.050 s (0.2% of 33.0 s: 0.040 before the denoising, 0.010 after)``."""
    parts = []
    for s in STAGES:
        v = (entry.get("stages") or {}).get(s)
        if v is not None:
            steps = f" ({len(entry['step_times'])} steps)" if s == "denoise" and entry.get("step_times") else ""
            parts.append(f"{_LABELS[s]} {v:.3f} s{steps}")
    rest, share = entry.get("unaccounted"), entry.get("unaccounted_share")
    where = entry.get("unaccounted_where") or {}
    tail = ""
    if rest is not None and share is not None:
        named = ""
        if where.get("before_denoise") is not None and where.get("after_denoise") is not None:
            named = f": {where['before_denoise']:.3f} before the denoising, {where['after_denoise']:.3f} after"
        tail = f"; unaccounted {rest:.3f} s ({share:.1%} of {entry.get('total_time', float('nan')):.2f} s{named})"
    return "stages: " + ", ".join(parts) + tail


def end_to_end(total: float, stages: dict, *, in_repetitions: Optional[float] = None) -> dict:
    """A whole render's ``total`` seconds (process start to the video on disk) broken into ``stages`` (seconds by
    :data:`END_TO_END_STAGES` name, None: no such stage): ``stages``, ``unaccounted`` (``total`` minus the stages:
    ``stages`` + ``unaccounted`` = ``total`` exactly), ``unaccounted_share`` and ``unaccounted_where`` --
    ``in_repetitions`` (the repetitions' own ``unaccounted``, summed) and ``outside`` (the rest: the gaps between
    the load, the repetitions and the write)."""
    out = _split(total, stages, END_TO_END_STAGES)
    rest = out["unaccounted"]
    out["unaccounted_where"] = {"in_repetitions": in_repetitions,
                                "outside": None if in_repetitions is None else rest - in_repetitions}
    return out


@dataclass
class Wall:
    """The host-clock marks of a render that its end-to-end time is made of: what it counts from (``started``,
    :class:`vdbench.timing.WallStart`), where the load began (``load_start``, ``time.perf_counter``) and how long it
    took (``load_s``)."""

    started: WallStart
    load_start: float
    load_s: float


def render_end_to_end(entries: list[dict], wall: Wall, write_s: float, end: float) -> dict:
    """timing.json's ``end_to_end`` of a render (:func:`end_to_end`, with what it counts from, the clock, the
    repetitions it covers): the stages of ``wall`` and of every repetition's entry, summed, and the write
    (``write_s``, ending at ``end``, ``time.perf_counter``)."""

    def summed(stage):
        vals = [(e.get("stages") or {}).get(stage) for e in entries]
        vals = [v for v in vals if v is not None]
        return sum(vals) if vals else None

    stages = {"startup": wall.load_start - wall.started.t, "load": wall.load_s,
              "warmup_calls": (entries[0].get("one_time") or {}).get("warmup_calls_s"),
              **{k: summed(k) for k in STAGES}, "write": write_s}
    in_reps = [e.get("unaccounted") for e in entries]
    return {**wall.started.as_dict(), "repetitions": len(entries),
            **end_to_end(end - wall.started.t, stages,
                         in_repetitions=sum(in_reps) if all(v is not None for v in in_reps) else None)}


def merge_one_time(section: dict, stage: str, info: Optional[dict], *, keys=None) -> dict:
    """Put the one-time costs ``info["one_time"]`` (``{"name_s": seconds}``, reported by the stage itself) into
    ``section`` as ``"<stage>.name_s"``; values that are not numbers are left out. ``keys``: only these names (the
    ones a repetition reported itself). Returns ``section``."""
    reported = (info or {}).get("one_time") or {}
    for k, v in reported.items():
        if (keys is None or k in keys) and isinstance(v, (int, float)) and not isinstance(v, bool):
            section[f"{stage}.{k}"] = float(v)
    return section


def reported_since(info: dict, set_up: Optional[dict], before: dict) -> tuple[dict, dict]:
    """The one-time costs a stage whose ``info`` lives across the pipeline calls (the encode's) reported for one
    repetition, and, for the first, those it reported in the warm-up calls: (this repetition's, the warm-up's).
    ``before``: ``info["one_time"]`` when the repetition began; ``set_up`` (the first repetition only): when the
    warm-up calls began -- what was reported before them (on setting up) is the first repetition's."""
    now = dict(info.get("one_time") or {})
    if set_up is None:
        return {k: v for k, v in now.items() if before.get(k) != v}, {}
    in_warmup = {k: v for k, v in before.items() if set_up.get(k) != v}
    return {k: v for k, v in now.items() if k not in in_warmup or in_warmup[k] != v}, in_warmup


def stage_reports(encode_info: dict, decode_info: dict, before: dict, *, set_up: Optional[dict] = None) -> dict:
    """The one-time costs one repetition's stages reported themselves, under their stage's prefix: the encode's
    (``encode_info`` lives across the calls: :func:`reported_since`, with ``before`` and ``set_up``), for the first
    repetition also those the encode reported inside the warm-up calls (their time holds them), and the decode's."""
    mine, in_warmup = reported_since(encode_info, set_up, before)
    out: dict = {}
    merge_one_time(out, "vae_encode", {"one_time": mine})
    merge_one_time(out, "warmup_calls.vae_encode", {"one_time": in_warmup})
    merge_one_time(out, "vae_decode", decode_info)
    return out


def _reported(section: dict) -> dict:
    return {k: v for k, v in section.items() if k.split(".", 1)[0] in ONE_TIME_STAGES and v is not None}


def one_time(entries: list[dict]) -> list[dict]:
    """Complete the ``one_time`` section and ``steady_s`` of a render's entries (in place; returns them).

    ``one_time`` holds what a repetition paid once, apart from its steady work: ``first_step_excess_s`` (its first
    step minus its warm median; None without a warm step), ``first_decode_excess_s`` (the first repetition's VAE
    decode minus the median of the later ones': with two repetitions or more), the costs the stages reported
    themselves (``vae_decode.<name>_s``, ``vae_encode.<name>_s``), and on the first repetition, which carries the
    render's one-time costs, ``load_s`` (the load stage), ``warmup_calls_s`` / ``warmup_calls_excess_s``
    (``--warmup_calls``: their time, and that time minus as many steady pipeline calls) and ``compile_s``
    (torch.compile's time, already inside the first step's, the warm-up's or the decode's time: not added).

    ``total_s`` adds each cost once: the first step's excess, the warm-up calls' excess and the stages' reported
    costs -- or, for a decode that reported none, ``first_decode_excess_s``. The load is not in it (it is the same
    work whatever the attention backend; ``load_s`` beside it). ``steady_s``: the repetition's ``total_time`` minus
    its one-time costs (those paid inside it: ``total_s`` less the warm-up's), what a warm render would take."""
    decodes = [e.get("vae_decode_time") for e in entries[1:] if e.get("vae_decode_time") is not None]
    for i, e in enumerate(entries):
        section = dict(e.get("one_time") or {})
        first, warm = e.get("first_step"), e.get("warm_step_median")
        section["first_step_excess_s"] = (first - warm) if first is not None and warm is not None else None
        if i == 0:
            section.setdefault("load_s", None)
            section.setdefault("warmup_calls_s", None)
            section.setdefault("compile_s", None)
            section["first_decode_excess_s"] = (e["vae_decode_time"] - statistics.median(decodes)
                                                if decodes and e.get("vae_decode_time") is not None else None)
        reported = _reported(section)
        counted_decode = (section.get("first_decode_excess_s")
                          if not any(k.startswith("vae_decode.") for k in reported) else None)
        inside = sum(v for v in (section["first_step_excess_s"], counted_decode, *reported.values()) if v is not None)
        warmup_excess = None
        if i == 0 and section.get("warmup_calls_s") is not None:
            calls = int(((e.get("run") or {}).get("settings") or {}).get("warmup_calls") or 1)
            steady_call = (e.get("pipe_time") or 0.0) - (section["first_step_excess_s"] or 0.0)
            warmup_excess = section["warmup_calls_s"] - calls * steady_call
            section["warmup_calls_excess_s"] = warmup_excess
        section["total_s"] = inside + (warmup_excess or 0.0)
        e["one_time"] = section
        e["steady_s"] = (e["total_time"] - inside) if e.get("total_time") is not None else None
    return entries


def describe_end_to_end(entry: dict) -> Optional[str]:
    """One line for a person: ``end-to-end 41.3 s (process start to the video on disk: startup 6.10, load 9.20,
    denoising 24.0, VAE decode 1.10, write 0.30, ...; unaccounted 0.21, 0.5%); one-time 2.05 s beyond the steady
    work (first step +1.90, compile 1.70 within it), load 9.20 s``; None when the entry has no end-to-end time."""
    total = entry.get("end_to_end_s")
    if total is None:
        return None
    e2e = entry.get("end_to_end") or {}
    since = {"process start": "process start", "vdbench import": "vdbench's import",
             "render call": "the render's call"}.get(e2e.get("since"), "start")
    parts = [f"{_LABELS.get(k, k)} {v:.2f}" for k, v in (e2e.get("stages") or {}).items() if v]
    rest, share = e2e.get("unaccounted"), e2e.get("unaccounted_share")
    if rest is not None:
        parts.append(f"unaccounted {rest:.2f}" + (f", {share:.1%}" if share is not None else ""))
    reps = e2e.get("repetitions") or 1
    line = (f"end-to-end {total:.2f} s ({since} to the video on disk"
            + (f", {reps} repetitions" if reps > 1 else "") + ": " + ", ".join(parts) + ")")
    ot = entry.get("one_time") or {}
    if ot.get("total_s") is not None:
        bits = []
        if ot.get("first_step_excess_s") is not None:
            bits.append(f"first step {ot['first_step_excess_s']:+.2f}")
        if ot.get("warmup_calls_excess_s") is not None:
            bits.append(f"warm-up calls {ot['warmup_calls_excess_s']:+.2f}")
        bits += [f"{k} {v:+.2f}" for k, v in _reported(ot).items()]
        if ot.get("first_decode_excess_s") is not None and not any(k.startswith("vae_decode.") for k in _reported(ot)):
            bits.append(f"first decode {ot['first_decode_excess_s']:+.2f}")
        if ot.get("compile_s"):
            bits.append(f"compile {ot['compile_s']:.2f} within them")
        line += f"; one-time {ot['total_s']:.2f} s beyond the steady work ({', '.join(bits)})"
    if ot.get("load_s") is not None:
        line += f", load {ot['load_s']:.2f} s"
    return line
