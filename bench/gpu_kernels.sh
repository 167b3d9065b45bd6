#!/usr/bin/env bash
# The project's Triton attention kernels (vdbench/kernels) on the GPU machine: correctness, a small tile sweep,
# then the kernel bench at the real shapes next to FA3. Run from the repo root; everything goes under $OUT
# (default outputs/gpu_kernels). Expected ~4 min on an H200 (the stage time limits add up to 8 min at worst).
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site && bash bench/gpu_kernels.sh      (gpu_lib.sh puts the checkout first on it)
#
# Stages (each under its own time limit; check and sweep: bench/gpu_kernels.py, whose docstring says what they do):
#   1 check  kernels vs their torch emulations and fp64 at small odd shapes, poisoned outputs, with the configs
#            the backends use                                                                    -> check.json
#   2 sweep  vdbench.kernels.attention.SWEEP per kernel at Wan 1.3B (D128) and CogVideoX-2b (D64), compiled first by
#            SWEEP_JOBS (default 8) workers within SWEEP_WARM_S (50 s), then timed; the best eligible config per
#            kernel                                                 -> sweep.csv, best_configs.json (~60-90 s on an H200)
#            To make the winners the backends' defaults:
#              cp $OUT/best_configs.json vdbench/kernels/tuned_configs.json   (then STAGES=check to verify)
#   3 bench  bench/bench_attention.py at wan2.1-1.3b-480p, cogvideox-2b, wan2.1-14b-720p with the sweep's
#            winners (VDBENCH_KERNEL_CONFIGS) and FA3 bf16/fp8 measured in the same run   -> attn_kernels_<preset>.csv/json/png
# STAGES="check sweep bench" selects stages.
set -uo pipefail
OUT="${OUT:-outputs/gpu_kernels}"
source "$(dirname "$0")/gpu_lib.sh"   # repo root, the environment, OUT, PY, gpu_info
STAGES="${STAGES:-check sweep bench}"
LOG="$OUT/log.txt"
start=$(date +%s)
echo "== $(date -u +%FT%TZ) gpu_kernels.sh, stages: $STAGES" | tee -a "$LOG"
gpu_info "$OUT/gpu.txt"; tee -a "$LOG" < "$OUT/gpu.txt"

rc=0
if [[ " $STAGES " == *" check "* ]]; then
  echo "== stage check" | tee -a "$LOG"
  timeout 75 "$PY" bench/gpu_kernels.py check --out "$OUT" 2>&1 | tee -a "$LOG"; r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
fi
if [[ " $STAGES " == *" sweep "* ]]; then
  echo "== stage sweep" | tee -a "$LOG"
  timeout 140 "$PY" bench/gpu_kernels.py sweep --out "$OUT" 2>&1 | tee -a "$LOG"; r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
fi
if [[ " $STAGES " == *" bench "* ]]; then
  echo "== stage bench" | tee -a "$LOG"
  [ -s "$OUT/best_configs.json" ] && export VDBENCH_KERNEL_CONFIGS="$OUT/best_configs.json"
  # one invocation per preset, so a timeout at the largest shape loses only that shape's rows
  for preset in wan2.1-1.3b-480p cogvideox-2b wan2.1-14b-720p; do
    timeout 100 "$PY" bench/bench_attention.py --preset "$preset" --kernel fav3_sage,fp8_triton,fav2_triton,fav3,fav3_fp8 \
      -o "$OUT/attn_kernels_$preset.csv" 2>&1 | tee -a "$LOG"
    r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  done
fi
echo "== done in $(( $(date +%s) - start )) s, exit $rc; results in $OUT" | tee -a "$LOG"
exit $rc
