#!/usr/bin/env python3
"""Where a profiled step's GPU time goes on the timeline, not just in sum: busy, idle, and communication that no
compute kernel hides.

    python3 bench/trace_gaps.py OUT/traces/u2/rank0_step4.json [...] -o gaps.json

Reads torch.profiler Chrome traces (a render's ``--profile_output NAME`` writes them under
``DIR/traces/NAME/``). For each trace, over the span from its first GPU kernel to its last:

* ``busy_ms``: the union of every kernel's interval (streams overlapping counted once); ``idle_ms`` the rest of the
  span -- the GPU waiting for the host or for another rank;
* ``comm_ms``: the union of the communication kernels (NCCL), ``comm_exposed_ms`` the part of it no compute kernel
  runs beside -- what an overlap could still win;
* ``categories_ms``: kernel time by :func:`vdbench.profiling.kernel_category` (summed, not unioned);
* ``gaps``: the idle intervals over ``--min_gap_us``, their count and sum, and the largest ones with the kernels on
  either side (what the GPU waited between); where the trace has the host side (torch.profiler's ``cuda_runtime``
  launch events, matched to the kernels by ``correlation``), which gaps the host caused: ``host_bound_ms`` sums the
  gaps whose next kernel was launched only after the gap had begun (the GPU waited for the host), and each large gap
  says when that launch came (``launched_us`` after the gap's start; negative: launched before, the kernel waited
  on another stream or rank) and what the launching thread ran meanwhile (``host``: its outermost ops in the gap,
  longest first, the profiler's step marks left out; ``host_ops_us``: their time in the gap, the rest of which the
  thread spent in Python between ops or waiting for the GIL).

With ``--per_step``, a trace of several steps (``--profile_active`` > 1) is read step by step: each GPU kernel
belongs to the step whose profiler mark (``ProfilerStep#N``) was open when the host launched it, so steps that
took longer than others can be told apart (more idle, more exposed communication, or slower kernels).

Prints one line per trace (or step) and writes the whole as JSON. CPU-only traces have no GPU kernels: said, not
guessed.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

from vdbench.helptext import DefaultsHelpFormatter
from vdbench.profiling import kernel_category

KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted intervals covering the same points."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def minus(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the merged intervals ``xs`` outside the merged intervals ``ys``."""
    out, j = [], 0
    for a, b in xs:
        cur = a
        while j < len(ys) and ys[j][1] <= cur:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def analyse(events: list[dict], min_gap_us: float = 20.0, top: int = 12) -> dict:
    """The timeline summary of one trace's GPU kernels (times in ms)."""
    ks = [e for e in events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATS and e.get("dur") is not None]
    if not ks:
        return {"error": "no GPU kernels in this trace (a CPU-only profile)"}
    ks.sort(key=lambda e: e["ts"])
    t0, t1 = ks[0]["ts"], max(e["ts"] + e["dur"] for e in ks)
    comm = [e for e in ks if kernel_category(e["name"]) == "communication"]
    comp = [e for e in ks if kernel_category(e["name"]) != "communication"]
    iv = lambda es: union([(e["ts"], e["ts"] + e["dur"]) for e in es])  # noqa: E731
    all_u, comm_u, comp_u = iv(ks), iv(comm), iv(comp)
    cats: dict = {}
    for e in ks:
        c = kernel_category(e["name"])
        cats[c] = cats.get(c, 0.0) + e["dur"] / 1e3
    idle = minus([(t0, t1)], all_u)
    big = [(a, b) for a, b in idle if b - a >= min_gap_us]
    ends = sorted(((e["ts"] + e["dur"], e["name"]) for e in ks))
    end_ts = [t for t, _ in ends]
    start_ts = [e["ts"] for e in ks]  # ks is sorted by start

    def before(t):  # the kernel that ended last at or before t
        i = bisect.bisect_right(end_ts, t + 1e-3)
        return ends[i - 1][1] if i else None

    def after(t):  # the kernel that starts first at or after t
        i = bisect.bisect_left(start_ts, t - 1e-3)
        return ks[i]["name"] if i < len(ks) else None

    # the host side: each kernel's launch (its cuda_runtime event, by correlation id) and the launching thread's ops
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in (e.get("args") or {})}
    host_ops: dict = {}
    for e in events:  # the profiler's own step marks enclose everything: not an op the host ran
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "user_annotation") \
                and e.get("dur") is not None and not str(e.get("name", "")).startswith("ProfilerStep#"):
            host_ops.setdefault(e.get("tid"), []).append(e)
    for ops in host_ops.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))

    def launch_of(t):  # the runtime event that launched the kernel starting first at or after t
        i = bisect.bisect_left(start_ts, t - 1e-3)
        corr = (ks[i].get("args") or {}).get("correlation") if i < len(ks) else None
        return launches.get(corr)

    def host_during(tid, a, b):  # the thread's outermost ops overlapping [a, b], by their overlap
        outer, cover = [], float("-inf")
        for e in host_ops.get(tid, ()):
            if e["ts"] >= b:
                break
            if e["ts"] < cover:  # nested in an outer op already seen
                continue
            cover = e["ts"] + e["dur"]
            if cover > a:
                outer.append((min(b, cover) - max(a, e["ts"]), e["name"]))
        return sorted(outer, reverse=True)

    host_bound = 0.0
    for a, b in big:
        launch = launch_of(b)
        if launch is not None and launch["ts"] > a:
            host_bound += b - a

    def gap_entry(a, b):
        entry = {"us": b - a, "at_ms": (a - t0) / 1e3, "after": (before(a) or "")[:80], "before": (after(b) or "")[:80]}
        launch = launch_of(b)
        if launch is not None:
            ops = host_during(launch.get("tid"), a, b)
            entry["launched_us"] = round(launch["ts"] - a, 1)
            entry["host_ops_us"] = round(sum(us for us, _ in ops), 1)  # the rest of the gap: Python, or the GIL
            entry["host"] = [{"op": name[:60], "us": round(us, 1)} for us, name in ops[:3]]
        return entry

    largest = sorted(big, key=lambda ab: ab[0] - ab[1])[:top]
    return {
        "span_ms": (t1 - t0) / 1e3, "kernels": len(ks), "busy_ms": length(all_u) / 1e3,
        "idle_ms": length(idle) / 1e3, "comm_ms": length(comm_u) / 1e3,
        "comm_exposed_ms": length(minus(comm_u, comp_u)) / 1e3, "compute_ms": length(comp_u) / 1e3,
        "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "gaps": {"min_gap_us": min_gap_us, "count": len(big), "sum_ms": length(big) / 1e3,
                 "host_bound_ms": host_bound / 1e3 if launches else None,
                 "largest": [gap_entry(a, b) for a, b in largest]},
    }


