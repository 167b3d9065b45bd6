#!/usr/bin/env python3
"""Does installing a backend through vdbench.patching cost anything? Same kernel, patched by hand vs by vdbench.

    python bench/lab/patch_overhead.py --model random:wan2.1-t2v-1.3b --backend fav3 --height 480 --width 832 --num_frames 81

Times the Wan transformer's forward (one denoising step's worth: the cond and uncond passes) at the real token
count with CUDA events after warm-up, median of repeats, three ways interleaved:
  * ``hand``: diffusers' ``dispatch_attention_fn`` replaced, in the Wan transformer module, by a two-line
    function calling the kernel directly — what a user would write by hand;
  * ``vdbench``: the same kernel installed with ``AttentionPatch`` (call counting on);
  * ``vdbench+timing``: the same with ``time_attention`` (an event pair per call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from vdbench import backends as B
from vdbench.patching import AttentionPatch
from vdbench.pipelines import load_pipeline
from vdbench.timing import call_ms
from vdbench.helptext import DefaultsHelpFormatter


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="random:wan2.1-t2v-1.3b",
                   help="model to patch (tiny, random:<name>, hub id, path)")
    p.add_argument("--backend", default="fav3", help="attention backend")
    p.add_argument("--height", type=int, default=480, help="frame height in pixels")
    p.add_argument("--width", type=int, default=832, help="frame width in pixels")
    p.add_argument("--num_frames", type=int, default=81, help="frames")
    p.add_argument("--repeats", type=int, default=7, help="timed forwards per variant")
    p.add_argument("--device", default="cuda", help="device")
    p.add_argument("-o", "--output", help="write the results as JSON here")
    args = p.parse_args(argv)

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pipe = load_pipeline(args.model, "t2v", "wan", dtype=dtype, device=dev)
    tr = pipe.transformer
    vae_s, vae_t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    g = torch.Generator("cpu").manual_seed(0)
    lat = torch.randn(2, tr.config.in_channels, (args.num_frames - 1) // vae_t + 1, args.height // vae_s,
                      args.width // vae_s, generator=g).to(dev, dtype)
    ctx = torch.randn(2, 512, tr.config.text_dim, generator=g).to(dev, dtype)
    t = torch.tensor([500, 500], device=dev)
    backend = B.get_backend(args.backend)

    def step():
        with torch.inference_mode():
            tr(hidden_states=lat, timestep=t, encoder_hidden_states=ctx, return_dict=False)

    def timed():
        return call_ms(step, dev)

    import diffusers.models.transformers.transformer_wan as wan_mod

    orig = wan_mod.dispatch_attention_fn

    def by_hand(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        return backend.fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          scale=scale, is_causal=is_causal).transpose(1, 2)

    def run_hand():
        wan_mod.dispatch_attention_fn = by_hand
        try:
            return timed()
        finally:
            wan_mod.dispatch_attention_fn = orig

    def run_patch(time_attention):
        def f():
            with AttentionPatch([("transformer", tr)], backend, time_attention=time_attention) as patch:
                ms = timed()
            patch.finish_timing()
            return ms
        return f

    ways = {"hand": run_hand, "vdbench": run_patch(False), "vdbench+timing": run_patch(True)}
    for f in ways.values():  # warm-up every path (compilation, cuDNN plans, allocator)
        f()
    times = {k: [] for k in ways}
    for _ in range(args.repeats):
        for k, f in ways.items():
            times[k].append(f())
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"backend": args.backend, "model": args.model, "tokens": lat.shape[2] * lat.shape[3] * lat.shape[4] // 4,
           "median_ms": med, "all_ms": times,
           "overhead_vs_hand": {k: med[k] / med["hand"] - 1 for k in med if k != "hand"},
           "device": torch.cuda.get_device_name(dev)}
    print(json.dumps(res, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
