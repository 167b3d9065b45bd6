#!/usr/bin/env python3
"""Sample every card's clocks, power and temperature with nvidia-smi while a suite runs, and summarize each card's
busy samples: whether the cards of one machine ran at the same clocks, and why not (power, thermal).

    python3 bench/gpu_monitor.py -o smi.csv --summary smi.json --stop_file OUT/parallel_summary.json --seconds 600
    python3 bench/gpu_monitor.py -o smi.csv -- torchrun --nproc_per_node=4 run_wan.py ...   # around one command

It reads only (``nvidia-smi --query-gpu``); it changes no setting of the cards. It stops when ``--stop_file``
exists, after ``--seconds``, on SIGTERM/SIGINT, or when the command given after ``--`` ends (its exit status is
then this tool's), and writes the summary whichever way it stopped. A busy sample is
one with the card's utilization at or above ``--busy_pct``; the summary per card (by nvidia-smi's UUID, the key
``gpu_uuid`` in a render's timing.json) holds the busy samples' count, median and minimum SM clock, median power
and the power limit, the highest temperature, and every clock event reason (nvidia-smi's bit mask: power cap,
thermal, ...) seen while busy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vdbench.helptext import DefaultsHelpFormatter

FIELDS = ["timestamp", "index", "uuid", "utilization.gpu", "clocks.sm", "clocks.mem", "power.draw", "power.limit",
          "temperature.gpu"]
#: The clock event reasons' field: its newer name first (older drivers know only the second).
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _num(x: str):
    try:
        return float(x)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse(lines: list[str], fields: list[str]) -> list[dict]:
    """nvidia-smi's ``csv,noheader,nounits`` lines as dicts (numbers where a field is one)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(fields):
            continue
        row = dict(zip(fields, parts))
        for k in fields[3:]:
            row[k] = row[k] if k == "reasons" else _num(row[k])
        row["index"] = int(row["index"]) if row["index"].isdigit() else row["index"]
        out.append(row)
    return out


def summarize(rows: list[dict], busy_pct: float) -> dict:
    """Per card (UUID): its busy samples' clocks, power, temperature and clock event reasons."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["uuid"], []).append(r)
    out = {}
    for uuid, rs in by.items():
        busy = [r for r in rs if (r.get("utilization.gpu") or 0) >= busy_pct]
        sm = [r["clocks.sm"] for r in busy if r.get("clocks.sm") is not None]
        pw = [r["power.draw"] for r in busy if r.get("power.draw") is not None]
        tp = [r["temperature.gpu"] for r in rs if r.get("temperature.gpu") is not None]
        reasons = sorted({r.get("reasons") for r in busy if r.get("reasons") not in (None, "0x0000000000000000")})
        out[uuid] = {"index": rs[0]["index"], "samples": len(rs), "busy_samples": len(busy),
                     "sm_clock_mhz_median": statistics.median(sm) if sm else None,
                     "sm_clock_mhz_min": min(sm) if sm else None,
                     "power_w_median": statistics.median(pw) if pw else None,
                     "power_limit_w": rs[-1].get("power.limit"),
                     "temperature_c_max": max(tp) if tp else None,
                     "busy_clock_event_reasons": reasons}
    return out


def _query(fields: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("-o", "--output", type=Path, required=True, help="CSV of every sample")
    ap.add_argument("--summary", type=Path, default=None, help="JSON summary per card (default: OUTPUT with .json)")
    ap.add_argument("--interval_s", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--seconds", type=float, default=600.0, help="stop after this long")
    ap.add_argument("--stop_file", type=Path, default=None, help="stop once this file exists")
    ap.add_argument("--busy_pct", type=float, default=90.0, help="utilization (%%) from which a sample counts as busy")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="after --: a command to run, sampled while it runs (default: none, sample until stopped)")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if shutil.which("nvidia-smi") is None:
        print("error: nvidia-smi is not on PATH: gpu_monitor samples NVIDIA cards (hint: run it on the GPU machine)",
              file=sys.stderr)
        return 2
    fields = FIELDS + [REASONS[0]]
    if _query(fields).returncode != 0:
        fields = FIELDS + [REASONS[1]]
    if _query(fields).returncode != 0:
        fields = list(FIELDS)
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    names = fields[:-1] + ["reasons"] if fields[-1] in REASONS else fields
    rows: list[dict] = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(command) if command else None
    t0 = time.monotonic()
    with open(args.output, "w") as f:
        f.write(",".join(names) + "\n")
        while not stop["now"] and (child is not None or time.monotonic() - t0 < args.seconds) \
                and not (args.stop_file and args.stop_file.exists()) and not (child and child.poll() is not None):
            p = _query(fields)
            if p.returncode == 0:
                lines = p.stdout.strip().splitlines()
                f.write("\n".join(lines) + "\n")
                f.flush()
                rows += parse(lines, names)
            time.sleep(args.interval_s)
    summary = {"fields": names, "interval_s": args.interval_s, "busy_pct": args.busy_pct,
               "seconds": round(time.monotonic() - t0, 1), "cards": summarize(rows, args.busy_pct)}
    out = args.summary or args.output.with_suffix(".json")
    out.write_text(json.dumps(summary, indent=1))
    for uuid, c in summary["cards"].items():
        print(f"card {c['index']} {uuid[:12]}: {c['busy_samples']} busy samples, SM clock median "
              f"{c['sm_clock_mhz_median']} MHz (min {c['sm_clock_mhz_min']}), power {c['power_w_median']} W of "
              f"{c['power_limit_w']}, max {c['temperature_c_max']} C, reasons {c['busy_clock_event_reasons']}")
    if child is not None:
        if child.poll() is None:  # stopped by a signal or the stop file: the command goes too
            child.terminate()
        return child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
