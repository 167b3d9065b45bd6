"""Multi-process rendering under ``torchrun``: process group, engine, per-path backend checks, rank handling.

    torchrun --nproc_per_node=2 run_wan.py --ulysses_degree 2 --parallel_engine diffusers ...

Two engines, both the projects' own sequence-parallel code (nothing here re-implements it); ``auto`` (the
default) picks the model family's preferred engine (``Family.preferred_engine``: the one measured faster for it;
diffusers for Wan) where it runs and serves the request, else the other (:func:`resolve_engine`; timing.json records
the request, the engine that ran and why):

* ``xfuser`` — xDiT: the transformer becomes ``xFuserWanTransformer3DWrapper`` (its processors call
  xfuser's USP: Ulysses all-to-all, ring via torch's templated ring attention, or both), with xfuser's model
  parallel groups. The backend is installed behind xfuser's attention registry (``AttentionPatch``), which
  serves the Ulysses *and* the ring path. Needs CUDA: ``import xfuser`` raises NotImplementedError without an
  accelerator (``envs.get_device_version()``), ``xfuser.envs.get_torch_distributed_backend()`` raises
  NotImplementedError on a machine without CUDA/HIP/MUSA/MPS/NPU, and ``xfuser.model_executor.layers.usp``
  binds yunchang's ``PROCESS_GROUP`` only when ``torch.cuda.is_available()`` (``None`` otherwise, so both its
  Ulysses all-to-all and its ring attention dereference ``None``).
* ``diffusers`` — ``transformer.enable_parallelism(config=ContextParallelConfig(...))``: diffusers' own CP
  hooks split the sequence and its templated Ulysses / ring / unified attention runs, with our kernel as the
  forward op (``AttentionPatch._cp_forward_op``). Runs on CPU over gloo, which is how CI checks it.

Guidance: ``--use_cfg_parallel`` puts classifier-free guidance's two branches on the two halves of the world, on
both engines: the engine's own split where it has one (xfuser's Wan I2V and CogVideoX pipelines), else
:class:`GuidanceSplit`, a diffusers hook that computes one branch per rank and gathers the prediction once per step.

Paths: Ulysses (``--ulysses_degree N``), ring (``--ring_degree N``), hybrid (both > 1). Ring merges partial
results with each block's log-sum-exp, so the backend must return it (``Backend.lse_form``); one that
can't is refused before the model is loaded. Every rank checks its device and backend and the ranks agree
(one collective) before any rendering; a rank that fails later sets a flag in the process group's store and
every other rank exits within ``POLL_S`` seconds (no wait until the NCCL timeout). Only rank 0 writes the video
and the merged timing.json, which carries every rank's figures (``ranks``).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from . import backends as B
from . import families

__all__ = ["ParallelSpec", "DistContext", "ENGINES", "ENGINE_CHOICES", "resolve_engine", "engine_check", "refusal_of",
           "settle_engine", "init_distributed", "check_backend_for_path", "agree", "apply_engine", "share_output",
           "sequence_layout", "merge_rank_entries",
           "FailureWatch", "set_outcome", "finish", "one_device_presented", "shares_calls", "shard_group",
           "hooks_in_place", "compile_refusal", "guidance_split", "guidance_overlap_refusal",
           "settle_guidance_overlap", "GUIDANCE_OVERLAP_AUTO", "Baton", "interleaved", "turn", "EXIT_PEER_FAILED"]

ENGINES = ("xfuser", "diffusers")
ENGINE_CHOICES = ("auto", *ENGINES)  # what --parallel_engine takes; auto is resolved by resolve_engine
EXIT_PEER_FAILED = 4  # this rank stopped because another rank failed
POLL_S = 1.0
ACK_TIMEOUT_S = 30.0  # how long a failing rank waits for its peers to read its failure
_FAIL_KEY = "vdbench/failed"
_ACK_KEY = "vdbench/failure_read"
_BEAT_KEY = "vdbench/beat/{}"  # + rank: a counter each rank's watch advances every POLL_S while the rank lives
SILENT_S = 3 * POLL_S  # a peer whose heartbeat doesn't advance for this long is gone (killed, its host down)
_OUTCOME: dict = {"code": None, "watch": None}  # this process's pending exit code (SIGTERM handler)


def sequence_layout(ulysses: int, ring: int) -> str:
    """The sequence-parallel layout as one name: 'ulysses2', 'ring2', 'ulysses2xring2'; '' for none. The same
    name labels runs (``ParallelSpec.label``) and the kernel calls that ran on that path (``@ulysses2``)."""
    parts = [f"ulysses{ulysses}"] if ulysses > 1 else []
    parts += [f"ring{ring}"] if ring > 1 else []
    return "x".join(parts)


@dataclass(frozen=True)
class ParallelSpec:
    engine: str = "xfuser"
    ulysses_degree: int = 1
    ring_degree: int = 1
    use_cfg_parallel: bool = False
    requested_engine: Optional[str] = None  # what --parallel_engine said (auto), when it differs from engine
    engine_reason: Optional[str] = None  # auto: why this engine (one line)
    # --ulysses_overlap: Ulysses attention in this many head chunks, each chunk's all-to-all beside another's
    # attention (vdbench.patching.ulysses); 1: diffusers' template as it is
    head_chunks: int = 1
    # --ulysses_async: the model family's self-attention sends Q, K and V as each is made, beside the next
    # projection (Family.ulysses_self_attention through vdbench.patching.ulysses.UlyssesExchange). None (auto): where
    # it applies (diffusers' Ulysses without ring or head chunks, a family that has one), settled by apply_engine
    async_exchange: Optional[bool] = None
    # --guidance_overlap: both guidance branches of a step computed together on every rank, on two host threads
    # taking turns, so each branch's exchanges travel beside the other's GEMMs (GuidanceSplit through interleaved).
    # None (auto): settled by settle_guidance_overlap with the request in hand
    guidance_overlap: Optional[bool] = None
    guidance_overlap_reason: Optional[str] = None  # why it is off (auto), one line
    # --ulysses_fp8_exchange: V and the attention output of --ulysses_async's exchange cross as e4m3 rows with a
    # scale each (vdbench.patching.ulysses.Fp8Exchange): half the bytes, not the one-GPU output bit for bit
    fp8_exchange: bool = False
    # --ulysses_v_per_rank: the async exchange projects V per destination rank, this rank's heads while the others'
    # travel (UlyssesExchange.send_projected); the same values as V projected whole
    v_per_rank: bool = True

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree * (2 if self.use_cfg_parallel else 1)

    @property
    def path(self) -> str:
        u, r = self.ulysses_degree, self.ring_degree
        return "single" if u == r == 1 else "hybrid" if u > 1 and r > 1 else "ulysses" if u > 1 else "ring"

    @property
    def async_applies(self) -> bool:
        """Whether the layout has the exchange ``--ulysses_async`` overlaps: Ulysses without ring or head chunks,
        on diffusers' engine (or auto, which takes it there)."""
        return (self.ulysses_degree > 1 and self.ring_degree == 1 and self.head_chunks == 1
                and self.engine != "xfuser")

    @property
    def needs_lse(self) -> bool:
        return self.ring_degree > 1

    @property
    def tag(self) -> str:
        """The layout in an output file name: 'u2', 'r2', 'u2r2', 'cfg2', 'u2cfg2'; '' for one process."""
        return families.layout_tag(self.ulysses_degree, self.ring_degree, self.use_cfg_parallel)

    @property
    def sequence_degree(self) -> int:
        """The ranks that share one transformer call (Ulysses x ring); the CFG split doubles the world."""
        return self.ulysses_degree * self.ring_degree

    def validate(self) -> None:
        if self.engine not in ENGINE_CHOICES:
            raise ValueError(f"--parallel_engine must be one of {', '.join(ENGINE_CHOICES)}, got {self.engine!r}")
        if self.ulysses_degree < 1 or self.ring_degree < 1:
            raise ValueError("--ulysses_degree and --ring_degree must be >= 1")
        if self.head_chunks < 1:
            raise ValueError("--ulysses_overlap must be >= 1")
        if self.head_chunks > 1 and (self.ulysses_degree < 2 or self.ring_degree > 1 or self.engine == "xfuser"):
            raise ValueError(f"--ulysses_overlap {self.head_chunks} overlaps the all-to-all of Ulysses attention: it "
                             "needs --ulysses_degree >= 2 without --ring_degree, on --parallel_engine diffusers "
                             "(or auto)")
        if self.guidance_overlap is True and (not self.async_applies or self.use_cfg_parallel
                                              or self.async_exchange is False):
            raise ValueError("--guidance_overlap on interleaves the two guidance branches' Ulysses exchanges: it "
                             "needs --ulysses_degree >= 2 without --ring_degree, --ulysses_overlap or "
                             "--use_cfg_parallel, and --ulysses_async auto or on, on --parallel_engine diffusers "
                             "(or auto)")
        if self.fp8_exchange and (not self.async_applies or self.async_exchange is False):
            raise ValueError("--ulysses_fp8_exchange on quantizes the exchanges of --ulysses_async: it needs "
                             "--ulysses_degree >= 2 without --ring_degree or --ulysses_overlap, with --ulysses_async "
                             "auto or on, on --parallel_engine diffusers (or auto)")
        if self.async_exchange is True and not self.async_applies:
            raise ValueError("--ulysses_async on sends Q, K and V of Ulysses attention beside the projections: it "
                             "needs --ulysses_degree >= 2 without --ring_degree or --ulysses_overlap, on "
                             "--parallel_engine diffusers (or auto)")

    @property
    def label(self) -> str:
        """Human-readable layout, e.g. 'ulysses2', 'ring2', 'ulysses2xring2', 'cfg2', 'ulysses2+cfg2'."""
        sp = sequence_layout(self.ulysses_degree, self.ring_degree)
        if self.use_cfg_parallel:
            return f"{sp}+cfg2" if sp else "cfg2"
        return sp or "single"

    def as_dict(self) -> dict:
        return {"engine": self.engine, "engine_requested": self.requested_engine or self.engine,
                "engine_reason": self.engine_reason or (f"--parallel_engine {self.engine}" if self.engine != "auto"
                                                        else None),
                "ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree,
                "use_cfg_parallel": self.use_cfg_parallel, "path": self.path, "label": self.label, "tag": self.tag,
                "world_size": self.world_size, "head_chunks": self.head_chunks,
                "async_exchange": self.async_exchange, "guidance_overlap": self.guidance_overlap,
                "guidance_overlap_reason": self.guidance_overlap_reason, "fp8_exchange": self.fp8_exchange,
                "v_per_rank": self.v_per_rank}


