"""The sweep's command line: ``python sweep.py`` / ``python -m vdbench.sweep`` (what it does: the package's
docstring, its ``--help``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import backends as B
from .. import families
from ..helptext import DefaultsHelpFormatter
from ..options import add_options
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
    add_options(p, families.get("wan"), names={"task", "prompt", "img_file_path"}, task=None, prompt=None,
                helps={"task": "what to render: t2v, i2v or ti2v (default: the model's first task: i2v for an I2V "
                               "model, ti2v for TI2V-5B, else t2v)",
                       "prompt": "the text prompt of every render (default: the family's fixed prompt)"})
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="render each candidate on each prompt of FILE, one a line; quality is then the mean over "
                        "the set with its min-max and n (default: --prompt alone)")
    p.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="render each candidate on each seed (default: --seed alone)")
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
    p.add_argument("--gpus", default="all",
                   help="the GPUs the renders share, by id (0,1,3) or all: the one-GPU candidates render side by side, "
                        "one a GPU, then each layout on its GPUs (--device cuda:N: that GPU alone)")
    p.add_argument("--jobs", type=int, default=None,
                   help="renders at once (default: one a GPU; 1 on a CPU, where N is the plumbing: no speed figure)")
    p.add_argument("--max_gpu_mem", type=float, default=None, metavar="GB",
                   help="leave out a render whose estimated peak on a card exceeds GB GiB (default's measured "
                        "peaks, less the weights its offload option takes off the card), and name the offload stack "
                        "to try when none fits (default: no bound)")
    m = p.add_argument_group("past one machine (torchrun's rendezvous for the layout renders, passed through)")
    for flags, dest, kind, text in (
            (("--nnodes",), "nnodes", int, "machines each layout render spans (default: 1)"),
            (("--node-rank", "--node_rank"), "node_rank", int, "this machine's rank (static rendezvous) (default: "
                                                               "none)"),
            (("--rdzv-endpoint", "--rdzv_endpoint"), "endpoint", str, "HOST:PORT where the renders meet: render i on "
                                                                      "PORT + i (default: none)"),
            (("--rdzv-id", "--rdzv_id"), "rdzv_id", str, "the rendezvous id, the same on every machine (default: "
                                                         "vdbench)"),
            (("--rdzv-backend", "--rdzv_backend"), "rdzv_backend", str, "c10d or static (default: c10d)"),
            (("--master-addr", "--master_addr"), "master_addr", str, "the static rendezvous' rank-0 machine "
                                                                     "(default: none)"),
            (("--master-port", "--master_port"), "master_port", int, "with --master-addr: render i on this port + i "
                                                                     "(default: 29500)")):
        m.add_argument(*flags, dest=dest, type=kind, default=None, help=text)
    p.add_argument("--out", default="outputs/sweep", help="where everything goes (a re-run resumes there)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if any(n < 1 for n in args.nproc):
            raise ValueError("--nproc takes GPU counts of 1 or more")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError("--jobs takes 1 or more")
        need = max(args.nproc + [parse_stack(s).nproc for s in args.stacks or []])
        if need > 1 and args.device != "cpu":
            import torch

            from ..pool import parse_gpus, visible_gpus

            have = len(parse_gpus(args.gpus, visible_gpus())) if torch.cuda.is_available() else 0
            if torch.cuda.is_available() and have < need:
                raise ValueError(f"renders on {need} GPUs asked for (--nproc / a stack's layout), {have} given "
                                 f"(--gpus {args.gpus})")
        from ..pool import Rendezvous

        Rendezvous.of(args).check()
        return run(args)
    except (ValueError, B.BackendUnavailable) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2

