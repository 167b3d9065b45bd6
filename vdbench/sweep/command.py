"""The sweep's command line: ``python sweep.py`` / ``python -m vdbench.sweep`` (what it does: the package's
docstring, its ``--help``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import backends as B
from .. import families
from ..helptext import DefaultsHelpFormatter
from .candidates import parse_stack
from .stages import KERNEL_SHARE, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sweep.py", description=importlib.import_module(__package__).__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="tiny", help="hub id, local path, random:<arch>, tiny or tiny:<variant>")
    p.add_argument("--family", default=None, choices=families.names(),
                   help="the model family (default: from the model name: cogvideox when it says so, else wan)")
    p.add_argument("--height", type=int, default=64, help="video height in pixels")
    p.add_argument("--width", type=int, default=96, help="video width in pixels")
    p.add_argument("--num_frames", type=int, default=9, help="video frames")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per render (warm n = steps - 1)")
    p.add_argument("--seed", type=int, default=42, help="one seed for every render: same noise, comparable videos")
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--budget_min", type=float, default=15.0,
                   help="minutes for the whole sweep, re-runs that resume it included (progress.json keeps the count)")
    p.add_argument("--stop_after_min", type=float, default=None,
                   help="minutes for this run alone: it starts no render it can't finish within them, writes what "
                        "it has, and a re-run resumes (default: none, only --budget_min)")
    p.add_argument("--max_candidates", type=int, default=8, help="backends rendered beside default and reference")
    p.add_argument("--max_rel_l2", type=float, default=0.1,
                   help="leave out backends further than this from exact attention on the captures")
    p.add_argument("--psnr_tolerance_db", type=float, default=0.5, help="'within N dB of exact' in the verdict")
    p.add_argument("--stacks", nargs="*", default=[], metavar="STACK",
                   help="extra renders: <attention type>[+compile|+compile=<backend>[:<mode>]][+fp8gemm|+fp8gemm=ffn]"
                        "[+bf16te][+eagerblock]"
                        "[+vae=<mode>][+encode=<mode>][+<cache spec>|+cache=<spec>], the name a render records "
                        "as its stack")
    p.add_argument("--nproc", type=int, nargs="+", default=[1], metavar="N",
                   help="GPU counts to rank layouts for: each layout N allows (the CFG split, Ulysses, ring and "
                        "their products) x the --layout_backends leading backends, each render under torchrun, with "
                        "a verdict per count (e.g. --nproc 2 4)")
    p.add_argument("--layout_backends", nargs="+", default=["2"], metavar="N_OR_BACKEND",
                   help="backends rendered in each multi-GPU layout: a count (the kernel bench's fastest within "
                        "--max_rel_l2), or their names (e.g. fav3): then those are the candidates, on one GPU and in "
                        "each layout, and neither the capture render nor the kernel bench runs")
    p.add_argument("--bench_beside", choices=("auto", "on", "off"), default="auto",
                   help="the capture render and the kernel bench on a GPU the 1-GPU renders don't use, beside them "
                        "(the candidates and the multi-GPU renders wait for them): auto where a second GPU is "
                        "visible; on: also on a CPU (the plumbing); off: before the renders")
    p.add_argument("--max_captures", type=int, default=8, help="attention calls captured for the kernel bench")
    p.add_argument("--kernel_budget_s", type=float, default=10.0, help="seconds of timed calls per kernel and input")
    p.add_argument("--kernel_max_s", type=float, default=None,
                   help="seconds of kernel benching after which no further capture of a shape already benched is "
                        f"started (default: {KERNEL_SHARE * 100:.0f}%% of --budget_min; 0: no bound)")
    p.add_argument("--out", default="outputs/sweep", help="where everything goes (a re-run resumes there)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if any(n < 1 for n in args.nproc):
            raise ValueError("--nproc takes GPU counts of 1 or more")
        need = max(args.nproc + [parse_stack(s).nproc for s in args.stacks or []])
        if need > 1 and args.device != "cpu":
            import torch

            have = torch.cuda.device_count()
            if torch.cuda.is_available() and have < need:
                raise ValueError(f"renders on {need} GPUs asked for (--nproc / a stack's layout), {have} visible")
        return run(args)
    except (ValueError, B.BackendUnavailable) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2

