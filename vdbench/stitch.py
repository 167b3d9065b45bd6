"""Stitch the per-backend videos of a benchmark run into one labelled comparison grid (``stitch_comparison.py``).

    python stitch_comparison.py --input_dir outputs/wan/results --font_size 48   # -> results/comparison_grid.mp4
    python stitch_comparison.py --input_dir outputs/wan --output outputs/wan/compare.mp4
    python stitch_comparison.py --input_dir outputs/cog --output cmp.mp4 --pattern 'cogvideox-2b_*.mp4' \\
        --labels sdpa,sage,fa3 --layout 1x3
    python stitch_comparison.py --output grid.mp4 --labels sdpa,sagev1 a.mp4 b.mp4   # explicit files, in order
    python stitch_comparison.py --input_dir outputs/set/results --content 2      # one prompt and seed of a set

A thin command line over :func:`vdbench.grid.stitch_grid`. With ``--input_dir`` the matching files are taken
in name order; files named on the command line (what ``render_all_WAN.sh --stitch`` passes) are taken in the
order given. The grid goes to ``--output``, by default ``comparison_grid.mp4`` in the input directory (beside the
first video when files are named). Grids this tool made (recognised by the tag every grid carries) and the output
itself are never taken as cells; what was left out is said, with why. An existing output is replaced only when it
is a grid this tool made, other files only with ``--overwrite``. Cells are labelled with each render's identity as
its record says it (records.jsonl or timing.json beside the video: the record naming the video's path; the
backend or schedule with its options, then the parallel layout and any VAE mode other than default in parentheses,
such as ``sdpa (u2)``) unless ``--labels`` is given; a video no record names is labelled from its file name
(``wan_result_..._attn_<type>_<H>x<W>[_<layout>].mp4``, ``cogvideox-<model>_<type>[_<layout>].mp4``). Videos of
several contents (a batch over a prompt or seed set: each render's record says what its frames are of) make one grid
of them all, and the tool says so and lists the contents; ``--content N`` keeps the N-th content's videos. Bad input
(no matching file, an unreadable video, a single video) exits with status 2 and a one-line message naming what is
wrong.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import textwrap

from vdbench.helptext import DefaultsHelpFormatter
from vdbench.grid import grid_shape, stitch_grid
from vdbench.video import MADE_BY_GRID, VideoError, made_by

DEFAULT_OUTPUT = "comparison_grid.mp4"


def _parse_layout(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS such as 2x3, got {text!r}") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"rows and cols must be at least 1, got {text!r}")
    return rows, cols


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stitch_comparison.py", description="Stitch benchmark videos into a labelled comparison grid.",
        epilog="examples:\n" + "\n".join(__doc__.splitlines()[2:6]) + "\n\n" + textwrap.fill(
            "Grids this tool made and the output itself are never taken as cells (what was left out is said); an "
            "existing output is replaced only when it is such a grid. Labels come from each render's record: the "
            "backend or schedule, with the parallel layout of a torchrun render (sdpa (u2)); from the file name "
            "for a video without a record. Exit status 2 on bad input.", 100),
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="VIDEO",
                   help="videos to stitch, in this order (instead of --input_dir)")
    p.add_argument("--input_dir", "--input-dir", help="directory holding the per-backend videos")
    p.add_argument("--output", default=None,
                   help=f"grid video to write (default: INPUT_DIR/{DEFAULT_OUTPUT}, or beside the first VIDEO)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output that is not a grid this tool made")
    p.add_argument("--pattern", default="*.mp4", help="glob for the inputs inside input_dir")
    p.add_argument("--font_size", "--font-size", type=_positive_int, default=24, help="label size in pixels")
    p.add_argument("--fps", type=_positive_float, default=None,
                   help="output frame rate (default: the first input's)")
    p.add_argument("--labels", default=None,
                   help="comma-separated cell labels, one per input in name order (default: each render's record)")
    p.add_argument("--reference", default=None, metavar="LABEL",
                   help="add figures to each label: speedup of the warm steps (median of the steps after the "
                        "first, from timing.json next to the videos; 'emulated' for an emulation, flagged when "
                        "not a speed figure) and PSNR of the decoded video against this reference input's decoded "
                        "video (codec noise included), e.g. 'fav3_fp8 · 1.12× (n=49) · 26.4 dB'")
    p.add_argument("--layout", type=_parse_layout, default=None,
                   help="grid as ROWSxCOLS (default: as square as possible)")
    p.add_argument("--content", type=_positive_int, default=None, metavar="N",
                   help="of videos of several contents (a prompt or seed set), stitch the N-th content's alone, "
                        "counted in the inputs' order (default: every video)")
    return p


def find_inputs(input_dir: str, pattern: str, output: str) -> tuple[list[str], list[tuple[str, str]]]:
    """``(inputs, excluded)``: the matching files in name order, and the matching files left out with why -- the
    output itself and every grid this tool made (its tag), so re-running into the same directory never stitches a
    previous grid in as a cell. ``glob`` skips dot files, so a temporary file left by a killed run is never picked
    up either."""
    out_abs = os.path.abspath(output)
    inputs, excluded = [], []
    for path in sorted(glob.glob(os.path.join(glob.escape(input_dir), pattern))):
        if not os.path.isfile(path):
            continue
        if os.path.abspath(path) == out_abs:
            excluded.append((path, "the output of this run"))
        elif made_by(path) == MADE_BY_GRID:
            excluded.append((path, "a comparison grid this tool made"))
        else:
            inputs.append(path)
    return inputs, excluded


def _excluded_text(excluded: list[tuple[str, str]]) -> str:
    return "; ".join(f"{os.path.basename(p)} left out ({why})" for p, why in excluded)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.inputs) == bool(args.input_dir):
        parser.error("give either --input_dir DIR or the video files, not both" if args.inputs
                     else "give --input_dir DIR or the video files to stitch")

    def fail(message: str, hint: str = "") -> int:
        print(f"stitch_comparison: error: {message}", file=sys.stderr)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return 2

    if args.output is None:
        args.output = os.path.join(args.input_dir or os.path.dirname(os.path.abspath(args.inputs[0])),
                                   DEFAULT_OUTPUT)
    if os.path.exists(args.output) and not args.overwrite and made_by(args.output) != MADE_BY_GRID:
        return fail(f"{args.output} exists and is not a grid this tool made; not replacing it",
                    "choose another --output, or pass --overwrite to replace it")
    if args.inputs:
        inputs = list(args.inputs)
        if len(inputs) == 1:
            return fail(f"only one video given ({inputs[0]}); need at least two to compare")
    else:
        if not os.path.isdir(args.input_dir):
            return fail(f"input directory {args.input_dir} does not exist")
        inputs, excluded = find_inputs(args.input_dir, args.pattern, args.output)
        left_out = f"; {_excluded_text(excluded)}" if excluded else ""
        if not inputs:
            return fail(f"no files match {args.pattern!r} in {args.input_dir}{left_out}")
        if len(inputs) == 1:
            return fail(f"only one video to stitch in {args.input_dir}: {os.path.basename(inputs[0])} matches "
                        f"{args.pattern!r}{left_out}; need at least two to compare")
        for path, why in excluded:
            print(f"stitch_comparison: note: {os.path.basename(path)} left out ({why})", file=sys.stderr)
    from vdbench.report import refused

    bad = refused(inputs, args.input_dir)  # a file its record no longer vouches for: its figures are not its own
    for path in bad:
        print(f"stitch_comparison: {bad[path]}", file=sys.stderr)
    inputs = [p for p in inputs if str(p) not in bad]
    if bad and len(inputs) < 2:
        return fail(f"{len(inputs)} video(s) left to stitch after refusing {len(bad)}", next(iter(bad.values())))
    from vdbench.batch import contents_of

    groups = contents_of(args.input_dir, inputs)
    if args.content is not None:
        if args.content > len(groups):
            return fail(f"--content {args.content}: the videos are of {len(groups)} content(s)")
        _, desc, inputs = groups[args.content - 1]
        print(f"stitch_comparison: note: content {args.content} of {len(groups)}: {desc}", file=sys.stderr)
        if len(inputs) < 2:
            return fail(f"content {args.content} has one video ({os.path.basename(inputs[0])}); need at least two")
    elif len(groups) > 1:
        print(f"stitch_comparison: note: the {len(inputs)} videos are of {len(groups)} contents, all in this grid; "
              "--content N stitches one: " + "; ".join(f"{i}: {d}" for i, (_, d, _) in enumerate(groups, 1)),
              file=sys.stderr)
    if args.labels is not None:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(inputs):
            names = ", ".join(os.path.basename(p) for p in inputs)
            return fail(f"--labels gives {len(labels)} labels for {len(inputs)} videos: {names}")
    else:
        from vdbench.report import identities, shown_labels

        labels, common = shown_labels(identities(inputs))
        if common:
            print(f"stitch_comparison: note: every video: {common}", file=sys.stderr)
    if args.reference is not None:
        from vdbench.report import figure_labels

        warnings: list[str] = []
        try:
            labels = figure_labels(inputs, labels, args.reference,
                                   timing_dir=args.input_dir or os.path.dirname(os.path.abspath(inputs[0])),
                                   warnings=warnings)
        except (VideoError, ValueError) as exc:
            return fail(str(exc).splitlines()[0])
        for w in warnings:
            print(f"stitch_comparison: warning: {w}", file=sys.stderr)

    try:
        rows, cols = grid_shape(len(inputs), args.layout)
        out = stitch_grid(inputs, args.output, labels=labels, fps=args.fps, font_size=args.font_size,
                          layout=(rows, cols))
    except (VideoError, ValueError, FileNotFoundError) as exc:
        return fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    print(out)
    for k, (label, path) in enumerate(zip(labels, inputs)):
        r, c = divmod(k, cols)
        print(f"  [{r},{c}] {label}  <- {os.path.basename(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
