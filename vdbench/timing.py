"""Timing that is honest about asynchronous devices, and the timing.json every render appends to.

Rules (docs/RENDERING.md): device work is timed with CUDA events (or after a synchronize); host clocks are only used
around work that is synchronous (CPU) or after an explicit synchronize. Per-step times come from events
recorded at each step boundary by the pipeline's ``callback_on_step_end``, so they cost no synchronization
during the run; they are read once at the end.

``timing.json`` is a JSON list with one object per repetition. Renders of several backends into one results
directory append to the same list (each object names its ``attention_type`` and carries the run's header:
settings, versions, device), written atomically under a file lock so a crash never leaves a truncated file
and a corrupt file is moved aside, never overwritten.

**One definition of a step time** (:func:`step_stats`, used by every output: the render line, timing.json, the
report and summary.csv, the grid labels, ``bench/parallel_summary.py``): the *warm step* is the median of the
steps after the first, given with its n and its spread (min–max, p20–p80); the first step is reported on its own
as ``first_step``, because it pays one-time costs (cuDNN plans, Triton JIT, allocator growth) that can make it
1.5–5.6x a warm step on an H200 -- a median that includes it is a different number. Across repetitions
(:func:`run_step_stats`) the warm steps of all repetitions are pooled and each repetition's own warm median is kept
beside them. A figure is a *speed figure* only when it was timed on a GPU, from at least ``MIN_SAMPLES`` samples,
and not for an emulated backend; otherwise ``speed_figure`` is False and ``why_not_speed`` says why
(:func:`speed_verdict`), so a CPU timing of one repetition can't pass for a measurement.

**Bench samples** (:func:`sample_ms`, used by the kernel benches): the first call of a callable is timed on its
own (``first_ms``: Triton JIT, a FlexAttention compile, a cuDNN plan for the shape are paid there) and never counted
among the warm samples; the number of warm samples adapts to the call's time -- at least ``TARGET_SAMPLES``, more
for short calls (``rep_ms`` of them), within a per-row budget that says why when it allowed fewer. A *cold* figure
is a first call in a fresh process whose Triton and inductor caches point at new empty directories
(:func:`fresh_cache_env`, :func:`cache_state`: the benches' ``--cold``).

Profiles live here too, beside the clocks: :class:`StepProfiler` runs ``torch.profiler`` over scheduled denoising
steps (the render's ``--profile_*`` flags), each profile's kernels summed by :func:`vdbench.profiling.kernel_summary`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .power import PowerTrace
from .profiling import kernel_summary

__all__ = ["Clock", "Laps", "StepTimer", "MIN_SAMPLES", "STEP_KEYS", "spread", "speed_verdict", "step_stats",
           "run_step_stats", "call_ms", "first_call_ms", "TARGET_SAMPLES", "Sampled", "sample_ms", "CACHE_VARS",
           "cache_state", "fresh_cache_env", "describe_steps", "system_info", "append_timing", "load_timing",
           "peak_memory", "reset_peak_memory", "process_start", "WallStart", "wall_start", "compile_seconds",
           "compile_counts", "device_seconds", "StepProfiler"]


class Clock:
    """A point in time on ``device``: a recorded CUDA event on GPU, a host clock after nothing on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.t = time.perf_counter()

    def seconds_until(self, later: "Clock") -> float:
        if self.cuda:
            later.event.synchronize()
            return self.event.elapsed_time(later.event) / 1000.0
        return later.t - self.t


def device_seconds(device: torch.device, run) -> float:
    """``run()``'s time on ``device``'s clock (:class:`Clock`: on a GPU, until the work it queued is done)."""
    start = Clock(device)
    run()
    return start.seconds_until(Clock(device))


