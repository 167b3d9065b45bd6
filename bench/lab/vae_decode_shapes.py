#!/usr/bin/env python3
"""Where a fast Wan decode's time goes by operator and input shape: one warm decode under torch.profiler with the
shapes recorded, the device time of each (op, input shapes) summed -- the convolutions by shape with their TFLOP/s
in context (the power-capped, cache-sharing decode, not an isolated conv: bench/lab/vae_conv_shapes.py), and every
other op the same way.

    python3 bench/lab/vae_decode_shapes.py --model wan2.2 --size 1280*704 --frames 121 -o decode_shapes.json

Warm: one decode of the same latents first (compiles, cuDNN's plans); the profiled decode is the second."""

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from vdbench.vae import decode as D
from vdbench.vae_bench.models import build_vae, family_of, make_latents


def conv_flop(shapes) -> float:
    """Multiply-adds x 2 of a convolution from its recorded input and weight shapes (valid in time, same in space)."""
    x, w = shapes[0], shapes[1]
    if len(x) == 5 and len(w) == 5:
        return 2.0 * x[0] * (x[2] - w[2] + 1) * x[3] * x[4] * w[0] * w[1] * w[2] * w[3] * w[4]
    if len(x) == 4 and len(w) == 4:
        return 2.0 * x[0] * (x[2] + 2 - w[2] + 1) * (x[3] + 2 - w[3] + 1) * w[0] * w[1] * w[2] * w[3]
    return 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan2.2", help="the VAE, as bench/bench_vae.py names it (default: %(default)s)")
    ap.add_argument("--size", default="1280*704", help="W*H of the video (default: %(default)s)")
    ap.add_argument("--frames", type=int, default=121, help="video frames (default: %(default)s)")
    ap.add_argument("--chunk_frames", type=int, default=None,
                    help="latent frames a decoder call (default: the fast decode's)")
    ap.add_argument("--tail_frames", type=int, default=None,
                    help="latent frames a call of the decoder's tail (default: the fast decode's)")
    ap.add_argument("-o", "--out", required=True, help="the JSON file to write; required")
    a = ap.parse_args(argv)
    w, h = (int(v) for v in a.size.split("*"))
    vae = build_vae(a.model, "cuda").to(torch.bfloat16)
    z = make_latents(vae, family_of(vae), a.frames, w, h, 0, "cuda")

    def run():
        return D.decode_video(vae, z, mode="fast", chunk_frames=a.chunk_frames, tail_frames=a.tail_frames)

    with torch.no_grad():
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            run()
            torch.cuda.synchronize()
    groups = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages(group_by_input_shape=True):
        dev = getattr(e, "self_device_time_total", 0) or 0
        if dev <= 0 or e.key.startswith("cudaLaunch"):
            continue
        g = groups[(e.key, str(e.input_shapes))]
        g[0] += e.count
        g[1] += dev / 1e3
    rows = []
    for (key, shapes), (calls, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        row = {"op": key, "input_shapes": shapes, "calls": calls, "device_ms": round(ms, 3)}
        if "conv" in key:
            try:
                flop = conv_flop(eval(shapes)) * calls  # noqa: S307 - the profiler's own list of shape lists
                row["tflops"] = round(flop / ms / 1e9, 1) if flop and ms else None
            except (SyntaxError, IndexError, TypeError):  # a shape list the profiler wrote otherwise: no figure
                row["tflops"] = None
        rows.append(row)
    total = sum(r["device_ms"] for r in rows)
    for r in rows[:40]:
        print(f"{r['device_ms']:9.2f} ms {r['calls']:5d}x {r.get('tflops') or '':>7} {r['op'][:34]:<34} "
              f"{r['input_shapes'][:110]}")
    print(f"total self device time {total:.1f} ms")
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "args": vars(a), "total_ms": round(total, 2), "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
