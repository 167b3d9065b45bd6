#!/usr/bin/env python3
"""Band-parallel VAE decode (vdbench.vae.parallel) under torchrun: exactness against the single-device decode,
time, peak memory. Every rank also decodes the whole latent alone (the single-device reference and time: Wan through
``wan_decode_chunked``, the loop the band decode drives; CogVideoX through diffusers' own ``decode``), then its
band in the parallel decode; medians of ``--repeats`` timed runs after ``--warmup`` (on a GPU 5 after 1 unless
given: a figure from fewer than 3 is no speed figure, ``speed_figure`` / ``why_not_speed`` per run), synchronized
(and barrier-aligned for the parallel one, whose time is the slowest rank's).

    torchrun --nproc_per_node=2 bench/bench_vae_parallel.py --case tiny --case tiny:wan2.2 --json out.json

The command line of ``vdbench.vae_bench.parallel`` (what it measures and writes: ``--help``); an installed
vdbench runs it as ``python -m vdbench.vae_bench.parallel``.
"""

import sys

from vdbench.vae_bench.parallel import main

if __name__ == "__main__":
    sys.exit(main())
