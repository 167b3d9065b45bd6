"""Where the weights wait when one GPU can't hold them all: the offload modes, a stack option (``offload=<mode>``).

:data:`MODES` (``--offload``):

* ``model`` -- diffusers' ``enable_model_cpu_offload``: each component on the GPU while it runs (the text encoder,
  each denoiser, the VAE), moved whole and synchronously when the next one starts. A checkpoint is read on the host;
  a random-weight build's denoisers are drawn on the device a block at a time into host buffers
  (:func:`load_placement`), so the card never holds both experts, and the frames are the resident render's.
* ``group`` -- diffusers' ``enable_group_offload`` (block level, a CUDA stream onloading the next block while the
  current one runs, pinned host copies) on every component but the VAE: the GPU holds a few blocks of a denoiser.
  The denoisers are loaded on the host, each into one pinned flat buffer (:mod:`vdbench.hostmem`) that diffusers
  takes as its pinned copy: one host copy of the weights, never a whole denoiser on the GPU (diffusers' own
  pinning of weights loaded on the host would hold a second copy of each: twice A14B's 57 GB).
* ``expert`` -- for a pipeline of two experts (Wan 2.2 A14B): the expert that is not denoising waits on the host
  (pinned, one flat buffer an expert: :mod:`vdbench.hostmem`). In the last step of one expert (and in the call's
  last step, for the next call's first), each of its blocks, once it has run its last call of the step, is swapped
  for the other expert's block: its GPU memory freed, the other's weights sent on a side stream into it. The GPU
  holds one expert and a block in flight; the copies travel behind the step's remaining blocks, and the other
  expert's first call waits for the last one (on the device, never the host). The weights are the same bytes: the
  frames are the resident render's, bit for bit.
* ``shard`` -- under torchrun: each denoiser's weights sharded over the ranks by PyTorch's FSDP2
  (``torch.distributed.fsdp.fully_shard`` on every block and on the denoiser itself, ``reshard_after_forward``):
  a rank holds about 1/N of each denoiser and all-gathers a block's weights just before the block runs, freeing
  them after it (:func:`shard_weights`, applied after the parallel engine). The denoisers are loaded on the host;
  the sharding moves each rank's part to its device a block at a time, so no card ever holds a whole expert. The
  gathered weights are the loaded bytes: the frames are the unsharded layout's, bit for bit.

Each mode refuses with its reason where it can't apply (no CUDA device, no second expert, a parallel layout or a
compile for ``expert``; one process, a compile, fp8 GEMMs or a step cache under a CFG split for ``shard``), and
:func:`apply_offload` returns what it did for the render's record. On a CPU the expert
swap runs with its host copies standing in for the device's (it saves nothing there): what the tests render.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from .hostmem import (HOST_BUFFER, HostBuffer, block_list, check_room, cores, held, layout, move_into, nbytes,
                      weights)

__all__ = ["MODES", "EXECUTION_DEVICE", "OffloadError", "check_offload", "apply_offload", "expert_swap", "ExpertSwap",
           "HOST_COMPONENTS", "load_placement", "host_buffers", "shard_weights"]

#: ``--offload``'s modes (``none``: every weight resident).
MODES = ("none", "model", "group", "expert", "shard")

#: The components a mode keeps on the host from the load on (built or loaded there, never on the GPU whole).
HOST_COMPONENTS = {"expert": ("transformer_2",), "group": ("transformer", "transformer_2"),
                   "shard": ("transformer", "transformer_2"), "model": ("transformer", "transformer_2")}


def load_placement(mode: str, *, built: bool) -> tuple[bool, tuple]:
    """(whether the whole load stays on the host, the components it keeps there otherwise) for ``mode``; ``built``:
    a random-weight build (drawn on the device) rather than a checkpoint read.

    ``model``: a checkpoint is read on the host and stays there (diffusers' model offload places each component when
    it runs); a random-weight build draws its weights on the device -- the host's generator would draw other weights
    (the frames would not be the resident render's), and slowly -- its denoisers a block at a time into host buffers
    (:data:`HOST_COMPONENTS`), the rest moved out by the offload."""
    if mode == "model" and not built:
        return True, ()
    return False, HOST_COMPONENTS.get(mode, ())


class OffloadError(ValueError):
    """An offload mode that can't apply to this render (its reason on the first line, what to do on the next)."""


def check_offload(mode: str, *, device: torch.device, two_experts: Optional[bool], parallel: bool = False,
                  compiled: bool = False, fp8_gemms: bool = False, cache: bool = False,
                  cfg_split: bool = False) -> None:
    """Refuse before the load what an offload mode can't do here; ``two_experts``: whether the model has a second
    expert (None: not known before the load; :func:`apply_offload` checks the loaded pipeline); ``parallel``: a
    torchrun render; ``cache``: a step cache asked; ``cfg_split``: ``--use_cfg_parallel``."""
    if mode not in MODES:
        raise OffloadError(f"unknown --offload {mode!r}; valid: {', '.join(MODES)}")
    if mode == "none":
        return
    if mode == "shard":
        _check_shard(parallel=parallel, compiled=compiled, fp8_gemms=fp8_gemms, cache=cache, cfg_split=cfg_split)
        return
    if device.type != "cuda" and mode != "expert":  # the expert swap runs on a CPU too: what its tests render
        raise OffloadError(f"--offload {mode} moves weights between the host and a GPU: it needs a CUDA device")
    if mode == "expert":
        if two_experts is False:
            raise OffloadError("--offload expert keeps the idle one of two experts on the host; this model has one "
                               "denoiser\nuse --offload group or model")
        if parallel:
            raise OffloadError("--offload expert runs on one process: under torchrun each rank's blocks are hooked "
                               "by the parallel engine\nuse --offload group, or a layout whose cards hold both experts")
        if compiled:
            raise OffloadError("--offload expert swaps the blocks' weights between calls, which a compiled graph "
                               "would have to guard on\ndrop the compile, or use --offload model")


def _check_shard(*, parallel: bool, compiled: bool, fp8_gemms: bool, cache: bool, cfg_split: bool) -> None:
    if not parallel:
        raise OffloadError("--offload shard splits each denoiser's weights over the ranks of a torchrun render; one "
                           "process has no other rank\nlaunch under torchrun with a parallel layout (--ulysses_degree "
                           "2, --use_cfg_parallel, ...)")
    if compiled:
        raise OffloadError("--offload shard gathers each block's weights in hooks around its forward, which the "
                           "compiled blocks are not measured with\ndrop the compile")
    if fp8_gemms:
        raise OffloadError("--offload shard splits plain weight tensors; the fp8 GEMMs' quantized weights are "
                           "torchao tensor subclasses FSDP would have to shard\ndrop --use_fp8_gemms")
    if cache and cfg_split:
        raise OffloadError("--offload shard gathers each block over every rank, and under --use_cfg_parallel each "
                           "guidance half decides its step cache alone: a call one half skips would leave the "
                           "other's gathers waiting\ndrop --cache or --use_cfg_parallel")


def apply_offload(mode: str, pipe, device: torch.device) -> Optional[dict]:
    """Apply ``mode`` to the loaded ``pipe`` (its denoisers' weights where :data:`HOST_COMPONENTS` left them);
    returns the record's section (None for ``none``, and for ``shard``, which :func:`shard_weights` applies and
    records after the parallel engine)."""
    if mode == "none":
        return None
    for name in ("transformer", "transformer_2"):
        if getattr(pipe, name, None) is not None:
            setattr(getattr(pipe, name), EXECUTION_DEVICE, torch.device(device))
    if mode == "shard":
        return None
    if mode == "model":
        # diffusers moves a component back to the host into new memory once the next one runs: a load's buffer kept
        # here would be a second host copy of each denoiser (its weights' views keep it until they move to the GPU)
        released = [name for name in HOST_COMPONENTS["model"]
                    if getattr(pipe, name, None) is not None and HOST_BUFFER in vars(getattr(pipe, name))]
        for name in released:
            delattr(getattr(pipe, name), HOST_BUFFER)
        pipe.enable_model_cpu_offload(device=device)
        return {"mode": mode, "how": "diffusers enable_model_cpu_offload", "load_buffers_released": released}
    if mode == "group":
        pinned = host_buffers(pipe, pinned=torch.device(device).type == "cuda")
        pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                                  exclude_modules=["vae"])
        return {"mode": mode, "how": "diffusers enable_group_offload (block level, 1 block a group, a CUDA stream; "
                                     "the VAE resident)", "host_buffers": pinned}
    if getattr(pipe, "transformer_2", None) is None:
        check_offload(mode, device=device, two_experts=False)
    swap = ExpertSwap(pipe, device)
    setattr(pipe, _SWAP_ATTR, swap)
    return {"mode": mode, "how": "the idle expert pinned on the host, swapped block by block in its neighbour's "
                                 "last step on a side stream", "host_bytes": swap.host_bytes}


