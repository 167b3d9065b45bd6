#!/usr/bin/env python3
"""Does vdbench's parallel render cost anything over the parallel engine called bare? One process group, side by side.

    torchrun --nproc_per_node=2 bench/lab/parallel_overhead.py --model random:wan2.1-t2v-1.3b --height 480 \\
        --width 832 --num_frames 81 --backend sdpa_cudnn --engines diffusers,xfuser -o outputs/overhead

Under torchrun (Ulysses degree = the number of ranks unless ``--ring_degree`` says otherwise), for each engine, the
same shape, steps, prompt, seed, flow shift, dtype and attention kernel, by each of these sides:

* ``bare``    -- the engine as its own documentation calls it. diffusers: ``load_pipeline`` (the same random or tiny
  weights), ``transformer.set_attention_backend(<diffusers' name of the kernel>)``,
  ``transformer.enable_parallelism(config=ContextParallelConfig(...))``, ``pipe(...)``. xfuser (0.7): its Wan T2V
  recipe -- ``xFuserWanTransformer3DWrapper`` built from the loaded transformer's config and tensors (what its runner
  reads from a checkpoint), diffusers' ``WanPipeline``, ``initialize_runtime_state`` with ``attention_backend`` set
  to xfuser's name of the kernel (``XFUSER_NAMES``), ``pipe(...)``.
* ``vdbench`` -- ``vdbench.render.render`` with ``--parallel_engine <engine>`` and ``--attention_type <backend>``,
  configured by the render CLI's own parser: FailureWatch, per-step callbacks, the attention patch, the decode, the
  merged timing -- everything a user's run pays.
* ``vdbench_timed`` (``--sides``) -- the same with ``--time_attention`` (a CUDA event pair around every attention
  call), which the multi-GPU table's runs (the W13 of the x4b / x8 suites) pass.
* ``vdbench_template`` (``--sides``, diffusers) -- with ``--ulysses_async off``: diffusers' Ulysses template around
  vdbench's kernel instead of the render's default exchange beside the projections.

The bare side runs ``pipe(...)`` under ``torch.inference_mode()`` as the render does, so the difference measured is
the harness's and not autograd's bookkeeping (diffusers' own ``@torch.no_grad`` costs host time per op).

Both are timed by the same clock (``vdbench.timing.StepTimer``: CUDA events at each step boundary, the step taken as
done when the slowest rank is, as ``merge_rank_entries`` does), and reported by one definition (``run_step_stats``:
the warm step is the median of the steps after the first, pooled over repetitions, with n and spread). Each round
runs every side once, the order rotated from round to round, so a drift of the machine does not land on one side. ``--profile`` adds one
profiled repetition per side (steps 2-3: ``vdbench.timing.StepProfiler``'s kernel summary per rank) to tell a
kernel-level difference (the engine's) from host time between kernels.

Writes ``OUTPUT/parallel_overhead.json`` and prints the table (rank 0): per engine and side the warm step with its
p20-p80 and n, and each vdbench side's overhead in % of bare's (vdbench / bare - 1). Engines that can't run here (xfuser without CUDA or not installed) are rows
with the reason. CPU timings are not speed figures (``speed_figure`` false): on a CPU over gloo this checks the
plumbing, which is what tests/test_parallel_overhead.py does.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vdbench import backends as B
from vdbench import cli, families
from vdbench import parallel as P
from vdbench.pipelines import load_pipeline
from vdbench.render import render, resolve_dtype
from vdbench.timing import StepProfiler, StepTimer, describe_steps, load_timing, run_step_stats
from vdbench.helptext import DefaultsHelpFormatter

#: xfuser's ``AttentionBackendType`` name of the kernel each vdbench backend runs (xfuser/core/distributed/
#: attention_backend.py); a backend missing here needs ``--xfuser_backend``.
XFUSER_NAMES = {"sdpa": "SDPA", "sdpa_flash": "SDPA_FLASH", "sdpa_efficient": "SDPA_EFFICIENT",
                "sdpa_math": "SDPA_MATH", "sdpa_cudnn": "CUDNN", "fav2": "FLASH", "fav3": "FLASH_3",
                "fav3_fp8": "FLASH_3_FP8", "sagev1": "SAGE"}
ENGINES = ("diffusers", "xfuser")
#: the sides timed per engine, and the render flags each vdbench side adds
SIDES = ("bare", "vdbench", "vdbench_timed", "vdbench_template")
SIDE_FLAGS = {"vdbench": [], "vdbench_timed": ["--time_attention"], "vdbench_template": ["--ulysses_async", "off"]}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="random:wan2.1-t2v-1.3b", help="the model, as run_wan.py takes it")
    p.add_argument("--height", type=int, default=480, help="frame height")
    p.add_argument("--width", type=int, default=832, help="frame width")
    p.add_argument("--num_frames", type=int, default=81, help="frames")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per repetition (warm steps: steps - 1)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each one repetition bare and one through vdbench")
    p.add_argument("--backend", default="sdpa_cudnn", help="vdbench backend name (aliases accepted)")
    p.add_argument("--diffusers_backend", default=None,
                   help="diffusers' name of the same kernel (default: the backend's alias diffusers registers)")
    p.add_argument("--xfuser_backend", default=None,
                   help="xfuser's AttentionBackendType name of the same kernel (default: XFUSER_NAMES)")
    p.add_argument("--engines", default="diffusers,xfuser", help="comma-separated: diffusers, xfuser")
    p.add_argument("--sides", default="bare,vdbench",
                   help=f"comma-separated, bare first: {', '.join(SIDES)} (default: bare,vdbench)")
    p.add_argument("--ring_degree", type=int, default=1, help="ring degree; Ulysses takes the rest of the ranks")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cuda, cpu")
    p.add_argument("--seed", type=int, default=42, help="the seed every side renders with")
    p.add_argument("--profile", action="store_true", help="one profiled repetition per side after the timing")
    p.add_argument("-o", "--output", default="outputs/parallel_overhead", help="where the JSON and the table go")
    args = p.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown engine(s) {', '.join(sorted(unknown))}; valid: {', '.join(ENGINES)}")
    args.sides = [x for x in args.sides.split(",") if x]
    if args.sides[:1] != ["bare"] or len(args.sides) < 2 or set(args.sides) - set(SIDES):
        p.error(f"--sides: bare first, then one or more of {', '.join(SIDES[1:])}")
    if args.steps < 2 or args.rounds < 1:
        p.error("--steps must be >= 2 (a warm step is a step after the first) and --rounds >= 1")
    return args


# ----- the process group and the run's fixed inputs -----

def join_group(device_arg: str) -> tuple[int, int, torch.device]:
    """This process's rank, world size and device, the default process group joined (NCCL on GPUs, gloo on a CPU).
    vdbench's renders run inside this group and leave it up (``DistContext.owns_group``)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:
        raise SystemExit("error: run under torchrun with 2 or more ranks (torchrun --nproc_per_node=2 ...)")
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank, world, device


