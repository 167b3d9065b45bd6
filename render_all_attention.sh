#!/usr/bin/env bash
# Render the same CogVideoX clip once per attention backend (sageattn_cogvideo.py's renderer), keep going when one
# fails, compare, and stitch a grid. Same options as render_all_WAN.sh (--help); --model-path defaults to tiny.
#
#   bash render_all_attention.sh --model-path tiny --output-dir outputs/cog --stitch
#   bash render_all_attention.sh --types sdpa_cudnn,sagev1,fav3 --model-path THUDM/CogVideoX-2b --reuse --stitch
#   bash render_all_attention.sh --nproc 2 --use-cfg-parallel --types sdpa_cudnn,fav3 --model-path THUDM/CogVideoX-2b
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RENDER_ALL_FAMILY=cogvideox RENDER_ALL_PROG=render_all_attention.sh exec bash "$here/render_all_WAN.sh" "$@"
