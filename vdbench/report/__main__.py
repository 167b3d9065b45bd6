"""``python -m vdbench.report``: the report's command line (``--help``)."""

import sys

from .cli import main

sys.exit(main())