def diffusers_name(backend: B.Backend, override) -> str:
    """diffusers' registered name for ``backend``'s kernel: the override, else the entry's alias diffusers knows;
    refused unless vdbench resolves it to the same entry (the same kernel on both sides)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    known = {n.value for n in AttentionBackendName}
    name = override or next((a for a in (*backend.aliases, backend.name) if a in known), None)
    if name is None:
        raise SystemExit(f"error: no diffusers attention backend is registered as an alias of '{backend.name}'; "
                         f"pass --diffusers_backend (diffusers knows: {', '.join(sorted(known))})")
    if name in B.names() or name in B.aliases():
        if B.resolve(name) is not backend:
            raise SystemExit(f"error: diffusers' '{name}' is vdbench's '{B.resolve(name).name}', not "
                             f"'{backend.name}': compare the same kernel")
    return name


class Inputs:
    """What both sides render: the render CLI's defaults for the family (prompt, negative prompt, guidance), the
    family's flow shift for the size, the dtype vdbench picks for the device."""

    def __init__(self, args, device: torch.device):
        self.family = families.get("wan")
        self.device, self.dtype = device, resolve_dtype("auto", device)
        self.flow_shift = self.family.flow_shift("t2v", args.height, args.width)
        cli_ = self.family.cli
        self.kwargs = dict(prompt=cli_.prompt, negative_prompt=cli_.negative_prompt, height=args.height,
                           width=args.width, num_frames=args.num_frames, num_inference_steps=args.steps,
                           guidance_scale=cli_.guidance_scale, output_type="latent")
        self.seed = args.seed

    def load(self, model: str):
        pipe = load_pipeline(model, "t2v", self.family.name, dtype=self.dtype, device=self.device)
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, flow_shift=self.flow_shift)
        pipe.set_progress_bar_config(disable=True)  # what the render does when stderr is not a terminal
        return pipe


