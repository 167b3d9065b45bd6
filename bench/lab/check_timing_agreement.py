#!/usr/bin/env python3
"""Does the attention bench's timing (bench_attention.py) agree with a plain hand-written timing of the same kernel call?

    python bench/lab/check_timing_agreement.py --preset wan2.1-1.3b-480p --kernel sdpa_cudnn,fav3,sagev1,fav3_fp8

Hand-written = what one would write without the tool: warm up, then CUDA events around each of N calls on the
same inputs, median. The tool times as bench_attention.py does (``vdbench.timing.sample_ms``: the first call apart,
then a sample count fitted to the call's time, CUDA events, L2 written over between calls). Prints both medians with
their p20–p80 and n (``vdbench.timing.spread``) and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vdbench import backends as B
from vdbench import kernel_bench as ba
from vdbench.helptext import DefaultsHelpFormatter
from vdbench.timing import call_ms, spread


def events_samples_ms(fn, n=30, warmup=5) -> list[float]:
    """The hand-written timing: CUDA-event times (ms) around each of ``n`` calls after ``warmup`` calls (no L2
    flush)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return [call_ms(fn, "cuda") for _ in range(n)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--preset", default="wan2.1-1.3b-480p", choices=sorted(ba.PRESETS), help="attention shape")
    p.add_argument("--kernel", default="sdpa_cudnn,fav3,sagev1,fav3_fp8", help="comma-separated backends")
    p.add_argument("-o", "--output", help="write the rows as JSON here")
    args = p.parse_args(argv)
    b, h, sq, sk, d = ba.PRESETS[args.preset]
    q, k, v = ba.synthetic((b, h, sq, sk, d), torch.bfloat16, "cuda")
    rows = []
    for be in map(B.resolve, args.kernel.split(",")):
        name = be.name
        ok, reason = be.availability("cuda", torch.bfloat16, d)
        if not ok:
            rows.append({"kernel": name, "status": reason})
            continue
        fn = be.fn
        call = lambda fn=fn: fn(q, k, v)  # noqa: E731
        got, timer = ba.time_samples(call, "cuda", first_call=True)
        tool_s, hand_s = spread(got.samples), spread(events_samples_ms(call))
        tool, hand = tool_s["median"], hand_s["median"]
        rows.append({"kernel": name, "tool_ms": tool, "tool_p20_ms": tool_s["p20"], "tool_p80_ms": tool_s["p80"],
                     "tool_n": tool_s["n"], "tool_timer": timer, "hand_ms": hand, "hand_p20_ms": hand_s["p20"],
                     "hand_p80_ms": hand_s["p80"], "hand_n": hand_s["n"], "ratio": tool / hand,
                     "tool_tflops": 4 * b * h * sq * sk * d / tool / 1e9})
        print(f"{name:12} tool {tool:8.3f} ms [p20–p80 {tool_s['p20']:.3f}–{tool_s['p80']:.3f}, n={tool_s['n']}]  "
              f"hand {hand:8.3f} ms [p20–p80 {hand_s['p20']:.3f}–{hand_s['p80']:.3f}, n={hand_s['n']}]  "
              f"ratio {tool / hand:.3f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"preset": args.preset, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
