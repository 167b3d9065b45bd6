#!/usr/bin/env bash
# The 8-GPU run (issue 10) on one nvidia-h200-x8 machine, in two calls of <= 10 min each, chained so the machine
# (and /tmp) stays the same; the VAE table (issue 7) rides along on the one GPU the first call leaves free.
#
#   CALL=1 bash bench/gpu_x8.sh   # baselines on the same machine, side by side on separate GPUs:
#       GPU 7      the VAE glue kernel's tests, then the VAE table (bench/gpu_vae.sh all: every config x Wan 2.1 /
#                  2.2 / CogVideoX)
#       GPU 0-4    Wan 14B 720p x81, one GPU each: fav3, sdpa_cudnn, sagev1, fav3_fp8, fav3_sage
#       GPU 5-6    Wan 1.3B 480p x81, one GPU: fav3, fav3_fp8, sdpa_cudnn, sagev1, fav3_sage
#       then       Wan 14B Ulysses-2 (three pairs at a time) and Ulysses-4 for every backend (the 2- and 4-GPU
#                  points of the scaling curve), Wan 1.3B Ulysses-2 / Ulysses-4 while the VAE table finishes
#   CALL=2 bash bench/gpu_x8.sh   # all 8 GPUs: Wan 14B Ulysses-8 x every backend (40 heads split 8 ways; diffusers
#                  engine, fav3 also xfuser), Wan 1.3B ring-8 / Ulysses-4 x ring-2 / Ulysses-2 x ring-4 (12 heads
#                  cannot split 8 ways; ring needs the kernel's LSE, so sagev1 / fav3_sage are refused: recorded),
#                  the 8-GPU VAE decode (bench/gpu_vae_parallel.sh, NPROC=8)
#
# runs.tsv says which ran (rc, wall) and which a deadline skipped; the table (speed-up and efficiency against the
# same backend's 1-GPU run on this machine, PSNR against its frames) is bench/parallel_summary.py's.
# Run from the repo root after the wheel install + PYTHONPATH export. Plumbing: bench/gpu_lib.sh.
set -uo pipefail
CALL=${CALL:-1}
OUT=${OUT:-gpu_results}; RES=${RES:-/tmp/vd8/res}; W=${W:-/tmp/vd8/out}
LIMIT_S=${LIMIT_S:-560}
source "$(dirname "$0")/gpu_lib.sh"   # r / wan / cog / pack, the model arguments, the environment
runs_init; gpu_info "$W/gpu_$CALL.txt"
BK=(fav3 sdpa_cudnn sagev1 fav3_fp8 fav3_sage)
D=(--parallel_engine diffusers)
# u GROUP BACKEND GPUS: a Ulysses run (diffusers engine) over GPUS, degree = their count, named for the table;
# time bounds (need / limit, s) by model size: 14B Ulysses-2 60/120, 14B Ulysses-4 50/110, 1.3B 30/80
u() {
  local g=$1 b=$2 gpus=$3 n need=30 lim=80
  n=$(( $(tr -cd , <<< "$gpus" | wc -c) + 1 ))
  [ "$g" = w14 ] && { need=$(( n == 2 ? 60 : 50 )); lim=$(( n == 2 ? 120 : 110 )); }
  r "${g}_diffusers_u${n}_$b" $need $lim wan $g diffusers_u$n $b $gpus $n "${D[@]}" --ulysses_degree $n
}

