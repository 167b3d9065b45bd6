"""The sweep's stages, each a function of what the ones before it gave, chained by :func:`run`: the probe of what
runs here, the capture render and the kernel bench (beside the first renders where a second GPU is free), the plan,
the renders (a list of candidates and a runner that starts each one's command), then :mod:`vdbench.sweep.verdict`'s
quality figures and verdict with the files it writes. What the stages share is passed as objects
(:mod:`vdbench.sweep.state`): the run's ``Context`` (fixed), its ``Budget`` (seconds, across the runs that resume it)
and the renders' ``Ledger`` (what they measured)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from .. import families
from ..kernel_bench import child_env
from ..measure.record import Record, read
from ..pool import Done, Job, Pool, Rendezvous, launcher
from ..pool import TIMED_OUT as POOL_TIMED_OUT
from ..report import load_frames
from ..sets import Content
from .budget import (attention_ms_per_step, calls_per_step, default_render_s, estimate_render_s, options_one_time,
                     plan_renders, render_order)
from .candidates import (BASELINE, BASELINE_WHY, REFERENCE, REFERENCE_WHY, Candidate, availability,
                         layout_candidates, parse_layout_backends, parse_stack, plan_candidates)
from .ranking import frames_of, quality_of, stored_quality, video_of
from .state import Budget, Context, Ledger, PreRender
from .state import log as _log
from .verdict import conclude, quality_rows

#: The kernel bench's share of the budget (``--kernel_max_s``'s default): past it, it starts no further input of a
#: shape already benched. On 4 H200s at Wan 1.3B 480p the unbounded bench (8 captures + a random input, 17 kernels)
#: and the capture took 363 s of a 420 s budget: the renders are what the budget is for.
KERNEL_SHARE = 0.15

#: :func:`run_job`'s status for a command stopped at the end of the budget (the pool's).
TIMED_OUT = POOL_TIMED_OUT


def run_job(cmd: list[str], log: Path, left_s: float, env: Optional[dict] = None) -> int:
    """Run ``cmd`` (its output to ``log``) for at most ``left_s``, in this process's folder with the vdbench it
    imported (:func:`vdbench.kernel_bench.child_env`); ``env``: variables set on top (the GPU a job beside the
    renders sees). The runner the stages start their commands with."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(1.0, left_s),
                                  env=child_env(env)).returncode
        except subprocess.TimeoutExpired:
            f.write("\n[sweep] stopped: out of budget\n")
            return TIMED_OUT


#: How a one-process render runs its CLI (``python -c``: the family's CLI without ``-m``'s second import).
ONE_PROCESS = "import sys; from vdbench.cli import main; sys.exit(main(sys.argv[1], sys.argv[2:]))"


def render_args(args, cand: Candidate, out: Path, extra: list[str], content: Optional[Content] = None,
                device: Optional[str] = None) -> list[str]:
    """The render CLI's arguments that render ``cand`` (of ``content``, the set's prompt and seed) into ``out``."""
    content = content or Content()
    task, prompt, image = (getattr(args, k, None) for k in ("task", "prompt", "img_file_path"))
    seed = content.seed if content.seed is not None else args.seed
    prompt = content.prompt if content.prompt is not None else prompt
    return ["--model", args.model, "--height", str(args.height), "--width", str(args.width),
            "--num_frames", str(args.num_frames), "--num_inference_steps", str(args.steps), "--seed", str(seed),
            "--device", device or args.device, "--attention_type", cand.attention,
            *(["--task", task] if task else []), *(["--prompt", prompt] if prompt is not None else []),
            *(["--img_file_path", str(image)] if image else []),
            "--benchmark_output_directory", str(out), "--save_frames", *cand.flags, *extra]


def render_program(family: str, args, cand: Candidate, out: Path, extra: list[str],
                   content: Optional[Content] = None, device: Optional[str] = None) -> list[str]:
    """Python's arguments for the render (the pool puts torchrun before a layout's)."""
    head = ["-m", "vdbench.cli"] if cand.nproc > 1 else ["-c", ONE_PROCESS]
    return [*head, family, *render_args(args, cand, out, extra, content, device)]


def render_cmd(family: str, args, cand: Candidate, out: Path, extra: list[str]) -> list[str]:
    """The whole command that renders ``cand`` into ``out``: under torchrun for a layout (one process per GPU, a
    rendezvous port of its own), one process otherwise."""
    from ..pool import free_port

    return [*launcher(sys.executable, cand.nproc, Rendezvous(), 0, free_port() if cand.nproc > 1 else None),
            *render_program(family, args, cand, out, extra)]


