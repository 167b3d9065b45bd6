#!/usr/bin/env bash
# GPU verification runs (device tool): what docs/PERFORMANCE.md records. Run from the repo root on a GPU machine
# with the optional packages available (on the lent machines: carried wheels, see ../shared/device/).
#
#   bash bench/gpu_verify.sh kernels   # bench_attention.py at the real shapes, every GPU kernel + emulations
#   bash bench/gpu_verify.sh wan       # Wan 1.3B architecture (random weights) 832x480x81: step time per backend
#   bash bench/gpu_verify.sh wanref    # the same for reference + emulations, then quality vs reference (after wan)
#   bash bench/gpu_verify.sh overhead  # patching overhead vs the same kernel installed by hand
#   bash bench/gpu_verify.sh compile   # Wan 1.3B: eager vs --use_torch_compile per backend, + torchao fp8 GEMMs
#   bash bench/gpu_verify.sh cogvideo  # CogVideoX-2b architecture 720x480x49: step time per backend + PSNR
# Results go to $OUT (or ./gpu_results).
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"   # the environment, OUT, PY, the model arguments, gpu_info
STEPS=${STEPS:-3}
RES=${RES:-/tmp/vdbench_gpu}  # videos and raw frames (~100 MB each) stay here; summaries are copied to $OUT
# (the output directory stays third from the end: the compile runs swap it)
WR=("${WAN13[@]}" --num_inference_steps "$STEPS" --benchmark_output_directory "$RES/wan" --save_frames --time_attention)

info() {
  gpu_info "$OUT/gpu.txt"; cat "$OUT/gpu.txt"
  "$PY" run_wan.py --list_backends --device cuda | tee "$OUT/backends.txt"
}

case "${1:-}" in
  kernels)
    info
    "$PY" bench/bench_attention.py --preset wan2.1-1.3b-480p --preset cogvideox-2b --preset wan2.1-14b-720p \
      --kernel sdpa_flash,sdpa_cudnn,sdpa_efficient,sagev1,fav3,fav3_fp8,sagev1_emu,fp8_emu \
      -o "$OUT/attn_presets.csv" 2>&1 | tee "$OUT/attn_presets.txt"
    ;;
  wan)
    info
    for t in default sdpa_cudnn sagev1 fav3 fav3_fp8; do
      "$PY" run_wan.py "${WR[@]}" --attention_type "$t" 2>&1 | grep -vE 'it/s\]|Warning|warn' | tail -n 4
    done
    ;;
  wanref)
    for t in ${REF_TYPES:-reference sagev1_emu fp8_emu}; do
      "$PY" run_wan.py "${WR[@]}" --attention_type "$t" 2>&1 | grep -vE 'it/s\]|Warning|warn' | tail -n 4
    done
    "$PY" bench/compare_outputs.py "$RES/wan/results" --reference reference --device cuda -o "$OUT/wan_quality.json"
    cp "$RES/wan/results/timing.json" "$OUT/wan_timing.json"
    ;;
  overhead)
    "$PY" bench/patch_overhead.py --backend fav3 -o "$OUT/patch_overhead_fav3.json"
    "$PY" bench/patch_overhead.py --backend sdpa_cudnn -o "$OUT/patch_overhead_cudnn.json"
    ;;
  compile)
    # Eager renders of the same backends come first (same dir layout), then compiled ones (own dir): the PSNR of
    # compiled vs eager says whether compile changed the output; step times say what it bought.
    CT=${COMPILE_TYPES:-default fav3 sagev1}
    E=("${WR[@]}"); E[${#E[@]}-3]="$RES/eager"
    C=("${WR[@]}"); C[${#C[@]}-3]="$RES/compiled"
    for t in $CT; do
      "$PY" run_wan.py "${E[@]}" --attention_type "$t" 2>&1 | grep -vE 'it/s\]|Warning|warn' | tail -n 2
      "$PY" run_wan.py "${C[@]}" --attention_type "$t" --use_torch_compile --warmup_calls 1 2>&1 \
        | grep -vE 'it/s\]|Warning|warn' | tail -n 2
      "$PY" bench/compare_outputs.py "$RES/compiled/results" --device cuda \
        --reference "$(ls "$RES"/eager/results/*attn_${t}_*.npy)" -o "$OUT/compile_vs_eager_$t.json" | grep -E "^$t "
    done
    F=("${WR[@]}"); F[${#F[@]}-3]="$RES/fp8gemm"
    "$PY" run_wan.py "${F[@]}" --attention_type fav3 --use_fp8_gemms --use_torch_compile --warmup_calls 1 2>&1 \
      | grep -vE 'it/s\]|Warning|warn' | tail -n 2
    "$PY" bench/compare_outputs.py "$RES/fp8gemm/results" --device cuda \
      --reference "$(ls "$RES"/eager/results/*attn_fav3_*.npy)" -o "$OUT/fp8gemm_vs_eager_fav3.json" | grep -E "^fav3 "
    for d in eager compiled fp8gemm; do cp "$RES/$d/results/timing.json" "$OUT/${d}_timing.json"; done
    ;;
  cogvideo)
    info
    CG=("${COG2B[@]}" --num_inference_steps "$STEPS" --output_dir "$RES/cog" --save_frames --time_attention)
    for t in ${COG_TYPES:-default sdpa_cudnn sagev1 fav3 fav3_fp8 reference}; do
      "$PY" sageattn_cogvideo.py "${CG[@]}" --attention_type "$t" 2>&1 | grep -vE 'it/s\]|Warning|warn' | tail -n 2
    done
    "$PY" bench/compare_outputs.py "$RES/cog" --reference reference --device cuda -o "$OUT/cog_quality.json"
    cp "$RES/cog/timing.json" "$OUT/cog_timing.json"
    ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
