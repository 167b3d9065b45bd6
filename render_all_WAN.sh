#!/usr/bin/env bash
# Render the same Wan clip once per attention backend, keep going when one fails, compare, stitch a grid.
#
#   bash render_all_WAN.sh --model-path tiny --output-dir outputs/demo --stitch
#   bash render_all_WAN.sh --types sdpa_cudnn,fav3,sagev1 --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers -- --num_frames 33
#   bash render_all_WAN.sh --nproc 8 --types sdpa_cudnn,fav3 --model-path Wan-AI/Wan2.1-T2V-14B-Diffusers --stitch
#
# Options:
#   --output-dir DIR        where results/, logs/ and the grid go
#                           (default: outputs/render_all_wan; for CogVideoX outputs/render_all_cogvideox)
#   --types a,b,c           backends to render (default: every backend that can run on this machine)
#   --model-path M          hub id, local path, tiny or tiny:<variant> (default: tiny)
#   --nproc N               launch each render with torchrun on N processes (GPUs) (default: 1)
#   --ulysses-degree N      Ulysses degree under --nproc (default: N, when no degree or CFG split is given)
#   --ring-degree N         ring-attention degree under --nproc (default: 1)
#   --use-cfg-parallel      split the guidance batch over 2 ranks (xfuser) (default: off)
#   --parallel-engine E     auto, xfuser or diffusers (default: auto: the faster engine for the family where it serves)
#   --img-file-path IMG     conditioning image (i2v; ti2v's image-to-video path) (default: none)
#   --fps N                 frame rate of the rendered videos (and so of the grid) (default: the model family's)
#   --font-size N           label size of the grid, in pixels (default: 24)
#   --stitch                stitch the renders into DIR/comparison_grid.mp4 (needs two or more) (default: off)
#   --reuse                 skip a backend whose video already exists (counted as rendered) (default: off)
#   --report                write DIR/report.html and DIR/summary.csv (python -m vdbench.report) (default: off)
#   -h, --help              this help
#   -- ARGS...              passed to the renderer unchanged: run_wan.py (sageattn_cogvideo.py for
#                           render_all_attention.sh) (default: none)
# Each render runs in its own process (or torchrun group): a crash or a failing rank loses that render only. Its
# log is DIR/logs/<type>.log; its step lines (time, ETA) are shown here. The batch ends with a comparison table
# (warm ms/step, speed-up vs the first exact backend, PSNR vs reference, kernels that ran; install hints and
# emulations of the backends that can't run here).
# Exit code: 0 if every requested backend rendered; 1 if any failed or nothing rendered; 2 on bad options.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
# The same loop serves CogVideoX (render_all_attention.sh sets RENDER_ALL_FAMILY=cogvideox).
family=${RENDER_ALL_FAMILY:-wan}
if [ "$family" = cogvideox ]; then
  runner="$here/sageattn_cogvideo.py"; model_flag=--model_path; out_flag=--output_dir; results_sub=""
  default_out=outputs/render_all_cogvideox
else
  runner="$here/run_wan.py"; model_flag=--model; out_flag=--benchmark_output_directory; results_sub=results
  default_out=outputs/render_all_wan
