"""The render's prewarms, started from one place (:class:`Prewarms`): what a first call would otherwise pay inside a
timed step or the decode, paid ahead while the host waits anyway. Each starts at the moment of the load that hides
it best:

* the attention backend's first-call kernels (:mod:`vdbench.backends.prewarm`, in a worker process: no GIL taken
  from the load) at the load's start -- the first attention call comes right after the load and the text encode, so
  only the load can hide them --, or at its end where the call shapes need configs only the load reads;
* the fast VAE path's kernels (:mod:`vdbench.vae.prewarm`, on a thread) at the load's end -- the compile holds the
  GIL for tens of ms at a time, which the load's Python needs and the denoising's waiting thread does not --, except
  an image-to-video encode part, which runs before the denoising: that one starts with the load;
* the fused RoPE's and block's kernels (:func:`vdbench.kernels.rope.prewarm`, :func:`vdbench.kernels.block.prewarm`,
  each on a thread) once the weights are loaded;
* the scheduler's first-call costs (:func:`vdbench.pipelines.prewarm_scheduler`) in the load itself.

What each did is data: the records in the timing entries, :attr:`AttentionStart.after_load` for a start that waits
for the load.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .. import backends as B
from ..backends import prewarm as AP
from ..patching.schedule import as_schedule
from ..pipelines import prewarm_scheduler, run_scheduler_ahead, run_scheduler_blocking, transformers_of
from ..vae import prewarm as W
from .plan import Plan

__all__ = ["Prewarms", "AttentionStart", "CallShapes", "KernelPrewarm", "attention_calls", "start_vae",
           "start_attention", "start_rope", "start_block", "rope_prewarm", "block_prewarm"]


@dataclass
class Prewarms:
    """The prewarms of one render, each started by the method named after its moment of the load: :meth:`at_load_start`,
    :meth:`after_weights`, :meth:`ready_scheduler` (in the load, waited for), :meth:`at_load_end`. The stages after read
    them here: the decode waits for ``vae``, the first attention call for ``attention``, the first fused RoPE and block
    calls for ``rope`` and ``block``; the timing entries record them."""

    vae: object = None  # vdbench.vae.prewarm.Prewarm, or None
    attention: "AttentionStart" = field(default_factory=lambda: AttentionStart())
    rope: Optional["KernelPrewarm"] = None
    block: Optional["KernelPrewarm"] = None
    scheduler: Optional[dict] = None  # the scheduler's prewarm record (run.resolved.scheduler_prewarm)

    def at_load_start(self, plan: Plan) -> None:
        """An image's VAE encode part (it comes before the denoising) and the attention backend's kernels."""
        self.vae, self.attention = start_vae(plan, encode_only=True), start_attention(plan)

    def after_weights(self, plan: Plan, pipe) -> None:
        """The fused RoPE's and block's kernels, ready before the first step: from here the load's remaining parts
        (the parallel engine's set-up, the collectives' warm-up, the speed options) and the text encode mostly wait
        on the GPU."""
        fused = plan.device.type == "cuda" and (plan.fused_rope is None or plan.fused_block is None)
        own = _self_attention_calls(plan, pipe) if fused else None  # the call shapes read once, for both
        self.rope = start_rope(plan, own)
        self.block = start_block(plan, own)

    def ready_scheduler(self, plan: Plan, pipe) -> dict:
        """The scheduler readied for the steps, its records (``run.resolved``): its first-call costs (cuSOLVER's load
        at a multistep solver's third step) paid now, not in a step (``scheduler_prewarm``); then -- after the
        prewarm, whose dry run copies the scheduler -- its steps made not to wait for the device
        (``scheduler_async``)."""
        cfg, device = plan.cfg, plan.device
        if not cfg.scheduler_prewarm:
            self.scheduler = {"status": "skipped", "why": "--scheduler_prewarm off"}
        elif device.type != "cuda":
            self.scheduler = {"status": "skipped", "why": "not a CUDA device"}
        else:
            self.scheduler = prewarm_scheduler(pipe.scheduler, cfg.num_inference_steps, device, plan.dtype)
        if not cfg.scheduler_async or device.type != "cuda":
            run_scheduler_blocking(pipe.scheduler)  # a pipeline loaded once keeps what an earlier render set
            ahead = {"status": "skipped", "why": "--scheduler_async off" if not cfg.scheduler_async
                     else "not a CUDA device"}
        else:
            ahead = run_scheduler_ahead(pipe.scheduler)
        return {"scheduler_prewarm": self.scheduler, "scheduler_async": ahead}

    def at_load_end(self, plan: Plan, pipe) -> None:
        """Under the text encode and the denoising, where the main thread waits on the GPU: the VAE's kernels (unless
        an encode part started them), and the attention's where its call shapes waited for the loaded configs."""
        if self.vae is None:
            self.vae = start_vae(plan, pipe)
        if self.attention.after_load:
            self.attention = start_attention(plan, pipe)

    def close(self) -> None:
        """The attention prewarm's worker stopped if it still runs (the load failed, or the calls are over)."""
        if self.attention.prewarm is not None:
            self.attention.prewarm.close()


