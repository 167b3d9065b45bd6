#!/usr/bin/env bash
# SageAttention 2 on the GPU machine: bench/bench_sage2.py at Wan 1.3B 480p, Wan 14B 720p and CogVideoX-2b (speed,
# rel L2 vs fp64, the emulation's rel L2 on the same rows, LSE, input purity, the dispatch of sageattn) for every
# upstream function and option, after saying which sageattention imports. Run from the repo root; everything goes
# under $OUT (default outputs/gpu_sage2). About 75 s on an H200 once sageattention is installed (results of
# 2026-11-23: docs/gpu_results/sage2/, summarized in docs/notes/sageattention2.md). The registry's sagev2 entries
# beside their bare calls, fav3_fp8 and the alpha table: bench/gpu_fp8.sh.
#
# This script does not build SageAttention: the package must already import (e.g. installed into /tmp/site and
# PYTHONPATH=/tmp/site). The repository never carries SageAttention's source, a build of it, or a recipe for
# building it; README.md says where the package comes from.
#
# Environment: OUT, BENCH_LIMIT_S (wall limit of the bench, default 420 s), BENCH_ARGS (extra bench_sage2.py
# arguments, e.g. "--shapes cogvideox-2b --reps 20").
set -uo pipefail
OUT="${OUT:-outputs/gpu_sage2}"
source "$(dirname "$0")/gpu_lib.sh"   # repo root, the environment, OUT, PY, gpu_info, sage_info
LOG="$OUT/log.txt"
echo "== $(date -u +%FT%TZ) gpu_sage2.sh" | tee -a "$LOG"
gpu_info "$OUT/gpu.txt"; tee -a "$LOG" < "$OUT/gpu.txt"
sage_info "$OUT/sageattention.txt" | tee -a "$LOG"

start=$(date +%s)
# shellcheck disable=SC2086
timeout -k 10 "${BENCH_LIMIT_S:-420}" "$PY" bench/bench_sage2.py --out "$OUT" \
  --deadline_s $(( ${BENCH_LIMIT_S:-420} - 60 )) ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "bench_sage2.py rc=$rc wall=$(( $(date +%s) - start )) s; results: $OUT/sage2_bench.json" | tee -a "$LOG"
exit "$rc"
