#!/usr/bin/env bash
# VAE decode configs on ONE GPU: every config x Wan 2.1 / Wan 2.2 (832x480, 81 frames) / CogVideoX (720x480,
# 49 frames) VAE, real architectures with seeded random weights, fp32-untiled reference, PSNR/SSIM per config,
# peak memory; kernel profiles (top 15 by device time) of bf16 and every fast variant on Wan 2.1.
# Run from the repo root (after the lead's wheel install + PYTHONPATH export); writes $OUT/vae_*.json|err|log
# and prints a compact summary.
#
# Budget: `all` <= ~7 min wall. Each model run is bounded by `timeout` (230 + 110 + 90 s; on an H200 in session 3 the
# first limits, 170 + 80 + 50 s, cut the last 1-3 configs of each model), each config by the
# bench's own watchdog (--timeout), so nothing can wait forever. Configs are ordered by priority and results are
# written after each config, so a run cut at its limit keeps everything before the cut (the lowest-priority
# configs, last in each list, are the ones that may be cut).
#
#   bash bench/gpu_vae.sh            # all three models (the table)
#   bash bench/gpu_vae.sh wan2.1     # one of: wan2.1 wan2.2 cogvideox compile
#
# Config names (bench/bench_vae.py): fast = the render's --vae_decode fast (lean layers + channels_last, 1 latent
# frame per decoder call, the Triton glue where it runs: decode_info.glue says which ran); fast@K = K latent frames
# per call; fast+eager_glue = the fast path with the PyTorch-op glue; fast_nocl = fast without channels_last;
# +cudnn_benchmark / +compile compose (fast+compile: the fast path's norm/SiLU glue compiled by inductor, convs
# stay cuDNN's; graph breaks reported); memory@GiB = fast path bounded by a memory budget.
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"   # the environment, OUT, PY
B=("$PY" bench/bench_vae.py --warmup 1 --repeats 2 --ops decode)  # the decode table (the encode's: gpu_vae_encode.sh)
rcs=()

# SKIP=REGEX drops the configs whose names match (e.g. SKIP='^(fast|memory)' when the Triton glue's GPU tests
# failed: a kernel fault would end the whole in-process run and lose every config after it)
SKIP=${SKIP:-}
run() {  # name, wall limit (s), bench args...
  local name=$1 limit=$2; shift 2
  if [ -n "$SKIP" ]; then
    local a=() prev=
    for x in "$@"; do
      [ "$prev" = --configs ] && x=$(echo "$x" | tr ',' '\n' | grep -vE "$SKIP" | paste -sd, -)
      a+=("$x"); prev=$x
    done
    set -- "${a[@]}"
  fi
  echo "=== $name (limit ${limit}s) ==="
  timeout -k 5 "$limit" "${B[@]}" "$@" -o "$OUT/vae_$name.json" 2>"$OUT/vae_$name.err" | tee "$OUT/vae_$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "!!! $name: run killed at ${limit}s (wall limit); partial results in $OUT/vae_$name.json"
  rcs+=("$name=$rc")
}

what=${1:-all}
if [ "$what" = all ] || [ "$what" = wan2.1 ]; then
  # Wan 2.1 VAE (also Wan 2.2 A14B's). Profiles: bf16 and every fast* config (the best one is among them).
  # memory@4.5: a budget at the stock bf16 peak (4.63 GiB), i.e. an untiled chunk.
  run wan21 230 --model wan2.1 --frames 81 --size 832*480 --timeout 60 --profile 20 \
    --profile_configs 'bf16,fast,fast@2,fast+eager_glue' \
    --configs fp32,bf16,fast,fast@2,fast+eager_glue,fast@4,fast_nocl,fast+cudnn_benchmark,memory@4.5,channels_last_3d,\
fast+compile,cudnn_benchmark,fast+eager_glue@2,tiled,bf16_autocast,chunked@4
fi
if [ "$what" = all ] || [ "$what" = wan2.2 ]; then
  # Wan 2.2 TI2V-5B VAE (48 latent channels, 16x spatial), 832x480 (the 5B model's 480p is 1280x704; 832x480
  # keeps the table at one resolution), 81 frames.
  run wan22 110 --model wan2.2 --frames 81 --size 832*480 --timeout 40 \
    --configs fp32,bf16,fast,fast@2,fast+eager_glue,fast_nocl,channels_last_3d,fast@4,cudnn_benchmark,tiled,fast+compile
fi
if [ "$what" = all ] || [ "$what" = cogvideox ]; then
  # CogVideoX VAE (2b/5b), 720x480, 49 frames (its native size). fast*: Wan only (reported n/a, no time spent).
  run cogvideox 90 --model cogvideox --frames 49 --size 720*480 --timeout 25 \
    --configs fp32,bf16,channels_last_3d,cudnn_benchmark,fast,tiled,bf16_autocast
fi
if [ "$what" = compile ]; then
  # torch.compile of the whole Wan 2.1 decoder (~150 s of compilation on an H200, outside the timed repeats;
  # graph breaks reported), and the fast path with its glue compiled.
  run wan21_compile 280 --model wan2.1 --frames 81 --size 832*480 --timeout 240 --configs fast+compile,compile
fi

echo "=== summary ==="
for f in "$OUT"/vae_*.json; do
  [ -f "$f" ] || continue
  "$PY" - "$f" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
a, s = d["args"], d["system"]
print(f"{a['model']} {a['frames']}f {a['size']} on {s.get('gpu')} ({s.get('gpu_arch')}), torch {s['torch']}, "
      f"cuDNN {s.get('cudnn')}")
for r in d["results"]:
    if r.get("status") != "ok":
        print(f"  {r['config']:<24} {r['status']}: {str(r.get('reason', ''))[:90]}")
        continue
    info = r.get("decode_info") or {}
    extra = " ".join(f"{k}={info[k]}" for k in ("path", "chunk_frames", "tile_px") if k in info)
    if "glue" in info:
        extra += " glue=" + info["glue"].split(" ")[0]
    if "graph_breaks" in r:
        extra += f" graph_breaks={r['graph_breaks']} graphs={r.get('compiled_graphs')}"
    print(f"  {r['config']:<24} {r['time_s_median']:6.3f} s [{r['time_s_min']:.3f}-{r['time_s_max']:.3f}]"
          f" {r['peak_memory_gib'] or 0:6.2f} GiB  PSNR min/mean {r.get('psnr_min', float('nan')):6.2f}/"
          f"{r.get('psnr_mean', float('nan')):6.2f}  SSIM min {r.get('ssim_min') or float('nan'):.4f}"
          f"{'  FLAG' if r.get('quality_flag') else ''} {extra}")
for r in d["results"]:
    p = r.get("profile")
    if not p:
        continue
    print(f"  profile {r['config']}: {p['total_ms']:.0f} ms of {p['time_kind']}; top 6:")
    for k in p["kernels"][:6]:
        print(f"    {k['pct']:5.1f}% {k['total_ms']:8.1f} ms {k['calls']:6d}x  {k['name'][:100]}")
EOF
done
echo "exit codes: ${rcs[*]}"
