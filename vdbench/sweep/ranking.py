"""The sweep's ranking: each render's row (warm step with its spread, speed-up, one-time cost, quality against the
exact reference or the exact-kernel render standing in for it), the Pareto set, the verdict line and the files it
writes (sweep.csv, sweep.json, report.html)."""

from __future__ import annotations

import csv
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..measure.record import Record
from ..report import NEGATIVE_ONE_TIME_NOTE, break_even, break_even_text, load_frames, one_time_cell, pareto_front
from .candidates import BASELINE, REFERENCE, Candidate

def quality_baseline(cands: list[Candidate], warm_ms: dict[str, Optional[float]],
                     baseline: str = BASELINE) -> Optional[str]:
    """The render the PSNR / SSIM column reads against: the exact ``reference`` where it was rendered; else the
    fastest rendered exact-kernel render (:attr:`Candidate.exact`, by warm step), ``default`` only when no other
    is (then no second exact render says how far two exact kernels differ); None where none is. ``warm_ms``: the
    rendered ones' warm step (None where a render gave none)."""
    ref = next((c.name for c in cands if c.is_reference and c.name in warm_ms), None)
    if ref is not None:
        return ref
    exact = [c.name for c in cands if c.exact and c.name in warm_ms]
    others = [n for n in exact if n != baseline]
    pool = others or exact
    return min(pool, key=lambda n: (warm_ms[n] is None, warm_ms[n] or 0.0)) if pool else None



@dataclass
class Coverage:
    """What the verdict rests on: the candidates the sweep set out to render (``default`` and the ``reference``
    aside), those rendered, those skipped for the budget and those whose render failed, and the kernel bench's
    ranking (:func:`predicted_ranking`) that stands in, provisionally, for what was not rendered."""

    planned: list[str]
    rendered: list[str]
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    predicted: list[tuple[str, float]] = field(default_factory=list)
    predicted_is: str = "predicted step vs default's"
    no_bench: str = ""  # why there was no kernel bench to predict from ("" where there was one)

    @property
    def complete(self) -> bool:
        return len(self.rendered) >= len(self.planned)

    def text(self) -> str:
        why = [f"{len(self.skipped)} skipped for the budget"] * bool(self.skipped) + \
              [f"{len(self.failed)} failed"] * bool(self.failed)
        return f"{len(self.rendered)} of {len(self.planned)} candidates rendered" + (f" ({', '.join(why)})"
                                                                                     if why else "")

    def of(self, keep) -> "Coverage":
        """The same, for the candidates ``keep(name)`` selects (one GPU count's)."""
        pick = lambda names: [n for n in names if keep(n)]  # noqa: E731
        return Coverage(pick(self.planned), pick(self.rendered), pick(self.skipped), pick(self.failed),
                        [p for p in self.predicted if keep(p[0])], self.predicted_is, self.no_bench)

    def provisional(self) -> str:
        if not self.predicted:
            if self.no_bench:
                return f"no kernel bench to rank them ({self.no_bench})"
            return "the kernel bench predicts none of them (kernels/attention.csv)"
        done = set(self.rendered)
        return (f"provisional ranking from the kernel bench ({self.predicted_is}): " + ", ".join(
            f"{n} {x:.2f}x" + ("" if n in done else " (not rendered)") for n, x in self.predicted))



def video_of(rec: Record) -> Optional[Path]:
    out = rec.data.get("output")
    return Path(out) if out and Path(out).exists() else None


def frames_of(rec: Record) -> Optional[Path]:
    """The frames a render's quality is read from: its raw uint8 frames (``--save_frames``' ``.npy`` beside the
    video) where they are there, else its video; None where neither is.

    Why the raw frames: each video is encoded on its own, so the codec's noise differs between two videos of
    nearly equal frames -- on Wan 1.3B 480p it holds every bf16 backend near 33 dB against the reference whose raw
    frames they match to 43-44 dB, hiding the differences the sweep ranks on."""
    video = video_of(rec)
    if video is None:
        return None
    raw = video.with_suffix(".npy")
    return raw if raw.is_file() else video


#: what a quality figure was computed from (the ``quality_from`` column)
RAW, CODEC = "raw frames", "decoded videos (codec noise: PSNR capped near 33 dB at 480p)"


