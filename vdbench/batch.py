"""The comparison a batch of renders ends with: what each backend cost and changed, one row per render.

    python -m vdbench.batch RESULTS_DIR --outputs V1.mp4 V2.mp4 ... [--failed NAME:CODE ...] [--logs DIR]
    python -m vdbench.batch RESULTS_DIR --content 2        # a prompt and seed set: the second content's renders

What ``render_all_WAN.sh`` / ``render_all_attention.sh`` print after their renders, so a batch never ends on bare
counts. Rows, in the batch's order: the render's stack (its backend with the speed options, VAE modes and step
cache: :func:`vdbench.measure.record.stack_name`), parallel layout, warm ms/step with its spread
(``vdbench.timing``'s definition: the median of the steps after the first, p20–p80 and n), the render's end-to-end
time (the process's start to the video on disk) and its one-time costs (timing.json's ``one_time.total_s``: the
first step's excess over a warm step, the warm-up calls', the decode's), speed-up against the batch's first exact
backend (:attr:`vdbench.backends.Backend.exact`; emulations say "emulated", never a speed), the break-even steps
against that same baseline (:func:`vdbench.report.break_even`: from how many denoising steps the render beats it),
PSNR of the decoded video against the ``reference`` render of the same content when the batch rendered one, the
throughput (:func:`throughput`: videos per GPU-hour from the render's end-to-end seconds and GPUs, joules per video
from its warm step's energy and its steps, both computed from its record) and the kernels that actually ran. Renders
of several contents (a prompt and seed set, :mod:`vdbench.sets`) are shown one row per stack over the set
(:func:`set_rows`: the PSNR's mean, min-max and n), or one content at a time (``--content N``). A backend that
failed gets its exit code and the first error line of its log; one that can't run on this machine gets its install
hint and its emulation twin from the registry, so what to do next is on screen.

Everything is read with :mod:`vdbench.report`'s readers (:func:`vdbench.report.speed`: the latest run of each
output, never two runs mixed; :func:`vdbench.report.video_psnr`), not parsed again here. Each video's identity --
its backend or schedule with their options, the parallel layout, the VAE modes -- is its record's
(:func:`vdbench.report.identities`: the record naming the video's path), never its file name; a video no record
names is identified from its file name, and a ``note`` column says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import backends as B
from .helptext import DefaultsHelpFormatter
from .report import (BREAK_EVEN_NOTE, EMULATED, FROM_FILE_NAME, NEGATIVE_ONE_TIME_NOTE, break_even_cell, identities,
                     is_grid_name, one_time_cell, references, refused, resolved, shown_labels, speed, video_psnr)

__all__ = ["rows", "table", "failure_line", "main"]


#: A cell with no figure (a file written before it was recorded, a render with no warm step).
MISSING = "—"


def _s(v) -> str:
    return MISSING if v is None else f"{v:.2f}"


def _spread(s: dict):
    """The warm steps' p20–p80 spread (s) of a speed entry, None where it has none."""
    lo, hi = s.get("warm_step_p20"), s.get("warm_step_p80")
    return hi - lo if lo is not None and hi is not None else None


def _ms(v) -> str:
    return f"{v * 1e3:.3g}" if v * 1e3 < 100 else f"{v * 1e3:.0f}"


def _layout(s: dict) -> str:
    par = s.get("parallel") or {}
    if not par:
        return "1 process"
    return f"{par.get('label')} ({par.get('engine')}, {par.get('world_size')} ranks)"


def _exact(ident) -> bool:
    """Whether a run's attention is exact: as its record says, else the registry's answer for the recorded spec
    (a backend or a whole schedule: :attr:`vdbench.patching.schedule.Schedule.exact`)."""
    return bool(ident.exact if ident.exact is not None else resolved(ident.attention, "exact"))