class Laps:
    """Consecutive named parts of a stretch of host time, added into ``parts`` (a dict, the caller's): ``lap(name)``
    bills ``name`` the time since the previous lap (or the start), less what other laps billed to the same ``parts``
    meanwhile -- a callee timing its own parts into the same dict -- so the parts add up to the whole, each second
    counted once. With ``device`` a GPU, each lap first waits for its queued work (a part's kernels are its own, not
    the next part's). ``parts`` None: nothing is timed and nothing waited for. ``lap`` returns ``value``, so a part can
    wrap the expression it times."""

    def __init__(self, parts: Optional[dict], device=None):
        self.parts = parts
        self._device = device if device is not None and torch.device(device).type == "cuda" else None
        self._t = time.perf_counter()
        self._billed = sum(parts.values()) if parts is not None else 0.0

    def lap(self, name: str, value=None):
        if self.parts is None:
            return value
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        now = time.perf_counter()
        billed = sum(self.parts.values())
        self.parts[name] = self.parts.get(name, 0.0) + (now - self._t) - (billed - self._billed)
        self._t, self._billed = now, sum(self.parts.values())
        return value


def process_start() -> tuple[float, str]:
    """(the process's start on the ``time.perf_counter`` clock, the clock it was read from).

    On Linux the kernel's record of the process's start (``/proc/self/stat`` field 22, clock ticks since boot: 10 ms
    resolution) against ``CLOCK_BOOTTIME`` (the clock that field counts on): ``"proc_starttime"``; where that clock
    is missing, against the wall clock and ``/proc/stat``'s ``btime`` (whole seconds: up to 1 s early):
    ``"proc_starttime+btime"``. Elsewhere, or where /proc can't be read, the moment vdbench was first imported
    (``vdbench.IMPORTED_AT``; the interpreter's start and the imports before it are not counted):
    ``"vdbench_import"``."""
    from . import IMPORTED_AT

    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        # field 2 (the command name) is in parentheses and may hold spaces: count the fields after its ")"
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        if hasattr(time, "CLOCK_BOOTTIME"):
            age, clock = time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot, "proc_starttime"
        else:
            with open("/proc/stat") as f:
                btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
            age, clock = time.time() - (btime + since_boot), "proc_starttime+btime"
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED_AT, "vdbench_import"
    start = now - age
    if age < 0 or start > IMPORTED_AT:  # a clock that disagrees with what this process saw itself: not trusted
        return IMPORTED_AT, "vdbench_import"
    return start, clock


class WallStart:
    """What a render's ``end_to_end_s`` counts from: ``t`` on the ``time.perf_counter`` clock, ``since`` (``"process
    start"``, ``"vdbench import"`` or ``"render call"``) and ``clock`` (:func:`process_start`'s name, or
    ``"perf_counter"`` for a render call)."""

    def __init__(self, t: float, since: str, clock: str):
        self.t, self.since, self.clock = t, since, clock

    def as_dict(self) -> dict:
        return {"since": self.since, "clock": self.clock}


_PROCESS_START_USED = False


def wall_start(from_process: bool) -> WallStart:
    """The start a render's end-to-end time counts from. ``from_process`` (the render CLIs): the process's start
    (:func:`process_start`) for the first render of the process -- what the user waited, interpreter and imports
    included; a later render in the same process (tests, a script calling the CLI twice) counts from now, its own
    call, since the process's start was paid for by the first. Otherwise (a render called as a library) from now."""
    global _PROCESS_START_USED
    if from_process and not _PROCESS_START_USED:
        _PROCESS_START_USED = True
        t, clock = process_start()
        return WallStart(t, "vdbench import" if clock == "vdbench_import" else "process start", clock)
    return WallStart(time.perf_counter(), "render call", "perf_counter")


