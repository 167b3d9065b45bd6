"""The one command line of the render CLIs (``run_wan.py``, ``sageattn_cogvideo.py``): parser, config, exit codes.

Why one module: the two scripts had grown 25 flags twice and drifted apart (flags only one had, one option under two
names, memory flags for one family only although the renderer served both). Here every flag is declared once, the
model family supplies only its defaults and its rules (``vdbench.families``), and the scripts are three-line shims.

Spellings: every flag is accepted as ``--a_b`` and ``--a-b``; the names users of the original scripts type are kept
as aliases of one option (``--model``/``--model_path``, ``--img_file_path``/``--image``,
``--benchmark_output_directory``/``--output_dir``, ``--use_torch_compile``/``--compile``,
``--save_inputs --max_captures --input_dir``). Where the two original scripts laid out their outputs differently
(Wan under ``<dir>/results/``, CogVideoX directly in ``<dir>``) the family keeps its layout, so existing scripts
find their files where they did.

Exit codes (also in ``--help``): 0 ok; 2 bad input (unknown or unavailable backend, bad size, a model that can't
be loaded, a refused option), 3 an attention call the backend can't serve (see ``--on_unsupported``), 4 another
torchrun rank failed, 124 a watched stage (``--vae_timeout``) hung.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from . import backends as B
from . import families
from .cache import CACHE_HELP, parse_cache
from .parallel import ENGINE_CHOICES, EXIT_PEER_FAILED, ParallelSpec
from .helptext import DefaultsHelpFormatter
from .identity import DEFAULT_SEED
from .offload import MODES as OFFLOAD_MODES
from .patching import ON_UNSUPPORTED_CHOICES
from .patching.schedule import resolve_attention
from .sparse import split_attention_types
from .speed import COMPILE_BACKENDS, FP8_GEMM_SCOPES, INDUCTOR_TUNING

__all__ = ["build_parser", "config_from_args", "main", "EXIT_OK", "EXIT_BAD_INPUT", "EXIT_UNSUPPORTED_CALL",
           "EXIT_PEER_FAILED", "EXIT_HUNG"]

#: the choices of the flags whose ``auto`` the render settles (:func:`_auto_on_off`)
AUTO_ON_OFF = ("auto", "on", "off")

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # unknown/unavailable backend, bad size, model that can't be loaded, refused option
EXIT_UNSUPPORTED_CALL = 3  # the backend met a call it cannot serve during the run
EXIT_HUNG = 124  # a watched stage (--vae_timeout) ran past its timeout (timeout(1)'s code)
DEFAULT_ATTENTION = "default"  # --attention_type when not given: the pipeline's own attention, counted

EPILOG = ("exit codes: 0 ok, 2 bad input (unknown or unavailable backend, bad size, model not loadable, refused "
          f"option), 3 an attention call the backend can't serve (see --on_unsupported), {EXIT_PEER_FAILED} another "
          f"torchrun rank failed, {EXIT_HUNG} a watched stage hung (--vae_timeout)")


#: ``--vae_decode`` help per mode; the parser lists the modes that apply to the family's VAE.
_DECODE_HELP = {
    "default": "default: diffusers' decode (the pipeline's own)",
    "fast": "fast: the same layers without diffusers' copies, channels_last, the Triton glue, bounded chunks",
    "parallel": "parallel: rows split across the torchrun ranks with a halo exchange (matches the one-GPU decode)",
}


class _Parser(argparse.ArgumentParser):
    """argparse with both spellings of every long flag (``--num_frames`` and ``--num-frames``)."""

    def add(self, *names: str, **kw):
        spelled: list[str] = []
        for n in names:
            forms = (n, "--" + n[2:].replace("_", "-"), "--" + n[2:].replace("-", "_")) if n.startswith("--") else (n,)
            for s in forms:
                if s not in spelled:
                    spelled.append(s)
        if "dest" not in kw and names[0].startswith("--"):
            kw["dest"] = names[0][2:].replace("-", "_")
        return self.add_argument(*spelled, **kw)


def build_parser(family: str | families.Family, prog: Optional[str] = None,
                 description: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of one family's render CLI: the same flags for every family, the family's defaults."""
    from .vae.decode import GLUES, MODES
    from .vae.encode import MODES as ENCODE_MODES

    fam = families.get(family) if isinstance(family, str) else family
    p = _Parser(prog=prog, description=description, epilog=EPILOG,
                formatter_class=DefaultsHelpFormatter)
    add = p.add
    add("--model", "--model_path", default=None,
        help="hub id, local diffusers directory, 'tiny' / 'tiny:<variant>' (embedded tiny model) or "
             "'random:<name>' (real shapes, random weights); default: the family's checkpoint for the task")
    add("--task", choices=fam.tasks, default=fam.tasks[0], help="what to render (default: %(default)s)")
    add("--prompt", default=fam.cli.prompt, help="text prompt (default: a fixed prompt, for comparable runs)")
    add("--negative_prompt", default=fam.cli.negative_prompt, help="negative prompt (default: %(default)r)")
    add("--img_file_path", "--image", default=None,
        help="conditioning image: needed by " + ", ".join(fam.image_tasks)
             + (f"; optional for {', '.join(fam.image_pipeline_classes)} (runs its image-to-video path)"
                if fam.image_pipeline_classes else "") + " (default: none)")
    add("--force_output_size", action="store_true",
        help="image-to-video: render exactly --height x --width (the image is center-cropped to it); by default the "
             "output keeps the image's aspect ratio within the area height*width")
    add("--height", type=int, default=None, help="frame height in pixels (default: the model's; the tiny model's is "
                                                 "smaller)")
    add("--width", type=int, default=None, help="frame width in pixels (default: the model's)")
    add("--num_frames", type=int, default=None, help="frames to render (default: the model's)")
    add("--num_inference_steps", type=int, default=None, help="denoising steps (default: the model's)")
    add("--guidance_scale", type=float, default=fam.cli.guidance_scale,
        help="classifier-free guidance scale (default: %(default)s)")
    add("--seed", type=int, default=DEFAULT_SEED, help="random seed: same seed, same video (default: %(default)s)")
    add("--flow_shift", type=float, default=None,
        help="flow-matching shift, for families with a flow-matching scheduler (default: the model's own: the "
             "shift its scheduler config ships, or the family's rule by size where the model card gives one)")
    add("--boundary_ratio", type=float, default=None, metavar="R",
        help="two-expert models (Wan 2.2 A14B): the low-noise expert takes over at timestep R x 1000 (default: the "
             "model's config)")
    add("--guidance_scale_2", type=float, default=None,
        help="two-expert models (Wan 2.2 A14B): the guidance scale of the low-noise expert's steps (default: "
             "--guidance_scale)")
    add("--fps", type=int, default=fam.cli.fps, help="frames per second of the written video (default: %(default)s)")

    add("--attention_type", default=DEFAULT_ATTENTION,
        help="the attention backend (see --list_backends; diffusers' and SGLang's names are accepted; options "
             "after a colon, e.g. sta:window=3x3x3,tile=6x8x8); default: %(default)s = the pipeline's own "
             "attention, counted")
    add("--attention_schedule", default=None, metavar="RULES",
        help="several backends by denoising step / block instead of --attention_type, e.g. 'fav3@steps:0-9,sta' "
             "(FA3 on steps 0-9, STA elsewhere) or 'reference@layers:0-1,fav3_fp8': rules BACKEND@steps:N-M"
             "[@layers:N-M], 0-based inclusive ranges ('N-' open, '+' joins ranges), the last rule a plain backend "
             "for every other call; calls counted per kernel and per step")
    add("--on_unsupported", choices=ON_UNSUPPORTED_CHOICES, default="error",
        help="an attention call the backend can't serve: stop (error, the default) or run it on torch sdpa and "
             "count it (fallback:sdpa)")
    add("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N (default: auto)")
    add("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on a CPU), bf16, fp16, fp32 (default: auto)")
    add("--vae_dtype", default="auto", help="auto (the pipeline's dtype), fp32, bf16, fp16 (default: auto)")

    add("--benchmark_output_directory", "--output_dir", dest="output_dir", default=fam.cli.output_dir,
        help="where the video, timing.json, captures and traces go "
             + (f"(videos and timing.json under DIR/{fam.cli.results_subdir}/) " if fam.cli.results_subdir else "")
             + "(default: %(default)s)")
    add("--num_repetitions", type=int, default=1, help="timed renders, each reported (default: %(default)s)")
    add("--warmup_calls", type=int, default=0,
        help="untimed pipeline calls before the timed ones: compilation, cuDNN plans, Triton JIT (default: 0)")
    add("--time_attention", action="store_true", help="time every attention call (CUDA events on a GPU)")
    add("--save_inputs", action="store_true",
        help="save Q/K/V of attention calls (.pt, loadable with weights_only=True) to --input_dir")
    add("--input_dir", default=None, help="where captures go (default: DIR/captures)")
    add("--max_captures", type=int, default=0, help="with --save_inputs: at most N calls (default: 0 = all)")
    add("--save_latents", action="store_true", help="save the latents before the VAE decode to --input_dir")
    add("--save_frames", action="store_true",
        help="also save the raw uint8 frames (.npy beside the video), for codec-free quality figures")
    add("--profile_output", default=None, metavar="NAME",
        help="torch profiler Chrome traces of the first repetition under DIR/traces/NAME/")
    add("--profile_wait", type=int, default=0, help="denoising steps skipped before profiling (default: 0)")
    add("--profile_warmup", type=int, default=1, help="profiler warm-up steps, not recorded (default: 1)")
    add("--profile_active", type=int, default=2, help="denoising steps recorded (default: 2)")
    add("--power_interval_ms", type=float, default=10.0,
        help="sample the card's energy counter, SM clock and power cap every MS during the steps (NVML, "
             "nvidia-ml-py): each step's joules in timing.json; 0 = off (default: %(default)s)")

    add("--use_torch_compile", "--compile", dest="compile", action="store_true",
        help="regional torch.compile of the transformer blocks (every backend survives it: each attention call is "
             "one opaque op, still counted); pair with --warmup_calls 1")
    add("--compile_backend", choices=COMPILE_BACKENDS, default="inductor",
        help="torch.compile backend; eager/aot_eager check what dynamo traces, fast to build (default: inductor)")
    add("--compile_mode", default=None,
        help="inductor mode, e.g. max-autotune-no-cudagraphs (default: inductor's default)")
    add("--inductor_tuning", choices=INDUCTOR_TUNING, default="auto",
        help="inductor's coordinate-descent tuning of the compiled kernels: on sets it (with --use_fp8_gemms, "
             "torchao's recommended inductor settings too: about 2 minutes more in the first call on an H200, no "
             "warm-step gain measured), off clears it, auto leaves it as the process has it (off unless set "
             "before) (default: %(default)s)")
    add("--fused_rope", choices=AUTO_ON_OFF, default="auto",
        help="Q and K's rotary embedding in one Triton kernel, diffusers' values bit for bit (the eager form is eight "
             "strided passes, ~8%% of a Wan 1.3B step on an H200); auto: on a CUDA device with Triton, not with "
             "--use_torch_compile (inductor fuses it); Wan (default: %(default)s)")
    add("--fused_block", choices=AUTO_ON_OFF, default="auto",
        help="each transformer block's modulations and gated residuals in Triton kernels, diffusers' values bit for "
             "bit (eagerly each is several fp32 passes over the hidden state); auto: on a CUDA device with Triton, "
             "not with --use_torch_compile (inductor fuses them); on also runs on a CPU under TRITON_INTERPRET=1; "
             "Wan (default: %(default)s)")
    add("--use_bf16_te_gemms", action="store_true",
        help="run the text encoder in bfloat16 whatever --dtype is (T5 overflows in fp16)")
    add("--use_fp8_gemms", nargs="?", const="all", default=None, choices=FP8_GEMM_SCOPES,
        help="torchao float8 GEMMs (dynamic activation + weight, per-row scales) in the transformer blocks: all "
             "their Linear layers (bare flag, or 'all'), or 'ffn': only the feed-forward ones (the attention "
             "projections, whose errors feed the softmax, stay in --dtype); needs torchao and a GPU with fp8")
    add("--cache", default=None, metavar="KIND[:key=value,...]", help=CACHE_HELP)

    modes = [m for m, e in MODES.items() if e.vaes is None or fam.vae_class in e.vaes]
    add("--vae_decode", choices=modes, default="default",
        help="; ".join(_DECODE_HELP[m] for m in modes) + " (default: default)")
    add("--vae_encode", choices=tuple(ENCODE_MODES), default="default",
        help="image-to-video's VAE encode of the conditioning video: default (diffusers'), fast (Wan VAEs: the fast "
             "decode's lean layers, channels_last, the Triton glue, bounded chunks); refused where it doesn't apply "
             "(default: default)")
    add("--vae_glue", choices=tuple(GLUES), default="auto",
        help="the fast decode's (and fast encode's) norm/SiLU glue: triton (our Triton row kernels, refused where "
             "they can't run), eager "
             "(PyTorch ops), auto (triton on a GPU where it runs, else eager; recorded in timing.json) "
             "(default: auto)")
    add("--scheduler_prewarm", choices=("on", "off"), default="on",
        help="on (a CUDA device): run a copy of the scheduler through the render's steps on a tiny sample during the "
             "load, so what its step pays once (cuSOLVER's load at a multistep solver's third step) is load time, "
             "not a warm step's (recorded in timing.json: run.resolved.scheduler_prewarm); off: the step pays it "
             "(default: %(default)s)")
    add("--scheduler_async", choices=("on", "off"), default="on",
        help="on (a CUDA device): the scheduler's steps don't wait for the device: their small CPU-to-device copies "
             "are made from pinned memory without blocking and their linear solves without the error check that "
             "blocks (checked once after the denoising), so the host issues the next step while the GPU finishes "
             "this one; the same values and kernels as off (recorded in timing.json: run.resolved.scheduler_async, "
             "scheduler_ahead); off: diffusers' blocking step (default: %(default)s)")
    add("--attention_prewarm", choices=("on", "off"), default="on",
        help="on: compile the attention backend's first-call kernels (fav3_fp8's Triton pre-pass) for this render's "
             "call shapes in a worker process while the model loads, so the first denoising step finds them "
             "compiled (its wait recorded in timing.json: one_time.attention_prewarm_wait_s); off: the first calls "
             "compile them (Triton's JIT), to measure what it saves (default: on)")
    add("--no_vae_prewarm", dest="vae_prewarm", action="store_false",
        help="don't compile the fast VAE path's Triton kernels on a background thread while the GPU denoises (by "
             "default they are, so that the decode, a first call in every render, finds them compiled)")
    add("--vae_max_memory", type=float, default=None, metavar="GIB",
        help="bound the decode's memory: the frame chunk (or tiles) is chosen from this budget (Wan VAEs)")
    add("--vae_timeout", type=float, default=None, metavar="S",
        help="watchdog: a VAE decode or encode running longer is reported as hung (stacks dumped, exit 124)")
    add("--vae_tiling", action="store_true", help="diffusers' tiled VAE decode (less memory, seams blended)")
    add("--vae_slicing", action="store_true", help="diffusers' sliced VAE decode (one batch element at a time)")
    add("--offload", choices=OFFLOAD_MODES, default="none",
        help="where weights wait off the GPU (needs one): model = diffusers' model offload (each component on the "
             "GPU while it runs), group = diffusers' group offload (a block at a time, the next one prefetched on "
             "a CUDA stream), expert = the idle one of two experts (Wan 2.2 A14B) on the host, swapped block by "
             "block in the last step before its turn; named in the stack (offload=<mode>) (default: %(default)s)")
    add("--cpu_offload", dest="offload", action="store_const", const="model", help="the same as --offload model")

    add("--parallel_engine", choices=ENGINE_CHOICES, default="auto",
        help="under torchrun: xfuser (xDiT's USP; CUDA only), diffusers (diffusers' context parallelism; CPU too) "
             "or auto: the engine measured faster for the model family where both serve the request (Wan: diffusers; "
             "CogVideoX: xfuser where it runs), else the one that serves it; the engine that ran and why are in "
             "timing.json "
             "(default: %(default)s)")
    add("--ulysses_degree", type=int, default=1, help="Ulysses sequence-parallel degree under torchrun (default: 1)")
    add("--ring_degree", type=int, default=1,
        help="ring-attention degree under torchrun; the backend must return the log-sum-exp (default: 1)")
    add("--use_cfg_parallel", action="store_true", help="split classifier-free guidance over 2 halves of the ranks (both engines; world size = 2 x ulysses x ring)")
    add("--ulysses_overlap", type=int, default=1, metavar="N",
        help="Ulysses attention in N head chunks, each chunk's all-to-all running beside another chunk's attention "
             "(diffusers engine; the kernel label ends in /overlapN; 1: diffusers' own Ulysses) (default: 1)")
    add("--ulysses_async", choices=AUTO_ON_OFF, default="auto",
        help="Ulysses self-attention with Q, K and V each sent to the other ranks as soon as it is made, while the "
             "next is projected, Q and K written by the RoPE straight into the exchange's layout (Wan; diffusers "
             "engine; the same output as diffusers' Ulysses; the kernel label ends in /async); auto: wherever it "
             "applies (Ulysses without ring or --ulysses_overlap), off: diffusers' own Ulysses (default: "
             "%(default)s)")
    add("--ulysses_v_per_rank", choices=("on", "off"), default="on",
        help="with --ulysses_async's exchange: V projected per destination rank, the other ranks' heads first and "
             "sent, this rank's own heads projected straight into place while they travel (they never cross the "
             "wire); the same values as off, where V is projected whole, copied into the send layout and sent "
             "whole (recorded in timing.json: parallel.v_per_rank) (default: %(default)s)")
    add("--ulysses_fp8_exchange", choices=("off", "on"), default="off",
        help="V and the attention output of --ulysses_async's exchange cross as fp8 e4m3 with a scale per (token, "
             "head): half the bytes of the two exchanges nothing hides, quantized inside the layout copies they "
             "need anyway (Triton); the frames are then no longer the one-GPU render's bit for bit: compare them "
             "(bench/parallel_summary.py gives the PSNR); the kernel label ends in /async+fp8 (default: "
             "%(default)s)")
    add("--guidance_overlap", choices=AUTO_ON_OFF, default="auto",
        help="under Ulysses without --use_cfg_parallel: each step's two guidance branches computed together on "
             "every rank, on two host threads taking turns, so each branch's exchanges travel beside the other's "
             "GEMMs (Wan; diffusers engine with --ulysses_async; the same frames); auto: wherever it applies (not "
             "with a cache, the compile or a sparse pattern; timing.json's parallel.guidance_overlap_reason says "
             "why it is off), off: one branch after the other (default: %(default)s)")

    add("--overwrite", action="store_true",
        help="replace an existing file at the output path that this tool did not write (a video it wrote is "
             "replaced anyway)")
    add("--list_backends", action="store_true", help="print the backend table for this device and dtype, and exit")
    add("--list_available", action="store_true",
        help="print the names of the backends that can run on this device and dtype, one per line, and exit")
    add("--print_output_path", action="store_true",
        help="print the video path(s) these arguments would write (comma-separated --attention_type), and exit")
    return p


