#!/usr/bin/env python3
"""Stitch the per-backend videos of a benchmark run into one labelled comparison grid (:mod:`vdbench.stitch`).

    python stitch_comparison.py --input_dir outputs/wan/results --font_size 48   # -> results/comparison_grid.mp4
    python stitch_comparison.py --output grid.mp4 --labels sdpa,sagev1 a.mp4 b.mp4   # explicit files, in order
    python stitch_comparison.py --input_dir outputs/set/results --content 2      # one prompt and seed of a set

See ``python stitch_comparison.py --help``.
"""

import sys

from vdbench.stitch import main

if __name__ == "__main__":
    sys.exit(main())
