#!/usr/bin/env bash
# Sparse video attention (issue 21) on ONE H200, in one device call of <= 9 min: the figures docs/PERFORMANCE.md
# records for the sparse backends, every run under the budgeted runner (its own limit, skipped when the deadline
# can't fit it), in priority order:
#
#   gpu_tests    the CUDA tests: the compiled FlexAttention kernel (block lists + mask_mod) against
#                exact masked attention, STA padded / unpadded with text, radial (tests/test_sparse.py); the packaged
#                STA kernel against the FlexAttention form of its mask where it imports (else skipped, with the reason)
#   k14, k13     bench_attention.py at Wan 14B 720p (H40, grid 21x45x80) and Wan 1.3B 480p (H12, 21x30x52), B=1 bf16
#                D128, random inputs: FA3 bf16, FlexAttention dense, STA (3,3,3) tiles (6,8,8) padded and unpadded,
#                STA (3,5,5) padded and unpadded, radial, the packaged STA kernel (unavailable: the reason is its row)
#                -- median with p20/p80 and n, x FA3 (speedup_vs_baseline), work, rel L2 vs exact dense attention
#   w14_*        Wan 2.1 14B 720p x 81 (random weights), 3 denoising steps: fav3 (with the first self-attention call
#                captured), sta, sta with cross-attention on FA3 (fav3@kind:cross,sta), and the dense-first schedule
#                fav3@steps:0,sta; PSNR/SSIM of sta and the schedule vs
#                the fav3 render (the exact-attention `reference` render at 14B does not fit this budget: it is
#                left out, and the quality figures are vs FA3 only)
#   w14_*_f8g    fav3 and fav3@kind:cross,sta again with --use_fp8_gemms (torchao float8 GEMMs in the blocks) on
#                both: the same non-attention work on both sides, smaller; PSNR vs the fp8-GEMM fav3 and the bf16 fav3
#   w14_*_c      fav3 and fav3@kind:cross,sta with the blocks compiled on both sides (own folder), PSNR vs the
#                compiled fav3; k14b/w14_sta133/q14b: the sparser window (1,3,3) at the kernel and in the pipeline
#   w14n_*       4 steps (n = 3 warm steps, a speed figure): fav3 (first self-attention call captured),
#                fav3@kind:cross,sta:window=1x3x3, and its dense-first schedule (step 0 on FA3: the whole-run
#                figure); PSNR/SSIM vs fav3; mass14b: the (1,3,3) window's softmax mass on that capture
#   w13_*        Wan 2.1 1.3B 480p x 81, 4 steps: fav3 (4 calls captured), sta, fav3@steps:0,sta, reference (exact,
#                for PSNR vs reference); PSNR/SSIM vs fav3 and vs reference
#   mass13/14    bench/window_mass.py on those captures: each query's softmax mass inside the STA (3,3,3) and
#                (3,5,5) windows and radial's band, per head, beside the key share (random weights: expect mass ~
#                key share -- attention is not local, so the quality figures are a lower bound)
#
# Results: $OUT/results_sparse.tgz (logs, runs.tsv, kernel CSV/JSON/PNG, timing.json per model, quality JSON,
# window-mass JSON, the backend table) and $OUT/summary_sparse.txt (runs, the kernel tables, the render lines, PSNR).
# Videos and raw frames stay in $RES. DRY_RUN=1 lists the runs without a GPU; ONLY='w14_.*|q14' runs those alone
# (session 7 left: ONLY='w14_fav3|w14_fav3_c|w14_stax_c|q14c|k14b|w14_sta133|q14b'; session 6 ran the rest).
set -uo pipefail
CALL=${CALL:-sparse}
OUT=${OUT:-gpu_results}; RES=${RES:-/tmp/vds/res}; W=${W:-/tmp/vds/out}
LIMIT_S=${LIMIT_S:-530}  # this call's deadline: 9 min less the packing
source "$(dirname "$0")/gpu_lib.sh"   # r, the model arguments (WAN13, WAN14), the environment, pack_dir, gpu_info
runs_init; gpu_info "$W/gpu_$CALL.txt"
"$PY" run_wan.py --list_backends --device cuda > "$W/backends.txt" 2>&1

