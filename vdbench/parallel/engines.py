"""The two engines that make a loaded pipeline parallel (:func:`apply_engine`), both the projects' own
sequence-parallel code (nothing here re-implements it); the groups' connections made before the first step
(:func:`warm_collectives`).

* ``xfuser`` -- xDiT: the transformer becomes ``xFuserWanTransformer3DWrapper`` (its processors call
  xfuser's USP: Ulysses all-to-all, ring via torch's templated ring attention, or both), with xfuser's model
  parallel groups. The backend is installed behind xfuser's attention registry (``AttentionPatch``), which
  serves the Ulysses *and* the ring path. Needs CUDA: ``import xfuser`` raises NotImplementedError without an
  accelerator (``envs.get_device_version()``), ``xfuser.envs.get_torch_distributed_backend()`` raises
  NotImplementedError on a machine without CUDA/HIP/MUSA/MPS/NPU, and ``xfuser.model_executor.layers.usp``
  binds yunchang's ``PROCESS_GROUP`` only when ``torch.cuda.is_available()`` (``None`` otherwise, so both its
  Ulysses all-to-all and its ring attention dereference ``None``).
* ``diffusers`` -- ``transformer.enable_parallelism(config=ContextParallelConfig(...))``: diffusers' own CP
  hooks split the sequence and its templated Ulysses / ring / unified attention runs, with our kernel as the
  forward op (``AttentionPatch._cp_forward_op``). Runs on CPU over gloo, which is how CI checks it.

Under ``--use_cfg_parallel`` the engine's own guidance split serves where it has one (xfuser's Wan I2V and
CogVideoX pipelines), else vdbench's (:func:`vdbench.parallel.guidance.split_guidance`).
"""

from __future__ import annotations

import importlib
import inspect
import time
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .. import backends as B
from .. import families
from .group import DistContext, shard_group
from .guidance import split_guidance
from .spec import fp8_exchange_refusal, unwired

__all__ = ["apply_engine", "warm_collectives", "one_device_presented", "rebuild_pipeline_as"]


@contextmanager
def one_device_presented(device: torch.device):
    """diffusers 0.42's parallel setup computes ``rank % torch.accelerator.device_count()``, which is 0 on a
    CPU-only machine; present one device for that call only (the CPU mesh itself is built by torch)."""
    if device.type != "cpu" or torch.accelerator.device_count() > 0:
        yield
        return
    orig = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = orig


def apply_engine(ctx: DistContext, pipe, models: list, family: families.Family) -> tuple:
    """Make the pipeline parallel with the chosen engine; returns ``(pipe, models)`` (both may be new objects:
    xfuser wraps the transformers, and for CFG parallel / CogVideoX the pipeline itself). ``family``: the
    pipeline's family (the render's :attr:`vdbench.pipelines.Model.family`)."""
    spec = ctx.spec
    if spec.engine == "diffusers":
        # imported here: diffusers takes seconds to import, and one process never needs it
        from diffusers import ContextParallelConfig

        if spec.async_exchange is None:  # auto: where it applies; the record says what was settled
            spec = ctx.spec = replace(spec, async_exchange=spec.async_applies
                                      and family.ulysses_self_attention is not None)
        if spec.fp8_exchange:
            why = fp8_exchange_refusal(spec, ctx.device)
            if why:
                raise ValueError(f"--ulysses_fp8_exchange on: {why}\nuse --ulysses_fp8_exchange off")

        mesh = _cfg_mesh(ctx) if spec.use_cfg_parallel else None  # diffusers builds its own mesh otherwise
        for name, m in models if spec.sequence_degree > 1 else ():
            if not hasattr(m, "enable_parallelism") or getattr(m, "_cp_plan", None) is None:
                raise B.BackendUnavailable(f"{type(m).__name__} has no diffusers context-parallel plan "
                                           "(use --parallel_engine xfuser)")
            with one_device_presented(ctx.device):
                m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=spec.ulysses_degree,
                                                                  ring_degree=spec.ring_degree, mesh=mesh))
            # read by the patched dispatcher at each Ulysses call (vdbench.patching.ulysses)
            m._parallel_config.context_parallel_config.vdbench_head_chunks = spec.head_chunks
            m._parallel_config.context_parallel_config.vdbench_async = spec.async_exchange
            m._parallel_config.context_parallel_config.vdbench_fp8_exchange = spec.fp8_exchange
            m._parallel_config.context_parallel_config.vdbench_v_per_rank = spec.v_per_rank
        if spec.use_cfg_parallel or spec.guidance_overlap:
            split_guidance(ctx, pipe, models, family)
        warm_collectives(ctx, models)
        return pipe, models
    return _apply_xfuser(ctx, pipe, models, family)


