#!/usr/bin/env bash
# VAE decode configs on the GPU machine (issue 7): every config x Wan 2.1 / Wan 2.2 / CogVideoX VAE at 480p,
# real architectures with seeded random weights, fp32-untiled reference, PSNR/SSIM per config.
# Run from the repo root (after the lead's wheel install + PYTHONPATH export); writes $OUT/vae_*.json|csv|log
# and prints a compact summary. Budget: <= 4 min in all (each model run is bounded by `timeout`, each config
# by the bench's own watchdog, so nothing can wait forever).
#
#   bash bench/gpu_vae.sh            # all three models
#   bash bench/gpu_vae.sh wan2.1     # one of: wan2.1 wan2.2 cogvideox compile
set -uo pipefail
OUT=${OUT:-gpu_results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B=(python3 bench/bench_vae.py --warmup 1)
rcs=()

run() {  # name, wall limit (s), bench args...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) ==="
  timeout -k 5 "$limit" "${B[@]}" "$@" -o "$OUT/vae_$name.json" 2>"$OUT/vae_$name.err" | tee "$OUT/vae_$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "!!! $name: run killed at ${limit}s (wall limit); partial log in $OUT/vae_$name.log"
  rcs+=("$name=$rc")
}

what=${1:-all}
if [ "$what" = all ] || [ "$what" = wan2.1 ]; then
  # Wan 2.1 VAE (also Wan 2.2 A14B's), 832x480, 81 frames: every config; fast at chunks 2/4/8; the memory
  # mode at the diffusers-tiling peak (1.45 GiB) and at 2.5 GiB.
  # Ordered by priority: results are written after each config, so a run cut at its limit keeps the first ones.
  run wan21 140 --model wan2.1 --frames 81 --size 832*480 --repeats 3 --timeout 40 \
    --configs fp32,bf16,fast@4,memory@1.45,tiled,fast@2,fast@8,chunked@4,channels_last_3d,cudnn_benchmark,\
bf16_autocast,memory@2.5,miopen_fast
fi
if [ "$what" = all ] || [ "$what" = wan2.2 ]; then
  # Wan 2.2 TI2V-5B VAE (48 latent channels, 16x spatial), 832x480 (the 5B model's 480p is 1280x704; 832x480
  # keeps the table at one resolution), 81 frames.
  run wan22 50 --model wan2.2 --frames 81 --size 832*480 --repeats 2 --timeout 25 \
    --configs fp32,bf16,fast@4,memory@2.5,tiled
fi
if [ "$what" = all ] || [ "$what" = cogvideox ]; then
  # CogVideoX VAE (2b/5b), 720x480, 49 frames (its native size). chunked/fast/memory: Wan only (reported n/a).
  run cogvideox 45 --model cogvideox --frames 49 --size 720*480 --repeats 2 --timeout 25 \
    --configs fp32,bf16,tiled,channels_last_3d,bf16_autocast,cudnn_benchmark,fast
fi
if [ "$what" = compile ]; then
  # torch.compile of the Wan 2.1 decoder (compile time is outside the timed repeats; graph breaks reported).
  run wan21_compile 150 --model wan2.1 --frames 81 --size 832*480 --repeats 2 --timeout 120 --configs compile
fi

echo "=== summary ==="
for f in "$OUT"/vae_*.json; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
a, s = d["args"], d["system"]
print(f"{a['model']} {a['frames']}f {a['size']} on {s.get('gpu')} ({s.get('gpu_arch')}), torch {s['torch']}")
for r in d["results"]:
    if r.get("status") != "ok":
        print(f"  {r['config']:<18} {r['status']}: {str(r.get('reason', ''))[:90]}")
        continue
    info = r.get("decode_info") or {}
    extra = " ".join(f"{k}={info[k]}" for k in ("path", "chunk_frames", "tile_px") if k in info)
    print(f"  {r['config']:<18} {r['time_s_median']:6.3f} s [{r['time_s_min']:.3f}-{r['time_s_max']:.3f}]"
          f" {r['peak_memory_gib'] or 0:6.2f} GiB  PSNR min/mean {r.get('psnr_min', float('nan')):6.2f}/"
          f"{r.get('psnr_mean', float('nan')):6.2f}  SSIM min {r.get('ssim_min') or float('nan'):.4f}"
          f"{'  FLAG' if r.get('quality_flag') else ''} {extra}")
EOF
done
echo "exit codes: ${rcs[*]}"