def resolve_engine(spec: ParallelSpec, device: torch.device,
                   refusal: Optional[Callable[[ParallelSpec], Optional[str]]] = None,
                   family: Optional[families.Family] = None) -> ParallelSpec:
    """``--parallel_engine auto``: the model family's preferred engine (``Family.preferred_engine``; xfuser for a
    family that names none) where it runs and serves the request, else the other; ``engine_reason`` says which
    applied. xfuser runs on a CUDA device with xfuser installed; diffusers' context parallelism everywhere.
    ``refusal(spec)``: why the engine ``spec`` names can't serve this request (its attention backend or schedule, the
    compile, the pipeline), None where it can -- what the render checks per engine before the load; without it (the
    process group's set-up, before the request is read) only where xfuser runs decides. Where the preferred engine
    refuses and the other serves, the other; where both refuse, the preferred one, whose refusal the render then says.
    A spec already resolved from auto is resolved again (the request known by then); a named engine is kept."""
    if spec.engine != "auto" and spec.requested_engine != "auto":
        return spec
    import importlib.util

    auto = replace(spec, requested_engine="auto")
    if device.type != "cuda" or importlib.util.find_spec("xfuser") is None:
        why = "needs a CUDA GPU" if device.type != "cuda" else "is not installed"
        return replace(auto, engine="diffusers", engine_reason=f"auto: xfuser {why}")
    if spec.head_chunks > 1 or spec.async_exchange is True or spec.guidance_overlap is True or spec.fp8_exchange:
        flag = ("--ulysses_overlap" if spec.head_chunks > 1 else "--ulysses_async on" if spec.async_exchange
                else "--guidance_overlap on" if spec.guidance_overlap else "--ulysses_fp8_exchange on")
        return replace(auto, engine="diffusers", engine_reason=f"auto: {flag} runs on diffusers' engine")
    first = family.preferred_engine if family is not None else "xfuser"
    other = "diffusers" if first == "xfuser" else "xfuser"
    refused = refusal(replace(auto, engine=first)) if refusal is not None else None
    if refused and refusal(replace(auto, engine=other)) is None:
        return replace(auto, engine=other,
                       engine_reason=f"auto: {first} can't serve this request ({refused.splitlines()[0]})")
    why = ("runs here (a CUDA GPU, xfuser installed)" if first == "xfuser" else
           f"is the faster engine for {family.name}, measured (xfuser would run here)")
    return replace(auto, engine=first, engine_reason=f"auto: {first} {why}")