def compile_seconds() -> float:
    """Seconds torch.compile (dynamo and its backend: inductor's code generation and Triton builds, FlexAttention's
    kernel on CUDA) has spent compiling in this process so far, from torch's own counters
    (``torch._dynamo.utils.calculate_time_spent()["total_wall_time"]``); 0.0 when nothing was compiled or the
    counters can't be read. The difference of two readings is what was compiled between them."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
    if utils is None:
        return 0.0
    try:
        return float(utils.calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a private counter of torch's: its absence must not stop a render
        return 0.0


def compile_counts() -> tuple[int, int]:
    """(graphs, graph breaks) torch.compile has made in this process so far, from dynamo's own counters
    (``torch._dynamo.utils.counters``: ``stats.unique_graphs``, which a recompile adds to as much as a first compile,
    and the ``graph_break`` reasons summed); (0, 0) when nothing was compiled or the counters can't be read. The
    difference of two readings is what was compiled between them: a compiled render whose steps after the first
    compile anything recompiles (a guard failed)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    try:
        counters = utils.counters
        return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["graph_break"].values()))
    except Exception:  # noqa: BLE001 - a private counter of torch's: its absence must not stop a render
        return 0, 0


class StepTimer:
    """One pipeline call's steps, as its ``callback_on_step_end``: the step times (a clock at each step's end), the
    graphs torch.compile made in each step and its graph breaks (:func:`compile_counts` at each step's end: a graph
    made after the first step is a recompile), and the profiler's schedule stepped where one runs over the call
    (:meth:`run_pipe`); chain it with other callbacks via ``then``. One per call: its counts start where it is made.

    Inside :meth:`run_pipe` it also keeps the host's side of each step (:meth:`host`): the Python garbage collector's
    pauses that fell in it (any thread's: a collection holds every thread), since a pause the GPU's queue does not
    cover is idle GPU time -- and a multi-GPU step, whose ranks wait for each other, keeps a shorter queue."""

    def __init__(self, device, then=None, profiler: Optional["StepProfiler"] = None, power=None):
        self.device = torch.device(device)
        # a PowerTrace sampled over run_pipe (vdbench.power.open_trace), or why there is none
        self.power: Optional[PowerTrace] = power if isinstance(power, PowerTrace) else None
        self.power_why = power if isinstance(power, str) else "not sampled"
        self.started: Optional[Clock] = None
        self.marks: list[Clock] = []
        self.gc_ms: list[float] = []  # per step, as the steps come (index = marks so far - 1)
        self.gc_collections = [0, 0, 0]  # by generation
        self._gc_t0: Optional[float] = None
        self.then, self.profiler = then, profiler
        self._compiled_at = compile_counts()
        self.graphs_per_step: list[int] = []
        self.graph_breaks = 0

    def start(self):
        """The call starts: :attr:`started`, and the first step's start until :meth:`starts_at` moves it."""
        self.started = Clock(self.device)
        self.marks = [self.started]
        if self.power is not None and self.started.cuda:
            self.power.watch(self.started.event)

    def run_pipe(self, pipe, **kwargs):
        """``pipe(callback_on_step_end=self, **kwargs)`` -- a pipeline call with this timer as its step callback --
        from :meth:`start`, inside the profiler where one is given (left also on an error); what it returns."""
        import gc

        power = self.power
        with self.profiler if self.profiler is not None else contextlib.nullcontext():
            if power is not None:
                power.start()
            self.start()
            gc.callbacks.append(self._gc)
            try:
                return pipe(callback_on_step_end=self, **kwargs)
            finally:
                gc.callbacks.remove(self._gc)
                if power is not None:
                    power.stop()

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        if self._gc_t0 is None:
            return
        i = max(0, len(self.marks) - 1)
        self.gc_ms += [0.0] * (i + 1 - len(self.gc_ms))
        self.gc_ms[i] += (time.perf_counter() - self._gc_t0) * 1e3
        self.gc_collections[min(int(info.get("generation", 0)), 2)] += 1
        self._gc_t0 = None

    def host(self) -> dict:
        """The host's side of the steps: ``gc_ms_per_step`` (the garbage collector's pauses in each step, ms; the
        first step's holds the pauses before it too), ``gc_collections`` by generation, ``gc_ms`` in all."""
        n = max(0, len(self.marks) - 1)
        per = (self.gc_ms + [0.0] * n)[:n]
        return {"gc_ms_per_step": [round(x, 3) for x in per], "gc_collections": list(self.gc_collections),
                "gc_ms": round(sum(self.gc_ms), 3)}

    def starts_at(self, clock: Optional[Clock]) -> None:
        """The first step starts at ``clock`` (a render: the first denoiser call) instead of at :meth:`start`, so
        what ran before it in the pipeline call (the text and image encoders, the VAE encode, the initial latents)
        is no step's time; None leaves the start as it was."""
        if clock is not None and self.marks:
            self.marks[0] = clock

    def __call__(self, pipe, step, timestep, callback_kwargs):
        self.marks.append(Clock(self.device))
        if self.power is not None and self.marks[-1].cuda:
            self.power.watch(self.marks[-1].event)
        graphs, breaks = compile_counts()
        self.graphs_per_step.append(graphs - self._compiled_at[0])
        self.graph_breaks += breaks - self._compiled_at[1]
        self._compiled_at = (graphs, breaks)
        if self.then is not None:
            self.then(step)
        if self.profiler is not None:
            self.profiler.step()
        return callback_kwargs

    def step_times(self) -> list[float]:
        return [a.seconds_until(b) for a, b in zip(self.marks, self.marks[1:])]

    def power_record(self) -> dict:
        """Each step's energy, power, SM clock and power-capped share (:meth:`vdbench.power.PowerTrace.steps`,
        over the marks as :meth:`step_times` reads them), or ``{"source": None, "why": ...}``."""
        if self.power is None:
            return {"source": None, "why": self.power_why}
        if len(self.marks) < 2:
            return {"source": None, "why": "no step was taken"}
        return self.power.steps([m.event for m in self.marks])


