#!/usr/bin/env python3
"""The project's Triton attention kernels (vdbench/kernels) on a GPU: the check and sweep stages of the kernels
suite (bench/suites/kernels.toml).

    python bench/gpu_kernels.py check --out DIR    # kernels vs their torch emulations and fp64 -> DIR/check.json
    python bench/gpu_kernels.py sweep --out DIR    # the tile sweep -> DIR/sweep.csv, DIR/best_configs.json

The command line of ``vdbench.kernel_tune`` (what it measures and writes: ``--help``); an installed
vdbench runs it as ``python -m vdbench.kernel_tune``.
"""

import sys

from vdbench.kernel_tune import main

if __name__ == "__main__":
    sys.exit(main())
