"""SageAttention 2 at the real video shapes: speed, accuracy against fp64, its emulation, purity and dispatch.

Why: before the ``sagev2*`` backends are trusted in pipelines we need to know, per upstream
function and option, (1) how fast it is on the GPU we have, (2) how far it is from exact attention, (3) whether
vdbench's pure-torch twin (vdbench.numerics.sagev2_emulated) reproduces that error -- the goal is the emulation's rel L2
within 10% of the kernel's, which tells the algorithm's error from a kernel bug --, (4) that no function writes its
inputs (1.x did), (5) that the log-sum-exp it returns (what ring attention needs) is right, and (6) which kernel
``sageattn`` picks on this GPU.

Per shape (B=1, bf16, K with a per-(head, channel) bias, the case smoothing exists for) and per variant:
  time: CUDA events around each call after warm-up; median, p20, p80 and n; TFLOP/s = 4·B·H·S²·D / t
  rel_l2: vs fp64 attention on a sample of heads x 128-aligned query blocks (the reference is chunked on the GPU)
  rel_l2_emu: the emulation of the same numerics on the same rows; emu_ratio = rel_l2_emu / rel_l2;
    emu_vs_kernel_rel_l2: the two outputs against each other (small when the emulation rounds like the kernel);
    *_fp22: the same under the paper's FP22 fp8-MMA accumulator (mma_acc="fp22"), for fp8 P·V
  lse_*: |lse - fp64 logsumexp| (max, mean) of the kernel's return_lse=True output and of the emulation's
  inputs_unchanged: torch.equal of q, k, v before/after both calls
  edge (first shape only): causal with an odd length, head dim 72 with q_len != kv_len (kernel, emulation, fp64),
    and whether an all-zero V channel leaves the output finite (fp8 scales it by 0·inf upstream)
Writes $OUT/sage2_bench.json after every variant (a time-out keeps what was measured).

CPU dry run (tests/test_bench_sage2.py): ``--dry_run`` uses tiny shapes on the CPU; the kernels run only if a
``sageattention`` module imports (the test supplies a fake one), the emulation path always runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vdbench.measure.quality import max_abs, mean_abs, nan_inf, rel_l2
from vdbench.numerics import exact_attention, sagev2_emulated
from vdbench.timing import fixed_ms, spread
from vdbench.helptext import DefaultsHelpFormatter

SHAPES = {  # name -> (heads, seq, head_dim), B = 1
    "wan2.1-1.3b-480p": (12, 32760, 128),
    "wan2.1-14b-720p": (40, 75600, 128),
    "cogvideox-2b": (30, 17776, 64),
}
DRY_SHAPES = {"tiny-d128": (2, 300, 128), "tiny-d64": (3, 200, 64)}


@dataclass(frozen=True)
class Variant:
    """One upstream function with fixed options, and the emulation configuration of the same numerics."""

    name: str
    function: str
    kwargs: dict = field(default_factory=dict)
    emu: dict = field(default_factory=dict)


VARIANTS = [
    Variant("sagev2", "sageattn"),  # emulation chosen from the recorded dispatch
    Variant("fp8_sm90_per_thread", "sageattn_qk_int8_pv_fp8_cuda_sm90",
            dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32+fp32"),
            dict(pv="fp8", arch="sm90", qk_gran="per_thread")),
    Variant("fp8_sm90_per_warp", "sageattn_qk_int8_pv_fp8_cuda_sm90",
            dict(qk_quant_gran="per_warp", pv_accum_dtype="fp32+fp32"),
            dict(pv="fp8", arch="sm90", qk_gran="per_warp")),
    Variant("fp8_sm89_per_thread_fp32+fp16", "sageattn_qk_int8_pv_fp8_cuda",
            dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32+fp16"),
            dict(pv="fp8", arch="sm89", qk_gran="per_thread", pv_accum="fp32+fp16")),
    Variant("fp8_sm89_per_warp_fp32+fp16", "sageattn_qk_int8_pv_fp8_cuda",
            dict(qk_quant_gran="per_warp", pv_accum_dtype="fp32+fp16"),
            dict(pv="fp8", arch="sm89", qk_gran="per_warp", pv_accum="fp32+fp16")),
    Variant("fp8_sm89_per_thread_fp32+fp32", "sageattn_qk_int8_pv_fp8_cuda",
            dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32+fp32"),
            dict(pv="fp8", arch="sm89", qk_gran="per_thread", pv_accum="fp32+fp32")),
    Variant("fp8_sm89_per_thread_fp32", "sageattn_qk_int8_pv_fp8_cuda",
            dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32"),
            dict(pv="fp8", arch="sm89", qk_gran="per_thread", pv_accum="fp32")),
    Variant("fp16_cuda_per_thread_fp32", "sageattn_qk_int8_pv_fp16_cuda",
            dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32"),
            dict(pv="fp16", qk_gran="per_thread", pv_accum="fp32")),
    Variant("fp16_cuda_per_warp_fp32", "sageattn_qk_int8_pv_fp16_cuda",
            dict(qk_quant_gran="per_warp", pv_accum_dtype="fp32"),
            dict(pv="fp16", qk_gran="per_warp", pv_accum="fp32")),
    Variant("fp16_cuda_per_thread_fp16+fp32", "sageattn_qk_int8_pv_fp16_cuda",
            dict(qk_quant_gran="per_thread", pv_accum_dtype="fp16+fp32"),
            dict(pv="fp16", qk_gran="per_thread", pv_accum="fp16+fp32")),
    Variant("fp16_triton", "sageattn_qk_int8_pv_fp16_triton", {}, dict(pv="fp16", qk_gran="per_block")),
]

# what sageattn's callee computes, by the callee's name; qk_gran / pv_accum come from the recorded call
DISPATCH_EMU = {
    "sageattn_qk_int8_pv_fp8_cuda_sm90": dict(pv="fp8", arch="sm90"),
    "sageattn_qk_int8_pv_fp8_cuda": dict(pv="fp8", arch="sm89"),
    "sageattn_qk_int8_pv_fp16_cuda": dict(pv="fp16"),
    "sageattn_qk_int8_pv_fp16_triton": dict(pv="fp16", qk_gran="per_block"),
}


def time_calls(fn, device, warmup, reps):
    """Per-call times in ms after ``warmup`` calls (``vdbench.timing.fixed_ms``), as median / p20 / p80 / n."""
    st = spread(fixed_ms(fn, device, reps=reps, warmup=warmup))
    return {"median_ms": st["median"], "p20_ms": st["p20"], "p80_ms": st["p80"], "n": st["n"]}


def sample_rows(seq, rows):
    """About ``rows`` query rows as whole 128-row blocks starting at multiples of 128, spread over the sequence.

    Aligned blocks keep every kernel's Q scale groups (at most 128 rows, always aligned) identical to the full run's,
    so the emulation of the sample is the emulation of those rows of the full tensor.
    """
    if seq <= 128:
        return torch.arange(seq)
    n_blk = max(1, min(seq // 128, rows // 128))
    last = (seq - 128) // 128
    starts = sorted({round(i * last / max(1, n_blk - 1)) * 128 for i in range(n_blk)})
    return torch.cat([torch.arange(s, s + 128) for s in starts])


def sample_heads(n_heads, want):
    want = max(1, min(n_heads, want))
    return sorted({round(i * (n_heads - 1) / max(1, want - 1)) for i in range(want)})


def make_inputs(heads, seq, dim, *, device, dtype, k_bias, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (1, heads, seq, dim)
    q = torch.randn(shape, generator=g, device=device, dtype=dtype)
    k = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    k += k_bias * torch.randn((1, heads, 1, dim), generator=g, device=device)
    v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    return q, k.to(dtype), v


def load_sage():
    """(module, version, error): sageattention if it imports; the version from its metadata when installed."""
    try:
        sage = importlib.import_module("sageattention")
    except Exception as e:  # ImportError without the compiled _fused extension, or a broken build
        return None, None, f"{type(e).__name__}: {e}"
    try:
        version = importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sage, "__version__", None)
    return sage, version, None


def record_dispatch(sage, q, k, v):
    """Which public function ``sageattn`` calls here, with the options it forces, by wrapping the module's names."""
    core = sys.modules.get(sage.__name__ + ".core", sage)
    calls = []
    saved = {}
    for name in dir(core):
        fn = getattr(core, name)
        if name.startswith("sageattn_") and callable(fn):
            saved[name] = fn

            def wrapper(*a, _n=name, _f=fn, **kw):
                calls.append({"function": _n, "kwargs": {key: val for key, val in kw.items()
                                                         if isinstance(val, (str, int, float, bool, type(None)))}})
                return _f(*a, **kw)

            setattr(core, name, wrapper)
    try:
        sage.sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    finally:
        for name, fn in saved.items():
            setattr(core, name, fn)
    return calls[0] if calls else None


