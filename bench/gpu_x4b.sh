#!/usr/bin/env bash
# The multi-GPU table for every backend (issues 8 and 10) and the VAE table (issue 7), on one 4-GPU machine
# (nvidia-h200-x4) in two calls of <= 10 min each, chained so the machine (and /tmp) stays the same:
#
#   CALL=1 bash bench/gpu_x4b.sh   # three tracks side by side on separate GPUs:
#       GPU 3     the VAE table (bench/gpu_vae.sh: every config x Wan 2.1 / 2.2 / CogVideoX)
#       GPU 2     one-GPU baselines: Wan 1.3B 480p x 5 backends, CogVideoX-2b, Wan 14B 720p
#       GPU 0-1   GPU-only tests (xfuser CogVideoX / CFG pipelines vs one GPU), then Wan 1.3B Ulysses-2 and
#                 ring-2 with both engines for sdpa_cudnn, sagev1, fav3_fp8, fav3_sage
#   CALL=2 bash bench/gpu_x4b.sh   # 4 GPUs: Wan 1.3B Ulysses-4 / ring-4 / Ulysses-2 x ring-2 per backend,
#                 Wan 14B Ulysses-4, CogVideoX-2b Ulysses-2 / CFG-2 / both (xfuser), the 4-GPU VAE decode
#   CALL=3, 4: re-runs after fixes (session 3); CALL=5 (session 4): Wan 14B 720p one GPU and Ulysses-4 for
#                 fav3_fp8 and fav3_sage
#
# Every run has its own time limit and each track a deadline, so a failing or slow piece costs only itself;
# runs.tsv says which ran (rc, wall) and which were skipped. Everything but frames/latents is packed into
# $OUT/results_<call>.tgz (the device tool returns few files) with summary_<call>.txt beside it.
# Run from the repo root after the wheel install + PYTHONPATH export.
set -uo pipefail
CALL=${CALL:-1}
OUT=${OUT:-gpu_results}; RES=${RES:-/tmp/vd3/res}; W=${W:-/tmp/vd3/out}
LIMIT_S=${LIMIT_S:-560}  # this call's deadline (the device tool stops a command at 600 s)
source "$(dirname "$0")/gpu_lib.sh"   # r / wan / cog / pack, the model arguments, the environment
runs_init; gpu_info "$W/gpu_$CALL.txt"

if [ "$CALL" = 1 ]; then
  ( CUDA_VISIBLE_DEVICES=3 OUT="$W/vae" timeout -k 5 $(( LIMIT_S - 20 )) bash bench/gpu_vae.sh all > "$W/logs/vae.log" 2>&1
    echo "[$(el)s] vae table rc=$?" ) &
  ( for b in fav3 sdpa_cudnn sagev1 fav3_fp8 fav3_sage; do r "w13_1gpu_$b" 40 90 wan w13 1gpu $b 2 1; done
    r w13_prof_1gpu_fav3 40 90 wan _prof 1gpu fav3 2 1 $PROF
    for b in fav3 sdpa_cudnn; do r "cog_1gpu_$b" 40 80 cog 1gpu $b 2 1; done
    for b in sdpa_cudnn sagev1; do r "w14_1gpu_$b" 110 150 wan w14 1gpu $b 2 1; done
  ) > "$W/logs/track_gpu2.log" 2>&1 &
  ( r gpu_tests 60 170 env CUDA_VISIBLE_DEVICES=0,1 "$PY" -m pytest -q -rs tests/test_parallel.py \
        -k "gpus or match_one_gpu" -p no:cacheprovider -s
    for b in sdpa_cudnn sagev1 fav3_fp8 fav3_sage; do
      for e in diffusers xfuser; do r "w13_${e}_u2_$b" 35 90 wan w13 ${e}_u2 $b 0,1 2 --parallel_engine $e --ulysses_degree 2; done
    done
    r w13_prof_diffusers_u2_fav3 40 90 wan _prof diffusers_u2 fav3 0,1 2 --parallel_engine diffusers --ulysses_degree 2 $PROF
    for b in sdpa_cudnn fav3_fp8 fav3_sage; do r "w13_diffusers_r2_$b" 35 90 wan w13 diffusers_r2 $b 0,1 2 --parallel_engine diffusers --ring_degree 2; done
    r w13_diffusers_r2_sagev1_refused 15 60 wan w13 diffusers_r2 sagev1 0,1 2 --parallel_engine diffusers --ring_degree 2
    for b in sdpa_cudnn fav3_fp8; do r "w13_xfuser_r2_$b" 35 90 wan w13 xfuser_r2 $b 0,1 2 --parallel_engine xfuser --ring_degree 2; done
  ) > "$W/logs/track_gpu01.log" 2>&1 &
  wait
  cat "$W/logs/track_gpu2.log" "$W/logs/track_gpu01.log" "$W/logs/vae.log" | grep -E '^\[' | cut -c1-220
  tail -n 40 "$W/vae/"*.log 2>/dev/null | grep -vE '^\s*$' | tail -n 45
fi