def host_buffers(pipe, *, pinned: bool) -> dict:
    """Each denoiser of ``pipe`` (:data:`HOST_COMPONENTS`' ``group``) with its weights in one flat host buffer:
    the load's where it made one (a random-weight build), else made here from the weights on the host (a
    ``from_pretrained`` load), pinned where ``pinned``. diffusers' group offload then takes those views as its pinned
    copies (``pin_memory()`` of a pinned tensor is the tensor) instead of pinning a second copy of every weight.
    Returns, per denoiser, where its buffer was made, its bytes and its parts' seconds."""
    out = {}
    for name in HOST_COMPONENTS["group"]:
        model = getattr(pipe, name, None)
        if model is None:
            continue
        buffer, made = held(model), "load"
        if buffer is None:
            on = {t.device.type for t in weights(model)}
            if on != {"cpu"}:
                raise OffloadError(f"--offload group takes {name}'s weights from the host; they are on "
                                   f"{', '.join(sorted(on))}\nload the pipeline without moving it to the GPU")
            size = layout(weights(model))[1]  # a second copy of the denoiser until its weights move into it
            check_room({name: size}, "--offload group", "use a host with more memory, or --offload model")
            buffer, made = HostBuffer(size, pinned=pinned), "offload"
            move_into(model, buffer)
        out[name] = {"made": made, **buffer.parts}
    return out


