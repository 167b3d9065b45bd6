"""Attention kernels on captured (or preset-shaped synthetic) inputs: speed and accuracy in one run.

    python bench/bench_attention.py --input_dir outputs/x/captures --kernel sdpa_cudnn,fav3,sagev1 -o attn.csv
    python bench/bench_attention.py --preset wan2.1-1.3b-480p --kernel all -metric all -o attn.csv
    python bench/bench_attention.py --preset cogvideox-2b --max_seq 512 --device cpu   # small, on a CPU
    python -m vdbench.kernel_bench ...     # the same, from an installed vdbench (what the sweep runs)

Per input x kernel:
* time: median latency of the warm calls with its spread -- p20/p80, min/max and n, the samples behind it
  (``time_p20_ms``, ``time_p80_ms``, ``time_n``; ``vdbench.timing.spread``), so two runs can be told apart from
  noise. The first call of each kernel on each input is timed on its own before any warm-up (``first_call_ms``:
  what it pays once -- Triton JIT, a FlexAttention compile, a cuDNN plan for the shape -- is in it;
  ``first_call_excess_ms`` = first - warm median) and is never a warm sample. The number of warm samples adapts to
  the kernel's time (``vdbench.timing.sample_ms``): a warm-up of ``--warmup_ms`` (at least one call) estimates a
  call, then max(``--min_samples``, ``--rep_ms`` / estimate) calls are timed, as many as fit in ``--budget_s`` of
  timed calls per row -- 5 samples even of a 175 ms FlashAttention-3 call at Wan 14B 720p or of a multi-second
  exact kernel; a row with fewer says why (``time_n_why``). GPU: CUDA events around each call, L2 written over
  between calls; CPU: host clock (CPU calls are synchronous), marked not a speed figure (``speed_figure`` False,
  ``why_not_speed``): a loaded shared CPU's timings mean nothing. The timed callable is the backend as the pipeline
  calls it, so quantization pre-passes (sagev1, fav3_fp8, fav3_sage, fp8_triton, ...) are INSIDE the figure; the
  pre-pass alone (the entry's ``prepass``) is timed too and printed beside every quantized backend's figure
  (``quant_ms`` with its share of the time, ``quant_share``; "inside" where the package's pre-pass can't be run
  alone, as sageattention's).
* cold (``--cold``): each kernel runs in a fresh process whose ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR``
  are new empty temporary folders (removed afterwards), so its first call on the first input compiles everything:
  the cold figure. Rows carry ``cold`` and ``caches`` (the cache folders' state when the kernel first ran:
  ``empty``; ``default (not cleared)`` without ``--cold``; a later input of the same kernel in the same process:
  ``warm: an earlier input``). Each process repeats the inputs' setup (and the fp64 reference).
* emulated backends (``*_emu``) are never timed: pure-torch emulations of a kernel's numerics, their accuracy is
  the figure; no time, TFLOP/s or GB/s is written for them.
* throughput: TFLOP/s with FLOPs = 4*B*H*Sq*Sk*D (two matmuls, forward, non-causal; causal halves nothing here).
  These are *dense-equivalent* FLOPs: for a sparse pattern ``tflops`` is its effective rate (what dense attention
  would have to reach to be as fast), and ``tflops_computed`` counts only the block pairs it computed.
* sparse patterns (``sta``, ``radial``, with options: ``--kernel "sta:window=3x5x5,tile=6x8x8,radial"``) need the
  token grid of the call: ``--grid 21x30x52`` (``FxHxW``, ``+T`` for T text tokens first), matched to the inputs by
  their sequence length. They are timed on tokens already in their tile order (as the once-per-forward form runs
  them; the permutation happens once per forward, not per call) and checked for accuracy in the model's order.
  ``work`` is the fraction of the kernel's 128x128 (query, key) block pairs computed, ``work_vs_dense`` the
  computed pairs over dense attention's on the unpadded sequence (padding to whole tiles adds pairs). ``natten``
  (``natten:window=TxHxW``) needs the grid too but has no tile order: it is timed in the model's order, as it runs,
  and leaves ``work`` empty (no block mask of ours to count). Accuracy is
  against exact *dense* attention: for a pattern, its approximation error. ``--baseline fav3`` adds
  ``speedup_vs_baseline`` (the baseline's time / the kernel's, per input).
* bandwidth: GB/s over the bytes each kernel really moves (the entry's bytes model): Q/K/V read and O written
  at the precision the kernel reads them (int8/fp8 count 1 byte), plus its quantization pre-pass (reads bf16
  Q/K(/V), writes 1 byte).
* arithmetic_intensity: FLOPs / those bytes.
* accuracy: against exact attention in fp64 — relative L2, cosine, max abs, share of elements beyond
  atol + rtol*|ref|, NaN/Inf count — and a poison check: the output memory is pre-filled with NaN (Python
  allocations through a torch-function mode, native ones through the caching allocator) so elements a kernel
  never writes show up as NaN instead of stale plausible values.
Every kernel is also checked on fresh random inputs (row "random"), not only on captured ones. ``--max_s`` bounds a
run (the sweep's share of its budget): past it, no further input of a shape already benched is started -- one of a
new shape still is, so every shape the model calls gets a time -- and the JSON's ``not_benched`` names those left out.

Captured inputs are cast to ``--dtype`` (bf16 by default) and the run says so (a note, and ``cast_from`` in the
CSV); ``--dtype capture`` keeps the captured dtype. Printed figures keep three significant digits (0.0086
TFLOP/s, not 0.0). The plot: colour = kernel, marker = input, one legend outside the axes.

Captures are checked before any work (size limit ``--max_capture_gib``, dense q/k/v of matching shapes, meta
consistent); a bad one is skipped with its reason and the others run. The CSV is written row by row, so a kill or
one bad input never costs the rows already measured.

Exit status: 0; 1 when a kernel failed (FAIL / error rows); 3 when capture files were skipped; 4 when no kernel
ran at all (every row unavailable or failed), with the reasons.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import backends as B
from . import families
from .measure import quality as Q
from .capture import MAX_CAPTURE_BYTES, CaptureError, list_captures, load_capture
from .helptext import DefaultsHelpFormatter
from .sparse import block_mask, parse_grid, split_attention_types, to_layout
from .timing import TARGET_SAMPLES, cache_state, first_call_ms, fresh_cache_env, sample_ms, speed_verdict, spread

#: Real models' attention shapes (B, H, Sq, Sk, D), by name: each family's ``attention_presets``.
PRESETS = families.attention_presets()
PRESET_GRIDS = families.attention_grids()
METRICS = ("all", "time", "throughput", "bandwidth", "arithmetic_intensity", "accuracy")
ATOL, RTOL = 1e-2, 1e-2
COLUMNS = ["input", "kernel", "kernel_label", "B", "H", "Sq", "Sk", "D", "dtype", "cast_from", "time_ms",
           "time_p20_ms", "time_p80_ms", "time_min_ms", "time_max_ms", "time_n", "time_n_why", "timer",
           "first_call_ms", "first_call_excess_ms", "cold", "caches", "quant_ms", "quant_p20_ms",
           "quant_p80_ms", "quant_share", "quant_in_time", "tflops", "gbps", "bytes", "arith_intensity",
           "speed_figure", "why_not_speed", "rel_l2", "cosine", "max_abs", "frac_beyond_tol", "nan_inf", "unwritten",
           "grid", "work", "work_vs_dense", "tflops_computed", "speedup_vs_baseline", "status"]
EXIT_NOTHING_RAN = 4
#: ``caches`` of a row whose kernel already ran in this process on an earlier input (its first call is not cold).
WARM_FROM_EARLIER = "warm: an earlier input"


def synthetic(shape, dtype, device, seed=0, k_bias=3.0):
    """Random Q/K/V at a real shape; K gets a per-channel bias as real (post-RoPE, RMS-normed) K has."""
    b, h, sq, sk, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, h, sk, d, generator=g) + k_bias * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, sk, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def time_samples(fn, device, warmup_ms=25, rep_ms=100, min_samples=TARGET_SAMPLES, budget_s=60.0,
                 first_call=False):
    """(:class:`vdbench.timing.Sampled`, the timer used): the warm samples of ``fn()`` in ms -- all of them, not
    one summary, so the caller can give the spread -- their count fitted to the call's time
    (:func:`vdbench.timing.sample_ms`: max(``min_samples``, ``rep_ms`` / a call) within ``budget_s`` of timed
    calls, ``why_fewer`` when fewer), and with ``first_call`` the first call timed on its own. GPU: CUDA events
    around each call, L2 written over between calls. CPU: the host clock, ``min_samples`` calls after one warm-up
    call (``rep_ms`` and ``warmup_ms`` are the GPU's: CPU times are no speed figures)."""
    cuda = torch.device(device).type == "cuda"
    got = sample_ms(fn, device, min_samples=min_samples, rep_ms=rep_ms if cuda else 0.0,
                    warmup_ms=warmup_ms if cuda else 0.0, budget_s=budget_s, first_call=first_call)
    return got, ("CUDA events, L2 flushed" if cuda else "host clock")


def sig(x, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits (0.0086, 356, 8.56), whole numbers from 10**digits up (1234, not
    1.23e+03): small rates must not print as 0.0."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 10 ** digits:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


class _PoisonEmpty(torch.overrides.TorchFunctionMode):
    """Allocations made through torch's Python API during the call come back NaN-filled, not stale."""

    _FNS = {torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.empty_strided}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._FNS and isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(float("nan"))
        return out


def poisoned_call(fn, q, k, v):
    """Run ``fn`` with its output memory poisoned; returns its output."""
    if q.is_cuda:  # native allocations: leave NaN in the allocator's free blocks of the output's size
        junk = torch.full((q.numel() * 2,), float("nan"), dtype=q.dtype, device=q.device)
        del junk
    with _PoisonEmpty():
        return fn(q, k, v)


def accuracy(out, ref):
    """The accuracy columns: the shared attention-quality dict at this bench's tolerances."""
    return Q.attention_quality(out, ref, ATOL, RTOL)


def iter_inputs(args, device, dtype, skipped: list):
    """(name, q, k, v, cast_from) one input at a time -- captures or presets, then a fresh random input of the first
    shape -- so a run never holds every capture at once. Each capture is checked before any work
    (:func:`vdbench.capture.load_capture`: size limit, dense q/k/v of matching shapes, meta consistent); a bad one
    is skipped with its reason (printed, and appended to ``skipped``), the others still run. ``cast_from`` is the
    captured dtype when the capture was cast to ``dtype`` (else ""); a note says so once per captured dtype,
    because a kernel timed in bf16 on fp32 captures is not the call that was captured."""
    first = None
    noted: set = set()
    to = str(dtype).replace("torch.", "")
    if args.input_dir:
        files = list_captures(args.input_dir)
        if not files:
            raise SystemExit(f"error: no capture files (attn_*.pt) in {args.input_dir}")
        files = files[::max(1, args.sample_rate)]
        if args.max_inputs:
            files = files[:args.max_inputs]
        for f in files:
            try:
                q, k, v, meta = load_capture(f, max_bytes=int(args.max_capture_gib * 2**30))
            except CaptureError as e:
                print(f"skipped: {e}", file=sys.stderr, flush=True)
                skipped.append(str(f))
                continue
            keep = args.dtype == "capture" or q.dtype == dtype
            cast_from = "" if keep else str(q.dtype).replace("torch.", "")
            if cast_from and cast_from not in noted:
                noted.add(cast_from)
                print(f"note: captures hold {cast_from} inputs; cast to {to} for the kernels (--dtype {args.dtype}); "
                      f"--dtype capture keeps {cast_from}", file=sys.stderr)
            cast = (lambda t: t.to(device)) if keep else (lambda t: t.to(device=device, dtype=dtype))
            q, k, v = cast(q), cast(k), cast(v)
            first = first or (q.shape, k.shape[2], q.dtype)
            yield f.name, q, k, v, cast_from
    else:
        for p in args.preset:
            b, h, sq, sk, d = PRESETS[p]
            if args.max_seq:
                sq, sk = min(sq, args.max_seq), min(sk, args.max_seq)
            q, k, v = synthetic((b, h, sq, sk, d), dtype, device)
            first = first or (q.shape, sk, q.dtype)
            yield p, q, k, v, ""
    if first is not None:
        (b, h, sq, d), sk, dt = first
        yield ("random", *synthetic((b, h, sq, sk, d), dt, device, seed=1234, k_bias=0.0), "")


OUTPUT_SUFFIXES = (".csv", ".json", ".png")


def output_path(output, ext: str) -> Path:
    """``-o``'s file for ``ext``: its name with a .csv/.json/.png ending replaced, else with ``ext`` added -- never a
    dot inside the name taken for a suffix (``attn_wan2.1-1.3b-480p.csv`` stays whole)."""
    out = Path(output)
    name = out.name[:-len(out.suffix)] if out.suffix.lower() in OUTPUT_SUFFIXES else out.name
    return out.with_name(name + ext)


class RowWriter:
    """The CSV written row by row as the bench goes (flushed each time), so a kill, a time limit or one bad input
    never costs the rows already measured; the JSON and the plot follow at the end from all rows."""

    def __init__(self, output):
        self.path = output_path(output, ".csv") if output else None
        self.file = self.writer = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "w", newline="")
            self.writer = csv.DictWriter(self.file, fieldnames=COLUMNS)
            self.writer.writeheader()
            self.file.flush()

    def add(self, row: dict) -> None:
        if self.writer is not None:
            self.writer.writerow(row)
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _timing_args(args) -> dict:
    return dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_samples=args.min_samples, budget_s=args.budget_s)


