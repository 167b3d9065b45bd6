#!/usr/bin/env python3
"""Render a Wan 2.1 / 2.2 video with a chosen attention backend, timed.

    python run_wan.py --model tiny --attention_type sdpa                  # embedded tiny model, CPU is fine
    python run_wan.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --attention_type fav3 --height 480 --width 832
    torchrun --nproc_per_node=2 run_wan.py --model random:wan2.1-t2v-1.3b --attention_type fav3 --ulysses_degree 2
    python run_wan.py --list_backends

    python run_wan.py --model tiny --task ti2v --img_file_path first_frame.png   # TI2V's image-to-video path

Writes DIR/results/wan_result_<task>_<model>_<F>f_<S>s_attn_<type>_<H>x<W>[_<layout>].mp4 (layout: u2, r2,
u2r2, cfg2 ... under torchrun) and appends one object per repetition to DIR/results/timing.json (DIR:
--benchmark_output_directory, alias --output_dir). The same flags as sageattn_cogvideo.py.
"""

import sys

from vdbench import cli

size_from_image = cli.size_from_image  # kept importable from here (what the original script offered)


def main(argv=None) -> int:
    return cli.main("wan", argv, prog="run_wan.py", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
