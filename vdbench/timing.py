"""Timing that is honest about asynchronous devices, and the timing.json every render appends to.

Rules (see README): device work is timed with CUDA events (or after a synchronize); host clocks are only used
around work that is synchronous (CPU) or after an explicit synchronize. Per-step times come from events
recorded at each step boundary by the pipeline's ``callback_on_step_end``, so they cost no synchronization
during the run; they are read once at the end.

``timing.json`` is a JSON list with one object per repetition. Renders of several backends into one results
directory append to the same list (each object names its ``attention_type`` and carries the run's header:
settings, versions, device), written atomically under a file lock so a crash never leaves a truncated file
and a corrupt file is moved aside, never overwritten.

Profiles live here too, beside the clocks: :class:`StepProfiler` runs ``torch.profiler`` over scheduled denoising
steps (the render's ``--profile_*`` flags) and :func:`kernel_summary` is the one aggregation of profiler events
(device time by kernel and by :data:`KERNEL_CATEGORIES`) that the render and the VAE bench both write.
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

__all__ = ["Clock", "StepTimer", "system_info", "append_timing", "load_timing", "peak_memory", "reset_peak_memory",
           "KERNEL_CATEGORIES", "kernel_category", "kernel_summary", "StepProfiler"]


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


#: Kernel-name patterns per category, first match wins (lower-case substrings). What a step's GPU time goes to
#: -- attention kernels, GEMMs, communication, the rest -- is what decides where parallel overhead comes from.
KERNEL_CATEGORIES = (
    ("communication", ("nccl", "all_to_all", "alltoall", "allgather", "all_gather", "reducescatter", "allreduce")),
    ("attention", ("flash", "fmha", "attn", "attention", "sdpa", "sage", "_fwd_kernel", "vdbench")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_", "sm80_", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::linear")),
    ("conv", ("conv", "cudnn", "implicit")),
    ("copy", ("memcpy", "memset", "copy", "cat", "transpose", "permute", "contiguous")),
    ("elementwise/norm", ("elementwise", "vectorized", "reduce", "norm", "softmax", "silu", "gelu", "mul", "add")),
)


def kernel_category(name: str) -> str:
    """The :data:`KERNEL_CATEGORIES` entry a kernel (or aten op) name falls in, "other" if none."""
    low = name.lower()
    for cat, pats in KERNEL_CATEGORIES:
        if any(p in low for p in pats):
            return cat
    return "other"


def kernel_summary(events, top: int = 40) -> dict:
    """GPU time by kernel and by category from profiler events (device-side events; on a CPU-only run, the CPU
    operators' self time). Times in ms summed over the profiled steps."""
    # kernels only: GPU-side user annotations (ProfilerStep#N, nccl:all_to_all, record_function ranges) span
    # kernels that are counted themselves
    dev = [e for e in events if getattr(e, "device_type", None) is not None
           and e.device_type.name in ("CUDA", "HIP", "PrivateUse1") and not getattr(e, "is_user_annotation", False)
           and not e.name.startswith(("ProfilerStep", "nccl:"))]
    source = "device kernels" if dev else "cpu operators (self time)"
    by: dict = {}
    if dev:
        for e in dev:
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            n, c = by.get(e.name, (0.0, 0))
            by[e.name] = (n + t / 1e3, c + 1)
    else:
        for e in events:
            if e.name.startswith("aten::"):
                n, c = by.get(e.name, (0.0, 0))
                by[e.name] = (n + e.self_cpu_time_total / 1e3, c + 1)
    total = sum(t for t, _ in by.values())
    cats: dict = {}
    for name, (t, _) in by.items():
        k = kernel_category(name)
        cats[k] = cats.get(k, 0.0) + t
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return {"source": source, "total_ms": total,
            "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n, "calls": c, "ms": t, "share": t / total if total else 0.0, "category": kernel_category(n)}
                    for n, (t, c) in rows]}


class StepProfiler:
    """torch.profiler over denoising steps (scheduled wait/warmup/active), one Chrome trace per rank and cycle,
    and beside it the :func:`kernel_summary` of the same steps (where a step's GPU time went, by category)."""

    def __init__(self, out_dir: Path, rank: int, wait: int, warmup: int, active: int, device):
        from torch.profiler import ProfilerActivity, profile, schedule

        out_dir.mkdir(parents=True, exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
        self.paths: list[Path] = []

        def ready(prof):
            path = out_dir / f"rank{rank}_step{prof.step_num}.json"
            prof.export_chrome_trace(str(path))
            self.paths.append(path)
            summary = kernel_summary(prof.events())
            summary["active_steps"] = active
            (out_dir / f"kernels_rank{rank}_step{prof.step_num}.json").write_text(json.dumps(summary, indent=1))

        self.prof = profile(activities=acts, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                            on_trace_ready=ready, record_shapes=True)

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        return self.prof.__exit__(*exc)

    def step(self):
        self.prof.step()