def _time_row(row, be, fn, q, k, v, args, device, flops, first_ms=None):
    """Time one available, non-emulated kernel on (q, k, v): the warm median and spread (``first_ms``, its first
    call timed before, beside them), throughput from the median, its pre-pass alone where it has one, and the
    speed verdict (a CPU or fewer than ``MIN_SAMPLES`` samples: not a speed figure, and why)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    got, timer = time_samples(lambda: fn(q, k, v), device, **_timing_args(args))
    st = spread(got.samples)
    t = st["median"]
    moved = be.bench.bytes_moved(b, h, sq, sk, d, q.element_size())
    ok, why = speed_verdict(device, st["n"])
    if why and got.why_fewer and "timed samples" in why:
        why = f"{why}: {got.why_fewer}"
    row.update(time_ms=t, time_p20_ms=st["p20"], time_p80_ms=st["p80"], time_min_ms=st["min"],
               time_max_ms=st["max"], time_n=st["n"], time_n_why=got.why_fewer or "", timer=timer,
               tflops=flops / t / 1e9, bytes=moved.total, gbps=moved.total / t / 1e6,
               arith_intensity=flops / moved.total, quant_in_time=bool(moved.prepass), speed_figure=ok,
               why_not_speed=why or "")
    if first_ms is not None:
        row.update(first_call_ms=first_ms, first_call_excess_ms=first_ms - t)
    prepass = be.bench.prepass
    if prepass is not None:
        qs = spread(time_samples(lambda: prepass(q, k, v, args.scale), device, **_timing_args(args))[0].samples)
        row.update(quant_ms=qs["median"], quant_p20_ms=qs["p20"], quant_p80_ms=qs["p80"], quant_share=qs["median"] / t)


def _grid_kernel(row, be, q, k, v, grids, scale):
    """For a backend that needs the token grid: (accuracy callable in the model's order, timing callable and its
    inputs in the pattern's tile order), or None with the row marked unavailable; fills the grid and work columns."""
    grid = grids.get(q.shape[2]) if q.shape[2] == k.shape[2] else None
    if grid is None:
        row["status"] = (f"unavailable: needs the token grid of a {q.shape[2]}-token self-attention input "
                         f"(--grid FxHxW; given: {', '.join(str(g) for g in grids.values()) or 'none'})")
        return None
    attend = be.sparse.attend
    if be.sparse.spec.dense:  # a grid kernel with no tile order (natten): timed as it runs, in the model's order
        row.update(grid=str(grid))
        call = (lambda q_, k_, v_: attend(q_, k_, v_, grid=grid, scale=scale)[0])
        return call, call, (q, k, v)
    _, stats, lay = block_mask(be.sparse.spec, grid, q.device)  # the call's block-pair accounting (cached mask)
    row.update(grid=str(grid), work=stats.fraction, work_vs_dense=stats.relative_to_dense)
    ql, kl, vl = (to_layout(t, lay, 2) for t in (q, k, v))
    return (lambda q_, k_, v_: attend(q_, k_, v_, grid=grid, scale=scale)[0],
            lambda q_, k_, v_: attend(q_, k_, v_, grid=grid, tile_ordered=True, scale=scale)[0],
            (ql, kl, vl))


def run(args) -> int:
    state = cache_state()  # before anything compiles: what the compile caches hold for this process
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "capture": None}[args.dtype]
    try:
        backends = (list(B.BACKENDS.values()) if args.kernel == "all"
                    else [B.resolve(k) for k in split_attention_types(args.kernel)])
    except B.BackendUnavailable as e:
        sys.exit(f"error: {e}")
    want = set(METRICS[1:]) if args.metric == "all" else {args.metric}
    if args.cold and not args._child_out:
        return run_cold(args, device, backends, want)
    skipped: list = []
    timed = want & {"time", "throughput", "bandwidth"}
    rows = []
    sink = RowWriter(None if args._child_out else args.output)
    try:
        late = _bench(args, device, dtype, backends, want, timed, skipped, rows, sink, state)
    finally:
        sink.close()
    if args._child_out:  # one kernel of a --cold run: its rows go to the parent, which prints and writes them
        Path(args._child_out).write_text(json.dumps({"rows": rows, "skipped": skipped, "pid": os.getpid(), **state},
                                                    default=str))
        return 0
    if late:
        print(f"note: {len(late)} input(s) not benched, past --max_s {args.max_s:g} s (every shape was benched on "
              f"an earlier input): {', '.join(late)}", file=sys.stderr)
    return _finish(args, rows, want, skipped, device, {"not_benched": late, "max_s": args.max_s} if late else None)


