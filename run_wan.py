#!/usr/bin/env python3
"""Render a Wan 2.1 / 2.2 video with a chosen attention backend, timed.

    python run_wan.py --model tiny --attention_type sdpa                  # embedded tiny model, CPU is fine
    python run_wan.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --attention_type fav3 --height 480 --width 832
    python run_wan.py --list_backends

Writes <dir>/results/wan_result_<task>_<model>_<F>f_<S>s_attn_<type>_<H>x<W>.mp4 and appends one object per
repetition to <dir>/results/timing.json. Exit codes: 0 ok, 2 bad input (unknown or unavailable backend, bad
size, model not loadable), 3 the backend met an attention call it cannot serve (see --on_unsupported).
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

#: The Wan family: default checkpoints, sizes, prompts and output names (vdbench/families/wan.py).
WAN = families.get("wan")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(WAN.tasks), default="t2v")
    p.add_argument("--model", default=None, help="hub id, local path, 'tiny' or 'tiny:<variant>' "
                   "(default: the Wan-AI checkpoint for the task)")
    p.add_argument("--prompt", default=WAN.cli.prompt)
    p.add_argument("--negative_prompt", default=WAN.cli.negative_prompt)
    p.add_argument("--img_file_path", default=None, help="conditioning image (i2v)")
    p.add_argument("--force_output_size", action="store_true",
                   help="i2v: render exactly --height x --width (the image is center-cropped to it); by default the "
                        "output keeps the image's aspect ratio within the area height*width")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num_frames", type=int, default=None)
    p.add_argument("--num_inference_steps", type=int, default=None)
    p.add_argument("--guidance_scale", type=float, default=WAN.cli.guidance_scale)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--attention_type", default="default", help=f"one of: {', '.join(B.names())}")
    p.add_argument("--on_unsupported", choices=ON_UNSUPPORTED_CHOICES, default="error",
                   help="an attention call the backend can't serve: stop (default) or run it on sdpa, counted")
    p.add_argument("--benchmark_output_directory", default=WAN.cli.output_dir)
    p.add_argument("--num_repetitions", type=int, default=1)
    p.add_argument("--time_attention", action="store_true", help="time every attention call (events)")
    p.add_argument("--warmup_calls", type=int, default=0,
                   help="untimed pipeline calls before the timed repetitions (compile, cuDNN plans, Triton JIT)")
    p.add_argument("--vae_dtype", default="auto", help="auto (the pipeline dtype), fp32, bf16, fp16")
    add_speed_args(p, ("--use_torch_compile",))
    add_vae_args(p, fast_ok=True)
    p.add_argument("--flow_shift", type=float, default=None,
                   help="flow-matching shift (default: 3.0 at 480p, 5.0 at 720p and for ti2v)")
    p.add_argument("--profile_output", default=None,
                   help="NAME: torch profiler Chrome traces of the first repetition under <dir>/traces/NAME/")
    p.add_argument("--profile_wait", type=int, default=0, help="denoising steps skipped before profiling")
    p.add_argument("--profile_warmup", type=int, default=1, help="profiler warm-up steps (not recorded)")
    p.add_argument("--profile_active", type=int, default=2, help="denoising steps recorded")
    p.add_argument("--save_inputs", action="store_true",
                   help="save Q/K/V of attention calls to <dir>/captures (loadable with weights_only=True)")
    p.add_argument("--max_captures", type=int, default=0, help="with --save_inputs: at most N calls (0 = all)")
    p.add_argument("--save_latents", action="store_true", help="save the latents before VAE decode to <dir>/captures")
    p.add_argument("--save_frames", action="store_true",
                   help="also save the raw uint8 frames (.npy beside the video) for codec-free quality figures")
    add_parallel_args(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
    p.add_argument("--fps", type=int, default=WAN.cli.fps)
    p.add_argument("--list_backends", action="store_true", help="print the backend table and exit")
    p.add_argument("--list_available", action="store_true",
                   help="print the names of the backends that can run on this device/dtype, one per line")
    p.add_argument("--print_output_path", action="store_true",
                   help="print the video path(s) these arguments would write (comma-separated types allowed), and exit")
    return p


def size_from_image(path: str, height: int, width: int, mod: int) -> tuple[int, int]:
    """Largest (h, w), multiples of ``mod`` (VAE stride x patch size), with the image's aspect ratio and
    h * w <= height * width — what Wan's image-to-video examples do."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            iw, ih = img.size
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read --img_file_path {path}: {e}")
    area, aspect = height * width, ih / iw
    h = max(mod, int(round((area * aspect) ** 0.5)) // mod * mod)
    w = max(mod, int(round((area / aspect) ** 0.5)) // mod * mod)
    return h, w


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if handle_listing(args):
        return 0
    model = args.model or WAN.default_models[args.task]
    fill_defaults(args, model, WAN.cli.tiny, WAN.cli.real)
    if args.num_repetitions < 1:
        print("error: --num_repetitions must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.img_file_path and args.task in ("i2v", "ti2v") and not args.force_output_size:
        args.height, args.width = size_from_image(args.img_file_path, args.height, args.width,
                                                  mod=WAN.image_size_multiple(args.task, model))
        print(f"output size {args.height}x{args.width} (the image's aspect ratio; --force_output_size to keep "
              "--height/--width)", file=sys.stderr)
    results = Path(args.benchmark_output_directory) / WAN.cli.results_subdir
    out = results / WAN.output_name(args.task, model, args.num_frames, args.num_inference_steps,
                                    args.attention_type, args.height, args.width)
    if args.print_output_path:  # comma-separated types: one path per line (one process for a whole sweep)
        for t in args.attention_type.split(","):
            print(results / WAN.output_name(args.task, model, args.num_frames, args.num_inference_steps, t,
                                            args.height, args.width))
        return 0
    cfg = RenderConfig(family=WAN.name, task=args.task, model=model, prompt=args.prompt,
                       negative_prompt=args.negative_prompt, image=args.img_file_path, height=args.height,
                       width=args.width, num_frames=args.num_frames, num_inference_steps=args.num_inference_steps,
                       guidance_scale=args.guidance_scale, seed=args.seed, attention_type=args.attention_type,
                       output_path=out, timing_path=results / "timing.json", num_repetitions=args.num_repetitions,
                       device=args.device, dtype=args.dtype, fps=args.fps, on_unsupported=args.on_unsupported,
                       time_attention=args.time_attention,
                       capture_dir=(Path(args.benchmark_output_directory) / "captures"
                                    if args.save_inputs or args.save_latents else None),
                       save_inputs=args.save_inputs, max_captures=args.max_captures, save_latents=args.save_latents, save_frames=args.save_frames,
                       rank=int(os.environ.get("RANK", 0)), warmup_calls=args.warmup_calls,
                       vae_dtype=args.vae_dtype, flow_shift=args.flow_shift, profile_output=args.profile_output,
                       traces_root=Path(args.benchmark_output_directory) / "traces", profile_wait=args.profile_wait,
                       profile_warmup=args.profile_warmup, profile_active=args.profile_active,
                       **parallel_kwargs(args),
                       **speed_kwargs(args), **vae_kwargs(args))
    return run_cli(cfg)


if __name__ == "__main__":
    sys.exit(main())
