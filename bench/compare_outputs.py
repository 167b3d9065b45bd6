#!/usr/bin/env python3
"""Quality of each backend's render against the reference render, with the speed from timing.json.

    python bench/compare_outputs.py outputs/demo/results --reference reference -o quality.json

For each rendered backend: PSNR (from the MSE over all frames), mean SSIM, worst-frame PSNR, max/mean abs
difference against the reference backend's output, and the warm step (median of the steps after the first, with
its n; ``vdbench.timing``'s one definition, through ``vdbench.report.speed``) / decode time from timing.json.
Emulated backends get no speed ("emulated"); timings that are not speed figures (CPU, n < 3) are flagged.
Frames come from the raw ``.npy`` files that ``--save_frames`` writes when present (codec noise excluded) and
from the decoded videos otherwise; the ``source`` column says which, since codec noise can hide or fake a
difference of a few dB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vdbench.measure.quality import frame_quality
from vdbench.report import collect, load_frames, speed  # (one definition, shared with the report)
from vdbench.helptext import DefaultsHelpFormatter


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("results", type=Path, help="a results directory (videos, .npy frames, timing.json)")
    p.add_argument("--reference", default="reference",
                   help="label of the reference render in RESULTS, or a path to a render (.npy/.mp4) elsewhere "
                        "(e.g. the eager render when RESULTS holds compiled ones)")
    p.add_argument("--reference_dir", type=Path, default=None,
                   help="take the render labelled --reference from this results directory instead (e.g. the eager "
                        "renders' folder when RESULTS holds compiled ones)")
    p.add_argument("-o", "--output", type=Path, help="write the rows as JSON here")
    p.add_argument("--device", default=None, help="run the SSIM windows here (e.g. cuda): much faster on 480p clips")
    args = p.parse_args(argv)
    sources = collect(args.results)
    if args.reference_dir is not None:
        others = collect(args.reference_dir)
        if args.reference not in others:
            print(f"error: no render labelled {args.reference!r} in {args.reference_dir} "
                  f"(found: {', '.join(others) or 'none'})", file=sys.stderr)
            return 2
        sources = {"reference-file": others[args.reference], **sources}
        args.reference = "reference-file"
    if args.reference not in sources and Path(args.reference).suffix in (".npy", ".mp4"):
        if not Path(args.reference).is_file():
            print(f"error: reference file {args.reference} does not exist", file=sys.stderr)
            return 2
        sources = {"reference-file": Path(args.reference), **sources}
        args.reference = "reference-file"
    args.reference = _label(args.reference, sources)
    if args.reference not in sources:
        print(f"error: no render labelled {args.reference!r} in {args.results} (found: {', '.join(sources) or 'none'})",
              file=sys.stderr)
        return 2
    ref, ref_src = load_frames(sources[args.reference])
    sp = speed(args.results)
    base = (sp.get("default") or {}).get("warm_step_median")
    rows = []
    for label, path in sources.items():
        frames, src = load_frames(path)
        if src != ref_src:
            src = f"{src} vs {ref_src}"
        q = quality_columns(frames, ref, args.device)
        s = sp.get(label, {})
        # a step cache makes steps of two kinds (computed, reused): the median is one kind's time, the mean the
        # render's (its denoising over its steps)
        cached = bool(s.get("cache"))
        st = s.get("step_mean") if cached else s.get("warm_step_median")
        rows.append({"backend": label, "source": src, **q,
                     "warm_step_ms": st * 1e3 if st else None, "warm_is": "mean of all steps" if cached else "median",
                     "warm_step_n": s.get("warm_step_n"),
                     "first_step_ms": s["first_step"] * 1e3 if s.get("first_step") else None,
                     "speedup_vs_default": (base / st) if (base and st) else None,
                     "emulated": s.get("emulated"), "speed_figure": s.get("speed_figure"),
                     "why_not_speed": s.get("why_not_speed"),
                     "vae_decode_s": s.get("vae_decode_time"), "peak_memory_gib": (s["peak_memory_bytes"] / 2**30)
                     if s.get("peak_memory_bytes") else None, "kernels": s.get("calls_by_kernel"),
                     "note": None if q else f"shape {frames.shape} differs from the reference {ref.shape}"})
    fmt = lambda v, f: "-" if v is None else ("inf" if v == float("inf") else format(v, f))  # noqa: E731
    print(f"{'backend':16} {'warm ms':>9} {'n':>3} {'speedup':>8} {'PSNR dB':>8} {'SSIM':>7} {'worst dB':>8} "
          f"{'decode s':>8}  source")
    for r in rows:
        emu = r["emulated"]
        mean = "" if r["warm_is"] == "median" else "*"
        print(f"{r['backend']:16} {'emulated' if emu else fmt(r['warm_step_ms'], '.1f') + mean:>9} "
              f"{fmt(r['warm_step_n'], 'd'):>3} {'emulated' if emu else fmt(r['speedup_vs_default'], '.2f'):>8} "
              f"{fmt(r['psnr_db'], '.2f'):>8} {fmt(r['ssim'], '.4f'):>7} {fmt(r['worst_frame_psnr_db'], '.2f'):>8} "
              f"{fmt(r['vae_decode_s'], '.2f'):>8}  {r['source']}")
    if any(r["warm_is"] != "median" for r in rows):
        print("* a step cache's render: the mean of all its steps (the denoising over the steps), not the median")
    for why, names in _not_speed(rows).items():
        print(f"warning: not a speed figure ({why}): {', '.join(names)}")
    if args.output:
        args.output.write_text(json.dumps({"reference": args.reference, "rows": rows}, indent=1,
                                          default=lambda o: None if o == float("inf") else str(o)))
        from vdbench.measure.record import write_beside

        write_beside(args.output, {"reference": args.reference, "rows": rows})  # the same rows as records
    return 0


def _label(name: str, sources: dict) -> str:
    """The render ``name`` stands for: itself where a render has that label, else the one render whose stack is ``name``
    (``fav3+u2`` for ``fav3+u2 [id-337af5e3]``: the settings' tag aside), else the render whose stack's attention
    part is ``name`` (``reference`` for ``reference+vae=fast``) -- of several, the one with the fewest options (the
    plain ``fav3+vae=fast`` beside ``fav3+vae=fast+fbc:threshold=0.2``: a stack's quality is read against its
    kernel alone); ``name`` unchanged where none matches or the fewest options tie."""
    if name in sources:
        return name
    tagged = [label for label in sources if label.split(" [", 1)[0] == name]  # the stack, its settings' tag aside
    if len(tagged) == 1:
        return tagged[0]
    from vdbench.cache import KINDS
    from vdbench.measure.record import split_stack

    def parsed(label):
        try:
            return split_stack(label, cache_kinds=KINDS)
        except ValueError:
            return None, []

    found = sorted((len(opts), label) for label, (head, opts) in ((lb, parsed(lb)) for lb in sources) if head == name)
    if not found or (len(found) > 1 and found[0][0] == found[1][0]):
        return name
    return found[0][1]


def quality_columns(frames, ref, device=None) -> dict:
    """This tool's quality columns of one render against the reference: the shared frame-quality dict under the
    names its JSON has always used (all None when the shapes differ)."""
    q = frame_quality(frames, ref, device=device) if frames.shape == ref.shape else None
    return {"psnr_db": q["psnr"] if q else None, "ssim": q["ssim"] if q else None,
            "worst_frame_psnr_db": q["psnr_min"] if q else None,
            "max_abs": q["max_abs"] if q else None, "mean_abs": q["mean_abs"] if q else None}


def _not_speed(rows: list[dict]) -> dict[str, list[str]]:
    """Backends whose warm step is not a speed figure (CPU, n < 3), grouped by the reason, emulations left out
    (they print 'emulated' instead of a time)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r["speed_figure"] is False and not r["emulated"] and r["warm_step_ms"] is not None:
            out.setdefault(r["why_not_speed"], []).append(r["backend"])
    return out


if __name__ == "__main__":
    sys.exit(main())