def child_env(extra: dict | None = None) -> dict:
    """The environment of a Python process that must run this same vdbench (a ``--cold`` kernel's process, the
    sweep's renders and kernel bench): this one's, the folder holding the imported vdbench first on PYTHONPATH (a
    checkout run from another folder finds itself; an installed one finds the install it already would), unbuffered
    output; ``extra`` on top (the GPU a job beside the renders sees)."""
    import vdbench

    where = str(Path(vdbench.__file__).resolve().parents[1])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != where]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([where, *paths]), "PYTHONUNBUFFERED": "1", **(extra or {})}


def run_cold(args, device, backends, want) -> int:
    """``--cold``: each kernel in a fresh process (``python -m vdbench.kernel_bench``, the same arguments, that one kernel) whose Triton
    and inductor caches are new empty folders (:func:`vdbench.timing.fresh_cache_env`, removed afterwards); the
    processes' rows are merged into one run's table, CSV and JSON (rows in input order, kernels in ``--kernel``
    order; the JSON's ``cold.processes`` gives each process's pid, cache folders and their state at its start)."""
    argv = getattr(args, "_argv", None)
    if argv is None:
        raise SystemExit("error: --cold runs the bench again per kernel: call main(argv), not run(args)")
    specs = [be.name for be in backends] if args.kernel == "all" else split_attention_types(args.kernel)
    rows: list = []
    skipped: list = []
    procs: list = []
    sink = RowWriter(args.output)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_attention_cold_") as td:
            for i, spec in enumerate(specs):
                out = Path(td) / f"kernel{i}.json"
                cmd = [sys.executable, "-m", "vdbench.kernel_bench", *argv, "--kernel", spec,
                       "--_child_out", str(out)]
                print(f"[cold] {spec}: a fresh process, Triton and inductor caches in new empty folders", flush=True)
                with fresh_cache_env(child_env()) as env:
                    rc = subprocess.run(cmd, env=env).returncode
                if out.exists():
                    got = json.loads(out.read_text())
                    kernel_rows = got["rows"]
                    skipped += [f for f in got["skipped"] if f not in skipped]
                    procs.append({"kernel": spec, "pid": got["pid"], "caches": got["caches"],
                                  "cache_dirs": got["cache_dirs"], "exit_code": rc})
                else:
                    row = dict.fromkeys(COLUMNS, "")
                    row.update(kernel=spec, cold=True, status=f"error: its process exited {rc} without a result")
                    kernel_rows = [row]
                    procs.append({"kernel": spec, "pid": None, "exit_code": rc})
                for r in kernel_rows:
                    rows.append(r)
                    sink.add(r)
    finally:
        sink.close()
    inputs = list(dict.fromkeys(r["input"] for r in rows))
    rows.sort(key=lambda r: inputs.index(r["input"]))  # stable: each input's kernels in --kernel order
    return _finish(args, rows, want, skipped, device, extra={"cold": {"processes": procs}}, rewrite_csv=True)


