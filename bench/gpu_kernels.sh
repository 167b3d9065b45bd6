#!/usr/bin/env bash
# The project's Triton attention kernels (vdbench/kernels) on the GPU machine: correctness, a small tile sweep,
# then the kernel bench at the real shapes next to FA3. Run from the repo root; everything goes under $OUT
# (default outputs/gpu_kernels). Expected ~4 min on an H200 (the stage time limits add up to 8 min at worst).
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=$PWD:/tmp/site && bash bench/gpu_kernels.sh
#
# Stages (each under its own time limit):
#   1 check  kernels vs their torch emulations and fp64 at small odd shapes, poisoned outputs, with the configs
#            the backends use (vdbench/kernels CONFIGS + tuned_configs.json)                      -> check.json
#   2 sweep  vdbench.kernels.attention.SWEEP per kernel at Wan 1.3B (D128) and CogVideoX-2b (D64): v1's configs
#            first, then the v2 variants (TMA descriptor loads, PV_ACC direct fp8 accumulation, FOLD scale in
#            the exp2); all variants are compiled first by SWEEP_JOBS (default 8) parallel workers (at most
#            SWEEP_WARM_S=50 s), then timed one by one (backend call, quantization pre-pass included), rel L2 vs
#            fp64 on 2 heads x 4096 queries of the same output. A config that fails to compile or launch is a row
#            with status "error: ...". Best per kernel among the rows whose rel L2 is within 5% + 1e-3 of the
#            v1 baseline's; sweep.csv / best_configs.json rewritten after every row.   ~60-90 s on an H200.
#            To make the winners the backends' defaults:
#              cp $OUT/best_configs.json vdbench/kernels/tuned_configs.json   (then STAGES=check to verify)
#   3 bench  bench/bench_attention.py at wan2.1-1.3b-480p, cogvideox-2b, wan2.1-14b-720p with the sweep's
#            winners (VDBENCH_KERNEL_CONFIGS) and FA3 bf16/fp8 measured in the same run   -> attn_kernels_<preset>.csv/json/png
# STAGES="check sweep bench" selects stages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu_kernels}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-$PWD}"
case ":$PYTHONPATH:" in *":$PWD:"*) ;; *) export PYTHONPATH="$PWD:$PYTHONPATH" ;; esac
STAGES="${STAGES:-check sweep bench}"
LOG="$OUT/log.txt"
PY=python3
start=$(date +%s)
{
  echo "== $(date -u +%FT%TZ) gpu_kernels.sh, stages: $STAGES"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} 2>&1 | tee -a "$LOG"

cat > "$OUT/kernels_gpu.py" <<'PYEOF'
import csv, json, os, sys, time
import torch
from vdbench import backends as B
from vdbench import numerics as N
from vdbench.kernels import attention as A
OUT = os.environ["OUT"]
DRY = os.environ.get("DRY") == "1"  # CPU dry run of this script's logic under TRITON_INTERPRET=1, tiny shapes
dev = torch.device("cpu" if DRY else "cuda")
if DRY:
    def do_bench(fn, warmup=0, rep=0, return_mode="median"):
        t0 = time.perf_counter(); fn(); return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize = lambda *a: None
else:
    from triton.testing import do_bench
NAMES = ("fav3_sage", "fp8_triton", "fav2_triton")


def rel(x, r):
    return ((x.double() - r.double()).norm() / r.double().norm()).item()


def inputs(b, h, s, d, seed=0, k_bias=3.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g) + k_bias * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    return [t.to(dev, dtype) for t in (q, k, v)]


def emu(name, q, k, v, cfg, **kw):
    if name == "fav3_sage":
        return N.fav3_sage_emulated(q, k, v, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], **kw)
    if name == "fp8_triton":
        return N.fp8_triton_emulated(q, k, v, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], **kw)
    return None


def check():
    rows, bad = [], 0
    for name in NAMES:
        print(name, B.availability(name, dev), flush=True)
    for d in (64, 128):
        for s in ((1, 37, 130) if DRY else (1, 37, 130, 1000, 4096)):
            for dtype in (torch.bfloat16, torch.float16):
                if dtype == torch.float16 and s not in (130,):
                    continue
                q, k, v = inputs(1 if DRY or s >= 1000 else 2, 2 if s < 4096 else 12, s, d, seed=s + d, dtype=dtype)
                ref = B.exact_attention(q, k, v)
                for name in NAMES:
                    for kw in ({}, {"pv": "fp16"}) if name == "fav3_sage" else ({},):
                        for causal in (False, True) if (s == 130 and dtype == torch.bfloat16) else (False,):
                            cfg = A.config_for(name, d, dev)
                            out = torch.full_like(q, float("nan"))
                            A.KERNELS[name](q, k, v, out=out, is_causal=causal, **kw)
                            torch.cuda.synchronize()
                            nan = int((~torch.isfinite(out)).sum())
                            r = B.exact_attention(q, k, v, is_causal=True) if causal else ref
                            e = emu(name, q, k, v, cfg, is_causal=causal, **kw) if s <= 4096 else None
                            row = dict(kernel=name + ("[pv=fp16]" if kw else ""), D=d, S=s, dtype=str(dtype)[6:],
                                       causal=causal, rel_l2_fp64=rel(out, r),
                                       rel_l2_emu=rel(out, e) if e is not None else None,
                                       emu_rel_l2_fp64=rel(e, r) if e is not None else None, nan_inf=nan)
                            ok = nan == 0 and row["rel_l2_fp64"] < (1e-2 if name == "fav2_triton" else 1e-1)
                            if e is not None:
                                ok = ok and row["rel_l2_emu"] < 3e-2
                            row["ok"] = ok
                            bad += not ok
                            rows.append(row)
    json.dump(rows, open(f"{OUT}/check.json", "w"), indent=1)
    for r in rows:
        if not r["ok"] or (r["S"] == 4096 and not r["causal"]):
            print(("FAIL " if not r["ok"] else "") + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in r.items()), flush=True)
    print(f"check: {len(rows) - bad}/{len(rows)} ok", flush=True)
    return bad


