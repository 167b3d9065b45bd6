#!/usr/bin/env python3
"""Recompute the warm step (``vdbench.timing``'s one definition) from the raw per-step times of recorded runs.

    python bench/lab/warm_steps.py docs/gpu_results/4xh200/2026-11-22_x4b/parallel_summary.json docs/gpu_results/h200/2026-11-22_verify/wan_timing.json ...

Older tables (docs/PERFORMANCE.md) quoted ``step_time_median``, the median of *all* steps, the first one
included; with 2–3 steps per render that is a different number from the warm step (median of the steps after
the first), because the first step carries one-time costs. This reads the raw step times those tables came from
-- a ``timing.json`` list (``step_times`` in seconds) or a ``parallel_summary*.json`` list (``step_times_ms``) --
and prints, per entry, the first-included median next to the warm step with its n and the first step, so each
number can be replaced by the warm one and said so; for parallel_summary rows also the speed-up of the warm steps
against the "1 GPU" row of the same group and backend in the same file (and the efficiency, speed-up / GPUs).
``-o`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vdbench.timing import step_stats
from vdbench.helptext import DefaultsHelpFormatter


def rows_of(path: Path) -> list[dict]:
    """One row per recorded run in ``path``: where it is, its label, the first-included median and the warm
    figures (ms)."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("rows") or []
    out = []
    for e in data:
        if "step_times_ms" in e:  # parallel_summary rows
            steps = [t / 1e3 for t in e["step_times_ms"]]
            label = f"{e.get('group', '')} {e['backend']} {e.get('config', '')}".strip()
        elif "step_times" in e:  # timing.json entries
            steps = list(e["step_times"])
            par = e.get("parallel") or {}
            label = f"{e.get('attention_type')} rep{e.get('repetition', 0)}" + (
                f" {par.get('label')} ({par.get('engine')})" if par else "")
        else:
            continue
        if not steps:
            continue
        st = step_stats(steps)
        out.append({"file": str(path), "label": label, "steps_ms": [1e3 * t for t in steps],
                    "first_included_median_ms": 1e3 * statistics.median(steps),
                    "warm_step_ms": None if st["warm_step_median"] is None else 1e3 * st["warm_step_median"],
                    "warm_step_n": st["warm_step_n"], "first_step_ms": 1e3 * st["first_step"],
                    "key": (e.get("group"), e.get("backend")) if "step_times_ms" in e else None,
                    "gpus": e.get("gpus"), "one_gpu": e.get("config") == "1 GPU"})
    base = {r["key"]: r["warm_step_ms"] for r in out if r["key"] and r["one_gpu"]}
    for r in out:
        b = base.get(r.pop("key"))
        if b and r["warm_step_ms"] and not r["one_gpu"]:
            r["speedup_vs_1gpu"] = b / r["warm_step_ms"]
            r["efficiency"] = r["speedup_vs_1gpu"] / r["gpus"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="timing.json or parallel_summary*.json files")
    ap.add_argument("-o", "--output", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for f in args.files:
        try:
            rows += rows_of(f)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {f}: {exc}", file=sys.stderr)
            return 2
    print(f"{'file':48s} {'run':44s} {'all-steps med':>13s} {'warm ms':>9s} {'n':>2s} {'first ms':>9s} "
          f"{'speedup':>7s} {'eff':>5s}")
    for r in rows:
        warm = "-" if r["warm_step_ms"] is None else f"{r['warm_step_ms']:.1f}"
        sp = f"{r['speedup_vs_1gpu']:.2f}x" if "speedup_vs_1gpu" in r else ""
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else ""
        print(f"{r['file'][-48:]:48s} {r['label'][:44]:44s} {r['first_included_median_ms']:13.1f} {warm:>9s} "
              f"{r['warm_step_n']:2d} {r['first_step_ms']:9.1f} {sp:>7s} {eff:>5s}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