def start_vae(plan: Plan, pipe=None, *, encode_only: bool = False):
    """The fast VAE path's first-call compiles started on a thread (:mod:`vdbench.vae.prewarm`), on a meta-device VAE
    built from the model's VAE config; None where there is nothing to compile ahead, ``--no_vae_prewarm``, or
    (``encode_only``) the prewarm has no encode part. ``pipe``: the loaded pipeline, whose VAE's config serves where
    the model's could not be read before the load (a hub id downloaded by it).

    When: beside the load's Python (random-weight init, module building) the compile slows the load by about its
    own length (an H200's Wan 1.3B renders: load 11.2 s without, 12.1-15.7 s with it on the load); beside the
    denoising it costs nothing (see the module's docstring)."""
    cfg, device = plan.cfg, plan.device
    if not cfg.vae_prewarm or device.type != "cuda" or cfg.offload != "none" or cfg.vae_tiling:
        return None
    image = plan.model.image
    if encode_only and not image:
        return None
    spec = plan.model.vae if pipe is None else (type(pipe.vae).__name__, dict(pipe.vae.config))
    if spec is None:
        return None
    p = W.plan(vae_class=spec[0], device=device, decode_mode=plan.decode.mode, decode_options=plan.decode.options,
               encode_mode=plan.encode.mode if image else None, encode_options=plan.encode.options,
               pixel_hw=(cfg.height, cfg.width), first_use=not cfg.compile, frames=cfg.num_frames)
    if encode_only and (p is None or p.encode is None):
        return None
    dtype = plan.vae_dtype or plan.dtype
    return W.start_thread(lambda: W.meta_vae(spec[0], spec[1]).to(dtype), p)


@dataclass(frozen=True)
class CallShapes:
    """The distinct attention call shapes of a render (:class:`vdbench.backends.CallShape`), or None and why not;
    ``after_load``: none yet because the model's configs are read with the load (a hub id it downloads)."""

    calls: Optional[list]
    why: str = ""
    after_load: bool = False


def attention_calls(plan: Plan, pipe=None) -> CallShapes:
    """The render's attention call shapes, from its family's ``attention_calls`` over every denoiser's config.
    ``pipe``: the loaded pipeline, whose components' configs serve where the model's could not be read before the
    load."""
    cfg, family, model = plan.cfg, plan.family, plan.model
    if family.attention_calls is None:
        return CallShapes(None, f"family {family.name!r} does not give its attention call shapes "
                                "(Family.attention_calls)")
    if pipe is not None:
        denoisers = [dict(m.config) for _, m in transformers_of(pipe)]
        vae = dict(pipe.vae.config)
    elif model.denoisers and model.vae:
        denoisers, vae = [c for _, c in model.denoisers.values()], model.vae[1]
    else:
        return CallShapes(None, "the model's configs are read with the load", after_load=True)
    calls = []
    for den in denoisers:
        calls += family.attention_calls(den, vae, cfg.height, cfg.width, cfg.num_frames, cfg.guidance_scale,
                                        dict(cfg.extra_pipe_kwargs))
    return CallShapes([B.CallShape(*c) for c in dict.fromkeys(calls)])


@dataclass(frozen=True)
class AttentionStart:
    """What starting the attention prewarm came to: the prewarm (:class:`vdbench.backends.prewarm.Prewarm`), or None
    and -- where a backend of the render has a prewarm -- the record of why not (the first entry's
    ``attention_prewarm``); ``after_load``: not started because the call shapes wait for the load's configs."""

    prewarm: object = None
    record: Optional[dict] = None
    after_load: bool = False


def start_attention(plan: Plan, pipe=None) -> AttentionStart:
    """The attention prewarm started for this render: the first-call kernels of every backend it runs that has a
    ``prewarm``, compiled for its call shapes. ``pipe``: see :func:`attention_calls`."""
    entries = [b for b in as_schedule(plan.backend).members if b.prewarm is not None]
    if not entries:  # nothing to compile ahead: nothing recorded
        return AttentionStart()
    names = [b.name for b in entries]
    if not plan.cfg.attention_prewarm:
        return AttentionStart(record={"status": "off", "backends": names, "why": "--attention_prewarm off"})
    if plan.dctx.distributed:
        return AttentionStart(record={"status": "skipped", "backends": names,
                                      "why": "under torchrun each rank's call shapes follow the parallel split: the "
                                             "first calls compile their own kernels"})
    try:
        shapes = attention_calls(plan, pipe)
    except Exception as e:  # noqa: BLE001 - a config the family's rule can't read: recorded and said, never raised
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return AttentionStart(record={"status": "failed", "backends": names,
                                      "error": f"the call shapes: {type(e).__name__}{': ' + first if first else ''}"})
    if shapes.calls is None:
        return AttentionStart(record={"status": "skipped", "backends": names, "why": shapes.why},
                              after_load=shapes.after_load)
    return AttentionStart(AP.start(entries, shapes.calls, plan.device, plan.dtype))