def rows(results, outputs, reference: str = "reference") -> tuple[list[dict], list[str]]:
    """One row per rendered ``outputs`` video (in order) and the warnings under the table (timings that are not
    speed figures, said once per reason)."""
    results = Path(results)
    sp = speed(results)
    ids = identities(outputs, results)
    labels = [i.label for i in ids]
    refs = references(reference, dict(zip(labels, ids)))  # one reference per content (prompt, seed, size)
    bad = refused(outputs, results)
    base_label = next((i.label for i in ids if (sp.get(i.label) or {}).get("warm_step_median") and _exact(i)),
                      None)
    base_s = (sp.get(base_label) or {}) if base_label else {}
    base = base_s.get("warm_step_median")
    out, whys, broke_even, cached = [], {}, False, False
    shown, common = shown_labels(ids)
    for ident, video, name in zip(ids, outputs, shown):
        label = ident.label
        s = sp.get(label) or {}
        rate, joules = throughput(s)
        row = {"backend": name, "layout": _layout(s) if s else "?", "warm": "no timing entry", "speedup": "",
               "per_gpu_h": MISSING if rate is None else f"{rate:.3g}",
               "j_video": MISSING if joules is None else f"{joules:.3g}",
               "_stack": ident.stack, "_content": ident.content, "_warm": s.get("warm_step_median"),
               "_e2e": s.get("end_to_end_s"), "_rate": rate, "_joules": joules, "_psnr": None,
               "_gpus": _gpus(s), "_exact": _exact(ident), "_emulated": bool(s.get("emulated")),
               "end_to_end": _s(s.get("end_to_end_s")) if s else "",
               "one_time": one_time_cell(s.get("one_time_s"), _spread(s), MISSING) if s else "",
               "break_even": "", "psnr": "",
               "kernels": "; ".join(f"{k}×{n}" for k, n in (s.get("calls_by_kernel") or {}).items()),
               "note": "" if ident.from_record else FROM_FILE_NAME}
        if s and base_label:
            cell = "baseline" if label == base_label else break_even_cell(s, base_s)
            row["break_even"] = cell or MISSING
            broke_even |= cell is not None and label != base_label
        if s.get("emulated"):
            row.update(warm=EMULATED, speedup=EMULATED, end_to_end=EMULATED, one_time=EMULATED, break_even=EMULATED,
                       per_gpu_h=EMULATED, j_video=EMULATED)
        elif s.get("warm_step_median") is not None:
            row["warm"] = (f"{_ms(s['warm_step_median'])} ({_ms(s['warm_step_p20'])}–{_ms(s['warm_step_p80'])}, "
                           f"n={s['warm_step_n']})")
            if base and s.get("cache") and s.get("denoise_s") and base_s.get("denoise_s"):
                # a cached run's steps are computed or reused: its warm median is one kind's, its speed the
                # denoising's
                row["speedup"] = f"{base_s['denoise_s'] / s['denoise_s']:.2f}× (denoising)"
                cached = True
            elif base:
                row["speedup"] = f"{base / s['warm_step_median']:.2f}×"
            if s.get("why_not_speed"):
                whys.setdefault(s["why_not_speed"], []).append(label)
                row["_why"] = s["why_not_speed"]
        elif s:
            row["warm"] = "no warm step (one step)"
        ref_label = refs.get(ident.content)
        if str(video) in bad:
            row["note"] = bad[str(video)]
        elif ref_label is not None:
            q = float("inf") if label == ref_label else video_psnr(video, outputs[labels.index(ref_label)])
            row["_psnr"], row["_is_ref"] = q, label == ref_label
            row["psnr"] = "ref" if label == ref_label else ("–" if q is None else
                                                             ("∞ dB" if q == float("inf") else f"{q:.1f} dB"))
        elif refs:
            row["psnr"] = "–"
        out.append(row)
    notes = [f"not a speed figure ({why}): {', '.join(names)}" for why, names in whys.items()]
    if common:
        notes.insert(0, f"every render: {common} (the settings off their defaults are in each timing entry's "
                        "identity.settings)")
    if base_label:
        notes.insert(0, f"speed-up: against {base_label}, the batch's first exact backend")
    if broke_even:
        notes.insert(1, BREAK_EVEN_NOTE.format(base=base_label))
    if any(r["one_time"].endswith("*") for r in out):
        notes.append(NEGATIVE_ONE_TIME_NOTE)
    if cached:
        notes.append("a run with a step cache: its speed-up is the denoising time's (denoise_s, every step), not "
                     "the warm step's (a median of computed or of reused steps)")
    if not refs:
        notes.append(f"no PSNR column: the batch rendered no {reference!r} (add it to --types)")
    if any(r["_rate"] is not None or r["_joules"] is not None for r in out):
        notes.append(THROUGHPUT_NOTE)
    return out, notes


#: How the throughput columns are computed (said under every table that shows them).
THROUGHPUT_NOTE = ("videos/GPU-h = 3600 / (end-to-end s x the render's GPUs), computed from each render's record "
                   "(its process start to its video on disk, the model's load included): N one-GPU renders side by "
                   "side on N GPUs make N x this an hour; J/video = a warm step's joules over every card (NVML) x the "
                   "render's steps: the denoising alone")


def _gpus(s: dict) -> int:
    return int((s.get("parallel") or {}).get("world_size") or 1)


