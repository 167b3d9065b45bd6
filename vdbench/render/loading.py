"""The render's load stage: :func:`load` -- the pipeline (real id, local path, tiny or random-weight model), what only
the loaded model can refuse (its exact size rules, its head dims), the parallel engine, the speed options and the
step cache, the scheduler readied, the prewarms started (:class:`~vdbench.render.prewarm.Prewarms`); returns a
:class:`Loaded`."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from PIL import Image

from .. import backends as B
from .. import parallel as P
from ..cache import apply_cache
from ..measure.record import command_line, commit
from ..offload import apply_offload, load_placement, shard_weights
from ..pipelines import ModelLoadError, model_summary, set_schedule, step_denoisers, transformers_of
from ..speed import apply_speed_options
from ..timing import Laps, memory_stage, system_info
from .plan import Plan
from .prewarm import Prewarms

__all__ = ["Loaded", "load", "load_checked"]


@dataclass
class Loaded:
    """What :func:`load` made: the pipeline (parallel and sped up as asked), its denoisers, the call's keyword
    arguments and the run's header (settings, resolved values, backend, model, system) recorded with every entry."""

    pipe: object
    models: list
    kwargs: dict
    header: dict
    load_s: Optional[float] = None  # the whole load stage (weights, checks, engine, speed options), host clock
    prewarms: Prewarms = None  # the VAE's, the attention's, the fused kernels', the scheduler's (render.prewarm)
    cache: object = None  # vdbench.cache.CacheCounter of the step cache applied, or None
    memory: Optional[dict] = None  # the load stage's allocated and reserved peaks (vdbench.timing.memory_stage)


def load(plan: Plan) -> Loaded:
    """Load the pipeline and check what only the loaded model can tell (its exact size rules, its head dims)."""
    device, dctx = plan.device, plan.dctx
    t0 = time.perf_counter()
    err = pipe = models = load_time = schedule = summary = None
    laps = Laps({})  # where the load's time goes (host clock): its variation is read here, not guessed
    part = laps.lap
    prewarms = Prewarms()
    try:  # what only the files or the loaded model can refuse is agreed like validate's refusals (torchrun)
        pipe, models, load_time, schedule, summary = load_checked(plan, laps, prewarms)
    except (ModelLoadError, B.BackendUnavailable, ValueError, OSError) as e:
        err = e
    if err is not None:
        prewarms.close()
    P.agree(dctx, err)  # single process: raises err itself
    part("agree")  # the ranks agreeing on the outcome (torchrun)
    prewarms.after_weights(plan, pipe)
    head_dims = [m.config.attention_head_dim for _, m in models]
    pipe, models, speed, counter = _made_parallel_and_fast(plan, pipe, models, part)
    if plan.cfg.offload == "shard":  # after the engine, on the denoisers it made: FSDP's units are their blocks
        schedule["offload"] = shard_weights(models, device)
        part("shard")
    for name, m in models:  # what the engine or the sharding made of each denoiser (xfuser's wrapper, FSDP's class)
        summary["transformers"][name]["class"] = type(m).__name__
    header = _header(plan, pipe, summary, head_dims,
                     {"flow_shift": schedule["flow_shift"],
                      "schedule": {k: v for k, v in schedule.items() if k != "offload"},
                      "offload": schedule["offload"], "speed_options": speed}, load_time)
    kwargs = _call_kwargs(plan)
    part("header")
    header["resolved"].update(prewarms.ready_scheduler(plan, pipe))
    part("scheduler_prewarm")
    if device.type == "cuda":  # the load's last copies and quantization kernels are the load's time
        torch.cuda.synchronize(device)
    part("sync")
    load_s = time.perf_counter() - t0
    header["load_parts"] = {k: round(v, 4) for k, v in laps.parts.items()}
    prewarms.at_load_end(plan, pipe)
    return Loaded(pipe, models, kwargs, header, load_s=load_s, prewarms=prewarms, cache=counter,
                  memory=memory_stage(device))


def load_checked(plan: Plan, laps: Laps, prewarms: Prewarms) -> tuple:
    """(pipeline, its denoisers, load time, its schedule, its model summary): the ``prewarms`` that go beside the
    load started (:meth:`~vdbench.render.prewarm.Prewarms.at_load_start`), the pipeline loaded, its scheduler's
    shift and experts' boundary set (:func:`vdbench.pipelines.set_schedule`), its exact size rules and the backend
    against its head dims checked; ``laps``: the load's parts, the loading's own (:meth:`vdbench.pipelines.Model.load`)
    among them."""
    prewarms.at_load_start(plan)
    laps.lap("prewarm_start")
    cfg, model, device = plan.cfg, plan.model, plan.device
    t_load = time.perf_counter()
    # the whole load on the host (a checkpoint under --offload model) or the components a mode keeps there
    on_host, host = load_placement(cfg.offload, built=model.spec.kind == "random")
    pipe = model.load(dtype=plan.dtype, device="cpu" if on_host else device, vae_dtype=plan.vae_dtype,
                      timings=laps.parts, host=host)
    if host and torch.device(device).type == "cuda":
        # a random-weight build makes each block of a host component on the card, then moves it out: what the
        # allocator kept of them goes back to the driver, so the later stages' reserved peaks are what the render
        # holds (a checkpoint's load never puts them there; the load stage's own peak keeps the build's)
        torch.cuda.empty_cache()
    if cfg.vae_tiling:
        pipe.vae.enable_tiling()
    if cfg.vae_slicing:
        pipe.vae.enable_slicing()
    load_time = time.perf_counter() - t_load
    laps.lap("pipeline_other")  # outside the parts the load names
    model.check_experts(cfg.boundary_ratio, cfg.guidance_scale_2,
                        loaded=getattr(pipe, "transformer_2", None) is not None)
    model.check_size(pipe, cfg.height, cfg.width, cfg.num_frames)
    models = transformers_of(pipe)
    schedule = set_schedule(pipe, plan.family, cfg.task, cfg.height, cfg.width, flow_shift=plan.flow_shift,
                            boundary_ratio=cfg.boundary_ratio, guidance_scale=cfg.guidance_scale,
                            guidance_scale_2=cfg.guidance_scale_2)
    steps = step_denoisers(pipe, cfg.num_inference_steps)  # which expert runs each step: recorded with the timesteps
    schedule["timesteps"] = [round(t, 4) for _, t in steps]
    schedule["denoiser_by_step"] = [d for d, _ in steps] if schedule["boundary_ratio"] is not None else None
    summary = model_summary(pipe)  # the loaded architecture (the engine may wrap the denoisers: load() says which)
    schedule["offload"] = apply_offload(cfg.offload, pipe, device)  # the boundary set: the expert swap reads it
    pipe.set_progress_bar_config(disable=not sys.stderr.isatty(), leave=False)
    laps.lap("size_checks")
    # the backend's availability here (its package imported, the device queried)
    B.require_here(plan.backend, device, plan.dtype, [m.config.attention_head_dim for _, m in models])
    laps.lap("preflight")
    return pipe, models, load_time, schedule, summary


