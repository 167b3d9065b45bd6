#!/usr/bin/env python3
"""A Wan block's elementwise passes: diffusers' eager expressions against the fused kernels (``--fused_block``), at the
real models' shapes.

    python3 bench/block_bench.py -o outputs/block.json

The command line of ``vdbench.fused_bench.block`` (what it measures and writes: ``--help``); an installed
vdbench runs it as ``python -m vdbench.fused_bench.block``.
"""

import sys

from vdbench.fused_bench.block import main

if __name__ == "__main__":
    sys.exit(main())