def shard_weights(models: list, device: torch.device) -> dict:
    """``--offload shard``: every denoiser of ``models`` (``(name, module)`` pairs, the parallel engine applied)
    sharded by FSDP2 over the whole world, each block a unit and the denoiser itself the unit of what is left
    (embeddings, the output head), each gathered before its forward and freed after it; returns the record's section.

    The mesh is the world, not the ranks of one call: under a CFG split both guidance halves hold the same weights,
    and FSDP's gathers pair the ranks' calls of a block in order, which are the same on every rank -- each rank runs
    the same steps, the same expert each step (the schedule is the pipeline's, not the rank's), one denoiser call a
    step (its guidance branch, or its sequence shard of the call) and every block of it once a call (a step cache
    skips in step with the other ranks of its call; under a CFG split :func:`check_offload` refuses it). A world
    mesh leaves each rank 1/N of the weights where sharding within each guidance half would leave 2/N."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    out = {"mode": "shard", "how": "torch FSDP2 fully_shard on each block and the denoiser, reshard after forward, "
                                   "the world as its mesh", "mesh_ranks": world, "denoisers": {}}
    for name, model in models:
        blocks = _blocks(model)
        if not blocks:
            raise OffloadError(f"--offload shard makes each of a denoiser's blocks a unit; {name} "
                               f"({type(model).__name__}) has no list of blocks\nrender without --offload shard")
        before = _local_bytes(model)
        # no parameter trains: FSDP then takes a unit's mixed dtypes (Wan keeps its norms and modulation tables in
        # fp32 beside the bf16 weights) as they are, gathered as bytes, where a trainable unit must hold one dtype
        model.requires_grad_(False)
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        buffer = getattr(model, HOST_BUFFER, None)
        if buffer is not None and device.type == "cuda":  # the load's host copy, the weights now on the device
            buffer.close()
            delattr(model, HOST_BUFFER)
        after: list = [None] * world  # each rank's share: a dimension N does not divide leaves the last ones less
        dist.all_gather_object(after, _local_bytes(model))
        out["denoisers"][name] = {"units": len(blocks) + 1, "bytes_per_rank_before": before,
                                  "bytes_per_rank_after": after,
                                  "buffer_bytes": sum(nbytes(b) for b in model.buffers())}
    return out


def _local_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's weights this rank holds (a sharded parameter: its local shard; buffers, which FSDP
    leaves whole on every rank, counted whole: ``buffer_bytes`` in the record)."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in weights(module)]
    return sum(nbytes(t) for t in local)


#: The attribute an offloaded denoiser carries: the device it runs on while its weights wait on the host (what an
#: attention backend's availability is checked against: :func:`vdbench.patching.targets.target_of`).
EXECUTION_DEVICE = "vdbench_execution_device"

#: The attribute of a pipeline that holds its :class:`ExpertSwap`.
_SWAP_ATTR = "vdbench_expert_swap"


def expert_swap(pipe) -> Optional["ExpertSwap"]:
    """The :class:`ExpertSwap` :func:`apply_offload` installed on ``pipe``, or None."""
    return getattr(pipe, _SWAP_ATTR, None)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return block_list(model)[1]


class _Unit:
    """One swappable part of an expert: a block, or what is left outside its blocks (embeddings, output head)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors


