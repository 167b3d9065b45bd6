#!/usr/bin/env bash
# Issue 20's pipeline table: warm ms/step and PSNR/SSIM against the exact-attention render for SageAttention 2
# (sagev2 = its fp8 sm90 kernel on Hopper, sagev2_fp8:gran=per_warp, sagev2_fp16), fav3_fp8 (fused pre-pass) and
# fav3_fp8:smooth_k=1, fav3 and sdpa_cudnn, one render per backend (random weights, bf16, same seed), then
# bench/compare_outputs.py against the reference render. One device call per PIPELINES setting, each within LIMIT_S
# (default 540 s); the budgeted runner starts a render only if its NEED fits, in the priority order below, and
# records skipped ones in runs.tsv:
#   PIPELINES="w13 cog" (default)  Wan 2.1 1.3B 480p x81, 5 steps (n = 4 warm steps), then CogVideoX-2b 480x720x49,
#                               5 steps; reference renders first (1.3B ~105 s, CogVideoX ~65 s), ~9 min on an H200
#   PIPELINES=w14                  Wan 2.1 14B 720p x81, STEPS14 (default 3: n = 2 warm steps, not a speed figure by
#                               vdbench.timing's rule); exact attention would take ~390 s per step at 14B (17.8x the
#                               1.3B call's FLOPs, 80 calls a step), so the quality reference is the fav3 (bf16 FA3)
#                               render, and the table says so; ~8 min
#                               B13 / BCOG / B14 replace a group's backend list; REF13 / REFCOG=fav3 compare w13 /
#                               cog against the fav3 render and skip the exact reference render (a re-measure of
#                               speed whose numerics are unchanged); SCHED14 adds renders with --attention_schedule
#                               (space-separated schedules, e.g. "fav3@steps:0,sta"), compared the same way
#   PIPELINES=w13u2 (needs nvidia-h200-x2; not lent when this was written: not run)  Wan 1.3B Ulysses-2 (diffusers)
#                               for sagev2, fav3_fp8:smooth_k=1, fav3_fp8 and fav3, compared with the one-GPU
#                               reference render of a w13 run in the same RES (run PIPELINES="w13 w13u2" there)
# Results in $OUT: quality_<group>.json (compare_outputs.py: PSNR, SSIM, warm step with n), timing_<group>.json,
# runs.tsv, logs/ (run names spell the option characters : = + as _), gpu.txt, sageattention.txt. Frames and
# videos stay in RES (default /tmp/vdbench_fp8p).
#
# SageAttention 2 must already import (see bench/gpu_fp8.sh); without it the sagev2 renders stop, saying why
# (exit 2), and the table has the others.
set -uo pipefail
OUT="${OUT:-outputs/gpu_fp8_pipelines}"
STEPS=${STEPS:-5}; STEPS14=${STEPS14:-3}
source "$(dirname "$0")/gpu_lib.sh"   # repo root, the environment, OUT, PY, W13/W14/COG, r, gpu_info, sage_info
LIMIT_S=${LIMIT_S:-540}
PIPELINES=${PIPELINES:-w13 cog}
W="$OUT"; RES="${RES:-/tmp/vdbench_fp8p}"; runs_init
echo "== $(date -u +%FT%TZ) gpu_fp8_pipelines.sh, groups: $PIPELINES, deadline ${LIMIT_S}s"
gpu_info "$OUT/gpu.txt"
sage_info "$OUT/sageattention.txt"

# priority order: what the table cannot do without first
BACKENDS=(sagev2 fav3_fp8 fav3 sdpa_cudnn fav3_fp8:smooth_k=1 sagev2_fp16 sagev2_fp8:gran=per_warp)
NEED13=40; NEED14=120; NEEDCOG=35   # seconds a render needs to be started (load + steps + decode, H200)

compare() {  # compare GROUP RESULTS_DIR REFERENCE
  r "compare_$1" 20 90 "$PY" bench/compare_outputs.py "$2" --reference "$3" --device cuda -o "$OUT/quality_$1.json"
  cp "$2/timing.json" "$OUT/timing_$1.json" 2>/dev/null
  grep -vE '^\[' "$W/logs/compare_$1.log" 2>/dev/null | tail -n 14
}

renders() {  # renders GROUP NEED LIMIT "B1 B2 ..." CMD...: one budgeted run of CMD --attention_type B per backend
  local g=$1 need=$2 lim=$3 list=$4 b; shift 4
  for b in $list; do r "${g}_${b//[:=+]/_}" "$need" "$lim" "$@" --attention_type "$b"; done
}

for g in $PIPELINES; do
  case "$g" in
    w13)
      cmd=("$PY" run_wan.py "${W13[@]}" --benchmark_output_directory "$RES/w13")
      [ "${REF13:-reference}" = reference ] && renders w13 130 240 reference "${cmd[@]}"
      renders w13 "$NEED13" 150 "${B13:-${BACKENDS[*]}}" "${cmd[@]}"
      compare w13 "$RES/w13/results" "${REF13:-reference}"
      ;;
    cog)
      cmd=("$PY" sageattn_cogvideo.py "${COG[@]}" --output_dir "$RES/cog")
      [ "${REFCOG:-reference}" = reference ] && renders cog 90 200 reference "${cmd[@]}"
      renders cog "$NEEDCOG" 120 "${BCOG:-${BACKENDS[*]}}" "${cmd[@]}"
      compare cog "$RES/cog" "${REFCOG:-reference}"
      ;;
    w14)
      cmd=("$PY" run_wan.py "${W14[@]}" --benchmark_output_directory "$RES/w14")
      renders w14 "$NEED14" 200 "${B14:-fav3 sagev2 fav3_fp8 sdpa_cudnn fav3_fp8:smooth_k=1 sagev2_fp16}" "${cmd[@]}"
      for s in ${SCHED14:-}; do r "w14_sched_${s//[:=+@,]/_}" "$NEED14" 200 "${cmd[@]}" --attention_schedule "$s"; done
      compare w14 "$RES/w14/results" fav3   # the proxy reference (exact attention: ~390 s a step at 14B)
      ;;
    w13u2)
      renders w13u2 50 150 "sagev2 fav3_fp8:smooth_k=1 fav3_fp8 fav3" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node=2 run_wan.py "${W13[@]}" --benchmark_output_directory "$RES/w13u2" \
        --parallel_engine diffusers --ulysses_degree 2
      ref=$(ls "$RES"/w13/results/*attn_reference_*.npy 2>/dev/null | head -n 1)
      compare w13u2 "$RES/w13u2/results" "${ref:-reference}"
      ;;
    *) echo "unknown group $g (w13, cog, w14, w13u2)"; exit 2 ;;
  esac
done
echo "== done at $(el) s"
cut -f2-4 "$W/runs.tsv"
