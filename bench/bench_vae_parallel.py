#!/usr/bin/env python3
"""Band-parallel VAE decode (vdbench.vae.parallel) under torchrun: exactness against the single-device decode, time,
peak memory.

    torchrun --nproc_per_node=2 bench/bench_vae_parallel.py --case tiny --case tiny:wan2.2 --json out.json

The command line of ``vdbench.vae_bench.parallel`` (what it measures and writes: its module doc, ``--help``); an
installed vdbench runs it as ``torchrun -m vdbench.vae_bench.parallel``.
"""

import sys

from vdbench.vae_bench.parallel import main

if __name__ == "__main__":
    sys.exit(main())