def slowest_rank(times: list[float], world: int) -> list[float]:
    """Per step, the slowest rank's time (the step is done when every rank is), as vdbench merges its ranks."""
    gathered: list = [None] * world
    dist.all_gather_object(gathered, times)
    return [max(col) for col in zip(*gathered)]


def time_pipe(pipe, inputs: Inputs, world: int, profile_dir: Path | None = None, rank: int = 0) -> list[float]:
    """One bare repetition: ``pipe(...)`` with the step clock (and the profiler over steps 2-3 when asked)."""
    timer = StepTimer(inputs.device,
                      profiler=StepProfiler(profile_dir, rank, 1, 1, 1, inputs.device) if profile_dir else None)
    with torch.inference_mode():
        timer.run_pipe(pipe, generator=torch.Generator("cpu").manual_seed(inputs.seed), **inputs.kwargs)
    return slowest_rank(timer.step_times(), world)


# ----- the two bare engines -----

def bare_diffusers(args, inputs: Inputs, backend: B.Backend):
    """diffusers' context parallelism as its documentation calls it."""
    from diffusers import ContextParallelConfig

    name = diffusers_name(backend, args.diffusers_backend)
    pipe = inputs.load(args.model)
    pipe.transformer.set_attention_backend(name)
    world = dist.get_world_size()
    with P.one_device_presented(inputs.device):  # diffusers 0.42 divides by the accelerator count (0 on a CPU)
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(
            ulysses_degree=world // args.ring_degree, ring_degree=args.ring_degree))
    return pipe, f"diffusers '{name}'"


def bare_xfuser(args, inputs: Inputs, backend: B.Backend):
    """xfuser's own Wan T2V: its transformer wrapper (USP processors) in diffusers' WanPipeline, its runtime state
    with its attention backend set to the same kernel."""
    if importlib.util.find_spec("xfuser") is None:
        raise XfuserMissing("xfuser is not installed (pip install '.[dist]')")
    from xfuser import xFuserArgs
    from xfuser.core.distributed import init_distributed_environment, initialize_runtime_state
    from xfuser.model_executor.models.transformers.transformer_wan import xFuserWanTransformer3DWrapper

    name = args.xfuser_backend or XFUSER_NAMES.get(backend.name)
    if name is None:
        raise XfuserMissing(f"no xfuser name known for '{backend.name}': pass --xfuser_backend")
    if "attention_backend" not in getattr(xFuserArgs, "__dataclass_fields__", {}):
        raise XfuserMissing("this xfuser's xFuserArgs has no attention_backend: its kernel can't be chosen")
    world = dist.get_world_size()
    init_distributed_environment(rank=dist.get_rank(), world_size=world, local_rank=inputs.device.index or 0)
    # model: a label only (the pipeline is built here, not read by xfuser), as vdbench.parallel passes it
    engine_config, _ = xFuserArgs(model="vdbench", ulysses_degree=world // args.ring_degree,
                                  ring_degree=args.ring_degree, attention_backend=name).create_config()
    pipe = inputs.load(args.model)
    tr = pipe.transformer
    accepted = set(inspect.signature(xFuserWanTransformer3DWrapper.__init__).parameters)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(inputs.dtype)
        with torch.device(inputs.device):
            wrapper = xFuserWanTransformer3DWrapper(**{k: v for k, v in dict(tr.config).items() if k in accepted})
    finally:
        torch.set_default_dtype(previous)
    wrapper.load_state_dict(tr.state_dict(), assign=True, strict=True)
    pipe.transformer = wrapper.eval()
    del tr
    initialize_runtime_state(pipe, engine_config)
    return pipe, f"xfuser {name}"


BARE = {"diffusers": bare_diffusers, "xfuser": bare_xfuser}


class XfuserMissing(RuntimeError):
    """xfuser (or the piece of it the bare recipe needs) is not here: the engine's rows say so."""


# ----- one side, one repetition -----

def run_bare(engine: str, args, inputs: Inputs, backend: B.Backend, world: int, profile_dir=None) -> tuple:
    pipe, how = BARE[engine](args, inputs, backend)
    try:
        return time_pipe(pipe, inputs, world, profile_dir, dist.get_rank()), how
    finally:
        del pipe
        _release()


def run_vdbench(engine: str, args, backend: B.Backend, out: Path, flags: list[str],
                profile: str | None = None) -> list[float]:
    """One repetition of ``vdbench.render.render`` configured by the render CLI's parser; the merged step times
    (slowest rank per step) from the timing.json rank 0 wrote, on rank 0 (None elsewhere)."""
    fam = families.get("wan")
    argv = ["--model", args.model, "--height", str(args.height), "--width", str(args.width), "--num_frames",
            str(args.num_frames), "--num_inference_steps", str(args.steps), "--attention_type", backend.name,
            "--parallel_engine", engine, "--ulysses_degree", str(dist.get_world_size() // args.ring_degree),
            "--ring_degree", str(args.ring_degree), "--seed", str(args.seed), "--device", args.device,
            "--benchmark_output_directory", str(out), *flags]
    if profile:
        argv += ["--profile_output", profile, "--profile_wait", "1", "--profile_warmup", "1", "--profile_active", "1"]
    cfg = cli.config_from_args(fam, cli.build_parser(fam).parse_args(argv))
    try:
        render(cfg, log=lambda *a, **k: None)
    finally:
        _release()
    if dist.get_rank() != 0:
        return None
    return load_timing(cfg.timing_path)[-1]["step_times"]


def _release() -> None:
    """Free the side's pipeline before the next one loads (several 1.3B pipelines would not share a GPU well)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----- the table -----

def side_stats(reps: list[list[float]], device: torch.device) -> dict:
    st = run_step_stats(reps, device)
    keys = ("warm_step_median", "warm_step_n", "warm_step_p20", "warm_step_p80", "warm_step_min", "warm_step_max",
            "first_step", "repetitions", "rep_warm_medians", "speed_figure", "why_not_speed")
    return {k: st.get(k) for k in keys} | {"step_times": reps, "line": describe_steps(st)}


def engine_row(engine: str, times: dict[str, list], how: str, device) -> dict:
    """One engine's sides with their step statistics, and each vdbench side's overhead over bare in % of bare's
    warm step; ``bare_p20_p80_pct``: bare's own spread in %, below which an overhead is not told from noise."""
    sides = {side: side_stats(reps, device) for side, reps in times.items()}
    b = sides["bare"]
    return {"engine": engine, "status": "ok", "bare_how": how, "sides": sides,
            "overhead_pct": {side: (st["warm_step_median"] / b["warm_step_median"] - 1.0) * 100.0
                             for side, st in sides.items() if side != "bare"},
            "bare_p20_p80_pct": (b["warm_step_p80"] - b["warm_step_p20"]) / b["warm_step_median"] * 100.0,
            "speed_figure": all(st["speed_figure"] for st in sides.values())}


def table(rows: list[dict]) -> str:
    lines = [f"{'engine':10s} {'side':14s} {'warm ms':>9s} {'p20-p80 ms':>17s} {'n':>3s} {'vs bare':>9s}  bare is"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['engine']:10s} {r['status']}")
            continue
        for side, st in r["sides"].items():
            vs = f"{r['overhead_pct'][side]:+8.2f}%" if side in r["overhead_pct"] else f"{'-':>9s}"
            lines.append(f"{r['engine']:10s} {side:14s} {st['warm_step_median'] * 1e3:9.1f} "
                         f"{st['warm_step_p20'] * 1e3:8.1f}-{st['warm_step_p80'] * 1e3:<8.1f} {st['warm_step_n']:3d} "
                         f"{vs}  {r['bare_how'] if side == 'bare' else ''}")
    why = {st["why_not_speed"] for r in rows if r["status"] == "ok" for st in r["sides"].values()
           if not st["speed_figure"]}
    if why:
        lines.append(f"not speed figures: {'; '.join(sorted(w for w in why if w))}")
    return "\n".join(lines)


def profile_dirs(engine: str, sides: list[str], out: Path) -> dict[str, Path]:
    """Where each side's profiled repetition leaves its kernel summaries (``kernels_rank<R>_step<N>.json``)."""
    dirs = {"bare": out / "profile" / f"{engine}_bare"}
    dirs.update({side: out / "renders" / engine / side / "profiled" / "traces" / f"{engine}_{side}"
                 for side in sides if side != "bare"})
    return dirs


def read_profiles(engine: str, sides: list[str], out: Path) -> dict:
    """side -> rank -> the profiled step's GPU time by category (``vdbench.profiling.kernel_summary``) and its top
    kernels: equal kernel time and a longer step is host time between kernels (the harness's); a category that grew
    is a kernel-level difference (whose: the top kernels name it)."""
    found: dict = {}
    for side, d in profile_dirs(engine, sides, out).items():
        for f in sorted(d.glob("kernels_rank*_step*.json")):
            summary = json.loads(f.read_text())
            rank = f.name.split("_")[1]
            found.setdefault(side, {})[rank] = {"source": summary["source"], "total_ms": summary["total_ms"],
                                                "categories_ms": summary["categories_ms"], "top": summary["top"][:10]}
    return found


def profile_table(rows: list[dict]) -> str:
    cats = ("attention", "communication", "gemm", "copy", "elementwise/norm", "conv", "other")
    lines = [f"profiled step, rank0, ms: {'engine':10s} {'side':14s} {'total':>8s} " + " ".join(f"{c[:11]:>11s}" for c in cats)]
    for r in rows:
        for side, ranks in (r.get("profile") or {}).items():
            p = ranks.get("rank0")
            if p:
                lines.append(f"{'':26s}{r['engine']:10s} {side:14s} {p['total_ms']:8.1f} "
                             + " ".join(f"{p['categories_ms'].get(c, 0.0):11.1f}" for c in cats))
    return "\n".join(lines) if len(lines) > 1 else ""


def run_engine(engine: str, args, inputs: Inputs, backend: B.Backend, world: int, out: Path) -> tuple[dict, str]:
    """The rounds of one engine: every side once per round, the order rotated each round; then the profiled pass."""
    times: dict[str, list] = {side: [] for side in args.sides}
    how, rank = "", dist.get_rank()
    for rnd in range(args.rounds):
        k = rnd % len(args.sides)
        for side in args.sides[k:] + args.sides[:k]:
            t0 = time.perf_counter()
            if side == "bare":
                reps, how = run_bare(engine, args, inputs, backend, world)
            else:
                reps = run_vdbench(engine, args, backend, out / "renders" / engine / side / f"round{rnd}",
                                   SIDE_FLAGS[side])
            times[side].append(reps)
            if rank == 0:
                print(f"[{engine} round {rnd}] {side}: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.profile:
        run_bare(engine, args, inputs, backend, world, profile_dir=profile_dirs(engine, args.sides, out)["bare"])
        for side in args.sides[1:]:
            run_vdbench(engine, args, backend, out / "renders" / engine / side / "profiled", SIDE_FLAGS[side],
                        profile=f"{engine}_{side}")
    return times, how


def main(argv=None) -> int:
    args = parse(argv)
    rank, world, device = join_group(args.device)
    if args.device == "auto":
        args.device = device.type
    if world % args.ring_degree:
        raise SystemExit(f"error: {world} ranks can't be split into ring degree {args.ring_degree}")
    backend = B.resolve(args.backend)
    inputs = Inputs(args, device)
    out = Path(args.output)
    rows = []
    for engine in args.engines:
        try:
            times, how = run_engine(engine, args, inputs, backend, world, out)
        except (B.BackendUnavailable, ImportError, NotImplementedError, XfuserMissing) as e:  # can't run here
            rows.append({"engine": engine, "status": f"skipped: {type(e).__name__}: {e}".splitlines()[0]})
            continue
        if rank == 0:
            rows.append(engine_row(engine, times, how, device))
            if args.profile:
                rows[-1]["profile"] = read_profiles(engine, args.sides, out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        result = {"backend": backend.name, "model": args.model, "shape": [args.num_frames, args.height, args.width],
                  "steps": args.steps, "rounds": args.rounds, "world_size": world, "ring_degree": args.ring_degree,
                  "device": str(device), "rows": rows}
        (out / "parallel_overhead.json").write_text(json.dumps(result, indent=1))
        print(table(rows))
        if args.profile:
            print(profile_table(rows))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
