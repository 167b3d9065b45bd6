"""The sweep's budget: what one more render costs (default's measured render with the step's attention time swapped
for the candidate's, from the kernel bench on the model's captured inputs), in which order the renders are bought,
and the kernel bench's own ranking, which stands in for what was not rendered."""

from __future__ import annotations

import math
import re
from typing import Optional

from .. import backends as B
from .candidates import BASELINE, STACK_OPTIONS, Candidate, parse_stack

#: What a stack option adds to a render once (its first step or warm-up call), until a render of this sweep measured it
#: (then the most it measured): the first-call costs measured on an H200 at Wan 1.3B 480p, docs/PERFORMANCE.md §3.6
#: (a regional compile: 8-11 s) and §10.3 (the feed-forward fp8 GEMMs' warm-up call, compile included, 14.1 s without
#: inductor's coordinate-descent tuning, the default; every block GEMM in fp8, not measured without it, is given the
#: same prior).
OPTION_ONE_TIME_S = {"compile": 11.0, "fp8gemm": 15.0, "fp8gemm=ffn": 15.0, "bf16te": 0.0, "eagerblock": 0.0}

#: A render is started when its estimate times this (a slower process start, a busy disk) fits in what is left.
MARGIN = 1.2


def calls_per_step(meta: dict) -> dict[tuple, float]:
    """{(B, H, Sq, Sk, D): attention calls per denoising step} from the capture render's metadata (its
    ``unique_shapes`` counted every call of its steps, not only the captured ones); {} where it holds no BHSD
    shapes."""
    if meta.get("layout", "BHSD") != "BHSD":
        return {}
    steps = max(1, int((meta.get("settings") or {}).get("num_inference_steps") or 1))
    out: dict[tuple, float] = {}
    for u in meta.get("unique_shapes") or []:
        try:
            q, k = (tuple(int(x) for x in re.findall(r"\d+", part)) for part in str(u["shape"]).split("|")[:2])
            calls = float(u["calls"])
        except (KeyError, TypeError, ValueError):
            continue
        if len(q) == 4 and len(k) == 4:
            key = (q[0], q[1], q[2], k[2], q[3])
            out[key] = out.get(key, 0.0) + calls / steps
    return out


def attention_ms_per_step(bench_rows: list[dict], calls: dict[tuple, float]) -> dict[str, float]:
    """{backend: its attention's milliseconds per denoising step}: for each shape the model calls, the median of the
    kernel bench's times on inputs of that shape, times the calls of that shape a step makes (``calls``:
    :func:`calls_per_step`). A backend without a time on every shape is left out: nothing predicts it."""
    from statistics import median

    times: dict[str, dict[tuple, list[float]]] = {}
    for r in bench_rows:
        if not str(r.get("status", "")).startswith("ok") or r.get("time_ms") in (None, "") or not r.get("kernel"):
            continue
        try:
            key = tuple(int(r[c]) for c in ("B", "H", "Sq", "Sk", "D"))
            name = B.resolve(r["kernel"]).name
        except (KeyError, TypeError, ValueError, B.BackendUnavailable):
            continue
        if key in calls:
            times.setdefault(name, {}).setdefault(key, []).append(float(r["time_ms"]))
    return {name: sum(n * median(by[key]) for key, n in calls.items())
            for name, by in times.items() if calls and set(by) == set(calls)}


def option_words(cand: Candidate) -> list[str]:
    """The stack options (:data:`STACK_OPTIONS`) a candidate's flags carry, the fp8 GEMMs by their scope
    (``fp8gemm``, ``fp8gemm=ffn``): each scope's one-time cost is its own."""
    words = [w for w, flags in STACK_OPTIONS.items() if all(f in cand.flags for f in flags)]
    if "fp8gemm" in words:
        at = cand.flags.index(STACK_OPTIONS["fp8gemm"][0]) + 1
        scope = cand.flags[at] if at < len(cand.flags) and not cand.flags[at].startswith("-") else "all"
        words[words.index("fp8gemm")] = "fp8gemm" if scope == "all" else f"fp8gemm={scope}"
    return words


def options_one_time(records: dict) -> dict[str, float]:
    """Per stack option, the most one-time cost a render of this sweep that carried it measured (``records``: by
    the stack's name, which says its options)."""
    seen: dict[str, float] = {}
    for name, rec in records.items():
        one = rec.figures.get("one_time_s")
        if one is None:
            continue
        try:
            words = option_words(parse_stack(name))
        except ValueError:
            continue
        for w in words:
            seen[w] = max(seen.get(w, 0.0), float(one))
    return seen


