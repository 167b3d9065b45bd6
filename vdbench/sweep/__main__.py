"""``python -m vdbench.sweep``: the sweep's command line (``--help``)."""

import sys

from .command import main

sys.exit(main())
