"""What vdbench measures, in one shape: the record every tool writes and reads (:mod:`vdbench.measure.record`)."""
