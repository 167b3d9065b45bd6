"""A step cache checked before the load, applied to the loaded denoisers (each its own config), and under torchrun
its data-dependent decisions made one for the ranks sharing a call. See :mod:`vdbench.cache`."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..pipelines import DENOISERS, step_denoisers
from .counter import CacheCounter
from .spec import CacheSpec

__all__ = ["check_cache", "apply_cache", "share_decisions"]


def check_cache(spec: Optional[CacheSpec], family, denoisers: Optional[dict] = None, *,
                compiled: bool = False, cfg_split: bool = False, steps: int = 1,
                pipeline_class: Optional[str] = None) -> None:
    """Refuse (ValueError, one line and a hint) a cache that can't run: the kind's own refusal against the family
    and its parameters, diffusers' config refusing the values, torch.compile of a kind whose hooks sit inside the
    blocks (their per-call Python would be traced: a graph break, which the regional compile's fullgraph refuses;
    the whole-block kinds wrap the compiled blocks from outside), FasterCache's skip of
    the unconditional half of a guidance batch whose halves are on two ranks (``cfg_split``: ``--use_cfg_parallel``),
    and, where the denoisers' configs are known without weights (``denoisers``: name -> (class name, config)), a
    second expert's own value (``<name>_2``) given to a model of one denoiser or a value of one expert alone given to
    a model of two (:func:`_expert_refusal`), a cache diffusers can't apply to them or that would hook no module
    (built on the meta device). Under torchrun otherwise every kind runs: :func:`apply_cache` makes the ranks'
    decisions one (``group``)."""
    if spec is None:
        return
    why = spec.kind.refusal(family, spec.params, pipeline_class)
    if why:
        raise ValueError(f"--cache {spec.name}: {why}")
    if cfg_split and spec.kind.name == "faster" and not spec.params.get("is_guidance_distilled"):
        raise ValueError(f"--cache {spec.name} with --use_cfg_parallel: FasterCache skips the unconditional half of "
                         "each guidance batch, and the CFG split puts the two halves on two ranks\nuse "
                         "faster:is_guidance_distilled=true (the attention cache alone), or drop --use_cfg_parallel")
    if cfg_split and spec.kind.across_calls and family is not None and not family.guidance_in_one_batch:
        raise ValueError(f"--cache {spec.name} with --use_cfg_parallel: diffusers' {spec.kind.config} keeps one state "
                         f"per attention module for every denoiser call, so on one process the {family.name} "
                         "pipeline's unconditional call of a step reuses its conditional call's output; a CFG split's "
                         "rank holds one branch and would reuse its previous step's instead (another render than one "
                         "process's)\nuse a cache whose state is per guidance branch (fbc, mag, taylor, sea), or "
                         "drop --use_cfg_parallel")
    if compiled and spec.kind.inside_blocks:
        raise ValueError(f"--cache {spec.name} with --use_torch_compile: its hooks sit on the attention modules "
                         "inside the compiled blocks and decide per call in Python (a graph break the regional "
                         "compile refuses)\nuse a cache of whole blocks (fbc, mag, sea) with the compile, or drop one")
    try:
        spec.build(_Stand(), steps, family)
    except (ValueError, TypeError) as e:
        lines = str(e).strip().splitlines()
        raise ValueError(f"--cache {spec.name}: diffusers refuses it: {lines[0]}\n"
                         + " ".join(ln.strip() for ln in lines[1:])) from None
    if denoisers:
        _expert_refusal(spec, list(denoisers))
    for name, (cls_name, config) in (denoisers or {}).items():
        import diffusers

        cls = getattr(diffusers, cls_name or "", None)
        if cls is None:
            continue
        with torch.device("meta"):
            model = cls.from_config(config)
        _hooked_or_refuse(spec, model, name, family, steps)


class _Stand:
    """A pipeline stand-in for building a config before the load (its callbacks are not called)."""

    current_timestep = None


def _hooked(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and getattr(getattr(m, "_diffusers_hook", None), "hooks", None)]


def _expert_refusal(spec: CacheSpec, names: list[str]) -> None:
    """A kind's per-expert parameter (:attr:`CacheKind.per_expert`): its second expert's value (``<name>_2``) is
    refused for a model of one denoiser, and on a model of two experts a value given for one alone -- the other
    would run with a value fitted to nothing of its own (MagCache's ratios are each expert's)."""
    two = DENOISERS[1] in names
    for name in spec.kind.per_expert:
        first, second = (spec.given.get(k) is not None for k in (name, f"{name}_2"))
        if second and not two:
            raise ValueError(f"--cache {spec.name}: {name}_2 is the second expert's (Wan 2.2's {DENOISERS[1]}); this "
                             f"model has one denoiser\ndrop {name}_2")
        if two and first != second:
            given, missing = (name, f"{name}_2") if first else (f"{name}_2", name)
            raise ValueError(f"--cache {spec.name}: this model has two experts, each with its own {name}; {given} "
                             f"is given, {missing} not\ngive {name} ({DENOISERS[0]}'s, the high-noise expert) and "
                             f"{name}_2 ({DENOISERS[1]}'s), e.g. both from a calibrating render's timing.json "
                             f"({name}=@FILE,{name}_2=@FILE)")


def _hooked_or_refuse(spec, model, name, family, steps, pipe=None) -> list[str]:
    if not hasattr(model, "enable_cache"):
        raise ValueError(f"--cache {spec.name}: {name} ({type(model).__name__}) has no diffusers cache support "
                         "(CacheMixin)\nrender without --cache")
    try:
        model.enable_cache(spec.build(pipe if pipe is not None else _Stand(), steps, family, denoiser=name))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--cache {spec.name}: diffusers can't apply it to {name} ({type(model).__name__}): "
                         f"{str(e).strip().splitlines()[0]}\nrender without --cache or with another kind") from None
    hooked = _hooked(model)
    if not hooked:
        raise ValueError(f"--cache {spec.name}: diffusers' {spec.kind.config} hooks no module of {name} "
                         f"({type(model).__name__}): nothing would be cached\nrender without --cache or with "
                         "another kind")
    return hooked


def apply_cache(spec: CacheSpec, pipe, models, *, steps: int, family,
                group: Optional[Callable[[], Any]] = None) -> "CacheCounter":
    """``enable_cache`` on every denoiser (Wan 2.2's ``transformer_2`` too), its units' forwards counted; returns
    the counter (its :meth:`CacheCounter.summary` is timing.json's ``cache``).

    Each denoiser's config is its own: the steps it runs (of Wan 2.2's ``steps``, the high-noise expert's first
    share and the low-noise expert's rest: :func:`vdbench.pipelines.step_denoisers`) and its own values of the
    kind's per-expert parameters; diffusers' hooks keep each denoiser's state apart (no residual crosses the
    experts' switch), and a MagCache counts each expert's steps from its first, reads its own ratios and logs its
    own calibration at its last step. A kind's refusal of a denoiser's first call (:attr:`CacheKind.first_call_refusal`,
    at that denoiser's first timestep) comes before any hook goes on.

    ``group`` (torchrun, where each rank computes a shard of the denoiser's calls): the process group of the ranks
    sharing a call (:func:`vdbench.parallel.shard_group`), asked when a decision is reduced; a decision read from the
    data would be each rank's own, :func:`share_decisions` makes it one for them. The hooks must see the shard:
    under diffusers' context parallelism the cache goes on before ``enable_parallelism``, whose split and gather
    hooks then wrap it (the render's order)."""
    names = [name for name, _ in models]
    _expert_refusal(spec, names)
    by_step = step_denoisers(pipe, steps)
    own = {name: [t for d, t in by_step if d == name] for name in names}
    for name in names:
        why = own[name] and spec.kind.first_call_refusal(spec.for_denoiser(name), name, own[name][0])
        if why:
            raise ValueError(f"--cache {spec.name}: {why}")
    counter = CacheCounter(spec)
    for name, model in models:
        counter.wrap_candidates(model, name)
        try:  # an expert that runs no step (a boundary past every timestep) is configured for one: never called
            hooked = _hooked_or_refuse(spec, model, name, family, max(1, len(own[name])), pipe)
        except ValueError:
            counter.remove()
            raise
        counter.keep(model, name, hooked)
    if group is not None:
        counter.shared = (share_decisions([m for _, m in models], group)
                          or {spec.kind.name: "a schedule (timestep, step or call counts): alike on every rank"})
    return counter


# ----- under torchrun: one decision for all ranks -----
#
# Under sequence parallelism every rank runs every block on its shard of the tokens, and the blocks' attention is a
# collective: a rank that skips a block while another computes it leaves the other waiting. So a skip decided from
# the data must be the same on every rank of the call. What each kind's decision reads:
#   fbc    -- the first block's relative residual change, measured on the block's output: a shard -> reduced (the
#             two sums of the change, over the ranks: every rank compares the one global figure with threshold).
#   mag    -- skips by the step index and the given ratios: a schedule, alike on every rank. Its calibration
#             (calibrate=true: nothing skipped) measures residual norms on the shard -> the logged ratio reduced
#             (the token-weighted mean over the ranks), so the ratios are the one-process render's.
#   sea    -- its indicator is built from the denoiser's input latents, which every rank holds whole (the split
#             comes at the first block): alike already. Its gate is voted all the same (computed wherever one rank
#             computes), so that a last-bit difference can't leave one rank skipping the collectives another runs.
#   pab, faster, taylor -- by the timestep and their call counters: schedules, alike on every rank.


def share_decisions(models, group: Callable[[], Any]) -> dict:
    """Make the data-dependent decisions of the cache hooks on ``models`` one for the ranks of ``group()`` (a
    torch.distributed process group, asked at each reduction; None: the default group), by wrapping each decision
    function on the hook object (diffusers' code runs unchanged around it). Returns what it wrapped (timing.json's
    ``cache.shared_decisions``)."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook
    from diffusers.hooks.mag_cache import MagCacheBlockHook
    from diffusers.hooks.sea_cache import SeaCacheLeaderBlockHook

    done: dict = {}
    voted: set = set()
    for model in models:
        for m in model.modules():
            for hook in list(getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values()):
                if isinstance(hook, FBCHeadBlockHook):
                    hook._should_compute_remaining_blocks = _reduced_fbc_decision(hook, group)
                    done["fbc"] = "first-block residual change summed over the ranks"
                elif isinstance(hook, MagCacheBlockHook) and hook.is_tail and hook.config.calibrate:
                    hook._perform_calibration_step = _reduced_calibration(hook._perform_calibration_step, group)
                    done["mag"] = "calibration ratio averaged over the ranks' tokens"
                elif isinstance(hook, SeaCacheLeaderBlockHook) and id(hook.shared_state) not in voted:
                    voted.add(id(hook.shared_state))
                    hook.shared_state.resolve_gate = _voted_gate(hook.shared_state.resolve_gate, group)
                    done["sea"] = "gate voted (computed where any rank computes)"
    return done


def _reduced_fbc_decision(hook, group):
    """FirstBlockCache's decision on the whole sequence: the relative mean change of the first block's residual
    (mean |now - before| / mean |before|, the figure diffusers compares with ``threshold``) from the two sums over
    every rank's tokens. The shards are equal in size, so the ratio of the sums is the ratio of the means (xfuser
    pads a sequence to a multiple of its degree: there the padding tokens count too)."""
    import torch.distributed as dist

    from ..parallel import maybe_inject_failure

    @torch.compiler.disable
    def should_compute(residual: torch.Tensor) -> bool:
        before = hook.state_manager.get_state().head_block_residual
        if before is None:  # the first call of a context: nothing to compare with, on every rank alike
            return True
        # the tests of a rank failing inside the cache's hook, its peers waiting in this all_reduce
        maybe_inject_failure(dist.get_rank(), "cache")
        sums = torch.stack([(residual - before).abs().sum(dtype=torch.float32),
                            before.abs().sum(dtype=torch.float32)]).double()
        dist.all_reduce(sums, group=group())
        return (sums[0] / sums[1]).item() > hook.threshold

    return should_compute


def _reduced_calibration(step, group):
    """MagCache's calibration step, whose ratio (the mean over tokens of |residual| now / before) diffusers
    appends from this rank's tokens, replaced by the mean over every rank's tokens."""
    import torch.distributed as dist

    def calibration_step(state, residual: torch.Tensor):
        step(state, residual)
        tokens = residual.numel() // residual.shape[-1]
        t = torch.tensor([state.calibration_ratios[-1] * tokens, tokens], dtype=torch.float64,
                         device=residual.device)
        dist.all_reduce(t, group=group())
        state.calibration_ratios[-1] = (t[0] / t[1]).item()

    return calibration_step


def _voted_gate(resolve_gate, group):
    """SeaCache's gate, computed on every rank where any rank computes: its accumulated distance reset there as
    diffusers resets it on a computed step."""
    import torch.distributed as dist

    def voted(state, metadata, indicator, config):
        compute = resolve_gate(state, metadata, indicator, config)
        like = state.gen_input if state.gen_input is not None else (indicator[0] if indicator else None)
        vote = torch.tensor([int(compute)], dtype=torch.int32, device=like.device if like is not None else "cpu")
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group())
        if vote.item() and not compute:
            state.accumulated_distance = 0.0
            state.gate_should_compute = True
            return True
        return compute

    return voted
