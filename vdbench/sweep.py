"""Which attention backend for this model, at this size, on this machine: one command that measures and ranks.

    python sweep.py --model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81 --budget_min 15
    python sweep.py --model tiny --budget_min 3                        # on a CPU: the plumbing, no speed figures
    python sweep.py --model tiny --stacks "fav3+compile" "sdpa+vae=fast"   # stacks beside the plain backends

What it does, in order, everything under ``--out`` (default ``outputs/sweep``):

1. **What runs here**: every registered backend with whether it can run on this device, and why not
   (``backends.txt``).
2. **The model's real attention inputs**: one short render with ``--save_inputs`` (one denoising step), then
   ``bench/bench_attention.py`` on those captures for every backend that runs here: speed with n and spread,
   accuracy against exact fp64 attention (``kernels/``: its CSV, JSON and records).
3. **Renders**: the candidates -- the backends that run here, are not emulations, and stayed within
   ``--max_rel_l2`` of exact attention on the captures, fastest first, at most ``--max_candidates`` -- plus the
   pipeline's own attention (``default``, the speed baseline), the exact ``reference`` (the quality baseline) and
   every ``--stacks`` entry, same prompt, seed and size, each in its own process and folder (``runs/<name>/``).
   A render is skipped when the budget left is below what the slowest render so far took (+20%); a re-run skips
   the renders already done (their records are read back) and spends what is left of the same budget
   (``progress.json``); ``--stop_after_min`` bounds one run alone (a machine lent for ten minutes at a time).
4. **The ranking** (``sweep.csv``, ``sweep.json``, ``report.html``, ``records.jsonl``): warm ms/step with p20-p80
   and n, speed-up against ``default``, end-to-end seconds, one-time seconds, PSNR / SSIM against ``reference``,
   peak memory, the kernels that ran; the Pareto set on (warm step, PSNR); and the verdict line: the fastest
   within ``--psnr_tolerance_db`` of exact, and the fastest overall.

A stack is ``<attention type>[+option...]`` (:func:`vdbench.measure.record.split_stack`): ``compile``
(``--use_torch_compile``), ``compile=<backend>[:<mode>]`` (with ``--compile_backend`` / ``--compile_mode``),
``fp8gemm`` (``--use_fp8_gemms``), ``bf16te`` (``--use_bf16_te_gemms``), ``vae=<mode>`` (``--vae_decode``),
``encode=<mode>`` (``--vae_encode``), a step cache's spec (``--cache``: ``fbc:threshold=0.05``, or
``cache=fbc:threshold=0.05``). Its row is named by the stack's one spelling, the ``stack`` its render records
(``sagev2_fp8:gran=per_warp+compile+fp8gemm+vae=fast``). CPU figures are not
speed figures (said in the verdict and per row); emulations are never ranked on speed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import html
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import backends as B
from . import families
from .helptext import DefaultsHelpFormatter
from .measure.record import Record, Writer, command_line, commit, now, read
from .report import break_even, break_even_text, load_frames, pareto_front

__all__ = ["Candidate", "parse_stack", "plan_candidates", "rank", "verdict", "main"]

ROOT = Path(__file__).resolve().parents[1]

#: The speed baseline (the pipeline's own attention) and the quality reference (exact attention) every sweep renders.
BASELINE, REFERENCE = "default", "reference"

#: Stack options -> the render flags they add (the grammar: :func:`vdbench.measure.record.split_stack`).
STACK_OPTIONS = {"compile": ["--use_torch_compile"], "fp8gemm": ["--use_fp8_gemms"], "bf16te": ["--use_bf16_te_gemms"]}
STACK_VALUES = {"vae": "--vae_decode", "encode": "--vae_encode", "cache": "--cache"}


@dataclass
class Candidate:
    """One render of the sweep: its name (the stack's one spelling: what the render records as its ``stack``), the
    attention type and the extra render flags; ``why``: why it is in the sweep (a role or the kernel bench's
    figure)."""

    name: str
    attention: str
    flags: list = field(default_factory=list)
    why: str = ""
    is_reference: bool = False

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.name)


def parse_stack(text: str) -> Candidate:
    """``"fav3+compile+vae=fast"`` -> Candidate(attention="fav3", flags=[...]), named by the stack's one spelling
    (:func:`vdbench.measure.record.stack_name`: the attention's alias resolved, the options in their order, the step
    cache's spec bare and canonical) -- the ``stack`` its render records; ValueError naming the valid options
    otherwise (the attention type itself is checked by the render, before it loads anything)."""
    from .cache import KINDS, parse_cache
    from .cli import canonical_attention
    from .measure.record import speed_options, stack_name, split_stack

    head, opts = split_stack(text, cache_kinds=KINDS)
    flags: list[str] = []
    given: dict = {}
    for key, value in opts:
        given[key] = value
        if key == "compile" and value is not None:
            backend, _, mode = value.partition(":")
            flags += ["--use_torch_compile", "--compile_backend", backend] + (["--compile_mode", mode] if mode else [])
        elif value is None:
            flags += STACK_OPTIONS[key]
        else:
            flags += [STACK_VALUES[key], value]
    compile_backend, _, compile_mode = (given.get("compile") or "inductor").partition(":")
    cache = parse_cache(given["cache"]) if "cache" in given else None
    name = stack_name(canonical_attention(head),
                      speed_options("compile" in given, compile_backend, compile_mode or None, "fp8gemm" in given,
                                    "bf16te" in given),
                      given.get("vae"), given.get("encode"), cache.name if cache else None)
    return Candidate(name, head, flags, "asked for (--stacks)")


def availability(device) -> list[dict]:
    """Every registered backend and each of its ``variants`` (``fav3_fp8:smooth_v=1``): can it run on ``device``,
    and why not."""
    out = []
    for name in B.names():
        b = B.BACKENDS[name]
        ok, why = b.availability(device)
        for spec in (name, *(B.resolve(f"{name}:{v}").name for v in b.variants)):
            out.append({"backend": spec, "runs": bool(ok), "why_not": None if ok else why,
                        "emulated": b.emulated})
    return out


def plan_candidates(avail: list[dict], bench_rows: list[dict], *, max_candidates: int, max_rel_l2: float,
                    stacks: list[Candidate], baseline: str = BASELINE,
                    reference: str = REFERENCE) -> tuple[list[Candidate], list[dict]]:
    """(the renders, the backends left out with why): the runnable, non-emulated backends (baseline and reference
    aside) within ``max_rel_l2`` on the captures, fastest first, at most ``max_candidates``; then the baseline,
    the reference and the stacks. Fastest: the least total time over the bench's inputs (what a step pays for those
    calls: a self-attention of 32k tokens weighs what it costs, not what a cross-attention call does), an input a
    kernel could not run counted at the slowest kernel's time on it."""
    by: dict[str, list[dict]] = {}
    for r in bench_rows:
        by.setdefault(B.resolve(r["kernel"]).name if r.get("kernel") else "", []).append(r)
    scored, left_out = [], []
    for a in avail:
        name = a["backend"]
        if name in (baseline, reference):
            continue
        if not a["runs"]:
            left_out.append({"backend": name, "why": f"can't run here: {a['why_not']}"})
            continue
        if a["emulated"]:
            left_out.append({"backend": name, "why": "emulation (accuracy only, never a speed)"})
            continue
        rows = [r for r in by.get(name, []) if str(r.get("status", "")).startswith("ok")]
        if not rows:
            why = next((r.get("status") for r in by.get(name, []) if r.get("status")), "no kernel-bench row")
            left_out.append({"backend": name, "why": f"kernel bench: {why}"})
            continue
        errs = [float(r["rel_l2"]) for r in rows if r.get("rel_l2") not in (None, "")]
        err = max(errs) if errs else math.nan
        if not errs or err > max_rel_l2:
            left_out.append({"backend": name, "why": f"rel L2 {err:.3g} vs exact on the captures > {max_rel_l2:g}"})
            continue
        times = {_input_of(r, i): float(r["time_ms"]) for i, r in enumerate(rows) if r.get("time_ms") not in (None, "")}
        scored.append((times, name, err))
    slowest: dict = {}
    for times, _, _ in scored:
        for k, t in times.items():
            slowest[k] = max(t, slowest.get(k, t))
    scored = sorted(((sum(times.get(k, s) for k, s in slowest.items()) if times else math.inf, name, err)
                     for times, name, err in scored), key=lambda x: (x[0], x[1]))
    chosen = [Candidate(n, n, [], f"kernel bench: {t:.3g} ms over its inputs, rel L2 {e:.2g}")
              for t, n, e in scored[:max_candidates]]
    left_out += [{"backend": n, "why": f"beyond --max_candidates {max_candidates}"} for _, n, _ in
                 scored[max_candidates:]]
    return [Candidate(baseline, baseline, [], "baseline: the pipeline's own attention"),
            Candidate(reference, reference, [], "quality reference: exact attention", is_reference=True), *chosen,
            *stacks], left_out


def _input_of(row: dict, i: int):
    """Which input a kernel-bench row timed (its file, or the synthetic input's name), with its shape."""
    name = row.get("input")
    return (name, row.get("Sq"), row.get("D")) if name not in (None, "") else i


def _render_cmd(family: str, args, cand: Candidate, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-c", "import sys; from vdbench.cli import main; sys.exit(main(sys.argv[1], sys.argv[2:]))",
            family, "--model", args.model, "--height", str(args.height), "--width", str(args.width),
            "--num_frames", str(args.num_frames), "--num_inference_steps", str(args.steps), "--seed",
            str(args.seed), "--device", args.device, "--attention_type", cand.attention,
            "--benchmark_output_directory", str(out), "--save_frames", *cand.flags, *extra]


def _records(folder: Path) -> list[Record]:
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


def _video(rec: Record) -> Optional[Path]:
    out = rec.data.get("output")
    return Path(out) if out and Path(out).exists() else None


def _frames(rec: Record) -> Optional[Path]:
    """The frames a render's quality is read from: its raw uint8 frames (``--save_frames``' ``.npy`` beside the
    video) where they are there, else its video; None where neither is.

    Why the raw frames: each video is encoded on its own, so the codec's noise differs between two videos of
    nearly equal frames -- on Wan 1.3B 480p it holds every bf16 backend near 33 dB against the reference whose raw
    frames they match to 43-44 dB, hiding the differences the sweep ranks on."""
    video = _video(rec)
    if video is None:
        return None
    raw = video.with_suffix(".npy")
    return raw if raw.is_file() else video


#: what a quality figure was computed from (the ``quality_from`` column)
RAW, CODEC = "raw frames", "decoded videos (codec noise: PSNR capped near 33 dB at 480p)"


def quality_of(frames_path: Optional[Path], ref, device=None) -> Optional[dict]:
    """{"psnr", "ssim", "from"} of the render whose frames are at ``frames_path`` (:func:`_frames`) against the
    reference's (``ref``: (frames, path)), or None where either is missing or their shapes differ; ``from`` is
    :data:`RAW` only when both sides are raw frames. ``device``: where the SSIM windows run (on the H200 machine's
    CPU they took ~27 s per 480p x 81 render, half as long as the render: time the sweep's budget spends)."""
    if frames_path is None or ref is None:
        return None
    from .measure.quality import frame_quality

    ref_frames, ref_path = ref
    frames, _ = load_frames(frames_path)
    if frames.shape != ref_frames.shape:
        return None
    q = frame_quality(frames, ref_frames, device=device)
    raw = frames_path.suffix == ".npy" and ref_path.suffix == ".npy"
    return {"psnr": q["psnr"], "ssim": q["ssim"], "from": RAW if raw else CODEC}


def _stored_quality(folder: Path) -> Optional[dict]:
    """The quality a render's folder keeps (``quality.json``, written when it was rendered): what ranks it where its
    video is not at hand (a sweep resumed on another machine carries the reference's video only)."""
    try:
        q = json.loads((folder / "quality.json").read_text())
    except (OSError, ValueError):
        return None
    return q if isinstance(q, dict) and "psnr" in q else None


def row_of(cand: Candidate, rec: Record, ref, stored: Optional[dict] = None, device=None) -> dict:
    """A candidate's row from its render's record (the last repetition) and its quality against the reference:
    ``stored`` (as kept beside it when it was rendered), else from its frames and the reference's (``ref``:
    (frames, path), :func:`quality_of`; SSIM on ``device``); the reference's own row is exact by definition
    (``ref`` holds its frames: not read twice)."""
    step = rec.figures.get("step_ms") or {}
    peak = rec.figures.get("peak_memory_bytes")
    # a step cache makes steps of two kinds (computed, reused): the median is one kind's time, the mean the render's
    cached = bool(rec.config.get("cache"))
    video = _video(rec)
    row = {"stack": cand.name, "attention": cand.attention, "why": cand.why, "is_reference": cand.is_reference,
           "warm_ms": step.get("mean" if cached else "median"), "warm_is": "mean" if cached else "median",
           "p20_ms": step.get("p20"), "p80_ms": step.get("p80"),
           "n": step.get("n"), "first_step_ms": step.get("first"),
           "end_to_end_s": rec.figures.get("end_to_end_s"), "one_time_s": rec.figures.get("one_time_s"),
           "peak_gib": None if peak is None else peak / 2**30,
           "speed_figure": rec.verdict.get("speed_figure"), "why_not_speed": rec.verdict.get("why_not"),
           "emulated": bool((rec.config.get("backend") or {}).get("emulated")),
           "kernels": ", ".join(f"{k}×{v}" for k, v in
                                ((rec.data.get("attention") or {}).get("calls_by_kernel") or {}).items()),
           "psnr_db": None, "ssim": None, "quality_from": None, "video": str(video or "")}
    if cand.is_reference:
        q = {"psnr": math.inf, "ssim": 1.0, "from": RAW if ref is not None and ref[1].suffix == ".npy" else CODEC} \
            if video is not None and ref is not None else None
    else:
        q = stored or quality_of(_frames(rec), ref, device)
    if q is not None:
        # a quality kept before the raw frames were read says nothing of its source: the videos'
        row["psnr_db"], row["ssim"], row["quality_from"] = q["psnr"], q["ssim"], q.get("from", CODEC)
    return row


def rank(rows: list[dict], baseline: str = BASELINE) -> list[dict]:
    """Rows sorted by warm step (emulations and rows without a step last), with the speed-up against
    ``baseline``, the break-even steps against it (:func:`vdbench.report.break_even`: one-time cost against the
    gain per step) and the Pareto mark on (warm step, PSNR vs reference)."""
    base = next((r for r in rows if r["stack"] == baseline and r["warm_ms"]), None)
    for r in rows:
        r["speedup"] = (base["warm_ms"] / r["warm_ms"]) if base and r["warm_ms"] and not r["emulated"] else None
        # from how many steps a render of this stack beats one of the baseline: its one-time cost against its gain
        r["break_even"] = None if base is None or r is base or r["emulated"] or not r["warm_ms"] else break_even_text(
            break_even(r.get("one_time_s"), r["warm_ms"] / 1e3, base.get("one_time_s"), base["warm_ms"] / 1e3))
    pts = [(r["warm_ms"], math.inf if r["psnr_db"] is None and r.get("is_reference") else r["psnr_db"],
            r["stack"]) for r in rows if r["warm_ms"] and not r["emulated"] and
           (r["psnr_db"] is not None or r.get("is_reference"))]
    front = {label for _, _, label in pareto_front(pts)}
    for r in rows:
        r["pareto"] = r["stack"] in front
    return sorted(rows, key=lambda r: (r["emulated"] or not r["warm_ms"], r["warm_ms"] or math.inf))


def verdict(rows: list[dict], *, device: str, model: str, tolerance_db: float) -> str:
    """One line: the fastest within ``tolerance_db`` of exact, and the fastest overall with its PSNR."""
    timed = [r for r in rows if r["warm_ms"] and not r["emulated"] and not r.get("is_reference")]
    if not timed:
        return f"on this {device} for {model}: no render gave a warm step (see the rows' notes)"
    speed = all(r["speed_figure"] for r in timed)
    exact_db = _exact_db(rows)
    near = [r for r in timed if r["psnr_db"] is not None and r["psnr_db"] >= exact_db - tolerance_db]
    best = min(near, key=lambda r: r["warm_ms"]) if near else None
    fastest = min(timed, key=lambda r: r["warm_ms"])
    text = f"on this {device} for {model}: "
    if best is not None:
        scale = "identical to exact" if math.isinf(exact_db) else f"exact attention's {exact_db:.1f} dB"
        text += (f"{best['stack']} is fastest within {tolerance_db:g} dB of {scale} ({best['warm_ms']:.4g} "
                 f"ms/step{_x(best)}, {_db(best)})")
    else:
        text += "no render reached exact attention's quality"
    if fastest is not best:
        text += (f"; {fastest['stack']} is fastest overall ({fastest['warm_ms']:.4g} ms/step{_x(fastest)}, "
                 f"{_db(fastest)})")
    if not speed:
        why = next((r["why_not_speed"] for r in timed if not r["speed_figure"]), "")
        text += f" -- NOT speed figures ({why})"
    return text


def _exact_db(rows, baseline: str = BASELINE) -> float:
    """The quality 'within N dB of exact' reads on: the PSNR against the fp64/fp32 ``reference`` of the pipeline's
    own attention (exact math in the model's dtype: what no faster backend needs to beat), else the best PSNR of
    the batch."""
    base = next((r["psnr_db"] for r in rows if r["stack"] == baseline and r["psnr_db"] is not None), None)
    if base is not None:
        return base
    got = [r["psnr_db"] for r in rows if r["psnr_db"] is not None and not r.get("is_reference")]
    return max(got) if got else math.inf


def _x(r) -> str:
    return f", {r['speedup']:.2f}x default" if r.get("speedup") else ""


def _db(r) -> str:
    if r["psnr_db"] is None:
        return "PSNR n/a"
    codec = " (decoded videos: codec-capped)" if r.get("quality_from") == CODEC else ""
    return f"{r['psnr_db']:.1f} dB vs the reference{codec}"


COLUMNS = ["stack", "warm_ms", "warm_is", "p20_ms", "p80_ms", "n", "speedup", "first_step_ms", "end_to_end_s",
           "one_time_s", "break_even", "psnr_db", "ssim", "quality_from", "peak_gib", "pareto", "speed_figure", "why_not_speed",
           "emulated", "kernels", "why", "attention", "video"]
#: The report's table: the CSV's columns up to the kernels that ran.
HTML_COLUMNS = COLUMNS[:COLUMNS.index("kernels") + 1]


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def write_outputs(out: Path, rows: list[dict], meta: dict) -> None:
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "sweep.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in HTML_COLUMNS)
    body = "".join("<tr" + (' class="pareto"' if r["pareto"] else "") + ">" +
                   "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in HTML_COLUMNS) + "</tr>" for r in rows)
    left = "".join(f"<li>{html.escape(x['backend'])}: {html.escape(x['why'])}</li>" for x in meta["left_out"])
    (out / "report.html").write_text(
        "<!doctype html><meta charset=utf-8><title>vdbench sweep</title><style>body{font:14px sans-serif}"
        "td,th{border:1px solid #ccc;padding:2px 6px}table{border-collapse:collapse}.pareto{background:#e8f5e9}"
        f"</style><h1>Which backend: {html.escape(meta['model'])}</h1><p><b>{html.escape(meta['verdict'])}</b></p>"
        f"<p>{html.escape(meta['device'])}; {meta['height']}x{meta['width']}, {meta['num_frames']} frames, "
        f"{meta['steps']} steps; warm = median of the steps after the first (p20-p80, n), their mean for a stack with a "
        f"step cache (its steps are of two kinds: warm_is says which); green rows: the Pareto "
        f"set on (warm step, PSNR vs reference). Command: <code>{html.escape(meta['command'])}</code>; commit "
        f"{html.escape(str(meta['commit']))}.</p><table><tr>{head}</tr>{body}</table>"
        f"<h2>Not rendered</h2><ul>{left}</ul><p>Kernel bench on the captures: kernels/attention.csv</p>")


def _log(msg: str) -> None:
    print(msg, flush=True)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    budget = args.budget_min * 60.0
    # the budget is the whole sweep's, across re-runs that resume it: what earlier runs spent is kept in progress.json
    progress_path = out / "progress.json"
    try:
        progress = json.loads(progress_path.read_text())
    except (OSError, ValueError):
        progress = {}
    spent_before, runs_before = float(progress.get("spent_s", 0.0)), int(progress.get("runs", 0))
    stop_after = args.stop_after_min * 60.0 if args.stop_after_min else math.inf

    def left() -> float:
        now = time.monotonic() - t0
        return min(budget - spent_before - now, stop_after - now)

    def save_progress(**extra) -> None:
        progress.update(spent_s=spent_before + time.monotonic() - t0, runs=runs_before + 1, **extra)
        progress_path.write_text(json.dumps(progress))
    fam = families.get(args.family or _family_of(args.model))
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    args.device = device
    dev_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    stacks = [parse_stack(s) for s in args.stacks or []]

    avail = availability(device)
    (out / "backends.txt").write_text("".join(
        f"{a['backend']:22s} {'runs' if a['runs'] else 'no: ' + str(a['why_not'])}\n" for a in avail))
    n_run = sum(a["runs"] for a in avail)
    _log(f"[sweep] {n_run} of {len(avail)} backends run on {dev_name} ({out / 'backends.txt'})")

    # 2. capture the model's attention inputs with one short render, then bench every runnable kernel on them
    caps, kdir = out / "captures", out / "kernels"
    bench_rows: list[dict] = []
    capture_s = 0.0
    if not (kdir / "attention.json").exists():
        cap = Candidate("capture", BASELINE)
        cmd = _render_cmd(fam.name, argparse.Namespace(**{**vars(args), "steps": 1}), cap, out / "capture_run",
                          ["--save_inputs", "--input_dir", str(caps), "--max_captures", str(args.max_captures),
                           "--overwrite"])
        t = time.monotonic()
        rc = _run(cmd, out / "logs" / "capture.log", left())
        capture_s = time.monotonic() - t  # a lower bound of a render's time: the first render's budget check
        save_progress(slowest_s=max(capture_s, float(progress.get("slowest_s", 0.0))))
        if rc != 0:
            _log(f"[sweep] error: the capture render failed (rc {rc}); see {out / 'logs' / 'capture.log'}")
            return 1
        kdir.mkdir(exist_ok=True)
        # what can be a candidate: emulations carry accuracy only and the exact reference is rendered anyway
        runnable = [a["backend"] for a in avail if a["runs"] and not a["emulated"] and a["backend"] not in (
            BASELINE, REFERENCE)]
        grid = ["--grid", fam.size_grid(args.height, args.width, args.num_frames)] if fam.size_grid else []
        cmd = [sys.executable, str(ROOT / "bench" / "bench_attention.py"), "--input_dir", str(caps), "--kernel",
               ",".join(runnable), "--device", device, "--budget_s", str(args.kernel_budget_s), *grid, "-o",
               str(kdir / "attention.csv")]
        rc = _run(cmd, out / "logs" / "kernels.log", left())
        if rc not in (0, 3):  # 3: some kernels skipped (their rows say why)
            _log(f"[sweep] warning: the kernel bench ended with rc {rc}; see {out / 'logs' / 'kernels.log'}")
    if (kdir / "attention.json").exists():
        bench_rows = json.loads((kdir / "attention.json").read_text())["rows"]
    cands, left_out = plan_candidates(avail, bench_rows, max_candidates=args.max_candidates,
                                      max_rel_l2=args.max_rel_l2, stacks=stacks)
    _log(f"[sweep] rendering {len(cands)}: {', '.join(c.name for c in cands)} ({left():.0f} s of budget left)")

    # 3. the renders, reference first (the others are compared with it), each skipped when done or out of time
    order = sorted(cands, key=lambda c: not c.is_reference)  # the others are compared with its video
    slowest, records = max(capture_s, float(progress.get("slowest_s", 0.0))), {}
    ref_frames = None  # (frames, path) of the reference render, once read
    quality_device = device if device.startswith("cuda") else None

    def reference_frames():
        nonlocal ref_frames
        ref = next((records.get(c.name) for c in cands if c.is_reference), None)
        if ref_frames is None and ref is not None and _frames(ref) is not None:
            ref_frames = (load_frames(_frames(ref))[0], _frames(ref))
        return ref_frames

    for c in order:
        folder = out / "runs" / c.slug
        done = _records(folder) if folder.exists() else []
        if done and (_video(done[-1]) is not None or (not c.is_reference and _stored_quality(folder))):
            records[c.name] = done[-1]
            _log(f"[sweep] {c.name}: done earlier (records read back)")
            continue
        if left() < slowest * 1.2:
            left_out.append({"backend": c.name, "why": f"budget: {left():.0f} s left, a render took {slowest:.0f} s"})
            _log(f"[sweep] {c.name}: skipped, {left():.0f} s of budget left")
            continue
        t = time.monotonic()
        rc = _run(_render_cmd(fam.name, args, c, folder, ["--overwrite"]), out / "logs" / f"{c.slug}.log", left())
        recs = _records(folder)
        if rc != 0 or not recs:
            slowest = max(slowest, time.monotonic() - t)
            save_progress(slowest_s=slowest)
            left_out.append({"backend": c.name, "why": f"render failed (rc {rc}): {_first_error(out, c)}"})
            _log(f"[sweep] {c.name}: failed (rc {rc}); see {out / 'logs' / (c.slug + '.log')}")
            continue
        records[c.name] = recs[-1]
        rendered_s = time.monotonic() - t
        q = None if c.is_reference else quality_of(_frames(recs[-1]), reference_frames(), quality_device)
        if q is not None:  # kept beside the render: ranks it on a resume that has only the reference's video
            (folder / "quality.json").write_text(json.dumps(q))
        slowest = max(slowest, time.monotonic() - t)  # the quality is part of what one more render costs
        save_progress(slowest_s=slowest)
        _log(f"[sweep] {c.name}: rendered in {rendered_s:.0f} s" + (
            f", quality in {time.monotonic() - t - rendered_s:.1f} s" if q is not None else ""))

    # 4. rank against the reference video
    reference_frames()
    rows = rank([row_of(c, records[c.name], ref_frames, _stored_quality(out / "runs" / c.slug), quality_device)
                 for c in cands if c.name in records])
    text = verdict(rows, device=dev_name, model=args.model, tolerance_db=args.psnr_tolerance_db)
    meta = {"model": args.model, "family": fam.name, "device": dev_name, "height": args.height, "width": args.width,
            "num_frames": args.num_frames, "steps": args.steps, "verdict": text, "left_out": left_out,
            "command": command_line(), "commit": commit(), "budget_min": args.budget_min,
            "elapsed_s": spent_before + time.monotonic() - t0, "runs": runs_before + 1}
    save_progress()
    write_outputs(out, rows, meta)
    Writer(out / "records.jsonl").write(*(Record(
        suite="sweep", case=r["stack"], config={"model": args.model, "size": [args.height, args.width],
                                                "num_frames": args.num_frames, "steps": args.steps,
                                                "attention": r["attention"], "stack": r["stack"]},
        figures={k: r[k] for k in ("warm_ms", "p20_ms", "p80_ms", "n", "speedup", "end_to_end_s", "one_time_s",
                                   "psnr_db", "ssim", "peak_gib")},
        verdict={"speed_figure": r["speed_figure"], "why_not": r["why_not_speed"]}, command=meta["command"],
        commit=meta["commit"], created=now(), data=r) for r in rows))
    _print_table(rows)
    _log(f"[sweep] {text}")
    runs = f" over {meta['runs']} runs" if meta["runs"] > 1 else ""
    _log(f"[sweep] {out / 'report.html'}, {out / 'sweep.csv'} ({meta['elapsed_s']:.0f} s of "
         f"{budget:.0f} s budget{runs})")
    return 0 if rows else 1


def _print_table(rows):
    cols = ["stack", "warm_ms", "n", "speedup", "one_time_s", "break_even", "psnr_db", "pareto"]
    print("  ".join(f"{c:>12s}" for c in cols))
    for r in rows:
        print("  ".join(f"{_cell(r.get(c)):>12s}" for c in cols))


def _first_error(out: Path, c: Candidate) -> str:
    try:
        lines = (out / "logs" / f"{c.slug}.log").read_text().splitlines()
    except OSError:
        return "no log"
    return next((ln for ln in lines if ln.startswith("error")), lines[-1] if lines else "empty log")[:200]


def _run(cmd: list[str], log: Path, left_s: float) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=max(1.0, left_s)).returncode
        except subprocess.TimeoutExpired:
            f.write("\n[sweep] stopped: out of budget\n")
            return 124


def _family_of(model: str) -> str:
    return "cogvideox" if "cogvideo" in model.lower() else "wan"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sweep.py", description=__doc__, formatter_class=DefaultsHelpFormatter)
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
                   help="extra renders: <attention type>[+compile|+compile=<backend>[:<mode>]][+fp8gemm][+bf16te]"
                        "[+vae=<mode>][+encode=<mode>][+<cache spec>|+cache=<spec>], the name a render records "
                        "as its stack")
    p.add_argument("--max_captures", type=int, default=8, help="attention calls captured for the kernel bench")
    p.add_argument("--kernel_budget_s", type=float, default=10.0, help="seconds of timed calls per kernel and input")
    p.add_argument("--out", default="outputs/sweep", help="where everything goes (a re-run resumes there)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for s in args.stacks or []:
            parse_stack(s)
        return run(args)
    except (ValueError, B.BackendUnavailable) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