def records_in(folder: Path) -> list[Record]:
    """The render records under ``folder``; a video path that no longer exists where the record says (the sweep's
    folder was moved or copied to another machine to resume there) is taken from ``folder`` by its file name."""
    recs = []
    for p in sorted(folder.rglob("records.jsonl")):
        for r in read(p):
            if r.suite != "render":
                continue
            out = r.data.get("output")
            if out and not Path(out).exists():
                moved = sorted(folder.rglob(Path(out).name))
                if moved:
                    r = dataclasses.replace(r, data={**r.data, "output": str(moved[0])})
            recs.append(r)
    return recs


def side_device(mode: str, device: str, visible: list[str]) -> Optional[tuple[str, dict]]:
    """Where the capture render and the kernel bench run beside the 1-GPU renders: (the device they are given, the
    environment that puts them there) or None (before the renders, on their device). On CUDA: the last visible GPU
    that is not the renders' (``visible``: the GPUs' ids as ``CUDA_VISIBLE_DEVICES`` names them), the job seeing it
    alone -- its own GPU, so neither the bench's timings nor the renders' share one; with one GPU, none (``on``
    refuses). On a CPU only when asked (``on``: the plumbing; no CPU figure is a speed figure)."""
    if mode == "off":
        return None
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        free = [g for i, g in enumerate(visible) if i != index]
        if free:
            return "cuda", {"CUDA_VISIBLE_DEVICES": free[-1]}
        if mode == "on":
            raise ValueError(f"--bench_beside on needs a second GPU ({len(visible)} visible): use auto or off")
        return None
    return (device, {}) if mode == "on" else None


def visible_gpus(device: str) -> list[str]:
    """The GPUs this process sees, by the ids ``CUDA_VISIBLE_DEVICES`` gives them (:func:`vdbench.pool.visible_gpus`);
    [] off CUDA."""
    from ..pool import visible_gpus as visible

    return visible() if device.startswith("cuda") else []


# ----------------------------------------------------------------------------------------------------------------
# 1. what runs here
# ----------------------------------------------------------------------------------------------------------------

def probe(ctx: Context) -> tuple[list[dict], float]:
    """(every registered backend with whether it runs here and why not, the seconds that took), written to
    ``backends.txt``."""
    t = time.monotonic()
    avail = availability(ctx.device)
    probe_s = time.monotonic() - t
    (ctx.out / "backends.txt").write_text("".join(
        f"{a['backend']:22s} {'runs' if a['runs'] else 'no: ' + str(a['why_not'])}\n" for a in avail))
    n_run = sum(a["runs"] for a in avail)
    _log(f"[sweep] {n_run} of {len(avail)} backends run on {ctx.dev_name} ({ctx.out / 'backends.txt'}; probed in "
         f"{probe_s:.1f} s)")
    return avail, probe_s


# ----------------------------------------------------------------------------------------------------------------
# 2. the model's attention inputs captured by one short render, every runnable kernel benched on them
# ----------------------------------------------------------------------------------------------------------------