def quality_of(frames_path: Optional[Path], ref, device=None) -> Optional[dict]:
    """{"psnr", "ssim", "from"} of the render whose frames are at ``frames_path`` (:func:`frames_of`) against the
    reference's (``ref``: (frames, path)), or None where either is missing or their shapes differ; ``from`` is
    :data:`RAW` only when both sides are raw frames. ``device``: where the SSIM windows run (on the H200 machine's
    CPU they took ~27 s per 480p x 81 render, half as long as the render: time the sweep's budget spends)."""
    if frames_path is None or ref is None:
        return None
    from ..measure.quality import frame_quality

    ref_frames, ref_path = ref
    frames, _ = load_frames(frames_path)
    if frames.shape != ref_frames.shape:
        return None
    q = frame_quality(frames, ref_frames, device=device)
    raw = frames_path.suffix == ".npy" and ref_path.suffix == ".npy"
    return {"psnr": q["psnr"], "ssim": q["ssim"], "from": RAW if raw else CODEC}


def stored_quality(folder: Path) -> Optional[dict]:
    """The quality a render's folder keeps (``quality.json``, written when it was rendered): what ranks it where its
    video is not at hand (a sweep resumed on another machine carries the reference's video only)."""
    try:
        q = json.loads((folder / "quality.json").read_text())
    except (OSError, ValueError):
        return None
    return q if isinstance(q, dict) and "psnr" in q else None


def warm_of(rec: Record) -> tuple[Optional[float], str]:
    """(warm ms/step, which statistic): the median of the steps after the first; with a step cache their mean (its
    steps are of two kinds, computed and reused: the median would be one kind's time, the mean is the render's)."""
    step = rec.figures.get("step_ms") or {}
    stat = "mean" if rec.config.get("cache") else "median"
    return step.get(stat), stat


def row_of(cand: Candidate, rec: Record, ref, stored: Optional[dict] = None, device=None, *,
           quality_vs: str = REFERENCE) -> dict:
    """A candidate's row from its render's record (the last repetition) and its quality against the quality baseline
    (``quality_vs``: the exact reference, or the render standing in for it, :func:`quality_baseline`): ``stored``
    (as kept beside it when it was compared), else from its frames and the baseline's (``ref``: (frames, path),
    :func:`quality_of`; SSIM on ``device``); the baseline's own row is exact by definition (``ref`` holds its
    frames: not read twice)."""
    from ..batch import throughput
    from ..report import memory_text, rank_max

    step = rec.figures.get("step_ms") or {}
    peak = rank_max(rec.data, "peak_memory_bytes") or rec.figures.get("peak_memory_bytes")
    reserved = rank_max(rec.data, "peak_reserved_bytes")
    emulated = bool((rec.config.get("backend") or {}).get("emulated"))
    rate, joules = throughput({"end_to_end_s": rec.figures.get("end_to_end_s"), "emulated": emulated,
                               "step_energy_j": rec.figures.get("step_energy_j"),
                               "step_times": rec.data.get("step_times"), "parallel": rec.data.get("parallel")})
    warm, warm_is = warm_of(rec)
    video = video_of(rec)
    row = {"stack": cand.name, "attention": cand.attention, "gpus": cand.nproc, "why": cand.why,
           "is_reference": cand.is_reference,
           "warm_ms": warm, "warm_is": warm_is,
           "p20_ms": step.get("p20"), "p80_ms": step.get("p80"),
           "n": step.get("n"), "first_step_ms": step.get("first"),
           "end_to_end_s": rec.figures.get("end_to_end_s"), "one_time_s": rec.figures.get("one_time_s"),
           "peak_gib": None if peak is None else peak / 2**30,
           "peak_reserved_gib": None if reserved is None else reserved / 2**30, "memory": memory_text(rec.data),
           "videos_per_gpu_h": rate, "j_per_video": joules,
           "speed_figure": rec.verdict.get("speed_figure"), "why_not_speed": rec.verdict.get("why_not"),
           "emulated": bool((rec.config.get("backend") or {}).get("emulated")),
           # a warm step's joules over every card (vdbench.power), as a speed: none for an emulation
           "step_energy_j": (None if (rec.config.get("backend") or {}).get("emulated")
                             else rec.figures.get("step_energy_j")),
           "kernels": ", ".join(f"{k}×{v}" for k, v in
                                ((rec.data.get("attention") or {}).get("calls_by_kernel") or {}).items()),
           "psnr_db": None, "psnr_min": None, "psnr_max": None, "psnr_n": None, "ssim": None, "quality_from": None,
           "quality_vs": quality_vs, "video": str(video or "")}
    if cand.name == quality_vs:
        q = {"psnr": math.inf, "ssim": 1.0, "from": RAW if ref is not None and ref[1].suffix == ".npy" else CODEC} \
            if video is not None and ref is not None else None
    else:
        q = stored or quality_of(frames_of(rec), ref, device)
    if q is not None:
        # a quality kept before the raw frames were read says nothing of its source: the videos'
        row["psnr_db"], row["ssim"], row["quality_from"] = q["psnr"], q["ssim"], q.get("from", CODEC)
        # over a prompt and seed set: the mean above, its spread here (one content: n 1)
        row["psnr_min"], row["psnr_max"], row["psnr_n"] = q.get("min", q["psnr"]), q.get("max", q["psnr"]), q.get("n", 1)
    return row