if [ "$CALL" = 1 ]; then
  ( # the glue kernel's tests on the GPU first (real Triton): if they fail, the configs that run it (every fast /
    # memory config: the Triton glue is their default) are left out of the table -- a kernel fault would end the run
    CUDA_VISIBLE_DEVICES=7 timeout -k 5 120 "$PY" -m pytest -q tests/test_vae_glue.py -p no:cacheprovider \
      > "$W/logs/vae_glue_tests.log" 2>&1; t=$?
    echo "[$(el)s] vae glue tests rc=$t: $(tail -n 1 "$W/logs/vae_glue_tests.log")"
    skip=; [ $t = 0 ] || skip='^(fast|memory)'
    CUDA_VISIBLE_DEVICES=7 SKIP=$skip OUT="$W/vae" timeout -k 5 $(( LIMIT_S - 15 - $(el) )) bash bench/gpu_vae.sh all \
      > "$W/logs/vae.log" 2>&1
    echo "[$(el)s] vae table rc=$?" ) > "$W/logs/track_vae.log" 2>&1 &
  vae=$!
  (
    for i in 0 1 2 3 4; do r "w14_1gpu_${BK[$i]}" 100 170 wan w14 1gpu "${BK[$i]}" $i 1 & done
    ( for b in fav3 fav3_fp8 fav3_sage; do r "w13_1gpu_$b" 30 80 wan w13 1gpu $b 5 1; done ) &
    ( for b in sdpa_cudnn sagev1; do r "w13_1gpu_$b" 30 80 wan w13 1gpu $b 6 1; done ) &
    wait
    # 14B Ulysses-2: three pairs side by side, then the other two backends beside the first Ulysses-4
    u w14 fav3 0,1 & u w14 sdpa_cudnn 2,3 & u w14 fav3_fp8 4,5 & wait
    u w14 fav3_fp8 0,1,2,3 & u w14 sagev1 4,5 & wait
    u w14 fav3_sage 0,1,2,3 & u w14 fav3_sage 4,5 & wait
    u w14 fav3 0,1,2,3 & u w13 fav3 4,5 & wait
    u w14 sdpa_cudnn 0,1,2,3 & u w13 sdpa_cudnn 4,5 & wait
    u w13 fav3 0,1,2,3 & u w13 fav3_fp8 4,5 & wait
  ) > "$W/logs/track_par.log" 2>&1
  wait $vae
  cat "$W/logs/track_par.log" "$W/logs/track_vae.log" | cut -c1-220
  tail -n 60 "$W/logs/vae.log" 2>/dev/null | grep -vE '^\s*$' | tail -n 60
fi

if [ "$CALL" = 2 ]; then
  G8=0,1,2,3,4,5,6,7
  for b in fav3 sdpa_cudnn sagev1 fav3_fp8 fav3_sage; do
    r "w14_diffusers_u8_$b" 55 110 wan w14 diffusers_u8 $b $G8 8 "${D[@]}" --ulysses_degree 8
  done
  r w13_diffusers_r8_fav3 30 80 wan w13 diffusers_r8 fav3 $G8 8 "${D[@]}" --ring_degree 8
  r w13_diffusers_u4r2_fav3 30 80 wan w13 diffusers_u4r2 fav3 $G8 8 "${D[@]}" --ulysses_degree 4 --ring_degree 2
  r w13_diffusers_u4r2_sdpa_cudnn 30 80 wan w13 diffusers_u4r2 sdpa_cudnn $G8 8 "${D[@]}" --ulysses_degree 4 --ring_degree 2
  r vae_parallel8 70 150 env NPROC=8 BUDGET_S=100 OUT="$W/vae_par8" bash bench/gpu_vae_parallel.sh
  r w13_diffusers_u4r2_sagev1_refused 15 60 wan w13 diffusers_u4r2 sagev1 $G8 8 "${D[@]}" --ulysses_degree 4 --ring_degree 2
  r w13_diffusers_u2r4_fav3 30 80 wan w13 diffusers_u2r4 fav3 $G8 8 "${D[@]}" --ulysses_degree 2 --ring_degree 4
  r w13_diffusers_u4r2_fav3_fp8 30 80 wan w13 diffusers_u4r2 fav3_fp8 $G8 8 "${D[@]}" --ulysses_degree 4 --ring_degree 2
  r w14_xfuser_u8_fav3 55 110 wan w14 xfuser_u8 fav3 $G8 8 --parallel_engine xfuser --ulysses_degree 8
  r w13_xfuser_u4r2_fav3 30 80 wan w13 xfuser_u4r2 fav3 $G8 8 --parallel_engine xfuser --ulysses_degree 4 --ring_degree 2
  r w13_diffusers_r8_sdpa_cudnn 30 80 wan w13 diffusers_r8 sdpa_cudnn $G8 8 "${D[@]}" --ring_degree 8
  tail -n 14 "$W/logs/vae_parallel8.log" 2>/dev/null
fi
pack
cat "$W/summary_parallel.txt"
echo "== call $CALL done ($(el) s)"
