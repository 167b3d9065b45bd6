#!/usr/bin/env python3
"""The fast Wan decode's Triton kernels under other launch configurations, against what they replace, on this GPU.

    python3 bench/lab/vae_kernel_configs.py -o kernel_configs.json

``head``: the decoder's ``conv_out`` (256 -> 12 channels at 352x640 for the Wan 2.2 VAE, 96 -> 3 at 480x832 and
720x1280 for Wan 2.1's; the input buffer of 2 context + 4 or 8 frames, channels_last_3d, bf16) by cuDNN (with its
bias, and without it plus the glue's bias pass: the fast decode's call until ``narrow_conv3d``) and by
:func:`vdbench.kernels.glue.narrow_conv3d` in each launch configuration (voxels a program, warps, pipeline stages);
each output's largest error against the fp32 conv (TF32 off) of the same bf16 values.

``glue``: the norm -> SiLU -> conv-input glue (``norm_silu_cat_keep`` with the producing conv's bias and the cache
written by the same pass: the decode's call) at the decoder's four resolutions, with its rows a program and warps
set otherwise than ``glue._blocks`` sets them; GB/s from the bytes it must move (read x, write the buffer's frames
and the cache, copy the context).

Warm: the median of 20 timed calls (CUDA events) after 5 warm-up calls, on random inputs (never zeros)."""

import argparse
import json

import torch
import torch.nn.functional as F

from vdbench.timing import call_ms, spread

REPS, WARMUP = 20, 5
#: The GPU; a CPU (Triton's interpreter) only to try the tool on tiny shapes (its timings are no speed figures).
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: (what, C_in, C_out, frames a call, H, W)
HEAD_SHAPES = [("wan2.2 conv_out 256->12 at 352x640", 256, 12, 4, 352, 640),
               ("wan2.2 conv_out 256->12 at 352x640", 256, 12, 8, 352, 640),
               ("wan2.1 conv_out 96->3 at 480x832", 96, 3, 4, 480, 832),
               ("wan2.1 conv_out 96->3 at 720x1280", 96, 3, 4, 720, 1280)]
HEAD_CONFIGS = [(bm, wp, st) for bm in (64, 128, 256) for wp in (4, 8) for st in (2, 3, 4)]

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


def head_rows() -> list:
    from vdbench.kernels import glue

    dev, rows = DEV, []
    for what, cin, cout, t, h, w in HEAD_SHAPES:
        g = torch.Generator(device=dev).manual_seed(cin + t)
        x = torch.randn(1, cin, 2 + t, h, w, device=dev, dtype=torch.bfloat16, generator=g).contiguous(
            memory_format=torch.channels_last_3d)
        wt = (torch.randn(cout, cin, 3, 3, 3, device=dev, generator=g) / (27 * cin) ** 0.5).to(torch.bfloat16)
        wt = wt.contiguous(memory_format=torch.channels_last_3d)
        bias = torch.randn(cout, device=dev, generator=g).to(torch.bfloat16)
        old = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        ref = F.conv3d(x.float(), wt.float(), bias.float(), 1, (0, 1, 1))
        torch.backends.cudnn.allow_tf32 = old
        flop = 2 * t * h * w * cout * cin * 27
        wn = glue.narrow_weight(wt)
        cases = {"cudnn+bias": lambda: F.conv3d(x, wt, bias, 1, (0, 1, 1)),
                 "cudnn, bias pass": lambda: glue.add_rows_(F.conv3d(x, wt, None, 1, (0, 1, 1)), bias)}
        for bm, wp, st in HEAD_CONFIGS:
            cases[f"narrow bm={bm} w={wp} s={st}"] = (
                lambda bm=bm, wp=wp, st=st: glue.narrow_conv3d(x, wn, bias, cout, block_m=bm, num_warps=wp,
                                                               num_stages=st))
        for name, fn in cases.items():
            try:
                err = (fn().float() - ref).abs().max().item()
                med, lo, hi = timed(fn)
            except Exception as e:  # a configuration that can't compile or launch here: said, the others go on
                rows.append({"part": "head", "what": what, "frames": t, "how": name, "error": repr(e)[:300]})
                print(f"head {what:<36} T={t} {name:<24} failed: {e!r}"[:200], flush=True)
                continue
            rows.append({"part": "head", "what": what, "cin": cin, "cout": cout, "frames": t, "hw": [h, w],
                         "how": name, "ms": round(med, 4), "ms_min_max": [round(lo, 4), round(hi, 4)],
                         "tflops": round(flop / med / 1e9, 1), "max_abs_err_vs_fp32": err, "n": REPS, "warm": True})
            print(f"head {what:<36} T={t} {name:<24} {med:8.3f} ms {rows[-1]['tflops']:6.1f} TF/s err {err:.2e}",
                  flush=True)
        del x, wt, ref
    return rows


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
    ap.add_argument("--parts", default="head,glue", help="which parts, comma-separated (head, glue); default: both")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - {"head", "glue"}:
        ap.error(f"--parts: head and/or glue, not {args.parts!r}")
    info = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (not speed figures)",
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    rows = (head_rows() if "head" in parts else []) + (glue_rows() if "glue" in parts else [])
    with open(args.out, "w") as f:
        json.dump({"system": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
