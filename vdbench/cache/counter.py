"""What a step cache computed and reused, per denoising step: :class:`CacheCounter` (the units' forwards counted,
the denoiser each step ran) and a calibrating MagCache's ratios read from diffusers' log. See :mod:`vdbench.cache`."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Optional

import torch

from ..pipelines import DENOISERS
from .spec import CacheSpec, ratios_of, strict_json

__all__ = ["CacheCounter"]

#: the logger diffusers' MagCache calibration reports its ratios on, and the message's start (``_advance_step``)
MAG_LOGGER = "diffusers.hooks.mag_cache"
_CALIBRATION_PREFIX = "MagCache Calibration Results:"


def _ratios_of_message(message: str) -> list[float]:
    """The ratios of diffusers' ``MagCache Calibration Results: [...]``: the bracketed text read as JSON (never
    evaluated), numbers only; ValueError otherwise."""
    start, end = message.find("["), message.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no bracketed list")
    return ratios_of(strict_json(message[start:end + 1]))


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
        logger = logging.getLogger(MAG_LOGGER)
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