def engine_check(device, members, family: families.Family, task: str, pipeline_class: Optional[str] = None, *,
                 compiled: bool = False,
                 check_schedule: Optional[Callable[[Optional[ParallelSpec]], None]] = None
                 ) -> Callable[[Optional[ParallelSpec]], None]:
    """``check(spec)``: raises why the engine ``spec`` names (None: one process) can't serve a render's request --
    ``check_schedule(spec)``, the attention schedule's own rules for that engine (a sparse pattern under xfuser);
    under torchrun each backend of ``members`` on the engine's path (:func:`check_backend_for_path`) and the
    compile (:func:`compile_refusal`)."""
    def check(spec: Optional[ParallelSpec]) -> None:
        if check_schedule is not None:
            check_schedule(spec)
        if spec is None:
            return
        if spec.async_exchange is True and family.ulysses_self_attention is None:
            raise ValueError(f"--ulysses_async on: vdbench has no {family.name} self-attention that sends Q, K and V "
                             "beside the projections\nuse --ulysses_async auto or off (diffusers' Ulysses runs as it "
                             "is)")
        for member in members:
            check_backend_for_path(spec, member, device, family, task, pipeline_class)
        why = compile_refusal(spec) if compiled else None
        if why:
            raise ValueError(why)

    return check


def fp8_exchange_refusal(spec: ParallelSpec, device) -> Optional[str]:
    """Why ``--ulysses_fp8_exchange on`` can't run in this render (one line), or None: it quantizes the exchanges of
    vdbench's own Ulysses self-attention (settled on by then), in Triton kernels (a GPU Triton compiles for, or its
    interpreter: ``TRITON_INTERPRET=1``)."""
    import importlib.util

    from .kernels import interpret_requested

    if not spec.async_exchange:
        return "this model family has no vdbench Ulysses self-attention whose exchanges it could quantize"
    if importlib.util.find_spec("triton") is None:
        return "its kernels are Triton's: pip install triton"
    if torch.device(device).type != "cuda" and not interpret_requested():
        return "its Triton kernels need a GPU (or TRITON_INTERPRET=1 to run them on the CPU, slowly)"
    return None


#: ``--guidance_overlap auto``: on wherever it applies
GUIDANCE_OVERLAP_AUTO = True


def guidance_overlap_refusal(spec: ParallelSpec, family: families.Family, *, guidance_scale: float,
                             cache: bool, compiled: bool, sparse: bool) -> Optional[str]:
    """Why the two guidance branches can't be interleaved in this render (one line), or None. They can where
    vdbench's Ulysses self-attention runs (its phase ends are the turns), the family's pipelines make two denoiser
    calls per step that differ only in the text, and nothing keeps state across one forward: a step cache (diffusers'
    hooks hold one context at a time), the compiled blocks, a sparse pattern's per-forward token order."""
    if not (spec.async_applies and spec.async_exchange is not False and not spec.use_cfg_parallel):
        return ("it interleaves Ulysses exchanges: needs --ulysses_degree >= 2 without ring, --ulysses_overlap or "
                "--use_cfg_parallel, with --ulysses_async on diffusers' engine")
    if family.guidance_in_one_batch or family.ulysses_self_attention is None:
        return f"{family.name}'s pipelines run guidance as one batch or have no vdbench Ulysses self-attention"
    if guidance_scale <= 1:
        return f"--guidance_scale {guidance_scale:g} runs one branch per step"
    for on, what in ((cache, "a step cache (its hooks keep one guidance context at a time)"),
                     (compiled, "--use_torch_compile (not measured interleaved)"),
                     (sparse, "a sparse pattern (its token order is kept per forward)")):
        if on:
            return f"not with {what}"
    return None


def settle_guidance_overlap(dctx: Optional["DistContext"], refusal: Optional[str]) -> None:
    """``--guidance_overlap``: ``on`` refused with the reason where it can't apply; ``auto`` settled (on where it
    applies, per :data:`GUIDANCE_OVERLAP_AUTO`) and the reason it is off recorded."""
    if dctx is None:
        return
    spec = dctx.spec
    if spec.guidance_overlap is True and refusal:
        raise ValueError(f"--guidance_overlap on: {refusal}\nuse --guidance_overlap auto or off")
    if spec.guidance_overlap is None:
        on = refusal is None and GUIDANCE_OVERLAP_AUTO
        why = None if on else refusal or "auto: off by default"
        dctx.spec = replace(spec, guidance_overlap=on, guidance_overlap_reason=why)
    elif spec.guidance_overlap is False:
        dctx.spec = replace(spec, guidance_overlap_reason="--guidance_overlap off")


def refusal_of(check: Callable[[Optional[ParallelSpec]], None]) -> Callable[[ParallelSpec], Optional[str]]:
    """``check(spec)`` (raises why the engine ``spec`` names can't serve a request) as the ``refusal`` that
    :func:`resolve_engine` takes: the first line of that refusal, or None."""
    def refusal(spec: ParallelSpec) -> Optional[str]:
        try:
            check(spec)
        except (B.BackendUnavailable, ValueError) as e:
            return str(e).splitlines()[0]
        return None

    return refusal


def settle_engine(dctx, device: torch.device, check: Callable[[Optional[ParallelSpec]], None],
                  family: Optional[families.Family] = None) -> None:
    """The render's engine settled and checked before the load: under torchrun ``dctx.spec`` resolved for this
    request (:func:`resolve_engine`, ``check``'s refusal deciding an ``auto``) and the chosen engine checked; one
    process (``dctx`` None) checked as such. ``check(spec)``: raises why the engine ``spec`` names (None: one
    process) can't serve the request (``BackendUnavailable`` or ValueError)."""
    if dctx is not None:
        dctx.spec = resolve_engine(dctx.spec, device, refusal_of(check), family)
    check(dctx.spec if dctx is not None else None)