KERNELS="fav3,flex,sta,sta:pad=none,sta:window=3x5x5,sta:window=3x5x5+pad=none,radial,sta_kernel"
KB=("$PY" bench/bench_attention.py --kernel "$KERNELS" --baseline fav3 --metric all)
S14=3; S13=4
R14=("${WAN14[@]}" --num_inference_steps "$S14" --benchmark_output_directory "$RES/w14" --save_frames --time_attention
     --vae_decode fast)
R14F8=("${R14[@]/$RES\/w14/$RES/w14f8}" --use_fp8_gemms)
R14C=("${R14[@]/$RES\/w14/$RES/w14c}" --use_torch_compile)
R14N=("${R14[@]/$RES\/w14/$RES/w14n}" --num_inference_steps 4)  # the last --num_inference_steps wins
R13=("${WAN13[@]}" --num_inference_steps "$S13" --benchmark_output_directory "$RES/w13" --save_frames --time_attention
     --vae_decode fast)
MASS=(--pattern sta --pattern sta:window=3x5x5 --pattern radial --device cuda)

r gpu_tests 30 100 "$PY" -m pytest -q -rs tests/test_sparse.py tests/test_sparse_backends.py -k cuda -p no:cacheprovider
r k14 60 230 "${KB[@]}" --preset wan2.1-14b-720p --grid 21x45x80 --rep_ms 1200 -o "$W/kernels_w14.csv"
r w14_fav3 80 150 "$PY" run_wan.py "${R14[@]}" --attention_type fav3 --save_inputs --max_captures 1 \
  --input_dir "$RES/cap14"
r w14_sta 60 140 "$PY" run_wan.py "${R14[@]}" --attention_type sta
r w14_stax 60 140 "$PY" run_wan.py "${R14[@]}" --attention_schedule "fav3@kind:cross,sta"
r q14 10 60 "$PY" bench/compare_outputs.py "$RES/w14/results" --reference fav3 --device cuda -o "$W/quality_w14_vs_fav3.json"
# the same pair with torchao fp8 GEMMs in the blocks on BOTH sides (the rest of the step shrinks alike; own folder:
# the output names carry the backend, not the speed options), PSNR vs the fp8-GEMM fav3 and vs the bf16 fav3 render
r w14_fav3_f8g 80 150 "$PY" run_wan.py "${R14F8[@]}" --attention_type fav3
r w14_stax_f8g 60 140 "$PY" run_wan.py "${R14F8[@]}" --attention_schedule "fav3@kind:cross,sta"
r q14f8 10 60 "$PY" bench/compare_outputs.py "$RES/w14f8/results" --reference fav3 --device cuda \
  -o "$W/quality_w14f8_vs_fav3f8.json"
r q14f8bf 10 60 bash -c 'ref=$(ls "$2"/*attn_fav3_720x1280.npy | head -n 1); "$1" bench/compare_outputs.py "$3" \
  --reference "$ref" --device cuda -o "$4"' _ "$PY" "$RES/w14/results" "$RES/w14f8/results" \
  "$W/quality_w14f8_vs_fav3bf16.json"
# the 2x question, next: the same pair with the blocks compiled on both sides (--use_torch_compile: the rest of the
# step shrinks, attention is an opaque op), and a sparser window (1,3,3): work 0.044 of dense at 14B against 0.13
r w14_fav3_c 100 200 "$PY" run_wan.py "${R14C[@]}" --attention_type fav3
r w14_stax_c 80 200 "$PY" run_wan.py "${R14C[@]}" --attention_schedule "fav3@kind:cross,sta"
r q14c 10 60 "$PY" bench/compare_outputs.py "$RES/w14c/results" --reference fav3 --device cuda \
  -o "$W/quality_w14c_vs_fav3c.json"
r k14b 40 170 "$PY" bench/bench_attention.py --kernel "fav3,sta,sta:window=1x3x3" --baseline fav3 --metric all \
  --preset wan2.1-14b-720p --grid 21x45x80 --rep_ms 1200 -o "$W/kernels_w14_sparser.csv"
