#!/usr/bin/env python3
"""What a VAE decode's first call in a fresh process costs, and where: one variant per fresh process, Triton and
inductor caches emptied (new temporary folders), the first call timed apart from the warm calls, its host time
split into convolutions (cuDNN's per-shape plans), the Triton glue launches (their JIT compiles) and the rest.

    python3 bench/cold_decode.py --model wan2.1 --size 832*480 --variants fast,prewarm --repeats 2

The command line of ``vdbench.vae_bench.cold`` (what it measures and writes: ``--help``); an installed
vdbench runs it as ``python -m vdbench.vae_bench.cold``.
"""

import sys

from vdbench.vae_bench.cold import main

if __name__ == "__main__":
    sys.exit(main())
