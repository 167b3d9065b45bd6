#!/usr/bin/env python3
"""Stitching speed, side by side in one run: vdbench's labelled grid vs ffmpeg's own xstack filter.

    python bench/lab/bench_stitch.py                       # six 81-frame 832x480 H.264 clips -> 3x2 grid, 3 repeats
    python bench/lab/bench_stitch.py --frames 5 --size 96x64 --repeats 1 -o stitch.json   # quick

Both sides read the same H.264 inputs and write H.264 (libx264, veryfast, crf 18, yuv420p) with the ffmpeg that
imageio-ffmpeg ships; xstack draws no labels, so it is the floor for "decode six, encode one". Repeats are
interleaved (a, b, a, b, ...) so load on the machine hits both alike; the table gives median wall and CPU time
(children included) and the ratio to xstack. Peak RSS of this process shows the stitcher streams frames.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vdbench.grid import stitch_grid
from vdbench.video import write_video
from vdbench.helptext import DefaultsHelpFormatter


def make_inputs(directory: Path, n: int, frames: int, width: int, height: int) -> list[Path]:
    """Moving gradients plus grain: textured like renders, not trivially compressible."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for i in range(n):
        def gen(i=i):
            for t in range(frames):
                base = 0.5 + 0.5 * np.sin((xx + 7 * t * (i + 1)) / (23 + i) + yy / (31 + 2 * i))
                rgb = np.stack([base, np.roll(base, i * 5, axis=1), 1 - base], axis=-1)
                yield np.clip(rgb + rng.normal(0, 0.03, rgb.shape), 0, 1).astype(np.float32)
        paths.append(Path(write_video(gen(), directory / f"wan_result_t2v_bench_{frames}f_1s_attn_b{i}_{height}x{width}.mp4",
                                      fps=16, preset="veryfast")))
    return paths


def run_xstack(inputs, output, rows, cols):
    import imageio_ffmpeg

    # cell (r, c) sits at x = c widths, y = r heights of the first input (all inputs share one size)
    layout = "|".join(f"{'+'.join(['w0'] * c) or '0'}_{'+'.join(['h0'] * r) or '0'}"
                      for r in range(rows) for c in range(cols))
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error"]
    for p in inputs:
        cmd += ["-i", str(p)]
    cmd += ["-filter_complex", "".join(f"[{i}:v]" for i in range(len(inputs))) + f"xstack=inputs={len(inputs)}:layout={layout}",
            "-c:v", "libx264", "-preset", "veryfast", "-crf", "18", "-pix_fmt", "yuv420p", str(output)]
    subprocess.run(cmd, check=True)


def timed(fn):
    r0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum((b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime) for a, b in zip(r0, r1))
    return wall, cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--inputs", nargs="*", type=Path, help="existing clips (default: generate six)")
    p.add_argument("--frames", type=int, default=81, help="frames of the generated clips")
    p.add_argument("--size", default="832x480", help="WxH of generated clips")
    p.add_argument("--repeats", type=int, default=3, help="timed stitches per way")
    p.add_argument("-o", "--output", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = args.inputs or make_inputs(tmp, 6, args.frames, width, height)
        rows, cols = 2, 3
        ways = {"vdbench stitch_grid (labelled)": lambda: stitch_grid(inputs, tmp / "grid.mp4", layout=(rows, cols)),
                "ffmpeg xstack (no labels)": lambda: run_xstack(inputs, tmp / "xstack.mp4", rows, cols)}
        res = {k: {"wall_s": [], "cpu_s": []} for k in ways}
        for _ in range(args.repeats):
            for k, fn in ways.items():
                wall, cpu = timed(fn)
                res[k]["wall_s"].append(wall)
                res[k]["cpu_s"].append(cpu)
    base = statistics.median(res["ffmpeg xstack (no labels)"]["wall_s"])
    out = {"inputs": len(inputs), "frames": args.frames, "size": args.size, "grid": f"{rows}x{cols}",
           "cpu_count": os.cpu_count(), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "results": {k: {**v, "wall_median_s": statistics.median(v["wall_s"]),
                           "cpu_median_s": statistics.median(v["cpu_s"]),
                           "ratio_to_xstack": statistics.median(v["wall_s"]) / base} for k, v in res.items()}}
    for k, v in out["results"].items():
        print(f"{k:32} wall {v['wall_median_s']:7.2f} s  cpu {v['cpu_median_s']:7.2f} s  x{v['ratio_to_xstack']:.2f}")
    print(f"peak RSS of this process: {out['peak_rss_mib']:.0f} MiB")
    if args.output:
        args.output.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
