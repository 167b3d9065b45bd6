#!/usr/bin/env python3
"""Wan's RoPE: diffusers' eager expressions against the fused kernel (``--fused_rope``), at the real models' shapes.

    python3 bench/rope_bench.py -o outputs/rope.json
    python3 bench/rope_bench.py --shapes wan13 --ranks 2

The command line of ``vdbench.fused_bench.rope`` (what it measures and writes: ``--help``); an installed
vdbench runs it as ``python -m vdbench.fused_bench.rope``.
"""

import sys

from vdbench.fused_bench.rope import main

if __name__ == "__main__":
    sys.exit(main())
