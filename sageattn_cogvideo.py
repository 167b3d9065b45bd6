#!/usr/bin/env python3
"""Render a CogVideoX video with a chosen attention backend, timed.

CogVideoX's attention processor calls F.scaled_dot_product_attention directly (not diffusers' dispatcher):
the backend is installed into that model's processors only, nothing else in the process is touched.

    python sageattn_cogvideo.py --model_path tiny --attention_type sagev1_emu
    python sageattn_cogvideo.py --model_path THUDM/CogVideoX-2b --attention_type sagev1

Writes <output_dir>/cogvideox-<model>_<type>.mp4 and appends to <output_dir>/timing.json (the run_wan.py
schema). Exit codes as run_wan.py: 2 bad input / unavailable backend, 3 an attention call the backend can't serve.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vdbench import backends as B
from vdbench import families
from vdbench.parallel import add_parallel_args, parallel_kwargs
from vdbench.patching import ON_UNSUPPORTED_CHOICES
from vdbench.speed import add_speed_args, speed_kwargs
from vdbench.vae import add_vae_args, vae_kwargs
from vdbench.render import EXIT_BAD_INPUT, RenderConfig, fill_defaults, handle_listing, run_cli

#: The CogVideoX family: default checkpoint, sizes, prompts and output names (vdbench/families/cogvideox.py).
COG = families.get("cogvideox")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=COG.default_models["t2v"],
                   help="hub id, local path, 'tiny' or 'tiny:<variant>'")
    p.add_argument("--task", choices=list(COG.tasks), default="t2v")
    p.add_argument("--image", default=None, help="conditioning image (i2v)")
    p.add_argument("--attention_type", default="default", help=f"one of: {', '.join(B.names())}")
    p.add_argument("--on_unsupported", choices=ON_UNSUPPORTED_CHOICES, default="error")
    p.add_argument("--prompt", default=COG.cli.prompt)
    p.add_argument("--negative_prompt", default=COG.cli.negative_prompt)
    p.add_argument("--num_frames", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num_inference_steps", type=int, default=None)
    p.add_argument("--guidance_scale", type=float, default=COG.cli.guidance_scale)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", default=COG.cli.output_dir)
    p.add_argument("--fps", type=int, default=COG.cli.fps)
    p.add_argument("--num_repetitions", type=int, default=1)
    p.add_argument("--time_attention", action="store_true")
    add_parallel_args(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--save_inputs", action="store_true", help="save Q/K/V of attention calls (see run_wan.py)")
    p.add_argument("--input_dir", default=None, help="where --save_inputs writes (default <output_dir>/captures)")
    p.add_argument("--max_captures", type=int, default=0, help="with --save_inputs: at most N calls (0 = all)")
    p.add_argument("--save_frames", action="store_true", help="also save raw uint8 frames (.npy beside the video)")
    p.add_argument("--save_latents", action="store_true", help="save the latents before the VAE decode (captures)")
    p.add_argument("--warmup_calls", type=int, default=0, help="untimed pipeline calls before the timed ones")
    p.add_argument("--vae_dtype", default="auto", help="auto (the pipeline dtype), fp32, bf16, fp16")
    add_speed_args(p, ("--compile", "--use_torch_compile"))
    add_vae_args(p, fast_ok=False)
    p.add_argument("--cpu_offload", action="store_true", help="enable_model_cpu_offload (needs a GPU)")
    p.add_argument("--vae_tiling", action="store_true", help="decode the VAE in spatial tiles (less memory)")
    p.add_argument("--vae_slicing", action="store_true", help="decode the VAE one batch element at a time")
    p.add_argument("--list_backends", action="store_true")
    p.add_argument("--list_available", action="store_true", help="names of the backends that can run here")
    p.add_argument("--print_output_path", action="store_true",
                   help="print the video path(s) these arguments would write (comma-separated types allowed)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if handle_listing(args):
        return 0
    fill_defaults(args, args.model_path, COG.cli.tiny, COG.cli.real)
    if args.num_repetitions < 1:
        print("error: --num_repetitions must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    out_dir = Path(args.output_dir) / COG.cli.results_subdir

    def output(attention_type):
        return out_dir / COG.output_name(args.task, args.model_path, args.num_frames, args.num_inference_steps,
                                         attention_type, args.height, args.width)

    if args.print_output_path:
        for t in args.attention_type.split(","):
            print(output(t))
        return 0
    cfg = RenderConfig(family=COG.name, task=args.task, model=args.model_path, prompt=args.prompt,
                       negative_prompt=args.negative_prompt, image=args.image, height=args.height, width=args.width,
                       num_frames=args.num_frames, num_inference_steps=args.num_inference_steps,
                       guidance_scale=args.guidance_scale, seed=args.seed, attention_type=args.attention_type,
                       output_path=output(args.attention_type),
                       timing_path=out_dir / "timing.json", num_repetitions=args.num_repetitions,
                       device=args.device, dtype=args.dtype, fps=args.fps, on_unsupported=args.on_unsupported,
                       time_attention=args.time_attention, save_inputs=args.save_inputs,
                       max_captures=args.max_captures, save_frames=args.save_frames,
                       save_latents=args.save_latents,
                       capture_dir=Path(args.input_dir) if args.input_dir else Path(args.output_dir) / "captures",
                       rank=int(os.environ.get("RANK", 0)), warmup_calls=args.warmup_calls,
                       vae_dtype=args.vae_dtype, cpu_offload=args.cpu_offload, vae_tiling=args.vae_tiling,
                       **parallel_kwargs(args),
                       vae_slicing=args.vae_slicing, **speed_kwargs(args), **vae_kwargs(args))
    return run_cli(cfg)


if __name__ == "__main__":
    sys.exit(main())
