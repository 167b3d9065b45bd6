"""Measurements of a run's outputs. ``quality``: how far an output is from its reference (the one definition of
every distance the tools report). Bottom layer: imports nothing of vdbench."""
