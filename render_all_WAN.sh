#!/usr/bin/env bash
# Render the same Wan clip once per attention backend, keep going when one fails, then stitch a grid.
#
#   bash render_all_WAN.sh --model-path tiny --output-dir outputs/demo --stitch
#   bash render_all_WAN.sh --types sdpa_cudnn,fav3,sagev1 --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers -- --num_frames 33
#
# Options:
#   --output-dir DIR   where results/, logs/ and the grid go (default outputs/render_all_wan)
#   --types a,b,c      backends to render (default: every backend that can run on this machine)
#   --model-path M     hub id, local path or tiny (default tiny)
#   --stitch           stitch the successful renders into DIR/comparison_grid.mp4 (needs two or more)
#   --reuse            skip a backend whose video already exists (counted as succeeded)
#   --report           write DIR/report.html and DIR/summary.csv (python -m vdbench.report; quality vs reference)
#   -h, --help         this help
#   -- ARGS...         passed to the renderer unchanged (run_wan.py; sageattn_cogvideo.py for render_all_attention.sh)
# Each render runs in its own process (a crash in one loses no other); its log is DIR/logs/<type>.log.
# Exit code: 0 if every requested backend rendered, 1 if any failed, 2 on bad options.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
# The same loop serves CogVideoX (render_all_attention.sh sets RENDER_ALL_FAMILY=cogvideox).
family=${RENDER_ALL_FAMILY:-wan}
if [ "$family" = cogvideox ]; then
  runner="$here/sageattn_cogvideo.py"; model_flag=--model_path; out_flag=--output_dir; results_sub=""
  default_out=outputs/render_all_cogvideox; script_name=render_all_attention.sh
else
  runner="$here/run_wan.py"; model_flag=--model; out_flag=--benchmark_output_directory; results_sub=results
  default_out=outputs/render_all_wan; script_name=render_all_WAN.sh
fi
[ -x "$here/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && py="$here/.venv/bin/python"

out_dir=$default_out; types=""; model=tiny; stitch=0; reuse=0; want_report=0; extra=()
usage() {
  if [ "$family" = cogvideox ]; then sed -n '2,6p' "$here/render_all_attention.sh"; sed -n '7,17p' "$here/render_all_WAN.sh"
  else sed -n '2,17p' "$here/render_all_WAN.sh"; fi | sed 's/^# \{0,1\}//'
}
while [ $# -gt 0 ]; do
  case "$1" in
    --output-dir) out_dir=${2:?--output-dir needs a value}; shift 2 ;;
    --types) types=${2:?--types needs a value}; shift 2 ;;
    --model-path) model=${2:?--model-path needs a value}; shift 2 ;;
    --stitch) stitch=1; shift ;;
    --reuse) reuse=1; shift ;;
    --report) want_report=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
valid=$("$py" -c 'from vdbench.backends import aliases, names; print(" ".join(names() + list(aliases())))') || { echo "error: cannot import vdbench with $py" >&2; exit 2; }
if [ -z "$types" ]; then
  types=$("$py" "$runner" --list_available "${extra[@]}" | tr '\n' ',' ) || { echo "error: could not list backends" >&2; exit 2; }
fi
IFS=',' read -r -a type_list <<< "$types"
for t in "${type_list[@]}"; do
  [ -z "$t" ] && continue
  case " $valid " in *" $t "*) ;; *) echo "error: unknown attention type '$t'; valid: $valid" >&2; exit 2 ;; esac
done

mkdir -p "$out_dir/logs"
results_dir=$out_dir${results_sub:+/$results_sub}
common=("$model_flag" "$model" "$out_flag" "$out_dir" "${extra[@]}")
ok=(); failed=(); outputs=()
start=$(date +%s)
joined=$(IFS=,; echo "${type_list[*]}")
mapfile -t paths < <("$py" "$runner" "${common[@]}" --attention_type "$joined" --print_output_path)
[ ${#paths[@]} -eq ${#type_list[@]} ] || { echo "error: could not compute output paths" >&2; exit 2; }
for i in "${!type_list[@]}"; do
  t=${type_list[$i]}; path=${paths[$i]}
  [ -z "$t" ] && continue
  if [ "$reuse" = 1 ] && [ -s "$path" ]; then
    echo "[$t] reused $path"; ok+=("$t"); outputs+=("$path"); continue
  fi
  echo "[$t] rendering (log: $out_dir/logs/$t.log)"
  if "$py" "$runner" "${common[@]}" --attention_type "$t" >"$out_dir/logs/$t.log" 2>&1; then
    grep -E '^\[' "$out_dir/logs/$t.log" | tail -n 1
    ok+=("$t"); outputs+=("$path")
  else
    rc=$?
    echo "[$t] FAILED (exit $rc): $(grep -E '^error:' "$out_dir/logs/$t.log" | head -n 1)"
    failed+=("$t")
  fi
done

echo
echo "rendered in $(( $(date +%s) - start )) s: ${#ok[@]} succeeded (${ok[*]:-none}), ${#failed[@]} failed (${failed[*]:-none})"
echo "videos and timing.json: $results_dir/"
if [ "$stitch" = 1 ]; then
  if [ ${#outputs[@]} -ge 2 ]; then
    labels=$(IFS=,; echo "${ok[*]}")
    if "$py" "$here/stitch_comparison.py" --output "$out_dir/comparison_grid.mp4" --labels "$labels" "${outputs[@]}"; then
      echo "grid: $out_dir/comparison_grid.mp4"
    else
      echo "stitching failed" >&2; exit 1
    fi
  else
    echo "not stitching: fewer than two renders succeeded"
  fi
fi
if [ "$want_report" = 1 ]; then
  if "$py" -m vdbench.report "$results_dir" -o "$out_dir"; then echo "report: $out_dir/report.html"
  else echo "report failed" >&2; exit 1; fi
fi
[ ${#failed[@]} -eq 0 ]
