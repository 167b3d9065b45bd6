#!/usr/bin/env python3
"""Which attention backend for this model, at this size, on this machine: measured, ranked, one verdict line.

    python sweep.py --model tiny --budget_min 3                          # CPU: the plumbing (no speed figures)
    python sweep.py --model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81 --budget_min 15

See ``python sweep.py --help`` (vdbench.sweep) for what it runs and writes.
"""

import sys

from vdbench.sweep import main

if __name__ == "__main__":
    sys.exit(main())
