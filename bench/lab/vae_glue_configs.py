#!/usr/bin/env python3
"""The fast Wan decode's norm -> SiLU -> conv-input glue under other launch configurations, on this GPU.

    python3 bench/lab/vae_glue_configs.py -o glue_configs.json

The glue (``norm_silu_cat_keep`` with the producing conv's bias and the cache written by the same pass: the decode's
call) at the decoder's four resolutions, with its rows a program and warps set otherwise than ``glue._blocks`` sets
them; GB/s from the bytes it must move (read x, write the buffer's frames and the cache, copy the context).

Warm: the median of 20 timed calls (CUDA events) after 5 warm-up calls, on random inputs (never zeros)."""

import argparse
import json

import torch

from vdbench.timing import call_ms, spread

REPS, WARMUP = 20, 5
#: The GPU; a CPU (Triton's interpreter) only to try the tool on tiny shapes (its timings are no speed figures).
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: (what, C, frames a call, H, W)
GLUE_SHAPES = [("up3 256 at 352x640", 256, 4, 352, 640), ("up2 512 at 176x320", 512, 4, 176, 320),
               ("up1 1024 at 88x160", 1024, 4, 88, 160), ("mid 1024 at 44x80", 1024, 2, 44, 80)]
GLUE_ELEMS = (2048, 4096, 8192, 16384, 32768)  # elements (rows x C) a program
GLUE_WARPS = (4, 8, 16)


def timed(fn):
    """(median, min, max) ms of REPS calls after WARMUP (vdbench.timing: CUDA events, its spread)."""
    dev = DEV
    for _ in range(WARMUP):
        fn()
    s = spread([call_ms(fn, dev) for _ in range(REPS)])
    return s["median"], s["min"], s["max"]


def glue_rows() -> list:
    import triton

    from vdbench.kernels import glue

    dev, rows, stock = DEV, [], glue._blocks
    for what, c, t, h, w in GLUE_SHAPES:
        g = torch.Generator(device=dev).manual_seed(c + t)
        x = torch.randn(1, c, t, h, w, device=dev, dtype=torch.bfloat16, generator=g).contiguous(
            memory_format=torch.channels_last_3d)
        ctx = torch.randn(1, c, 2, h, w, device=dev, dtype=torch.bfloat16, generator=g).contiguous(
            memory_format=torch.channels_last_3d)
        gain = torch.rand(c, device=dev, generator=g) + 0.5
        bias = torch.randn(c, device=dev, generator=g).to(torch.bfloat16)
        moved = 2 * c * h * w * (t + t + 2 + 2 * 2)  # read x, write T frames, the cache, copy the context
        want = glue.norm_silu_cat_keep(x, ctx, gain, bias, keep=2)
        configs = [("stock", None)] + [(f"elems={e} w={wp}", (e, wp)) for e in GLUE_ELEMS for wp in GLUE_WARPS]
        for name, cfg in configs:
            if cfg is not None:
                e, wp = cfg
                glue._blocks = lambda cc, e=e, wp=wp: (triton.next_power_of_2(cc),
                                                       max(1, e // triton.next_power_of_2(cc)), wp)
            try:
                fn = lambda: glue.norm_silu_cat_keep(x, ctx, gain, bias, keep=2)  # noqa: E731
                got = fn()
                same = all(torch.equal(a, b) for a, b in zip(got, want))
                med, lo, hi = timed(fn)
            except Exception as e:
                rows.append({"part": "glue", "what": what, "how": name, "error": repr(e)[:300]})
                print(f"glue {what:<22} {name:<18} failed: {e!r}"[:200], flush=True)
                continue
            finally:
                glue._blocks = stock
            rows.append({"part": "glue", "what": what, "c": c, "frames": t, "hw": [h, w], "how": name,
                         "ms": round(med, 4), "ms_min_max": [round(lo, 4), round(hi, 4)],
                         "gb_s": round(moved / med / 1e6, 1), "same_as_stock": same, "n": REPS, "warm": True})
            print(f"glue {what:<22} {name:<18} {med:8.3f} ms {rows[-1]['gb_s']:7.1f} GB/s same {same}", flush=True)
        del x, ctx
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", required=True, help="the JSON file to write (the rows and the device); required")
    args = ap.parse_args(argv)
    info = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (not speed figures)",
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    rows = glue_rows()
    with open(args.out, "w") as f:
        json.dump({"system": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