def _made_parallel_and_fast(plan: Plan, pipe, models: list, part) -> tuple:
    """(pipeline, denoisers, the speed options' record, the step cache's counter or None): the parallel engine, the
    speed options and the step cache applied, in the order each engine needs. An engine that hooks the denoisers in
    place (diffusers' context parallelism) goes on last: its split and gather hooks wrap the compiled blocks and the
    cache's hooks, which then see the shard each rank computes; an engine that rebuilds the pipeline (xfuser) goes
    first, and the speed options and cache apply to what it built."""
    cfg, dctx, family = plan.cfg, plan.dctx, plan.family
    engine_first = dctx.distributed and not P.hooks_in_place(dctx.spec)
    if engine_first:
        pipe, models = P.apply_engine(dctx, pipe, models, family)
        part("engine")
    speed = apply_speed_options(pipe, models, device=plan.device, compile=cfg.compile,
                                compile_backend=cfg.compile_backend, compile_mode=cfg.compile_mode,
                                bf16_te_gemms=cfg.bf16_te_gemms, fp8_gemms=plan.fp8_gemms,
                                inductor_tuning=cfg.inductor_tuning)
    part("speed_options")
    counter = None
    if plan.cache is not None:  # beside the speed options: diffusers' hooks on every denoiser, counted
        shares = P.shares_calls(dctx, family.guidance_in_one_batch)
        counter = apply_cache(plan.cache, pipe, models, steps=cfg.num_inference_steps, family=family,
                              group=(lambda: P.shard_group(dctx)) if shares else None)
        speed["cache"] = {**plan.cache.as_dict(), "units": len(counter.units)}
        part("cache")
    if dctx.distributed and not engine_first:
        pipe, models = P.apply_engine(dctx, pipe, models, family)
        part("engine")
    split = P.guidance_split(dctx, pipe) if counter is not None else None
    if split is not None:  # the cache's counts are of what this rank computed: one guidance branch per step
        counter.split_guidance(*split)
    return pipe, models, speed, counter


def _header(plan: Plan, pipe, summary: dict, head_dims: list, resolved: dict, load_time: Optional[float]) -> dict:
    """The run's header, recorded with every entry: its settings, what they resolved to (``resolved``: the flow
    shift, the speed options, the scheduler's records), the backend, the model (``summary``), the system, the
    command and the commit."""
    cfg, device, backend = plan.cfg, plan.device, plan.backend
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "resolved": {"device": str(device), "dtype": str(plan.dtype).replace("torch.", ""),
                     "head_dims": head_dims, "vae_dtype": str(pipe.vae.dtype).replace("torch.", ""), **resolved},
        "backend": {"name": backend.name, "kernel": backend.kernel, "emulated": backend.emulated,
                    "exact": backend.exact, "description": backend.description},
        "model": summary,
        "system": system_info(device),
        "load_time": load_time,
        "command": command_line(),
        "commit": commit(),
    }


def _call_kwargs(plan: Plan) -> dict:
    """The pipeline call's arguments, the conditioning image read and sized."""
    cfg = plan.cfg
    kwargs = dict(prompt=cfg.prompt, negative_prompt=cfg.negative_prompt, height=cfg.height, width=cfg.width,
                  num_frames=cfg.num_frames, num_inference_steps=cfg.num_inference_steps,
                  guidance_scale=cfg.guidance_scale, output_type="latent", **cfg.extra_pipe_kwargs)
    if cfg.guidance_scale_2 is not None:
        kwargs["guidance_scale_2"] = cfg.guidance_scale_2
    if plan.model.image:
        kwargs["image"] = _load_image(cfg.image, cfg.width, cfg.height)
    return kwargs


def _load_image(path: str, width: int, height: int):
    """Center-crop to the target aspect ratio, then resize: the conditioning image gets the video's size."""
    img = Image.open(path).convert("RGB")
    w, h = img.size
    target = width / height
    if w / h > target:
        nw = round(h * target)
        img = img.crop(((w - nw) // 2, 0, (w - nw) // 2 + nw, h))
    elif w / h < target:
        nh = round(w / target)
        img = img.crop((0, (h - nh) // 2, w, (h - nh) // 2 + nh))
    return img.resize((width, height), Image.BICUBIC)
