"""vdbench: compare attention kernels and VAE decode paths inside real video diffusion pipelines.

One module per concern (see README): ``backends`` (the registry), ``patching`` (installing a backend into a
pipeline), ``capture``, ``pipelines`` (loading real and tiny models), ``vae``, ``metrics``, ``video``,
``timing`` and ``report``; ``numerics`` (exact attention, quantizers, emulations) sits below the registry.
"""

__version__ = "0.1.0"
