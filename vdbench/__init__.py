"""vdbench: compare attention kernels and VAE decode paths inside real video diffusion pipelines.

One module per concern (see README, docs/ARCHITECTURE.md): ``backends`` (the registry), ``patching`` (installing
a backend into a pipeline), ``capture``, ``families`` (one module per model family), ``tiny`` (the tiny /
random-weight model factory), ``pipelines`` (loading real and tiny models), ``vae``, ``metrics``, ``video``,
``timing`` and ``report``.
"""

__version__ = "0.1.0"