#: Fewer timed samples than this and a figure is not a speed figure: one or two samples have no spread to judge
#: them by (the same kernel was timed at 15.8 and 0.9 ms on two single-sample runs).
MIN_SAMPLES = 3

#: The keys :func:`step_stats` adds to a timing.json entry (seconds; ``warm_step_n`` a count).
STEP_KEYS = ("first_step", "warm_step_n", "warm_step_median", "warm_step_mean", "warm_step_min", "warm_step_max",
             "warm_step_p20", "warm_step_p80", "denoise_s", "step_mean", "speed_figure", "why_not_speed")


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default), so p20/p80 of two samples lie
    between them rather than snapping to one."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(samples) -> dict:
    """``n``, ``median``, ``mean``, ``min``, ``max``, ``p20``, ``p80`` of timed samples (None values dropped;
    all None but ``n`` = 0 when nothing is left). The one spread every timing output gives, so two runs of the same
    kernel can be told apart from noise."""
    xs = sorted(float(x) for x in samples if x is not None)
    if not xs:
        return {"n": 0, "median": None, "mean": None, "min": None, "max": None, "p20": None, "p80": None}
    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs), "min": xs[0],
            "max": xs[-1], "p20": _quantile(xs, 0.2), "p80": _quantile(xs, 0.8)}


def call_ms(fn, device) -> float:
    """Milliseconds of one call of ``fn()``: CUDA events around it on a GPU (waiting for the call's end), the host
    clock elsewhere (CPU calls are synchronous; not a speed figure, ``speed_verdict``). The one way the benches time
    a single call, so their samples mean the same thing."""
    if torch.device(device).type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def fixed_ms(fn, device, *, reps: int, warmup: int = 1) -> list[float]:
    """:func:`call_ms` of ``reps`` calls after ``warmup`` untimed ones (the device drained between): a fixed sample
    count, for checks that compare like with like at one count (:func:`sample_ms` fits the count to the call's
    time instead)."""
    for _ in range(warmup):
        fn()
    _drain(device)
    return [call_ms(fn, device) for _ in range(reps)]