def throughput(s: dict) -> tuple:
    """(videos per GPU-hour, joules per video) of a render's speed entry (:func:`vdbench.report.speed`): 3600 over
    its end-to-end seconds times its GPUs, and a warm step's joules (every card) times its steps; None where a
    figure is missing or the render is an emulation (no speed)."""
    if not s or s.get("emulated"):
        return None, None
    e2e, energy, steps = s.get("end_to_end_s"), s.get("step_energy_j"), len(s.get("step_times") or [])
    rate = 3600.0 / (e2e * _gpus(s)) if e2e else None
    return rate, (energy * steps if energy is not None and steps else None)


def failure_line(name: str, code: str, log: Path | None = None, backend_name: str | None = None) -> str:
    """``name: FAILED (exit 2): <first error line of its log>``, then, for a backend that can't run here, what
    installs it and the emulation that runs anywhere (the registry's ``install_hint`` and ``twin``);
    ``backend_name``: the backend asked for where ``name`` is more (a render of a prompt set)."""
    first = ""
    if log is not None and Path(log).is_file():
        lines = Path(log).read_text(errors="replace").splitlines()
        first = next((ln[len("error: "):] for ln in lines if ln.startswith("error: ")), "")
    text = f"{name}: FAILED (exit {code})" + (f": {first}" if first else "")
    try:  # the name the batch asked for (a --types entry), not a label read back from a file
        backend = B.resolve(backend_name or name)
    except B.BackendUnavailable:
        backend = None
    if backend is not None and not backend.availability()[0]:
        extra = [f"install: {backend.install_hint}"] if backend.install_hint else []
        extra += [f"runs anywhere as its emulation: {backend.twin}"] if backend.twin else []
        if extra:
            text += "\n    " + "; ".join(extra)
    return text


def set_rows(per_render: list[dict]) -> list[dict]:
    """One row per stack over the renders of a prompt and seed set (:func:`rows`' rows, in their order): the
    renders' count, the median of their warm steps, its speed-up against the first exact stack's, the PSNR against
    each content's own reference averaged over the set with its min-max and n (:func:`vdbench.sets.spread`), the
    median videos per GPU-hour and joules per video."""
    from statistics import median

    from .sets import spread, spread_text

    by: dict[str, list[dict]] = {}
    for r in per_render:
        by.setdefault(r["_stack"], []).append(r)

    def med(values):
        values = [v for v in values if v is not None]
        return median(values) if values else None

    out = []
    for stack, rs in by.items():
        emulated = any(r["_emulated"] for r in rs)
        warm, rate, joules = (med(r[k] for r in rs) for k in ("_warm", "_rate", "_joules"))
        ref = all(r.get("_is_ref") for r in rs)
        q = spread(r["_psnr"] for r in rs if not r.get("_is_ref"))
        out.append({"stack": stack, "layout": rs[0]["layout"], "renders": str(len(rs)), "_warm": warm,
                    "_exact": rs[0]["_exact"], "_emulated": emulated,
                    "warm": EMULATED if emulated else (MISSING if warm is None else _ms(warm)),
                    "psnr": "ref" if ref else spread_text(q), "_psnr": q,
                    "per_gpu_h": EMULATED if emulated else (MISSING if rate is None else f"{rate:.3g}"),
                    "j_video": EMULATED if emulated else (MISSING if joules is None else f"{joules:.3g}")})
    base = next((r for r in out if r["_warm"] and r["_exact"] and not r["_emulated"]), None)
    for r in out:
        r["speedup"] = EMULATED if r["_emulated"] else (f"{base['_warm'] / r['_warm']:.2f}×" if base and r["_warm"]
                                                        else "")
    return out


def _grid(cols: list[tuple[str, str]], found: list[dict]) -> list[str]:
    grid = [[c for c, _ in cols]] + [[r[k] for _, k in cols] for r in found]
    widths = [max(len(r[i]) for r in grid) for i in range(len(cols))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in grid]


def contents_of(results, outputs) -> list[tuple[object, str, list]]:
    """The outputs grouped by what their frames are of (their records' content; the videos without a record, one
    group), in order: [(content, its description -- seed and prompt from the record --, its outputs)]."""
    from .report import records_of
    from .sets import describe

    groups: dict = {}
    for v, ident, rec in zip(outputs, identities(outputs, results), records_of(outputs, results)):
        settings = ((rec.config or {}).get("settings") or {}) if rec is not None else {}
        groups.setdefault(ident.content, (describe(settings) or "no record", []))[1].append(v)
    return [(k, d, vs) for k, (d, vs) in groups.items()]


