"""What the sweep's stages share (:mod:`vdbench.sweep.stages`, :mod:`vdbench.sweep.verdict`): the run's
:class:`Context` (fixed), its :class:`Budget` (seconds, across the runs that resume it), the renders' :class:`Ledger`
(what they measured) and the stage before the renders (:class:`PreRender`)."""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .. import families
from ..measure.record import Record
from ..sets import Content

__all__ = ["Context", "Budget", "Ledger", "PreRender", "log"]


@dataclass
class Context:
    """What every stage reads and none changes: the arguments (``args.device`` resolved), the sweep's folder, the
    model's family and the device's name."""

    args: argparse.Namespace
    out: Path
    fam: families.Family
    dev_name: str
    sets: list = field(default_factory=lambda: [Content()])  # the prompt and seed set: each candidate renders each
    render_device: Optional[str] = None  # what a render is told (cuda: the pool gives each its own GPU)
    max_mem: Optional[float] = None  # --max_gpu_mem, bytes
    weights: Optional[dict] = None  # the denoisers' parameters (vdbench.sweep.memory.weights), for --max_gpu_mem
    gpu_ids: list = field(default_factory=list)  # the GPUs the renders share (the pool's; [] on a CPU)
    visible: list = field(default_factory=list)  # the GPUs this process sees, in its own cuda:N order
    gpus: int = 1  # how many

    @property
    def device(self) -> str:
        return self.args.device

    def content_of(self, rec: Record) -> Optional[int]:
        """Which content of the set a render's record is of (by its recorded prompt and seed), None: none."""
        settings = rec.config.get("settings") or {}
        for i, c in enumerate(self.sets):
            prompt = c.prompt if c.prompt is not None else (getattr(self.args, "prompt", None) or self.fam.cli.prompt)
            seed = c.seed if c.seed is not None else self.args.seed
            if settings.get("seed", seed) == seed and settings.get("prompt", prompt) == prompt:
                return i
        return None

    @property
    def quality_device(self) -> Optional[str]:
        """Where the SSIM windows run: the GPU where there is one (on the host they cost half a render)."""
        return self.device if self.device.startswith("cuda") else None


class Budget:
    """The sweep's seconds: ``--budget_min`` over every run that resumes the sweep (what earlier runs spent is kept
    in ``progress.json``, with what they measured: :attr:`progress`), ``--stop_after_min`` for this run alone."""

    def __init__(self, out: Path, budget_s: float, stop_after_s: float = math.inf):
        self.t0 = time.monotonic()
        self.path, self.budget_s, self.stop_after_s = out / "progress.json", budget_s, stop_after_s
        try:
            self.progress = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.progress = {}
        self.spent_before = float(self.progress.get("spent_s", 0.0))
        self.runs = int(self.progress.get("runs", 0)) + 1  # this run's number

    def left(self) -> float:
        now_s = time.monotonic() - self.t0
        return min(self.budget_s - self.spent_before - now_s, self.stop_after_s - now_s)

    def spent(self) -> float:
        return self.spent_before + time.monotonic() - self.t0

    def save(self, **extra) -> None:
        self.progress.update(spent_s=self.spent(), runs=self.runs, **extra)
        self.path.write_text(json.dumps(self.progress))


@dataclass
class Ledger:
    """What the renders measured and decided, read and written by the render stage: the slowest render, each
    render's seconds and one quality comparison's (kept across the runs in ``progress.json``), each candidate's
    record (its first content's; ``sets``: every content's), those skipped for the budget or failed and every
    left-out one with why, the attention's milliseconds per step by backend (what predicts a render's time) and the
    renders this run started or passed over."""

    slowest: float = 0.0
    render_s: dict = field(default_factory=dict)
    quality_s: Optional[float] = None
    records: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    left_out: list = field(default_factory=list)
    attn: dict = field(default_factory=dict)
    tried: set = field(default_factory=set)
    sets: dict = field(default_factory=dict)  # name -> {content index: record} (records: the first content's)
    given_up: set = field(default_factory=set)  # skipped or failed: its other contents are not started
    mem: dict = field(default_factory=dict)  # name -> (estimated peak bytes or None, what it rests on)

    @classmethod
    def resume(cls, progress: dict) -> "Ledger":
        return cls(float(progress.get("slowest_s", 0.0)), dict(progress.get("render_s") or {}),
                   progress.get("quality_s"))


@dataclass
class PreRender:
    """The stage before the renders: what it cost and where it ran (``pre``: the probe's, the capture render's and
    the kernel bench's seconds, or why there was no bench), the bench's bound, the 1-GPU renders that go on beside it (``early``), and
    what its job reported (``got``) once :func:`finish_kernel_bench` joined it."""

    pre: dict
    kernel_max_s: float = 0.0
    early: list = field(default_factory=list)
    got: dict = field(default_factory=dict)
    thread: Optional[threading.Thread] = None
    held: Optional[str] = None  # the pool's GPU the bench ran on, held from the renders until it ends


def log(msg: str) -> None:
    print(msg, flush=True)
