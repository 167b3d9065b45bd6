"""The render's timed stage: :func:`run_repetitions` -- the untimed warm-up calls, then one repetition at a time
(:class:`Repetition`: the pipeline call to latents with its step times from events at each step boundary, the
encoders before the first step timed by hooks (:mod:`vdbench.stages`), the decode timed on its own, the calls
counted per kernel) and its timing entry; what watches the calls (:class:`Watch`: the attention patch, the stage
timers, the capture, the step cache's counter, the progress lines, the prewarms the calls wait for) is set up once
before them and closed after them."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from .. import parallel as P
from ..capture import AttentionCapture, save_latents
from ..offload import expert_swap
from ..patching import AttentionPatch
from ..pipelines import settle_scheduler
from ..power import open_trace
from ..stages import StageTimers, stage_reports
from ..timing import (Clock, StepProfiler, StepTimer, compile_seconds, device_seconds, gpu_uuid, memory_stage,
                      reset_peak_memory, step_stats)
from ..vae.decode import decode_latents
from ..vae.encode import use_encode
from ..watchdog import Watchdog, WatchdogTimeout
from .config import VAEHang
from .loading import Loaded
from .plan import Plan

__all__ = ["run_repetitions", "Repetition", "Watch"]


class Progress:
    """A plain line per denoising step (``[sdpa] step 3/50 (rep 1/2): 12.4 s, ETA 3:10``) for a log that is not a
    terminal, where the progress bars are off: a batch run's logs (and the render-all scripts' screen) show the
    render moving. Host-clock progress only; the step times themselves are the events of StepTimer."""

    def __init__(self, name: str, steps: int, reps: int, log, enabled: bool):
        self.name, self.steps, self.reps, self.log, self.enabled = name, steps, reps, log, enabled
        self.rep, self.t0, self.first = 0, 0.0, None

    def begin(self, rep: int) -> None:
        self.rep, self.t0 = rep, time.monotonic()
        if self.first is None:
            self.first = self.t0

    def step(self, step: int) -> None:
        if not self.enabled or self.first is None:  # the untimed warm-up calls print no progress
            return
        now = time.monotonic()
        done = self.rep * self.steps + step + 1
        left = self.reps * self.steps - done
        eta = (now - self.first) / done * left
        rep = f" (rep {self.rep + 1}/{self.reps})" if self.reps > 1 else ""
        self.log(f"[{self.name}] step {step + 1}/{self.steps}{rep}: {now - self.t0:.1f} s, ETA "
                 f"{int(eta) // 60}:{int(eta) % 60:02d}")
        sys.stdout.flush()


class Watch:
    """What watches a render's pipeline calls, set up once before them and closed after (:meth:`close`): the
    attention patch (counts, timing, its observers), the stage timers (the encoders, the VAE encode under
    ``--vae_timeout``'s watchdog, the first denoiser call), the attention capture, the step cache's counter, the
    progress lines, the encode's reports (``encode_info``, across the calls) and the run id every entry carries. What
    a call counts itself (its step times, the graphs compiled in each step, its profiler's steps) is its own
    :class:`~vdbench.timing.StepTimer`'s, whose steps :meth:`advance` the watch."""

    def __init__(self, plan: Plan, loaded: Loaded, log):
        cfg, device = plan.cfg, plan.device
        # one render's entries, told apart from a re-run's (two renders in one process and second differ by the
        # suffix)
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.progress = Progress(plan.stack, cfg.num_inference_steps, cfg.num_repetitions, log,
                                 enabled=not sys.stderr.isatty())
        watch_encode = (lambda: Watchdog(cfg.vae_timeout, label="vae encode")) if cfg.vae_timeout else None
        self.stage_timers = StageTimers(loaded.pipe, [m for _, m in loaded.models], device, encode_around=watch_encode)
        self.capture = None
        if cfg.save_inputs:
            self.capture = AttentionCapture(cfg.capture_dir, cfg.attention_type, rank=cfg.rank,
                                            max_captures=cfg.max_captures)
        self.log, self.stack = log, plan.stack
        prewarms = loaded.prewarms
        self.attention_prewarm = prewarms.attention.prewarm  # its record once waited for (wait_for_prewarm)
        self.attention_prewarm_record: Optional[dict] = prewarms.attention.record
        if (self.attention_prewarm_record or {}).get("status") == "failed":
            log(f"warning: [{plan.stack}] attention prewarm failed ({self.attention_prewarm_record['error']}); the "
                "first attention calls compile their own kernels")
        self.patch = AttentionPatch(loaded.models, plan.backend, on_unsupported=cfg.on_unsupported,
                                    time_attention=cfg.time_attention,
                                    before_first_call=self.wait_for_prewarm if self.attention_prewarm else None,
                                    observers=[self.capture] if self.capture else None,
                                    # the family's call classifier, grid hooks (none: a grid backend is refused)
                                    # and Ulysses self-attention, not found again from the transformers' classes
                                    family=plan.family,
                                    # compiled blocks would trace the tile-order hooks; a step cache compares and
                                    # reuses block outputs across steps, which a schedule's switch to tile order
                                    # (padded) breaks; context parallelism splits the sequence at the blocks'
                                    # entry, while each Ulysses attention call holds the whole sequence again
                                    tile_order_once=not cfg.compile and plan.cache is None and plan.parallel is None,
                                    fused_rope=plan.fused_rope is None,
                                    rope_ready=prewarms.rope.wait if prewarms.rope else None,
                                    fused_block=plan.fused_block is None,
                                    block_ready=prewarms.block.wait if prewarms.block else None)
        self.counter = loaded.cache
        self.encode_info: dict = {}
        self.began: Optional[Mark] = None  # the repetition in progress's start (:meth:`begin`)
        self.device, self.dctx, self.attention_type = device, plan.dctx, cfg.attention_type
        self.settings = loaded.header["settings"]  # recorded beside the capture

    def wait_for_prewarm(self) -> dict:
        """The attention prewarm waited for (the first attention call's, or the first repetition's end where no call
        came) and its record kept; a failure said in one line -- the first calls then compile their own kernels."""
        if self.attention_prewarm is not None and self.attention_prewarm_record is None:
            rec = self.attention_prewarm_record = self.attention_prewarm.wait()
            if rec["status"] != "done":
                self.log(f"warning: [{self.stack}] attention prewarm failed ({rec.get('error')}); the first "
                         "attention calls compile their own kernels")
        return self.attention_prewarm_record

    def mark(self) -> "Mark":
        """torch.compile's time and the encode's one-time reports so far."""
        return Mark(compile_seconds(), dict(self.encode_info.get("one_time") or {}))

    def advance(self, step: int) -> None:
        """A denoising step ended (the ``then`` of the call's :class:`~vdbench.timing.StepTimer`, which keeps its own
        counts): the schedule's step, the cache counter's, the progress line."""
        self.patch.step = step + 1
        if self.counter is not None:
            self.counter.end_step()
        self.progress.step(step)
        if self.dctx.distributed:  # the test hook of the failure propagation (VDBENCH_TEST_FAIL)
            P.maybe_inject_failure(self.dctx.rank, "step", self.attention_type)

    def reset(self) -> None:
        """Before a pipeline call: its steps and cache counted from its first step (a schedule warms every backend
        it names in the warm-up calls as in a timed one)."""
        self.patch.step = 0
        if self.counter is not None:
            self.counter.reset()

    def begin(self, rep: int) -> None:
        """Before a timed repetition: the counts, the stage timers and the peak memory afresh."""
        self.reset()
        self.patch.reset_counts()
        self.stage_timers.reset()
        reset_peak_memory(self.device)
        self.progress.begin(rep)
        self.began = self.mark()

    def close(self, log) -> None:
        """After the calls, also on error: the stage timers' hooks removed, the capture's files closed, the attention
        prewarm's worker stopped if it still runs."""
        self.stage_timers.close()
        if self.attention_prewarm is not None:
            self.attention_prewarm.close()
        if self.capture is not None:
            meta_path = self.capture.close(extra={"settings": self.settings})
            stats = self.capture.stats
            log(f"captured {stats.saved} of {stats.seen} attention calls ({stats.bytes / 2**20:.1f} MiB, "
                f"{stats.host_time_s:.3f} s on the run's thread, {stats.writer_time_s:.3f} s in the writer) "
                f"-> {meta_path}")


@dataclass(frozen=True)
class Mark:
    """torch.compile's time and the encode's one-time reports at a point of the render: what the one-time costs
    after it are counted from (:meth:`Watch.mark`)."""

    compiled: float
    encode: dict


def run_repetitions(plan: Plan, loaded: Loaded, log) -> tuple[list[dict], object]:
    """The untimed warm-up calls, then the timed repetitions: one timing entry each, and the last one's frames."""
    cfg = plan.cfg
    watch = Watch(plan, loaded, log)
    entries, frames = [], None
    try:  # a calibrating MagCache's ratios recorded from diffusers' log while the pipeline runs
        with (watch.patch, torch.inference_mode(),
              use_encode(loaded.pipe.vae, plan.encode.mode, plan.encode.options, info=watch.encode_info),
              watch.counter.listening() if watch.counter is not None else contextlib.nullcontext()):
            # torch.compile's time from here on is this render's; what the encode reported before any call (on
            # setting up) is the first repetition's
            set_up = watch.mark()
            warmup_s = _warm_up(plan, loaded, watch)
            for rep in tqdm(range(cfg.num_repetitions), desc=plan.stack, unit="rep",
                            disable=cfg.num_repetitions < 2 or not sys.stderr.isatty()):
                repetition = Repetition(plan, loaded, watch, rep, (set_up, warmup_s) if rep == 0 else None)
                frames = repetition.denoise_and_decode()
                entries.append(repetition.entry())
    finally:
        watch.close(log)
    return entries, frames


def _warm_up(plan: Plan, loaded: Loaded, watch: Watch) -> Optional[float]:
    """The untimed calls before the timed repetitions (compilation, cuDNN plans, Triton JIT, the allocator); their
    whole time, one-time costs and all (None without them): not a step time."""
    cfg = plan.cfg
    if not cfg.warmup_calls:
        return None

    def calls():
        for _ in range(cfg.warmup_calls):  # steps advance as in a timed call; their times unread
            watch.reset()
            steps = StepTimer(plan.device, then=watch.advance)
            steps.run_pipe(loaded.pipe, generator=torch.Generator("cpu").manual_seed(cfg.seed), **loaded.kwargs)
            settle_scheduler(loaded.pipe.scheduler)  # a failed solve raises here too

    return device_seconds(plan.device, calls)


def _profiler(plan: Plan) -> Optional[StepProfiler]:
    """The profiler of the first repetition (``--profile_output``), made as it begins: its traces under the traces
    root; None without the flag."""
    cfg = plan.cfg
    if not cfg.profile_output:
        return None
    root = cfg.traces_root if cfg.traces_root is not None else cfg.output_path.parent.parent / "traces"
    return StepProfiler(Path(root) / cfg.profile_output, cfg.rank, cfg.profile_wait, cfg.profile_warmup,
                        cfg.profile_active, plan.device)


class Repetition:
    """One timed repetition: :meth:`denoise_and_decode` -- the pipeline call to latents, then the decode timed on its
    own -- makes its frames and marks its clocks; :meth:`entry` reads what it measured, once, into its timing entry.
    ``first``: the first repetition's (the mark before the warm-up calls, their time)."""

    def __init__(self, plan: Plan, loaded: Loaded, watch: Watch, rep: int,
                 first: Optional[tuple[Mark, Optional[float]]] = None):
        self.plan = plan
        self.loaded = loaded
        self.watch = watch
        self.rep = rep
        self.first = first
        self.timer: Optional[StepTimer] = None  # the pipeline call's steps
        self.after_pipe = self.after_decode = None  # the clocks after the call and after the decode
        self.vae_info: dict = {}  # what the decode reported
        self.scheduler_ahead: Optional[dict] = None  # what the scheduler made ahead (pipelines.settle_scheduler)
        self.memory: dict = {}  # each stage's allocated and reserved peaks (vdbench.timing.memory_stage)

    def denoise_and_decode(self):
        """The pipeline call to latents (the first repetition's profiled), then the decode; the frames."""
        plan, loaded, watch, rep = self.plan, self.loaded, self.watch, self.rep
        cfg, device = plan.cfg, plan.device
        watch.begin(rep)
        profiler = _profiler(plan) if rep == 0 else None  # the first repetition is profiled
        self.timer = StepTimer(device, then=watch.advance, profiler=profiler,
                               power=open_trace(device, cfg.power_interval_ms, gpu_uuid(device)))
        try:
            latents = self.timer.run_pipe(loaded.pipe, generator=torch.Generator("cpu").manual_seed(cfg.seed),
                                          **loaded.kwargs).frames
            # what the scheduler made ahead of the device (--scheduler_async); a solve that failed raises here
            self.scheduler_ahead = settle_scheduler(loaded.pipe.scheduler)
            latents = P.share_output(plan.dctx, latents)  # xfuser's CogVideoX: only its last ranks return them
        except WatchdogTimeout as e:  # the VAE encode inside the pipeline call (the stage timers' watchdog)
            raise VAEHang(f"VAE encode hung (> {cfg.vae_timeout} s, --vae_timeout); all threads' stacks were dumped "
                          "to stderr") from e
        self.after_pipe = Clock(device)
        self.memory["denoise"] = memory_stage(device)  # the text encode and the steps: the pipeline call
        try:
            frames = decode_latents(loaded.pipe, latents, plan.family, num_frames=cfg.num_frames,
                                    mode=plan.decode.mode, options=plan.decode.options, timeout_s=cfg.vae_timeout,
                                    info=self.vae_info, prewarm=loaded.prewarms.vae if rep == 0 else None, uint8=True)
        except WatchdogTimeout as e:  # never wait forever: say where it hung, exit non-zero
            raise VAEHang(f"VAE decode hung (> {cfg.vae_timeout} s, --vae_timeout); last completed stage: "
                          f"{e.report.last_completed_stage}; all threads' stacks were dumped to stderr") from e
        self.after_decode = Clock(device)
        self.memory["decode"] = memory_stage(device)
        if cfg.save_latents:
            save_latents(cfg.capture_dir, latents, cfg.attention_type, rank=cfg.rank, repetition=rep,
                         meta={"family": plan.family.name, "model": plan.model.spec.model, "height": cfg.height,
                               "width": cfg.width, "num_frames": cfg.num_frames})
        return frames

    def _one_time(self, reported: dict) -> dict:
        """What this repetition paid once (completed in finish: :func:`vdbench.stages.one_time`): the first carries
        the render's -- the load, the warm-up calls, torch.compile's time since the load, the wait for the attention
        prewarm --, each what its stages reported themselves (``reported``: :func:`vdbench.stages.stage_reports`)."""
        watch, first = self.watch, self.first
        set_up, warmup_s = first if first is not None else (None, None)
        compiled = compile_seconds() - (set_up or watch.began).compiled
        once: dict = {"load_s": self.loaded.load_s, "warmup_calls_s": warmup_s} if first is not None else {}
        once["compile_s"] = compiled if compiled > 0 else None
        prewarm = watch.wait_for_prewarm() if first is not None else None
        if prewarm is not None and "waited_s" in prewarm:  # inside the first attention call's step: not added again
            once["attention_prewarm_wait_s"] = prewarm["waited_s"]
        once.update(reported)
        return once

    def entry(self) -> dict:
        """The repetition's timing entry: its step times and their statistics, the stages, the decode and the encode,
        the attention's counts, the cache's, the compiler's, the memory, what it paid once (:meth:`_one_time`), the
        run it is part of."""
        plan, watch, timer, rep = self.plan, self.watch, self.timer, self.rep
        cfg, device, backend, patch = plan.cfg, plan.device, plan.backend, watch.patch
        # the step times (the encoders before the first step are no step's) and the one-time costs the stages
        # reported themselves
        timer.starts_at(watch.stage_timers.denoise_start)
        step_times = timer.step_times()
        last_step = timer.marks[-1] if len(timer.marks) > 1 else None
        once = self._one_time(stage_reports(watch.encode_info, self.vae_info, watch.began.encode,
                                            set_up=self.first[0].encode if self.first is not None else None))
        start, after_pipe, after_decode = timer.started, self.after_pipe, self.after_decode
        attn_time = patch.finish_timing()
        decode_time = after_pipe.seconds_until(after_decode)
        stages = watch.stage_timers.entry(start=start, after_pipe=after_pipe, after_decode=after_decode,
                                          last_step=last_step, step_times=step_times, vae_decode=decode_time)
        encode_info, vae_info, capture, profiler = watch.encode_info, self.vae_info, watch.capture, timer.profiler
        return {
            "attention_type": cfg.attention_type,
            "stack": plan.stack,  # the whole configuration as one name: vdbench.measure.record.stack_name
            "repetition": rep,
            "pipe_time": start.seconds_until(after_pipe),
            "text_encode_time": stages.pop("text_encode_time"),
            "image_encode_time": stages.pop("image_encode_time"),
            "vae_encode_time": stages.pop("vae_encode_time"),
            "vae_encode": ({"mode": plan.encode.mode.name, **{k: v for k, v in encode_info.items()
                                                           if isinstance(v, (int, float, str, bool))}}
                           if stages["stages"]["vae_encode"] is not None else None),
            "step_times": step_times,
            **step_stats(step_times, device, backend.emulated),  # warm step, first step, spread, verdict
            "vae_decode_time": decode_time,
            "vae_decode": {"mode": plan.decode.mode.name, "max_memory_gib": cfg.vae_max_memory,
                           **{k: v for k, v in vae_info.items() if isinstance(v, (int, float, str, bool))}},
            "total_time": start.seconds_until(after_decode),
            **stages,  # stages, unaccounted (+ share, where): vdbench.stages.breakdown
            "one_time": once,  # + steady_s; end_to_end_s and end_to_end on the first: finish
            "cache": watch.counter.summary() if watch.counter is not None else None,
            # the backend's first-call kernels compiled ahead (vdbench.backends.prewarm): the render's, on the first
            "attention_prewarm": watch.attention_prewarm_record if rep == 0 else None,
            # --use_torch_compile: the graphs dynamo made in each step (the first step's compile; any later one is a
            # recompile) and its graph breaks in this call (none: the blocks compile with fullgraph=True)
            "compile": ({"graphs_per_step": list(timer.graphs_per_step), "graph_breaks": timer.graph_breaks}
                        if cfg.compile else None),
            "host": timer.host(),  # the garbage collector's pauses per step (a multi-GPU step's host stalls)
            "power": timer.power_record(),  # each step's joules, power, SM clock, power-capped share (vdbench.power)
            "scheduler_ahead": self.scheduler_ahead,  # copies and solves made without waiting (--scheduler_async)
            "attention": patch.stats.as_dict(),  # + the RoPE's calls, fused or eager
            "fused_rope": _fused_record(plan.cfg.fused_rope, plan.fused_rope, patch.stats.rope["fused"],
                                        "no call went through the family's processor (diffusers' own ran)",
                                        self.loaded.prewarms.rope if rep == 0 else None),
            "fused_block": {**_fused_record(plan.cfg.fused_block, plan.fused_block,
                                            sum(n for (_, form), n in patch.stats.block.items() if form == "fused"),
                                            patch.stats.block_eager_why or "no block ran the family's forward",
                                            self.loaded.prewarms.block if rep == 0 else None),
                            "norms": _norms_record(plan, patch.stats)},
            # --offload expert: the units swapped since the load, those left to the incoming expert's first call;
            # --offload shard: what the load sharded (the mesh's ranks, each denoiser's bytes a rank before and after)
            "offload": (swap.as_dict() if (swap := expert_swap(self.loaded.pipe)) is not None
                        else self.loaded.header["resolved"]["offload"] if plan.cfg.offload == "shard" else None),
            "attention_share": (attn_time / sum(step_times)) if attn_time and step_times else None,
            "memory": {"load": self.loaded.memory, **self.memory},  # each stage's peaks, this rank's card
            "peak_memory_bytes": _peak(self.memory, "allocated_peak"),
            "peak_reserved_bytes": _peak(self.memory, "reserved_peak"),
            "traces": [str(p) for p in profiler.paths] if profiler is not None else None,
            "capture": ({"saved": capture.stats.saved, "bytes": capture.stats.bytes,
                         "host_time_s": capture.stats.host_time_s} if capture else None),
            "output": str(cfg.output_path),
            "run_id": watch.run_id,
            "run": self.loaded.header,
        }


def _peak(memory: dict, key: str) -> Optional[int]:
    """A repetition's peak (the denoising's and the decode's; the load's is its own stage), None on a CPU."""
    values = [m[key] for m in memory.values() if m]
    return max(values) if values else None


def _norms_record(plan, stats) -> dict:
    """The fused block's norms in a render's entry: whether any ran fused, why not (the plan's reason for the whole
    block, else the first refusal: the statistics of the bf16 hidden state not those of its fp32 copy, ...), and
    each form's first-call check (``PatchStats.block_norm_checks``)."""
    fused = stats.block["norm_modulate", "fused"] + stats.block["norm", "fused"]
    why = plan.fused_block or stats.block_norm_why
    return {"used": bool(fused), "why_not": why or (None if fused else "no norm ran the family's forward"),
            "checks": list(stats.block_norm_checks)}


def _fused_record(setting: Optional[bool], why: Optional[str], fused: int, none_ran: str, prewarm) -> dict:
    """A fused kernel's part of a render's entry (``fused_rope``, ``fused_block``): the setting, whether the kernel ran
    (``fused``: its calls), why not (the plan's reason, else ``none_ran`` where no call was fused: a context-parallel
    render without the family's processor runs diffusers' RoPE; block calls the kernels can't serve run the eager
    expressions), and, given (the first repetition), its prewarm."""
    out = {"setting": {None: "auto", True: "on", False: "off"}[setting], "used": bool(fused),
           "why_not": why or (None if fused else none_ran)}
    if prewarm is not None:
        out["prewarm"] = prewarm.as_dict()
    return out