def interleaved_ms(fns: dict, device, *, reps: int, warmup: int = 1) -> dict:
    """{name: :func:`call_ms` samples} of several callables taking turns call by call, after ``warmup`` rounds:
    clock drift and thermal state fall on all of them alike (a comparison's figures, taken together)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _drain(device)
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(call_ms(fn, device))
    return samples


def burst_ms(fn, device, burst: int) -> float:
    """Milliseconds per call of ``burst`` calls issued back to back and timed as one (CUDA events around the burst:
    no wait between calls, so a kernel's launch gaps overlap the previous call as in a pipeline); the host clock on
    a CPU."""
    if torch.device(device).type != "cuda":
        return call_ms(lambda: [fn() for _ in range(burst)], device) / burst
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(burst):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / burst


def _drain(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def first_call_ms(fn, device) -> float:
    """Milliseconds of the first call of ``fn()`` on its own: the device drained first (so no earlier work hides
    in the figure, and none of the call's host-side work -- a JIT compile, a plan search -- hides behind earlier
    work), then :func:`call_ms`. What it pays once (compiles, plans, allocator growth) is in the figure."""
    _drain(device)
    return call_ms(fn, device)


#: The number of warm samples :func:`sample_ms` takes at the least (more for short calls): enough for a p20–p80
#: that means something. ``MIN_SAMPLES`` stays the floor below which a figure is no speed figure.
TARGET_SAMPLES = 5

#: Bytes written between two timed GPU calls so that no call finds its inputs in L2 (triton's do_bench: 256 MB).
L2_FLUSH_BYTES = 256 * 2**20


@dataclass
class Sampled:
    """What :func:`sample_ms` measured: the warm ``samples`` (ms), ``first_ms`` (the first call, timed on its own;
    None when it was not asked for), ``estimate_ms`` (a warm call's time from the warm-up, which sized the count),
    ``planned`` (the count it aimed for), ``warmup_calls`` and ``why_fewer`` (why fewer than the minimum were
    taken: the budget; None when the minimum was reached)."""

    samples: list = field(default_factory=list)
    first_ms: Optional[float] = None
    estimate_ms: Optional[float] = None
    planned: int = 0
    warmup_calls: int = 0
    why_fewer: Optional[str] = None

    @property
    def n(self) -> int:
        return len(self.samples)

    def stats(self) -> dict:
        """:func:`spread` of the warm samples, with ``first_ms`` and ``first_excess_ms`` (first - warm median)."""
        st = spread(self.samples)
        excess = None if self.first_ms is None or st["median"] is None else self.first_ms - st["median"]
        return dict(st, first_ms=self.first_ms, first_excess_ms=excess, why_fewer=self.why_fewer)


def _device_timer(device, flush_l2: bool) -> Callable:
    """``time_call(fn) -> ms`` for :func:`sample_ms`: :func:`call_ms`, after writing over a buffer larger than L2 on
    a GPU (outside the timed span) so every call reads its inputs from memory, as do_bench times."""
    if torch.device(device).type != "cuda" or not flush_l2:
        return lambda fn: call_ms(fn, device)
    buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def timed(fn):
        buf.zero_()
        return call_ms(fn, device)

    return timed


def sample_ms(fn, device, *, min_samples: int = TARGET_SAMPLES, rep_ms: float = 100.0, warmup_ms: float = 25.0,
              budget_s: float = 60.0, max_samples: int = 1000, first_call: bool = True, flush_l2: bool = True,
              time_call: Optional[Callable] = None) -> Sampled:
    """Time ``fn()`` with a number of samples fitted to its time, so a slow call still gets a spread.

    1. ``first_call``: the first call timed on its own (:func:`first_call_ms`); never a warm sample.
    2. warm-up: calls for ``warmup_ms`` (at least one), each timed: their median is the *estimate* of a call.
    3. warm samples: ``max(min_samples, ceil(rep_ms / estimate))`` (at most ``max_samples``), as many of them as
       fit in ``budget_s`` seconds of timed calls; the loop also stops when the next call would pass the budget
       (calls slower than estimated). Fewer than ``min_samples`` only when one call takes more than
       ``budget_s / min_samples``: ``why_fewer`` says so. A single call longer than the whole budget gets no further
       call: its one warm-up call (a warm call, after the first) is the one sample.

    ``time_call(fn) -> ms`` times one call, the first one included when given (default: CUDA events on a GPU
    with L2 written over before each warm call, the host clock elsewhere: :func:`call_ms`); the budget counts the
    times it returns, so a test can pass a fake clock."""
    out = Sampled()
    if first_call:
        out.first_ms = float(time_call(fn) if time_call is not None else first_call_ms(fn, device))
    if time_call is None:
        time_call = _device_timer(device, flush_l2)
    budget_ms = budget_s * 1e3
    warm: list[float] = []
    while True:
        warm.append(float(time_call(fn)))
        if sum(warm) >= warmup_ms or warm[-1] > budget_ms or len(warm) >= max_samples:
            break
    out.warmup_calls = len(warm)
    est = max(statistics.median(warm), 1e-6)
    out.estimate_ms = est
    planned = min(max_samples, max(min_samples, math.ceil(rep_ms / est) if rep_ms > 0 else 0))
    fit = int(budget_ms // est)
    if fit < 1:  # one call is past the whole budget: the warm-up call (warm: after the first) is the only sample
        out.planned, out.samples = 1, [warm[-1]]
        if min_samples > 1:
            out.why_fewer = (f"one call takes {est / 1e3:.3g} s, more than the {budget_s:g} s budget of timed calls "
                             f"per row: 1 sample (the warm-up call)")
        return out
    out.planned = min(planned, fit)
    spent = 0.0
    for _ in range(out.planned):
        if out.samples and spent + statistics.median(out.samples) > budget_ms:
            break
        t = float(time_call(fn))
        out.samples.append(t)
        spent += t
    if out.n < min_samples:
        out.why_fewer = (f"{out.n} calls of ~{statistics.median(out.samples) / 1e3:.3g} s fit in the {budget_s:g} s "
                         f"budget of timed calls per row (fewer than {min_samples})")
    return out


#: The compile caches a first call can find filled: Triton's kernels and inductor's (FX graphs, its kernels).
CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def cache_state(env=None) -> dict:
    """What the compile caches (:data:`CACHE_VARS`) held for this process at the time of the call -- call it before
    anything compiles: ``caches`` is "empty" (every variable set, each folder missing or empty: a cold start),
    "not empty" (set, something in one) or "default (not cleared)" (a variable unset: the user's caches, in an
    unknown state); ``cache_dirs`` the folders."""
    env = os.environ if env is None else env
    dirs = {v: env.get(v) for v in CACHE_VARS}
    if not all(dirs.values()):
        state = "default (not cleared)"
    elif all(not os.path.isdir(p) or not any(os.scandir(p)) for p in dirs.values()):
        state = "empty"
    else:
        state = "not empty"
    return {"caches": state, "cache_dirs": dirs}


@contextlib.contextmanager
def fresh_cache_env(base=None):
    """An environment (``base``, default ``os.environ``, copied) whose :data:`CACHE_VARS` point at new empty
    temporary folders, for a child process whose first calls must compile everything: a cold start. The folders
    are removed on exit."""
    dirs = {v: tempfile.mkdtemp(prefix=f"vdbench_{v.lower()}_") for v in CACHE_VARS}
    try:
        yield {**(os.environ if base is None else base), **dirs}
    finally:
        for p in dirs.values():
            shutil.rmtree(p, ignore_errors=True)


def _is_cpu(device) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return str(device).startswith("cpu")


def speed_verdict(device=None, n: Optional[int] = None, emulated: bool = False) -> tuple[bool, Optional[str]]:
    """(is it a speed figure, why not). Not one when the backend is an emulation (pure torch, slow by
    construction), when it was timed on a CPU (a host clock on a shared, loaded machine: the project's CPU runs
    showed 4.56x between two sdpa paths that are the same kernel), or from fewer than ``MIN_SAMPLES`` samples.
    ``device`` None means unknown (not judged); ``n`` None means not judged."""
    why = []
    if emulated:
        why.append("emulated backend (pure-torch numerics, never a speed figure)")
    if _is_cpu(device):
        why.append("CPU timing (host clock, shared machine)")
    if n is not None and n < MIN_SAMPLES:
        why.append(f"n={n} timed samples (< {MIN_SAMPLES})")
    return (not why, "; ".join(why) or None)


def step_stats(step_times, device=None, emulated: bool = False) -> dict:
    """The step-time figures of one repetition, keyed as timing.json stores them (``STEP_KEYS``, seconds).

    ``warm_step_median`` is the median of the steps after the first (with ``warm_step_n``, min/max, p20/p80,
    mean); ``first_step`` is the first step alone (one-time costs). A one-step render has no warm step: its
    warm figures are None and it is not a speed figure. ``denoise_s`` is every step summed and ``step_mean`` it
    over the step count: where a step cache skips work on some steps (``--cache``), the median is a computed or a
    reused step's time, and the denoising time is the speed-up's figure."""
    times = [float(t) for t in step_times]
    st = spread(times[1:])
    ok, why = speed_verdict(device, st["n"], emulated)
    out = {"first_step": times[0] if times else None, "warm_step_n": st["n"]}
    out.update({f"warm_step_{k}": st[k] for k in ("median", "mean", "min", "max", "p20", "p80")})
    out.update(denoise_s=sum(times) if times else None, step_mean=sum(times) / len(times) if times else None)
    out.update(speed_figure=ok, why_not_speed=why)
    return out


def run_step_stats(repetitions, device=None, emulated: bool = False) -> dict:
    """:func:`step_stats` over several repetitions of one run (a list of per-repetition step-time lists):
    the warm steps of every repetition pooled (their median, n and spread), ``first_step`` the median of the
    first steps, ``repetitions`` and ``rep_warm_medians`` (each repetition's own warm median, so a drift between
    repetitions shows) with ``rep_warm_min`` / ``rep_warm_max``."""
    reps = [list(r) for r in repetitions if r]
    pooled = [t for r in reps for t in r[1:]]
    firsts = [r[0] for r in reps]
    # one synthetic sequence: the median first step, then every warm step -- same definition, pooled
    out = step_stats(([statistics.median(firsts)] if firsts else []) + pooled, device, emulated)
    meds = [step_stats(r)["warm_step_median"] for r in reps]
    meds = [m for m in meds if m is not None]
    out.update(repetitions=len(reps), rep_warm_medians=meds, rep_warm_min=min(meds) if meds else None,
               rep_warm_max=max(meds) if meds else None)
    totals = [sum(r) for r in reps]  # the synthetic sequence's sum is no repetition's: the median repetition's
    out.update(denoise_s=statistics.median(totals) if totals else None,
               step_mean=statistics.median(totals) / len(reps[0]) if totals else None)
    return out


def describe_steps(stats: dict, cached: bool = False) -> str:
    """One line for a person: ``warm step 941.2 ms (median of n=3 steps after the first; p20–p80 …, min–max …),
    first step 1363.4 ms`` -- the definition is in the line, so it can't be mistaken for another median. ``cached``
    (a step cache ran): the denoising total and the mean step follow, the figures a cache's speed-up is read from."""
    first = stats.get("first_step")
    first_s = f"first step {first * 1e3:.1f} ms" if first is not None else "no step timed"
    if not stats.get("warm_step_n"):
        return f"no warm step (a single step: its time carries the one-time costs), {first_s}"
    ms = {k: stats[f"warm_step_{k}"] * 1e3 for k in ("median", "p20", "p80", "min", "max")}
    reps = ""
    if stats.get("repetitions", 1) > 1 and stats.get("rep_warm_min") is not None:
        reps = (f"; {stats['repetitions']} repetitions, their warm medians {stats['rep_warm_min'] * 1e3:.1f}–"
                f"{stats['rep_warm_max'] * 1e3:.1f} ms")
    line = (f"warm step {ms['median']:.1f} ms (median of n={stats['warm_step_n']} steps after the first; p20–p80 "
            f"{ms['p20']:.1f}–{ms['p80']:.1f}, min–max {ms['min']:.1f}–{ms['max']:.1f}{reps}), {first_s}")
    if cached and stats.get("denoise_s") is not None:  # steps of two kinds: the median is one kind's
        line += f"; denoising {stats['denoise_s']:.2f} s (mean step {stats['step_mean'] * 1e3:.1f} ms)"
    return line


def reset_peak_memory(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_stage(device) -> Optional[dict]:
    """One stage's memory: the allocated and the reserved peak (bytes, torch's caching allocator on a CUDA device)
    since the last call or reset, then the peaks reset for the next stage; None on a CPU (not tracked). The reserved
    peak is what the card had to hold: the allocated one plus the allocator's cached, fragmented blocks."""
    if torch.device(device).type != "cuda":
        return None
    out = {"allocated_peak": int(torch.cuda.max_memory_allocated(device)),
           "reserved_peak": int(torch.cuda.max_memory_reserved(device))}
    torch.cuda.reset_peak_memory_stats(device)
    return out


def peak_memory(device) -> Optional[int]:
    """Peak bytes allocated by torch on a CUDA device since the last reset; None on CPU (not tracked)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def gpu_uuid(device) -> Optional[str]:
    """The physical GPU behind ``device`` as nvidia-smi names it (``GPU-...``), whatever ``CUDA_VISIBLE_DEVICES``
    renumbered: what ties a render's figures to one card when the cards of a machine differ in speed. None off CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        u = str(torch.cuda.get_device_properties(dev).uuid)
    except (AttributeError, RuntimeError):  # a build without the field
        return None
    return u if u.startswith("GPU-") else f"GPU-{u}"


def system_info(device) -> dict:
    dev = torch.device(device)
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "device": str(dev),
    }
    for pkg in ("sageattention", "flash_attn", "fa3-fwd", "xfuser", "triton"):
        v = _version(pkg)
        if v:
            info[pkg] = v
    if dev.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, gpu_capability=f"{p.major}.{p.minor}", gpu_memory_bytes=p.total_memory,
                    gpu_count=torch.cuda.device_count(), gpu_uuid=gpu_uuid(dev))
    return info


def load_timing(path) -> list:
    """Read a timing.json list; raise ValueError with the path if it isn't one."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: timing.json must hold a JSON list, found {type(data).__name__}")
    return data


def append_timing(path, entries: list[dict]) -> Path:
    """Append ``entries`` to the JSON list at ``path`` atomically (lock, write temp, rename)."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        existing: list = []
        if path.exists():
            try:
                existing = load_timing(path)
            except (ValueError, json.JSONDecodeError) as e:
                aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
                os.replace(path, aside)
                print(f"warning: {path} was not a valid timing list ({e}); moved it to {aside}", file=sys.stderr)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".timing-", suffix=".json.tmp")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the result unreadable to others
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(existing + list(entries), f, indent=1, default=_json_default)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return path


def _json_default(o):
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if isinstance(o, float):
        return o
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


class StepProfiler:
    """torch.profiler over denoising steps (scheduled wait/warmup/active), one Chrome trace per rank and cycle,
    and beside it the :func:`kernel_summary` of the same steps (where a step's GPU time went, by category)."""

    def __init__(self, out_dir: Path, rank: int, wait: int, warmup: int, active: int, device):
        from torch.profiler import ProfilerActivity, profile, schedule

        out_dir.mkdir(parents=True, exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
        self.paths: list[Path] = []

        def ready(prof):
            path = out_dir / f"rank{rank}_step{prof.step_num}.json"
            prof.export_chrome_trace(str(path))
            self.paths.append(path)
            summary = kernel_summary(prof.events())
            summary["active_steps"] = active
            (out_dir / f"kernels_rank{rank}_step{prof.step_num}.json").write_text(json.dumps(summary, indent=1))

        self.prof = profile(activities=acts, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                            on_trace_ready=ready, record_shapes=True)

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        return self.prof.__exit__(*exc)

    def step(self):
        self.prof.step()