def capture_and_bench(ctx: Context, avail: list[dict], *, device: str, env: Optional[dict], kernel_max_s: float,
                      left: Callable[[], float], runner=run_job) -> dict:
    """The capture render (one step, ``--save_inputs``) then the kernel bench (``python -m vdbench.kernel_bench``)
    on its captures, on ``device`` with ``env``, each for at most what ``left()`` says is left: {"capture_s",
    "kernel_bench_s"} (what each took), "error" (the capture failed) or "warning" (the bench ended badly)."""
    args, out, got = ctx.args, ctx.out, {}
    caps, kdir = out / "captures", out / "kernels"
    cmd = render_cmd(ctx.fam.name, argparse.Namespace(**{**vars(args), "steps": 1, "device": device}),
                     Candidate("capture", BASELINE), out / "capture_run",
                     ["--save_inputs", "--input_dir", str(caps), "--max_captures", str(args.max_captures), "--overwrite"])
    t = time.monotonic()
    rc = runner(cmd, out / "logs" / "capture.log", left(), env)
    got["capture_s"] = time.monotonic() - t  # a lower bound of a render's time: the first render's budget check
    if rc != 0:
        got["error"] = f"the capture render failed (rc {rc}); see {out / 'logs' / 'capture.log'}"
        return got
    kdir.mkdir(exist_ok=True)
    # what can be a candidate (emulations carry accuracy only), and default and the exact reference: their
    # times on the same inputs are what predicts each render's time (estimate_render_s)
    runnable = [a["backend"] for a in avail if a["runs"] and not a["emulated"]]
    runnable.sort(key=lambda n: 0 if n == BASELINE else 2 if n == REFERENCE else 1)
    grid = (["--grid", ctx.fam.size_grid(args.height, args.width, args.num_frames)] if ctx.fam.size_grid else [])
    cmd = [sys.executable, "-m", "vdbench.kernel_bench", "--input_dir", str(caps), "--kernel", ",".join(runnable),
           "--device", device, "--budget_s", str(args.kernel_budget_s), "--max_s", str(kernel_max_s), *grid,
           "-o", str(kdir / "attention.csv")]
    t = time.monotonic()
    rc = runner(cmd, out / "logs" / "kernels.log", left(), env)
    got["kernel_bench_s"] = time.monotonic() - t
    if rc not in (0, 3):  # 3: some kernels skipped (their rows say why)
        got["warning"] = f"the kernel bench ended with rc {rc}; see {out / 'logs' / 'kernels.log'}"
    return got


def _beside(got: dict, ctx: Context, avail: list[dict], where: tuple[str, dict], kernel_max_s: float,
            left: Callable[[], float]) -> None:
    """:func:`capture_and_bench` on a thread, its result put in ``got``; a failure said in one line, on join, as a
    failed capture is."""
    try:
        got.update(capture_and_bench(ctx, avail, device=where[0], env=where[1], kernel_max_s=kernel_max_s, left=left))
    except Exception as e:  # noqa: BLE001
        got["error"] = f"the capture / kernel bench failed: {type(e).__name__}: {e}"


def start_kernel_bench(ctx: Context, avail: list[dict], named: list[Candidate], budget: Budget, *,
                       kernel_max_s: float, probe_s: float, pool: Optional[Pool] = None) -> PreRender:
    """The capture render and the kernel bench started: none where the backends are named (``--layout_backends``)
    or an earlier run benched them; on a GPU the renders don't use where there is one (:func:`side_device`: held
    from the pool until it ends; then ``default``'s render, which needs no kernel-bench figure, goes on meanwhile,
    and the exact ``reference`` too where the pool has a second place: ``early``), else run here, now."""
    pre = PreRender({"probe_s": probe_s}, kernel_max_s)
    if named:
        names = " ".join(c.name for c in named)
        pre.pre["kernel_bench"] = f"skipped: the backends are named (--layout_backends {names})"
        _log(f"[sweep] no capture render and no kernel bench: the backends are named (--layout_backends {names}); "
             f"each render is estimated at the slowest render so far")
        return pre
    if (ctx.out / "kernels" / "attention.json").exists():
        return pre
    beside = side_device(ctx.args.bench_beside, ctx.device, visible_gpus(ctx.device))
    if beside is None:
        pre.got = capture_and_bench(ctx, avail, device=ctx.device, env=None, kernel_max_s=kernel_max_s,
                                    left=budget.left)
        return pre
    gpu = beside[1].get("CUDA_VISIBLE_DEVICES")
    if pool is not None and gpu in pool.gpus:
        pool.hold(gpu)
        pre.held = gpu
    where = f"GPU {gpu}" if beside[1] else beside[0]
    pre.pre["beside"] = where
    _log(f"[sweep] capture render and kernel bench (no new input of a benched shape after {kernel_max_s:.0f} s) on "
         f"{where}, beside the 1-GPU renders; the candidates and every multi-GPU render wait for them")
    pre.thread = threading.Thread(target=_beside, args=(pre.got, ctx, avail, beside, kernel_max_s, budget.left),
                                  name="sweep-kernel-bench", daemon=True)
    pre.thread.start()
    pre.early = [Candidate(BASELINE, BASELINE, [], BASELINE_WHY)]
    if pool is not None and pool.available() > 1:
        pre.early.append(Candidate(REFERENCE, REFERENCE, [], REFERENCE_WHY, is_reference=True))
    return pre