fi
[ -x "$here/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && py="$here/.venv/bin/python"

out_dir=$default_out; types=""; model=tiny; stitch=0; reuse=0; want_report=0; extra=()
nproc=1; ulysses=""; ring=""; cfg=0; engine=""; image=""; fps=""; font_size=24
usage() {
  if [ "$family" = cogvideox ]; then
    sed -n '2,7p' "$here/render_all_attention.sh"; sed -n '7,31p' "$here/render_all_WAN.sh"
  else sed -n '2,31p' "$here/render_all_WAN.sh"; fi | sed 's/^# \{0,1\}//'
}
need() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "error: $1 needs a value (see --help)" >&2; exit 2; }; }
int() { case "$2" in ''|*[!0-9]*|0) echo "error: $1 needs a positive integer, got '$2'" >&2; exit 2 ;; esac; }
while [ $# -gt 0 ]; do
  case "$1" in
    --output-dir|--output_dir) need "$@"; out_dir=$2; shift 2 ;;
    --types) need "$@"; types=$2; shift 2 ;;
    --model-path|--model_path|--model) need "$@"; model=$2; shift 2 ;;
    --nproc|--nproc_per_node|--nproc-per-node) need "$@"; int "$1" "$2"; nproc=$2; shift 2 ;;
    --ulysses-degree|--ulysses_degree) need "$@"; int "$1" "$2"; ulysses=$2; shift 2 ;;
    --ring-degree|--ring_degree) need "$@"; int "$1" "$2"; ring=$2; shift 2 ;;
    --use-cfg-parallel|--use_cfg_parallel) cfg=1; shift ;;
    --parallel-engine|--parallel_engine) need "$@"; engine=$2; shift 2 ;;
    --img-file-path|--img_file_path|--image) need "$@"; image=$2; shift 2 ;;
    --fps) need "$@"; int "$1" "$2"; fps=$2; shift 2 ;;
    --font-size|--font_size) need "$@"; int "$1" "$2"; font_size=$2; shift 2 ;;
    --stitch) stitch=1; shift ;;
    --reuse) reuse=1; shift ;;
    --report) want_report=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$image" ] && [ ! -f "$image" ]; then echo "error: --img-file-path $image: no such file" >&2; exit 2; fi

# the parallel layout: Ulysses over all N processes unless a degree or the CFG split says otherwise
par=()
if [ "$nproc" -gt 1 ] && [ -z "$ulysses$ring" ] && [ "$cfg" = 0 ]; then ulysses=$nproc; fi
[ -n "$ulysses" ] && par+=(--ulysses_degree "$ulysses")
[ -n "$ring" ] && par+=(--ring_degree "$ring")
[ "$cfg" = 1 ] && par+=(--use_cfg_parallel)
[ -n "$engine" ] && par+=(--parallel_engine "$engine")
if [ "$nproc" = 1 ] && { [ "${ulysses:-1}" -gt 1 ] || [ "${ring:-1}" -gt 1 ] || [ "$cfg" = 1 ]; }; then
  echo "error: --ulysses-degree / --ring-degree / --use-cfg-parallel split a render over processes: add --nproc N" >&2
  exit 2
fi
if [ "$nproc" -gt 1 ]; then launch=("$py" -m torch.distributed.run --standalone --nproc_per_node="$nproc" "$runner")
else launch=("$py" "$runner"); fi
render_args=("$model_flag" "$model" "$out_flag" "$out_dir" "${par[@]}")
[ -n "$image" ] && render_args+=(--img_file_path "$image")
[ -n "$fps" ] && render_args+=(--fps "$fps")
render_args+=("${extra[@]}")

export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
valid=$("$py" -c 'from vdbench.backends import aliases, names; print(" ".join(names() + list(aliases())))') || { echo "error: cannot import vdbench with $py" >&2; exit 2; }
if [ -z "$types" ]; then
  types=$("$py" "$runner" --list_available "${extra[@]}" | tr '\n' ',' ) || { echo "error: could not list backends" >&2; exit 2; }
fi
IFS=',' read -r -a all_types <<< "$types"
type_list=()
for t in "${all_types[@]}"; do
  [ -z "$t" ] && continue
  case " $valid " in *" $t "*) ;; *) echo "error: unknown attention type '$t'; valid: $valid" >&2; exit 2 ;; esac
  type_list+=("$t")