def table(results, outputs, failed=(), logs=None, reference: str = "reference", gpus: int = 0,
          content: int | None = None) -> str:
    """The whole comparison as text: the table of the renders, the failed ones, the notes. ``failed``: (name,
    code) pairs, the log found in ``logs`` by name, or (name, code, log, backend) tuples; ``gpus``: the GPUs the
    batch had (the throughput note's N). Renders of several contents (a prompt and seed set) are shown one row per
    stack over the set (:func:`set_rows`), or, with ``content`` (1-based, in the outputs' order), that content's
    renders one row each."""
    groups = contents_of(results, outputs) if outputs else []
    lines = []
    if content is not None:
        if not 1 <= content <= len(groups):
            raise ValueError(f"--content {content}: the renders are of {len(groups)} content(s)")
        lines.append(f"content {content} of {len(groups)}: {groups[content - 1][1]}")
        outputs = groups[content - 1][2]
    found, notes = rows(results, outputs, reference) if outputs else ([], [])
    as_set = content is None and len(groups) > 1
    if as_set:
        shown = set_rows(found)
        cols = [("stack", "stack"), ("layout", "layout"), ("renders", "renders"),
                ("warm ms/step (median of the renders)", "warm"), ("speed-up", "speedup"),
                (f"PSNR vs {reference} over the set (min–max, n)", "psnr")]
    else:
        shown = found
        cols = [("stack", "backend"), ("layout", "layout"), ("warm ms/step (p20–p80, n)", "warm"),
                ("end-to-end (s)", "end_to_end"), ("one-time (s)", "one_time"), ("speed-up", "speedup"),
                ("break-even steps", "break_even")]
    if any(r.get("_rate") is not None or r.get("_emulated") for r in found):
        cols.append(("videos/GPU-h", "per_gpu_h"))
    if any(r.get("_joules") is not None for r in found):
        cols.append(("J/video", "j_video"))
    if not as_set:
        cols += [(f"PSNR vs {reference}", "psnr"), ("kernels that ran", "kernels")]
        if any(r["note"] for r in found):
            cols.append(("note", "note"))
    lines += _grid(cols, shown) if shown else ["nothing rendered"]
    for name, code, *more in failed:
        log = more[0] if more else (Path(logs) / f"{name}.log" if logs else None)
        lines.append(failure_line(name, code, log, more[1] if len(more) > 1 else None))
    if as_set:  # the notes of the stacks, not of each render
        keep = ("speed-up:", "break-even steps against", "not a speed figure")
        notes = [n for n in notes if not n.startswith(keep)]
        base = next((r["stack"] for r in shown if r["speedup"] == "1.00×" and r["_exact"]), None)
        whys: dict = {}
        for r in found:
            if r.get("_why") and r["_stack"] not in whys.setdefault(r["_why"], []):
                whys[r["_why"]].append(r["_stack"])
        notes[:0] = ([f"speed-up: against {base}, the batch's first exact stack"] if base else []) + [
            f"not a speed figure ({why}): {', '.join(names)}" for why, names in whys.items()]
        notes.insert(0, f"{len(groups)} contents (prompt, seed): each render against the reference render of its own "
                        "content; one content's renders: python -m vdbench.batch RESULTS --content N; " + "; ".join(
                            f"{i}: {d}" for i, (_, d, _) in enumerate(groups, 1)))
    rate = max((r["_rate"] for r in found if r.get("_rate") and r.get("_gpus") == 1), default=None)
    if gpus > 1 and rate:
        best = next(r for r in found if r.get("_rate") == rate)
        notes.append(f"on {gpus} GPUs, one one-GPU render each, side by side: {best['_stack']} makes {gpus} x "
                     f"{rate:.3g} = {gpus * rate:.3g} videos an hour (computed from its record, as videos/GPU-h)")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vdbench.batch", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("results", type=Path, help="the batch's results directory (its videos and timing.json)")
    p.add_argument("--outputs", nargs="*", default=[],
                   help="the batch's rendered videos, in its order (default: every video in RESULTS, by name)")
    p.add_argument("--failed", nargs="*", default=[], metavar="NAME:CODE",
                   help="backends whose render failed, with their exit code")
    p.add_argument("--logs", type=Path, default=None, help="directory of the renders' logs (<backend>.log)")
    p.add_argument("--reference", default="reference", help="the backend the PSNR column compares against")
    p.add_argument("--content", type=int, default=None, metavar="N",
                   help="of renders of several contents (a prompt and seed set), show the N-th content's, one row "
                        "each (default: one row per stack over the set)")
    p.add_argument("--gpus", type=int, default=0,
                   help="the GPUs the batch had: the videos an hour of one render per GPU (default: 0, not said)")
    args = p.parse_args(argv)
    failed = [tuple(f.rsplit(":", 1)) if ":" in f else (f, "?") for f in args.failed]
    outputs = args.outputs or [str(v) for v in sorted(Path(args.results).glob("*.mp4")) if not is_grid_name(v)]
    try:
        print(table(args.results, outputs, failed, args.logs, args.reference, args.gpus, args.content))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
