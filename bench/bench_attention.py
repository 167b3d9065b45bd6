#!/usr/bin/env python3
"""Attention kernels on captured (or preset-shaped synthetic) inputs: speed and accuracy in one run.

    python bench/bench_attention.py --input_dir outputs/x/captures --kernel sdpa_cudnn,fav3,sagev1 -o attn.csv
    python bench/bench_attention.py --preset wan2.1-1.3b-480p --kernel all -metric all -o attn.csv

The command line of ``vdbench.kernel_bench`` (what it measures and writes: ``--help``), which an installed vdbench
runs as ``python -m vdbench.kernel_bench`` -- the sweep does.
"""

import sys

from vdbench.kernel_bench import main

if __name__ == "__main__":
    sys.exit(main())
