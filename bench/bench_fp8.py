#!/usr/bin/env python3
"""SageAttention 2 and the fp8 kernels through vdbench beside their bare calls: speed, accuracy, purity, the α table.

    python bench/bench_fp8.py --out DIR                            # the three video shapes, every backend below
    python bench/bench_fp8.py --out DIR --captures CAPDIR          # + accuracy on captured pipeline inputs
    python bench/bench_fp8.py --out DIR --dry_run                  # CPU, tiny shapes (the stand-ins of the tests)

Why: it answers whether each fp8 backend runs at its kernel's speed through vdbench (the registry call within
2% of the bare kernel call on the same tensors; ``fav3_fp8`` with its fused pre-pass within 3% of FA3 on
pre-quantized inputs), which fp8 path is accurate (rel L2 vs fp64 on random and captured inputs, and as attention
gets peakier), and that nothing writes its inputs -- all in one run on one GPU, so the figures compare.

Per shape (B=1, bf16, Gaussian Q/K/V with a per-(head, channel) K bias, as real K has) and per backend:
  time        the registry call (``resolve(name)(q, k, v)``, what a pipeline runs) and the bare kernel call on the same
              tensors (``BARE``: the package function as a user would call it), interleaved call by call so drift
              hits both; CUDA events, median with p20/p80, min/max and n (``vdbench.timing.spread``); TFLOP/s =
              4·B·H·S²·D / median. fav3_fp8 also: its pre-pass alone and FA3 after torch's unfused quantization.
  accuracy    rel L2 vs fp64 on a sample of heads x 128-aligned query blocks; the LSE form's max |lse - fp64|
  emulation   the twin (``entry.twin``) on the same sample (sagev2_emu: the sampled rows; others: every row of
              fewer heads, their per-head scales need all rows): its rel L2, the ratio to the kernel's and the two
              outputs against each other
  purity      torch.equal of q, k, v before and after the calls
  edge        (first shape) an all-zero V channel: output finite and that channel exactly 0
``--captures``: accuracy figures of the fp8 backends and emulations on every self-attention capture of a pipeline
run (``run_wan.py --save_inputs``). Then the α table (``--alpha_shape``): Q scaled by α = 1, 4, 8 and α = 8 with
the K bias, rel L2 of every fp8 backend and emulation, plus bf16 FA3 as the floor (the issue's table). In that
order, so a deadline cuts the α table first. Writes DIR/fp8_bench.json after every
row (a time-out keeps what was measured); exit 0 once the table is written, 4 when no backend ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from vdbench import backends as B
from vdbench import families
from vdbench.capture import list_captures, load_capture
from vdbench.measure.quality import max_abs, nan_inf, rel_l2
from vdbench.numerics import exact_attention, fp8_bh_inputs, quantize_fp8
from vdbench.timing import interleaved_ms, speed_verdict, spread, system_info
from vdbench.helptext import DefaultsHelpFormatter

PRESETS = families.attention_presets()
SHAPES = ("wan2.1-1.3b-480p", "wan2.1-14b-720p", "cogvideox-2b")
DRY_SHAPES = {"tiny-d128": (1, 2, 300, 300, 128), "tiny-d64": (1, 3, 200, 200, 64)}
BACKENDS = ("sagev2", "sagev2_fp8", "sagev2_fp8:gran=per_warp", "sagev2_fp16", "sagev2_fp16:gran=per_warp",
            "sagev2_triton", "fav3_fp8", "fav3_fp8:smooth_k=1", "fav3_fp8:rotate=hadamard",
            "fav3_fp8:smooth_k=1+rotate=hadamard", "fav3_fp8:smooth_v=1", "fav3_fp8:smooth_k=1+smooth_v=1", "fav3",
            "sdpa_cudnn")
# (the project's Triton kernels fav3_sage / fp8_triton can be added with --alpha_backends: their first call compiles
# for ~20 s each, which a call that also builds SageAttention can't spare)
ALPHA_BACKENDS = ("sagev2", "sagev2_fp8:gran=per_warp", "sagev2_fp16", "fav3_fp8", "fav3_fp8:smooth_k=1",
                  "fav3_fp8:smooth_k=1+rotate=hadamard", "fav3_fp8:smooth_v=1", "fav3_fp8:smooth_k=1+smooth_v=1", "fav3", "fp8_emu", "fp8_emu:smooth_k=1",
                  "fp8_emu:smooth_k=1+rotate=hadamard", "sagev2_emu")
ALPHAS = ((1.0, 0.0), (4.0, 0.0), (8.0, 0.0), (8.0, 3.0))  # (Q scaled by, std of K's per-channel bias)
ROW_LOCAL_TWINS = ("sagev2_emu",)  # Q scale groups of <= 128 aligned rows: sampled row blocks emulate exactly
EXIT_NOTHING_RAN = 4


# ----------------------------------------------------------------------------------------------------------
# The bare calls: each kernel as a user would call it, what the registry's call is measured against
# ----------------------------------------------------------------------------------------------------------

def _fa3():
    import importlib.util

    for mod in ("flash_attn_interface", "fa3_fwd_interface"):
        if importlib.util.find_spec(mod) is not None:
            return __import__(mod)
    raise ImportError("no FlashAttention-3 module")


def _first(res):
    return res[0] if isinstance(res, tuple) else res


def _bare_sdpa_cudnn(be, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return {"bare": call}


def _bare_fav3(be, q, k, v):
    fa3 = _fa3()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return {"bare": lambda: _first(fa3.flash_attn_func(qt, kt, vt))}


def _bare_fav3_fp8(be, q, k, v):
    """FA3's e4m3 kernel on inputs quantized once beforehand (the kernel alone), and after torch's unfused
    quantization (the path fav3_fp8 had before its fused pre-pass)."""
    fa3 = _fa3()
    smooth = be.option_values.get("smooth_k") == "1"
    x = fp8_bh_inputs(q, k, v, smooth_k=smooth)
    args = [t.transpose(1, 2) for t in x[:3]]
    kw = dict(q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale)

    def unfused():
        (q8, _, qd), (k8, _, kd), (v8, _, vd) = (quantize_fp8(t, "bh") for t in (q, k, v))
        return _first(fa3.flash_attn_func(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2),
                                          q_descale=qd, k_descale=kd, v_descale=vd))

    out = {"bare": lambda: _first(fa3.flash_attn_func(*args, **kw)), "prepass": lambda: be.bench.prepass(q, k, v)}
    if not smooth:
        out["torch_prepass_then_kernel"] = unfused
    return out


def _sage(function: str, **kw):
    def bare(be, q, k, v):
        import sageattention

        name = function
        if name == "fp8":  # the arch's fp8 kernel, as the backend picks it
            name = ("sageattn_qk_int8_pv_fp8_cuda_sm90" if q.is_cuda and torch.cuda.get_device_capability(q.device)[0]
                    == 9 else "sageattn_qk_int8_pv_fp8_cuda")
        fn = getattr(sageattention, name)
        opts = dict(kw)
        if "gran" in be.option_values:
            opts["qk_quant_gran"] = be.option_values["gran"]
        return {"bare": lambda: fn(q, k, v, tensor_layout="HND", **opts)}

    return bare


BARE = {
    "sdpa_cudnn": _bare_sdpa_cudnn,
    "fav3": _bare_fav3,
    "fav3_fp8": _bare_fav3_fp8,
    "sagev2": _sage("sageattn"),
    "sagev2_fp8": _sage("fp8", pv_accum_dtype="fp32+fp32"),
    "sagev2_fp16": _sage("sageattn_qk_int8_pv_fp16_cuda", pv_accum_dtype="fp32"),
    "sagev2_triton": _sage("sageattn_qk_int8_pv_fp16_triton"),
}


# ----------------------------------------------------------------------------------------------------------
# Inputs, samples, timing
# ----------------------------------------------------------------------------------------------------------

def make_inputs(shape, device, *, alpha=1.0, k_bias=3.0, seed=0, dtype=torch.bfloat16):
    """Q (scaled by ``alpha``), K (+ a per-(head, channel) bias of std ``k_bias``), V; generated on the device."""
    b, h, sq, sk, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((b, h, sq, d), generator=g, device=device) * alpha
    k = torch.randn((b, h, sk, d), generator=g, device=device)
    k += k_bias * torch.randn((1, h, 1, d), generator=g, device=device)
    v = torch.randn((b, h, sk, d), generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sample(h: int, s: int, heads: int, rows: int, device):
    """(head indices, query row indices): ``heads`` spread over the heads, ``rows`` as whole 128-row blocks starting at
    multiples of 128 (every SageAttention 2 Q scale group stays whole, so an emulation of the sample is exact)."""
    n_heads = max(1, min(h, heads))
    hs = sorted({round(i * (h - 1) / max(1, n_heads - 1)) for i in range(n_heads)})
    if s <= 128:
        return hs, torch.arange(s, device=device)
    n = max(1, min(s // 128, rows // 128))
    last = (s - 128) // 128
    starts = sorted({round(i * last / max(1, n - 1)) * 128 for i in range(n)})
    return hs, torch.cat([torch.arange(a, a + 128, device=device) for a in starts])


def time_interleaved(fns: dict, device, warmup: int, reps: int) -> dict:
    """Samples (ms) of each callable, taking turns call by call: ``vdbench.timing.interleaved_ms``."""
    return interleaved_ms(fns, device, reps=reps, warmup=warmup)


def _timing(samples: list, flops: float, device) -> dict:
    st = spread(samples)
    ok, why = speed_verdict(device, st["n"])
    return dict(st, tflops=flops / (st["median"] * 1e-3) / 1e12, speed_figure=ok, why_not_speed=why)


# ----------------------------------------------------------------------------------------------------------
# One backend on one input
# ----------------------------------------------------------------------------------------------------------

class Sample:
    """The fp64 reference (and its LSE) of one input on its sampled heads and rows, computed once."""

    def __init__(self, q, k, v, heads, rows):
        self.heads, self.rows = heads, rows
        self.q, self.k, self.v = q[:, heads][:, :, rows], k[:, heads], v[:, heads]
        self.ref, self.lref = exact_attention(self.q, self.k, self.v, return_lse=True)

    def cut(self, out: torch.Tensor) -> torch.Tensor:
        return out[:, self.heads][:, :, self.rows]


def on_sample(entry, full, smp: Sample, emu_heads: int):
    """(output, reference, which of the sampled heads) of an emulation on the sample: the sampled rows where its
    Q scale groups are row-local (``ROW_LOCAL_TWINS``), else every row of the first ``emu_heads`` sampled heads
    (per-head scales need all rows) cut to the sampled rows. Emulations are never run on the whole input."""
    q, k, v = full
    if entry.base_name in ROW_LOCAL_TWINS:
        return entry(smp.q, smp.k, smp.v), smp.ref, slice(None)
    hs = smp.heads[:emu_heads]
    return entry(q[:, hs], k[:, hs], v[:, hs])[:, :, smp.rows], smp.ref[:, :len(hs)], slice(0, len(hs))


def twin_figures(be, full, smp: Sample, out_sub, emu_heads: int) -> dict:
    """The twin's rel L2 on the sample, against the kernel's (ratio) and the kernel's output (direct)."""
    if not be.twin:
        return {}
    twin = B.resolve(be.twin)
    try:
        o, ref, which = on_sample(twin, full, smp, emu_heads)
        kern = out_sub[:, which]
        e, ek = rel_l2(o, ref), rel_l2(kern, ref)
        return {"twin": twin.name, "rel_l2_emu": e, "emu_vs_kernel_rel_l2": rel_l2(o, kern),
                "emu_ratio": e / ek if ek > 0 else None}
    except Exception as exc:
        return {"twin": twin.name, "emu_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def measure(be, q, k, v, smp: Sample, args, device, flops, reps: int) -> dict:
    """One backend on one input: accuracy, LSE, twin, purity and (``reps`` > 0) registry vs bare times. An emulation
    runs on the sample only (``on_sample``) and is never timed."""
    row = {"backend": be.name, "kernel": be.kernel if be.emulated else be.call_label(q, k, v)}
    before = [t.clone() for t in (q, k, v)]
    if be.emulated:
        out_sub, ref, _ = on_sample(be, (q, k, v), smp, args.emu_heads)
        row.update(rel_l2=rel_l2(out_sub, ref), nan_inf=nan_inf(out_sub),
                   inputs_unchanged=all(torch.equal(a, t) for a, t in zip(before, (q, k, v))))
        return row
    out = be(q, k, v)
    row["inputs_unchanged"] = all(torch.equal(a, t) for a, t in zip(before, (q, k, v)))
    out_sub = smp.cut(out)
    row["rel_l2"] = rel_l2(out_sub, smp.ref)
    row["nan_inf"] = nan_inf(out)
    del out
    if be.has_lse(device):
        _, lse = be.lse_form(device).fn(q, k, v)
        row["lse_max_abs"] = max_abs(lse[:, smp.heads][:, :, smp.rows], smp.lref, keep_device=True)
        row["inputs_unchanged"] &= all(torch.equal(a, t) for a, t in zip(before, (q, k, v)))
        del lse
    del before
    row.update(twin_figures(be, (q, k, v), smp, out_sub, args.emu_heads))
    if not reps:
        return row
    bare = BARE.get(be.base_name)
    fns = {"registry": lambda: be(q, k, v), **(bare(be, q, k, v) if bare else {})}
    samples = time_interleaved(fns, device, args.warmup, reps)
    for name, s in samples.items():
        row["time_" + name] = _timing(s, flops if name != "prepass" else 0.0, device)
    if "bare" in samples:
        row["registry_over_bare"] = row["time_registry"]["median"] / row["time_bare"]["median"]
    return row


def zero_v_edge(be, device, d: int) -> dict:
    """An all-zero V channel: the output stays finite and that channel is exactly 0 (the fp8 kernels' NaN guarded)."""
    q, k, v = make_inputs((1, 2, 512, 512, d), device, seed=7)
    v[:, 1, :, 3] = 0
    out = be(q, k, v)
    return {"finite": bool(torch.isfinite(out).all()), "channel_zero": bool((out[:, 1, :, 3] == 0).all())}


# ----------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------

def run_rows(names, q, k, v, smp, args, device, flops, report_rows, save, *, label, reps=0, t_start=0.0):
    ran = 0
    for name in names:
        row = {"input": label, "backend": name}
        if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
            report_rows.append(dict(row, status="skipped(deadline)"))
            continue
        t0 = time.perf_counter()
        try:
            be = B.resolve(name)
            ok, why = be.availability(device, q.dtype, q.shape[-1])
            if not ok:
                row["status"] = f"unavailable: {why}"
            else:
                row.update(measure(be, q, k, v, smp, args, device, flops, reps))
                row["status"] = "ok"
                ran += 1
        except Exception as e:  # one backend failing must not lose the others' rows
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            row["traceback"] = traceback.format_exc(limit=4)
        row["wall_s"] = time.perf_counter() - t0
        report_rows.append(row)
        save()
        print(summary_line(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ran


def summary_line(row) -> str:
    t = row.get("time_registry") or {}
    bare = row.get("time_bare") or {}
    parts = [f"[{row['input']}] {row['backend']}: {row['status'][:100]}"]
    if t:
        parts.append(f"{t['median']:.3f} ms ({t['tflops']:.0f} TF/s, n={t['n']})")
    if bare:
        parts.append(f"bare {bare['median']:.3f} ms, registry/bare {row['registry_over_bare']:.3f}")
    if "rel_l2" in row:
        parts.append(f"rel_l2 {row['rel_l2']:.2e}" + (f" emu {row['rel_l2_emu']:.2e}" if "rel_l2_emu" in row else ""))
    if "inputs_unchanged" in row:
        parts.append(f"unchanged={row['inputs_unchanged']}")
    return "  ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="folder for fp8_bench.json and fp8_tables.md")
    p.add_argument("--shapes", default=None, help="comma list (default: " + ", ".join(SHAPES) + ")")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma list of backends (options: name:key=value, several joined by +)")
    p.add_argument("--alpha_shape", default=None, help="shape of the α table (default: the first shape; 'none')")
    p.add_argument("--alpha_backends", default=",".join(ALPHA_BACKENDS), help="backends of the α and captured tables")
    p.add_argument("--captures", default=None, help="a capture directory (run_wan.py --save_inputs)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per callable first")
    p.add_argument("--reps", type=int, default=0, help="timed calls per callable (default: 20, 6 at S > 50000)")
    p.add_argument("--heads", type=int, default=8, help="heads sampled for accuracy")
    p.add_argument("--rows", type=int, default=1024, help="query rows sampled per head (128-aligned blocks)")
    p.add_argument("--emu_heads", type=int, default=2, help="heads emulated in full for per-head-scale twins")
    p.add_argument("--deadline_s", type=float, default=0.0, help="seconds the bench may take; later rows are skipped and recorded (0: no deadline)")
    p.add_argument("--device", default=None, help="the device (none: CUDA)")
    p.add_argument("--dry_run", action="store_true", help="CPU, tiny shapes, 1 warm-up, 2 reps")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    presets = DRY_SHAPES if args.dry_run else PRESETS
    shapes = args.shapes.split(",") if args.shapes else list(DRY_SHAPES if args.dry_run else SHAPES)
    unknown = [s for s in shapes if s not in presets]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {list(presets)}")
    backends = [n for n in args.backends.split(",") if n]
    alpha_backends = [n for n in args.alpha_backends.split(",") if n]
    for n in backends + alpha_backends:
        try:
            B.resolve(n)
        except B.BackendUnavailable as e:
            p.error(str(e))
    if args.dry_run:
        args.warmup, args.reps = min(args.warmup, 1), 2
    device = torch.device(args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "fp8_bench.json"
    report = {"system": system_info(device), "sageattention": _sage_description(),
              "settings": {"batch": 1, "dtype": "bfloat16", "k_bias": 3.0, "warmup": args.warmup,
                           "heads_sampled": args.heads, "rows_sampled": args.rows, "dry_run": args.dry_run,
                           "flops": "4*B*H*Sq*Sk*D", "time": "median of interleaved CUDA-event samples, p20/p80, n",
                           "goals": {"registry_over_bare": 1.02, "fav3_fp8_over_prequantized_kernel": 1.03}},
              "rows": [], "alpha": [], "captured": [], "checks": {}}

    def save():
        tmp = out_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(out_path)

    ran = 0
    for si, shape_name in enumerate(shapes):
        shape = presets[shape_name]
        b, h, sq, sk, d = shape
        reps = args.reps or (6 if sq > 50000 else 20)
        q, k, v = make_inputs(shape, device)
        heads, rows = sample(h, sq, args.heads, args.rows, device)
        smp = Sample(q, k, v, heads, rows)
        flops = 4.0 * b * h * sq * sk * d
        if si == 0:
            report["checks"]["fa3_prepass_bit_equal"] = _prepass_check(q, k, v)
        ran += run_rows(backends, q, k, v, smp, args, device, flops, report["rows"], save, label=shape_name,
                        reps=reps, t_start=t_start)
        if si == 0:
            report["checks"]["zero_v_channel"] = {
                n: _safe(lambda n=n: zero_v_edge(B.resolve(n), device, d)) for n in backends
                if B.resolve(n).availability(device, torch.bfloat16, d)[0]}
            save()
        del q, k, v, smp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.captures:
        for f in list_captures(args.captures):
            q, k, v, meta = load_capture(f)
            if q.shape[2] != k.shape[2]:
                continue  # cross-attention: the goal is about self-attention
            q, k, v = (t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v))
            heads, rows = sample(q.shape[1], q.shape[2], args.heads, args.rows, device)
            smp = Sample(q, k, v, heads, rows)
            ran += run_rows(alpha_backends, q, k, v, smp, args, device, 0.0, report["captured"], save,
                            label=f"captured {f.name}", t_start=t_start)
    alpha_shape = args.alpha_shape or shapes[0]
    if alpha_shape != "none":
        for alpha, bias in ALPHAS:
            shape = presets[alpha_shape]
            q, k, v = make_inputs(shape, device, alpha=alpha, k_bias=bias, seed=1)
            heads, rows = sample(shape[1], shape[2], args.heads, args.rows, device)
            smp = Sample(q, k, v, heads, rows)
            ran += run_rows(alpha_backends, q, k, v, smp, args, device, 0.0, report["alpha"], save,
                            label=f"{alpha_shape} alpha={alpha:g} k_bias={bias:g}", t_start=t_start)
            del q, k, v, smp
    report["wall_s"] = time.perf_counter() - t_start
    save()
    (out_dir / "fp8_tables.md").write_text(tables(report))
    from vdbench.measure.record import write_beside

    write_beside(out_path, report)  # the rows again, as records with the command that made them
    print(f"wrote {out_path} and fp8_tables.md ({report['wall_s']:.0f} s)")
    if not ran:
        print("error: no backend ran: " + " | ".join(dict.fromkeys(r["status"] for r in report["rows"])),
              file=sys.stderr)
        return EXIT_NOTHING_RAN
    return 0


def _ms(t: dict) -> str:
    return f"{t['median']:.3f} ({t['p20']:.3f}–{t['p80']:.3f}, n={t['n']})" if t else ""


def tables(report: dict) -> str:
    """The measured rows as markdown: the kernel table (registry vs bare), the α table, the captured inputs, and
    the speed warnings (CPU, n < 3) -- what docs/PERFORMANCE.md quotes, with nothing added."""
    lines = ["| shape | backend | kernel that ran | registry ms (p20–p80, n) | TF/s | bare ms | registry / bare | "
             "fav3_fp8: kernel on pre-quantized ms | pre-pass ms | rel L2 vs fp64 | emulation rel L2 (ratio) | "
             "inputs unchanged | status |", "|" + " --- |" * 13]
    whys = set()
    for r in report["rows"]:
        t, bare = r.get("time_registry") or {}, r.get("time_bare") or {}
        if t and not t.get("speed_figure"):
            whys.add(t.get("why_not_speed"))
        fp8 = r["backend"].startswith("fav3_fp8")
        emu = f"{r['rel_l2_emu']:.2e} ({r['emu_ratio']:.3f})" if r.get("emu_ratio") else ""
        lines.append("| " + " | ".join([
            r["input"], r["backend"], r.get("kernel", ""), _ms(t), f"{t['tflops']:.0f}" if t else "",
            "" if fp8 else _ms(bare), f"{r['registry_over_bare']:.3f}" if "registry_over_bare" in r else "",
            _ms(bare) if fp8 else "", _ms(r.get("time_prepass") or {}),
            f"{r['rel_l2']:.2e}" if "rel_l2" in r else "", emu, str(r.get("inputs_unchanged", "")),
            r["status"][:80]]) + " |")
    for key, title in (("alpha", "α table (rel L2 vs fp64)"), ("captured", "captured inputs (rel L2 vs fp64)")):
        rows = [r for r in report[key] if "rel_l2" in r]
        if not rows:
            continue
        inputs = list(dict.fromkeys(r["input"] for r in rows))
        names = list(dict.fromkeys(r["backend"] for r in rows))
        cell = {(r["input"], r["backend"]): r["rel_l2"] for r in rows}
        lines += ["", f"{title}:", "", "| backend | " + " | ".join(inputs) + " |", "|" + " --- |" * (len(inputs) + 1)]
        lines += ["| " + n + " | " + " | ".join(f"{cell[(i, n)]:.2e}" if (i, n) in cell else "" for i in inputs)
                  + " |" for n in names]
    lines += ["", *(f"warning: not speed figures: {w}" for w in sorted(w for w in whys if w))]
    return "\n".join(lines) + "\n"


def _safe(fn):
    try:
        return fn()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def _prepass_check(q, k, v) -> dict:
    """The fused Triton pre-pass against the eager one on this input: bit-equal values and scales (or why not run)."""
    from vdbench import kernels
    from vdbench.numerics import fp8_bh_inputs as eager

    ok, why = kernels.probe("fa3_prepass", q.device)
    if not ok or q.device.type != "cuda":
        return {"status": f"not run: {why if not ok else 'not a GPU'}"}
    res = {}
    for smooth in (False, True):
        a, b = eager(q, k, v, smooth_k=smooth), kernels.fa3_fp8_prepass(q, k, v, smooth)
        res[f"smooth_k={int(smooth)}"] = {
            "values": all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[:3], b[:3])),
            "scales": all(torch.equal(x, y) for x, y in zip(a[3:6], b[3:6]))}
    return res


def _sage_description() -> str:
    from vdbench.backends.sage import describe_install

    return describe_install()


if __name__ == "__main__":
    sys.exit(main())