class KernelPrewarm:
    """One of the render's fused kernels (``--fused_rope``, ``--fused_block``) imported, compiled and loaded on a
    thread -- its module's ``prewarm`` (``vdbench.kernels.<kernel>.prewarm``) over each of ``forms``, the render's
    shapes, counting the kernels -- from the end of the weights' load to the text encode (where the main thread mostly
    waits on the GPU); the first fused call waits for it (:meth:`wait`). Without it that call pays Triton's import,
    the compile on an empty cache and the module load inside the first step: the module is imported on the thread,
    its Triton import being part of what the thread takes off the first step. A failure is recorded, never raised:
    the first call then compiles its own. ``record``: what it compiles for, recorded with its outcome."""

    def __init__(self, kernel: str, record: dict, forms: list[tuple]):
        self.record: dict = {"status": "running", **record}
        self._waited: Optional[float] = None
        self._kernel, self._forms = kernel, forms
        self._thread = threading.Thread(target=self._run, name=f"vdbench-{kernel}-prewarm", daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        try:
            module = importlib.import_module(f"..kernels.{self._kernel}", __package__)
            self.record.update(status="done", compiled=sum(module.prewarm(*form) for form in self._forms))
        except Exception as e:  # noqa: BLE001 - recorded; the first call compiles its own kernel instead
            self.record.update(status="failed", error=f"{type(e).__name__}: {str(e).strip()[:200]}")
        self.record["seconds"] = round(time.perf_counter() - self._t0, 4)

    def wait(self) -> None:
        t = time.perf_counter()
        self._thread.join()
        self._waited = time.perf_counter() - t

    def as_dict(self) -> dict:
        return {**self.record, "waited_s": None if self._waited is None else round(self._waited, 4)}


def rope_prewarm(calls: list, device, dtype, ulysses: int) -> KernelPrewarm:
    """The fused RoPE's kernel for these self-attention calls at Ulysses degree ``ulysses``
    (:func:`vdbench.kernels.rope.prewarm`), on a thread."""
    return KernelPrewarm("rope", {"calls": [list(c) for c in calls], "ulysses": ulysses},
                         [(c.seq, c.heads, c.head_dim, dtype, device, ulysses) for c in calls])


def block_prewarm(forms: list, device, dtype) -> KernelPrewarm:
    """The fused block's kernels for these (tokens, width) of a block call (:func:`vdbench.kernels.block.prewarm`),
    on a thread."""
    return KernelPrewarm("block", {"forms": [list(f) for f in forms]},
                         [(tokens, dim, dtype, device) for tokens, dim in forms])


def _self_attention_calls(plan: Plan, pipe) -> Optional[list]:
    """The render's self-attention call shapes (its family's call shapes with as many keys as queries), or None
    where they can't be read."""
    try:
        calls = attention_calls(plan, pipe).calls
    except Exception:  # noqa: BLE001 - no shapes, no prewarm: the first call compiles its own kernel
        return None
    return [c for c in calls if c.seq == c.seq_kv and c.heads == c.heads_kv] if calls else None


def start_rope(plan: Plan, own: Optional[list]) -> Optional[KernelPrewarm]:
    """The fused RoPE's prewarm for a render that fuses its RoPE on CUDA, for its self-attention calls ``own`` at its
    Ulysses degree (1 under CFG alone or in one process); None otherwise."""
    spec = plan.dctx.spec  # one process: every degree 1
    if plan.fused_rope is not None or plan.device.type != "cuda" or spec.ring_degree > 1:
        return None
    return rope_prewarm(own, plan.device, plan.dtype, spec.ulysses_degree) if own else None


def start_block(plan: Plan, own: Optional[list]) -> Optional[KernelPrewarm]:
    """The fused block's prewarm for a render that fuses its blocks on CUDA: each self-attention call's (``own``)
    tokens (a rank's share of the sequence under context parallelism) by the model's width; None otherwise."""
    if plan.fused_block is not None or plan.device.type != "cuda":
        return None
    share = plan.dctx.spec.sequence_degree
    forms = sorted({(c.seq // share, c.heads * c.head_dim) for c in own or ()})
    return block_prewarm(forms, plan.device, plan.dtype) if forms else None