def split_steps(events: list[dict]) -> list[tuple[str, list[dict]]]:
    """(``ProfilerStep#N``, the trace's events with only that step's GPU kernels) for each step mark that launched
    a kernel; a kernel goes to the mark open at its launch (its ``cuda_runtime`` event; its own start where the
    trace has none). Kernels launched before the first mark are left out; no marks: an empty list."""
    marks = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    if not marks:
        return []
    starts = [m["ts"] for m in marks]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in (e.get("args") or {})}
    is_kernel = lambda e: e.get("ph") == "X" and e.get("cat") in KERNEL_CATS and e.get("dur") is not None  # noqa: E731
    rest = [e for e in events if not is_kernel(e)]
    per: list[list[dict]] = [[] for _ in marks]
    for e in events:
        if not is_kernel(e):
            continue
        t = launches.get((e.get("args") or {}).get("correlation"), e["ts"])
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0:
            per[i].append(e)
    return [(m["name"], rest + ks) for m, ks in zip(marks, per) if ks]


def load_events(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def _analysed(paths: list[Path], per_step: bool, min_gap_us: float):
    """(name, summary) for each trace, or each step of each trace with ``per_step`` (name ``PATH#ProfilerStep#N``)."""
    for path in paths:
        try:
            events = load_events(path)
            parts = split_steps(events) if per_step else []
            if not parts:
                yield str(path), analyse(events, min_gap_us)
            for name, evs in parts:
                yield f"{path}#{name}", analyse(evs, min_gap_us)
        except (OSError, ValueError, KeyError) as exc:
            yield str(path), {"error": f"{type(exc).__name__}: {exc}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path,
                   help="Chrome trace JSON files, or folders searched for rank*_step*.json traces")
    p.add_argument("--min_gap_us", type=float, default=20.0, help="idle intervals shorter than this are not gaps")
    p.add_argument("--per_step", action="store_true",
                   help="read a trace of several steps step by step (by the profiler's step marks)")
    p.add_argument("-o", "--output", type=Path, default=None, help="the JSON summary (default: print only)")
    args = p.parse_args(argv)
    paths = [q for p in args.traces for q in (sorted(p.rglob("rank*_step*.json")) if p.is_dir() else [p])]
    if not paths:
        print(f"no traces in {', '.join(map(str, args.traces))}", file=sys.stderr)
        return 1
    out = {}
    for path, r in _analysed(paths, args.per_step, args.min_gap_us):
        out[path] = r
        if "error" in r:
            print(f"{path}: {r['error']}")
            continue
        print(f"{path}: span {r['span_ms']:.1f} ms, busy {r['busy_ms']:.1f}, idle {r['idle_ms']:.1f} "
              f"({r['gaps']['count']} gaps >= {args.min_gap_us:g} us: {r['gaps']['sum_ms']:.1f}"
              + (f", host-bound {r['gaps']['host_bound_ms']:.1f}" if r["gaps"]["host_bound_ms"] is not None else "")
              + "), "
              f"comm {r['comm_ms']:.1f} (exposed {r['comm_exposed_ms']:.1f}); "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["categories_ms"].items()))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