def _model(fam: families.Family, args) -> str:
    return args.model or fam.default_models[args.task]


def _fill_defaults(fam: families.Family, args, model: str) -> None:
    """Size and step arguments left unset take the tiny model's CPU-sized defaults or the real model's."""
    for k, v in (fam.cli.tiny if model.startswith("tiny") else fam.cli.real).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def _image_sized(fam: families.Family, task: str, model: str) -> Optional[int]:
    """The multiple an image-derived output size is rounded to, when this task takes an image; else None."""
    if not fam.takes_image(task) and task not in fam.image_refusals:
        return None
    return fam.image_size_multiple(task, model)


def results_dir(fam: families.Family, args) -> Path:
    """Where the video and timing.json go: the family's layout under the output directory."""
    out = Path(args.output_dir)
    return out / fam.cli.results_subdir if fam.cli.results_subdir else out


def canonical_attention(attention_type: str) -> str:
    """The name a run is recorded under: an alias -> the backend's name, options and schedules in their one
    spelling; a name that doesn't resolve comes back as given (the render refuses it, with the reason)."""
    try:
        return resolve_attention(attention_type).name
    except (B.BackendUnavailable, ValueError):
        return attention_type


def output_path(fam: families.Family, args, model: str, attention_type: str) -> Path:
    """The video these arguments write for one backend or schedule (:func:`render_path` of their config)."""
    one = argparse.Namespace(**vars(args))
    if not args.attention_schedule:
        one.attention_type = attention_type
    return config_from_args(fam, one, model).output_path


