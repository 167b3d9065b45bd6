#!/usr/bin/env bash
# Render the same Wan clip once per attention backend (and per prompt and seed of a set), side by side on the
# machine's GPUs, keep going when one fails, compare, stitch a grid: python -m vdbench.render_all (its --help).
#
#   bash render_all_WAN.sh --model-path tiny --output-dir outputs/demo --stitch
#   bash render_all_WAN.sh --types sdpa_cudnn,fav3,sagev1 --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers -- --num_frames 33
#   bash render_all_WAN.sh --nproc 8 --types sdpa_cudnn,fav3 --model-path Wan-AI/Wan2.1-T2V-14B-Diffusers --stitch
#
# The Python is $PYTHON, else this checkout's .venv, else python3.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
[ -x "$here/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && py="$here/.venv/bin/python"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("vdbench") and u.find_spec("torch")))' 2>/dev/null \
  || { echo "error: cannot import vdbench and torch with $py (set PYTHON, or make setup creates .venv)" >&2; exit 2; }
# render_all_attention.sh runs this one for CogVideoX (RENDER_ALL_FAMILY=cogvideox)
exec "$py" -m vdbench.render_all --family "${RENDER_ALL_FAMILY:-wan}" --prog "${RENDER_ALL_PROG:-render_all_WAN.sh}" "$@"
