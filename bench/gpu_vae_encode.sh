#!/usr/bin/env bash
# The VAE encode on ONE GPU (issue 22): the Wan 2.1 VAE's encode configs for Wan I2V's conditioning video (81 frames
# at 480x832: the image, then zero frames) beside diffusers' bf16 encode, the seed benchmark's 21-frame case
# (encode + decode, 256-px tiles), and one Wan 2.1 I2V 14B 480p render (random weights, 3 steps) with its stage
# breakdown. Real architectures, seeded random weights; quality: latents vs the fp32 encode (relative L2) and the
# round trip (the config's encode then its decode) vs the fp32 round trip, PSNR/SSIM per frame.
# Run from the repo root (after the lead's install + PYTHONPATH export): bash bench/gpu_vae_encode.sh
#
# Budget: <= 8 min wall on an H200 (nvidia-h200). Each part is bounded by `timeout` (200 + 190 + 75 s, the parts
# in priority order: the I2V table, the render, the quick case), each config by the bench's watchdog (--timeout),
# each render's VAE work by --vae_timeout, so nothing waits forever; results are written after each config, so a
# part cut at its limit keeps everything before the cut (the last configs of a list are the ones that may be cut).
#
# Goal (docs/PERFORMANCE.md §6b): fast >= 1.8x diffusers' bf16 encode (<= 0.62 s where bf16 takes 1.125 s) at
# >= 45 dB round trip against the fp32 round trip. The summary prints the verdict from the JSON.
#
# $OUT: gpu_info.txt; vae_encode_i2v81.json|log|err (the table; kernel profiles of bf16 and fast in the JSON);
# vae_encode_quick21.json|log|err; render_i2v14b.log, render_i2v14b_timing.json; summary.txt.
#
# A CPU dry run of the plumbing (tests/test_gpu_scripts.py): VAE=tiny-wan2.1 SIZE=48*32 F_I2V=9 F_QUICK=5 TILE=32
# BENCH_ARGS='--compile_backend eager --warmup 0 --repeats 1' I2V_ARGS='--model tiny --task i2v ...' STEPS=2.
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"   # the environment, OUT, PY, WAN14I2V
gpu_info "$OUT/gpu_info.txt"
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
B=("$PY" bench/bench_vae.py --model "${VAE:-wan2.1}" --size "${SIZE:-832*480}" --warmup 1 --repeats 3 "${EXTRA[@]}")
I2V=("${WAN14I2V[@]}")
[ -n "${I2V_ARGS:-}" ] && read -r -a I2V <<< "$I2V_ARGS"
rcs=()

part() {  # name, wall limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, at $(el)s) ==="
  timeout -k 5 "$limit" "$@" 2>"$OUT/$name.err" | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "!!! $name: cut at ${limit}s (wall limit); what finished is in $OUT"
  rcs+=("$name=$rc")
}

# 1. Wan I2V's conditioning video, encode only (each row's round trip decodes with that config's decode).
#    fast = --vae_encode fast (1 latent frame = 4 video frames per encoder call, lean layers, channels_last, the
#    Triton glue); fast@K = K latent frames per call; fast+eager_glue / fast_nocl = without the Triton glue / without
#    channels_last; chunked@4 = diffusers' layers, 4 latent frames per call.
part vae_encode_i2v81 200 "${B[@]}" --frames "${F_I2V:-81}" --input i2v --ops encode --timeout 60 \
  --profile 15 --profile_configs 'bf16,fast' -o "$OUT/vae_encode_i2v81.json" \
  --configs fp32,bf16,fast,fast@2,fast@4,fast+eager_glue,fast_nocl,channels_last_3d,fast+cudnn_benchmark,\
cudnn_benchmark,bf16_autocast,chunked@4,tiled,fast+compile

