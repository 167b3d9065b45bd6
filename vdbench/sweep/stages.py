"""The sweep's stages, each a function of what the ones before it gave, chained by :func:`run`: the probe of what
runs here, the capture render and the kernel bench (beside the first renders where a second GPU is free), the plan,
the renders (a list of candidates and a runner that starts each one's command), the quality figures, and the
verdict with the files it writes. What the stages share is passed as objects: the run's :class:`Context` (fixed),
its :class:`Budget` (seconds, across the runs that resume it) and the renders' :class:`Ledger` (what they
measured)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .. import families
from ..kernel_bench import child_env
from ..measure.record import Record, Writer, command_line, commit, now, read
from ..report import load_frames
from .budget import (attention_ms_per_step, calls_per_step, default_render_s, estimate_render_s, options_one_time,
                     plan_renders, predicted_ranking, render_order)
from .candidates import (BASELINE, BASELINE_WHY, REFERENCE, REFERENCE_WHY, Candidate, availability,
                         layout_candidates, parse_layout_backends, parse_stack, plan_candidates)
from .ranking import (Coverage, frames_of, print_table, quality_baseline, quality_of, rank, row_of, stored_quality,
                      verdict, video_of, warm_of, write_outputs)

#: The kernel bench's share of the budget (``--kernel_max_s``'s default): past it, it starts no further input of a
#: shape already benched. On 4 H200s at Wan 1.3B 480p the unbounded bench (8 captures + a random input, 17 kernels)
#: and the capture took 363 s of a 420 s budget: the renders are what the budget is for.
KERNEL_SHARE = 0.15

#: :func:`run_job`'s status for a command stopped at the end of the budget.
TIMED_OUT = 124


@dataclass
class Context:
    """What every stage reads and none changes: the arguments (``args.device`` resolved), the sweep's folder, the
    model's family and the device's name."""

    args: argparse.Namespace
    out: Path
    fam: families.Family
    dev_name: str

    @property
    def device(self) -> str:
        return self.args.device

    @property
    def quality_device(self) -> Optional[str]:
        """Where the SSIM windows run: the GPU where there is one (on the host they cost half a render)."""
        return self.device if self.device.startswith("cuda") else None


class Budget:
    """The sweep's seconds: ``--budget_min`` over every run that resumes the sweep (what earlier runs spent is kept
    in ``progress.json``, with what they measured: :attr:`progress`), ``--stop_after_min`` for this run alone."""

    def __init__(self, out: Path, budget_s: float, stop_after_s: float = math.inf):
        self.t0 = time.monotonic()
        self.path, self.budget_s, self.stop_after_s = out / "progress.json", budget_s, stop_after_s
        try:
            self.progress = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.progress = {}
        self.spent_before = float(self.progress.get("spent_s", 0.0))
        self.runs = int(self.progress.get("runs", 0)) + 1  # this run's number

    def left(self) -> float:
        now_s = time.monotonic() - self.t0
        return min(self.budget_s - self.spent_before - now_s, self.stop_after_s - now_s)

    def spent(self) -> float:
        return self.spent_before + time.monotonic() - self.t0

    def save(self, **extra) -> None:
        self.progress.update(spent_s=self.spent(), runs=self.runs, **extra)
        self.path.write_text(json.dumps(self.progress))


@dataclass
class Ledger:
    """What the renders measured and decided, read and written by the render stage: the slowest render, each
    render's seconds and one quality comparison's (kept across the runs in ``progress.json``), each candidate's
    record, those skipped for the budget or failed and every left-out one with why, the attention's milliseconds per
    step by backend (what predicts a render's time) and the renders this run started or passed over."""

    slowest: float = 0.0
    render_s: dict = field(default_factory=dict)
    quality_s: Optional[float] = None
    records: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    left_out: list = field(default_factory=list)
    attn: dict = field(default_factory=dict)
    tried: set = field(default_factory=set)

    @classmethod
    def resume(cls, progress: dict) -> "Ledger":
        return cls(float(progress.get("slowest_s", 0.0)), dict(progress.get("render_s") or {}),
                   progress.get("quality_s"))


@dataclass
class PreRender:
    """The stage before the renders: what it cost and where it ran (``pre``: the probe's, the capture render's and
    the kernel bench's seconds, or why there was no bench), the bench's bound, the 1-GPU renders that go on beside it (``early``), and
    what its job reported (``got``) once :func:`finish_kernel_bench` joined it."""

    pre: dict
    kernel_max_s: float = 0.0
    early: list = field(default_factory=list)
    got: dict = field(default_factory=dict)
    thread: Optional[threading.Thread] = None


def _log(msg: str) -> None:
    print(msg, flush=True)


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


def render_cmd(family: str, args, cand: Candidate, out: Path, extra: list[str]) -> list[str]:
    """The command that renders ``cand`` into ``out``: under torchrun for a layout (one process per GPU; a free
    rendezvous port), one process otherwise."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cand.nproc}", "-m",
               "vdbench.cli"] if cand.nproc > 1 else
              [sys.executable, "-c", "import sys; from vdbench.cli import main; sys.exit(main(sys.argv[1], sys.argv[2:]))"])
    return [*launch, family, "--model", args.model, "--height", str(args.height), "--width", str(args.width),
            "--num_frames", str(args.num_frames), "--num_inference_steps", str(args.steps), "--seed",
            str(args.seed), "--device", args.device, "--attention_type", cand.attention,
            "--benchmark_output_directory", str(out), "--save_frames", *cand.flags, *extra]


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
    """The GPUs this process sees, by the ids ``CUDA_VISIBLE_DEVICES`` gives them (indices where it is unset)."""
    if not device.startswith("cuda"):
        return []
    import torch

    n = torch.cuda.device_count()
    ids = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return ids[:n] if ids else [str(i) for i in range(n)]


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
                       kernel_max_s: float, probe_s: float) -> PreRender:
    """The capture render and the kernel bench started: none where the backends are named (``--layout_backends``)
    or an earlier run benched them; on a GPU the renders don't use where there is one (:func:`side_device`: then
    ``default``'s render, which needs no kernel-bench figure, goes on meanwhile: ``early``), else run here, now."""
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
    where = f"GPU {beside[1]['CUDA_VISIBLE_DEVICES']}" if beside[1] else beside[0]
    pre.pre["beside"] = where
    _log(f"[sweep] capture render and kernel bench (no new input of a benched shape after {kernel_max_s:.0f} s) on "
         f"{where}, beside the 1-GPU renders; the candidates and every multi-GPU render wait for them")
    pre.thread = threading.Thread(target=_beside, args=(pre.got, ctx, avail, beside, kernel_max_s, budget.left),
                                  name="sweep-kernel-bench", daemon=True)
    pre.thread.start()
    pre.early = [Candidate(BASELINE, BASELINE, [], BASELINE_WHY)]
    return pre


def finish_kernel_bench(ctx: Context, pre: PreRender, ledger: Ledger, budget: Budget) -> Optional[list[dict]]:
    """The kernel bench's rows once it ended ([] where there was none), or None where the capture failed (said);
    what it cost goes into ``pre.pre`` and progress.json."""
    if pre.thread is not None:
        pre.thread.join()
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
                                              per_layout=per_layout)
        cands, left_out = cands + multi, left_out + multi_left
    try:
        calls = calls_per_step(json.loads((ctx.out / "captures" / "metadata_default_rank0.json").read_text()))
    except (OSError, ValueError):
        calls = {}
    return cands, left_out, attention_ms_per_step(bench_rows, calls)


