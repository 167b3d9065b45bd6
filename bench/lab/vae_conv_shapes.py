#!/usr/bin/env python3
"""How cuDNN's bf16 channels_last 3-D convolutions of the Wan 2.2 (TI2V-5B) decoder run by shape on this GPU: the
low-resolution head's 3x3x3 convs (1024 channels at 44x80, the latent grid of 704x1280) with 1 to 30 frames a call
(what a decode one latent frame at a time gives them, against a call over many frames), ``conv_in`` (48 -> 1024) the
same, and ``conv_out`` (256 -> 12 at 352x640, 4 frames) with its output channels padded to 16, 32 and 64 (zeros).

    python3 bench/lab/vae_conv_shapes.py -o conv_shapes.json

Warm: the median of 20 timed calls (CUDA events) after 5 warm-up calls, on random inputs; TFLOP/s from the
convolution's multiply-adds.

``--variants``: the decoder's four most costly conv shapes of a steady one-latent-frame chunk (and two frames), each
as cuDNN's heuristics pick it (the fast decode's call: spatial padding by the conv), on an input padded beforehand
(a valid conv), and with ``cudnn.benchmark`` trying its first 10 engines and all of them; each mode in a process of
its own (cuDNN caches a shape's pick per process), the kernel that ran named (torch.profiler)."""

import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F

from vdbench.timing import call_ms, spread


def timed(fn, reps=20, warmup=5):
    """(median, min, max) ms of ``reps`` calls after ``warmup`` (vdbench.timing: CUDA events, its spread)."""
    dev = torch.device("cuda")
    for _ in range(warmup):
        fn()
    s = spread([call_ms(fn, dev) for _ in range(reps)])
    return s["median"], s["min"], s["max"]


def conv_row(what, cin, cout, t, h, w, pt=2):
    dev = torch.device("cuda")
    x = torch.randn(1, cin, pt + t, h, w, device=dev, dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last_3d)
    wt = (torch.randn(cout, cin, 3, 3, 3, device=dev, dtype=torch.bfloat16) / (27 * cin) ** 0.5).contiguous(
        memory_format=torch.channels_last_3d)
    med, lo, hi = timed(lambda: F.conv3d(x, wt, None, 1, (0, 1, 1)))
    flop = 2 * t * h * w * cout * cin * 27
    return {"what": what, "cin": cin, "cout": cout, "frames": t, "hw": [h, w], "ms": round(med, 4),
            "ms_min_max": [round(lo, 4), round(hi, 4)], "ms_per_frame": round(med / t, 4),
            "tflops": round(flop / med / 1e9, 1), "n": 20, "warm": True}


#: (what, C_in, C_out, frames, H, W): per steady chunk the 5 + 1 convs at 352x640 and at 176x320 are 63% of the
#: TI2V-5B decoder's multiply-adds at 1280x704 (vdbench.vae.lean, one latent frame a call: 4 frames there).
VARIANT_SHAPES = [("up3 256->256 at 352x640", 256, 256, 4, 352, 640),
                  ("up3 256->256 at 352x640", 256, 256, 8, 352, 640),
                  ("up3 512->256 at 352x640", 512, 256, 4, 352, 640),
                  ("up2 512->512 at 176x320", 512, 512, 4, 176, 320),
                  ("up2 512->512 at 176x320", 512, 512, 8, 176, 320),
                  ("up1 1024->1024 at 88x160", 1024, 1024, 2, 88, 160)]
MODES = ("heuristic", "valid", "benchmark10", "benchmark_all")


def kernel_names(fn) -> list:
    """The CUDA kernels one call of ``fn`` launches (torch.profiler), longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
    return [e.key[:120] for e in ev if getattr(e, "device_time_total", 0) > 0][:3]


def variant_rows(mode: str) -> list:
    """The rows of :data:`VARIANT_SHAPES` in one mode (this process's cuDNN settings set for it)."""
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = mode.startswith("benchmark")
    torch.backends.cudnn.benchmark_limit = 0 if mode == "benchmark_all" else 10
    rows = []
    for what, cin, cout, t, h, w in VARIANT_SHAPES:
        pad = mode == "valid"
        x = torch.randn(1, cin, 2 + t, h + 2 * pad, w + 2 * pad, device=dev, dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last_3d)
        wt = (torch.randn(cout, cin, 3, 3, 3, device=dev, dtype=torch.bfloat16) / (27 * cin) ** 0.5).contiguous(
            memory_format=torch.channels_last_3d)
        def fn():
            return F.conv3d(x, wt, None, 1, 0 if pad else (0, 1, 1))
        first = call_ms(fn, dev)  # benchmark modes: the engines tried here, once per shape and process
        med, lo, hi = timed(fn)
        flop = 2 * t * h * w * cout * cin * 27
        rows.append({"what": what, "mode": mode, "cin": cin, "cout": cout, "frames": t, "hw": [h, w],
                     "ms": round(med, 4), "ms_min_max": [round(lo, 4), round(hi, 4)], "first_call_ms": round(first, 2),
                     "tflops": round(flop / med / 1e9, 1), "n": 20, "warm": True, "kernels": kernel_names(fn)})
        print(f"{mode:<14} {what:<28} T={t:<2} {med:8.3f} ms {rows[-1]['tflops']:6.1f} TF/s  first {first:8.1f} ms  "
              f"{rows[-1]['kernels'][0][:70]}", flush=True)
        del x, wt
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", required=True, help="the JSON file to write (the rows and the device); required")
    ap.add_argument("--variants", action="store_true",
                    help="the costly shapes in each cuDNN mode (module doc); default: off")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process (--variants' child)
    args = ap.parse_args(argv)
    if args.mode:
        with open(args.out, "w") as f:
            json.dump(variant_rows(args.mode), f)
        return
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    if args.variants:
        rows = []
        for mode in MODES:
            part = f"{args.out}.{mode}.part"
            subprocess.run([sys.executable, __file__, "--mode", mode, "-o", part], check=True)
            with open(part) as f:
                rows += json.load(f)
        with open(args.out, "w") as f:
            json.dump({"system": info, "rows": rows}, f, indent=1)
        return
    torch.backends.cudnn.benchmark = False
    rows = []
    for t in (1, 2, 4, 10, 30):
        rows.append(conv_row("head 3x3x3 1024->1024 at 44x80", 1024, 1024, t, 44, 80))
    for t in (2, 4, 60):
        rows.append(conv_row("up0 3x3x3 1024->1024 at 88x160", 1024, 1024, t, 88, 160))
    for t in (1, 30):
        rows.append(conv_row("conv_in 48->1024 at 44x80", 48, 1024, t, 44, 80))
    for cout in (12, 16, 32, 64):
        rows.append(conv_row(f"conv_out 256->{cout} at 352x640", 256, cout, 4, 352, 640))
    for r in rows:
        print(f"{r['what']:<40} T={r['frames']:<3} {r['ms']:8.3f} ms  {r['ms_per_frame']:7.3f} ms/frame  {r['tflops']:6.1f} TF/s")
    with open(args.out, "w") as f:
        json.dump({"system": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
