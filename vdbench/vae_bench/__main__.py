"""``python -m vdbench.vae_bench``: the VAE bench (:mod:`vdbench.vae_bench.cli`)."""

import sys

from .cli import main

sys.exit(main())