# ----------------------------------------------------------------------------------------------------------------
# 4. the renders: each started only when its estimate fits in what is left, none again that an earlier run finished
# ----------------------------------------------------------------------------------------------------------------

def read_back(out: Path, cands: list[Candidate], records: dict) -> dict:
    """{name: record} of the candidates an earlier run rendered (not already in ``records``): a record with its
    video, or one whose quality was kept beside it (the reference needs its frames)."""
    found = {}
    for c in cands:
        folder = out / "runs" / c.slug
        done = records_in(folder) if folder.exists() and c.name not in records else []
        if done and (video_of(done[-1]) is not None or (not c.is_reference and stored_quality(folder))):
            found[c.name] = done[-1]
    return found


def estimate(ctx: Context, c: Candidate, ledger: Ledger) -> tuple[float, str]:
    """:func:`estimate_render_s` of ``c`` from what the ledger holds now."""
    return estimate_render_s(c, default_s=default_render_s(ledger.render_s, ledger.records), steps=ctx.args.steps,
                             attn_ms=ledger.attn, fallback_s=ledger.slowest,
                             one_time_s=options_one_time(ledger.records))


def log_plan(ctx: Context, after: list[Candidate], ledger: Ledger, left_s: float) -> None:
    """What the renders still to come are estimated at, and which of them fit in ``left_s``."""
    plan_ = plan_renders([(x, *estimate(ctx, x, ledger)) for x in after if x.name not in ledger.records], left_s,
                         quality_s=float(ledger.quality_s or 0.0))
    if not plan_:
        return
    est = ", ".join(f"{p['name']} ~{p['estimate_s']:.0f} s" for p in plan_)
    out = [p["name"] for p in plan_ if not p["render"]]
    _log(f"[sweep] plan for the {left_s:.0f} s left: {est}" + (
        f"; beyond the budget as estimated: {', '.join(out)}" if out else "; all fit"))