def rank(rows: list[dict], baseline: str = BASELINE) -> list[dict]:
    """Rows sorted by warm step (emulations and rows without a step last), with the speed-up against
    ``baseline``, the break-even steps against it (:func:`vdbench.report.break_even`: one-time cost against the
    gain per step) and the Pareto mark on (warm step, PSNR vs reference)."""
    base = next((r for r in rows if r["stack"] == baseline and r["warm_ms"]), None)
    for r in rows:
        r["speedup"] = (base["warm_ms"] / r["warm_ms"]) if base and r["warm_ms"] and not r["emulated"] else None
        # from how many steps a render of this stack beats one of the baseline: its one-time cost against its gain
        r["break_even"] = None if base is None or r is base or r["emulated"] or not r["warm_ms"] else break_even_text(
            break_even(r.get("one_time_s"), r["warm_ms"] / 1e3, base.get("one_time_s"), base["warm_ms"] / 1e3))
    def is_base(r):  # the quality baseline's own row: exact by definition
        return r["stack"] == r.get("quality_vs", REFERENCE)

    pts = [(r["warm_ms"], math.inf if r["psnr_db"] is None and is_base(r) else r["psnr_db"],
            r["stack"]) for r in rows if r["warm_ms"] and not r["emulated"] and
           (r["psnr_db"] is not None or is_base(r))]
    front = {label for _, _, label in pareto_front(pts)}
    for r in rows:
        r["pareto"] = r["stack"] in front
    return sorted(rows, key=lambda r: (r["emulated"] or not r["warm_ms"], r["warm_ms"] or math.inf))


def verdict(rows: list[dict], *, device: str, model: str, tolerance_db: float, quality_vs: str = REFERENCE,
            coverage: Optional[Coverage] = None, gpus: Optional[int] = None) -> str:
    """One line: the fastest within ``tolerance_db`` of exact, and the fastest overall with its PSNR against
    ``quality_vs`` (the exact reference, or the exact-kernel render standing in for it: the line says which).
    ``coverage``: what was planned and rendered; where fewer candidates were rendered than planned the line says how
    many of how many, speaks of those rendered only, and ends with the kernel bench's ranking as provisional -- a
    verdict never claims to compare renders that were not made. ``gpus``: the verdict of that GPU count's renders
    alone (``default`` and the quality baseline still read from the whole table)."""
    timed = [r for r in rows if r["warm_ms"] and not r["emulated"] and not r.get("is_reference")
             and (gpus is None or r.get("gpus", 1) == gpus)]
    text = f"on this {device} for {model}: "
    partial = coverage is not None and not coverage.complete
    if partial:
        text += coverage.text() + ": "
    if partial and not coverage.rendered:
        text += "no measured verdict; " + coverage.provisional()
        return text + _not_speed(timed)
    if not timed:
        return text + "no render gave a warm step (see the rows' notes)" + (
            "; " + coverage.provisional() if partial else "")
    exact_db = _exact_db(rows, quality_vs=quality_vs)
    near = [] if exact_db is None else [r for r in timed
                                        if r["psnr_db"] is not None and r["psnr_db"] >= exact_db - tolerance_db]
    best = min(near, key=lambda r: r["warm_ms"]) if near else None
    fastest = min(timed, key=lambda r: r["warm_ms"])
    among = f"of the {len(coverage.rendered)} rendered, " if partial else ""
    if best is not None:
        scale = "identical to exact" if math.isinf(exact_db) else f"exact attention's {exact_db:.1f} dB"
        text += (f"{among}{best['stack']} is fastest within {tolerance_db:g} dB of {scale} ({best['warm_ms']:.4g} "
                 f"ms/step{_x(best)}, {_db(best)})")
    elif all(r["psnr_db"] is None for r in rows):
        text += f"{among}no quality figure (no exact render's frames to compare with)"
    elif exact_db is None:
        text += (f"{among}no render beside {quality_vs} computes exact attention, so 'within {tolerance_db:g} dB "
                 f"of exact' can't be read")
    else:
        text += f"{among}no render reached exact attention's quality"
    if fastest is not best:
        text += (f"; {fastest['stack']} is fastest overall ({fastest['warm_ms']:.4g} ms/step{_x(fastest)}, "
                 f"{_db(fastest)})")
    if quality_vs != REFERENCE:
        text += (f"; quality against {quality_vs}, the fastest exact-kernel render: the exact {REFERENCE} was not "
                 f"rendered")
    if partial:
        text += "; " + coverage.provisional()
    return text + _not_speed(timed)


