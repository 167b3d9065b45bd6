"""Timing that is honest about asynchronous devices, and the timing.json every render appends to.

Rules (see README): device work is timed with CUDA events (or after a synchronize); host clocks are only used
around work that is synchronous (CPU) or after an explicit synchronize. Per-step times come from events
recorded at each step boundary by the pipeline's ``callback_on_step_end``, so they cost no synchronization
during the run; they are read once at the end.

``timing.json`` is a JSON list with one object per repetition. Renders of several backends into one results
directory append to the same list (each object names its ``attention_type`` and carries the run's header:
settings, versions, device), written atomically under a file lock so a crash never leaves a truncated file
and a corrupt file is moved aside, never overwritten.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

__all__ = ["Clock", "StepTimer", "system_info", "append_timing", "load_timing", "peak_memory", "reset_peak_memory"]


class Clock:
    """A point in time on ``device``: a recorded CUDA event on GPU, a host clock after nothing on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.t = time.perf_counter()

    def seconds_until(self, later: "Clock") -> float:
        if self.cuda:
            later.event.synchronize()
            return self.event.elapsed_time(later.event) / 1000.0
        return later.t - self.t


class StepTimer:
    """Per-step times from a ``callback_on_step_end``; chain it with other callbacks via ``then``."""

    def __init__(self, device, then=None):
        self.device = torch.device(device)
        self.marks: list[Clock] = []
        self.then = then

    def start(self):
        self.marks = [Clock(self.device)]

    def __call__(self, pipe, step, timestep, callback_kwargs):
        self.marks.append(Clock(self.device))
        if self.then is not None:
            self.then(step)
        return callback_kwargs

    def step_times(self) -> list[float]:
        return [a.seconds_until(b) for a, b in zip(self.marks, self.marks[1:])]


def summarize_steps(step_times: list[float]) -> dict:
    if not step_times:
        return {"step_time_median": None, "step_time_mean": None}
    return {"step_time_median": statistics.median(step_times), "step_time_mean": statistics.fmean(step_times)}


def reset_peak_memory(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> Optional[int]:
    """Peak bytes allocated by torch on a CUDA device since the last reset; None on CPU (not tracked)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def system_info(device) -> dict:
    dev = torch.device(device)
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "device": str(dev),
    }
    for pkg in ("sageattention", "flash_attn", "fa3-fwd", "xfuser", "triton"):
        v = _version(pkg)
        if v:
            info[pkg] = v
    if dev.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, gpu_capability=f"{p.major}.{p.minor}", gpu_memory_bytes=p.total_memory,
                    gpu_count=torch.cuda.device_count())
    return info


def load_timing(path) -> list:
    """Read a timing.json list; raise ValueError with the path if it isn't one."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: timing.json must hold a JSON list, found {type(data).__name__}")
    return data


def append_timing(path, entries: list[dict]) -> Path:
    """Append ``entries`` to the JSON list at ``path`` atomically (lock, write temp, rename)."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        existing: list = []
        if path.exists():
            try:
                existing = load_timing(path)
            except (ValueError, json.JSONDecodeError) as e:
                aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
                os.replace(path, aside)
                print(f"warning: {path} was not a valid timing list ({e}); moved it to {aside}", file=sys.stderr)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".timing-", suffix=".json.tmp")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the result unreadable to others
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(existing + list(entries), f, indent=1, default=_json_default)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return path


def _json_default(o):
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if isinstance(o, float):
        return o
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
