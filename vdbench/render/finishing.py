"""The render's last stage: :func:`finish` -- the ranks' entries merged, rank 0 writes the video of the last
repetition (atomically) and appends the repetitions to ``timing.json`` and ``records.jsonl``, the first with the
render's end-to-end time (the process's start to the video on disk, broken into stages:
:func:`vdbench.stages.end_to_end`) and each with its one-time costs (:func:`vdbench.stages.one_time`); the summary
logged."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from .. import identity
from .. import parallel as P
from ..measure.record import Writer, from_render_entry
from ..stages import Wall, describe_end_to_end, one_time, render_end_to_end
from ..stages import describe as describe_stages
from ..timing import append_timing, describe_steps, run_step_stats
from ..video import MADE_BY_RENDER, render_comment, save_frames, write_video
from .config import RenderConfig
from .plan import Plan

__all__ = ["finish"]


def _compile_lines(comp: Optional[dict], stack: str, by_step: Optional[list] = None) -> list[str]:
    """What a compiled render says of its graphs per step; a warning where a step after the first compiled (a
    recompile: the step waits for the compiler again) or where dynamo broke a graph. ``by_step``: the denoiser of each
    step (two experts: ``run.resolved.schedule.denoiser_by_step``), whose first step compiles that denoiser's own
    blocks -- said, not warned of."""
    if not comp:
        return []
    per = comp["graphs_per_step"]
    firsts = {i: d for i, d in enumerate(by_step or []) if d not in by_step[:i]}
    own = "".join(f"; step {i + 1}: {d}'s first, its own blocks' graphs" for i, d in firsts.items()
                  if 0 < i < len(per) and per[i])
    lines = [f"[{stack}] torch.compile: graphs made per step {per}, graph breaks {comp['graph_breaks']}{own}"]
    later = [i + 1 for i, n in enumerate(per) if i and n and i not in firsts]
    if later:
        lines += [f"warning: [{stack}] torch.compile compiled again in step(s) {later}: a guard failed and the blocks "
                  "recompiled", "hint: TORCH_LOGS=recompiles names the guard"]
    return lines


def _calibration_lines(c: Optional[dict], stack: str, timing_path: Path) -> list[str]:
    """What a calibrating MagCache says of its outcome, one line and a hint: the spec to render with next time, or why
    there is none; a calibration message that held no list of numbers said too."""
    cal = (c or {}).get("calibration")
    if not cal:
        return []
    lines = [f"warning: [{stack}] cache {c['spec']}: a MagCache calibration message ignored: {why}"
             for why in cal.get("ignored") or []]
    by = cal.get("by_denoiser") or {}
    if cal.get("use") and len(by) > 1:  # two experts, each calibrated over its own steps
        n = len(next(iter(by.values())))
        steps = ", ".join(f"{name} {len(lists[0])} step{'s' if len(lists[0]) != 1 else ''}" for name, lists in by.items())
        lines += [f"[{stack}] cache calibrated per expert ({steps}; {n} cache context{'s' if n != 1 else ''} each; the "
                  f"first, the conditional pass's, kept): next time --cache {cal['use']}",
                  f"hint: or --cache mag:mag_ratios=@{timing_path},mag_ratios_2=@{timing_path} (the same ratios, read "
                  "from this render's timing.json)"]
    elif cal.get("use"):
        n = len(cal["ratios"])
        lines += [f"[{stack}] cache calibrated ({len(cal['ratios'][0])} steps, {n} cache "
                  f"context{'s' if n != 1 else ''}; the first, the conditional pass's, kept): next time --cache "
                  f"{cal['use']}",
                  f"hint: or --cache mag:mag_ratios=@{timing_path} (the same ratios, read from this render's "
                  "timing.json)"]
    else:
        lines += [f"warning: [{stack}] cache {c['spec']}: diffusers logged no calibration ratios",
                  "hint: it logs them when a denoiser has run all its steps"]
    return lines


def finish(plan: Plan, entries: list[dict], frames, log, wall: Optional[Wall] = None) -> dict:
    """Merge the ranks' entries; rank 0 writes the video (and raw frames) and appends to timing.json.

    Each entry's ``one_time`` is completed (:func:`vdbench.stages.one_time`). With ``wall`` (the render's marks), the
    first repetition's entry gets ``end_to_end_s`` -- the render's start (the process's, from the CLIs) to the video
    and raw frames on disk, every repetition included -- and its ``end_to_end`` breakdown
    (:func:`vdbench.stages.render_end_to_end`); the later repetitions' entries get None for both (the render's wait
    is counted once)."""
    cfg, device, backend = plan.cfg, plan.device, plan.backend
    merged = P.merge_rank_entries(plan.dctx, entries)  # a collective under torchrun; None on ranks other than 0
    if merged is None:
        return {"attention_type": cfg.attention_type, "rank": cfg.rank, "output": None,
                "calls_by_kernel": entries[-1]["attention"]["calls_by_kernel"]}
    stack, ran = plan.stack, merged[-1]
    # what the run's compile and cache calibration have to say (logged with the figures below)
    compile_lines = _compile_lines(ran.get("compile"), stack, ((ran.get("run") or {}).get("resolved") or {})
                                   .get("schedule", {}).get("denoiser_by_step"))
    calibration_lines = _calibration_lines(ran.get("cache"), stack, cfg.timing_path)
    # the files first: what the render's end-to-end time counts to
    write_start = time.perf_counter()
    run_id = merged[-1].get("run_id")
    write_video(frames, cfg.output_path, fps=cfg.fps, made_by=render_comment(run_id) if run_id else MADE_BY_RENDER)
    if cfg.save_frames:
        save_frames(frames, cfg.output_path.with_suffix(".npy"))
    end = time.perf_counter()
    # what the record vouches for: the render's identity and the bytes it wrote (the readers refuse a file that
    # no longer matches its entry)
    written = {"identity": identity.of(asdict(cfg), RenderConfig, plan.family).as_dict(),
               "output_sha256": identity.file_sha256(cfg.output_path),
               "frames_sha256": identity.file_sha256(cfg.output_path.with_suffix(".npy")) if cfg.save_frames else None}
    # then the entries completed: what each repetition paid once, the render's end to end on the first
    entries = one_time(merged)
    for i, e in enumerate(entries):
        e.update(written)
        e2e = render_end_to_end(entries, wall, end - write_start, end) if (wall is not None and i == 0) else None
        e["end_to_end_s"] = (end - wall.started.t) if e2e else None
        e["end_to_end"] = e2e
    last = entries[-1]
    stages_line, e2e_line = describe_stages(last), describe_end_to_end(entries[0])
    # the repetitions in the record schema every tool writes (vdbench.measure.record), beside timing.json
    Writer(cfg.timing_path.with_name("records.jsonl")).write(*(from_render_entry(e) for e in entries))
    append_timing(cfg.timing_path, entries)
    steps = run_step_stats([e["step_times"] for e in entries], device, backend.emulated)
    timing_text = ("emulated backend: no speed figure" if backend.emulated
                   else describe_steps(steps, cached=plan.cache is not None))
    summary = {
        "attention_type": cfg.attention_type, "stack": stack, "output": str(cfg.output_path),
        "timing": str(cfg.timing_path),
        "warm_step_median": None if backend.emulated else steps["warm_step_median"],
        "warm_step_n": steps["warm_step_n"], "speed_figure": steps["speed_figure"],
        "why_not_speed": steps["why_not_speed"], "vae_decode_time": last["vae_decode_time"],
        "vae_encode_time": last.get("vae_encode_time"),
        "calls_by_kernel": last["attention"]["calls_by_kernel"], "fallback_calls": last["attention"]["fallback_calls"],
        "end_to_end_s": entries[0].get("end_to_end_s"), "one_time_s": entries[0]["one_time"]["total_s"],
        "load_s": entries[0]["one_time"].get("load_s"),
        "denoise_s": steps["denoise_s"], "step_mean": steps["step_mean"], "cache": last.get("cache"),
    }
    kernels = ", ".join(f"{k}×{v}" for k, v in last["attention"]["calls_by_kernel"].items())
    log(f"[{stack}] {timing_text}, decode {last['vae_decode_time']:.2f} s, kernels: {kernels} "
        f"-> {cfg.output_path}")
    log(f"[{stack}] {stages_line}")
    if last.get("cache"):
        c = last["cache"]
        share = "n/a" if c["skipped_share"] is None else f"{c['skipped_share']:.0%}"
        mine = f" (rank 0: {c['guidance_split']['this_rank_computes']})" if c.get("guidance_split") else ""
        log(f"[{stack}] cache {c['spec']}: {share} of the {c['unit']} calls reused; computed per "
            f"step {c['computed_blocks_per_step']}, reused {c['reused_blocks_per_step']}{mine}")
        if c.get("ranks_agree") is False:  # made one by vdbench.cache.share_decisions: a difference is a fault
            log(f"warning: [{stack}] cache {c['spec']}: the ranks computed different blocks (ranks[].cache in "
                f"{cfg.timing_path})")
    for line in calibration_lines + compile_lines:
        log(line)
    fused_block = last.get("fused_block") or {}
    norms = fused_block.get("norms") or {}
    if fused_block.get("used") and not norms.get("used"):
        log(f"[{stack}] fused block: its norms ran as diffusers' ({norms.get('why_not')})")
    par = last.get("parallel")
    if par:
        log(f"[{stack}] parallel {par['label']} over {par['world_size']} ranks on the {par['engine']} engine "
            f"({par.get('engine_reason')})")
    if e2e_line:
        log(f"[{stack}] {e2e_line}")
    if not steps["speed_figure"] and not backend.emulated:
        log(f"warning: [{stack}] not a speed figure: {steps['why_not_speed']}")
    log(f"output: {cfg.output_path}")
    return summary