def finish_kernel_bench(ctx: Context, pre: PreRender, ledger: Ledger, budget: Budget,
                        pool: Optional[Pool] = None) -> Optional[list[dict]]:
    """The kernel bench's rows once it ended ([] where there was none), or None where the capture failed (said);
    what it cost goes into ``pre.pre`` and progress.json; the GPU it held goes back to the pool."""
    if pre.thread is not None:
        pre.thread.join()
    if pool is not None and pre.held is not None:
        pool.release(pre.held)
    got = pre.got
    for key in ("capture_s", "kernel_bench_s"):
        if key in got:
            pre.pre[key] = got[key]
    ledger.slowest = max(ledger.slowest, got.get("capture_s", 0.0))
    budget.save(slowest_s=ledger.slowest, pre_render=pre.pre)
    if "error" in got:
        _log(f"[sweep] error: {got['error']}")
        return None
    if "warning" in got:
        _log(f"[sweep] warning: {got['warning']}")
    rows: list[dict] = []
    if (ctx.out / "kernels" / "attention.json").exists():
        bench = json.loads((ctx.out / "kernels" / "attention.json").read_text())
        rows = bench["rows"]
        if bench.get("not_benched") and "kernel_bench_s" in got:
            _log(f"[sweep] kernel bench: {len(bench['not_benched'])} input(s) of shapes already benched left out "
                 f"past its {bench.get('max_s', pre.kernel_max_s):.0f} s (--kernel_max_s)")
    if "kernel_bench_s" in got:
        beside = (f" (on {pre.pre['beside']}, beside {', '.join(c.name for c in pre.early)})"
                  if "beside" in pre.pre else "")
        _log(f"[sweep] before the renders: probe {pre.pre['probe_s']:.1f} s, capture render {got['capture_s']:.0f} "
             f"s, kernel bench {got['kernel_bench_s']:.0f} s{beside}")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# 3. the plan: which renders, and what predicts each one's time
# ----------------------------------------------------------------------------------------------------------------

def plan(ctx: Context, avail: list[dict], bench_rows: list[dict], *, named: list[Candidate], per_layout: int,
         stacks: list[Candidate]) -> tuple[list[Candidate], list[dict], dict[str, float]]:
    """(the renders, the backends left out with why, each backend's attention milliseconds per step): the named
    backends or the kernel bench's fastest within the error bound, beside ``default``, the ``reference`` and the
    stacks; then every layout of each GPU count x the leading ``per_layout`` of them."""
    args, left_out = ctx.args, []
    if named:
        cands = [Candidate(BASELINE, BASELINE, [], BASELINE_WHY),
                 Candidate(REFERENCE, REFERENCE, [], REFERENCE_WHY, is_reference=True), *named, *stacks]
    else:
        cands, left_out = plan_candidates(avail, bench_rows, max_candidates=args.max_candidates,
                                          max_rel_l2=args.max_rel_l2, stacks=stacks)
    if any(n > 1 for n in args.nproc):
        multi, multi_left = layout_candidates(cands, args.nproc, fam=ctx.fam, device=ctx.device,
                                              per_layout=per_layout, task=getattr(args, "task", None) or "t2v")
        cands, left_out = cands + multi, left_out + multi_left
    try:
        calls = calls_per_step(json.loads((ctx.out / "captures" / "metadata_default_rank0.json").read_text()))
    except (OSError, ValueError):
        calls = {}
    return cands, left_out, attention_ms_per_step(bench_rows, calls)


# ----------------------------------------------------------------------------------------------------------------
# 4. the renders: each started only when its estimate fits in what is left, none again that an earlier run finished
# ----------------------------------------------------------------------------------------------------------------

def read_back(ctx: Context, cands: list[Candidate], ledger: Ledger) -> None:
    """The candidates an earlier run rendered (not already in the ledger) into ``ledger.records`` / ``ledger.sets``:
    each content's latest record with its video, or one whose quality was kept beside it (the reference needs its
    frames)."""
    for c in cands:
        folder = ctx.out / "runs" / c.slug
        if c.name in ledger.records or not folder.exists():
            continue
        kept = not c.is_reference and stored_quality(folder)
        got = {}
        for r in records_in(folder):
            i = ctx.content_of(r)
            if i is not None and (video_of(r) is not None or kept):
                got[i] = r
        if got:
            ledger.sets[c.name] = got
            ledger.records[c.name] = got[min(got)]