if [ "$CALL" = 2 ]; then
  ( r cog_xfuser_u2_fav3 40 90 cog xfuser_u2 fav3 0,1 2 --parallel_engine xfuser --ulysses_degree 2 ) > "$W/logs/c2_a.log" 2>&1 &
  ( r cog_xfuser_cfg2_fav3 40 90 cog xfuser_cfg2 fav3 2,3 2 --parallel_engine xfuser --use_cfg_parallel ) > "$W/logs/c2_b.log" 2>&1 &
  wait; cat "$W"/logs/c2_[ab].log
  r cog_xfuser_u2cfg2_fav3 40 90 cog xfuser_u2cfg2 fav3 0,1,2,3 4 --parallel_engine xfuser --ulysses_degree 2 --use_cfg_parallel
  for b in sdpa_cudnn sagev1 fav3_fp8 fav3_sage; do r "w13_diffusers_u4_$b" 30 80 wan w13 diffusers_u4 $b 0,1,2,3 4 --parallel_engine diffusers --ulysses_degree 4; done
  r w13_xfuser_u4_fav3 30 80 wan w13 xfuser_u4 fav3 0,1,2,3 4 --parallel_engine xfuser --ulysses_degree 4
  r w13_diffusers_r4_fav3 30 80 wan w13 diffusers_r4 fav3 0,1,2,3 4 --parallel_engine diffusers --ring_degree 4
  r w13_diffusers_u2r2_fav3 30 80 wan w13 diffusers_u2r2 fav3 0,1,2,3 4 --parallel_engine diffusers --ulysses_degree 2 --ring_degree 2
  r w13_xfuser_u2r2_fav3 30 80 wan w13 xfuser_u2r2 fav3 0,1,2,3 4 --parallel_engine xfuser --ulysses_degree 2 --ring_degree 2
  for b in sdpa_cudnn sagev1; do r "w14_diffusers_u4_$b" 75 120 wan w14 diffusers_u4 $b 0,1,2,3 4 --parallel_engine diffusers --ulysses_degree 4; done
  r w13_diffusers_u2r2_sdpa_cudnn 30 80 wan w13 diffusers_u2r2 sdpa_cudnn 0,1,2,3 4 --parallel_engine diffusers --ulysses_degree 2 --ring_degree 2
  r vae_parallel4 60 150 env NPROC=4 BUDGET_S=100 OUT="$W/vae_par4" bash bench/gpu_vae_parallel.sh
  tail -n 12 "$W/logs/vae_parallel4.log" 2>/dev/null
fi
if [ "$CALL" = 3 ]; then  # after fixes: xfuser CogVideoX / CFG tests and the CogVideoX-2b rows; whole-decoder VAE compile
  ( CUDA_VISIBLE_DEVICES=3 OUT="$W/vae_compile" timeout -k 5 300 bash bench/gpu_vae.sh compile > "$W/logs/vae_compile.log" 2>&1 ) &
  vae=$!
  ( r cog_1gpu_fav3 40 80 cog 1gpu fav3 2 1 ) > "$W/logs/c3_gpu2.log" 2>&1 &
  r gpu_tests 60 200 env CUDA_VISIBLE_DEVICES=0,1 "$PY" -m pytest -q -rs tests/test_parallel.py \
        -k "gpus or match_one_gpu" -p no:cacheprovider -s
  r cog_xfuser_u2_fav3 40 90 cog xfuser_u2 fav3 0,1 2 --parallel_engine xfuser --ulysses_degree 2
  r cog_xfuser_cfg2_fav3 40 90 cog xfuser_cfg2 fav3 0,1 2 --parallel_engine xfuser --use_cfg_parallel
  wait; cat "$W/logs/c3_gpu2.log"; grep -E 'passed|failed|relative L2' "$W/logs/gpu_tests.log" | tail -n 5
  r cog_xfuser_u2cfg2_fav3 40 90 cog xfuser_u2cfg2 fav3 0,1,2,3 4 --parallel_engine xfuser --ulysses_degree 2 --use_cfg_parallel
  tail -n 30 "$W/vae_compile/"*.log 2>/dev/null
fi
if [ "$CALL" = 4 ]; then  # CogVideoX under xfuser: joint attention through USP (path-tagged counts), ring with LSE
  ( r cog_1gpu_fav3 40 80 cog 1gpu fav3 2 1 ) > "$W/logs/c4_gpu2.log" 2>&1 &
  r cog_xfuser_u2_fav3 40 90 cog xfuser_u2 fav3 0,1 2 --parallel_engine xfuser --ulysses_degree 2
  r cog_xfuser_r2_fav3 40 90 cog xfuser_r2 fav3 0,1 2 --parallel_engine xfuser --ring_degree 2
  wait; cat "$W/logs/c4_gpu2.log"
fi
if [ "$CALL" = 5 ]; then  # session 4: Wan 14B 720p at 4 GPUs for the quantized backends (fav3_fp8, fav3_sage)
  ( r w14_1gpu_fav3_fp8 100 170 wan w14 1gpu fav3_fp8 0 1 ) > "$W/logs/c5_gpu0.log" 2>&1 &
  ( r w14_1gpu_fav3_sage 100 170 wan w14 1gpu fav3_sage 1 1 ) > "$W/logs/c5_gpu1.log" 2>&1 &
  wait; cat "$W"/logs/c5_gpu[01].log
  for b in fav3_fp8 fav3_sage; do
    r "w14_diffusers_u4_$b" 50 110 wan w14 diffusers_u4 $b 0,1,2,3 4 --parallel_engine diffusers --ulysses_degree 4
  done
fi
pack
cat "$W/summary_parallel.txt"
echo "== call $CALL done ($(el) s)"
