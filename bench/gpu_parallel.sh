#!/usr/bin/env bash
# Issue 8, part 5: sequence-parallel Wan on 2 GPUs (nvidia-h200-x2), both engines, per backend, against 1 GPU.
# Run from the repo root (wheels installed and PYTHONPATH set by the caller's prefix). Results under $OUT:
#   summary.txt (compact table + 4/8-GPU model), parallel_summary.json, runs.tsv (every command: rc, wall),
#   timing_<config>.json (merged per-rank timing written by rank 0), logs/<run>.log (every run's log).
# Model: Wan 2.1 1.3B architecture, random weights, 832x480, 81 frames, 3 steps (warm step: median of the steps after the first; vdbench.timing).
# Budget (bench/gpu_lib.sh's runner r): no run starts with < 45 s of BUDGET_S (default 420 s) left and none runs
# past BUDGET_S + 30 s (nor longer than RUN_TIMEOUT_S), so the whole script (summary included) stays under 8 min;
# runs.tsv says which ran, failed (rc) or were skipped.
set -uo pipefail
RES=${RES:-/tmp/vdbench_par}; [[ -n "${KEEP_RES:-}" ]] || rm -rf "$RES"  # KEEP_RES=1: 1-GPU runs made elsewhere
BUDGET_S=${BUDGET_S:-420}; RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}; PORT=29650
LIMIT_S=$(( BUDGET_S + 35 )); GRACE_S=30  # runs start within BUDGET_S and end by BUDGET_S + 30 s (r's 5 s kept)
# W13_ARGS overrides the model/size (a CPU dry run of this script: W13_ARGS="--model tiny --height 64 ...")
source "$(dirname "$0")/gpu_lib.sh"   # OUT, the environment, W13, r (the budgeted runner), gpu_info
W=$OUT; runs_init; gpu_info "$OUT/gpu.txt"  # r's logs and runs.tsv go to $OUT

TR2=("$PY" -m torch.distributed.run --nproc_per_node=2)  # + --master_port=$((PORT++)) per run (timeout runs no functions)

