"""The one aggregation of profiler events (:func:`kernel_summary`: device time by kernel and by
:data:`KERNEL_CATEGORIES`) that the render's step profiler (:class:`vdbench.timing.StepProfiler`) and the VAE bench
both write."""

from __future__ import annotations

__all__ = ["KERNEL_CATEGORIES", "kernel_category", "kernel_summary"]


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