@dataclass
class DistContext:
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
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        timeout = datetime.timedelta(seconds=float(os.environ.get("VDBENCH_DIST_TIMEOUT_S", 600)))
        # no device_id: xfuser notes that NCCL's device-side rendezvous it triggers breaks its new_group() calls;
        # the device is bound by set_device above
        dist.init_process_group(pg, rank=rank, world_size=world, timeout=timeout)
    return DistContext(spec, rank, world, local_rank, device, pg, owns_group=owns)


def check_backend_for_path(spec: ParallelSpec, attention_type: "str | B.Backend", device,
                           family: families.Family, task: str = "t2v", pipeline_class: Optional[str] = None) -> None:
    """Refuse (BackendUnavailable) what the chosen engine and path can't run, before any work.

    What each engine can split is the family's (:attr:`vdbench.families.Family.parallel_refusal`; as shipped,
    diffusers 0.42.1 and xfuser 0.7.0: Wan every task and the CFG split under both engines; CogVideoX T2V under
    xfuser, its CFG split alone under diffusers), and xfuser the pipelines wired to it (``pipeline_class``, where
    given: the family's ``xfuser`` table); what any backend needs on a path (ring: the log-sum-exp) is checked here.
    """
    why = family.parallel_refusal(spec.engine, task, spec.world_size, spec.use_cfg_parallel)
    if why:
        raise B.BackendUnavailable(why)
    if spec.engine == "xfuser" and spec.world_size > 1 and pipeline_class and pipeline_class not in family.xfuser:
        raise B.BackendUnavailable(_unwired(pipeline_class))
    backend = attention_type if isinstance(attention_type, B.Backend) else B.resolve(attention_type)
    if spec.engine == "xfuser" and spec.world_size > 1 and backend.passthrough:
        raise B.BackendUnavailable(
            f"--attention_type {backend.name} under --parallel_engine xfuser would leave the kernel to xfuser's own "
            "registry, uncounted; name the backend (e.g. sdpa_cudnn, fav3)")
    if not spec.needs_lse:
        return
    try:
        backend.lse_form(device)
    except B.BackendUnavailable as e:
        can = [n for n, b in B.BACKENDS.items() if b.has_lse(device) and b.availability(device)[0]]
        raise B.BackendUnavailable(
            f"attention backend '{backend.name}' can't serve {spec.path} attention "
            f"(--ring_degree {spec.ring_degree}): ring attention merges blocks with the log-sum-exp and {e}.\n"
            f"Backends that return it here ({torch.device(device).type}): {', '.join(can) or 'none'}; or use "
            f"--ulysses_degree alone") from None


def agree(ctx: Optional[DistContext], error: Optional[BaseException]) -> None:
    """Every rank reports its check; if any failed, every rank raises with the failing ranks' messages."""
    if ctx is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    mine = None if error is None else f"{type(error).__name__}: {error}"
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    bad = [(r, m) for r, m in enumerate(gathered) if m is not None]
    if bad:
        err = error if error is not None else B.BackendUnavailable(
            "; ".join(f"rank {r}: {m}" for r, m in bad))
        err._vd_agreed = True  # every rank raises this one together: no peer-failure flag needed
        raise err


def shares_calls(ctx: DistContext, guidance_in_one_batch: bool) -> bool:
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
    import torch.distributed as dist

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
    from torch.distributed.device_mesh import init_device_mesh

    spec = ctx.spec
    mesh = init_device_mesh(ctx.device.type, (2, spec.ring_degree, spec.ulysses_degree),
                            mesh_dim_names=("cfg", "ring", "ulysses"))
    ctx.cfg_group, ctx.cfg_index = mesh.get_group("cfg"), mesh.get_local_rank("cfg")
    if spec.sequence_degree > 1:
        ctx.shard_group = mesh["ring", "ulysses"]._flatten().get_group()
    return mesh


GUIDANCE_HOOK = "vdbench_guidance_split"


