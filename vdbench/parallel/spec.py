"""The parallel layout of a render and its checks: :class:`ParallelSpec`, which engine serves a request
(:func:`resolve_engine`) and every refusal of a layout, an engine or a backend on a path before any weight loads.

Paths: Ulysses (``--ulysses_degree N``), ring (``--ring_degree N``), hybrid (both > 1); ``--use_cfg_parallel``
doubles the world. Ring merges partial results with each block's log-sum-exp, so the backend must return it
(``Backend.lse_form``); one that can't is refused before the model is loaded (:func:`check_backend_for_path`).
``--parallel_engine auto`` (the default) picks the model family's preferred engine (``Family.preferred_engine``:
the one measured faster for it; diffusers for Wan) where it runs and serves the request, else the other; timing.json
records the request, the engine that ran and why. The engines' names are here, so the package's other modules take
them from it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from .. import backends as B
from .. import families
from ..kernels import interpret_requested

__all__ = ["ENGINES", "ENGINE_CHOICES", "GUIDANCE_OVERLAP_AUTO", "sequence_layout", "ParallelSpec", "resolve_engine",
           "engine_check", "refusal_of", "settle", "settle_engine", "check_backend_for_path", "compile_refusal",
           "fp8_exchange_refusal", "guidance_overlap_refusal", "settle_guidance_overlap", "hooks_in_place",
           "unwired"]

ENGINES = ("xfuser", "diffusers")
ENGINE_CHOICES = ("auto", *ENGINES)  # what --parallel_engine takes; auto is resolved by resolve_engine


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
                             cache: bool, compiled: bool, sparse: bool, sharded: bool = False) -> Optional[str]:
    """Why the two guidance branches can't be interleaved in this render (one line), or None. They can where
    vdbench's Ulysses self-attention runs (its phase ends are the turns), the family's pipelines make two denoiser
    calls per step that differ only in the text, and nothing keeps state across one forward: a step cache (diffusers'
    hooks hold one context at a time), the compiled blocks, a sparse pattern's per-forward token order, FSDP's
    per-block state (``sharded``: ``--offload shard``)."""
    if not (spec.async_applies and spec.async_exchange is not False and not spec.use_cfg_parallel):
        return ("it interleaves Ulysses exchanges: needs --ulysses_degree >= 2 without ring, --ulysses_overlap or "
                "--use_cfg_parallel, with --ulysses_async on diffusers' engine")
    if family.guidance_in_one_batch or family.ulysses_self_attention is None:
        return f"{family.name}'s pipelines run guidance as one batch or have no vdbench Ulysses self-attention"
    if guidance_scale <= 1:
        return f"--guidance_scale {guidance_scale:g} runs one branch per step"
    for on, what in ((cache, "a step cache (its hooks keep one guidance context at a time)"),
                     (compiled, "--use_torch_compile (not measured interleaved)"),
                     (sparse, "a sparse pattern (its token order is kept per forward)"),
                     (sharded, "--offload shard (each block's gather and free run in one order: one host thread)")):
        if on:
            return f"not with {what}"
    return None


def settle_guidance_overlap(ctx, refusal: Optional[str]) -> None:
    """``--guidance_overlap`` under torchrun: ``on`` refused with the reason where it can't apply; ``auto`` settled (on
    where it applies, per :data:`GUIDANCE_OVERLAP_AUTO`) and the reason it is off recorded. ``ctx``: the render's
    process context (:class:`vdbench.parallel.group.DistContext`; one process: nothing to settle)."""
    if not ctx.distributed:
        return
    spec = ctx.spec
    if spec.guidance_overlap is True and refusal:
        raise ValueError(f"--guidance_overlap on: {refusal}\nuse --guidance_overlap auto or off")
    if spec.guidance_overlap is None:
        on = refusal is None and GUIDANCE_OVERLAP_AUTO
        why = None if on else refusal or "auto: off by default"
        ctx.spec = replace(spec, guidance_overlap=on, guidance_overlap_reason=why)
    elif spec.guidance_overlap is False:
        ctx.spec = replace(spec, guidance_overlap_reason="--guidance_overlap off")


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


def settle_engine(ctx, device: torch.device, check: Callable[[Optional[ParallelSpec]], None],
                  family: Optional[families.Family] = None) -> None:
    """The render's engine settled and checked before the load: under torchrun ``ctx.spec`` resolved for this
    request (:func:`resolve_engine`, ``check``'s refusal deciding an ``auto``) and the chosen engine checked; one
    process checked as such. ``check(spec)``: raises why the engine ``spec`` names (None: one process) can't serve
    the request (``BackendUnavailable`` or ValueError)."""
    if not ctx.distributed:
        check(None)
        return
    ctx.spec = resolve_engine(ctx.spec, device, refusal_of(check), family)
    check(ctx.spec)


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
        raise B.BackendUnavailable(unwired(pipeline_class))
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


def unwired(pipeline_class: str) -> str:
    wired = families.xfuser_wired()
    return (f"--parallel_engine xfuser: {pipeline_class} is not wired to xfuser in vdbench ({', '.join(wired)} are); "
            "use --parallel_engine diffusers")


def settle(ctx, device: torch.device, schedule, family: families.Family, task: str, pipeline_class: Optional[str], *,
           compiled: bool, num_steps: int, guidance_scale: float, cache: bool, sharded: bool = False) -> None:
    """A render's parallel layout settled before the load: ``--parallel_engine auto`` becomes the engine that serves
    it (every rank decides alike); the attention ``schedule``'s rules (a :class:`vdbench.patching.schedule.Schedule`)
    and under torchrun the chosen engine's (the backend on its path, the compile) checked; ``--guidance_overlap``
    settled like it (``sharded``: ``--offload shard``); a CFG split refused where guidance runs one branch
    (``guidance_scale`` <= 1)."""
    grid_family = family.name if family.grid_hooks is not None else None

    def check_schedule(spec):  # the schedule's own rules on the engine spec names (a sparse pattern under xfuser)
        schedule.check_plan(num_steps=num_steps, compiled=compiled, parallel=spec, grid_family=grid_family)

    settle_engine(ctx, device, engine_check(device, schedule.members, family, task, pipeline_class, compiled=compiled,
                                            check_schedule=check_schedule), family)
    settle_guidance_overlap(ctx, guidance_overlap_refusal(
        ctx.spec, family, guidance_scale=guidance_scale, cache=cache, compiled=compiled,
        sparse=any(b.sparse is not None for b in schedule.members), sharded=sharded))
    if ctx.spec.use_cfg_parallel and guidance_scale <= 1:
        raise ValueError(f"--use_cfg_parallel splits classifier-free guidance's two branches, and "
                         f"--guidance_scale {guidance_scale:g} runs none\ndrop --use_cfg_parallel, or "
                         "use a guidance scale above 1")
