# The device scripts' shared plumbing: every bench/gpu_*.sh sources this file (never run on its own).
#
# On source, for every script (one GPU or many): OUT (default gpu_results) is created and made absolute; the working
# directory becomes the repo root; the environment line (unbuffered Python; NVLink multicast off for NCCL
# and for torch's symmetric memory, as the lent multi-GPU machines need; 8 OpenMP threads unless set); this checkout's vdbench first on PYTHONPATH (bench/*.py import it, nothing edits sys.path); PY (python3
# unless set); the clock (T0, `el` = seconds since); the model arguments:
#   WAN13 / WAN14 / COG2B   the architecture and size only: Wan 2.1 1.3B 480p x81, Wan 2.1 14B 720p x81, CogVideoX-2b
#                           480x720 x49 (random weights); WAN14I2V: Wan 2.1 I2V 14B 480p x81 (add --img_file_path)
#   W13 / W14 / COG         the multi-GPU table's renders: + steps (STEPS, default 3; STEPS14, default 2 for 14B),
#                           frames, latents and attention timing saved. For a CPU dry run of the plumbing, W13_ARGS /
#                           COG_ARGS replace W13 (and W14) / COG (e.g. the tiny models).
# Functions (nothing else runs on source; the multi-GPU-only steps are functions the multi-GPU scripts call):
#   gpu_info FILE                 the GPUs (nvidia-smi, topology) and vdbench.timing.system_info's versions -> FILE
#   sage_info FILE                which sageattention imports here -- version, 1.x or 2.x, where from, its kernels --
#                                 or why none does (vdbench.backends.sage.describe_install) -> stdout and FILE; never
#                                 fatal: the sagev2 rows then say they are unavailable, and why
#   runs_init                     RES, W/logs and W/runs.tsv (the record of the budgeted runner) for a script using r
#   r NAME NEED_S LIMIT_S CMD...  the budgeted runner: CMD under its own time limit (LIMIT_S, cut to what is left
#                                 before the deadline), skipped if fewer than NEED_S seconds are left before the
#                                 deadline minus GRACE_S (default 0: runs may use the grace, never start in it);
#                                 log in W/logs/NAME.log, call / name / rc / wall appended to W/runs.tsv. The deadline
#                                 is the script's LIMIT_S (seconds after T0). DRY_RUN=1: the command is printed and
#                                 recorded as "dry", not run (what a script would run, on a CPU). ONLY=REGEX: only
#                                 the runs whose NAME matches it in full (e.g. 'w14_.*|q14'), the others recorded as
#                                 "skip(only)" -- a later call running what an earlier one's deadline skipped.
#   left_s DEADLINE               seconds left before DEADLINE (s after T0), 5 s kept for the bookkeeping
#   wan GROUP CFG BACKEND GPUS NPROC [flags...]   run_wan.py (plain, or torchrun over NPROC ranks) on GPUS
#   cog CFG BACKEND GPUS NPROC [flags...]         sageattn_cogvideo.py likewise
#   pack_dir DIR ARCHIVE          DIR but frames, videos, latents and archives -> ARCHIVE (.tgz): the device tool
#                                 returns few files, so results travel as one archive per call
#   pack_timings DIR ARCHIVE      every timing.json under DIR -> ARCHIVE
#   pack                          the multi-GPU table: profiles' kernel summaries, bench/parallel_summary.py over RES,
#                                 W -> OUT/results_CALL.tgz, RES's timings -> OUT/timing_CALL.tgz, runs + table ->
#                                 OUT/summary_CALL.txt
# Variables the functions read: OUT, RES (render outputs), W (logs, runs.tsv, summaries), CALL (default -), LIMIT_S.

OUT=${OUT:-gpu_results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # (relative: to where the script was started)
VDB_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$VDB_ROOT" || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
case ":${PYTHONPATH:-}:" in *":$VDB_ROOT:"*) ;; *) export PYTHONPATH="$VDB_ROOT${PYTHONPATH:+:$PYTHONPATH}" ;; esac
# EXTRA_SITE: a folder of packages installed with pip --target (a kernel package built on the device), after vdbench
[ -n "${EXTRA_SITE:-}" ] && export PYTHONPATH="$PYTHONPATH:$EXTRA_SITE"
PY=${PY:-python3}
CALL=${CALL:--}
T0=${T0:-$(date +%s)}; el() { echo $(( $(date +%s) - T0 )); }

WAN13=(--model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81)
WAN14=(--model random:wan2.1-t2v-14b --height 720 --width 1280 --num_frames 81)
COG2B=(--model_path random:cogvideox-2b --height 480 --width 720 --num_frames 49)
WAN14I2V=(--model random:wan2.1-i2v-14b --task i2v --height 480 --width 832 --num_frames 81 --force_output_size)
SAVE=(--save_frames --save_latents --time_attention)
W13=("${WAN13[@]}" --num_inference_steps "${STEPS:-3}" "${SAVE[@]}")
W14=("${WAN14[@]}" --num_inference_steps "${STEPS14:-2}" "${SAVE[@]}")
COG=("${COG2B[@]}" --num_inference_steps "${STEPS:-3}" "${SAVE[@]}")
[ -n "${W13_ARGS:-}" ] && read -r -a W13 <<< "$W13_ARGS" && W14=("${W13[@]}")
[ -n "${COG_ARGS:-}" ] && read -r -a COG <<< "$COG_ARGS"

