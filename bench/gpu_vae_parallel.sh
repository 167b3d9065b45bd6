#!/usr/bin/env bash
# Multi-GPU VAE decode (vdbench.vae_parallel) on 2 GPUs (NPROC): exactness and time vs the single-GPU decode, as
# bench/bench_vae_parallel.py measures them.
# Run from the repo root on a 2-GPU machine (e.g. 2x H200), after the wheels are on PYTHONPATH:
#
#   bash bench/gpu_vae_parallel.sh            # results: $OUT/vae_parallel.json, $OUT/vae_parallel.log
#
# Every rank decodes the whole latent alone (the single-GPU reference and time: wan_decode_chunked, the same loop
# the parallel decode drives) and then its band in the parallel decode; medians of REPEATS timed runs after one
# warm-up, CUDA-synchronized (and barrier-aligned for the parallel one; its time is the slowest rank's).
# Random-weight VAEs of the real widths (vdbench.pipelines' RANDOM_VARIANTS configs), Wan with num_res_blocks=2 as
# in the released Wan 2.1 / 2.2 VAE checkpoints. Cases, in order (a time budget skips the tail, reported as skipped):
#   1. wan2.1 fp32, 17 frames 240x416, TF32 off: exactness over NCCL (K=1 and all latent frames per call)
#   2. wan2.1 bf16, 81 frames 480x832 (latent 21x60x104): K=1 (diffusers' per-frame loop) and K=all (mode fast)
#   3. wan2.2 bf16 (TI2V-5B VAE), 41 frames 704x1280 (latent 11x44x80): K=all
#   4. cogvideox bf16 (2B/5B VAE), 49 frames 480x720 (latent 13x60x90): diffusers' own decode loop
# Summary lines: "[case dtype latent world K] single s  parallel s  ratio  PSNR vs single dB  max|d|".
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"   # the environment, OUT, PY, gpu_info
NPROC=${NPROC:-2}
REPEATS=${REPEATS:-2}
BUDGET_S=${BUDGET_S:-120}   # inside python: remaining cases are skipped (and reported) past this
gpu_info "$OUT/vae_parallel_env.txt"
cat "$OUT/vae_parallel_env.txt"
timeout -k 10 170 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" bench/bench_vae_parallel.py \
  --num_res_blocks 2 --warmup 1 --repeats "$REPEATS" --budget_s "$BUDGET_S" --json "$OUT/vae_parallel.json" \
  --case wan2.1:5x30x52:fp32:1,0 \
  --case wan2.1:21x60x104:bf16:1,0 \
  --case wan2.2:11x44x80:bf16:0 \
  --case cogvideox:13x60x90:bf16 \
  > "$OUT/vae_parallel.log" 2>&1
rc=$?
grep -E '^\[(wan|tiny|cog)|^done|Error|Traceback|out of memory' "$OUT/vae_parallel.log" | grep -v deprecated | head -40
echo "exit code $rc (log: $OUT/vae_parallel.log, json: $OUT/vae_parallel.json)"
exit $rc
