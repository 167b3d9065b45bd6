#!/usr/bin/env bash
# Render the same CogVideoX clip once per attention backend (sageattn_cogvideo.py), keep going when one fails,
# report, and stitch a grid. Same options as render_all_WAN.sh (-h lists them); --model-path defaults to tiny.
#
#   bash render_all_attention.sh --model-path tiny --output-dir outputs/cog --stitch
#   bash render_all_attention.sh --types sdpa_cudnn,sagev1,fav3 --model-path THUDM/CogVideoX-2b --reuse --stitch
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RENDER_ALL_FAMILY=cogvideox exec bash "$here/render_all_WAN.sh" "$@"