def emu_config_for_dispatch(dispatch):
    if not dispatch or dispatch["function"] not in DISPATCH_EMU:
        return None
    cfg = dict(DISPATCH_EMU[dispatch["function"]])
    kw = dispatch["kwargs"]
    if "qk_quant_gran" in kw and cfg.get("qk_gran") != "per_block":
        cfg["qk_gran"] = kw["qk_quant_gran"]
    if "pv_accum_dtype" in kw:
        cfg["pv_accum"] = kw["pv_accum_dtype"]
    return cfg


def lse_errors(lse, lref):
    return {"max_abs": max_abs(lse, lref, keep_device=True), "mean_abs": mean_abs(lse, lref, keep_device=True)}


def run_variant(var, sage, emu_cfg, inputs, sub, ref, lref, args, emu_cache, flops, sage_reason=None):
    """Measures one variant; every failure is recorded as text in the row rather than stopping the run."""
    q, k, v = inputs
    heads, rows = sub
    qs, ks, vs = (t[:, heads] for t in (q, k, v))
    qs = qs[:, :, rows]
    row = {"name": var.name, "function": var.function, "kwargs": var.kwargs, "emulation": emu_cfg}
    # the emulation of the same numerics on the sampled rows (fp8 P·V: also under the paper's FP22 accumulator)
    emus = {}
    if emu_cfg is None:
        row["emu_status"] = "no emulation for this dispatch"
    else:
        models = {"": emu_cfg}
        if emu_cfg.get("pv") == "fp8":
            models["fp22"] = dict(emu_cfg, mma_acc="fp22")
        for tag, cfg in models.items():
            key = json.dumps(cfg, sort_keys=True)
            try:
                if key not in emu_cache:
                    t0 = time.perf_counter()
                    o_e, l_e = sagev2_emulated(qs, ks, vs, return_lse=True, **cfg)
                    emu_cache[key] = (o_e, l_e, rel_l2(o_e, ref), lse_errors(l_e, lref), time.perf_counter() - t0)
                emus[tag] = emu_cache[key]
                pre = "emu" if not tag else f"emu_{tag}"
                row["rel_l2_" + pre], row["lse_" + pre], row[pre + "_s"] = emus[tag][2:]
                row[pre + "_status"] = "ok"
            except Exception as e:
                row[("emu" if not tag else f"emu_{tag}") + "_status"] = f"error: {type(e).__name__}: {e}"
    if sage is None:
        row["status"] = f"unavailable: {sage_reason or 'sageattention does not import'}"
        return row
    fn = getattr(sage, var.function, None)
    if fn is None:
        row["status"] = f"refused: the installed sageattention has no {var.function}"
        return row
    call = functools.partial(fn, tensor_layout="HND", is_causal=False, **var.kwargs)
    before = [t.clone() for t in (q, k, v)]
    try:
        out = call(q, k, v)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
        out_sub = out[:, heads][:, :, rows]
        row["rel_l2"] = rel_l2(out_sub, ref)
        row["nan_inf"] = nan_inf(out)
        del out
        # kernel vs emulation directly: far below rel_l2 when the emulation rounds the same values the same way
        for tag, emu in emus.items():
            row["emu_vs_kernel_rel_l2" + (f"_{tag}" if tag else "")] = rel_l2(emu[0], out_sub)
        res = call(q, k, v, return_lse=True)
        unchanged = unchanged and all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
        if isinstance(res, tuple) and len(res) == 2:
            lse_sub = res[1][:, heads][:, :, rows]
            row["lse"] = lse_errors(lse_sub, lref)
            if "" in emus:
                row["lse_emu_vs_kernel_max_abs"] = max_abs(emus[""][1], lse_sub, keep_device=True)
        else:
            row["lse"] = "no (out, lse) tuple returned"
        del res
        row["inputs_unchanged"] = unchanged
        row["time"] = time_calls(lambda: call(q, k, v), q.device, args.warmup, args.reps)
        row["tflops"] = flops / (row["time"]["median_ms"] * 1e-3) / 1e12
        if "rel_l2_emu" in row and row["rel_l2"] > 0:
            row["emu_ratio"] = row["rel_l2_emu"] / row["rel_l2"]
            row["emu_within_10pct"] = abs(row["emu_ratio"] - 1.0) <= 0.10
        if "rel_l2_emu_fp22" in row and row["rel_l2"] > 0:
            row["emu_fp22_ratio"] = row["rel_l2_emu_fp22"] / row["rel_l2"]
        row["status"] = "ok"
    except Exception as e:
        row["status"] = f"error: {type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=4)
    finally:
        # a function that wrote its inputs (or failed half-way) must not change the problem the next variants see
        for t, b in zip((q, k, v), before):
            if not torch.equal(t, b):
                t.copy_(b)
        del before
        if q.is_cuda:
            torch.cuda.empty_cache()
    return row


