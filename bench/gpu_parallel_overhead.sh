#!/usr/bin/env bash
# Issue 18, item 5: does vdbench's parallel render cost anything over the engine called bare, under torchrun?
# One device call on nvidia-h200-x2 (2 GPUs), from the repo root, after the wheels are on PYTHONPATH (xfuser and its
# dependencies for the xfuser rows: pip install '.[dist]'; without them those rows say "skipped" with the reason):
#
#   bash bench/gpu_parallel_overhead.sh          # CALL=1 (default); CALL=2 is the optional second call below
#
# Model: Wan 2.1 1.3B architecture, random weights, 480x832, 81 frames (gpu_lib.sh's WAN13), Ulysses-2, bf16.
# bench/parallel_overhead.py times, in one process group, each engine bare and through vdbench.render (warm step =
# median of the steps after the first, pooled over rounds, with n and spread; rounds alternate the order):
#   CALL=1  a. timing   sdpa_cudnn (diffusers '_native_cudnn', xfuser CUDNN), diffusers + xfuser, bare vs vdbench,
#                       8 steps x 2 rounds (n = 14 warm steps per side)
#           b. profile  diffusers only: bare, vdbench, vdbench --time_attention (what the multi-GPU table's runs
#                       pass), 6 steps x 1 round, then one profiled step per side (GPU time by kernel category, rank 0
#                       and 1): tells kernel-level differences (the engine's) from host time between kernels
#   CALL=2  c. profile  xfuser: bare vs vdbench, 6 steps x 1 round, then one profiled step per side
#           d. timing   sdpa_flash (diffusers '_native_flash', xfuser SDPA_FLASH), both engines, as a. (fav3 can't be
#                       compared bare under diffusers offline: of its FA3 backends only '_flash_3_hub', a kernel
#                       fetched from the Hub, has context parallelism in diffusers 0.42.1)
# Budget: LIMIT_S (default 560 s) for the whole call; gpu_lib.sh's runner r starts a run only with its NEED seconds
# left and cuts its limit to the deadline, so the call ends before the 600 s device limit; runs.tsv says what ran,
# failed (rc) or was skipped. Expected: a ~300 s, b ~230 s (measured nowhere yet: the x2 machine was not lent when
# this was written).
# Results under $OUT: overhead_<run>.json (the table's data), overhead_<run>.txt (the printed table, profile table
# included), kernels_<run>.tgz (the profiled steps' kernel summaries), runs.tsv, logs/<run>.log, gpu.txt.
set -uo pipefail
LIMIT_S=${LIMIT_S:-560}
source "$(dirname "$0")/gpu_lib.sh"   # OUT, the environment, PY, WAN13, r (the budgeted runner), gpu_info
RES=${RES:-/tmp/vdbench_overhead}; W=$OUT; runs_init; gpu_info "$OUT/gpu.txt"
PORT=29710

ov() {  # ov NAME NEED_S LIMIT_S [bench flags...]: one torchrun of the bench, its table and data copied to $OUT
  local name=$1 need=$2 lim=$3; shift 3
  r "$name" "$need" "$lim" "$PY" -m torch.distributed.run --nproc_per_node=2 --master_port=$((PORT++)) \
    bench/parallel_overhead.py "${WAN13[@]}" -o "$RES/$name" "$@"
  [ -f "$RES/$name/parallel_overhead.json" ] && cp "$RES/$name/parallel_overhead.json" "$OUT/overhead_$name.json"
  [ -f "$W/logs/$name.log" ] && sed -n '/^engine /,$p' "$W/logs/$name.log" > "$OUT/overhead_$name.txt"
  [ -d "$RES/$name" ] && (cd "$RES/$name" && find . -name 'kernels_rank*.json' | tar czf "$OUT/kernels_$name.tgz" -T -)
  return 0
}

if [ "$CALL" = 2 ]; then
  ov xfuser_profile 150 280 --backend sdpa_cudnn --engines xfuser --steps 6 --rounds 1 --profile
  ov flash_timing 240 330 --backend sdpa_flash --engines diffusers,xfuser --steps 8 --rounds 2
else
  ov cudnn_timing 240 330 --backend sdpa_cudnn --engines diffusers,xfuser --steps 8 --rounds 2
  ov diffusers_profile 150 280 --backend sdpa_cudnn --engines diffusers --sides bare,vdbench,vdbench_timed \
    --steps 6 --rounds 1 --profile
fi
cat "$OUT"/overhead_*.txt 2>/dev/null
echo "call $CALL done at $(el) s (runs: $OUT/runs.tsv)"