class ExpertSwap:
    """The two experts of ``pipe`` sharing one expert's GPU memory (see the module's doc).

    Each expert is a list of units (its blocks, then the rest) with a host copy of every weight, a view of the
    expert's flat host buffer (pinned on a GPU machine: :class:`vdbench.hostmem.HostBuffer`). A unit is *on* the GPU
    (its tensors' data on the device) or *off* (their data the host copy). The pipeline's schedule decides which
    expert a step uses (``boundary_ratio`` x the scheduler's training steps against the step's timestep); a step
    whose next step (or the next call's first) uses the other expert is a swap step: there each block of the
    outgoing expert is swapped with the incoming one's after its last call of the step (the number of expert's calls
    per step, counted in the first step either expert finished), the rest after the expert's last call, and whatever
    was not swapped so (a block a step cache skipped; an expert's first step being its last) before the incoming
    expert's first call. On a CPU (the tests) the host copies stand in for the device's and an offloaded tensor
    holds NaN, so a call reading a weight that was not brought back shows in the frames."""

    def __init__(self, pipe, device: torch.device):
        self.pipe, self.device = pipe, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.experts = [pipe.transformer, pipe.transformer_2]
        self.units = [[_Unit(weights(b)) for b in _blocks(m)] + [_Unit(self._rest(m))] for m in self.experts]
        self.host: dict = {}
        self.host_bytes = sum(nbytes(t) for units in self.units for u in units for t in u.tensors)
        # the buffers the load did not make, made by this swap on a thread: refused now rather than by the OOM killer
        check_room({name: layout([t for u in self.units[e] for t in u.tensors])[1]
                    for e, name in enumerate(("transformer", "transformer_2")) if held(self.experts[e]) is None},
                   "--offload expert", "use a host with more memory, or --offload none on a card that holds both "
                                       "experts")
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # the host copies, one flat buffer an expert (:mod:`vdbench.hostmem`): one the load filled (the idle expert,
        # built there) is taken as it is; the others are made and filled by a thread while the first steps run (none
        # is needed before the first swap), behind what the current stream has queued (the load's last kernels); on a
        # CPU, at once
        self.buffers: list = [None, None]
        self.made: list = [None, None]  # where each buffer was made: "load" or "render" (the thread)
        self.setup_s: Optional[float] = None  # the thread's time, off the render's path
        self.copy_wait_s = 0.0  # the swaps' time waiting for it
        self._error: Optional[BaseException] = None
        self.copied = threading.Event()
        after = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        self._copier = threading.Thread(target=self._copy_to_host, args=(after,), daemon=True,
                                        name="vdbench-expert-host-copy")
        if self.cuda:
            self._copier.start()
        else:
            self._copy_to_host(after)
        self.on = [[True] * len(self.units[0]), [False] * len(self.units[1])]
        self.done_event = None  # the side stream's last copy
        self.lock = threading.Lock()  # the guidance-overlap threads call the blocks from two host threads
        self.swaps = 0
        self.late = 0  # swaps left to the incoming expert's first call (not hidden behind a step)
        self.copy_waits = 0  # swaps that waited for the host copies
        self.waits = 0
        for e, model in enumerate(self.experts):
            model.register_forward_pre_hook(lambda mod, args, e=e: self._before_expert(e))
            model.register_forward_hook(lambda mod, args, out, e=e: self._after_expert(e))
            for j, block in enumerate(_blocks(model)):
                block.register_forward_pre_hook(lambda mod, args, e=e, j=j: self._count(e, j))
                block.register_forward_hook(lambda mod, args, out, e=e, j=j: self._after_block(e, j))
        self._step_key = None
        self._schedule: list[int] = []
        self._step = 0
        self.calls = [0, 0]  # the expert's calls in the current step
        self.per_step = [None, None]  # an expert's calls per step, once counted
        self.block_calls: dict = {}

    def _copy_to_host(self, after) -> None:
        """Each expert's host buffer (pinned on a GPU machine): taken from the load where it left one holding every
        weight of the expert, else made here and filled (from the GPU on a stream of its own, behind ``after``); the
        idle expert's weights then pointed at their copies (on a CPU: poisoned)."""
        start = time.perf_counter()
        try:
            for e, model in enumerate(self.experts):
                tensors = [t for u in self.units[e] for t in u.tensors]
                buffer = getattr(model, HOST_BUFFER, None)
                if buffer is not None and all(buffer.holds(t) for t in tensors):
                    views, self.made[e] = [t.data for t in tensors], "load"
                else:
                    # made on a thread of its own, the copies behind it chunk by chunk; half the cores fault its
                    # pages in: the render's own threads (the launches, a prewarm's compiles) keep theirs
                    buffer = HostBuffer(layout(tensors)[1], pinned=self.cuda, background=True,
                                        threads=max(1, cores() // 2))
                    self.made[e] = "render"
                    views = buffer.fill(tensors, self.device if self.cuda else None, after=after)
                self.buffers[e] = buffer
                self.host.update((id(t), v) for t, v in zip(tensors, views))
            for u in self.units[1]:
                self._off(u)
        except BaseException as exc:  # raised by the first swap, which needs the copies
            self._error = exc
        finally:
            self.setup_s = round(time.perf_counter() - start, 4)
            self.copied.set()

    @staticmethod
    def _rest(model: torch.nn.Module) -> list[torch.Tensor]:
        inside = {id(t) for b in _blocks(model) for t in weights(b)}
        return [t for t in weights(model) if id(t) not in inside]

    # -- the schedule ------------------------------------------------------------------------------------------------

    def _experts_by_step(self) -> list[int]:
        """Which expert each step of this call runs (diffusers' rule: the high-noise one while the timestep is at
        or above ``boundary_ratio`` x the training steps), from the scheduler's host-side sigmas where it keeps
        them, so that no step waits on the device for it (else one read of its timesteps a call). A wrong guess
        costs only time: an expert's first call brings in whatever of its weights is missing."""
        sch = self.pipe.scheduler
        n = sch.config.num_train_timesteps
        boundary = self.pipe.config.get("boundary_ratio")
        sigmas = getattr(sch, "sigmas", None)
        if isinstance(sigmas, torch.Tensor) and sigmas.device.type == "cpu" and len(sigmas) == len(sch.timesteps) + 1:
            steps = (sigmas[:-1].double() * n).tolist()
        else:
            steps = sch.timesteps.tolist()
        return [0 if boundary is None or t >= boundary * n else 1 for t in steps]

    def _swap_step(self) -> Optional[int]:
        """The expert this step hands over to (the next step's, or for the call's last step the first step's), or
        None where the next step keeps this one's."""
        by_step, i = self._schedule, self._step
        nxt = by_step[i + 1] if i + 1 < len(by_step) else by_step[0]
        return nxt if nxt != by_step[i] else None

    # -- the hooks ---------------------------------------------------------------------------------------------------

    def _before_expert(self, e: int) -> None:
        with self.lock:
            sch = self.pipe.scheduler
            key = (id(sch.timesteps), sch.step_index or 0)  # the call (its timesteps) and the step
            if key != self._step_key:  # a new step
                if self._step_key is not None:
                    for k in (0, 1):
                        if self.calls[k] and self.per_step[k] is None:
                            self.per_step[k] = self.calls[k]
                if self._step_key is None or key[0] != self._step_key[0]:
                    self._schedule = self._experts_by_step()  # a new call: its schedule, once
                self._step_key, self._step, self.calls, self.block_calls = key, key[1], [0, 0], {}
            self.calls[e] += 1
            for j, u in enumerate(self.units[e]):  # whatever the other expert's last step left: swapped now
                if not self.on[e][j]:
                    self._swap(1 - e, j)
                    self.late += 1
        if self.cuda and self.done_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done_event)
            self.waits += 1

    def _per_step(self, e: int) -> Optional[int]:
        """An expert's calls per step: counted in its first step, else the other's (both take the pipeline's
        guidance branches), None before either has finished a step."""
        return self.per_step[e] if self.per_step[e] is not None else self.per_step[1 - e]

    def _after_expert(self, e: int) -> None:
        with self.lock:
            n = self._per_step(e)
            if n is not None and self.calls[e] == n and self._swap_step() == 1 - e:
                self._swap(e, len(self.units[e]) - 1)  # the rest, after the expert's last call of its last step

    def _count(self, e: int, j: int) -> None:
        with self.lock:
            self.block_calls[e, j] = self.block_calls.get((e, j), 0) + 1

    def _after_block(self, e: int, j: int) -> None:
        with self.lock:
            n = self._per_step(e)
            if n is None or self.block_calls.get((e, j)) != n or self._swap_step() != 1 - e:
                return
            self._swap(e, j)  # this block's last call of the expert's last step

    # -- moving weights ----------------------------------------------------------------------------------------------

    def _off(self, unit: _Unit) -> None:
        for t in unit.tensors:
            host = self.host[id(t)]
            t.data = host if self.cuda else torch.full_like(host, float("nan")) if host.is_floating_point() else host

    def _swap(self, e: int, j: int) -> None:
        """Unit ``j`` of expert ``e`` off the GPU, the other expert's unit ``j`` onto it."""
        out, into = self.units[e][j], self.units[1 - e][j]
        if not self.on[e][j]:
            return
        if not self.copied.is_set():  # the host copies still on their way (a render whose first switch came early)
            start = time.perf_counter()
            self.copied.wait()
            self.copy_wait_s += time.perf_counter() - start
            self.copy_waits += 1
        if self._error is not None:
            raise RuntimeError(f"the expert swap's host copies failed: {self._error}") from self._error
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            ready = main.record_event()  # after the outgoing unit's queued kernels
            self._off(out)  # its memory back to the main stream's pool, reusable in the main stream's order
            fresh = [torch.empty_like(self.host[id(t)], device=self.device) for t in into.tensors]
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                for dst, t in zip(fresh, into.tensors):
                    dst.copy_(self.host[id(t)], non_blocking=True)
            self.done_event = self.stream.record_event()
            for dst, t in zip(fresh, into.tensors):
                t.data = dst
        else:
            self._off(out)
            for t in into.tensors:
                t.data = self.host[id(t)].clone()
        self.on[e][j], self.on[1 - e][j] = False, True
        self.swaps += 1

    def as_dict(self) -> dict:
        """What the swap did (the render's record): units swapped, the incoming expert's waits on the copies, each
        expert's host buffer (its bytes, where it was made, its parts' seconds: allocate and fault in, pin, copy)."""
        names = ("transformer", "transformer_2")
        return {"units_swapped": self.swaps, "swapped_late": self.late, "expert_waits": self.waits,
                "calls_per_step": self.per_step, "host_copies_s": self.setup_s,
                "waited_for_host_copies": self.copy_waits, "waited_for_host_copies_s": round(self.copy_wait_s, 4),
                "host_bytes": self.host_bytes,
                "host_buffers": [{"expert": n, "made": m, **b.parts} for n, m, b in zip(names, self.made, self.buffers)
                                 if b is not None]}

    def close(self) -> None:
        """Unpin the host buffers, once the copies from them are done (the weights stay valid, pageable)."""
        self.copied.wait()
        if self.stream is not None:
            self.stream.synchronize()
        for b in self.buffers:
            if b is not None:
                b.close()