def render_path(fam: families.Family, cfg) -> Path:
    """The video a render writes, decided by its identity (:mod:`vdbench.identity`): the family's name for the
    backend (an alias named by the backend it resolves to), then the stack's speed options and VAE modes
    (``_compile-fp8gemm-vae=fast``, :func:`vdbench.measure.record.options_tag`), the step cache's tag
    (``_cache-fbc-threshold=0.1``, :func:`vdbench.measure.record.cache_tag`), the parallel layout (``_u2``, ``_r2``,
    ``_u2r2``, ``_cfg2``) of a torchrun render, and the identity's tags (``_seed7``, ``_id-3fa9c1d2``) in that order;
    a render with none of them keeps the family's plain name. Beside its ``timing.json``."""
    from . import identity
    from .measure.record import cache_tag, options_tag, settings_speed_options

    layout = ParallelSpec(cfg.parallel_engine, cfg.ulysses_degree, cfg.ring_degree, cfg.use_cfg_parallel).tag
    name = Path(fam.output_name(task=cfg.task, model=cfg.model, num_frames=cfg.num_frames,
                                steps=cfg.num_inference_steps, attention_type=canonical_attention(cfg.attention_type),
                                height=cfg.height, width=cfg.width, **({"layout": layout} if layout else {})))
    cache = parse_cache(cfg.cache)
    settings = dataclasses.asdict(cfg)
    tags = [options_tag(settings_speed_options(settings), cfg.vae_decode, cfg.vae_encode),
            cache_tag(cache.name) if cache is not None else ""]
    tags = [t for t in tags if t]
    if tags:  # before the layout tag
        rest, tag = families.split_layout(name.stem)
        name = name.with_name(f"{rest}_{'_'.join(tags)}{'_' + tag if tag else ''}{name.suffix}")
    return cfg.timing_path.parent / identity.of(settings, type(cfg), fam).name(name.name)


