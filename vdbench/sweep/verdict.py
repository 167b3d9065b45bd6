"""The sweep's last stages: the quality of each render against the exact reference (or the exact-kernel render
standing in for it), then the ranking, the verdict and the files (sweep.csv, sweep.json, report.html,
records.jsonl)."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from ..measure.record import Record, Writer, command_line, commit, now
from ..report import load_frames
from ..sets import spread
from .budget import predicted_ranking
from .candidates import BASELINE, REFERENCE, Candidate
from .ranking import (Coverage, frames_of, print_table, quality_baseline, quality_of, rank, row_of, stored_quality,
                      throughput_text, verdict, warm_of, write_outputs)
from .state import Budget, Context, Ledger, log

__all__ = ["quality_rows", "coverage_of", "verdict_text", "conclude", "memory_line"]


# ----------------------------------------------------------------------------------------------------------------
# 5. the quality of each render against the exact reference, or the exact-kernel render standing in for it
# ----------------------------------------------------------------------------------------------------------------

def quality_rows(ctx: Context, cands: list[Candidate], ledger: Ledger) -> tuple[list[dict], Optional[str]]:
    """(a row per rendered candidate, the quality baseline's name or None): each row's quality read from its frames
    against the baseline's -- over a prompt and seed set, each content's render against the baseline's render of
    that content, the mean with its min-max and n (:func:`vdbench.sets.spread`) -- or kept from an earlier run
    against the same baseline (``quality.json`` beside the render, written here: it ranks the render on a resume
    that has only the baseline's frames)."""
    records = ledger.records
    warm = {n: warm_of(r)[0] for n, r in records.items()}
    base = quality_baseline(cands, warm)
    base_frames: dict = {}  # content -> (frames, path) of the baseline's render of it
    for i, r in (ledger.sets.get(base) or ({0: records[base]} if base in records else {})).items():
        if frames_of(r) is not None:
            base_frames[i] = (load_frames(frames_of(r))[0], frames_of(r))
    if base is not None and base != REFERENCE:
        log(f"[sweep] quality read against {base}, the fastest exact-kernel render: the exact {REFERENCE} was "
             f"not rendered")
    rows = []
    for c in cands:
        if c.name not in records:
            continue
        folder = ctx.out / "runs" / c.slug
        mine = ledger.sets.get(c.name) or {0: records[c.name]}
        common = sorted(i for i in mine if i in base_frames)
        stored = stored_quality(folder)
        if stored is not None and (stored.get("vs", REFERENCE) != base or stored.get("n", 1) < len(common)):
            stored = None  # against another baseline, or fewer contents: read again from the frames
        if stored is None and len(ctx.sets) > 1 and c.name != base:
            got = [quality_of(frames_of(mine[i]), base_frames[i], ctx.quality_device) for i in common]
            got = [q for q in got if q is not None]
            psnr = spread(q["psnr"] for q in got)
            if psnr is not None:
                stored = {"psnr": psnr["mean"], "ssim": sum(q["ssim"] for q in got) / len(got),
                          "from": got[0]["from"], "n": psnr["n"], "min": psnr["min"], "max": psnr["max"]}
        ref = base_frames.get(min(common)) if common else next(iter(base_frames.values()), None)
        row = row_of(c, records[c.name], ref, stored, ctx.quality_device, quality_vs=base or REFERENCE)
        if c.name == base:
            row["psnr_n"] = len(mine)
        if stored is None and c.name != base and row["psnr_db"] is not None:
            stored = {"psnr": row["psnr_db"], "ssim": row["ssim"], "from": row["quality_from"]}
        if stored is not None and c.name != base and not stored_quality(folder) == {**stored, "vs": base}:
            (folder / "quality.json").write_text(json.dumps({**stored, "vs": base}))
        rows.append(row)
    return rows, base


# ----------------------------------------------------------------------------------------------------------------
# 6. the ranking, the verdict and the files
# ----------------------------------------------------------------------------------------------------------------

def coverage_of(cands: list[Candidate], ledger: Ledger, warm_default: Optional[float], no_bench: str) -> Coverage:
    """What the verdict rests on: the candidates planned, rendered, skipped and failed, and the kernel bench's
    ranking of them (``no_bench``: why there was none, "" where there was)."""
    planned = [c.name for c in cands if c.name != BASELINE and not c.is_reference]
    predicted, predicted_is = predicted_ranking(cands, ledger.attn, warm_default)
    return Coverage(planned, [n for n in planned if n in ledger.records], [n for n in ledger.skipped if n in planned],
                    [n for n in ledger.failed if n in planned], predicted, predicted_is, no_bench)


def verdict_text(ctx: Context, cands: list[Candidate], rows: list[dict], quality_vs: str, coverage: Coverage) -> str:
    """The verdict line; with renders on several GPU counts, one per count (each over that count's renders, quality
    against the same baseline), joined by `` | ``."""
    args = ctx.args
    counts = sorted({c.nproc for c in cands})
    if counts == [1]:
        return verdict(rows, device=ctx.dev_name, model=args.model, tolerance_db=args.psnr_tolerance_db,
                       quality_vs=quality_vs, coverage=coverage)
    gpus_of = {c.name: c.nproc for c in cands}
    return " | ".join(verdict(rows, device=f"{ctx.dev_name} x{n}" if n > 1 else ctx.dev_name, model=args.model,
                              tolerance_db=args.psnr_tolerance_db, quality_vs=quality_vs,
                              coverage=coverage.of(lambda name, n=n: gpus_of.get(name, 1) == n), gpus=n)
                      for n in counts)


def conclude(ctx: Context, cands: list[Candidate], rows: list[dict], base: Optional[str], ledger: Ledger,
             budget: Budget, pre: dict, no_bench: str) -> int:
    """Rank the rows, say the verdict, write sweep.csv / sweep.json / report.html / records.jsonl and the table;
    0 where a render gave a row, 1 otherwise."""
    args, out, vs = ctx.args, ctx.out, base or REFERENCE
    rows = rank(rows)
    warm_default = warm_of(ledger.records[BASELINE])[0] if BASELINE in ledger.records else None
    coverage = coverage_of(cands, ledger, warm_default, no_bench)
    text = verdict_text(ctx, cands, rows, vs, coverage)
    gpus = max([c.nproc for c in cands] + [ctx.gpus])
    through = throughput_text(rows, gpus, tolerance_db=args.psnr_tolerance_db, quality_vs=vs)
    memory = memory_line(ctx, cands, ledger)
    meta = {"model": args.model, "family": ctx.fam.name, "device": ctx.dev_name, "height": args.height,
            "width": args.width, "num_frames": args.num_frames, "steps": args.steps, "verdict": text,
            "throughput": through, "memory": memory, "contents": [dataclasses.asdict(c) for c in ctx.sets],
            "left_out": ledger.left_out, "command": command_line(), "commit": commit(), "budget_min": args.budget_min,
            "elapsed_s": budget.spent(), "runs": budget.runs, "quality_vs": vs,
            "coverage": dataclasses.asdict(coverage), "pre_render": pre}
    budget.save()
    write_outputs(out, rows, meta)
    Writer(out / "records.jsonl").write(*(Record(
        suite="sweep", case=r["stack"], config={"model": args.model, "size": [args.height, args.width],
                                                "num_frames": args.num_frames, "steps": args.steps,
                                                "attention": r["attention"], "stack": r["stack"]},
        figures={k: r[k] for k in ("warm_ms", "p20_ms", "p80_ms", "n", "speedup", "end_to_end_s", "one_time_s",
                                   "psnr_db", "psnr_n", "ssim", "peak_gib", "peak_reserved_gib", "videos_per_gpu_h",
                                   "j_per_video")},
        verdict={"speed_figure": r["speed_figure"], "why_not": r["why_not_speed"]}, command=meta["command"],
        commit=meta["commit"], created=now(), data=r) for r in rows))
    print_table(rows, vs)
    log(f"[sweep] {text}")
    for line in (through, memory):
        if line:
            log(f"[sweep] {line}")
    runs = f" over {meta['runs']} runs" if meta["runs"] > 1 else ""
    log(f"[sweep] {out / 'report.html'}, {out / 'sweep.csv'} ({meta['elapsed_s']:.0f} s of "
         f"{budget.budget_s:.0f} s budget{runs})")
    return 0 if rows else 1


def memory_line(ctx: Context, cands: list[Candidate], ledger: Ledger) -> str:
    """Under ``--max_gpu_mem``: how many were left out for it and, where no one-GPU render fit, the offload stack
    to try (:func:`vdbench.sweep.memory.offload_advice`); "" otherwise."""
    from .memory import GIB, measured, offload_advice

    if ctx.max_mem is None:
        return ""
    if not ctx.args.device.startswith("cuda"):
        return "--max_gpu_mem not applied: no GPU memory is measured here"
    out = [x["backend"] for x in ledger.left_out if x["why"].startswith("memory:")]
    text = (f"--max_gpu_mem {ctx.max_mem / GIB:g}: " + (f"left out for memory: {', '.join(out)}" if out else
                                                         "every render estimated to fit"))
    one_gpu = [c for c in cands if c.nproc == 1]
    if one_gpu and not any(c.name in ledger.records for c in one_gpu):
        base = measured(ledger.records[BASELINE]) if BASELINE in ledger.records else None
        text += "; " + offload_advice(Candidate(BASELINE, BASELINE), base, ctx.weights, ctx.max_mem)
    return text