def _first_error(out: Path, c: Candidate) -> str:
    try:
        lines = (out / "logs" / f"{c.slug}.log").read_text().splitlines()
    except OSError:
        return "no log"
    return next((ln for ln in lines if ln.startswith("error")), lines[-1] if lines else "empty log")[:200]


def _skip(ledger: Ledger, c: Candidate, why: str, failed: bool = False) -> None:
    (ledger.failed if failed else ledger.skipped).append(c.name)
    ledger.left_out.append({"backend": c.name, "why": why})


def render_one(ctx: Context, c: Candidate, ledger: Ledger, budget: Budget, runner=run_job) -> None:
    """Render ``c`` (once a run) where its estimate fits in what is left, into ``runs/<slug>/``; its record, its
    seconds and the slowest render so far go into the ledger, or why it was skipped or failed. Default's frames also
    time one quality comparison (what each render's quality figure will cost at the end)."""
    if c.name in ledger.tried:
        return
    ledger.tried.add(c.name)
    if c.name in ledger.records:
        _log(f"[sweep] {c.name}: done earlier (records read back)")
        return
    folder = ctx.out / "runs" / c.slug
    est, basis = estimate(ctx, c, ledger)
    take = plan_renders([(c, est, basis)], budget.left(), quality_s=float(ledger.quality_s or 0.0))[0]
    if not take["render"]:
        _skip(ledger, c, take["why"])
        _log(f"[sweep] {c.name}: skipped, {take['why']}")
        return
    t = time.monotonic()
    rc = runner(render_cmd(ctx.fam.name, ctx.args, c, folder, ["--overwrite"]), ctx.out / "logs" / f"{c.slug}.log",
                budget.left())
    recs = records_in(folder)
    took = time.monotonic() - t
    ledger.slowest = max(ledger.slowest, took)
    if rc == TIMED_OUT:  # stopped by the budget's end (its estimate fell short): skipped for the budget
        budget.save(slowest_s=ledger.slowest)
        why = f"budget: stopped when the budget ran out, {took:.0f} s into its render (estimated {est:.0f} s)"
        _skip(ledger, c, why)
        _log(f"[sweep] {c.name}: {why}")
        return
    if rc != 0 or not recs:
        budget.save(slowest_s=ledger.slowest)
        _skip(ledger, c, f"render failed (rc {rc}): {_first_error(ctx.out, c)}", failed=True)
        _log(f"[sweep] {c.name}: failed (rc {rc}); see {ctx.out / 'logs' / (c.slug + '.log')}")
        return
    ledger.records[c.name], ledger.render_s[c.name] = recs[-1], took
    _log(f"[sweep] {c.name}: rendered in {took:.0f} s (estimated {est:.0f} s)")
    if c.name == BASELINE and ledger.quality_s is None and frames_of(recs[-1]) is not None:
        t = time.monotonic()
        path = frames_of(recs[-1])
        quality_of(path, (load_frames(path)[0], path), ctx.quality_device)
        ledger.quality_s = time.monotonic() - t
    budget.save(slowest_s=ledger.slowest, render_s=ledger.render_s, quality_s=ledger.quality_s)


def render_all(ctx: Context, jobs: list[Candidate], ledger: Ledger, budget: Budget, runner=run_job) -> None:
    """The renders of ``jobs`` in their order (:func:`render_one` each); once ``default`` is freshly rendered, what
    its time says of the rest is logged (:func:`log_plan`)."""
    for i, c in enumerate(jobs):
        fresh = c.name not in ledger.records
        render_one(ctx, c, ledger, budget, runner)
        if c.name == BASELINE and fresh and c.name in ledger.records:
            log_plan(ctx, jobs[i + 1:], ledger, budget.left())


