"""The report's figures as PNG data URIs: speed against quality with its Pareto front, the warm step per backend,
the time per step, the PSNR per frame (:func:`run_plots`), and a video's first frame (:func:`poster_uri`)."""

from __future__ import annotations

import base64
import io
import math

from vdbench.video import iter_frames


def _png_uri(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The (time, psnr, label) points that no other point beats on both axes (faster *and* at least as
    accurate), sorted by time: the backends worth considering at each speed."""
    front, best = [], -math.inf
    for t, q, label in sorted(points, key=lambda p: (p[0], -p[1])):
        if q > best:
            front.append((t, q, label))
            best = q
    return front


def run_plots(summary: dict) -> list[tuple[str, str]]:
    """(caption, data URI) for each plot this run's data supports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    rows = summary["rows"]
    not_speed = any(r.get("speed_figure") is False and r.get("warm_step_ms") is not None for r in rows)
    flag = " (NOT a speed figure: see the notes)" if not_speed else ""
    timed = [r for r in rows if r.get("warm_step_ms") is not None]
    pts = [(r["warm_step_ms"], r["psnr_db"], r["backend"]) for r in timed if r["psnr_db"] is not None]
    if pts:
        finite = [q for _, q, _ in pts if math.isfinite(q)]
        cap = (max(finite) + 5.0) if finite else 60.0  # an identical render has infinite PSNR: draw it on top
        pts = [(t, q if math.isfinite(q) else cap, lab) for t, q, lab in pts]
        by = {r["backend"]: r for r in timed}
        err = [[t - by[lab]["warm_step_p20_ms"] for t, _, lab in pts], [by[lab]["warm_step_p80_ms"] - t for t, _, lab in pts]]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], xerr=err, fmt="o", ms=7, color="tab:blue", capsize=3,
                    zorder=3, label="warm step: median, p20–p80")
        for t, q, lab in pts:
            work = by[lab].get("work")
            ax.annotate(f"{lab} (n={by[lab]['warm_step_n']}" + (f", work {work:.2f})" if work is not None and work < 1
                                                                 else ")"), (t, q), textcoords="offset points",
                        xytext=(5, 5), fontsize=9)
        front = pareto_front(pts)
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:red", zorder=2,
                label="Pareto front (faster and at least as accurate)")
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=120, facecolors="none", edgecolors="tab:red")
        if not finite or any(q == cap for _, q, _ in pts):
            ax.axhline(cap, color="grey", lw=0.5)
            ax.text(ax.get_xlim()[0], cap, " identical to reference (PSNR inf)", va="bottom", fontsize=8)
        ax.set_xlabel("warm step (ms): median of the steps after the first")
        ax.set_ylabel(f"PSNR vs {summary['reference']} (dB)")
        ax.set_title("speed vs quality" + flag)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        out.append(("Speed vs quality: lower left is fast, up is accurate; the dashed line is the Pareto front; "
                    "horizontal bars span p20–p80 of the warm steps; 'work' is the fraction of self-attention block "
                    "pairs a sparse pattern computed. Emulated backends carry no speed and are not drawn.",
                    _png_uri(fig)))
    if timed:
        fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(timed)))
        ys = list(range(len(timed)))
        med = [r["warm_step_ms"] for r in timed]
        ax.barh(ys, med, color=["tab:gray" if r.get("speed_figure") is False else "tab:blue" for r in timed],
                xerr=[[m - r["warm_step_p20_ms"] for m, r in zip(med, timed)],
                      [r["warm_step_p80_ms"] - m for m, r in zip(med, timed)]], capsize=4, alpha=0.8)
        ax.plot([r["warm_step_min_ms"] for r in timed], ys, "|", color="k", ms=10, label="min / max")
        ax.plot([r["warm_step_max_ms"] for r in timed], ys, "|", color="k", ms=10)
        reps = [(m, y) for r, y in zip(timed, ys) if (r.get("repetitions") or 0) > 1 for m in r["rep_warm_medians_ms"]]
        if reps:
            ax.plot([m for m, _ in reps], [y for _, y in reps], "o", color="tab:orange", ms=4,
                    label="each repetition's warm median")
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{r['backend']} (n={r['warm_step_n']})" for r in timed], fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("warm step (ms): median of the steps after the first; error bar p20–p80")
        ax.set_title("time per warm step" + flag)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
        out.append(("Warm step per backend: bar = median of the steps after the first (all repetitions pooled), "
                    "error bar = p20–p80, ticks = min and max, dots = each repetition's warm median; grey bars are "
                    "not speed figures (CPU, or fewer than 3 warm steps).", _png_uri(fig)))
    steps = [(r["backend"], r["step_times"]) for r in rows if r.get("step_times")]
    if steps:
        fig, ax = plt.subplots(figsize=(7, 4))
        for lab, st in steps:
            ax.plot(range(1, len(st) + 1), [t * 1e3 for t in st], marker="o", label=lab)
        ax.set_xlabel("denoising step")
        ax.set_ylabel("time (ms)")
        ax.set_title("time per step (median over the repetitions of the last run)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out.append(("Per-step time: the first step includes one-off initialisation (reported apart as the first "
                    "step); emulated backends are not drawn.", _png_uri(fig)))
    frames = [(r["backend"], r["psnr_per_frame"]) for r in rows
              if r.get("psnr_per_frame") and all(math.isfinite(v) for v in r["psnr_per_frame"])]
    if frames:
        fig, ax = plt.subplots(figsize=(7, 4))
        for lab, pf in frames:
            ax.plot(range(len(pf)), pf, marker=".", label=lab)
        ax.set_xlabel("frame")
        ax.set_ylabel("PSNR (dB)")
        ax.set_title(f"per-frame PSNR vs {summary['reference']}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out.append(("Per-frame PSNR: a downward drift means the error grows over time.", _png_uri(fig)))
    return out


def poster_uri(video) -> str | None:
    from PIL import Image

    gen = iter_frames(video)
    try:
        frame = next(gen)
    finally:
        gen.close()
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
