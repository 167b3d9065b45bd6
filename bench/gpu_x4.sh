#!/usr/bin/env bash
# One call on a 4-GPU machine (nvidia-h200-x4) that does what issues 7, 8, 9 and 10 need from a GPU, packed so
# the GPUs are never idle: independent one-GPU work runs side by side on separate GPUs, then two 2-GPU jobs side
# by side, then the 4-GPU runs. Every piece has its own time limit and writes its results under $OUT as it goes,
# so a piece that fails or is cut costs only itself.
#
#   phase A (4 x 1 GPU):  GPU0 VAE configs (bench/gpu_vae.sh)          GPU1 Triton kernel sweep + 1-GPU Wan 1.3B
#                         GPU2 1-GPU Wan 1.3B (more backends)          GPU3 1-GPU Wan 14B 720p (the 4-GPU baseline)
#   phase B (2 x 2 GPUs): GPU0-1 Ulysses-2 / ring-2, both engines      GPU2-3 2-GPU VAE decode (halo exchange)
#   phase C (4 GPUs):     Wan 14B 720p and Wan 1.3B 480p, Ulysses-4 (diffusers engine); 4-GPU VAE decode
#
# Run from the repo root after the wheel install + PYTHONPATH export. Limits: A_S, B_S, C_S (seconds).
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"   # OUT, the environment, W13 / W14 (STEPS, STEPS14), pack_dir, gpu_info
RES=${RES:-/tmp/vdbench_x4}; mkdir -p "$RES"
A_S=${A_S:-215}; B_S=${B_S:-165}; C_S=${C_S:-150}
# The device tool brings back a limited number of files from $OUT: pack everything (but frames/videos) into one
# archive after every phase, so a cut call still returns what finished.
pack_all() { pack_dir "$OUT" "$OUT/results.tgz"; pack_timings "$RES" "$OUT/timing.tgz"; }
lim() { local l; l=$(left_s "$A_S"); (( l < 10 )) && l=1; echo $l; }  # what is left of phase A
gpu_info "$OUT/gpu.txt"
one13() { CUDA_VISIBLE_DEVICES=$1 "$PY" run_wan.py "${W13[@]}" --benchmark_output_directory "$RES/par/1gpu" \
            --attention_type "$2" 2>&1 | grep -E '^\[|^error' | tail -n 2; }

echo "== phase A ($(el) s)"
( CUDA_VISIBLE_DEVICES=0 OUT="$OUT/vae" timeout -k 5 "$A_S" bash bench/gpu_vae.sh > "$OUT/phaseA_gpu0.log" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  OUT="$OUT/kernels" STAGES=sweep timeout -k 5 110 bash bench/gpu_kernels.sh 2>&1 | tail -n 12
  for b in fav3 sdpa_cudnn; do timeout -k 5 "$(lim)" bash -c "$(declare -f one13); W13=(${W13[*]}); RES=$RES; PY=$PY; one13 1 $b"; done
) > "$OUT/phaseA_gpu1.log" 2>&1 &
( for b in sagev1 fav3_fp8 fav3_sage; do
    timeout -k 5 "$(lim)" bash -c "$(declare -f one13); W13=(${W13[*]}); RES=$RES; PY=$PY; one13 2 $b"
  done ) > "$OUT/phaseA_gpu2.log" 2>&1 &
( CUDA_VISIBLE_DEVICES=3 timeout -k 5 "$A_S" "$PY" run_wan.py "${W14[@]}" --benchmark_output_directory "$RES/w14/1gpu" \
    --attention_type fav3 2>&1 | grep -E '^\[|^error' | tail -n 2 ) > "$OUT/phaseA_gpu3.log" 2>&1 &
wait
tail -n 4 "$OUT"/phaseA_gpu*.log
pack_all

echo "== phase B ($(el) s)"
( CUDA_VISIBLE_DEVICES=0,1 OUT="$OUT/par" RES="$RES/par" KEEP_RES=1 SKIP_1GPU=1 BUDGET_S=$(( B_S - 10 )) \
  PAR_FIRST="fav3" PAR_THEN="sdpa_cudnn sagev1 fav3_fp8" RING_THEN=sdpa_cudnn timeout -k 5 "$B_S" \
  bash bench/gpu_parallel.sh > "$OUT/phaseB_par.log" 2>&1 ) &
( CUDA_VISIBLE_DEVICES=2,3 OUT="$OUT/vae_par" BUDGET_S=$(( B_S - 40 )) timeout -k 5 "$B_S" \
  bash bench/gpu_vae_parallel.sh > "$OUT/phaseB_vae_par.log" 2>&1 ) &
wait
tail -n 30 "$OUT/par/summary.txt" 2>/dev/null; tail -n 12 "$OUT/phaseB_vae_par.log"
pack_all

echo "== phase C ($(el) s)"
TR4=("$PY" -m torch.distributed.run --standalone --nproc_per_node=4)
timeout -k 5 $(( C_S - 40 )) "${TR4[@]}" run_wan.py "${W14[@]}" --benchmark_output_directory "$RES/w14/u4" \
  --attention_type fav3 --parallel_engine diffusers --ulysses_degree 4 2>&1 | grep -E '^\[|^error' | tail -n 3
timeout -k 5 40 "${TR4[@]}" run_wan.py "${W13[@]}" --benchmark_output_directory "$RES/par/diffusers_u4" \
  --attention_type fav3 --parallel_engine diffusers --ulysses_degree 4 2>&1 | grep -E '^\[|^error' | tail -n 3
for d in w14/1gpu w14/u4 par/diffusers_u4; do
  [ -f "$RES/$d/results/timing.json" ] && cp "$RES/$d/results/timing.json" "$OUT/timing_${d//\//_}.json"
done
for pair in "w14/u4 w14/1gpu" "par/diffusers_u4 par/1gpu"; do
  set -- $pair
  ref=$(ls "$RES/$2"/results/*attn_fav3_*.npy 2>/dev/null | head -n 1)
  [ -n "$ref" ] && [ -d "$RES/$1/results" ] && "$PY" bench/compare_outputs.py "$RES/$1/results" --reference "$ref" \
    --device cuda -o "$OUT/quality_${1//\//_}_vs_1gpu.json" 2>&1 | tail -n 2
done
pack_all
echo "== done ($(el) s)"