# the message sizes a warm-up exchanges: a small one and one past NCCL's switch to its bulk protocol, so the
# connections both use are made
_WARM_ELEMENTS = (64, 1 << 21)


def warm_collectives(ctx: DistContext, models: list) -> None:
    """Connect every group the denoising will use, once, before the first step: NCCL connects a group's peers on
    the group's first collective of each kind (point-to-point channels for an all-to-all, rings for a gather),
    ~0.3 s on 2 GPUs and ~1.1 s on 4 (measured in Wan 1.3B's first step on 4x H200), which would otherwise land in
    the first denoising step as if it were the step's. The groups: diffusers' Ulysses and ring meshes of each
    model (all-to-all, all-gather), the guidance pair (all-gather), the ranks of one call (the caches' shared
    decision: all-reduce). Its time is ``ctx.collectives_warmup_s`` (part of the load's ``engine`` part, and of
    the merged timing's ``parallel``). Only on CUDA (gloo connects at group creation)."""
    if ctx.device.type != "cuda":
        return
    t0 = time.perf_counter()
    groups = []
    for _, m in models:
        cp = getattr(getattr(m, "_parallel_config", None), "context_parallel_config", None)
        for attr in ("_ulysses_mesh", "_ring_mesh"):
            mesh = getattr(cp, attr, None)
            if mesh is not None and mesh.size() > 1:
                groups.append(("sequence", mesh.get_group()))
    if ctx.cfg_group is not None:
        groups.append(("guidance", ctx.cfg_group))
    groups.append(("call", shard_group(ctx)))
    seen = set()
    for kind, group in groups:
        if id(group) in seen:
            continue
        seen.add(id(group))
        n = dist.get_world_size(group)
        for count in _WARM_ELEMENTS:
            x = torch.ones(n * count, device=ctx.device, dtype=torch.bfloat16)
            if kind == "sequence":
                dist.all_to_all_single(torch.empty_like(x), x, group=group)
            if kind in ("sequence", "guidance"):
                dist.all_gather_into_tensor(torch.empty(n * x.numel(), device=ctx.device, dtype=x.dtype), x,
                                            group=group)
            if kind == "call":
                dist.all_reduce(x[:count].float(), group=group)
    torch.cuda.synchronize(ctx.device)
    ctx.collectives_warmup_s = time.perf_counter() - t0


def _cfg_mesh(ctx: DistContext):
    """The device mesh of a CFG-parallel run, ``(cfg, ring, ulysses)``: the guidance branch outermost, so the ranks
    of one sequence-parallel group (the all-to-all's heavy traffic) are neighbours and each guidance pair spans the
    two halves of the world. diffusers' context parallelism takes its ring and Ulysses dimensions from the same mesh.
    Sets ``ctx.cfg_group``, ``ctx.cfg_index`` and ``ctx.shard_group``."""
    spec = ctx.spec
    mesh = init_device_mesh(ctx.device.type, (2, spec.ring_degree, spec.ulysses_degree),
                            mesh_dim_names=("cfg", "ring", "ulysses"))
    ctx.cfg_group, ctx.cfg_index = mesh.get_group("cfg"), mesh.get_local_rank("cfg")
    if spec.sequence_degree > 1:
        ctx.shard_group = mesh["ring", "ulysses"]._flatten().get_group()
    return mesh