# ----------------------------------------------------------------------------------------------------------------
# 5. the quality of each render against the exact reference, or the exact-kernel render standing in for it
# ----------------------------------------------------------------------------------------------------------------

def quality_rows(ctx: Context, cands: list[Candidate], ledger: Ledger) -> tuple[list[dict], Optional[str]]:
    """(a row per rendered candidate, the quality baseline's name or None): each row's quality read from its frames
    against the baseline's, or kept from an earlier run against the same baseline (``quality.json`` beside the
    render, written here: it ranks the render on a resume that has only the baseline's frames)."""
    records = ledger.records
    warm = {n: warm_of(r)[0] for n, r in records.items()}
    base = quality_baseline(cands, warm)
    base_frames = None
    if base is not None and frames_of(records[base]) is not None:
        base_frames = (load_frames(frames_of(records[base]))[0], frames_of(records[base]))
    if base is not None and base != REFERENCE:
        _log(f"[sweep] quality read against {base}, the fastest exact-kernel render: the exact {REFERENCE} was "
             f"not rendered")
    rows = []
    for c in cands:
        if c.name not in records:
            continue
        folder = ctx.out / "runs" / c.slug
        stored = stored_quality(folder)
        if stored is not None and stored.get("vs", REFERENCE) != base:
            stored = None  # against another baseline (the reference was rendered since): read again from the frames
        row = row_of(c, records[c.name], base_frames, stored, ctx.quality_device, quality_vs=base or REFERENCE)
        if stored is None and c.name != base and row["psnr_db"] is not None:
            (folder / "quality.json").write_text(json.dumps({"psnr": row["psnr_db"], "ssim": row["ssim"],
                                                             "from": row["quality_from"], "vs": base}))
        rows.append(row)
    return rows, base


# ----------------------------------------------------------------------------------------------------------------
# 6. the ranking, the verdict and the files
# ----------------------------------------------------------------------------------------------------------------

def coverage_of(cands: list[Candidate], ledger: Ledger, warm_default: Optional[float], no_bench: str) -> Coverage:
    """What the verdict rests on: the candidates planned, rendered, skipped and failed, and the kernel bench's
    ranking of them (``no_bench``: why there was none, "" where there was)."""
    planned = [c.name for c in cands if c.name != BASELINE and not c.is_reference]
    predicted, predicted_is = predicted_ranking(cands, ledger.attn, warm_default)
    return Coverage(planned, [n for n in planned if n in ledger.records], [n for n in ledger.skipped if n in planned],
                    [n for n in ledger.failed if n in planned], predicted, predicted_is, no_bench)


def verdict_text(ctx: Context, cands: list[Candidate], rows: list[dict], quality_vs: str, coverage: Coverage) -> str:
    """The verdict line; with renders on several GPU counts, one per count (each over that count's renders, quality
    against the same baseline), joined by `` | ``."""
    args = ctx.args
    counts = sorted({c.nproc for c in cands})
    if counts == [1]:
        return verdict(rows, device=ctx.dev_name, model=args.model, tolerance_db=args.psnr_tolerance_db,
                       quality_vs=quality_vs, coverage=coverage)
    gpus_of = {c.name: c.nproc for c in cands}
    return " | ".join(verdict(rows, device=f"{ctx.dev_name} x{n}" if n > 1 else ctx.dev_name, model=args.model,
                              tolerance_db=args.psnr_tolerance_db, quality_vs=quality_vs,
                              coverage=coverage.of(lambda name, n=n: gpus_of.get(name, 1) == n), gpus=n)
                      for n in counts)