# 2. The render: the stages (text encode, CLIP image encode, VAE encode, denoising, VAE decode) and what's left.
"$PY" -c 'import sys, numpy as np; from PIL import Image
y, x = np.mgrid[0:480, 0:832]
Image.fromarray(np.stack([(x * 255 // 831), (y * 255 // 479), ((x + y) % 256)], -1).astype("uint8")).save(sys.argv[1])' \
  "$OUT/i2v_image.png"
part render_i2v14b 190 "$PY" run_wan.py "${I2V[@]}" --img_file_path "$OUT/i2v_image.png" --num_inference_steps "${STEPS:-3}" \
  --attention_type sdpa --vae_encode fast --vae_decode fast --vae_timeout 120 \
  --benchmark_output_directory "$OUT/i2v14b"
cp "$OUT/i2v14b/results/timing.json" "$OUT/render_i2v14b_timing.json" 2>/dev/null
rm -rf "$OUT/i2v14b" "$OUT/i2v_image.png"  # the video and image stay on the machine: the timing is the result

# 3. The seed benchmark's quick case: 21 frames, encode and decode, 256-px tiles.
part vae_encode_quick21 75 "${B[@]}" --frames "${F_QUICK:-21}" --tile_px "${TILE:-256}" --ops encode,decode \
  --timeout 25 --configs fp32,bf16,fast,tiled -o "$OUT/vae_encode_quick21.json"

echo "=== summary (at $(el)s) ==="
"$PY" - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(name):
    p = out / f"{name}.json"
    if not p.exists():
        print(f"{name}: no results"); return None, []
    d = json.loads(p.read_text())
    a, s = d["args"], d["system"]
    print(f"{name}: {a['model']} {a['frames']}f {a['size']} input={a['input']} ops={a['ops']} on {s.get('gpu')}, "
          f"torch {s['torch']}, cuDNN {s.get('cudnn')}")
    return d, d["results"]
_, res = rows("vae_encode_i2v81")
by = {r["config"]: r for r in res}
base = (by.get("bf16") or {}).get("encode_time_s_median")
for r in res:
    if r.get("status") != "ok" or "encode_time_s_median" not in r:
        print(f"  {r['config']:<22} {r.get('encode_status', r.get('status'))}: {str(r.get('encode_reason', r.get('reason', '')))[:90]}")
        continue
    t = r["encode_time_s_median"]
    info = r.get("encode_info") or {}
    print(f"  {r['config']:<22} encode {t:6.3f} s [{r['encode_time_s_min']:.3f}-{r['encode_time_s_max']:.3f}] "
          f"{(r.get('encode_peak_memory_gib') or 0):5.2f} GiB  x{(base / t) if base else float('nan'):4.2f} vs bf16  "
          f"latents rel L2 {r.get('latent_rel_l2', float('nan')):.2e}  round trip PSNR min/mean "
          f"{r.get('roundtrip_psnr_min', float('nan')):.2f}/{r.get('roundtrip_psnr_mean', float('nan')):.2f} "
          f"SSIM min {r.get('roundtrip_ssim_min') or float('nan'):.4f} {info.get('glue', '').split(' ')[0]}")
fast = by.get("fast") or {}
if base and fast.get("encode_time_s_median"):
    sp, q = base / fast["encode_time_s_median"], fast.get("roundtrip_psnr_min", 0)
    print(f"  GOAL fast >= 1.8x bf16 at >= 45 dB round trip: {sp:.2f}x, {q:.2f} dB -> "
          f"{'MET' if sp >= 1.8 and q >= 45 else 'NOT MET'}")
for r in res:
    p = r.get("encode_profile")
    if p:
        print(f"  profile {r['config']}: {p['total_ms']:.0f} ms of {p['time_kind']}; top 8:")
        for k in p["kernels"][:8]:
            print(f"    {k['pct']:5.1f}% {k['total_ms']:8.1f} ms {k['calls']:6d}x  {k['name'][:100]}")
_, res = rows("vae_encode_quick21")
for r in res:
    if r.get("status") != "ok":
        print(f"  {r['config']:<10} {r.get('status')}: {str(r.get('reason', ''))[:90]}"); continue
    print(f"  {r['config']:<10} encode {r.get('encode_time_s_median', float('nan')):.3f} s  decode "
          f"{r.get('time_s_median', float('nan')):.3f} s  together {r.get('total_time_s_median', float('nan')):.3f} s  "
          f"rel L2 {r.get('latent_rel_l2', float('nan')):.2e}  round trip PSNR min "
          f"{r.get('roundtrip_psnr_min', float('nan')):.2f}  decode PSNR min {r.get('psnr_min', float('nan')):.2f}")
p = out / "render_i2v14b_timing.json"
if p.exists():
    e = json.loads(p.read_text())[-1]
    print(f"render_i2v14b: total {e['total_time']:.2f} s, pipe {e['pipe_time']:.2f} s, steps "
          f"{', '.join(f'{t:.2f}' for t in e['step_times'])} s, peak {(e.get('peak_memory_bytes') or 0) / 2**30:.1f} GiB")
    total = e["total_time"]
    for k, v in e["stages"].items():
        print(f"  {k:<13} " + ("-" if v is None else f"{v:8.3f} s ({v / total:.1%})"))
    w = e["unaccounted_where"]
    named = ("" if w["before_denoise"] is None else
             f"; before the denoising {w['before_denoise']:.3f} s, after {w['after_denoise']:.3f} s")
    print(f"  unaccounted   {e['unaccounted']:8.3f} s ({e['unaccounted_share']:.2%}{named}) -> within 2%: "
          f"{abs(e['unaccounted_share']) <= 0.02}")
    print(f"  vae_encode: {e.get('vae_encode')}; vae_decode: {e.get('vae_decode')}")
else:
    print("render_i2v14b: no timing.json")
EOF
echo "exit codes: ${rcs[*]} (total $(el)s)"