def _finish(args, rows, want, skipped, device, extra=None, rewrite_csv=False) -> int:
    """Speed-ups, the table, the outputs and the exit status of a finished run."""
    _speedups(rows, args.baseline)
    print_table(rows, want)
    if args.output:
        write_outputs(rows, args.output, device, extra, rewrite_csv)
        from .measure.record import write_beside
        from .timing import system_info

        write_beside(args.output, {"system": system_info(device), "flops": "4*B*H*Sq*Sk*D", "rows": rows})
    if rows and not any(r["status"].startswith("ok") for r in rows):
        reasons = dict.fromkeys(r["status"] for r in rows)
        print(f"error: no kernel ran ({len(rows)} rows, none ok): " + " | ".join(reasons), file=sys.stderr)
        return EXIT_NOTHING_RAN
    if skipped:
        print(f"{len(skipped)} input file(s) skipped", file=sys.stderr)
        return 3
    return 1 if any(r["status"].startswith(("FAIL", "error")) for r in rows) else 0


def _bench(args, device, dtype, backends, want, timed, skipped, rows, sink, state=None):
    """Every kernel on every input, each row handed to ``sink`` as soon as it is measured. A timed kernel's first
    call on each input is timed on its own before anything else runs it (accuracy, warm-up); ``state``: the
    compile caches' state when this process started (:func:`vdbench.timing.cache_state`)."""
    grids = {g.seq_len: g for g in args.grid or []}
    for p in args.preset or []:  # a preset's own grid, unless --grid gave one of that length
        if p in PRESET_GRIDS and not args.max_seq:
            g = parse_grid(PRESET_GRIDS[p])
            grids.setdefault(g.seq_len, g)
    caches = (state or cache_state())["caches"]
    ran: set = set()  # kernels this process has run: their first call on a later input is not a cold one
    t0, shapes, late = time.monotonic(), set(), []
    for name, q, k, v, cast_from in iter_inputs(args, device, dtype or torch.bfloat16, skipped):
        b, h, sq, d = q.shape
        sk = k.shape[2]
        # past --max_s, an input of a shape already benched adds spread, not a figure the others lack: left out;
        # one of a new shape is still benched (a caller predicting a model's step needs every shape it calls)
        if args.max_s and time.monotonic() - t0 > args.max_s and (q.shape, k.shape) in shapes:
            late.append(name)
            continue
        shapes.add((q.shape, k.shape))
        ref = B.exact_attention(q, k, v, dtype=torch.float64) if ("accuracy" in want) else None
        flops = 4 * b * h * sq * sk * d
        for be in backends:
            row = dict.fromkeys(COLUMNS, "")
            row.update(input=name, kernel=be.name, kernel_label=be.kernel, B=b, H=h, Sq=sq, Sk=sk, D=d,
                       dtype=str(q.dtype).replace("torch.", ""), cast_from=cast_from)
            ok, reason = be.availability(device, q.dtype, d)
            if not ok:
                row["status"] = f"unavailable: {reason}"
                rows.append(row)
                sink.add(row)
                continue
            fn = (lambda q_, k_, v_, be=be: be(q_, k_, v_, scale=args.scale))
            timed_fn, timed_in = fn, (q, k, v)
            try:
                if be.sparse is not None:
                    got = _grid_kernel(row, be, q, k, v, grids, args.scale)
                    if got is None:
                        rows.append(row)
                        sink.add(row)
                        continue
                    fn, timed_fn, timed_in = got
                first_ms = None
                if timed and not be.emulated:  # the first call, on its own: before the accuracy call and warm-up
                    row.update(cold=bool(args.cold), caches=WARM_FROM_EARLIER if be.name in ran else caches)
                    ran.add(be.name)
                    first_ms = first_call_ms(lambda: timed_fn(*timed_in), device)
                if "accuracy" in want:
                    out = poisoned_call(fn, q, k, v)
                    acc = accuracy(out, ref)
                    row.update(acc)
                    row["unwritten"] = int((~torch.isfinite(out) & torch.isfinite(ref)).sum().item())
                    del out
                if timed and be.emulated:
                    row.update(status="ok (emulation: accuracy only, never timed)", speed_figure=False,
                               why_not_speed=speed_verdict(emulated=True)[1])
                elif timed:
                    _time_row(row, be, timed_fn, *timed_in, args, device, flops, first_ms)
                    if row["work_vs_dense"] != "":
                        row["tflops_computed"] = row["tflops"] * row["work_vs_dense"]
                if not row["status"]:
                    row["status"] = "ok"
                if row.get("unwritten"):
                    row["status"] = f"FAIL: {row['unwritten']} output elements never written"
            except Exception as e:  # one kernel failing must not lose the others' rows
                row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            sink.add(row)
        del ref
    return late