def config_from_args(fam: families.Family, args, model: Optional[str] = None):
    """The RenderConfig these arguments describe (defaults filled in, the image-conditioned size resolved), writing
    where its identity says (:func:`render_path`)."""
    from .render import RenderConfig

    model = model or _model(fam, args)
    out = Path(args.output_dir)
    capture_dir = Path(args.input_dir) if args.input_dir else out / "captures"
    if args.attention_schedule:
        if args.attention_type != DEFAULT_ATTENTION:
            raise ValueError("give --attention_type or --attention_schedule, not both (a schedule names its "
                             "backends itself, e.g. 'fav3@steps:0-9,sta')")
        args.attention_type = args.attention_schedule
    cfg = RenderConfig(
        family=fam.name, task=args.task, model=model, prompt=args.prompt, negative_prompt=args.negative_prompt,
        image=args.img_file_path, height=args.height, width=args.width, num_frames=args.num_frames,
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
        guidance_scale_2=args.guidance_scale_2, boundary_ratio=args.boundary_ratio, seed=args.seed,
        attention_type=args.attention_type, output_path=Path(),
        timing_path=results_dir(fam, args) / "timing.json", num_repetitions=args.num_repetitions,
        device=args.device, dtype=args.dtype, fps=args.fps, on_unsupported=args.on_unsupported,
        time_attention=args.time_attention, capture_dir=capture_dir, save_inputs=args.save_inputs,
        max_captures=args.max_captures, save_latents=args.save_latents, save_frames=args.save_frames,
        rank=int(os.environ.get("RANK", 0)), warmup_calls=args.warmup_calls, vae_dtype=args.vae_dtype,
        flow_shift=args.flow_shift, profile_output=args.profile_output, traces_root=out / "traces",
        profile_wait=args.profile_wait, profile_warmup=args.profile_warmup, profile_active=args.profile_active,
        power_interval_ms=args.power_interval_ms,
        offload=args.offload, vae_tiling=args.vae_tiling, vae_slicing=args.vae_slicing,
        compile=args.compile, compile_backend=args.compile_backend, compile_mode=args.compile_mode,
        bf16_te_gemms=args.use_bf16_te_gemms, fp8_gemms=args.use_fp8_gemms, cache=args.cache,
        inductor_tuning=args.inductor_tuning,
        vae_decode=args.vae_decode,
        vae_encode=args.vae_encode, vae_max_memory=args.vae_max_memory, vae_timeout=args.vae_timeout, vae_glue=args.vae_glue,
        vae_prewarm=args.vae_prewarm, attention_prewarm=args.attention_prewarm == "on",
        scheduler_prewarm=args.scheduler_prewarm == "on",
        scheduler_async=args.scheduler_async == "on",
        parallel_engine=args.parallel_engine, ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree,
        use_cfg_parallel=args.use_cfg_parallel, ulysses_overlap=args.ulysses_overlap,
        ulysses_async=_auto_on_off(args.ulysses_async), guidance_overlap=_auto_on_off(args.guidance_overlap),
        fused_rope=_auto_on_off(args.fused_rope),
        fused_block=_auto_on_off(args.fused_block),
        ulysses_fp8_exchange=args.ulysses_fp8_exchange == "on",
        ulysses_v_per_rank=args.ulysses_v_per_rank == "on",
        overwrite=args.overwrite)
    return dataclasses.replace(cfg, output_path=render_path(fam, cfg))


