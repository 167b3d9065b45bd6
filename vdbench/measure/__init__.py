"""What vdbench measures and how it is kept: ``record`` (one record per measurement, the schema every tool
writes and reads) and ``quality`` (how far an output is from its reference: the one definition of every distance the
tools report). Bottom layer: imports only other bottom-layer modules (``timing``)."""
