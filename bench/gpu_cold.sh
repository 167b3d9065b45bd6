#!/usr/bin/env bash
# What one render really costs on a fresh machine: the VAE decode's first call diagnosed (bench/cold_decode.py: one
# variant per fresh process, Triton/inductor caches emptied), and whole renders with --vae_decode fast vs default
# in fresh processes with empty caches (end_to_end_s in timing.json; the process's wall time beside it), and the
# default kernel bench at the Wan 14B 720p preset (n >= 5 per row; each kernel's first call apart).
#
#   PARTS="cold480 cold720 r480" bash bench/gpu_cold.sh     # one device call
#   PARTS="r720 attn14" bash bench/gpu_cold.sh              # the next
#   N=3 (renders per mode and size; N720 for 720p), STEPS=4, COLD_VARIANTS, LIMIT_S=560 (the call's deadline), DRY_RUN=1 (print, run nothing)
# Results: $OUT/cold_<call>.tgz (logs, JSON, timing.json files; no videos) and $OUT/summary_<call>.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
LIMIT_S=${LIMIT_S:-560}
W=$(mktemp -d); RES=$W/res; runs_init
N=${N:-3}; N720=${N720:-$N}; STEPS=${STEPS:-4}
CV=${COLD_VARIANTS:-bf16,fast,prewarm,prewarm+main}  # bench/cold_decode.py's variants
PARTS=${PARTS:-"cold480 cold720 r480"}
has() { [[ " $PARTS " == *" $1 "* ]]; }

fresh() {  # CMD...: run with new empty Triton / inductor caches (a fresh machine's), removed afterwards
  local t i; t=$(mktemp -d); i=$(mktemp -d)
  TRITON_CACHE_DIR=$t TORCHINDUCTOR_CACHE_DIR=$i "$@"; local rc=$?
  rm -rf "$t" "$i"; return $rc
}

render() {  # SIZE(480|720) MODE REP: one render in a fresh process, wall time from the shell beside end_to_end_s
  local size=$1 mode=$2 rep=$3 hw=(--height 480 --width 832)
  [ "$size" = 720 ] && hw=(--height 720 --width 1280)
  local dir=$RES/r$size/$mode/$rep s; s=$(date +%s%N)
  local base; read -r -a base <<< "$WAN13_S"  # the library's Wan 1.3B arguments; the later --height/--width win
  fresh "$PY" run_wan.py "${base[@]}" "${hw[@]}" --num_inference_steps "$STEPS" \
    --attention_type default --vae_decode "$mode" --benchmark_output_directory "$dir"
  local rc=$?
  echo "shell_wall_ms $(( ($(date +%s%N) - s) / 1000000 ))" > "$dir/shell_wall.txt"
  return $rc
}

WAN13_S="${WAN13[*]}"  # arrays don't cross into r's child bash; a string does
export -f fresh render; export RES STEPS PY WAN13_S  # r runs its command in a child bash
gpu_info "$W/gpu.txt"
has cold480 && r cold480 150 200 "$PY" bench/cold_decode.py --model wan2.1 --size '832*480' --frames 81 --variants "$CV" \
  -o "$W/cold480.json"
has cold720 && r cold720 200 260 "$PY" bench/cold_decode.py --model wan2.1 --size '1280*720' --frames 81 --variants "$CV" \
  -o "$W/cold720.json"
for size in 480 720; do
  has "r$size" || continue
  n=$N; [ "$size" = 720 ] && n=$N720
  for rep in $(seq 1 "$n"); do
    for mode in default fast; do  # interleaved: drift falls on both
      r "r${size}_${mode}_$rep" 60 150 render "$size" "$mode" "$rep"
    done
  done
done
has attn14 && r attn14 150 300 "$PY" bench/bench_attention.py --preset wan2.1-14b-720p --kernel fav3,fav3_fp8,sta \
  --output "$W/attn14.csv"

{ cat "$W/runs.tsv"
  for f in "$W"/logs/cold*.log; do [ -f "$f" ] && { echo "== $f"; tail -8 "$f"; }; done
  for f in "$RES"/r*/*/*; do
    [ -d "$f" ] || continue
    echo "== ${f#$RES/} $(cat "$f/shell_wall.txt" 2>/dev/null)"
    grep -h "end-to-end\|decode \|warm step" "$W"/logs/"$(echo "${f#$RES/}" | awk -F/ '{print $1"_"$2"_"$3}')".log 2>/dev/null | head -3
  done
  [ -f "$W/logs/attn14.log" ] && tail -15 "$W/logs/attn14.log"
} > "$OUT/summary_$CALL.txt" 2>&1
pack_dir "$W" "$OUT/cold_$CALL.tgz"
cat "$OUT/summary_$CALL.txt"