class GuidanceSplit:
    """Classifier-free guidance over two halves of the world: each rank evaluates one guidance branch of every step
    and one gather over its guidance pair (``ctx.cfg_group``) gives every rank both predictions -- no all-to-all,
    one exchange of the noise prediction per step. What diffusers' pipelines leave out (their context parallelism
    splits the sequence only), done with torch.distributed inside the pipeline's own loop:

    * ``batched=False`` (Wan: the denoiser is called twice per step, conditional then unconditional, the two calls
      differing only in ``encoder_hidden_states``): at a step's first call the rank of branch 1 swaps in the
      negative prompt's embeddings (recorded from the pipeline's ``encode_prompt``), each rank computes its branch,
      the pair gathers both; the first call returns the conditional prediction, the second call returns the
      unconditional one without computing (and is checked to be the pair's twin: same latents, the recorded
      negative embeddings). Each branch is computed exactly as on one GPU, so exact kernels give identical latents.
    * ``batched=True`` (CogVideoX: one call with the batch ``[uncond, cond]``): each rank computes its half of the
      batch and the halves are gathered back in order. A half-batch may pick other GEMM kernels than the full batch
      on one GPU, so latents agree to rounding rather than bit for bit.

    A diffusers cache (when one is stacked) keeps one state per guidance branch on one GPU; here each rank always
    computes the same branch under the pipeline's context, so its state is that branch's, as on one GPU.

    ``index=None`` (``--guidance_overlap``, pair mode only): no split -- every rank computes both branches at a
    step's first call, interleaved (:func:`interleaved`: the conditional call on the
    pipeline's thread, the unconditional one on a helper thread, taking turns at the Ulysses processor's phase
    ends), and serves the second call as above; no gather."""

    def __init__(self, group, index: Optional[int], batched: bool):
        self.group, self.index, self.batched = group, index, batched
        self.handovers = 0  # index None: the turns the two interleaved branches took
        self.negative = None  # the pipeline's negative prompt embeddings (pair mode), from its encode_prompt
        self.pending = None  # between a pair's two calls: (the step's latents, the unconditional prediction)
        self.gathers = 0
        self.served = 0  # denoiser calls answered without computing (a pair's second call: the other rank's branch)

    def record_prompts(self, pipe) -> None:
        """Keep the negative prompt embeddings ``pipe.encode_prompt`` returns (the second of its pair)."""
        encode = pipe.encode_prompt

        def recording(*args, **kwargs):
            out = encode(*args, **kwargs)
            self.negative = out[1]
            return out

        pipe.encode_prompt = recording

    def forward(self, inner, *args, **kwargs):
        return (self._batch if self.batched else self._pair)(inner, args, kwargs)

    def _gather(self, mine):
        import torch.distributed as dist

        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine.contiguous(), group=self.group)
        self.gathers += 1
        return both

    def _pair(self, inner, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        ehs = kwargs.get("encoder_hidden_states")
        if ehs is None:
            raise RuntimeError("--use_cfg_parallel: the denoiser was called without encoder_hidden_states as a "
                               "keyword; this pipeline's guidance can't be split by branch")
        if self.pending is not None:  # the step's second call: the unconditional branch, computed by the pair
            latents, negative, out = self.pending
            self.pending = None
            if hs is not latents or not torch.equal(ehs, negative):
                raise RuntimeError("--use_cfg_parallel: the second denoiser call of a step is not the first's "
                                   "unconditional twin (other latents or text embeddings); run without the CFG split")
            self.served += 1
            return out
        if self.negative is None:
            raise RuntimeError("--use_cfg_parallel: the pipeline's negative prompt embeddings were not recorded "
                               "(its encode_prompt did not run); run without the CFG split")
        negative = self.negative.to(device=ehs.device, dtype=ehs.dtype)
        uncond_kwargs = {**kwargs, "encoder_hidden_states": negative}
        if self.index is None:  # both branches here, interleaved
            out, other, turns = interleaved(lambda: inner(*args, **kwargs), lambda: inner(*args, **uncond_kwargs),
                                            hs.device)
            self.handovers += turns
            self.pending = (hs, negative, other)
            return out
        out = inner(*args, **(uncond_kwargs if self.index == 1 else kwargs))
        cond, uncond = self._gather(_prediction(out))
        self.pending = (hs, negative, _with_prediction(out, uncond))
        return _with_prediction(out, cond)

    def _batch(self, inner, args, kwargs):
        if args:
            raise RuntimeError("--use_cfg_parallel: the denoiser was called with positional arguments; this "
                               "pipeline's guidance batch can't be split")
        n = kwargs["hidden_states"].shape[0]
        if n % 2:
            raise RuntimeError(f"--use_cfg_parallel: a guidance batch of {n} can't be split in two halves "
                               "(is classifier-free guidance on?)")
        h = n // 2
        part = {k: v[self.index * h:(self.index + 1) * h] if isinstance(v, torch.Tensor) and v.dim() and
                v.shape[0] == n else v for k, v in kwargs.items()}
        out = inner(**part)
        return _with_prediction(out, torch.cat(self._gather(_prediction(out)), dim=0))


# ----- two guidance branches interleaved on two host threads (--guidance_overlap) -----

_LOCAL = threading.local()  # (baton, this thread's side) while a thread runs one branch of an interleaved pair


class _Abandoned(Exception):
    """Raised in a branch's thread when the other branch failed: its work is of no use any more."""


class Baton:
    """Two host threads issuing GPU work in turns: only the holder runs; :meth:`pass_` (a phase's end) hands the
    turn to the other side and waits for it to come back. Only one thread runs at a time, so the order of kernels
    and collectives follows from the code alone -- the same on every rank, never decided by thread timing (the
    ranks' collectives must match one for one).

    ``lead``: how many of each side's first passes are skipped. The processor passes at three points of each layer
    -- its entry (E), after Q, K and V are sent (V), after the output's exchange is started (O) -- and leads of
    (2, 1) offset the two branches by one phase, so that the stream receives A's attention, B's projections, A's
    out-projection to next-layer norm, B's attention, A's projections, ...: each exchange (A's Q/K/V, A's output,
    B's Q/K/V, B's output) has the other branch's GEMMs beside it, never the attention kernel (whose persistent
    grid holds every SM). A side that has finished passes nothing: the other runs alone to its end."""

    def __init__(self, lead: tuple[int, int] = (2, 1), start_second: Optional[Callable[[], None]] = None):
        self._cv = threading.Condition()
        self._owner = 0
        self._skip = list(lead)
        self._done = [False, False]
        self._failed = False
        self.passes = 0  # hand-overs made (recorded: a pair that never alternated overlapped nothing)
        # called once, at the first hand-over to side 1 (or when side 0 ends without one): side 1's thread is woken
        # only then, so its wake-up costs the host nothing at the call's start, where the GPU waits for the host
        self._start_second = start_second

    def _second_started(self) -> None:
        start, self._start_second = self._start_second, None
        if start is not None:
            start()

    def wait(self, side: int) -> None:
        """Block until ``side`` holds the turn; :class:`_Abandoned` if the other side failed."""
        with self._cv:
            self._cv.wait_for(lambda: self._owner == side or self._failed)
            if self._failed:
                raise _Abandoned()

    def pass_(self, side: int) -> None:
        if self._skip[side]:
            self._skip[side] -= 1
            return
        with self._cv:
            if self._done[1 - side]:
                return
            self._owner = 1 - side
            self.passes += 1
            self._cv.notify_all()
        self._second_started()
        self.wait(side)

    def finish(self, side: int, failed: bool = False) -> None:
        """``side`` is done (or ``failed``: the other side stops at its next pass)."""
        with self._cv:
            self._done[side] = True
            self._failed = self._failed or failed
            self._owner = 1 - side
            self._cv.notify_all()
        self._second_started()


def turn() -> None:
    """A phase's end in a branch of an :func:`interleaved` pair: the other branch's turn. Nothing outside one."""
    held = getattr(_LOCAL, "held", None)
    if held is not None:
        held[0].pass_(held[1])


@contextlib.contextmanager
def _holding(baton: Baton, side: int):
    _LOCAL.held = (baton, side)
    try:
        yield
    finally:
        _LOCAL.held = None


def _thread_state(device: torch.device):
    """What of the calling thread's torch state a branch's thread must share (grad and inference mode are
    thread-local; so are the current CUDA device and stream, which must be the caller's: one stream orders both
    branches' kernels as the host issued them)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def state():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(inference))
            stack.enter_context(torch.set_grad_enabled(grad))
            if stream is not None:
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(stream))
            yield

    return state


class _Helper:
    """The one long-lived thread that runs the second branch of every interleaved pair: a render calls
    :func:`interleaved` once per step, and a thread started per step would put its start-up (and the GIL hand-overs
    it brings) into every step's first layer, where the host is already behind the GPU."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs = self._thread = None

    def submit(self, fn, *args) -> threading.Event:
        """Run ``fn(*args)`` on the helper thread; the event is set once it has returned (or raised: ``fn`` keeps
        its own errors). A process forked after the thread started has the queue but not the thread (fork copies
        only the calling thread): a thread not alive is started afresh, with a queue of its own."""
        import queue

        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,),
                                                name="vdbench-guidance-branch", daemon=True)
                self._thread.start()
        done = threading.Event()
        self._jobs.put((fn, args, done))
        return done

    @staticmethod
    def _serve(jobs) -> None:
        while True:
            fn, args, done = jobs.get()
            try:
                fn(*args)
            finally:
                done.set()


