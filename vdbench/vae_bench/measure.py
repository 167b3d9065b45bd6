"""One op of a VAE bench config measured: its first call and warm calls timed, its time keys, the frames' quality."""

from __future__ import annotations


def to_frames(video):
    """(1, 3, F, H, W) in [-1, 1] -> (F, H, W, 3) float32 in [0, 1], as diffusers' VideoProcessor does."""
    return (video[0].permute(1, 2, 3, 0).float() / 2 + 0.5).clamp(0, 1)


def quality(frames, ref) -> dict:
    """This bench's columns of ``frames`` vs ``ref`` ((F, H, W, 3) tensors in [0, 1]): the shared frame-quality
    dict (``vdbench.measure.quality.frame_quality``, float64 on the frames' device) under the names its CSV and
    JSON have always used."""
    from ..measure.quality import frame_quality

    q = frame_quality(frames, ref)
    return {"psnr_min": q["psnr_min"], "psnr_mean": q["psnr_mean"], "psnr_all": q["psnr"],
            "ssim_min": q["ssim_min"], "ssim_mean": q["ssim"], "psnr_per_frame": q["psnr_per_frame"],
            "ssim_per_frame": q["ssim_per_frame"]}


def timed(fn, inp, args, device: str, stage, op: str):
    """The first call of ``fn(inp)`` timed on its own, ``--warmup`` - 1 more untimed calls, then ``--repeats`` timed
    warm calls (CUDA events after a synchronize; host clock on CPU): (warm times, the first call's time, peak bytes
    of the torch allocator over the warm calls, the last output). The first call is never a warm sample: it pays
    what is paid once (cuDNN plans, Triton JIT, compiles, allocator growth)."""
    import torch

    from ..timing import Clock

    cuda = device.startswith("cuda")
    times, peak, out = [], 0, None
    warmups = max(1, args.warmup)  # the first call is one of them
    with torch.no_grad():
        stage(f"{op} first call")
        if cuda:
            torch.cuda.synchronize()
        t0 = Clock(torch.device(device))
        out = fn(inp)
        first = t0.seconds_until(Clock(torch.device(device)))
        del out
        for i in range(1, warmups):
            stage(f"{op} warmup {i + 1}/{warmups}")
            out = fn(inp)
            del out
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        out = None
        for i in range(args.repeats):
            stage(f"{op} repeat {i + 1}/{args.repeats}")
            out = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = Clock(torch.device(device))
            out = fn(inp)
            t1 = Clock(torch.device(device))
            times.append(t0.seconds_until(t1))
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated())
    return times, first, peak, out


def time_fields(times, first: float, peak, device: str, prefix: str = "") -> dict:
    """An op's time keys: the warm calls' median with n, p20–p80 and min/max (``vdbench.timing.spread``), the first
    call and its excess over the warm median, the speed verdict, the peak memory."""
    from ..timing import speed_verdict, spread

    st = spread(times)
    ok, why = speed_verdict(device, st["n"])
    out = {f"{prefix}time_s_{k}": st[k] for k in ("median", "min", "max", "p20", "p80", "n")}
    out.update({f"{prefix}times_s": times, f"{prefix}first_call_s": first,
                f"{prefix}first_call_excess_s": first - st["median"], f"{prefix}speed_figure": ok,
                f"{prefix}why_not_speed": why,
                f"{prefix}peak_memory_gib": (peak / 2 ** 30) if device.startswith("cuda") else None})
    return out
