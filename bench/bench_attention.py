#!/usr/bin/env python3
"""Attention kernels on captured (or preset-shaped synthetic) inputs: speed and accuracy in one run.

    python bench/bench_attention.py --input_dir outputs/x/captures --kernel sdpa_cudnn,fav3,sagev1 -o attn.csv
    python bench/bench_attention.py --preset wan2.1-1.3b-480p --kernel all -metric all -o attn.csv
    python bench/bench_attention.py --preset cogvideox-2b --max_seq 512 --device cpu   # small, on a CPU

Per input x kernel:
* time: median latency. GPU: triton.testing.do_bench (CUDA events, warm-up, L2 flushed between runs);
  CPU: host clock (CPU calls are synchronous), median of repeats. The timed callable is the backend as the
  pipeline calls it, so quantization pre-passes (sagev1, fav3_fp8, fav3_sage, fp8_triton, ...) are INSIDE the
  figure; the pre-pass alone (the entry's ``prepass``, where it can be run alone) is also timed and reported
  (quant_ms) so the two can be told apart.
* throughput: TFLOP/s with FLOPs = 4*B*H*Sq*Sk*D (two matmuls, forward, non-causal; causal halves nothing here).
* bandwidth: GB/s over the bytes each kernel really moves (the entry's bytes model): Q/K/V read and O written
  at the precision the kernel reads them (int8/fp8 count 1 byte), plus its quantization pre-pass (reads bf16
  Q/K(/V), writes 1 byte).
* arithmetic_intensity: FLOPs / those bytes.
* accuracy: against exact attention in fp64 — relative L2, cosine, max abs, share of elements beyond
  atol + rtol*|ref|, NaN/Inf count — and a poison check: the output memory is pre-filled with NaN (Python
  allocations through a torch-function mode, native ones through the caching allocator) so elements a kernel
  never writes show up as NaN instead of stale plausible values.
Every kernel is also checked on fresh random inputs (row "random"), not only on captured ones.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from vdbench import backends as B
from vdbench import families
from vdbench import metrics as M
from vdbench.capture import CaptureError, list_captures, load_capture

# (B, H, Sq, Sk, D): self-attention of the real models at their usual sizes
#: Real models' attention shapes (B, H, Sq, Sk, D), by name: each family's ``attention_presets``.
PRESETS = families.attention_presets()
METRICS = ("all", "time", "throughput", "bandwidth", "arithmetic_intensity", "accuracy")
ATOL, RTOL = 1e-2, 1e-2
COLUMNS = ["input", "kernel", "kernel_label", "B", "H", "Sq", "Sk", "D", "dtype", "time_ms", "quant_ms",
           "quant_in_time", "tflops", "gbps", "bytes", "arith_intensity", "rel_l2", "cosine", "max_abs",
           "frac_beyond_tol", "nan_inf", "unwritten", "status"]


def synthetic(shape, dtype, device, seed=0, k_bias=3.0):
    """Random Q/K/V at a real shape; K gets a per-channel bias as real (post-RoPE, RMS-normed) K has."""
    b, h, sq, sk, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, h, sk, d, generator=g) + k_bias * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, sk, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def events_median_ms(fn, n=30, warmup=5):
    """Median of CUDA-event times around each of ``n`` calls after ``warmup`` calls (no L2 flush)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def time_ms(fn, device, warmup_ms=25, rep_ms=100, cpu_reps=5):
    """Median milliseconds of ``fn()`` (GPU: do_bench with L2 flush, or events; CPU: host clock)."""
    if torch.device(device).type == "cuda":
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        except ImportError:
            return events_median_ms(fn, n=20, warmup=3)
    fn()  # warm-up
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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
    o, r = out.double(), ref.double()
    finite = torch.isfinite(o)
    bad = (~finite).sum().item()
    diff = (o - r).abs()
    beyond = ((diff > ATOL + RTOL * r.abs()) | ~finite).double().mean().item()
    o_f = torch.where(finite, o, torch.zeros_like(o))
    return {"rel_l2": M.rel_l2(o_f, r), "cosine": M.cosine(o_f, r), "max_abs": diff[finite].max().item() if finite.any() else math.inf,
            "frac_beyond_tol": beyond, "nan_inf": int(bad)}


def load_inputs(args, device, dtype):
    """[(name, q, k, v)] from captures or presets, plus a fresh random input of the first shape."""
    inputs, skipped = [], []
    if args.input_dir:
        files = list_captures(args.input_dir)
        if not files:
            raise SystemExit(f"error: no capture files (attn_*.pt) in {args.input_dir}")
        files = files[::max(1, args.sample_rate)]
        if args.max_inputs:
            files = files[:args.max_inputs]
        for f in files:
            try:
                q, k, v, meta = load_capture(f)
            except CaptureError as e:
                print(f"skipped: {e}", file=sys.stderr)
                skipped.append(str(f))
                continue
            cast = (lambda t: t.to(device=device, dtype=dtype)) if args.dtype != "capture" else (lambda t: t.to(device))
            inputs.append((f.name, cast(q), cast(k), cast(v)))
    else:
        for p in args.preset:
            b, h, sq, sk, d = PRESETS[p]
            if args.max_seq:
                sq, sk = min(sq, args.max_seq), min(sk, args.max_seq)
            inputs.append((p, *synthetic((b, h, sq, sk, d), dtype, device)))
    if inputs:
        _, q, k, v = inputs[0]
        b, h, sq, d = q.shape
        inputs.append(("random", *synthetic((b, h, sq, k.shape[2], d), q.dtype, device, seed=1234, k_bias=0.0)))
    return inputs, skipped