gpu_info() {
  { nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    nvidia-smi topo -m
    "$PY" -c 'import json, torch; from vdbench.timing import system_info
print(json.dumps(system_info("cuda" if torch.cuda.is_available() else "cpu")))'
  } > "$1" 2>&1
}

sage_info() {
  "$PY" -c 'from vdbench.backends.sage import describe_install; print(describe_install())' 2>&1 | tee "$1"
}

runs_init() {
  mkdir -p "$RES" "$W/logs"
  [ -f "$W/runs.tsv" ] || printf 'call\trun\trc\twall_s\n' > "$W/runs.tsv"
}

left_s() { echo $(( $1 - $(el) - 5 )); }

r() {
  local name=$1 need=$2 lim=$3; shift 3
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ ^(${ONLY})$ ]]; then  # a later call running what an earlier one left
    printf '%s\t%s\tskip(only)\t0\n' "$CALL" "$name" >> "$W/runs.tsv"; return 0
  fi
  local left; left=$(left_s "$LIMIT_S")
  if (( left - ${GRACE_S:-0} < need )); then
    printf '%s\t%s\tskip(deadline)\t0\n' "$CALL" "$name" >> "$W/runs.tsv"; return 0
  fi
  (( lim > left )) && lim=$left
  if [ -n "${DRY_RUN:-}" ]; then
    printf '%s\t%s\tdry\t0\n' "$CALL" "$name" >> "$W/runs.tsv"
    echo "[$(el)s] $name (limit ${lim}s): $*"; return 0
  fi
  local s; s=$(date +%s)
  # a child bash gets the arrays and functions (timeout runs programs, not shell functions)
  timeout -k 5 "$lim" bash -c "$(declare -p W13 W14 COG RES PY); $(declare -f wan cog); \"\$@\"" _ "$@" \
    > "$W/logs/$name.log" 2>&1; local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$CALL" "$name" "$rc" "$(( $(date +%s) - s ))" >> "$W/runs.tsv"
  echo "[$(el)s] $name rc=$rc: $(grep -E '^\[[a-z0-9_]+\] |^error|passed|failed' "$W/logs/$name.log" | tail -n 1 | cut -c1-200)"
  return 0
}

wan() {
  local g=$1 c=$2 b=$3 gpus=$4 n=$5; shift 5
  local args=("${W13[@]}"); [ "$g" = w14 ] && args=("${W14[@]}")
  if [ "$n" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpus "$PY" run_wan.py "${args[@]}" --benchmark_output_directory "$RES/$g/$c/$b" \
      --attention_type "$b" "$@"
  else
    CUDA_VISIBLE_DEVICES=$gpus "$PY" -m torch.distributed.run --standalone --nproc_per_node="$n" run_wan.py \
      "${args[@]}" --benchmark_output_directory "$RES/$g/$c/$b" --attention_type "$b" "$@"
  fi
}

cog() {
  local c=$1 b=$2 gpus=$3 n=$4; shift 4
  if [ "$n" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpus "$PY" sageattn_cogvideo.py "${COG[@]}" --output_dir "$RES/cog/$c/$b" --attention_type "$b" "$@"
  else
    CUDA_VISIBLE_DEVICES=$gpus "$PY" -m torch.distributed.run --standalone --nproc_per_node="$n" sageattn_cogvideo.py \
      "${COG[@]}" --output_dir "$RES/cog/$c/$b" --attention_type "$b" "$@"
  fi
}

# one profiled step (the third) per run, in runs of their own (group _prof: not in the table), for where the
# parallel overhead goes: GPU time per kernel category (vdbench.timing.kernel_summary)
PROF="--profile_output p --profile_wait 1 --profile_warmup 1 --profile_active 1"

pack_dir() {
  local tmp; tmp=$(mktemp --suffix=.tgz)
  (cd "$1" && tar czf "$tmp" --exclude='*.npy' --exclude='*.pt' --exclude='*.mp4' --exclude='*.tgz' .) && mv "$tmp" "$2"
}

pack_timings() {
  (cd "$1" && find . -name timing.json | tar czf "$2" -T -) 2>/dev/null
}

pack() {
  mkdir -p "$W/prof"
  for f in $(find "$RES/_prof" -name 'kernels_*.json' 2>/dev/null); do
    cp "$f" "$W/prof/$(echo "${f#$RES/_prof/}" | tr '/' '_')"
  done
  "$PY" bench/parallel_summary.py "$RES" -o "$W/parallel_summary.json" > "$W/summary_parallel.txt" 2>&1
  pack_dir "$W" "$OUT/results_$CALL.tgz"
  pack_timings "$RES" "$OUT/timing_$CALL.tgz"
  { cat "$W/runs.tsv"; echo; cat "$W/summary_parallel.txt"; } > "$OUT/summary_$CALL.txt"
}
