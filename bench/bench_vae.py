#!/usr/bin/env python3
"""VAE decode and encode configs side by side: time, peak memory and quality against the fp32 untiled ones.

    python bench/bench_vae.py --model wan2.1 --frames 81 --size 832*480 --configs fp32,bf16,tiled,fast -o vae.json
    python bench/bench_vae.py --model tiny --frames 9 --size 64*48 --device cpu        # CI-sized (tiny Wan 2.1 VAE)

The command line of ``vdbench.vae_bench`` (its configs, what it measures and writes: ``--help``), which an installed
vdbench runs as ``python -m vdbench.vae_bench``.
"""

import sys

from vdbench.vae_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