done
[ ${#type_list[@]} -gt 0 ] || { echo "error: no backend to render (--types is empty)" >&2; exit 2; }

mkdir -p "$out_dir/logs"
results_dir=$out_dir${results_sub:+/$results_sub}
ok=(); failed=(); failed_codes=(); outputs=()
start=$(date +%s)
joined=$(IFS=,; echo "${type_list[*]}")
mapfile -t paths < <("$py" "$runner" "${render_args[@]}" --attention_type "$joined" --print_output_path \
                       2>"$out_dir/logs/.paths.err")
if [ ${#paths[@]} -ne ${#type_list[@]} ]; then
  echo "error: could not compute the output paths: $(grep -m1 '^error:' "$out_dir/logs/.paths.err")" >&2
  grep -m1 '^hint:' "$out_dir/logs/.paths.err" >&2
  exit 2
fi
under=""; [ "$nproc" -gt 1 ] && under=" under torchrun on $nproc processes (${par[*]})"
echo "rendering ${#type_list[@]} backend(s)$under into $results_dir/"
for i in "${!type_list[@]}"; do
  t=${type_list[$i]}; path=${paths[$i]}; log="$out_dir/logs/$t.log"
  if [ "$reuse" = 1 ] && [ -s "$path" ]; then
    echo "[$t] reused $path"; ok+=("$t"); outputs+=("$path"); continue
  fi
  echo "[$t] rendering (log: $log)"
  # the log gets everything; the screen its step lines and the result line
  "${launch[@]}" "${render_args[@]}" --attention_type "$t" 2>&1 | tee "$log" \
    | grep --line-buffered -E '^\[[^]]+\] (step [0-9]+/|warm step|no warm step|emulated backend)' | cut -c1-220
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ] && [ -s "$path" ]; then
    ok+=("$t"); outputs+=("$path")
  else
    # under torchrun the launcher exits 1; the ranks' own codes are in its summary
    code=$rc; ranks=$(grep -oE 'exitcode +: -?[0-9]+' "$log" | grep -oE -- '-?[0-9]+$' | sort -u | tr '\n' ' ')
    [ -n "$ranks" ] && [ "$nproc" -gt 1 ] && code="$rc; ranks exited ${ranks% }"
    echo "[$t] FAILED (exit $code): $(grep -m1 -E '^error:' "$log" | cut -c8-)"
    grep -m1 -E '^hint:' "$log" | sed 's/^/    /'
    failed+=("$t"); failed_codes+=("$t:$code")
  fi
done

echo
echo "rendered in $(( $(date +%s) - start )) s: ${#ok[@]} succeeded (${ok[*]:-none}), ${#failed[@]} failed (${failed[*]:-none})"
echo "videos and timing.json: $results_dir/"
echo
"$py" -m vdbench.batch "$results_dir" --outputs "${outputs[@]}" --failed "${failed_codes[@]}" --logs "$out_dir/logs" \
  || echo "warning: the comparison table could not be made" >&2
rc=0
[ ${#failed[@]} -eq 0 ] || rc=1
if [ ${#ok[@]} -eq 0 ]; then echo "error: nothing rendered (see the logs in $out_dir/logs/)" >&2; exit 1; fi
if [ "$stitch" = 1 ]; then
  if [ ${#outputs[@]} -ge 2 ]; then
    ref=()
    for t in "${ok[@]}"; do [ "$t" = reference ] && ref=(--reference reference); done
    if "$py" "$here/stitch_comparison.py" --output "$out_dir/comparison_grid.mp4" --font_size "$font_size" "${ref[@]}" \
        "${outputs[@]}" > "$out_dir/logs/stitch.log" 2>&1; then
      echo "grid: $out_dir/comparison_grid.mp4"
    else
      echo "stitching failed: $(grep -m1 'error:' "$out_dir/logs/stitch.log")" >&2; rc=1
    fi
  else
    echo "not stitching: fewer than two renders succeeded"
  fi
fi
if [ "$want_report" = 1 ]; then
  if "$py" -m vdbench.report "$results_dir" -o "$out_dir" > "$out_dir/logs/report.log" 2>&1; then
    echo "report: $out_dir/report.html"
  else
    echo "report failed: $(grep -m1 'error' "$out_dir/logs/report.log")" >&2; rc=1
  fi
fi
exit $rc