def _speedups(rows, baseline):
    """``speedup_vs_baseline``: the baseline kernel's time on the same input / this kernel's time."""
    if not baseline:
        return
    name = B.canonical_name(baseline)
    base = {r["input"]: r["time_ms"] for r in rows if r["kernel"] == name and isinstance(r["time_ms"], float)}
    for r in rows:
        if isinstance(r["time_ms"], float) and r["input"] in base:
            r["speedup_vs_baseline"] = base[r["input"]] / r["time_ms"]


def _cell(r, col, spec):
    """One printed cell: significant digits for rates and times, the p20–p80 range, "inside" for a pre-pass
    that runs inside the kernel's call and can't be timed alone."""
    if col == "p20–p80":
        return "" if r["time_p20_ms"] == "" else f"{sig(r['time_p20_ms'], 4)}–{sig(r['time_p80_ms'], 4)}"
    if col == "quant_ms" and r["quant_ms"] == "" and r["quant_in_time"] is True:
        return "inside"
    if col == "quant_share" and r["quant_share"] != "":
        return f"{r['quant_share']:.0%}"
    v = r[col]
    if spec == "sig":
        return sig(v)
    if spec == "sig4":
        return sig(v, 4)
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def print_table(rows, want):
    cols = [("input", "s"), ("kernel", "s"), ("Sq", "d"), ("D", "d")]
    if want & {"time", "throughput", "bandwidth"}:
        cols += [("time_ms", "sig4"), ("p20–p80", ""), ("time_n", "d"), ("first_call_ms", "sig4"),
                 ("quant_ms", "sig4"), ("quant_share", "")]
    if "throughput" in want:
        cols += [("tflops", "sig")]
        if any(r["work"] != "" for r in rows):
            cols += [("work", "sig"), ("tflops_computed", "sig")]
    if any(r["speedup_vs_baseline"] != "" for r in rows):
        cols += [("speedup_vs_baseline", "sig")]
    if "bandwidth" in want:
        cols += [("gbps", "sig")]
    if "arithmetic_intensity" in want:
        cols += [("arith_intensity", "sig")]
    if "accuracy" in want:
        cols += [("rel_l2", ".2e"), ("cosine", ".6f"), ("max_abs", ".2e"), ("nan_inf", "d")]
    cols += [("status", "s")]
    table = [[c for c, _ in cols]] + [[_cell(r, c, s) for c, s in cols] for r in rows]
    widths = [max(len(x[i]) for x in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())
    if any(r["work"] != "" for r in rows):
        print("note: tflops is dense-equivalent (4*B*H*Sq*Sk*D / time): for a sparse pattern its effective rate; "
              "tflops_computed counts the block pairs it computed (work_vs_dense of dense attention's)")
    if any(r["first_call_ms"] != "" for r in rows):
        cold = any(r["cold"] is True for r in rows)
        print("note: time_ms is the median of the warm calls; first_call_ms is each kernel's first call on the input, "
              "timed on its own" + (" (--cold: each kernel in a fresh process, its compile caches empty at the "
                                    "start)" if cold else
                                    " (this process, compile caches as found: not a cold figure)"))
    for r in rows:
        if r["time_n_why"]:
            print(f"note: {r['kernel']} on {r['input']}: n={r['time_n']}: {r['time_n_why']}")
    whys = dict.fromkeys(r["why_not_speed"] for r in rows if r["time_ms"] != "" and r["speed_figure"] is False)
    for why in whys:
        print(f"warning: these times are not speed figures: {why}")


_MARKERS = "osD^vP*Xh<>p"


def _log_ticks(ax, values):
    """Labelled ticks on a log axis that never crowd and never vanish: within two decades the coarsest of the
    mantissa sets 1-2-5 / 1-1.5-2-3-5-7 / 1..9 that puts at least three ticks in view (matplotlib would label
    its minor ticks there, or none), one per decade (or fewer) beyond; minor ticks unlabelled."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    pos = [v for v in values if v > 0]
    if not pos:
        return
    lo_v, hi_v = min(pos) / 1.3, max(pos) * 1.3
    lo, hi = math.floor(math.log10(lo_v)), math.ceil(math.log10(hi_v))
    if hi - lo <= 2:
        for mant in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), tuple(range(1, 10))):
            ticks = [m * 10.0 ** e for e in range(lo, hi + 1) for m in mant]
            ticks = [t for t in ticks if lo_v <= t <= hi_v]
            if len(ticks) >= 3:
                break
        fmt = lambda x, _: f"{x:.1e}".replace(".0e", "e").replace("e-0", "e-").replace("e+0", "e")  # noqa: E731
    else:
        step = max(1, (hi - lo + 5) // 6)
        ticks = [10.0 ** e for e in range(lo, hi + 1, step)]
        fmt = lambda x, _: f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")  # noqa: E731
    ax.set_xlim(min(lo_v, ticks[0]), max(hi_v, ticks[-1]))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(fmt))
    ax.xaxis.set_minor_formatter(NullFormatter())


def build_plot(rows):
    """Speed vs accuracy, legible: colour = kernel, marker = input, one legend outside the axes (no per-point
    text), TFLOP/s error bars from the p20/p80 times, no minor-tick labels on the log axis; None with nothing to
    draw (no timed row with an accuracy)."""
    pts = [r for r in rows if isinstance(r["tflops"], float) and isinstance(r["rel_l2"], float)]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    kernels = list(dict.fromkeys(r["kernel"] for r in pts))
    inputs = list(dict.fromkeys(r["input"] for r in pts))
    colour = {k: plt.get_cmap("tab10" if len(kernels) <= 10 else "tab20")(i) for i, k in enumerate(kernels)}
    marker = {n: _MARKERS[i % len(_MARKERS)] for i, n in enumerate(inputs)}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in pts:
        flops = 4 * r["B"] * r["H"] * r["Sq"] * r["Sk"] * r["D"]
        lo, hi = flops / r["time_p80_ms"] / 1e9, flops / r["time_p20_ms"] / 1e9
        ax.errorbar([r["rel_l2"]], [r["tflops"]], yerr=[[r["tflops"] - lo], [hi - r["tflops"]]],
                    fmt=marker[r["input"]], color=colour[r["kernel"]], ms=7, capsize=3)
    ax.set_xscale("log")
    _log_ticks(ax, [r["rel_l2"] for r in pts])
    ax.set_xlabel("relative L2 error vs fp64")
    ax.set_ylabel("TFLOP/s (4·B·H·Sq·Sk·D), p20–p80")
    whys = list(dict.fromkeys(r["why_not_speed"] for r in pts if r["speed_figure"] is False))
    ax.set_title("attention kernels: speed vs accuracy" + (f"\nNOT speed figures: {'; '.join(whys)}" if whys else ""),
                 fontsize=10)
    ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colour[k], marker="o", ls="", label=k) for k in kernels]
    handles += [Line2D([], [], color="0.4", marker=marker[n], ls="", label=f"input: {n}") for n in inputs]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return fig


def write_outputs(rows, output, device, extra=None, rewrite_csv=False):
    """The JSON (system, definitions, rows, ``extra``) and the plot beside the CSV that :class:`RowWriter` wrote row
    by row; the CSV rewritten whole (atomically) when a column known only at the end -- ``speedup_vs_baseline`` --
    was filled, or when asked (``--cold``: the rows in input order)."""
    csv_path, json_path, png_path = (output_path(output, e) for e in OUTPUT_SUFFIXES)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    from .timing import system_info

    if rewrite_csv or any(r.get("speedup_vs_baseline") not in ("", None) for r in rows):  # known only at the end
        tmp = csv_path.with_name(f".{csv_path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, csv_path)
    json_path.write_text(json.dumps({"system": system_info(device), "flops": "4*B*H*Sq*Sk*D",
                                                     "time": "median of the warm samples, with p20/p80, min/max "
                                                             "and n; first_call_ms: the first call on its own",
                                                     **(extra or {}), "rows": rows}, indent=1, default=str))
    fig = build_plot(rows)
    if fig is not None:
        import matplotlib.pyplot as plt

        fig.savefig(png_path, dpi=120, bbox_inches="tight")
        plt.close(fig)
    print(f"wrote {csv_path}, {json_path}" + (f", {png_path}" if fig is not None else ""))


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input_dir", help="directory of captures (run_wan.py --save_inputs)")
    src.add_argument("--preset", action="append", choices=sorted(PRESETS),
                     help="synthetic inputs at a real model's shape (repeatable)")
    p.add_argument("--kernel", default="all",
                   help="comma-separated backend names (options allowed: sta:window=3x5x5,tile=6x8x8), or 'all'")
    p.add_argument("--grid", action="append", type=parse_grid, metavar="FxHxW[+T]",
                   help="the token grid of the sparse patterns' inputs (repeatable; matched by sequence length)")
    p.add_argument("--baseline", default=None, help="a kernel of --kernel: add speedup_vs_baseline per input")
    p.add_argument("--rep_ms", type=float, default=100,
                   help="timed milliseconds per kernel and input (GPU): max(--min_samples, rep_ms / one call's "
                        "time) warm calls are timed, within --budget_s")
    p.add_argument("--warmup_ms", type=float, default=25,
                   help="warm-up milliseconds after the first call (GPU; at least one call, whose time sizes the "
                        "sample count)")
    p.add_argument("--min_samples", type=int, default=TARGET_SAMPLES,
                   help="warm samples per kernel and input at the least (fewer only when they don't fit in "
                        "--budget_s; the row says why in time_n_why)")
    p.add_argument("--budget_s", type=float, default=60.0,
                   help="seconds of timed warm calls per kernel and input at most (a call longer than all of it: "
                        "one sample, the warm-up call)")
    p.add_argument("--max_s", type=float, default=0,
                   help="seconds of benching after which no further input of a shape already benched is started (an "
                        "input of a new shape still is; the JSON's not_benched lists those left out); 0: no bound")
    p.add_argument("--cold", action="store_true",
                   help="each kernel in a fresh process whose Triton and inductor caches are new empty temporary "
                        "folders (removed afterwards): first_call_ms of its first input is the cold first call, "
                        "compiles included (default: off, one process, the caches as found)")
    p.add_argument("-metric", "--metric", choices=METRICS, default="all", help="what to measure")
    p.add_argument("-o", "--output", help="CSV path, written row by row (a .json and a .png plot are written beside "
                                          "it at the end)")
    p.add_argument("--max_inputs", type=int, default=0, help="at most N captures (0: all)")
    p.add_argument("--sample_rate", type=int, default=1, help="take every R-th capture")
    p.add_argument("--max_capture_gib", type=float, default=MAX_CAPTURE_BYTES / 2**30,
                   help="skip a capture whose file or q/k/v exceed this size (GiB)")
    p.add_argument("--reference", default="fp64", choices=["fp64"], help="accuracy reference: exact fp64 attention")
    p.add_argument("--max_seq", type=int, default=0, help="cap preset sequence lengths, for CPU runs (0: no cap)")
    p.add_argument("--scale", type=float, default=None, help="softmax scale (default: 1/sqrt(D))")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "capture"],
                   help="dtype the kernels get; capture: the captured one")
    p.add_argument("--_child_out", default=None, help=argparse.SUPPRESS)  # --cold: one kernel's process
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._argv = argv
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