def throughput_text(rows: list[dict], gpus: int, *, tolerance_db: float, quality_vs: str = REFERENCE) -> str:
    """For ``gpus`` GPUs, finishing more videos against finishing one sooner: the one-GPU render with the most
    videos per GPU-hour, run ``gpus`` times side by side, and the ``gpus``-GPU layout with the most, each within
    ``tolerance_db`` of exact quality where that is known, with its joules per video -- computed from the renders'
    records (:func:`vdbench.batch.throughput`: end to end, warm-step energy x steps); "" where none has a figure."""
    exact_db = _exact_db(rows, quality_vs=quality_vs)

    def ok(r):
        return (r.get("videos_per_gpu_h") and not r["emulated"] and not r.get("is_reference")
                and (exact_db is None or r["psnr_db"] is None or r["psnr_db"] >= exact_db - tolerance_db))

    def said(r, what):
        rate, e2e, j = r["videos_per_gpu_h"], r.get("end_to_end_s"), r.get("j_per_video")
        return (f"{what} {r['stack']}: {rate:.3g} videos/GPU-h, {gpus * rate:.3g} an hour on {gpus}"
                + (f", a video every {e2e:.0f} s" + (" on each GPU" if r.get("gpus", 1) == 1 and gpus > 1 else "")
                   if e2e else "") + (f", {j:.3g} J/video" if j else ""))

    rate = lambda r: r["videos_per_gpu_h"]  # noqa: E731
    one = max((r for r in rows if r.get("gpus", 1) == 1 and ok(r)), key=rate, default=None)
    lay = max((r for r in rows if r.get("gpus", 1) == gpus > 1 and ok(r)), key=rate, default=None)
    parts = ([said(one, f"{gpus} one-GPU renders side by side," if gpus > 1 else "one render,")] if one else []) + (
        [said(lay, f"the best {gpus}-GPU layout,")] if lay else [])
    if not parts:
        return ""
    return (f"throughput on {gpus} GPU{'s' if gpus > 1 else ''}: " + "; ".join(parts)
            + " (computed from each render's record: 3600 / (end-to-end s x its GPUs); J = a warm step's energy x "
              "its steps)" + _not_speed([r for r in (one, lay) if r is not None]))


def _not_speed(timed: list[dict]) -> str:
    if all(r["speed_figure"] for r in timed):
        return ""
    return f" -- NOT speed figures ({next((r['why_not_speed'] for r in timed if not r['speed_figure']), '')})"


def _exact_db(rows, baseline: str = BASELINE, quality_vs: str = REFERENCE) -> Optional[float]:
    """The quality 'within N dB of exact' reads on: the PSNR of the pipeline's own attention against the quality
    baseline (exact math in the model's dtype: what no faster backend needs to beat) -- against the fp32
    ``reference``, or against the exact-kernel render standing in for it (then: how far two exact kernels differ) --
    else the best PSNR of the batch beside the baseline's own; None where the baseline is ``default`` itself (no
    second exact render says how far exact kernels differ)."""
    if quality_vs == baseline:
        return None
    base = next((r["psnr_db"] for r in rows if r["stack"] == baseline and r["psnr_db"] is not None), None)
    if base is not None:
        return base
    got = [r["psnr_db"] for r in rows if r["psnr_db"] is not None and not r.get("is_reference")
           and r["stack"] != quality_vs]
    return max(got) if got else math.inf


def _x(r) -> str:
    return f", {r['speedup']:.2f}x default" if r.get("speedup") else ""


def _db(r) -> str:
    if r["psnr_db"] is None:
        return "PSNR n/a"
    codec = " (decoded videos: codec-capped)" if r.get("quality_from") == CODEC else ""
    vs = r.get("quality_vs", REFERENCE)
    if r["stack"] == vs:
        return "the quality baseline"
    return f"{r['psnr_db']:.1f} dB vs {'the reference' if vs == REFERENCE else vs}{codec}"


