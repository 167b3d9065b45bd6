#!/usr/bin/env bash
# Batch rendering on 2 GPUs (issue 19), one device call on nvidia-h200-x2, <= 9 min wall (LIMIT_S=540):
#   batch_u2     render_all_WAN.sh --nproc 2 (Ulysses over both GPUs, the default engine auto: xfuser where it runs)
#                over sdpa_cudnn, fav3, sagev1, reference on Wan 2.1 1.3B's shape (random weights, 480x832, 33
#                frames, 6 steps): step lines, the comparison table, the grid and report.html
#   refuse_ring  torchrun ring-2 with sagev1 (no log-sum-exp): refused before the load, every rank exit 2
#   fail_rank1   torchrun Ulysses-2 with rank 1 failing at a step (VDBENCH_TEST_FAIL): rank 1 exits 1, rank 0 exits 4
#   ti2v_image   one GPU: --task ti2v with an image on Wan 2.2 TI2V-5B's shape (WanImageToVideoPipeline), fav3
# Everything lands in $OUT: batch_summary.txt (the runs, the table, the ranks' exit codes, the TI2V entry),
# batch_logs.tgz (logs, runs.tsv), batch_timing.tgz (every timing.json), the grid and report of batch_u2.
#
#   OUT=/path bash bench/gpu_batch.sh        # DRY_RUN=1 lists the runs on a CPU
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"   # the environment, OUT, PY, WAN13, the runner r, packing
LIMIT_S=${LIMIT_S:-540}
RES=$OUT/batch; W=$OUT/batch_work
runs_init
[ -n "${DRY_RUN:-}" ] || gpu_info "$W/gpu_info.txt"
SHORT=(--num_frames 33 --num_inference_steps 6)

r batch_u2 120 330 env PYTHON="$PY" bash render_all_WAN.sh --nproc 2 --types sdpa_cudnn,fav3,sagev1,reference \
  --output-dir "$RES/u2" --stitch --report -- "${WAN13[@]}" "${SHORT[@]}"
r refuse_ring 20 90 wan w13 refuse sagev1 0,1 2 --ring_degree 2 "${SHORT[@]}"
export VDBENCH_TEST_FAIL=1:step
r fail_rank1 40 150 wan w13 fail fav3 0,1 2 --ulysses_degree 2 "${SHORT[@]}"
unset VDBENCH_TEST_FAIL
"$PY" -c 'import sys; from PIL import Image; Image.new("RGB", (1280, 704), (90, 140, 200)).save(sys.argv[1])' \
  "$W/first_frame.png"
r ti2v_image 60 150 "$PY" run_wan.py --model random:wan2.2-ti2v-5b --task ti2v --img_file_path "$W/first_frame.png" \
  --height 704 --width 1280 "${SHORT[@]}" --attention_type fav3 --benchmark_output_directory "$RES/ti2v"

{
  cat "$W/runs.tsv"
  echo; echo "== batch_u2: the screen"; cat "$W/logs/batch_u2.log" 2>/dev/null
  for run in refuse_ring fail_rank1; do
    echo; echo "== $run: error lines and each rank's exit code (torchrun's summary)"
    grep -E '^(error|hint):|rank +:|exitcode +:' "$W/logs/$run.log" 2>/dev/null
  done
  echo; echo "== ti2v_image: pipeline, size and kernels of its timing entry"
  "$PY" -c 'import json, sys
e = json.load(open(sys.argv[1]))[-1]
print(e["run"]["model"]["pipeline"], e["run"]["model"].get("expand_timesteps"), e["output"],
      e["attention"]["calls_by_kernel"], e.get("warm_step_median"))' "$RES/ti2v/results/timing.json" 2>&1
} > "$OUT/batch_summary.txt"
cp "$RES/u2/comparison_grid.mp4" "$RES/u2/report.html" "$OUT/" 2>/dev/null
pack_dir "$W" "$OUT/batch_logs.tgz"
pack_timings "$RES" "$OUT/batch_timing.tgz"
cat "$OUT/batch_summary.txt"