def conclude(ctx: Context, cands: list[Candidate], rows: list[dict], base: Optional[str], ledger: Ledger,
             budget: Budget, pre: dict, no_bench: str) -> int:
    """Rank the rows, say the verdict, write sweep.csv / sweep.json / report.html / records.jsonl and the table;
    0 where a render gave a row, 1 otherwise."""
    args, out, vs = ctx.args, ctx.out, base or REFERENCE
    rows = rank(rows)
    warm_default = warm_of(ledger.records[BASELINE])[0] if BASELINE in ledger.records else None
    coverage = coverage_of(cands, ledger, warm_default, no_bench)
    text = verdict_text(ctx, cands, rows, vs, coverage)
    meta = {"model": args.model, "family": ctx.fam.name, "device": ctx.dev_name, "height": args.height,
            "width": args.width, "num_frames": args.num_frames, "steps": args.steps, "verdict": text,
            "left_out": ledger.left_out, "command": command_line(), "commit": commit(), "budget_min": args.budget_min,
            "elapsed_s": budget.spent(), "runs": budget.runs, "quality_vs": vs,
            "coverage": dataclasses.asdict(coverage), "pre_render": pre}
    budget.save()
    write_outputs(out, rows, meta)
    Writer(out / "records.jsonl").write(*(Record(
        suite="sweep", case=r["stack"], config={"model": args.model, "size": [args.height, args.width],
                                                "num_frames": args.num_frames, "steps": args.steps,
                                                "attention": r["attention"], "stack": r["stack"]},
        figures={k: r[k] for k in ("warm_ms", "p20_ms", "p80_ms", "n", "speedup", "end_to_end_s", "one_time_s",
                                   "psnr_db", "ssim", "peak_gib")},
        verdict={"speed_figure": r["speed_figure"], "why_not": r["why_not_speed"]}, command=meta["command"],
        commit=meta["commit"], created=now(), data=r) for r in rows))
    print_table(rows, vs)
    _log(f"[sweep] {text}")
    runs = f" over {meta['runs']} runs" if meta["runs"] > 1 else ""
    _log(f"[sweep] {out / 'report.html'}, {out / 'sweep.csv'} ({meta['elapsed_s']:.0f} s of "
         f"{budget.budget_s:.0f} s budget{runs})")
    return 0 if rows else 1


# ----------------------------------------------------------------------------------------------------------------
# the stages in order
# ----------------------------------------------------------------------------------------------------------------

def context(args, out: Path) -> Context:
    """The run's :class:`Context`: the family (``--family``, else from the model's name) and the device resolved
    (``auto``: CUDA where there is one) into ``args.device``, which the renders are given."""
    fam = families.get(args.family or family_of(args.model))
    import torch

    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dev_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    return Context(args, out, fam, dev_name)


def family_of(model: str) -> str:
    return "cogvideox" if "cogvideo" in model.lower() else "wan"


def run(args) -> int:
    """The sweep (``args``: :func:`vdbench.sweep.build_parser`'s), stage after stage; its exit status."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(out, args.budget_min * 60.0, args.stop_after_min * 60.0 if args.stop_after_min else math.inf)
    ctx = context(args, out)
    stacks = [parse_stack(s) for s in args.stacks or []]
    avail, probe_s = probe(ctx)
    per_layout, named = parse_layout_backends(args.layout_backends, avail)
    kernel_max_s = args.kernel_max_s if args.kernel_max_s is not None else KERNEL_SHARE * budget.budget_s
    ledger = Ledger.resume(budget.progress)
    pre = start_kernel_bench(ctx, avail, named, budget, kernel_max_s=kernel_max_s, probe_s=probe_s)
    ledger.records.update(read_back(out, pre.early, ledger.records))
    render_all(ctx, pre.early, ledger, budget)  # beside the capture and the kernel bench, on the renders' own GPU
    bench_rows = finish_kernel_bench(ctx, pre, ledger, budget)
    if bench_rows is None:
        return 1
    cands, left_out, attn = plan(ctx, avail, bench_rows, named=named, per_layout=per_layout, stacks=stacks)
    ledger.left_out += left_out
    ledger.attn.update(attn)
    order = render_order(cands)
    _log(f"[sweep] rendering {len(order)}: {', '.join(c.name for c in order)} ({budget.left():.0f} s of budget left)")
    ledger.records.update(read_back(out, order, ledger.records))
    if any(c.name == BASELINE and c.name in ledger.render_s for c in pre.early):
        log_plan(ctx, order, ledger, budget.left())  # default rendered beside the kernel bench: what its time says
    render_all(ctx, order, ledger, budget)
    rows, base = quality_rows(ctx, cands, ledger)
    return conclude(ctx, cands, rows, base, ledger, budget, pre.pre,
                    "" if bench_rows else pre.pre.get("kernel_bench", ""))
