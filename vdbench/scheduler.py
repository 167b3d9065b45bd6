"""A loaded pipeline's scheduler around the timed steps: its first-call costs paid in the load
(:func:`prewarm_scheduler`, ``--scheduler_prewarm``) and its steps run without making the host wait for the device
(:func:`run_scheduler_ahead`, ``--scheduler_async``; :func:`settle_scheduler` after each call,
:func:`run_scheduler_blocking` to undo it). Both leave the render's values as they are: the same kernels on the
same numbers."""

from __future__ import annotations

import copy
import time
from typing import Optional

import torch

__all__ = ["SchedulerAhead", "prewarm_scheduler", "run_scheduler_ahead", "run_scheduler_blocking", "settle_scheduler"]


def prewarm_scheduler(scheduler, steps: int, device, dtype) -> dict:
    """Run a copy of ``scheduler`` through ``steps`` steps on a tiny random sample on ``device``, so the first-call
    costs its step pays (a library loaded on its first call: diffusers' multistep solvers call ``torch.linalg.solve``
    from their third step on, and its first call on a CUDA device loads cuSOLVER) are paid in the load, not inside a
    timed step where they would pass for step time. The pipeline's own scheduler is left as it was, and so is every
    random number generator (a stochastic scheduler draws from them). Returns the record: ``status`` (``done`` or
    ``skipped``), ``s`` (its time, host clock after a synchronize), ``why`` where skipped."""
    t0 = time.perf_counter()
    try:
        dry = copy.deepcopy(scheduler)
        dry.set_timesteps(steps, device=device)
        g = torch.Generator(device=device).manual_seed(0)
        with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
            sample = torch.randn(1, 4, 2, 2, 2, device=device, generator=g)
            for t in dry.timesteps:
                noise = torch.randn(sample.shape, device=device, generator=g).to(dtype)
                sample = dry.step(noise, t, sample, return_dict=False)[0]
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - a scheduler this dry run can't drive is simply not prewarmed, and says so
        return {"status": "skipped", "why": f"{type(scheduler).__name__}: {type(e).__name__}: {e}"[:200]}
    return {"status": "done", "scheduler": type(scheduler).__name__, "steps": steps,
            "s": round(time.perf_counter() - t0, 4)}


# ----- the scheduler's step without waiting for the device -----
#
# diffusers' multistep solvers keep their sigmas on the CPU and move the few they need each step with ``.to(device)``
# (UniPC: four to six per step); a pageable copy to the device waits for the stream to drain, and so does
# ``torch.linalg.solve``'s error check (the corrector's solve from the third step on). Each step therefore starts with
# an empty device queue: the GPU idles while the host issues the scheduler's tail and the next transformer call's
# first small kernels (3-10 ms a step measured under Ulysses, where that host work is longest). Making the same
# copies from pinned memory without blocking, and the same solve without its check, moves the same values through
# the same kernels: the render's bits are unchanged, only the host stops waiting.

_AHEAD_MAX_ELEMENTS = 4096  # the copies made ahead: a scheduler's scalars and coefficient vectors, never a sample


def _ahead_copy_target(src, args: tuple, kwargs: dict):
    """The CUDA device ``src.to(*args, **kwargs)`` copies a small CPU tensor to, where that copy can be made from
    pinned memory without blocking and give the same tensor: a blocking copy to a CUDA device that keeps the dtype
    and layout; else None (the call then runs as it is)."""
    if not isinstance(src, torch.Tensor) or src.device.type != "cpu" or src.numel() > _AHEAD_MAX_ELEMENTS:
        return None
    if kwargs.get("copy") or any(isinstance(a, bool) for a in args):  # positional non_blocking / copy: left alone
        return None
    try:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return None
    if device is None or device.type != "cuda" or non_blocking or memory_format is not None:
        return None
    if dtype is not None and dtype != src.dtype:
        return None
    return device