def _auto_on_off(value: str) -> Optional[bool]:
    """An ``auto|on|off`` flag as the render takes it: None (auto, settled later), True or False."""
    return {"on": True, "off": False}.get(value)


def _listing(args) -> None:
    from .render import resolve_device, resolve_dtype

    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    print(B.capability_table(dev, dtype) if args.list_backends else "\n".join(B.available_names(dev, dtype)))


def size_from_image(path: str, height: int, width: int, mod: int) -> tuple[int, int]:
    """Largest (h, w), multiples of ``mod`` (VAE stride x patch size), with the image's aspect ratio and
    h * w <= height * width -- what Wan's image-to-video examples do."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            iw, ih = img.size
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the conditioning image {path}: {e}") from None
    area, aspect = height * width, ih / iw
    h = max(mod, int(round((area * aspect) ** 0.5)) // mod * mod)
    w = max(mod, int(round((area / aspect) ** 0.5)) // mod * mod)
    return h, w


def say(e: BaseException, file=None) -> None:
    """An error as a user reads it: ``error: <what is wrong>`` on one line, then ``hint: ...`` with the rest of
    the message (what to do, what can run instead) on one more. The project's messages put the fact on their first
    line and the advice after it."""
    file = file if file is not None else sys.stderr
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    print(f"error: {lines[0]}", file=file)
    if len(lines) > 1:
        print(f"hint: {' '.join(lines[1:])}", file=file)
    file.flush()


def _quiet_peer(e: BaseException) -> bool:
    """Under torchrun a refusal all ranks agreed on is said once, by rank 0 (each rank exits with its code)."""
    return getattr(e, "_vd_agreed", False) and int(os.environ.get("RANK", 0)) != 0


def exit_code(e: BaseException) -> int:
    """The exit code an error means (the epilog's list): 2 bad input, 3 an unsupported call, 124 a hang, 1 else."""
    from .pipelines import ModelLoadError
    from .render import VAEHang
    from .speed import SpeedOptionError

    if isinstance(e, B.UnsupportedCall):
        return EXIT_UNSUPPORTED_CALL
    if isinstance(e, VAEHang):
        return EXIT_HUNG
    if isinstance(e, (B.BackendUnavailable, ModelLoadError, SpeedOptionError, ValueError, FileNotFoundError)):
        return EXIT_BAD_INPUT
    return 1


def run(cfg, log=print) -> int:
    """Run a render and turn the project's expected failures into one clear line and an exit code."""
    from .render import render
    from .timing import wall_start

    try:  # end_to_end_s counts from the process's start (the first render of the process)
        render(cfg, log=log, exit_code_of=exit_code, started=wall_start(from_process=True))
    except Exception as e:  # noqa: BLE001 - the expected ones get their code; anything else is re-raised
        code = exit_code(e)
        if code == 1:
            raise
        if not _quiet_peer(e):
            say(e)
        return code
    return EXIT_OK


def main(family: str, argv=None, *, prog: Optional[str] = None, description: Optional[str] = None) -> int:
    """The whole CLI of one family: parse, list or print paths, or render.

    Under torchrun a rank that ends non-zero leaves at once with its code (``os._exit`` after flushing, its process
    group already left): torchrun stops the other workers with SIGTERM as soon as one exits non-zero, and a
    process caught in the interpreter's teardown -- where Python's signal handlers are gone -- would end as -15
    instead of with its documented code."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return _main(family, argv, prog, description)
    try:
        code = _main(family, argv, prog, description)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - a crash: its traceback, exit 1
        if not getattr(e, "_vd_reported", False):
            traceback.print_exc()
        code = 1
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(family: str, argv, prog: Optional[str], description: Optional[str]) -> int:
    fam = families.get(family)
    args = build_parser(fam, prog=prog, description=description).parse_args(argv)
    try:
        if args.list_backends or args.list_available:
            _listing(args)
            return EXIT_OK
        model = _model(fam, args)
        _fill_defaults(fam, args, model)
        if args.num_repetitions < 1:
            raise ValueError("--num_repetitions must be >= 1")
        mod = _image_sized(fam, args.task, model)
        if args.img_file_path and mod and not args.force_output_size:
            args.height, args.width = size_from_image(args.img_file_path, args.height, args.width, mod=mod)
            print(f"output size {args.height}x{args.width} (the image's aspect ratio; --force_output_size to keep "
                  "--height/--width)", file=sys.stderr)
        if args.print_output_path:  # comma-separated types: one path per line (one process for a whole sweep)
            types = [args.attention_schedule] if args.attention_schedule else split_attention_types(args.attention_type)
            for t in types:
                print(output_path(fam, args, model, t))
            return EXIT_OK
        cfg = config_from_args(fam, args)
    except (B.BackendUnavailable, ValueError) as e:
        say(e)
        return EXIT_BAD_INPUT
    return run(cfg)


if __name__ == "__main__":  # python -m vdbench.cli FAMILY ARGS...: the render CLI of a family (what torchrun -m runs)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