SHAPES = {128: (1, 12, 32760, 128), 64: (1, 30, 17776, 64)}  # Wan 1.3B 480p, CogVideoX-2b
if DRY:
    SHAPES = {128: (1, 2, 100, 128), 64: (1, 2, 70, 64)}


def sweep_variants(d):
    """[(kernel, kwargs, label, cfg)] in sweep order: vdbench.kernels.attention.SWEEP (v1's configs first), then
    fav3_sage pv=fp16 at D128 (for the record; never picked as a default)."""
    out = [(n, {}, n, dict(c)) for n in NAMES for c in A.SWEEP[d][n]]
    if d == 128:  # v1's tiles and the first all-flags v2 config (the pv=fp16 call uses fav3_sage's config)
        v2 = next(c for c in A.SWEEP[d]["fav3_sage"] if c.get("TMA") and c.get("FOLD"))
        for c in (A.SWEEP[d]["fav3_sage"][0], v2):
            out.append(("fav3_sage", {"pv": "fp16"}, "fav3_sage[pv=fp16]", dict(c)))
    return out


def inputs_fast(b, h, s, d):  # same shapes/strides/alignment as inputs(): what the compiled variant depends on
    return [torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3)]


def warm(d, idx):
    """Compile some sweep variants at the real shape (fills Triton's on-disk cache), run by parallel workers."""
    b, h, s, _ = SHAPES[d]
    q, k, v = inputs_fast(b, h, s, d)
    vs = sweep_variants(d)
    for i in idx:
        name, kw, label, cfg = vs[i]
        t0 = time.time()
        try:
            A.KERNELS[name](q, k, v, config=cfg, **kw)
            pre = A.prepass(name, cfg)
            if pre and not kw:
                pre(q, k, v)
            torch.cuda.synchronize()
            print(f"  warm {label} D{d} {A.config_label(cfg)} {time.time() - t0:.1f}s", flush=True)
        except Exception as ex:
            print(f"  warm {label} D{d} {A.config_label(cfg)} failed: {type(ex).__name__}: {str(ex)[:120]}", flush=True)