COLUMNS = ["stack", "gpus", "warm_ms", "step_energy_j", "warm_is", "p20_ms", "p80_ms", "n", "speedup",
           "first_step_ms", "end_to_end_s", "one_time_s", "break_even", "psnr_db", "psnr_min", "psnr_max", "psnr_n",
           "ssim", "quality_from", "quality_vs", "peak_gib", "peak_reserved_gib", "memory", "videos_per_gpu_h",
           "j_per_video", "pareto", "speed_figure", "why_not_speed", "emulated", "kernels", "why", "attention", "video"]
#: The report's table: the CSV's columns up to the kernels that ran.
HTML_COLUMNS = COLUMNS[:COLUMNS.index("kernels") + 1]


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def _shown(row: dict, col: str) -> str:
    """A table cell: the one-time cost as :func:`vdbench.report.one_time_shown` shows it (a negative within the
    warm steps' noise is 0.00; the CSV keeps the measured value), every other column as :func:`_cell`."""
    if col == "one_time_s":
        lo, hi = row.get("p20_ms"), row.get("p80_ms")
        return one_time_cell(row.get(col), (hi - lo) / 1e3 if lo is not None and hi is not None else None, "—")
    return _cell(row.get(col))


def _negative_one_time(rows) -> bool:
    return any(_shown(r, "one_time_s").endswith("*") for r in rows)


def _notes_html(rows) -> str:
    return f"<p>{html.escape(NEGATIVE_ONE_TIME_NOTE)}</p>" if _negative_one_time(rows) else ""


def _header(col: str, quality_vs: str) -> str:
    """A column's title: the quality columns name what they are against where it is not the exact reference."""
    return f"{col} vs {quality_vs}" if col in ("psnr_db", "ssim") and quality_vs != REFERENCE else col


def write_outputs(out: Path, rows: list[dict], meta: dict) -> None:
    """sweep.csv, sweep.json and report.html of the ranked rows and the run's ``meta`` (its verdict, what was left
    out and why, the throughput and memory lines)."""
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "sweep.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    vs = meta.get("quality_vs") or REFERENCE
    head = "".join(f"<th>{html.escape(_header(c, vs))}</th>" for c in HTML_COLUMNS)
    body = "".join("<tr" + (' class="pareto"' if r["pareto"] else "") + ">" +
                   "".join(f"<td>{html.escape(_shown(r, c))}</td>" for c in HTML_COLUMNS) + "</tr>" for r in rows)
    left = "".join(f"<li>{html.escape(x['backend'])}: {html.escape(x['why'])}</li>" for x in meta["left_out"])
    (out / "report.html").write_text(
        "<!doctype html><meta charset=utf-8><title>vdbench sweep</title><style>body{font:14px sans-serif}"
        "td,th{border:1px solid #ccc;padding:2px 6px}table{border-collapse:collapse}.pareto{background:#e8f5e9}"
        f"</style><h1>Which backend: {html.escape(meta['model'])}</h1><p><b>{html.escape(meta['verdict'])}</b></p>"
        + "".join(f"<p>{html.escape(meta[k])}</p>" for k in ("throughput", "memory") if meta.get(k)) +
        f"<p>{html.escape(meta['device'])}; {meta['height']}x{meta['width']}, {meta['num_frames']} frames, "
        f"{meta['steps']} steps; warm = median of the steps after the first (p20-p80, n), their mean for a stack with a "
        f"step cache (its steps are of two kinds: warm_is says which); green rows: the Pareto "
        f"set on (warm step, PSNR vs {html.escape(vs)}). Command: <code>{html.escape(meta['command'])}</code>; commit "
        f"{html.escape(str(meta['commit']))}.</p><table><tr>{head}</tr>{body}</table>{_notes_html(rows)}"
        f"<h2>Not rendered</h2><ul>{left}</ul><p>Kernel bench on the captures: kernels/attention.csv</p>")



def print_table(rows, quality_vs: str = REFERENCE):
    cols = ["stack", "gpus", "warm_ms", "step_energy_j", "n", "speedup", "one_time_s", "break_even", "psnr_db",
            "pareto"]
    if any((r.get("psnr_n") or 1) > 1 for r in rows):  # a prompt and seed set: the PSNR's spread over it
        cols[cols.index("psnr_db") + 1:cols.index("psnr_db") + 1] = ["psnr_min", "psnr_max", "psnr_n"]
    print("  ".join(f"{_header(c, quality_vs):>12s}" for c in cols))
    for r in rows:
        print("  ".join(f"{_shown(r, c):>12s}" for c in cols))
    if _negative_one_time(rows):
        print(f"note: {NEGATIVE_ONE_TIME_NOTE}")

