#!/usr/bin/env bash
# Issue 20's kernel table on one GPU, in one device call: SageAttention 2 (sagev2, sagev2_fp8 and sagev2_fp16 at both
# granularities, sagev2_triton), fav3_fp8 (its fused pre-pass; FA3 on pre-quantized inputs and after torch's unfused
# quantization in the same run), fav3_fp8:smooth_k=1, fav3 and sdpa_cudnn -- each through vdbench's registry and as
# the bare kernel call on the same tensors, interleaved -- at Wan 1.3B 480p, Wan 14B 720p and CogVideoX-2b, with rel
# L2 vs fp64, the twin emulation beside each kernel, input purity, the zero-V-channel guard and the fused pre-pass
# checked bit for bit against the eager one; the alpha table (Q x 1, 4, 8, and 8 with a K channel bias) for every fp8
# backend; and the same accuracy figures on a captured Wan 1.3B self-attention input (random weights, block 0).
# Run from the repo root; everything lands in $OUT (default outputs/gpu_fp8):
#   gpu.txt, sageattention.txt, backends.txt   the GPU, which sageattention imports, --list_backends on this GPU
#   fp8_bench.json, fp8_tables.md              bench/bench_fp8.py's rows and the tables docs/PERFORMANCE.md quotes
#   runs.tsv, logs/                            each stage's rc and wall time, its log
# Expected: ~6 min on an H200 (capture ~30 s, the bench ~5 min); LIMIT_S (default 540) is the deadline of the whole
# script: the bench gets what is left and skips (records) the rows it has no time for.
#
# SageAttention 2 is not built here: it must already import. The lead's device call builds it first from a source
# tree kept outside the repository, then runs this script, e.g.
#   bash <source tree>/<its build helper> && PYTHONPATH=/tmp/site bash bench/gpu_fp8.sh
# (with the build in the same call, LIMIT_S=360 keeps the call under 10 min). Without it every sagev2 row says why.
# STAGES (default "capture bench") selects stages; BENCH_ARGS adds bench_fp8.py arguments.
set -uo pipefail
OUT="${OUT:-outputs/gpu_fp8}"
source "$(dirname "$0")/gpu_lib.sh"   # repo root, the environment, OUT, PY, W13, r, gpu_info, sage_info
LIMIT_S=${LIMIT_S:-540}
STAGES="${STAGES:-capture bench}"
W="$OUT"; RES="${RES:-/tmp/vdbench_fp8}"; runs_init
echo "== $(date -u +%FT%TZ) gpu_fp8.sh, stages: $STAGES, deadline ${LIMIT_S}s"
gpu_info "$OUT/gpu.txt"
sage_info "$OUT/sageattention.txt"
"$PY" run_wan.py --list_backends --device cuda > "$OUT/backends.txt" 2>&1

CAPS="$RES/captures"
if [[ " $STAGES " == *" capture "* ]]; then
  # one step of Wan 1.3B 480p, saving the first two attention calls: block 0's self- and cross-attention (their
  # inputs come before any attention ran, so the backend does not matter: torch sdpa, which is always there)
  r capture 60 150 "$PY" run_wan.py "${W13[@]}" --num_inference_steps 1 --attention_type sdpa \
    --benchmark_output_directory "$RES/capture" --save_inputs --max_captures 2 --input_dir "$CAPS"
fi
if [[ " $STAGES " == *" bench "* ]]; then
  left=$(left_s "$LIMIT_S")
  cap_arg=(); ls "$CAPS"/attn_*.pt > /dev/null 2>&1 && cap_arg=(--captures "$CAPS")
  # shellcheck disable=SC2086
  r bench 120 "$left" "$PY" bench/bench_fp8.py --out "$OUT" --deadline_s $(( left - 40 )) "${cap_arg[@]}" \
    ${BENCH_ARGS:-}
  tail -n 40 "$W/logs/bench.log" 2>/dev/null
fi
echo "== done at $(el) s; $(cut -f2-4 "$W/runs.tsv" | tail -n +2 | tr '\n' ';')"
