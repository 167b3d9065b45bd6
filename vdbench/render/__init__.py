"""Render one video with one attention backend, timed: the shared body of run_wan.py and sageattn_cogvideo.py.

Four stages, one module each, so a refusal can never come after work it could have spared (:func:`render`, in
``run``, runs them in order):

* ``plan`` -- :func:`validate`: every refusal that needs no weights, before anything loads; returns a :class:`Plan`,
  the configuration (``config``: :class:`RenderConfig`) resolved once into the objects every later stage takes.
* ``loading`` -- :func:`load`: the pipeline, its size and head-dim checks, the parallel engine, the speed options,
  the prewarms (``prewarm``); returns a :class:`Loaded`.
* ``repetitions`` -- :func:`run_repetitions`: the warm-up calls, then per repetition the denoising to latents (its
  step times), the decode timed on its own, the calls counted per kernel.
* ``finishing`` -- :func:`finish`: rank 0 writes the video and appends the repetitions to ``timing.json``.
"""

from .config import RenderConfig, VAEHang
from .finishing import finish
from .loading import Loaded, load
from .plan import DTYPES, Plan, VaeMode, resolve_device, resolve_dtype, validate
from .repetitions import run_repetitions
from .run import render

__all__ = ["RenderConfig", "Plan", "VaeMode", "Loaded", "render", "validate", "load", "run_repetitions", "finish",
           "resolve_device", "resolve_dtype", "VAEHang", "DTYPES"]
