# Shared plumbing of the multi-GPU device scripts (bench/gpu_x4b.sh, bench/gpu_x8.sh); sourced, not run.
# The caller sets CALL, OUT, RES (render outputs), W (logs, runs.tsv, summaries) and LIMIT_S (its deadline, s),
# then uses:
#   r NAME NEED_S LIMIT_S CMD...   run CMD with its own time limit unless fewer than NEED_S seconds are left
#                                  before the deadline; rc and wall go to runs.tsv (skips too, as skip(deadline))
#   wan GROUP CFG BACKEND GPUS NPROC [flags...]   run_wan.py (plain, or torchrun over NPROC ranks) on GPUS
#   cog CFG BACKEND GPUS NPROC [flags...]         sageattn_cogvideo.py likewise
#   pack                           archive everything but frames/latents into $OUT/results_$CALL.tgz, the timings
#                                  into $OUT/timing_$CALL.tgz, the table into $OUT/summary_$CALL.txt
# W13 / W14 / COG are the model arguments (Wan 1.3B 480p, Wan 14B 720p, CogVideoX-2b); for a CPU dry run of the
# plumbing, W13_ARGS / COG_ARGS replace them (e.g. the tiny models).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
mkdir -p "$OUT" "$RES" "$W/logs"
T0=${T0:-$(date +%s)}; el() { echo $(( $(date +%s) - T0 )); }
W13=(--model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81 --num_inference_steps 3
     --save_frames --save_latents --time_attention)
W14=(--model random:wan2.1-t2v-14b --height 720 --width 1280 --num_frames 81 --num_inference_steps 2
     --save_frames --save_latents --time_attention)
COG=(--model_path random:cogvideox-2b --height 480 --width 720 --num_frames 49 --num_inference_steps 3
     --save_frames --save_latents --time_attention)
[ -n "${W13_ARGS:-}" ] && read -r -a W13 <<< "$W13_ARGS" && W14=("${W13[@]}")
[ -n "${COG_ARGS:-}" ] && read -r -a COG <<< "$COG_ARGS"
[ -f "$W/runs.tsv" ] || printf 'call\trun\trc\twall_s\n' > "$W/runs.tsv"

r() {
  local name=$1 need=$2 lim=$3; shift 3
  local left=$(( LIMIT_S - $(el) - 5 ))
  if (( left < need )); then printf '%s\t%s\tskip(deadline)\t0\n' "$CALL" "$name" >> "$W/runs.tsv"; return 0; fi
  (( lim > left )) && lim=$left
  local s=$(date +%s)
  # a child bash gets the arrays and functions (timeout runs programs, not shell functions)
  timeout -k 5 "$lim" bash -c "$(declare -p W13 W14 COG RES); $(declare -f wan cog); \"\$@\"" _ "$@" \
    > "$W/logs/$name.log" 2>&1; local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$CALL" "$name" "$rc" "$(( $(date +%s) - s ))" >> "$W/runs.tsv"
  echo "[$(el)s] $name rc=$rc: $(grep -E '^\[[a-z0-9_]+\] |^error|passed|failed' "$W/logs/$name.log" | tail -n 1 | cut -c1-200)"
  return 0
}
wan() {
  local g=$1 c=$2 b=$3 gpus=$4 n=$5; shift 5
  local args=("${W13[@]}"); [ "$g" = w14 ] && args=("${W14[@]}")
  if [ "$n" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpus python3 run_wan.py "${args[@]}" --benchmark_output_directory "$RES/$g/$c/$b" \
      --attention_type "$b" "$@"
  else
    CUDA_VISIBLE_DEVICES=$gpus python3 -m torch.distributed.run --standalone --nproc_per_node="$n" run_wan.py \
      "${args[@]}" --benchmark_output_directory "$RES/$g/$c/$b" --attention_type "$b" "$@"
  fi
}
cog() {
  local c=$1 b=$2 gpus=$3 n=$4; shift 4
  if [ "$n" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpus python3 sageattn_cogvideo.py "${COG[@]}" --output_dir "$RES/cog/$c/$b" --attention_type "$b" "$@"
  else
    CUDA_VISIBLE_DEVICES=$gpus python3 -m torch.distributed.run --standalone --nproc_per_node="$n" sageattn_cogvideo.py \
      "${COG[@]}" --output_dir "$RES/cog/$c/$b" --attention_type "$b" "$@"
  fi
}
# one profiled step (the third) per run, in runs of their own (group _prof: not in the table), for where the
# parallel overhead goes: GPU time per kernel category (vdbench.timing.kernel_summary)
PROF="--profile_output p --profile_wait 1 --profile_warmup 1 --profile_active 1"
pack() {
  mkdir -p "$W/prof"
  for f in $(find "$RES/_prof" -name 'kernels_*.json' 2>/dev/null); do
    cp "$f" "$W/prof/$(echo "${f#$RES/_prof/}" | tr '/' '_')"
  done
  python3 bench/parallel_summary.py "$RES" -o "$W/parallel_summary.json" > "$W/summary_parallel.txt" 2>&1
  (cd "$W" && tar czf "$OUT/results_$CALL.tgz" --exclude='*.npy' --exclude='*.pt' --exclude='*.mp4' .)
  (cd "$RES" && find . -name timing.json | tar czf "$OUT/timing_$CALL.tgz" -T -) 2>/dev/null
  { cat "$W/runs.tsv"; echo; cat "$W/summary_parallel.txt"; } > "$OUT/summary_$CALL.txt"
}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$W/gpu_$CALL.txt" 2>&1
python3 -c 'import torch, diffusers, xfuser; print("torch", torch.__version__, torch.version.cuda, "diffusers", diffusers.__version__, "xfuser", xfuser.__version__)' >> "$W/gpu_$CALL.txt" 2>&1