def prewarm(jobs=int(os.environ.get("SWEEP_JOBS", "8")), limit=float(os.environ.get("SWEEP_WARM_S", "50"))):
    """Compile every variant in ``jobs`` worker processes first (Triton compiles on one CPU core each): the
    timed loop then loads them from the cache. Best effort: whatever isn't compiled compiles in the loop."""
    import subprocess
    t0 = time.time()
    work = [(d, i) for d in SHAPES for i in range(len(sweep_variants(d)))]
    # round-robin so each worker gets a mix (TMA and pointer variants, both head dims)
    groups = [work[j::jobs] for j in range(jobs)]
    procs = []
    for g in groups:
        if not g:
            continue
        arg = ";".join(f"{d}:{i}" for d, i in g)
        procs.append(subprocess.Popen([sys.executable, __file__, "warm", arg]))
    for p in procs:
        try:
            p.wait(timeout=max(1.0, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            print("  warm worker killed at the time limit", flush=True)
    print(f"prewarm: {len(work)} variants in {len(procs)} workers, {time.time() - t0:.1f}s", flush=True)


def write_results(rows, best):
    with open(f"{OUT}/sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    json.dump(best, open(f"{OUT}/best_configs.json", "w"), indent=1)


def sweep():
    """Time every variant at the real shape (backend call: pre-pass included), accuracy on 2 heads x 4096 queries
    of the same output (no second compile). A variant is eligible as its kernel's best only if its rel L2 vs
    fp64 is within 5% + 1e-3 of the v1 baseline's (the first config of the list), so no speed is bought with
    accuracy. Results are written after every row (a timeout keeps what was measured)."""
    if not DRY and os.environ.get("SWEEP_JOBS", "8") != "0":
        prewarm()
    rows, best, base_err = [], {}, {}
    for d, (b, h, s, _) in SHAPES.items():
        q, k, v = inputs(b, h, s, d)
        flops = 4 * b * h * s * s * d
        nq = min(4096, s)
        ref_small = B.exact_attention(q[:, :2, :nq], k[:, :2], v[:, :2])
        for name, kw, label, cfg in sweep_variants(d):
            fn = lambda: A.KERNELS[name](q, k, v, config=cfg, **kw)
            t0 = time.time()
            try:
                out = fn()
                torch.cuda.synchronize()
                applied = "+".join(f for f in ("tma_qk", "tma_v", "pv_acc", "fold") if A.LAST_LAUNCH.get(f)) or "-"
                err = rel(out[:, :2, :nq], ref_small)
                status = "ok" if torch.isfinite(out).all() else "NaN"
                del out
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                pre = A.prepass(name, cfg)
                qms = do_bench(lambda: pre(q, k, v), warmup=5, rep=20, return_mode="median") if pre and not kw else None
            except Exception as ex:  # a config that doesn't compile or launch (shared memory, registers) is a row
                ms, qms, err, status = float("nan"), None, float("nan"), f"error: {type(ex).__name__}: {str(ex)[:80]}"
                applied = "?"
            key = f"{name}:{d}"
            if not kw and key not in base_err and status == "ok":
                base_err[key] = err  # the first measured config of the kernel: v1's
            # PV_ACC (fp8 P.V wgmma accumulating straight into the running accumulator) is never eligible: on the
            # H200 it matched v1 on random inputs here but rendered the Wan 1.3B pipeline at 24.7 dB vs FA3 (v1
            # 41.9 dB) -- fp8 tensor-core accumulation keeps too few bits over 256 KV tiles (docs/PERFORMANCE.md).
            eligible = (status == "ok" and not kw and not cfg.get("PV_ACC", 0)
                        and err <= base_err.get(key, float("inf")) * 1.05 + 1e-3)
            row = dict(kernel=label, D=d, H=h, S=s, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], TMA=cfg.get("TMA", 0),
                       PV_ACC=cfg.get("PV_ACC", 0), FOLD=cfg.get("FOLD", 0), applied=applied, ms=ms, quant_ms=qms,
                       tflops=flops / ms / 1e9 if ms == ms else float("nan"), rel_l2_fp64=err, status=status,
                       eligible=eligible, wall_s=round(time.time() - t0, 1))
            rows.append(row)
            print(f"{label:20s} D{d} {A.config_label(cfg):24s} {ms:8.3f} ms  {row['tflops']:6.1f} TFLOP/s  "
                  f"quant {qms if qms is None else round(qms, 3)} ms  relL2 {err:.2e}  {status}  [{applied}]"
                  f"{'' if eligible or kw else '  (not eligible)'}  ({row['wall_s']}s)", flush=True)
            if eligible and (key not in best or ms < best[key]["ms"]):
                best[key] = dict(cfg, ms=ms, tflops=row["tflops"], rel_l2_fp64=err)
            write_results(rows, best)
        del q, k, v
        torch.cuda.empty_cache()
    print("best (copy best_configs.json to vdbench/kernels/tuned_configs.json to make these the defaults):", flush=True)
    for key, c in best.items():
        print(f"  {key:16s} {A.config_label(c):24s} {c['tflops']:.0f} TFLOP/s  relL2 {c['rel_l2_fp64']:.2e}",
              flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "warm":
        by_d = {}
        for item in sys.argv[2].split(";"):
            d, i = item.split(":")
            by_d.setdefault(int(d), []).append(int(i))
        for d, idx in by_d.items():
            warm(d, idx)
        sys.exit(0)
    sys.exit({"check": check, "sweep": sweep}[sys.argv[1]]() or 0)
PYEOF

rc=0
export OUT
if [[ " $STAGES " == *" check "* ]]; then
  echo "== stage check" | tee -a "$LOG"
  timeout 75 $PY "$OUT/kernels_gpu.py" check 2>&1 | tee -a "$LOG"; r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
fi
if [[ " $STAGES " == *" sweep "* ]]; then
  echo "== stage sweep" | tee -a "$LOG"
  timeout 140 $PY "$OUT/kernels_gpu.py" sweep 2>&1 | tee -a "$LOG"; r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
fi
if [[ " $STAGES " == *" bench "* ]]; then
  echo "== stage bench" | tee -a "$LOG"
  [ -s "$OUT/best_configs.json" ] && export VDBENCH_KERNEL_CONFIGS="$OUT/best_configs.json"
  # one invocation per preset, so a timeout at the largest shape loses only that shape's rows
  for preset in wan2.1-1.3b-480p cogvideox-2b wan2.1-14b-720p; do
    timeout 100 $PY bench/bench_attention.py --preset "$preset" --kernel fav3_sage,fp8_triton,fav2_triton,fav3,fav3_fp8 \
      -o "$OUT/attn_kernels_$preset.csv" 2>&1 | tee -a "$LOG"
    r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  done
fi
echo "== done in $(( $(date +%s) - start )) s, exit $rc; results in $OUT" | tee -a "$LOG"
exit $rc
