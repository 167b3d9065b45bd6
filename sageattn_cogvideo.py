#!/usr/bin/env python3
"""Render a CogVideoX video with a chosen attention backend, timed.

CogVideoX's attention processor calls F.scaled_dot_product_attention directly (not diffusers' dispatcher): the
backend is installed into that model's processors only, nothing else in the process is touched.

    python sageattn_cogvideo.py --model_path tiny --attention_type sagev1_emu
    python sageattn_cogvideo.py --model_path THUDM/CogVideoX-2b --attention_type sagev1
    torchrun --nproc_per_node=2 sageattn_cogvideo.py --model_path THUDM/CogVideoX-2b --attention_type fav3 --use_cfg_parallel

Writes DIR/cogvideox-<model>_<type>[_<layout>].mp4 (layout: u2, cfg2 ... under torchrun) and appends to
DIR/timing.json (DIR: --output_dir, alias --benchmark_output_directory). The same flags as run_wan.py.
"""

import sys

from vdbench import cli


def main(argv=None) -> int:
    return cli.main("cogvideox", argv, prog="sageattn_cogvideo.py", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