def _apply_xfuser(ctx: DistContext, pipe, models: list, family: families.Family) -> tuple:
    """xDiT's own integration of each pipeline, in xfuser's order: world group, engine config, its wrappers, then
    the runtime state (which builds the Ulysses / ring / CFG groups from the engine config). Which wrapper applies
    is the family's (:attr:`vdbench.families.Family.xfuser`, a :class:`~vdbench.families.XfuserWiring` per
    pipeline class):

    * a transformer wrapper (Wan: ``xFuserWanTransformer3DWrapper``, USP processors) takes the loaded
      transformers' tensors; the pipeline stays diffusers' (what xfuser's runner does for T2V), or becomes the
      family's CFG pipeline with CFG parallel (Wan I2V: ``xFuserWanImageToVideoPipeline``, its rank split of the
      guidance branches).
    * a pipeline wrapper (CogVideoX: ``xFuserCogVideoXPipeline``: sequence split of the latents, CFG split, its
      transformer wrapper with USP processors) wraps the whole loaded pipeline.
    """
    # xfuser imported here: it can only be imported where it runs (a CUDA device), and it is optional
    from xfuser.core.distributed import init_distributed_environment, initialize_runtime_state

    spec = ctx.spec
    kind = type(pipe).__name__
    if kind not in family.xfuser:
        raise B.BackendUnavailable(unwired(kind))
    wiring = family.xfuser[kind]
    init_distributed_environment(rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank)
    engine_config = _xfuser_engine_config(ctx, pipe)
    if wiring.pipeline_wrapper is not None:
        # a wrapper around the loaded pipeline (attributes read through to it); it builds the runtime state itself
        wrapped = _xfuser_class(wiring.pipeline_wrapper)(pipe, engine_config)
        return wrapped, [(name, getattr(wrapped, name)) for name, _ in models]

    transformer_wrapper = _xfuser_class(wiring.transformer_wrapper)
    accepted = set(inspect.signature(transformer_wrapper.__init__).parameters)
    new = []
    for name, m in models:
        cfg = {k: v for k, v in dict(m.config).items() if k in accepted}
        # xfuser's wrapper is built the way xfuser builds it (its processors, its head_perm buffers), then takes
        # the loaded model's own parameter and buffer tensors (assign: no copy, same dtypes, same values).
        previous = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.bfloat16 if ctx.device.type == "cuda" else previous)
            with torch.device(ctx.device):
                w = transformer_wrapper(**cfg)
        finally:
            torch.set_default_dtype(previous)
        w.load_state_dict(m.state_dict(), assign=True, strict=True)
        own = dict(w.named_buffers())
        for bname, buf in m.named_buffers():  # non-persistent buffers (RoPE tables) aren't in the state dict
            mod_name, _, leaf = bname.rpartition(".")
            if bname in own:
                w.get_submodule(mod_name)._buffers[leaf] = buf
        w.eval()
        setattr(pipe, name, w)
        new.append((name, w))
        del m
    if spec.use_cfg_parallel and wiring.cfg_pipeline is not None:  # xfuser's own split (Wan I2V)
        pipe = rebuild_pipeline_as(_xfuser_class(wiring.cfg_pipeline), pipe)  # a direct subclass: its __call__
        pipe.engine_config = engine_config
    initialize_runtime_state(pipe, engine_config)
    if spec.use_cfg_parallel and wiring.cfg_pipeline is None:  # xfuser runs this pipeline as diffusers' own
        from xfuser.core.distributed import get_cfg_group, get_classifier_free_guidance_rank, get_sp_group

        ctx.cfg_group, ctx.cfg_index = get_cfg_group().device_group, get_classifier_free_guidance_rank()
        ctx.shard_group = get_sp_group().device_group if spec.sequence_degree > 1 else None
        split_guidance(ctx, pipe, new, family)
    return pipe, new


def _xfuser_class(path: str):
    """xfuser's class at ``"module:Class"`` (imported here: xfuser only imports where it can run)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def rebuild_pipeline_as(cls, pipe):
    """``cls`` (a pipeline class with the same constructor, e.g. xfuser's subclass) built from ``pipe``'s own
    modules and its config-only values (``pipe.components`` alone drops e.g. Wan 2.2's ``boundary_ratio``), with
    ``pipe``'s progress-bar settings."""
    kwargs = {}
    comps = pipe.components
    for name in list(inspect.signature(cls.__init__).parameters)[1:]:
        if name in comps:
            kwargs[name] = comps[name]
        elif name in pipe.config:
            kwargs[name] = pipe.config[name]
    new = cls(**kwargs)
    if hasattr(pipe, "_progress_bar_config"):
        new._progress_bar_config = dict(pipe._progress_bar_config)
    return new


def _xfuser_engine_config(ctx: DistContext, pipe):
    from xfuser import xFuserArgs  # optional, and importable only where it runs

    spec = ctx.spec
    args = xFuserArgs(model="vdbench", ulysses_degree=spec.ulysses_degree, ring_degree=spec.ring_degree,
                      use_cfg_parallel=spec.use_cfg_parallel)
    engine_config, _ = args.create_config()
    return engine_config
