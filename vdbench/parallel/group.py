"""The process group of a multi-process render and what its ranks do together: the context a render runs in
(:class:`DistContext` under torchrun, :class:`OneProcess` for one process, with the same interface), joining the
group torchrun describes (:func:`init_distributed`), the ranks agreeing on a check (:func:`agree`), the ranks that
share a call (:func:`shares_calls`, :func:`shard_group`), the output shared (:func:`share_output`) and the ranks'
timing entries merged (:func:`merge_rank_entries`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
import torch.distributed as dist

from .. import backends as B
from ..power import all_ranks
from ..timing import STEP_KEYS, gpu_uuid, step_stats
from .spec import ParallelSpec, resolve_engine

__all__ = ["DistContext", "OneProcess", "init_distributed", "agree", "shares_calls", "shard_group", "share_output",
           "merge_rank_entries"]


@dataclass
class DistContext:
    """A rank of a torchrun render: its layout (``spec``, settled for the request by the render's validate), its
    place in the world, its device and process group, and what the engine set up in it."""

    distributed: ClassVar[bool] = True
    spec: ParallelSpec
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    pg_backend: str
    # whether init_distributed created the process group (and the run's end destroys it); a group the caller
    # made before (a bench timing several renders in one group, a library user) is left to the caller
    owns_group: bool = True
    # set by apply_engine under --use_cfg_parallel: the pair of ranks that split one step's guidance (a process
    # group), this rank's branch in it (0: the conditional pass, 1: the unconditional one), and the ranks that hold
    # shards of one transformer call (None: the whole world)
    cfg_group: object = None
    cfg_index: int = 0
    shard_group: object = None
    # seconds apply_engine spent connecting the groups' peers before the first step (warm_collectives)
    collectives_warmup_s: Optional[float] = None
    # the GuidanceSplit hook split_guidance installed (None: none, or the engine's own split)
    guidance: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class OneProcess:
    """A render in one process, with :class:`DistContext`'s interface: a world of one on ``device``, with the layout
    asked (``spec``: every degree 1); the functions here and the engine's find nothing to agree on, share or merge."""

    distributed: ClassVar[bool] = False
    world_size: ClassVar[int] = 1
    is_main: ClassVar[bool] = True
    device: torch.device
    spec: ParallelSpec = field(default_factory=ParallelSpec)
    rank: int = 0  # the rank the caller gives (RANK of a single-process torchrun): named in captures and traces


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return default if v in (None, "") else int(v)


def init_distributed(spec: ParallelSpec, device_arg: str = "auto") -> Optional[DistContext]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Returns None for a single-process run with no parallel degree asked. Raises ValueError when the degrees
    don't match the number of processes, before any model is loaded.
    """
    spec.validate()
    world = _env_int("WORLD_SIZE", 1)
    if world == 1 and spec.world_size == 1:
        return None
    if spec.world_size != world:
        raise ValueError(f"--ulysses_degree {spec.ulysses_degree} x --ring_degree {spec.ring_degree}"
                         f"{' x 2 (cfg)' if spec.use_cfg_parallel else ''} = {spec.world_size} processes, but "
                         f"WORLD_SIZE is {world}: launch with torchrun --nproc_per_node={spec.world_size}")
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    want_cuda = device_arg in (None, "auto") and torch.cuda.is_available() or str(device_arg).startswith("cuda")
    if want_cuda:
        if not torch.cuda.is_available():
            raise B.BackendUnavailable(f"rank {rank}: --device {device_arg} asked for, but CUDA is not available")
        if local_rank >= torch.cuda.device_count():
            raise B.BackendUnavailable(f"rank {rank}: LOCAL_RANK {local_rank} but only "
                                       f"{torch.cuda.device_count()} CUDA device(s) visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        pg = "nccl"
    else:
        device, pg = torch.device("cpu"), "gloo"
    spec = resolve_engine(spec, device)
    if spec.engine == "xfuser" and device.type != "cuda":
        raise B.BackendUnavailable(
            "--parallel_engine xfuser needs a CUDA GPU; on a CPU use --parallel_engine diffusers (or auto)"
            "\nwhy: xfuser 0.7.0 can't be imported without an accelerator "
            "(xfuser/core/distributed/__init__.py calls envs.get_device_version(), which raises "
            "NotImplementedError), xfuser.envs.get_torch_distributed_backend() raises "
            "NotImplementedError without a CUDA/HIP/MUSA/MPS/NPU device, and xfuser.model_executor.layers.usp "
            "binds yunchang's PROCESS_GROUP (the Ulysses and ring groups) only when torch.cuda.is_available()")
    if spec.engine == "xfuser":
        try:
            import xfuser.core.distributed  # noqa: F401  (fail here, before any model load, if it can't)
            import xfuser.model_executor.models.transformers.transformer_wan  # noqa: F401
        except Exception as e:
            raise B.BackendUnavailable(f"--parallel_engine xfuser: can't import xfuser ({type(e).__name__}: {e}); "
                                       "install xfuser, yunchang, distvae and einops (pip install '.[dist]')") from e
    owns = not dist.is_initialized()
    if owns:
        timeout = datetime.timedelta(seconds=float(os.environ.get("VDBENCH_DIST_TIMEOUT_S", 600)))
        # no device_id: xfuser notes that NCCL's device-side rendezvous it triggers breaks its new_group() calls;
        # the device is bound by set_device above
        dist.init_process_group(pg, rank=rank, world_size=world, timeout=timeout)
    return DistContext(spec, rank, world, local_rank, device, pg, owns_group=owns)


def agree(ctx: DistContext | OneProcess, error: Optional[BaseException]) -> None:
    """Every rank reports its check; if any failed, every rank raises with the failing ranks' messages (one process
    raises its own)."""
    if not ctx.distributed:
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    bad = [(r, m) for r, m in enumerate(gathered) if m is not None]
    if bad:
        err = error if error is not None else B.BackendUnavailable(
            "; ".join(f"rank {r}: {m}" for r, m in bad))
        err._vd_agreed = True  # every rank raises this one together: no peer-failure flag needed
        raise err


def shares_calls(ctx: DistContext | OneProcess, guidance_in_one_batch: bool) -> bool:
    """Whether this rank's transformer calls are shards of calls other ranks hold too (what a single process
    computes as one call): under sequence parallelism, and under a CFG split of a family whose guidance is one
    batch (CogVideoX: each rank holds half of it). A CFG split of two calls (Wan) gives each rank whole calls."""
    spec = ctx.spec
    return spec.sequence_degree > 1 or (spec.use_cfg_parallel and guidance_in_one_batch)


def shard_group(ctx: DistContext):
    """The process group whose ranks hold shards of the same transformer call (:func:`shares_calls`): what a
    decision taken on one rank's shard (a step cache's skip) is reduced over, so that every rank of the call decides
    alike. The sequence-parallel subgroup where a CFG split of two calls set one (``ctx.shard_group``), else the
    default group (None: every rank -- the CFG split of one batch shares each call over the whole world). Read
    when the reduction runs: diffusers' CFG mesh is built with the engine, after the cache's hooks are on."""
    return ctx.shard_group


def share_output(ctx: DistContext | OneProcess, latents):
    """Give every rank the pipeline's output latents.

    xfuser's CogVideoX pipeline returns them on its last data-parallel group only (the last sequence-parallel
    and last CFG rank); the others get ``[None]``. Rank 0 writes the video, so the latents go from a rank that has
    them to all (a broadcast on the ranks' devices). Outputs already on every rank (one process's) are returned as
    they are.
    """
    if not ctx.distributed:
        return latents
    have = isinstance(latents, torch.Tensor)
    info = (have, tuple(latents.shape), str(latents.dtype).replace("torch.", "")) if have else (False, None, None)
    flags: list = [None] * ctx.world_size
    dist.all_gather_object(flags, info)
    if all(f[0] for f in flags):
        return latents
    holders = [r for r, f in enumerate(flags) if f[0]]
    if not holders:
        raise RuntimeError("the pipeline returned no latents on any rank")
    src = holders[-1]
    if not have:
        latents = torch.empty(flags[src][1], dtype=getattr(torch, flags[src][2]), device=ctx.device)
    latents = latents.contiguous()
    dist.broadcast(latents, src)
    return latents


def merge_rank_entries(ctx: DistContext | OneProcess, entries: list[dict]) -> Optional[list[dict]]:
    """Gather every rank's timing entries; rank 0 gets rank 0's entries with ``ranks`` (per-rank figures) and
    ``parallel`` added and the call counts summed over ranks; other ranks get None (they write nothing). One
    process's entries are returned as they are."""
    if not ctx.distributed:
        return entries
    slim = [{k: e.get(k) for k in ("repetition", "step_times", *STEP_KEYS, "pipe_time", "vae_decode_time",
                                   "attention", "peak_memory_bytes", "peak_reserved_bytes", "memory", "total_time",
                                   "host", "power")}
            for e in entries]
    for sl, e in zip(slim, entries):  # a step cache's count per rank: the ranks must have decided alike
        sl["cache"] = {k: (e.get("cache") or {}).get(k) for k in _CACHE_COUNTS} if e.get("cache") else None
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"rank": ctx.rank, "device": str(ctx.device), "gpu_uuid": gpu_uuid(ctx.device),
                                      "entries": slim, "branch": ctx.cfg_index})
    if not ctx.is_main:
        return None
    merged = []
    for i, e in enumerate(entries):
        per_rank = [{"rank": g["rank"], "device": g["device"], "gpu_uuid": g["gpu_uuid"], **g["entries"][i]}
                    for g in gathered]
        total: dict = {}
        for pr in per_rank:
            for k, n in pr["attention"]["calls_by_kernel"].items():
                total[k] = total.get(k, 0) + n
        e = dict(e)
        e["parallel"] = {**ctx.spec.as_dict(), "pg_backend": ctx.pg_backend,
                         "collectives_warmup_s": ctx.collectives_warmup_s}
        if ctx.spec.guidance_overlap and ctx.guidance is not None:  # rank 0's, since the process started
            e["parallel"]["guidance_overlap_handovers"] = ctx.guidance.handovers
        e["ranks"] = per_rank
        e["attention_all_ranks"] = {"calls_by_kernel": total, "total_calls": sum(total.values())}
        e["power_all_ranks"] = all_ranks([pr.get("power") for pr in per_rank])  # the layout's joules per step
        if e.get("cache"):  # alike within each guidance branch (a CFG split's ranks count their branch's calls)
            branch = {}
            for g, pr in zip(gathered, per_rank):
                branch.setdefault(g["branch"], []).append(pr["cache"])
            e["cache"] = {**e["cache"], "ranks_agree": all(c == cs[0] for cs in branch.values() for c in cs)}
        # the step is done when the slowest rank is done
        e["step_times"] = [max(pr["step_times"][j] for pr in per_rank) for j in range(len(e["step_times"]))]
        run = e.get("run") or {}
        e.update(step_stats(e["step_times"], (run.get("resolved") or {}).get("device"),
                            bool((run.get("backend") or {}).get("emulated"))))
        merged.append(e)
    return merged


_CACHE_COUNTS = ("computed_blocks_per_step", "reused_blocks_per_step", "forwards_per_step")
