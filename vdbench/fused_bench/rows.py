"""What the fused-kernel benches (:mod:`~vdbench.fused_bench.rope`, :mod:`~vdbench.fused_bench.block`) share: their
common options, one timed row -- a form of a pass timed with :func:`vdbench.timing.sample_ms`, its bandwidth, its
per-step total and its output checked against the eager one --, its printed line, and the end of a run: the speed
verdict, the JSON, the exit code (1 where a fused output differs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from ..timing import sample_ms, speed_verdict, system_info


def add_options(p, shapes, ranks: int):
    """Add to the bench's parser ``p`` the options every such bench takes: ``--shapes`` (of ``shapes``), ``--ranks``
    (default ``ranks``), ``--budget_s``, ``-o``; returns ``p``."""
    p.add_argument("--shapes", nargs="+", default=["wan13", "wan14"], choices=sorted(shapes),
                   help="model shapes (default: %(default)s)")
    p.add_argument("--ranks", type=int, default=ranks, help="also a rank's share at this Ulysses degree; 1: not "
                   "(default: %(default)s)")
    p.add_argument("--budget_s", type=float, default=5.0, help="timed seconds per row at most (default: %(default)s)")
    p.add_argument("-o", "--output", default=None, help="JSON output (default: print only)")
    return p


def print_rows(rows: list[dict], label: Callable[[dict], str]) -> None:
    """One line a row: ``label(row)``, then its time, spread, bandwidth, per-step total and check."""
    for r in rows:
        print(f"{label(r)} {r['tokens']:6d} tok  {r['ms']:8.3f} ms [{r['p20_ms']:.3f}-{r['p80_ms']:.3f}] n={r['n']}  "
              f"{r['gbps'] or 0:7.0f} GB/s  x{r['calls_per_step']}/step = {r['per_step_ms']:.1f} ms  "
              f"identical={r['bit_identical']}")


def timed_row(fn: Callable, device, budget_s: float, *, moved: float, calls: int,
              check: Optional[Callable[[object], bool]] = None, **fields) -> tuple[dict, object]:
    """(row, the output of one more call): ``fields``, then the median ms of ``fn()`` with p20/p80, n and the first
    call apart, GB/s for ``moved`` bytes a call, the ``calls`` a step makes and their total, and ``bit_identical``:
    ``check(output)`` (None without a check: the eager reference itself)."""
    t = sample_ms(fn, device, budget_s=budget_s)
    st = t.stats()
    out = fn()
    ms = st["median"]
    return {**fields, "ms": ms, "p20_ms": st["p20"], "p80_ms": st["p80"], "n": t.n, "first_ms": st["first_ms"],
            "gbps": moved / (ms * 1e-3) / 1e9 if ms else None, "calls_per_step": calls,
            "per_step_ms": ms * calls if ms else None,
            "bit_identical": None if check is None else bool(check(out))}, out


def finish(rows: list[dict], device, output: Optional[str], **extra) -> int:
    """Say whether the rows are a speed figure, write them (with ``extra``) as JSON to ``output`` where given; 0, or
    1 where a fused output differed from the eager one."""
    ok, why = speed_verdict(device, n=min(r["n"] for r in rows))
    if not ok:
        print(f"warning: not a speed figure ({why})")
    out = {"device": system_info(device), "speed_figure": ok, "why_not_speed": why, "rows": rows, **extra}
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(out, indent=1))
    return 0 if all(r["bit_identical"] in (None, True) for r in rows) else 1
