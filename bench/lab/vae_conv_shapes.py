#!/usr/bin/env python3
"""How cuDNN's bf16 channels_last 3-D convolutions of the Wan 2.2 (TI2V-5B) decoder run by shape on this GPU: the
low-resolution head's 3x3x3 convs (1024 channels at 44x80, the latent grid of 704x1280) with 1 to 30 frames a call
(what a decode one latent frame at a time gives them, against a call over many frames), ``conv_in`` (48 -> 1024) the
same, and ``conv_out`` (256 -> 12 at 352x640, 4 frames) with its output channels padded to 16, 32 and 64 (zeros).

    python3 bench/lab/vae_conv_shapes.py -o conv_shapes.json

Warm: the median of 20 timed calls (CUDA events) after 5 warm-up calls, on random inputs; TFLOP/s from the
convolution's multiply-adds."""

import argparse
import json

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", required=True, help="the JSON file to write (the rows and the device); required")
    args = ap.parse_args()
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
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    with open(args.out, "w") as f:
        json.dump({"system": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
