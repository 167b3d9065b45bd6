"""``python -m vdbench.report``'s command line: summarize each run dir, write summary.csv and report.html."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from vdbench.helptext import DefaultsHelpFormatter

from .summary import summarize
from .write import write_csv, write_html


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vdbench.report", formatter_class=DefaultsHelpFormatter,
                                description=importlib.import_module(__package__).__doc__)
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="results directory (or a directory holding results/)")
    p.add_argument("--reference", default="reference", help="label of the reference render (default: reference)")
    p.add_argument("-o", "--output_dir", type=Path, default=None,
                   help="where report.html and summary.csv go (default: the first RUN_DIR)")
    p.add_argument("--device", default=None, help="run the SSIM windows here (e.g. cuda): much faster on 480p")
    p.add_argument("--content", type=int, default=None, metavar="N",
                   help="of renders of several contents (a prompt and seed set), report the N-th content's alone "
                        "(default: every render, and each stack's quality over the set)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summaries = [summarize(d, args.reference, device=args.device, content=args.content) for d in args.run_dirs]
    except (FileNotFoundError, ValueError) as exc:
        print(f"vdbench.report: error: {exc}", file=sys.stderr)
        return 2
    out = args.output_dir or args.run_dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    print(write_csv(summaries, out / "summary.csv"))
    print(write_html(summaries, out / "report.html"))
    for s in summaries:
        for n in s["notes"]:
            print(f"note: {s['run']}: {n}", file=sys.stderr)
    return 0