def estimate(ctx: Context, c: Candidate, ledger: Ledger) -> tuple[float, str]:
    """:func:`estimate_render_s` of ``c`` from what the ledger holds now."""
    return estimate_render_s(c, default_s=default_render_s(ledger.render_s, ledger.records), steps=ctx.args.steps,
                             attn_ms=ledger.attn, fallback_s=ledger.slowest,
                             one_time_s=options_one_time(ledger.records))


def log_plan(ctx: Context, after: list[Candidate], ledger: Ledger, left_s: float, slots: int = 1) -> None:
    """What the renders still to come are estimated at, and which of them fit in ``left_s`` on ``slots`` places."""
    todo = [x for x in after if x.name not in ledger.records and x.name not in ledger.given_up]
    plan_ = plan_renders([(x, *estimate(ctx, x, ledger)) for x in todo for _ in ctx.sets], left_s,
                         quality_s=float(ledger.quality_s or 0.0), slots=slots)
    if not plan_:
        return
    est = ", ".join(dict.fromkeys(f"{p['name']} ~{p['estimate_s']:.0f} s" for p in plan_))
    out = list(dict.fromkeys(p["name"] for p in plan_ if not p["render"]))
    each = f" x {len(ctx.sets)} prompt/seed pairs" if len(ctx.sets) > 1 else ""
    on = f" with {slots} renders at once" if slots > 1 else ""
    _log(f"[sweep] plan for the {left_s:.0f} s left{on}: {est}{each}" + (
        f"; beyond the budget as estimated: {', '.join(out)}" if out else "; all fit"))


def _first_error(log: Path) -> str:
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return "no log"
    return next((ln for ln in lines if ln.startswith("error")), lines[-1] if lines else "empty log")[:200]


def _skip(ledger: Ledger, c: Candidate, why: str, failed: bool = False) -> None:
    ledger.given_up.add(c.name)
    if c.name in ledger.records:  # some of its contents were rendered: it ranks on those
        return
    (ledger.failed if failed else ledger.skipped).append(c.name)
    ledger.left_out.append({"backend": c.name, "why": why})


def _fits_memory(ctx: Context, c: Candidate, ledger: Ledger) -> Optional[str]:
    """Why ``c`` would not fit in ``--max_gpu_mem`` as estimated (:func:`vdbench.sweep.memory.estimate_peak`),
    None where it fits or nothing predicts it."""
    from .memory import GIB, estimate_peak, measured

    if ctx.max_mem is None:
        return None
    base = measured(ledger.records[BASELINE]) if BASELINE in ledger.records else None
    est, basis = estimate_peak(c, base, ctx.weights)
    ledger.mem[c.name] = (est, basis)
    if est is None or est <= ctx.max_mem:
        return None
    return f"memory: estimated peak {est / GIB:.1f} GiB > --max_gpu_mem {ctx.max_mem / GIB:g} ({basis})"


def _job(ctx: Context, c: Candidate, i: int, timeout_s: float, device: Optional[str]) -> Job:
    content = ctx.sets[i]
    tag = f"_{content.tag.replace(' ', '_')}" if content.tag else ""
    return Job(c.name, render_program(ctx.fam.name, ctx.args, c, ctx.out / "runs" / c.slug, ["--overwrite"], content,
                                      device), ctx.out / "logs" / f"{c.slug}{tag}.log", c.nproc, content.tag,
               timeout_s=max(1.0, timeout_s), data=(c, i))


