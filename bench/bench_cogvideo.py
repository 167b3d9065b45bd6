#!/usr/bin/env python3
"""Old name of bench/bench_attention.py, kept so existing commands keep working. Same arguments:

    python bench/bench_cogvideo.py --input_dir outputs/cogvideox/captures --kernel sdpa_cudnn,sagev1 -o out.csv
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[0] = str(Path(__file__).with_name("bench_attention.py"))
    runpy.run_path(sys.argv[0], run_name="__main__")