def run(args) -> int:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "capture": None}[args.dtype]
    try:
        backends = list(B.BACKENDS.values()) if args.kernel == "all" else [B.resolve(k) for k in args.kernel.split(",")]
    except B.BackendUnavailable as e:
        sys.exit(f"error: {e}")
    inputs, skipped = load_inputs(args, device, dtype or torch.bfloat16)
    want = set(METRICS[1:]) if args.metric == "all" else {args.metric}
    timed = want & {"time", "throughput", "bandwidth"}
    rows = []
    for name, q, k, v in inputs:
        b, h, sq, d = q.shape
        sk = k.shape[2]
        ref = B.exact_attention(q, k, v, dtype=torch.float64) if ("accuracy" in want) else None
        flops = 4 * b * h * sq * sk * d
        for be in backends:
            row = dict.fromkeys(COLUMNS, "")
            row.update(input=name, kernel=be.name, kernel_label=be.kernel, B=b, H=h, Sq=sq, Sk=sk, D=d,
                       dtype=str(q.dtype).replace("torch.", ""))
            ok, reason = be.availability(device, q.dtype, d)
            if not ok:
                row["status"] = f"unavailable: {reason}"
                rows.append(row)
                continue
            fn = (lambda q_, k_, v_, be=be: be(q_, k_, v_, scale=args.scale))
            try:
                if "accuracy" in want:
                    out = poisoned_call(fn, q, k, v)
                    acc = accuracy(out, ref)
                    row.update(acc)
                    row["unwritten"] = int((~torch.isfinite(out) & torch.isfinite(ref)).sum().item())
                    del out
                if timed and be.emulated and device.type == "cuda" and not args.time_emulated:
                    row["status"] = "ok (emulation: accuracy only, not timed)"
                elif timed:
                    t = time_ms(lambda: fn(q, k, v), device)
                    moved = be.bytes_moved(b, h, sq, sk, d, q.element_size())
                    row.update(time_ms=t, tflops=flops / t / 1e9, bytes=moved.total, gbps=moved.total / t / 1e6,
                               arith_intensity=flops / moved.total, quant_in_time=bool(moved.prepass))
                    if be.prepass is not None:
                        row["quant_ms"] = time_ms(lambda: be.prepass(q, k, v, args.scale), device)
                if not row["status"]:
                    row["status"] = "ok"
                if row.get("unwritten"):
                    row["status"] = f"FAIL: {row['unwritten']} output elements never written"
            except Exception as e:  # one kernel failing must not lose the others' rows
                row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
        del ref
    print_table(rows, want)
    if args.output:
        write_outputs(rows, args.output, device)
    if skipped:
        print(f"{len(skipped)} input file(s) skipped", file=sys.stderr)
        return 3
    return 1 if any(r["status"].startswith(("FAIL", "error")) for r in rows) else 0


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def print_table(rows, want):
    cols = [("input", "s"), ("kernel", "s"), ("Sq", "d"), ("D", "d")]
    if "time" in want:
        cols += [("time_ms", ".3f"), ("quant_ms", ".3f")]
    if "throughput" in want:
        cols += [("tflops", ".1f")]
    if "bandwidth" in want:
        cols += [("gbps", ".0f")]
    if "arithmetic_intensity" in want:
        cols += [("arith_intensity", ".0f")]
    if "accuracy" in want:
        cols += [("rel_l2", ".2e"), ("cosine", ".6f"), ("max_abs", ".2e"), ("nan_inf", "d")]
    cols += [("status", "s")]
    table = [[c for c, _ in cols]] + [[_fmt(r[c], s) for c, s in cols] for r in rows]
    widths = [max(len(x[i]) for x in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())


def write_outputs(rows, output, device):
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    from vdbench.timing import system_info

    stem.with_suffix(".json").write_text(json.dumps({"system": system_info(device), "flops": "4*B*H*Sq*Sk*D",
                                                     "rows": rows}, indent=1, default=str))
    pts = [r for r in rows if isinstance(r["tflops"], float) and isinstance(r["rel_l2"], float)]
    if pts:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in pts:
            ax.scatter(r["rel_l2"], r["tflops"], s=18)
            ax.annotate(f"{r['kernel']} ({r['input'][:12]})", (r["rel_l2"], r["tflops"]), fontsize=6)
        ax.set_xscale("log")
        ax.set_xlabel("relative L2 error vs fp64")
        ax.set_ylabel("TFLOP/s (4·B·H·Sq·Sk·D)")
        ax.set_title("attention kernels: speed vs accuracy")
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=120)
        plt.close(fig)
    print(f"wrote {stem.with_suffix('.csv')}, {stem.with_suffix('.json')}" + (f", {stem.with_suffix('.png')}" if pts else ""))


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input_dir", help="directory of captures (run_wan.py --save_inputs)")
    src.add_argument("--preset", action="append", choices=sorted(PRESETS), help="synthetic inputs at a real shape")
    p.add_argument("--kernel", default="all", help="comma-separated backend names, or 'all'")
    p.add_argument("-metric", "--metric", choices=METRICS, default="all")
    p.add_argument("-o", "--output", help="CSV path (a .json and a .png plot are written beside it)")
    p.add_argument("--max_inputs", type=int, default=0)
    p.add_argument("--sample_rate", type=int, default=1, help="take every R-th capture")
    p.add_argument("--reference", default="fp64", choices=["fp64"], help="accuracy reference: exact fp64 attention")
    p.add_argument("--max_seq", type=int, default=0, help="cap preset sequence lengths (CPU runs)")
    p.add_argument("--scale", type=float, default=None, help="softmax scale (default 1/sqrt(D))")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "capture"])
    p.add_argument("--time_emulated", action="store_true", help="also time the emulations on GPU (slow)")
    return p


def main(argv=None):
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