_HELPER = _Helper()


def interleaved(first: Callable[[], object], second: Callable[[], object], device) -> tuple[object, object, int]:
    """``first()`` on this thread and ``second()`` on a helper thread, taking turns at every :func:`turn` (a
    :class:`Baton`, ``first`` leading; the helper is handed ``second`` at the first hand-over, when the GPU already
    holds the first branch's opening work). Returns both results and the number of hand-overs. An error in either
    stops both and is raised here (the first's own error when both failed)."""
    result: dict = {}
    state = _thread_state(torch.device(device))
    ended = threading.Event()

    def start_second():
        nonlocal ended
        ended = _HELPER.submit(contextvars.copy_context().run, run_second)

    baton = Baton(start_second=start_second)

    def run_second():
        try:
            with state(), _holding(baton, 1):
                baton.wait(1)
                result["second"] = second()
        except _Abandoned:  # the first branch failed: its error is the one the caller raises
            return
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e
        finally:
            baton.finish(1, failed="error" in result)

    try:
        with _holding(baton, 0):
            out = first()
    except _Abandoned:
        baton.finish(0)
        ended.wait()
        raise result["error"] from None
    except BaseException:
        baton.finish(0, failed=True)
        ended.wait()
        raise
    baton.finish(0)
    ended.wait()
    if "error" in result:
        raise result["error"]
    return out, result["second"], baton.passes


def _prediction(out):
    """The noise prediction in a denoiser's output (a tuple with ``return_dict=False``, else ``.sample``)."""
    return out[0] if isinstance(out, tuple) else out.sample


def _with_prediction(out, pred):
    if isinstance(out, tuple):
        return (pred, *out[1:])
    return type(out)(sample=pred)


