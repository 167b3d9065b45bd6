"""``--profile``: one more decode (or encode) of a config under torch.profiler, its top kernels."""

from __future__ import annotations


def profile_wanted(spec: str, patterns) -> bool:
    """``--profile_configs``: comma-separated shell patterns matched against the config spec (None: all)."""
    import fnmatch

    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(spec, p.strip()) for p in patterns.split(",") if p.strip())


def profile_op(fn, inp, device: str, top: int) -> dict:
    """One decode (or encode) under ``torch.profiler``: the ``top`` kernels by device time (CUDA/HIP kernels,
    memcpy and memset on a GPU; aten ops by self CPU time on the CPU), with calls, total ms and % of the total."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        out = fn(inp)
        if cuda:
            torch.cuda.synchronize()
    del out
    # one aggregation for every profile the project writes (vdbench.profiling.kernel_summary: device kernels without
    # the GPU-side annotations, or aten ops' self CPU time on a CPU)
    from ..profiling import kernel_summary

    summary = kernel_summary(prof.events(), top=top)
    return {"time_kind": "self device time" if summary["source"] == "device kernels" else "self CPU time",
            "total_ms": summary["total_ms"],
            "kernels": [{"name": k["name"], "calls": int(k["calls"]), "total_ms": round(k["ms"], 3),
                         "pct": round(100.0 * k["share"], 2)} for k in summary["top"]]}