def estimate_render_s(cand: Candidate, *, default_s: Optional[float], steps: int, attn_ms: dict[str, float],
                      fallback_s: float, baseline: str = BASELINE,
                      one_time_s: Optional[dict[str, float]] = None) -> tuple[float, str]:
    """(seconds, what the figure rests on) of rendering ``cand``, the quality figure aside.

    A render of another attention differs from the ``default`` render (measured: ``default_s``) by its attention's
    time per step against default's (:func:`attention_ms_per_step`, from the kernel bench on the model's own
    captured inputs), over ``steps`` steps: the rest of the render (load, text encoder, the other layers, the VAE)
    is the same work. The exact ``reference`` is predicted the same way -- it is slow because exact fp32 attention
    is (at Wan 1.3B 480p: ~290 ms a call against ~12, 17.8 s a step against 1.2) -- and every other render from
    its own attention, not from the slowest render so far. Without a figure (no default render yet, or no
    kernel-bench time for that attention) the estimate is ``fallback_s``, the slowest render so far, and says so.
    A stack's options are not in the kernel bench: their one-time cost is added, the most a render of this sweep
    measured for one of them (``one_time_s``, :func:`options_one_time`), else :data:`OPTION_ONE_TIME_S`'s."""
    if default_s is None:
        return fallback_s, "no default render yet: the slowest render so far"
    if cand.name == baseline:
        return default_s, "default's own render"
    try:
        name = B.resolve(cand.attention).name
    except (ValueError, B.BackendUnavailable):
        name = None
    a, d = attn_ms.get(name), attn_ms.get(baseline)
    if a is None or d is None:
        return max(default_s, fallback_s), "no kernel-bench time for its attention: the slowest render so far"
    est = default_s + steps * (a - d) / 1e3
    basis = (f"default's {default_s:.0f} s {'+' if a >= d else '-'} {steps} steps x {abs(a - d):.1f} ms of attention "
             f"a step (kernel bench)")
    words = option_words(cand)
    if words:
        seen = one_time_s or {}
        extra, word = max((seen.get(w, OPTION_ONE_TIME_S.get(w, 0.0)), w) for w in words)
        est += extra
        basis += (f" + {extra:.0f} s once for {word} ("
                  f"{'measured on an earlier render here' if word in seen else 'the prior: no render here had it yet'})")
    return est, basis


def render_order(cands: list[Candidate], baseline: str = BASELINE, slots: int = 1) -> list[Candidate]:
    """The order the budget is spent in: ``default`` first (the speed baseline every speed-up reads on), then the
    candidates as planned (fastest on the kernel bench first, then the stacks), the exact ``reference`` last: with a
    short budget the renders that answer "which is faster" come before the one that only sharpens the quality
    column (:func:`quality_baseline` stands in for it). On several places side by side (``slots``) the reference
    goes after the one-GPU candidates and before the multi-GPU layouts, which need the places it would free."""
    if slots > 1:
        return sorted(cands, key=lambda c: 0 if c.name == baseline else 3 if c.nproc > 1 else 2 if c.is_reference
                      else 1)
    return sorted(cands, key=lambda c: 0 if c.name == baseline else 2 if c.is_reference else 1)


def plan_renders(pending: list[tuple[Candidate, float, str]], left_s: float, *, quality_s: float = 0.0,
                 slots: int = 1) -> list[dict]:
    """Which of the ``pending`` renders (in :func:`render_order`, each with its estimate and basis) fit in
    ``left_s`` on ``slots`` places side by side: walked in order, each goes to the place that frees first and is
    taken when it ends there, its estimate x :data:`MARGIN` later, with the quality comparison it adds
    (``quality_s``), within ``left_s``; one that doesn't is passed over and the next (cheaper) one still tried.
    [{"name", "estimate_s", "basis", "render", "why"}] -- the run re-plans after each render with what it
    measured. A layout of N GPUs is counted on one place (its GPUs run it together)."""
    plan, ends = [], [0.0] * max(1, slots)
    for cand, est, basis in pending:
        need = est * MARGIN + quality_s
        k = min(range(len(ends)), key=ends.__getitem__)
        take = ends[k] + need <= left_s
        left = left_s - ends[k]
        plan.append({"name": cand.name, "estimate_s": est, "basis": basis, "render": take,
                     "why": None if take else f"budget: {left:.0f} s left, its render ~{est:.0f} s ({basis})"})
        if take:
            ends[k] += need
    return plan


def predicted_ranking(cands: list[Candidate], attn_ms: dict[str, float], default_step_ms: Optional[float],
                      baseline: str = BASELINE) -> tuple[list[tuple[str, float]], str]:
    """The kernel bench's ranking of the plain candidates: ([(name, predicted speed-up over default)], fastest first;
    what the speed-up is of). With default's measured warm step: the step each would take (default's, with its
    attention's time swapped in: :func:`attention_ms_per_step`); without: the attention alone. Stacks are not in it
    (their options are not in the kernel bench)."""
    d = attn_ms.get(baseline)
    got = []
    for c in cands:
        if c.flags or c.is_reference or c.name == baseline:
            continue
        try:
            a = attn_ms.get(B.resolve(c.attention).name)
        except (ValueError, B.BackendUnavailable):
            a = None
        if a is None or not d:
            continue
        if default_step_ms:
            step = default_step_ms - d + a
            got.append((c.name, default_step_ms / step if step > 0 else math.inf))
        elif a > 0:
            got.append((c.name, d / a))
    what = "predicted step vs default's" if default_step_ms else "attention time vs default's attention"
    return sorted(got, key=lambda x: -x[1]), what


def default_render_s(render_s: dict, records: dict) -> Optional[float]:
    """Default's render time: as measured by a run of this sweep, else its record's end to end (process start to
    the video on disk); None before it is rendered."""
    if BASELINE in render_s:
        return float(render_s[BASELINE])
    rec = records.get(BASELINE)
    e2e = rec.figures.get("end_to_end_s") if rec is not None else None
    return float(e2e) if e2e else None