def split_guidance(ctx: DistContext, pipe, models: list, family: "families.Family") -> GuidanceSplit:
    """Install :class:`GuidanceSplit` on every denoiser of ``pipe`` (both Wan 2.2 experts) as a diffusers hook,
    outermost, over ``ctx.cfg_group``; how the family's pipelines run guidance is the family's
    (``guidance_in_one_batch``)."""
    from diffusers.hooks import HookRegistry, ModelHook

    overlap = not ctx.spec.use_cfg_parallel  # --guidance_overlap: both branches on every rank
    split = GuidanceSplit(None if overlap else ctx.cfg_group, None if overlap else ctx.cfg_index,
                          family.guidance_in_one_batch)
    if not split.batched:
        split.record_prompts(pipe)

    class _Hook(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return split.forward(self.fn_ref.original_forward, *args, **kwargs)

    for _, m in models:
        HookRegistry.check_if_exists_or_initialize(m).register_hook(_Hook(), GUIDANCE_HOOK)
    pipe._vdbench_guidance_split = ctx.guidance = split
    return split


def guidance_split(ctx: DistContext, pipe) -> Optional[tuple[dict, Optional[Callable[[], int]]]]:
    """Under ``--use_cfg_parallel``: what this rank computes of each step's guidance (timing.json's
    ``cache.guidance_split``), and a count of the denoiser calls it answers without computing (vdbench's
    :class:`GuidanceSplit`: a pair's second call; None where the engine's own pipeline splits guidance, whose calls
    are each rank's own). None without a CFG split."""
    if not ctx.spec.use_cfg_parallel:
        return None
    split = getattr(pipe, "_vdbench_guidance_split", None)
    if split is None:
        part = "one guidance branch per step (the engine's own split)"
    elif split.batched:
        part = "its half of each step's guidance batch"
    else:
        part = f"the {('conditional', 'unconditional')[split.index]} branch of each step"
    note = {"this_rank_computes": part, "counts": "this rank's (every rank's under ranks[].cache)"}
    return note, ((lambda: split.served) if split is not None else None)


def hooks_in_place(spec: ParallelSpec) -> bool:
    """Whether the engine makes the loaded denoisers parallel by hooking them in place (diffusers' context
    parallelism: split and gather hooks on the model's own modules) rather than by new modules (xfuser's wrappers).
    Hooks registered later wrap earlier ones, so what must see each rank's shard (a step cache's hooks, the
    compiled blocks) goes on before such an engine, and after one that builds new modules."""
    return spec.engine == "diffusers"


def compile_refusal(spec: ParallelSpec) -> Optional[str]:
    """Why ``--use_torch_compile`` can't run with this engine (one line, then a hint), or None. Under diffusers'
    context parallelism a compiled block's parallel attention call is one opaque ``vdbench::attention`` op
    (diffusers' template, its collectives and our kernel inside). xfuser's processors reach the kernel through
    its USP function, whose all-to-all the compiled block would trace around the op, not hand to it."""
    if spec.engine == "xfuser" and spec.world_size > 1:
        return ("--use_torch_compile under --parallel_engine xfuser: xfuser's USP runs its all-to-all around the "
                "registry's kernel, where the compiled block would trace it instead of calling vdbench's attention "
                "op\nuse --parallel_engine diffusers with --use_torch_compile, or drop the compile")
    return None


def _unwired(pipeline_class: str) -> str:
    wired = families.xfuser_wired()
    return (f"--parallel_engine xfuser: {pipeline_class} is not wired to xfuser in vdbench ({', '.join(wired)} are); "
            "use --parallel_engine diffusers")


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
    from xfuser.core.distributed import init_distributed_environment, initialize_runtime_state
    spec = ctx.spec
    kind = type(pipe).__name__
    if kind not in family.xfuser:
        raise B.BackendUnavailable(_unwired(kind))
    wiring = family.xfuser[kind]
    init_distributed_environment(rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank)
    engine_config = _xfuser_engine_config(ctx, pipe)
    if wiring.pipeline_wrapper is not None:
        # a wrapper around the loaded pipeline (attributes read through to it); it builds the runtime state itself
        wrapped = _xfuser_class(wiring.pipeline_wrapper)(pipe, engine_config)
        return wrapped, [(name, getattr(wrapped, name)) for name, _ in models]

    import inspect

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
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def rebuild_pipeline_as(cls, pipe):
    """``cls`` (a pipeline class with the same constructor, e.g. xfuser's subclass) built from ``pipe``'s own
    modules and its config-only values (``pipe.components`` alone drops e.g. Wan 2.2's ``boundary_ratio``), with
    ``pipe``'s progress-bar settings."""
    import inspect

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
    from xfuser import xFuserArgs

    spec = ctx.spec
    args = xFuserArgs(model="vdbench", ulysses_degree=spec.ulysses_degree, ring_degree=spec.ring_degree,
                      use_cfg_parallel=spec.use_cfg_parallel)
    engine_config, _ = args.create_config()
    return engine_config


def share_output(ctx: Optional[DistContext], latents):
    """Give every rank the pipeline's output latents.

    xfuser's CogVideoX pipeline returns them on its last data-parallel group only (the last sequence-parallel
    and last CFG rank); the others get ``[None]``. Rank 0 writes the video, so the latents go from a rank that has
    them to all (a broadcast on the ranks' devices). Outputs already on every rank are returned as they are.
    """
    if ctx is None:
        return latents
    import torch.distributed as dist

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


def merge_rank_entries(ctx: Optional[DistContext], entries: list[dict]) -> Optional[list[dict]]:
    """Gather every rank's timing entries; rank 0 gets rank 0's entries with ``ranks`` (per-rank figures) and
    ``parallel`` added and the call counts summed over ranks; other ranks get None (they write nothing)."""
    if ctx is None:
        return entries
    import torch.distributed as dist

    from .power import all_ranks
    from .timing import STEP_KEYS, gpu_uuid, step_stats

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


class FailureWatch:
    """Bounded failure propagation: a failing rank sets a flag in the process group's store; a thread on every
    rank polls it and ends its process (exit EXIT_PEER_FAILED) within POLL_S seconds of a peer's failure,
    instead of waiting in a collective until the NCCL/gloo timeout; the failing rank waits (bounded) until every
    peer has read the flag before it exits, since it may host the store.

    Exit codes that don't depend on timing: torchrun stops the remaining workers with SIGTERM as soon as one exits
    non-zero, which would end a rank still on its way out as -15 instead of its code. The watch installs a SIGTERM
    handler that ends the rank with the code it is on its way to (:func:`set_outcome`: a refusal's, a failure's,
    EXIT_PEER_FAILED when a peer failed), so every rank exits with its documented code whichever exits first.

    A rank that dies without a word (SIGKILL, the OOM killer, a segfault, its host gone) posts nothing. Every rank's
    watch therefore also beats (a counter in the store, every POLL_S); a rank whose collective broke, or that
    torchrun stops, first asks whether a peer fell silent (:meth:`silent_peers`) and, if one did, stops naming it
    (exit EXIT_PEER_FAILED) instead of taking the broken collective for its own failure."""

    def __init__(self, ctx: Optional[DistContext]):
        self.ctx = ctx
        self.store = None
        self._stop = threading.Event()
        self._reading = threading.Event()  # set while the poller reads the failure flag (cleared by fail())
        self._attributing = False  # inside fail(): this rank's error may be the consequence of a silent peer
        self._thread = None
        if ctx is None:
            return
        from torch.distributed import distributed_c10d as c10d

        self.store = c10d._get_default_store()
        self._reading.set()
        self.store.add(_BEAT_KEY.format(ctx.rank), 1)
        _OUTCOME.update(code=None, watch=self)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigterm)
        self._thread = threading.Thread(target=self._poll, name="vdbench-failure-watch", daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.wait(POLL_S):
            try:
                self.store.add(_BEAT_KEY.format(self.ctx.rank), 1)  # alive: beats on while fail() asks the peers
                if self._reading.is_set() and self.store.check([_FAIL_KEY]):
                    who = self.store.get(_FAIL_KEY).decode(errors="replace")
                    self.stop_for_peer(who)
            except Exception:  # the store went away (a peer's exit took the master down): stop as well
                if not self._stop.is_set() and self._reading.is_set():
                    self.stop_for_peer("the process group's store is gone: another rank exited first")

    def silent_peers(self, window_s: float = SILENT_S) -> list[int]:
        """The peers whose heartbeat does not advance within ``window_s`` (waiting only until every peer has beaten
        once: a live peer's watch beats every POLL_S, also while its main thread waits in a collective); [] when
        the store can't be read."""
        if self.store is None:
            return []
        try:
            keys = {r: _BEAT_KEY.format(r) for r in range(self.ctx.world_size) if r != self.ctx.rank}
            first = {r: self.store.add(k, 0) for r, k in keys.items()}
            waiting = set(keys)
            deadline = time.monotonic() + window_s
            while waiting and time.monotonic() < deadline:
                time.sleep(0.1)
                waiting = {r for r in waiting if self.store.add(keys[r], 0) == first[r]}
        except Exception:  # noqa: BLE001 - the store is gone: the callers' store-gone path says so
            return []
        return sorted(waiting)

    @staticmethod
    def silent_message(ranks: list[int]) -> str:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        return (f"{who} stopped without a word (no heartbeat for {SILENT_S:.0f} s: killed by a signal such as "
                "SIGKILL or the OOM killer, or its host is gone)")

    def stop_for_peer(self, who: str) -> None:
        """End this rank because of a peer's failure: say whose, tell the failing rank it was read, exit 4."""
        set_outcome(EXIT_PEER_FAILED)
        print(f"error: rank {self.ctx.rank}: stopping because {who}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # the store is gone with its host: nobody waits for the ack
            self.store.add(_ACK_KEY, 1)
        os._exit(EXIT_PEER_FAILED)

    def peer_failure(self) -> Optional[str]:
        """A peer's posted failure, if any (None also when the store can't be read)."""
        try:
            if self.store is not None and self.store.check([_FAIL_KEY]):
                return self.store.get(_FAIL_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return None
        return None

    def fail(self, exc: BaseException) -> Optional[str]:
        """Post this rank's failure, unless a peer's came first: one atomic compare-and-set elects the first
        failure of the run, so which rank failed and which stopped because of it (exit EXIT_PEER_FAILED) doesn't
        depend on thread timing -- a rank whose collective broke because a peer died reads that peer's failure
        here. Returns the peer's message when a peer failed first (or the store is gone with its host rank),
        None when this rank's failure is the run's."""
        if self.store is None:
            return None
        self._reading.clear()  # this rank's own poller must not take its own flag for a peer's failure
        self._attributing = True
        try:
            posted = self.peer_failure()
            if posted is not None:
                return posted
            # a collective broken by a peer that died without a word: that peer's failure, not this rank's
            silent = self.silent_peers()
            mine = (self.silent_message(silent) if silent
                    else f"rank {self.ctx.rank} failed: {type(exc).__name__}: {exc}"[:2000])
            try:
                first = self.store.compare_set(_FAIL_KEY, "", mine).decode(errors="replace")
            except Exception as e:  # the store is gone: its host rank exited, the run failed there first
                return f"the process group's store is gone ({type(e).__name__}): another rank exited first"
            return None if (first == mine and not silent) else first
        finally:
            self._attributing = False

    def wait_for_peers(self, timeout_s: float = ACK_TIMEOUT_S) -> None:
        """After posting the run's failure: wait until every peer has read it (each adds to an ack counter as it
        stops) or ``timeout_s``, so this rank -- perhaps the store's host -- doesn't pull the store away first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.add(_ACK_KEY, 0) >= self.ctx.world_size - 1:
                    return
            except Exception:  # noqa: BLE001 - the store is gone: its host read the flag and left
                return
            time.sleep(0.1)

    def close(self) -> None:
        """Stop polling and wait for the poller to be out of the store: a thread still inside a store call while
        the process group is torn down (or the interpreter exits) is what ended a rank with SIGABRT ("terminate
        called without an active exception") about once in seven refused runs."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=POLL_S + 5.0)


def maybe_inject_failure(rank: int, where: str, name: Optional[str] = None) -> None:
    """Test hook: ``VDBENCH_TEST_FAIL=<rank>:<where>[:<backend>]`` makes that rank raise there (in the render of
    that backend only, when one is named: one failing render of a batch), for the tests of propagation; with
    ``VDBENCH_TEST_FAIL_SIGNAL=N`` the rank is killed by signal N there instead (9: a rank that dies without a word,
    as the OOM killer ends one)."""
    spec = os.environ.get("VDBENCH_TEST_FAIL")
    if spec and spec in (f"{rank}:{where}", f"{rank}:{where}:{name}"):
        signum = os.environ.get("VDBENCH_TEST_FAIL_SIGNAL")
        if signum:
            print(f"injected signal {signum} on rank {rank} at {where} (VDBENCH_TEST_FAIL_SIGNAL)", file=sys.stderr,
                  flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), int(signum))
        raise RuntimeError(f"injected failure on rank {rank} at {where} (VDBENCH_TEST_FAIL)")


def set_outcome(code: Optional[int]) -> None:
    """The exit code this rank is on its way to; a SIGTERM from torchrun ends the rank with it (FailureWatch)."""
    _OUTCOME["code"] = code


def _on_sigterm(signum, frame) -> None:
    """torchrun stops the remaining workers once one has exited non-zero (or was killed): end with the code this
    rank is on its way to -- its refusal's or failure's, EXIT_PEER_FAILED when a peer's failure is posted or a
    peer fell silent (killed without a word: this rank says which) -- else 128 + SIGTERM (stopped from outside)."""
    code = _OUTCOME.get("code")
    watch = _OUTCOME.get("watch")
    if watch is not None and (code is None or watch._attributing):
        who = watch.peer_failure()
        if who is None:
            silent = watch.silent_peers()
            who = watch.silent_message(silent) if silent else None
        if who is not None:
            watch.stop_for_peer(who)
    os._exit(code if code is not None else 128 + signum)


def finish(ctx: Optional[DistContext], watch: FailureWatch, error: Optional[BaseException], code: int = 1) -> None:
    """End of a run: on error flag it for the peers; on success leave the group cleanly. ``code`` is the exit code
    ``error`` means (the CLI's mapping: 2 for a refusal, 3 for an unsupported call, 1 for a crash)."""
    if ctx is None:
        return
    if error is not None and getattr(error, "_vd_agreed", False):
        # every rank stops here together, each with the message (exit code of the error's kind); they leave the
        # group together too, so no rank's exit (rank 0 hosts the store) pulls the store from under a peer
        set_outcome(code)
        watch.close()
        _leave_group(ctx)
        return
    if error is not None:
        set_outcome(code)
        peer = watch.fail(error)
        watch.close()
        if peer is not None:  # this rank's error is the consequence (a broken collective): say whose failure it was
            watch.stop_for_peer(peer)
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()
        error._vd_reported = True  # its traceback is out: the CLI doesn't print it twice
        watch.wait_for_peers()  # the peers read the flag before this process (perhaps the store's host) goes away
        return
    set_outcome(0)
    watch.close()
    _leave_group(ctx)


def _leave_group(ctx: DistContext) -> None:
    """All ranks at the same point: a barrier, then the process group destroyed (its threads joined) before exit
    -- if this run created it; a group the caller made stays up for the caller's next render."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        if ctx.owns_group:
            dist.destroy_process_group()
