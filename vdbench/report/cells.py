"""The cells the report shares with the batch table and the sweep's ranking: break-even steps against a baseline
(:func:`break_even`, :func:`break_even_cell`), the one-time cost as a table shows it (:func:`one_time_shown`,
:func:`one_time_cell`), the memory per stage, the notes said under such tables, and :data:`EMULATED` (what an
emulated backend's speed cells say)."""

from __future__ import annotations

import math
from typing import Optional

#: What an emulated backend's speed cells say: its numerics are emulated in pure torch and its time means nothing.
EMULATED = "emulated"


def memory_text(s: dict) -> Optional[str]:
    """``load 28.1/30.2, denoise 40.3/42.0, decode 12.0/13.5`` GiB (allocated/reserved peaks of each stage, rank 0's
    card), None where not recorded."""
    mem = s.get("memory") or {}
    parts = [f"{k} {v['allocated_peak'] / 2**30:.1f}/{v['reserved_peak'] / 2**30:.1f}" for k, v in mem.items() if v]
    return ", ".join(parts) or None


def break_even(one_a, warm_a, one_b, warm_b) -> dict | None:
    """When a render on backend *a* costs less than one on baseline *b*: solve ``one_a + n·warm_a = one_b + n·warm_b``
    for the number of denoising steps ``n`` (one-time costs and warm steps in the same unit). None when a figure is
    missing. ``verdict``: ``"always"`` (a is ahead at every length: not slower per step and no more one-time
    cost), ``"never"`` (not faster per step and no less one-time cost, or ahead only below one step), ``"from"``
    (a is faster per step but pays more once: it wins from ``steps`` = the first whole n past the crossing),
    ``"up to"`` (a is slower per step but pays less once: it wins for renders of at most ``steps``), ``"same"``
    (identical figures); ``n`` the crossing itself (None where there is none)."""
    if any(v is None for v in (one_a, warm_a, one_b, warm_b)):
        return None
    more_once, saved_per_step = one_a - one_b, warm_b - warm_a  # a pays more_once more, saves saved_per_step a step
    if saved_per_step == 0:
        verdict = "always" if more_once < 0 else ("never" if more_once > 0 else "same")
        return {"verdict": verdict, "steps": None, "n": None}
    n = more_once / saved_per_step
    if saved_per_step > 0:
        if more_once <= 0:
            return {"verdict": "always", "steps": None, "n": n}
        return {"verdict": "from", "steps": math.floor(n) + 1, "n": n}
    if more_once >= 0:
        return {"verdict": "never", "steps": None, "n": n}
    steps = math.ceil(n) - 1  # a wins while n·saved > more_once, i.e. below the crossing
    if steps < 1:
        return {"verdict": "never", "steps": None, "n": n}
    return {"verdict": "up to", "steps": steps, "n": n}


def break_even_text(be: dict | None) -> str | None:
    """``always``, ``never``, ``same``, ``from 38 steps``, ``up to 12 steps``; None for None."""
    if be is None:
        return None
    if be["steps"] is None:
        return be["verdict"]
    return f"{be['verdict']} {be['steps']} step" + ("s" if be["steps"] != 1 else "")


def break_even_cell(s: dict, base: dict) -> str | None:
    """The break-even cell of a backend's :func:`~vdbench.report.timings.speed` figures ``s`` against the
    baseline's ``base``: the verdict from the warm medians and the one-time totals, and, where the warm steps'
    p20–p80 spread changes it, the range from the backend at its best (its p20 against the baseline's p80) to its
    worst, with each side's n kept: ``from 38 steps (p20–p80: 25–70; n=3 vs 3)``,
    ``from 38 steps (p20–p80: from 25 steps to never; n=3 vs 3)``.
    None where a figure is missing."""
    def at(mine, theirs):
        return break_even(s.get("one_time_s"), s.get(mine), base.get("one_time_s"), base.get(theirs))

    main = break_even_text(at("warm_step_median", "warm_step_median"))
    if main is None:
        return None
    best, worst = at("warm_step_p20", "warm_step_p80"), at("warm_step_p80", "warm_step_p20")
    n = f"n={s.get('warm_step_n')} vs {base.get('warm_step_n')}"
    if best is None or worst is None or break_even_text(best) == break_even_text(worst) == main:
        return f"{main} ({n})"
    if best["verdict"] == worst["verdict"] and best["steps"] is not None and worst["steps"] is not None:
        lo, hi = sorted((best["steps"], worst["steps"]))
        spread = f"{lo}–{hi}"
    else:
        spread = f"{break_even_text(best)} to {break_even_text(worst)}"
    return f"{main} (p20–p80: {spread}; {n})"


#: The one-time column's print resolution (s): it shows hundredths, and a magnitude under half of one is 0.00 there.
ONE_TIME_RESOLUTION_S = 0.005

#: Said under a table where a one-time cost stays negative (its cell marked ``*``).
NEGATIVE_ONE_TIME_NOTE = ("one-time cost marked *: negative by more than the warm steps' p20–p80 spread (the first "
                          "step came in faster than the warm median): a timing disturbance worth a look (a shared or "
                          "throttling machine), not a saving")


def one_time_shown(v: Optional[float], spread_s: Optional[float] = None) -> Optional[float]:
    """The one-time cost (s) a table shows: ``v``, or 0.0 where it is negative by no more than the noise of the
    subtraction it comes from -- the column's resolution, or the warm steps' p20–p80 spread ``spread_s`` where
    wider (its main term is the first step minus the warm median: one sample against that spread). A first step
    does the warm steps' work and more, so a negative within that noise is the noise; one beyond it is kept, for the
    table to mark (:data:`NEGATIVE_ONE_TIME_NOTE`). A positive figure is shown as it is. The files (summary.csv,
    timing.json) keep the measured value."""
    if v is None:
        return None
    if abs(v) < ONE_TIME_RESOLUTION_S or (v < 0 and -v <= max(ONE_TIME_RESOLUTION_S, spread_s or 0.0)):
        return 0.0
    return v


def one_time_cell(v: Optional[float], spread_s: Optional[float] = None, missing: str = "–") -> str:
    """A table cell of :func:`one_time_shown`: hundredths of a second, ``*`` on a negative kept."""
    shown = one_time_shown(v, spread_s)
    return missing if shown is None else f"{shown:.2f}" + ("*" if shown < 0 else "")


def warm_spread_s(row: dict) -> Optional[float]:
    """A summary row's warm-step p20–p80 spread in seconds, None where either end is missing."""
    lo, hi = row.get("warm_step_p20_ms"), row.get("warm_step_p80_ms")
    return (hi - lo) / 1e3 if lo is not None and hi is not None else None


#: What the break-even figures are, said under the table that shows them.
BREAK_EVEN_NOTE = ("break-even steps against {base}: the denoising steps a render needs before the backend's total "
                   "(one-time costs + steps × warm step) is below {base}'s, from the measured warm steps (median, "
                   "with the p20–p80 range where it changes the answer, and each side's n) and one-time totals "
                   "(the first step's excess over a warm step, the warm-up calls', the decode's; the load not "
                   "counted); 'always' / 'never': ahead / behind at every length")

