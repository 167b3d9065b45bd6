"""A render from start to end: :func:`render` -- the process group torchrun describes joined (or one process's
context, :class:`vdbench.parallel.OneProcess`), the four stages run in order (:func:`~vdbench.render.plan.validate`,
:func:`~vdbench.render.loading.load`, :func:`~vdbench.render.repetitions.run_repetitions`,
:func:`~vdbench.render.finishing.finish`), a rank's failure handed to its peers."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from .. import backends as B
from .. import parallel as P
from ..stages import Wall
from ..timing import WallStart, wall_start
from .config import RenderConfig
from .finishing import finish
from .loading import load
from .plan import resolve_device, validate
from .repetitions import run_repetitions

__all__ = ["render"]


def render(cfg: RenderConfig, log=print, exit_code_of=None, started: Optional[WallStart] = None) -> dict:
    """Run the render described by ``cfg``; returns the summary dict (also appended to timing.json).

    ``started``: what ``end_to_end_s`` counts from (:func:`vdbench.timing.wall_start`: the CLIs pass the process's
    start); by default this call.

    Under torchrun with a parallel degree (``cfg.ulysses_degree`` / ``ring_degree``) every rank renders its
    share through the chosen engine (vdbench.parallel); rank 0 alone writes the video and the merged timing.
    ``exit_code_of(exception)``: the exit code an error means (the CLI's mapping), which a rank stopped by
    torchrun on its way out still exits with.
    """
    started = started if started is not None else wall_start(from_process=False)
    spec = P.ParallelSpec(cfg.parallel_engine, cfg.ulysses_degree, cfg.ring_degree, cfg.use_cfg_parallel,
                          head_chunks=cfg.ulysses_overlap, async_exchange=cfg.ulysses_async,
                          guidance_overlap=cfg.guidance_overlap, fp8_exchange=cfg.ulysses_fp8_exchange,
                          v_per_rank=cfg.ulysses_v_per_rank)
    ctx = P.init_distributed(spec, cfg.device) or P.OneProcess(resolve_device(cfg.device), rank=cfg.rank)
    watch = P.FailureWatch(ctx)
    log = log if ctx.is_main else (lambda *a, **k: None)  # rank 0 speaks for the ranks
    try:
        if ctx.distributed:  # the test hook of the failure propagation (VDBENCH_TEST_FAIL)
            P.maybe_inject_failure(ctx.rank, "start", B.canonical_name(cfg.attention_type))
        plan = validate(replace(cfg, rank=ctx.rank), ctx)
        load_start = time.perf_counter()
        loaded = load(plan)
        entries, frames = run_repetitions(plan, loaded, log)
        out = finish(plan, entries, frames, log, wall=Wall(started, load_start, loaded.load_s))
    except BaseException as e:
        P.finish(ctx, watch, e, exit_code_of(e) if exit_code_of is not None else 1)
        raise
    P.finish(ctx, watch, None)
    return out