def _ended(ctx: Context, d: Done, ledger: Ledger, budget: Budget, est: float) -> None:
    """A render's end into the ledger: its record (by its content), its seconds and the slowest render so far, or
    why its candidate is given up. Default's frames also time one quality comparison (what each render's quality
    figure will cost at the end)."""
    c, i = d.job.data
    took = d.seconds
    ledger.slowest = max(ledger.slowest, took)
    recs = [r for r in records_in(ctx.out / "runs" / c.slug) if ctx.content_of(r) == i]
    label = f"{c.name}{' ' + d.job.tag if d.job.tag else ''}"
    if d.timed_out:  # stopped by the budget's end (its estimate fell short): skipped for the budget
        with open(d.job.log, "a") as f:
            f.write("\n[sweep] stopped: out of budget\n")
        budget.save(slowest_s=ledger.slowest)
        why = f"budget: stopped when the budget ran out, {took:.0f} s into its render (estimated {est:.0f} s)"
        _skip(ledger, c, why)
        _log(f"[sweep] {label}: {why}")
        return
    if d.code != 0 or not recs:
        budget.save(slowest_s=ledger.slowest)
        _skip(ledger, c, f"render failed (rc {d.code}): {_first_error(d.job.log)}", failed=True)
        _log(f"[sweep] {label}: failed (rc {d.code}); see {d.job.log}")
        return
    ledger.sets.setdefault(c.name, {})[i] = recs[-1]
    if c.name not in ledger.records or i < min(ledger.sets[c.name]):
        ledger.records[c.name] = recs[-1]
    ledger.render_s.setdefault(c.name, took)
    on = f" on GPU {','.join(d.gpus)}" if d.gpus else ""
    _log(f"[sweep] {label}: rendered in {took:.0f} s{on} (estimated {est:.0f} s)")
    if c.name == BASELINE and ledger.quality_s is None and frames_of(recs[-1]) is not None:
        # timed on the GPU default's render just freed (no render is started before this returns), not on one
        # where another render is timing its steps
        device = f"cuda:{ctx.visible.index(d.gpus[0])}" if d.gpus and d.gpus[0] in ctx.visible else \
            ctx.quality_device
        t = time.monotonic()
        path = frames_of(recs[-1])
        quality_of(path, (load_frames(path)[0], path), device)
        ledger.quality_s = time.monotonic() - t
    budget.save(slowest_s=ledger.slowest, render_s=ledger.render_s, quality_s=ledger.quality_s)


def render_all(ctx: Context, jobs: list[Candidate], ledger: Ledger, budget: Budget, pool: Pool) -> None:
    """The renders of ``jobs`` (each candidate once per content of the set), in their order, side by side on the
    pool's places: each started only when a place is free and its estimate (x1.2, plus its quality comparison)
    fits in what is left of the budget -- a render started now on a free place ends when its own time says,
    whatever runs beside it -- and ``--max_gpu_mem`` holds its estimated peak; stopped at the budget's end. Once
    ``default`` is freshly rendered, what its time says of the rest is logged (:func:`log_plan`)."""
    queue: list[tuple[Candidate, int]] = []
    for c in jobs:
        if c.name in ledger.tried:
            continue
        ledger.tried.add(c.name)
        done = ledger.sets.get(c.name, {})
        if c.name in ledger.records and len(done) == len(ctx.sets):
            _log(f"[sweep] {c.name}: done earlier (records read back)")
            continue
        queue += [(c, i) for i in range(len(ctx.sets)) if i not in done]
    ests: dict = {}
    device = "cuda" if pool.gpus else None
    for c in {c.name: c for c, _ in queue if not pool.fits(c.nproc)}.values():
        _skip(ledger, c, f"needs {c.nproc} GPUs, the renders have {len(pool.gpus)}")
        _log(f"[sweep] {c.name}: skipped, needs {c.nproc} GPUs, the renders have {len(pool.gpus)}")
    queue = [(c, i) for c, i in queue if pool.fits(c.nproc)]
    with pool.signals():
        while queue or pool.running:
            while queue and pool.can_start(queue[0][0].nproc):
                c, i = queue.pop(0)
                if c.name in ledger.given_up:
                    continue
                est, basis = estimate(ctx, c, ledger)
                why = _fits_memory(ctx, c, ledger)
                take = plan_renders([(c, est, basis)], budget.left(), quality_s=float(ledger.quality_s or 0.0))[0]
                why = why or take["why"]
                if why:
                    _skip(ledger, c, why)
                    _log(f"[sweep] {c.name}: skipped, {why}")
                    continue
                pool.start(_job(ctx, c, i, budget.left(), device))
                ests[(c.name, i)] = est
            d = pool.wait()
            if d is None:
                continue
            c, i = d.job.data
            fresh = c.name == BASELINE and c.name not in ledger.records
            _ended(ctx, d, ledger, budget, ests.get((c.name, i), 0.0))
            if fresh and c.name in ledger.records:
                log_plan(ctx, list({x.name: x for x, _ in queue}.values()), ledger, budget.left(), pool.available())


# ----------------------------------------------------------------------------------------------------------------
# the stages in order
# ----------------------------------------------------------------------------------------------------------------