EDGE_CASES = {  # name -> (heads, q_len, kv_len, head_dim, is_causal): paths the video shapes do not take
    "causal_odd": (4, 3001, 3001, 128, True),
    "d72_sq_ne_sk": (4, 1000, 2333, 72, False),
}
DRY_EDGE_CASES = {"causal_odd": (2, 301, 301, 128, True), "d72_sq_ne_sk": (2, 100, 233, 72, False)}


def edge_checks(sage, var, emu_cfg, device, dtype, cases=EDGE_CASES):
    """Causal masking with an odd length, and a padded head dim with q_len != kv_len: kernel and emulation vs fp64.

    Also an all-zero V channel (the fp8 kernels scale it by 0·inf): does the output stay finite?
    """
    res = {}
    fn = getattr(sage, var.function, None) if sage is not None else None
    for name, (h, sq, sk, d, causal) in cases.items():
        g = torch.Generator(device=device).manual_seed(2)
        q = torch.randn((1, h, sq, d), generator=g, device=device).to(dtype)
        k = (torch.randn((1, h, sk, d), generator=g, device=device) + 2.0).to(dtype)
        v = torch.randn((1, h, sk, d), generator=g, device=device).to(dtype)
        ref = exact_attention(q, k, v, is_causal=causal, q_offset=0)  # top-left, as the kernels
        case = {}
        o_e = None
        if emu_cfg is not None:
            o_e = sagev2_emulated(q, k, v, is_causal=causal, **emu_cfg)
            case["rel_l2_emu"] = rel_l2(o_e, ref)
        if fn is not None:
            try:
                o = fn(q, k, v, tensor_layout="HND", is_causal=causal, **var.kwargs)
                case["rel_l2"] = rel_l2(o, ref)
                if o_e is not None:
                    case["emu_vs_kernel_rel_l2"] = rel_l2(o_e, o)
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"
        res[name] = case
    q, k, v = make_inputs(2, 512 if cases is EDGE_CASES else 128, 128, device=device, dtype=dtype, k_bias=0.0,
                          seed=1)
    v[..., 0] = 0
    zero = {}
    if emu_cfg is not None:
        zero["emulation_finite"] = bool(torch.isfinite(sagev2_emulated(q, k, v, **emu_cfg)).all())
    if fn is not None:
        try:
            zero["kernel_finite"] = bool(torch.isfinite(fn(q, k, v, tensor_layout="HND", **var.kwargs)).all())
        except Exception as e:
            zero["kernel_finite"] = f"error: {type(e).__name__}: {e}"
    res["zero_v_channel"] = zero
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES) + " (default: all)")
    p.add_argument("--variants", default=None, help="comma list of variant names (default: all)")
    p.add_argument("--out", default=os.environ.get("OUT", "outputs/sage2"), help="result directory ($OUT if set)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per kernel")
    p.add_argument("--reps", type=int, default=10, help="timed calls per kernel")
    p.add_argument("--heads", type=int, default=8, help="heads sampled for the accuracy figures")
    p.add_argument("--rows", type=int, default=1024, help="query rows sampled per head (128-aligned blocks)")
    p.add_argument("--k_bias", type=float, default=2.0, help="std of K's per-(head, channel) bias")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--deadline_s", type=float, default=0,
                   help="skip what is left after this many seconds (0: no limit)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available, else cpu)")
    p.add_argument("--dry_run", action="store_true", help="CPU, tiny shapes, 1 warm-up, 2 reps")
    p.add_argument("--no_edge", action="store_true", help="skip the causal / padded-head-dim / zero-V checks")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = [s for s in wanted if s not in shapes]
        if unknown:
            p.error(f"unknown shapes {unknown}; known: {list(shapes)}")
        shapes = {s: shapes[s] for s in wanted}
    variants = VARIANTS
    if args.variants:
        wanted = args.variants.split(",")
        unknown = [w for w in wanted if w not in {v.name for v in VARIANTS}]
        if unknown:
            p.error(f"unknown variants {unknown}; known: {[v.name for v in VARIANTS]}")
        variants = [v for v in VARIANTS if v.name in wanted]
    if args.dry_run:
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 2)
    device = torch.device(args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"))
    dtype = torch.bfloat16
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "sage2_bench.json"

    sage, version, import_error = load_sage()
    if sage is not None and version and version.split(".")[0].isdigit() and int(version.split(".")[0]) < 2:
        import_error = f"sageattention {version} is 1.x; the sagev2 variants need >= 2.0"
        sage = None
    report = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capability": ("sm%d%d" % torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "sageattention": {"available": sage is not None, "version": version, "error": import_error,
                          "path": getattr(sage, "__file__", None)},
        "settings": {"batch": 1, "dtype": "bfloat16", "k_bias": args.k_bias, "seed": args.seed,
                     "warmup": args.warmup, "reps": args.reps, "heads_sampled": args.heads,
                     "rows_sampled": args.rows, "dry_run": args.dry_run,
                     "flops": "4*B*H*S^2*D", "goal": "rel_l2_emu within 10% of the kernel's rel_l2"},
        "shapes": [],
    }

    def save():
        tmp = out_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(out_path)

    for shape_name, (n_heads, seq, dim) in shapes.items():
        q, k, v = make_inputs(n_heads, seq, dim, device=device, dtype=dtype, k_bias=args.k_bias, seed=args.seed)
        heads = sample_heads(n_heads, args.heads)
        rows = sample_rows(seq, args.rows).to(device)
        t0 = time.perf_counter()
        ref, lref = exact_attention(q[:, heads][:, :, rows], k[:, heads], v[:, heads], return_lse=True)
        entry = {"name": shape_name, "B": 1, "H": n_heads, "S": seq, "D": dim, "heads_sampled": heads,
                 "rows_sampled": int(rows.numel()), "reference_s": time.perf_counter() - t0,
                 "bf16_output_rel_l2": rel_l2(ref.to(dtype), ref), "variants": []}
        report["shapes"].append(entry)
        dispatch = None
        if sage is not None:
            try:
                dispatch = record_dispatch(sage, q, k, v)
            except Exception as e:
                dispatch = {"function": None, "error": f"{type(e).__name__}: {e}"}
        entry["dispatch"] = dispatch
        if dispatch and dispatch.get("function"):
            entry["dispatch_name"] = "sageattention." + dispatch["function"]
        flops = 4.0 * n_heads * seq * seq * dim
        emu_cache = {}
        for var in variants:
            if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
                entry["variants"].append({"name": var.name, "status": "skipped(deadline)"})
                continue
            if var.function == "sageattn":
                emu_cfg = emu_config_for_dispatch(dispatch) if sage is not None else dict(pv="fp8", arch="sm90")
            else:
                emu_cfg = var.emu
            t0 = time.perf_counter()
            row = run_variant(var, sage, emu_cfg, (q, k, v), (heads, rows), ref, lref, args, emu_cache, flops,
                              sage_reason=import_error)
            if shape_name == next(iter(shapes)) and not args.no_edge:
                row["edge"] = edge_checks(sage, var, emu_cfg, device, dtype,
                                          DRY_EDGE_CASES if args.dry_run else EDGE_CASES)
            row["wall_s"] = time.perf_counter() - t0
            entry["variants"].append(row)
            save()
            print(f"[{shape_name}] {var.name}: {row.get('status')} "
                  f"t={row.get('time', {}).get('median_ms', float('nan')):.3f} ms "
                  f"rel_l2={row.get('rel_l2', float('nan')):.5f} emu={row.get('rel_l2_emu', float('nan')):.5f} "
                  f"emu_vs_kernel={row.get('emu_vs_kernel_rel_l2', float('nan')):.2e} "
                  f"unchanged={row.get('inputs_unchanged')} ({row['wall_s']:.1f} s)", flush=True)
        del q, k, v, ref, lref
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    report["wall_s"] = time.perf_counter() - t_start
    save()
    from vdbench.measure.record import write_beside

    write_beside(out_path, report)  # the variants again, as records with the command that made them
    print(f"wrote {out_path} and records.jsonl beside it ({report['wall_s']:.1f} s)")
    return report


if __name__ == "__main__":
    main()