r w14_sta133 60 140 "$PY" run_wan.py "${R14[@]}" --attention_schedule "fav3@kind:cross,sta:window=1x3x3"
r q14b 10 60 "$PY" bench/compare_outputs.py "$RES/w14/results" --reference fav3 --device cuda \
  -o "$W/quality_w14_vs_fav3.json"
S133="fav3@kind:cross,sta:window=1x3x3"
r w14n_fav3 110 200 "$PY" run_wan.py "${R14N[@]}" --attention_type fav3 --save_inputs --max_captures 1 \
  --input_dir "$RES/cap14n"
r w14n_sta133 70 140 "$PY" run_wan.py "${R14N[@]}" --attention_schedule "$S133"
r w14n_sched133 80 150 "$PY" run_wan.py "${R14N[@]}" --attention_schedule "fav3@steps:0,$S133"
r q14n 10 60 "$PY" bench/compare_outputs.py "$RES/w14n/results" --reference fav3 --device cuda \
  -o "$W/quality_w14n_vs_fav3.json"
r mass14b 15 60 "$PY" bench/window_mass.py "$RES/cap14n" --grid 21x45x80 --pattern sta:window=1x3x3 --device cuda \
  --max_queries 1024 -o "$W/window_mass_w14_133.json"
r k13 40 120 "${KB[@]}" --preset wan2.1-1.3b-480p --grid 21x30x52 --rep_ms 300 -o "$W/kernels_w13.csv"
r w13_fav3 25 80 "$PY" run_wan.py "${R13[@]}" --attention_type fav3 --save_inputs --max_captures 4 \
  --input_dir "$RES/cap13"
r w13_sta 25 80 "$PY" run_wan.py "${R13[@]}" --attention_type sta
r w13_sched 25 80 "$PY" run_wan.py "${R13[@]}" --attention_schedule "fav3@steps:0,sta"
r mass13 15 60 "$PY" bench/window_mass.py "$RES/cap13" --grid 21x30x52 "${MASS[@]}" -o "$W/window_mass_w13.json"
r w14_sched 70 130 "$PY" run_wan.py "${R14[@]}" --attention_schedule "fav3@steps:0,sta"
r q14sched 10 60 "$PY" bench/compare_outputs.py "$RES/w14/results" --reference fav3 --device cuda \
  -o "$W/quality_w14_vs_fav3.json"
r mass14 15 60 "$PY" bench/window_mass.py "$RES/cap14" --grid 21x45x80 "${MASS[@]}" --max_queries 1024 \
  -o "$W/window_mass_w14.json"
r w13_reference 40 90 "$PY" run_wan.py "${R13[@]}" --attention_type reference
r q13 10 60 "$PY" bench/compare_outputs.py "$RES/w13/results" --reference fav3 --device cuda -o "$W/quality_w13_vs_fav3.json"
r q13ref 10 60 "$PY" bench/compare_outputs.py "$RES/w13/results" --reference reference --device cuda \
  -o "$W/quality_w13_vs_reference.json"

for m in w13 w14 w14f8 w14c w14n; do [ -f "$RES/$m/results/timing.json" ] && cp "$RES/$m/results/timing.json" "$W/timing_$m.json"; done
{ cat "$W/runs.tsv"; echo
  for f in "$W"/logs/k1[34]*.log; do [ -f "$f" ] && { echo "== $(basename "$f")"; grep -vE 'Warn|warn|^ *$' "$f" | tail -n 14; }; done
  grep -h -E '^\[(fav3|sta|fav3@|reference)' "$W"/logs/w1[34]_*.log
  for f in "$W"/logs/q1[34]*.log "$W"/logs/mass1[34]*.log; do [ -f "$f" ] && { echo "== $(basename "$f")"; tail -n 12 "$f"; }; done
  grep -E '^sta_kernel' "$W/backends.txt"
} > "$OUT/summary_$CALL.txt" 2>&1
pack_dir "$W" "$OUT/results_$CALL.tgz"
cat "$OUT/summary_$CALL.txt"
echo "[$(el)s] call $CALL done"