def context(args, out: Path) -> Context:
    """The run's :class:`Context`: the family (``--family``, else from the model's name), the device resolved
    (``auto``: CUDA where there is one) into ``args.device``, the task (``--task``, else the model's first), the
    prompt and seed set, the GPUs the renders share and the memory bound."""
    from ..pipelines import parse_model
    from ..pool import parse_gpus
    from ..sets import contents, parse_seeds, read_prompts

    fam = families.get(args.family or family_of(args.model))
    import torch

    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dev_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    if getattr(args, "task", None) is None:
        built = parse_model(args.model, None, fam).built_from
        args.task = next((t for t in (built.tasks if built else ()) if t in fam.tasks), None)
    if args.task in fam.image_tasks and not getattr(args, "img_file_path", None):
        raise ValueError(f"{args.model} renders {args.task}: give the image to animate (--image FILE)")
    prompts = read_prompts(args.prompts) if getattr(args, "prompts", None) else None
    seeds = parse_seeds(args.seeds) if getattr(args, "seeds", None) else None
    visible = visible_gpus(args.device)
    if args.device.startswith("cuda:") and getattr(args, "gpus", "all") in (None, "all"):
        gpus = [visible[int(args.device.partition(":")[2])]]  # one GPU named: the renders' alone
    else:
        gpus = parse_gpus(getattr(args, "gpus", "all"), visible)
    ctx = Context(args, out, fam, dev_name, contents(prompts, seeds), "cuda" if gpus else None)
    ctx.gpus, ctx.gpu_ids, ctx.visible = len(gpus) or 1, gpus, visible
    if getattr(args, "max_gpu_mem", None):
        from .memory import GIB, weights

        ctx.max_mem = float(args.max_gpu_mem) * GIB
        ctx.weights = weights(args.model, args.task, fam)
    return ctx


def family_of(model: str) -> str:
    return "cogvideox" if "cogvideo" in model.lower() else "wan"


def run(args) -> int:
    """The sweep (``args``: :func:`vdbench.sweep.build_parser`'s), stage after stage; its exit status (128 + the
    signal where SIGINT or SIGTERM stopped it: every running render stopped, what was measured kept)."""
    from ..pool import Stopped

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(out, args.budget_min * 60.0, args.stop_after_min * 60.0 if args.stop_after_min else math.inf)
    ctx = context(args, out)
    stacks = [parse_stack(s) for s in args.stacks or []]
    avail, probe_s = probe(ctx)
    per_layout, named = parse_layout_backends(args.layout_backends, avail)
    kernel_max_s = args.kernel_max_s if args.kernel_max_s is not None else KERNEL_SHARE * budget.budget_s
    ledger = Ledger.resume(budget.progress)
    pool = Pool(ctx.gpu_ids, getattr(args, "jobs", None), rdzv=Rendezvous.of(args), env=child_env())
    if pool.limit > 1 or len(ctx.sets) > 1:
        each = f", each candidate on {len(ctx.sets)} prompt/seed pairs" if len(ctx.sets) > 1 else ""
        _log(f"[sweep] renders {pool.describe()}{each}")
    try:
        pre = start_kernel_bench(ctx, avail, named, budget, kernel_max_s=kernel_max_s, probe_s=probe_s, pool=pool)
        read_back(ctx, pre.early, ledger)
        render_all(ctx, pre.early, ledger, budget, pool)  # beside the capture and the kernel bench
        bench_rows = finish_kernel_bench(ctx, pre, ledger, budget, pool)
        if bench_rows is None:
            return 1
        cands, left_out, attn = plan(ctx, avail, bench_rows, named=named, per_layout=per_layout, stacks=stacks)
        ledger.left_out += left_out
        ledger.attn.update(attn)
        order = render_order(cands, slots=pool.available())
        _log(f"[sweep] rendering {len(order)}: {', '.join(c.name for c in order)} ({budget.left():.0f} s of budget "
             f"left)")
        read_back(ctx, order, ledger)
        if any(c.name == BASELINE and c.name in ledger.render_s for c in pre.early):
            log_plan(ctx, order, ledger, budget.left(), pool.available())  # default rendered beside the bench
        render_all(ctx, order, ledger, budget, pool)
    except Stopped as e:
        pool.stop_all(e.signum)
        budget.save(slowest_s=ledger.slowest, render_s=ledger.render_s, quality_s=ledger.quality_s)
        _log(f"[sweep] stopped by {e}: every running render ended; a re-run resumes ({out / 'progress.json'})")
        return 128 + e.signum
    rows, base = quality_rows(ctx, cands, ledger)
    return conclude(ctx, cands, rows, base, ledger, budget, pre.pre,
                    "" if bench_rows else pre.pre.get("kernel_bench", ""))