class SchedulerAhead:
    """What :func:`run_scheduler_ahead` made ahead during one pipeline call: ``copies`` (CPU -> device copies made
    from pinned memory without blocking), ``solves`` (linear solves made without their blocking check, their error
    codes kept for :func:`settle_scheduler`)."""

    def __init__(self):
        self.copies = 0
        self.solves = 0
        self.infos: list = []

    def as_dict(self) -> dict:
        return {"copies": self.copies, "solves": self.solves}


class _AheadMode(torch.overrides.TorchFunctionMode):
    """Active only inside a scheduler's ``step``: the two calls that make the host wait for the device, made
    without the wait (see the comment above :func:`_ahead_copy_target`)."""

    def __init__(self, record: SchedulerAhead):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args:
            device = _ahead_copy_target(args[0], args[1:], kwargs)
            if device is not None:
                self.record.copies += 1
                return args[0].pin_memory().to(device, non_blocking=True)
        elif func is torch.linalg.solve and "out" not in kwargs:
            result, info = torch.linalg.solve_ex(*args, check_errors=False, **kwargs)
            self.record.solves += 1
            self.record.infos.append(info)
            return result
        return func(*args, **kwargs)


_AHEAD_CLASSES: dict = {}


def _ahead_class(cls: type) -> type:
    """``cls`` with its ``step`` run under :class:`_AheadMode` (one subclass per scheduler class, named as it, so
    records and ``from_config`` see the scheduler they know)."""
    if getattr(cls, "_vdbench_ahead", False):
        return cls
    if cls not in _AHEAD_CLASSES:
        def step(self, *args, **kwargs):
            record = self.__dict__.setdefault("_vdbench_ahead_record", SchedulerAhead())
            with _AheadMode(record):
                return cls.step(self, *args, **kwargs)

        _AHEAD_CLASSES[cls] = type(cls.__name__, (cls,), {"step": step, "_vdbench_ahead": True,
                                                          "__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__})
    return _AHEAD_CLASSES[cls]


def run_scheduler_ahead(scheduler) -> dict:
    """Let the host run ahead of the device through ``scheduler``'s steps (``--scheduler_async``): its CPU -> device
    copies of scalars are made from pinned memory without blocking and its ``torch.linalg.solve`` calls without
    their error check, so no step drains the device queue. The values and kernels are the same. The scheduler keeps
    its class's name and behaviour (it becomes a subclass whose ``step`` runs under the mode); a copy of it
    (``copy.deepcopy``) is one too. Returns the record for timing.json (``status``, ``scheduler``)."""
    scheduler.__class__ = _ahead_class(type(scheduler))
    return {"status": "on", "scheduler": type(scheduler).__name__}


def run_scheduler_blocking(scheduler) -> None:
    """Undo :func:`run_scheduler_ahead` (a pipeline loaded once and rendered again with ``--scheduler_async off``)."""
    cls = type(scheduler)
    if getattr(cls, "_vdbench_ahead", False):
        scheduler.__class__ = cls.__mro__[1]
        scheduler.__dict__.pop("_vdbench_ahead_record", None)


def settle_scheduler(scheduler) -> Optional[dict]:
    """After a pipeline call: what ``scheduler`` made ahead in it (``copies``, ``solves``; None where it does not
    run ahead), its record reset for the next call. Raises ``RuntimeError`` where one of its linear solves failed
    (a singular system: the call's latents are not valid), which the check skipped during the call would have
    raised (one synchronization here, after the denoising)."""
    record = scheduler.__dict__.pop("_vdbench_ahead_record", None)
    if not getattr(type(scheduler), "_vdbench_ahead", False):
        return None
    if record is None:
        return SchedulerAhead().as_dict()
    codes = torch.stack([info.reshape(-1).amax() for info in record.infos]).tolist() if record.infos else []
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        raise RuntimeError(f"{type(scheduler).__name__}: its linear solve {failed[0] + 1} of {len(record.infos)} in "
                           "this call found a singular system; the latents are not valid "
                           "(hint: --scheduler_async off raises it where it happens)")
    return record.as_dict()
