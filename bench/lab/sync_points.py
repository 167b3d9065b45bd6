#!/usr/bin/env python3
"""Where a render makes the host wait for the GPU: every synchronizing CUDA call of one run, by call site.

    python3 bench/lab/sync_points.py -o outputs/sync -- run_wan.py --model random:wan2.1-t2v-1.3b ...
    torchrun --nproc_per_node=2 bench/lab/sync_points.py -o outputs/sync -- run_wan.py ... --ulysses_degree 2

A denoising step that synchronizes (a ``.item()``, ``torch.equal``, a blocking copy to the host) leaves the GPU idle
while the host issues the next step's first kernels, and on several GPUs that idle is paid by every rank at once.
This runs the given script in this process (each rank under torchrun) with torch's sync debug mode at ``warn``
(``torch.cuda.set_sync_debug_mode``), which flags every implicit synchronization; each one's Python stack is kept.
Explicit waits (``torch.cuda.synchronize``, an event's ``synchronize``) are not flagged: those are the timers'.

Writes ``OUTPUT/sync_points.rank<R>.json`` (every rank) and prints rank 0's table: per call site (the innermost
frame in this project, diffusers or the script) and the stack above it, how many times it synchronized. A stack
through the pipeline's denoising loop met once per step (a count that is a multiple of the steps) is what a warm
step pays; load-time and after-the-call ones are paid once. The run's own
outputs are the script's (its flags as usual). Needs CUDA: on a CPU nothing synchronizes and the tool says so.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

#: path parts of the frames a call site is named by (the first such frame from the innermost out)
OWN = ("vdbench", "diffusers", "run_wan.py", "sageattn_cogvideo.py")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-o", "--output", default="outputs/sync_points", help="folder of the per-rank JSON files")
    p.add_argument("--frames", type=int, default=8, help="stack frames kept per call site")
    p.add_argument("script", nargs=argparse.REMAINDER,
                   help="-- then the script and its arguments (run in this process, as __main__)")
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script or not script[0].endswith(".py"):
        p.error("give the script to run after --, e.g. -- run_wan.py --model ...")
    args.script = script
    return args


def site_of(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of the project, diffusers or the script (``file:line function``); the innermost frame
    where none is."""
    for fr in reversed(stack):
        if any(part in fr.filename for part in OWN):
            return f"{_short(fr.filename)}:{fr.lineno} {fr.name}"
    fr = stack[-1]
    return f"{_short(fr.filename)}:{fr.lineno} {fr.name}"


def _short(path: str) -> str:
    for part in ("site-packages/", "/work/", os.getcwd() + "/"):
        if part in path:
            return path.split(part, 1)[1]
    return path


class Recorder:
    """Counts the sync debug mode's warnings by call site and the frames above it (``frames`` deep), so one site met
    in two places (a scheduler's step in a load-time dry run and in the denoising loop) counts twice, apart."""

    def __init__(self, frames: int):
        self.frames = frames
        self.sites: Counter = Counter()  # (site, stack) -> count

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return self._orig(message, category, filename, lineno, file, line)
        stack = [fr for fr in traceback.extract_stack()[:-1] if "warnings.py" not in fr.filename]
        kept = tuple(f"{_short(fr.filename)}:{fr.lineno} {fr.name}" for fr in stack[-self.frames:])
        self.sites[(site_of(stack), kept)] += 1
        return None

    def install(self):
        self._orig = warnings.showwarning
        warnings.showwarning = self.showwarning
        warnings.filterwarnings("always", message=".*synchroniz.*")

    def report(self) -> dict:
        return {"total": sum(self.sites.values()),
                "sites": [{"site": s, "count": n, "stack": list(k)} for (s, k), n in self.sites.most_common()]}


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    rank = int(os.environ.get("RANK", "0"))
    if not torch.cuda.is_available():
        print("error: sync_points needs a CUDA GPU: on a CPU nothing synchronizes (hint: run it on the GPU machine)",
              file=sys.stderr)
        return 2
    rec = Recorder(args.frames)
    rec.install()
    torch.cuda.set_sync_debug_mode("warn")
    sys.argv = list(args.script)
    # the script's own folder first on the path, where python puts it for a script it runs (this tool imports
    # nothing of the project, so the script's checkout -- this one or another -- is the one that runs)
    sys.path[0] = os.path.dirname(os.path.abspath(args.script[0]))
    code = 0
    try:
        runpy.run_path(args.script[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        report = {"rank": rank, "command": args.script, "exit": code, **rec.report()}
        (out / f"sync_points.rank{rank}.json").write_text(json.dumps(report, indent=1))
        if rank == 0:
            print(f"{report['total']} synchronizing calls on rank 0 (exit {code})")
            for s in report["sites"]:
                print(f"{s['count']:6d}  {s['site']}  <- {' <- '.join(reversed(s['stack'][:-1][-3:]))}")
    return code


if __name__ == "__main__":
    sys.exit(main())
