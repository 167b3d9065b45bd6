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
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from .timing import Clock

__all__ = ["STAGES", "CallTimer", "StageTimers", "breakdown", "describe"]

#: The stages of a render, in pipeline order (timing.json ``stages``; None where the pipeline has no such stage).
STAGES = ("text_encode", "image_encode", "vae_encode", "denoise", "vae_decode")
_LABELS = {"text_encode": "text encode", "image_encode": "image encode", "vae_encode": "VAE encode",
           "denoise": "denoising", "vae_decode": "VAE decode"}


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

    def remove(self) -> None:
        for t in self.timers.values():
            t.remove()
        for h in self._hooks:
            h.remove()


def breakdown(total: float, stages: dict, *, before_denoise: Optional[float] = None,
              after_denoise: Optional[float] = None) -> dict:
    """A render's ``total`` seconds broken into ``stages`` (seconds by :data:`STAGES` name, None: no such stage):
    ``stages``, ``unaccounted`` (``total`` minus the stages), ``unaccounted_share`` (of ``total``) and
    ``unaccounted_where`` -- ``before_denoise`` (inside the pipeline call before its first denoising step, outside
    the encoders) and ``after_denoise`` (after the last step until the pipeline returns), None where unmeasured."""
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))}; valid: {', '.join(STAGES)}")
    rest = total - sum(v for v in stages.values() if v is not None)
    return {"stages": {s: stages.get(s) for s in STAGES}, "unaccounted": rest,
            "unaccounted_share": rest / total if total > 0 else None,
            "unaccounted_where": {"before_denoise": before_denoise, "after_denoise": after_denoise}}


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