# 0. all-to-all at Wan 1.3B Ulysses-2 shape: one Q/K/V/O tensor per rank = (1, 12 heads, 16380 tokens, 128) bf16
cat > "$RES/a2a.py" <<'EOF'
import json, os, sys, torch, torch.distributed as dist
rank = int(os.environ["RANK"]); torch.cuda.set_device(rank); dist.init_process_group("nccl")
n = dist.get_world_size(); x = torch.randn(1, 12, 32760 // n, 128, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x); ts = []
for i in range(25):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier(); a.record(); dist.all_to_all_single(y, x); b.record(); b.synchronize()
    if i >= 5: ts.append(a.elapsed_time(b) / 1e3)
ts.sort()
if rank == 0:
    json.dump({"world": n, "bytes_per_rank": x.numel() * 2, "a2a_s_median": ts[len(ts) // 2]}, open(sys.argv[1], "w"))
dist.destroy_process_group()
EOF
r a2a 30 "$RUN_TIMEOUT_S" "${TR2[@]}" --master_port=$((PORT++)) "$RES/a2a.py" "$OUT/a2a.json"

# 1. one GPU per backend (two at a time, one per GPU: independent devices)
one() { CUDA_VISIBLE_DEVICES=$1 "$PY" run_wan.py "${W13[@]}" --benchmark_output_directory "$RES/1gpu" --attention_type "$2"; }
ONE1=(${ONE_GPU_1:-sdpa_cudnn fav3}); ONE2=(${ONE_GPU_2:-sagev1 fav3_fp8})
[[ -n "${SKIP_1GPU:-}" ]] || r "1gpu_${ONE1[0]}+${ONE1[1]}" 60 "$RUN_TIMEOUT_S" bash -c "$(declare -f one); W13=(${W13[*]}); RES=$RES; PY=$PY; one 0 ${ONE1[0]} & a=\$!; one 1 ${ONE1[1]} & b=\$!; wait \$a; r=\$?; wait \$b; exit \$(( r | \$? ))"
[[ -n "${SKIP_1GPU:-}" ]] || r "1gpu_${ONE2[0]}+${ONE2[1]}" 60 "$RUN_TIMEOUT_S" bash -c "$(declare -f one); W13=(${W13[*]}); RES=$RES; PY=$PY; one 0 ${ONE2[0]} & a=\$!; one 1 ${ONE2[1]} & b=\$!; wait \$a; r=\$?; wait \$b; exit \$(( r | \$? ))"

# 2. two GPUs: Ulysses-2 and ring-2, both engines (most wanted first; sagev1 under ring is refused: no LSE)
par() {  # par ENGINE ulysses|ring DEGREE BACKEND
  local e=$1 p=$2 d=$3 b=$4 tag=${1}_${2:0:1}2
  r "${tag}_$b" 45 "$RUN_TIMEOUT_S" "${TR2[@]}" --master_port=$((PORT++)) run_wan.py "${W13[@]}" --benchmark_output_directory "$RES/$tag" --attention_type "$b" \
    --parallel_engine "$e" "--${p}_degree" "$d"
}
for b in ${PAR_FIRST:-sdpa_cudnn fav3}; do for e in diffusers xfuser; do par $e ulysses 2 $b; done; done
for b in ${PAR_FIRST:-sdpa_cudnn fav3}; do for e in diffusers xfuser; do par $e ring 2 $b; done; done
for b in ${PAR_THEN:-sagev1 fav3_fp8}; do for e in diffusers xfuser; do par $e ulysses 2 $b; done; done
for e in diffusers xfuser; do par $e ring 2 ${RING_THEN:-fav3_fp8}; done
for e in diffusers xfuser; do par $e ring 2 sagev1; done   # expected: refused before model load (exit 2)

# 3. summary: step times, speedups, PSNR / rel L2 vs the 1-GPU output of the same backend, per-rank kernel counts
"$PY" - "$RES" "$OUT" <<'EOF'
import glob, json, math, os, sys
import numpy as np, torch
res, out = sys.argv[1:3]
def entries(cfg):
    p = os.path.join(res, cfg, "results", "timing.json")
    return {e["attention_type"]: e for e in json.load(open(p))} if os.path.exists(p) else {}
def frames(cfg, b):
    f = glob.glob(os.path.join(res, cfg, "results", f"*attn_{b}_*.npy"))
    return np.load(f[0]) if f else None
def latents(cfg, b):
    f = sorted(glob.glob(os.path.join(res, cfg, "captures", f"latents_{b}_rank0_*.pt")))
    return torch.load(f[-1], weights_only=True)["latents"].float() if f else None
def psnr(a, b):
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return None if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)  # None: identical frames
base = entries("1gpu")
rows, table = [], []
configs = [("1gpu", "1 GPU", "-")] + [(f"{e}_{p}2", f"{p}-2".replace("u-", "Ulysses-").replace("r-", "ring-"), e)
                                     for p in ("u", "r") for e in ("diffusers", "xfuser")]
order = ["sdpa_cudnn", "fav3", "sagev1", "fav3_fp8"]
for b in order + sorted(set(base) - set(order)):
    ref_e, ref_f, ref_l = base.get(b), frames("1gpu", b), latents("1gpu", b)
    for cfg, label, engine in configs:
        e = entries(cfg).get(b)
        if e is None:
            continue
        r = {"backend": b, "config": label, "engine": engine, "step_ms": 1e3 * e["warm_step_median"],
             "step_times_ms": [1e3 * t for t in e["step_times"]], "decode_s": e["vae_decode_time"],
             "attention_s": e["attention"].get("attention_time_s")}
        if ref_e and cfg != "1gpu":
            r["speedup"] = ref_e["warm_step_median"] / e["warm_step_median"]
            f, l = frames(cfg, b), latents(cfg, b)
            if f is not None and ref_f is not None:
                r["psnr_vs_1gpu_db"] = psnr(f, ref_f)
                r["identical_frames"] = bool(np.array_equal(f, ref_f))
            if l is not None and ref_l is not None:
                r["latent_rel_l2_vs_1gpu"] = float((l - ref_l).norm() / ref_l.norm())
        if "ranks" in e:
            r["kernels_per_rank"] = {pr["rank"]: pr["attention"]["calls_by_kernel"] for pr in e["ranks"]}
            r["step_ms_per_rank"] = {pr["rank"]: 1e3 * pr["warm_step_median"] for pr in e["ranks"]}
            r["attention_s_per_rank"] = {pr["rank"]: pr["attention"].get("attention_time_s") for pr in e["ranks"]}
        else:
            r["kernels_per_rank"] = {0: e["attention"]["calls_by_kernel"]}
        rows.append(r)
        k = "; ".join(f"r{rk}: " + ",".join(f"{n}x{c}" for n, c in kk.items()) for rk, kk in r["kernels_per_rank"].items())
        table.append(f"{b:10s} {label:11s} {engine:9s} {r['step_ms']:8.1f} {r.get('speedup', float('nan')):6.2f}x "
                     f"{('  ident' if r.get('identical_frames') else format(r.get('psnr_vs_1gpu_db') or float('nan'), '7.2f'))} {r.get('latent_rel_l2_vs_1gpu', float('nan')):9.2e}  {k}")
# 4- and 8-GPU model (Ulysses): compute splits evenly over N; an all-to-all moves (N-1)/N of a rank's
# (S/N)*H*D shard, so its time scales as (N-1)/N^2 (per-GPU NVLink bandwidth constant on an NVSwitch host).
# Per step: 30 layers x 2 guidance passes x 4 all-to-alls (Q, K, V in; O out) = 240, not overlapped today.
model = {}
a2a = json.load(open(os.path.join(out, "a2a.json"))) if os.path.exists(os.path.join(out, "a2a.json")) else None
f = lambda n: (n - 1) / n ** 2
for b in ["sdpa_cudnn", "fav3"] + sorted(set(base) - set(order)):
    t1 = base.get(b, {}).get("warm_step_median")
    for eng in ("diffusers", "xfuser"):
        u2 = entries(f"{eng}_u2").get(b, {}).get("warm_step_median")
        if not (t1 and u2):
            continue
        over2 = u2 - t1 / 2  # measured cost of going parallel at N=2 (all-to-all + imbalance + gathers)
        m = {"t1_ms": 1e3 * t1, "u2_ms": 1e3 * u2, "overhead2_ms": 1e3 * over2}
        if a2a:
            m["a2a_240_ms_measured_n2"] = 1e3 * 240 * a2a["a2a_s_median"]
        for n in (4, 8):
            serial = t1 / n + over2 * f(n) / f(2)
            m[f"n{n}_ms_no_overlap"] = 1e3 * serial
            m[f"n{n}_speedup_no_overlap"] = t1 / serial
            if a2a:
                comm = 240 * a2a["a2a_s_median"] * f(n) / f(2)
                m[f"n{n}_ms_full_overlap"] = 1e3 * max(t1 / n, comm)
                m[f"n{n}_speedup_full_overlap"] = t1 / max(t1 / n, comm)
        model[f"{b}/{eng}"] = m
json.dump({"rows": rows, "model": model, "a2a": a2a}, open(os.path.join(out, "parallel_summary.json"), "w"), indent=1)
lines = ["backend    config      engine    ms/step  speedup PSNR(dB) latentRL2  kernels per rank",
         *table, "", "a2a (Ulysses-2 shard, 1 call): " + (f"{1e3 * a2a['a2a_s_median']:.3f} ms for "
         f"{a2a['bytes_per_rank'] / 2**20:.1f} MiB/rank" if a2a else "n/a"), "Ulysses model (ms/step, speedup):"]
for k, m in model.items():
    lines.append(f"  {k}: 1GPU {m['t1_ms']:.0f}, U2 {m['u2_ms']:.0f} (overhead {m['overhead2_ms']:.0f}"
                 + (f", 240 a2a {m['a2a_240_ms_measured_n2']:.0f}" if 'a2a_240_ms_measured_n2' in m else "") + ")"
                 + "".join(f"; N={n}: {m[f'n{n}_ms_no_overlap']:.0f} ({m[f'n{n}_speedup_no_overlap']:.2f}x)"
                           + (f" / overlapped {m[f'n{n}_ms_full_overlap']:.0f} ({m[f'n{n}_speedup_full_overlap']:.2f}x)"
                              if f'n{n}_ms_full_overlap' in m else "") for n in (4, 8)))
open(os.path.join(out, "summary.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
for d in "$RES"/*/results/timing.json; do c=$(basename "$(dirname "$(dirname "$d")")"); cp "$d" "$OUT/timing_$c.json"; done
echo "runs (rc, wall):"; column -t "$OUT/runs.tsv" | tee "$OUT/runs.txt"
echo "total $(el) s"
