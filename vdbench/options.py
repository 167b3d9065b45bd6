"""Every option of the render CLIs declared once (:data:`OPTIONS`): its flags (the first names it, the others are
the original scripts' spellings; each is also taken with ``-`` for ``_``), argparse's keywords (type, default,
choices, help...) and the :class:`~vdbench.render.RenderConfig` field it fills, with how the flag's value becomes the
field's. :func:`vdbench.cli.build_parser` and :func:`vdbench.cli.config_from_args` are built from the table; a
default, choice list or help that depends on the model family is a function of the
:class:`~vdbench.families.Family`. A command that passes some of these options on (the sweep) declares them from
here too (:func:`add_options`)."""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from . import families
from .cache import CACHE_HELP
from .identity import DEFAULT_SEED
from .offload import MODES as OFFLOAD_MODES
from .parallel import ENGINE_CHOICES
from .patching import ON_UNSUPPORTED_CHOICES
from .speed import COMPILE_BACKENDS, FP8_GEMM_SCOPES, INDUCTOR_TUNING
from .vae.decode import GLUES, MODES
from .vae.encode import MODES as ENCODE_MODES

__all__ = ["Option", "OPTIONS", "AUTO_ON_OFF", "DEFAULT_ATTENTION", "on", "auto_on_off", "add_options"]

#: the choices of the flags whose ``auto`` the render settles (:func:`auto_on_off`)
AUTO_ON_OFF = ("auto", "on", "off")
DEFAULT_ATTENTION = "default"  # --attention_type when not given: the pipeline's own attention, counted
_OWN_NAME = "the option's own name"  # fills: the RenderConfig field of the option's name


def on(value: str) -> bool:
    """An ``on|off`` flag as the render takes it."""
    return value == "on"


def auto_on_off(value: str) -> Optional[bool]:
    """An ``auto|on|off`` flag as the render takes it: None (auto, settled later), True or False."""
    return {"on": True, "off": False}.get(value)


class Option:
    """One option: ``flags`` (``--name`` first), argparse's keywords (``default``, ``choices`` and ``help`` may be
    functions of the family), ``fills`` (the RenderConfig field it fills: by default the one of its name; None: the
    CLI reads it itself, as an output directory or a listing) and ``convert`` (its value -> the field's)."""

    def __init__(self, *flags: str, fills: Optional[str] = _OWN_NAME, convert: Optional[Callable] = None, **kw):
        self.flags, self.kw, self.convert = flags, kw, convert or (lambda value: value)
        self.name = kw.get("dest") or flags[0][2:].replace("-", "_")  # argparse's dest
        self.fills = self.name if fills == _OWN_NAME else fills

    def arguments(self, fam: families.Family) -> dict:
        """argparse's keywords for ``fam``'s CLI."""
        return {k: (v(fam) if k in ("default", "choices", "help") and callable(v) else v) for k, v in self.kw.items()}

    def spellings(self) -> list[str]:
        """Every flag in both spellings (``--num_frames``, ``--num-frames``), the declared ones first."""
        spelled: list[str] = []
        for n in self.flags:
            for s in (n, "--" + n[2:].replace("_", "-"), "--" + n[2:].replace("-", "_")):
                if s not in spelled:
                    spelled.append(s)
        return spelled


def _decode_modes(fam: families.Family) -> list[str]:
    """The ``--vae_decode`` modes that apply to the family's VAE."""
    return [m for m, e in MODES.items() if e.vaes is None or fam.vae_class in e.vaes]


#: ``--vae_decode`` help per mode; the parser lists the modes that apply to the family's VAE.
_DECODE_HELP = {
    "default": "default: diffusers' decode (the pipeline's own)",
    "fast": "fast: the same layers without diffusers' copies, channels_last, the Triton glue, bounded chunks",
    "parallel": "parallel: rows split across the torchrun ranks with a halo exchange (matches the one-GPU decode)",
}

OPTIONS: tuple[Option, ...] = (
    Option("--model", "--model_path", fills=None, default=None,
           help="hub id, local diffusers directory, 'tiny' / 'tiny:<variant>' (embedded tiny model) or "
                "'random:<name>' (real shapes, random weights); default: the family's checkpoint for the task"),
    Option("--task", choices=lambda fam: fam.tasks, default=lambda fam: fam.tasks[0],
           help="what to render (default: %(default)s)"),
    Option("--prompt", default=lambda fam: fam.cli.prompt,
           help="text prompt (default: a fixed prompt, for comparable runs)"),
    Option("--negative_prompt", default=lambda fam: fam.cli.negative_prompt,
           help="negative prompt (default: %(default)r)"),
    Option("--img_file_path", "--image", fills="image", default=None,
           help=lambda fam: "conditioning image: needed by " + ", ".join(fam.image_tasks)
           + (f"; optional for {', '.join(fam.image_pipeline_classes)} (runs its image-to-video path)"
              if fam.image_pipeline_classes else "") + " (default: none)"),
    Option("--force_output_size", fills=None, action="store_true",
           help="image-to-video: render exactly --height x --width (the image is center-cropped to it); by default the "
                "output keeps the image's aspect ratio within the area height*width"),
    Option("--height", type=int, default=None,
           help="frame height in pixels (default: the model's; the tiny model's is smaller)"),
    Option("--width", type=int, default=None, help="frame width in pixels (default: the model's)"),
    Option("--num_frames", type=int, default=None, help="frames to render (default: the model's)"),
    Option("--num_inference_steps", type=int, default=None, help="denoising steps (default: the model's)"),
    Option("--guidance_scale", type=float, default=lambda fam: fam.cli.guidance_scale,
           help="classifier-free guidance scale (default: %(default)s)"),
    Option("--seed", type=int, default=DEFAULT_SEED,
           help="random seed: same seed, same video (default: %(default)s)"),
    Option("--flow_shift", type=float, default=None,
           help="flow-matching shift, for families with a flow-matching scheduler (default: the model's own: the "
                "shift its scheduler config ships, or the family's rule by size where the model card gives one)"),
    Option("--boundary_ratio", type=float, default=None, metavar="R",
           help="two-expert models (Wan 2.2 A14B): the low-noise expert takes over at timestep R x 1000 (default: the "
                "model's config)"),
    Option("--guidance_scale_2", type=float, default=None,
           help="two-expert models (Wan 2.2 A14B): the guidance scale of the low-noise expert's steps (default: "
                "--guidance_scale)"),
    Option("--fps", type=int, default=lambda fam: fam.cli.fps,
           help="frames per second of the written video (default: %(default)s)"),

    Option("--attention_type", default=DEFAULT_ATTENTION,
           help="the attention backend (see --list_backends; diffusers' and SGLang's names are accepted; options "
                "after a colon, e.g. sta:window=3x3x3,tile=6x8x8); default: %(default)s = the pipeline's own "
                "attention, counted"),
    Option("--attention_schedule", fills=None, default=None, metavar="RULES",
           help="several backends by denoising step / block instead of --attention_type, e.g. 'fav3@steps:0-9,sta' "
                "(FA3 on steps 0-9, STA elsewhere) or 'reference@layers:0-1,fav3_fp8': rules BACKEND@steps:N-M"
                "[@layers:N-M], 0-based inclusive ranges ('N-' open, '+' joins ranges), the last rule a plain backend "
                "for every other call; calls counted per kernel and per step"),
    Option("--on_unsupported", choices=ON_UNSUPPORTED_CHOICES, default="error",
           help="an attention call the backend can't serve: stop (error, the default) or run it on torch sdpa and "
                "count it (fallback:sdpa)"),
    Option("--device", default="auto",
           help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N (default: auto)"),
    Option("--dtype", default="auto",
           help="auto (bf16 on a GPU, fp32 on a CPU), bf16, fp16, fp32 (default: auto)"),
    Option("--vae_dtype", default="auto",
           help="auto (the pipeline's dtype), fp32, bf16, fp16 (default: auto)"),

    Option("--benchmark_output_directory", "--output_dir", fills=None, dest="output_dir",
           default=lambda fam: fam.cli.output_dir,
           help=lambda fam: "where the video, timing.json, captures and traces go "
           + (f"(videos and timing.json under DIR/{fam.cli.results_subdir}/) " if fam.cli.results_subdir else "")
           + "(default: %(default)s)"),
    Option("--num_repetitions", type=int, default=1,
           help="timed renders, each reported (default: %(default)s)"),
    Option("--warmup_calls", type=int, default=0,
           help="untimed pipeline calls before the timed ones: compilation, cuDNN plans, Triton JIT (default: 0)"),
    Option("--time_attention", action="store_true",
           help="time every attention call (CUDA events on a GPU)"),
    Option("--save_inputs", action="store_true",
           help="save Q/K/V of attention calls (.pt, loadable with weights_only=True) to --input_dir"),
    Option("--input_dir", fills=None, default=None,
           help="where captures go (default: DIR/captures)"),
    Option("--max_captures", type=int, default=0,
           help="with --save_inputs: at most N calls (default: 0 = all)"),
    Option("--save_latents", action="store_true",
           help="save the latents before the VAE decode to --input_dir"),
    Option("--save_frames", action="store_true",
           help="also save the raw uint8 frames (.npy beside the video), for codec-free quality figures"),
    Option("--profile_output", default=None, metavar="NAME",
           help="torch profiler Chrome traces of the first repetition under DIR/traces/NAME/"),
    Option("--profile_wait", type=int, default=0,
           help="denoising steps skipped before profiling (default: 0)"),
    Option("--profile_warmup", type=int, default=1,
           help="profiler warm-up steps, not recorded (default: 1)"),
    Option("--profile_active", type=int, default=2,
           help="denoising steps recorded (default: 2)"),
    Option("--power_interval_ms", type=float, default=10.0,
           help="sample the card's energy counter, SM clock and power cap every MS during the steps (NVML, "
                "nvidia-ml-py): each step's joules in timing.json; 0 = off (default: %(default)s)"),

    Option("--use_torch_compile", "--compile", dest="compile", action="store_true",
           help="regional torch.compile of the transformer blocks (every backend survives it: each attention call is "
                "one opaque op, still counted); pair with --warmup_calls 1"),
    Option("--compile_backend", choices=COMPILE_BACKENDS, default="inductor",
           help="torch.compile backend; eager/aot_eager check what dynamo traces, fast to build (default: inductor)"),
    Option("--compile_mode", default=None,
           help="inductor mode, e.g. max-autotune-no-cudagraphs (default: inductor's default)"),
    Option("--inductor_tuning", choices=INDUCTOR_TUNING, default="auto",
           help="inductor's coordinate-descent tuning of the compiled kernels: on sets it (with --use_fp8_gemms, "
                "torchao's recommended inductor settings too: about 2 minutes more in the first call on an H200, no "
                "warm-step gain measured), off clears it, auto leaves it as the process has it (off unless set "
                "before) (default: %(default)s)"),
    Option("--fused_rope", choices=AUTO_ON_OFF, default="auto", convert=auto_on_off,
           help="Q and K's rotary embedding in one Triton kernel, diffusers' values bit for bit (the eager form is "
                "eight strided passes, ~8%% of a Wan 1.3B step on an H200); auto: on a CUDA device with Triton, not "
                "with --use_torch_compile (inductor fuses it); Wan (default: %(default)s)"),
    Option("--fused_block", choices=AUTO_ON_OFF, default="auto", convert=auto_on_off,
           help="each transformer block's modulations and gated residuals in Triton kernels, diffusers' values bit "
                "for bit (eagerly each is several fp32 passes over the hidden state), its layer norms too where a "
                "first call finds PyTorch's statistics of the bf16 hidden state equal to its fp32 copy's; auto: on a "
                "CUDA device with Triton, not with --use_torch_compile (inductor fuses them); on also runs on a CPU "
                "under TRITON_INTERPRET=1; Wan (default: %(default)s)"),
    Option("--use_bf16_te_gemms", fills="bf16_te_gemms", action="store_true",
           help="run the text encoder in bfloat16 whatever --dtype is (T5 overflows in fp16)"),
    Option("--use_fp8_gemms", fills="fp8_gemms", nargs="?", const="all", default=None, choices=FP8_GEMM_SCOPES,
           help="torchao float8 GEMMs (dynamic activation + weight, per-row scales) in the transformer blocks: all "
                "their Linear layers (bare flag, or 'all'), or 'ffn': only the feed-forward ones (the attention "
                "projections, whose errors feed the softmax, stay in --dtype); needs torchao and a GPU with fp8"),
    Option("--cache", default=None, metavar="KIND[:key=value,...]", help=CACHE_HELP),

    Option("--vae_decode", choices=_decode_modes, default="default",
           help=lambda fam: "; ".join(_DECODE_HELP[m] for m in _decode_modes(fam)) + " (default: default)"),
    Option("--vae_encode", choices=tuple(ENCODE_MODES), default="default",
           help="image-to-video's VAE encode of the conditioning video: default (diffusers'), fast (Wan VAEs: the fast "
                "decode's lean layers, channels_last, the Triton glue, bounded chunks); refused where it doesn't apply "
                "(default: default)"),
    Option("--vae_glue", choices=tuple(GLUES), default="auto",
           help="the fast decode's (and fast encode's) norm/SiLU glue: triton (our Triton row kernels, refused where "
                "they can't run), eager "
                "(PyTorch ops), auto (triton on a GPU where it runs, else eager; recorded in timing.json) "
                "(default: auto)"),
    Option("--scheduler_prewarm", choices=("on", "off"), default="on", convert=on,
           help="on (a CUDA device): run a copy of the scheduler through the render's steps on a tiny sample during "
                "the load, so what its step pays once (cuSOLVER's load at a multistep solver's third step) is load "
                "time, not a warm step's (recorded in timing.json: run.resolved.scheduler_prewarm); off: the step "
                "pays it (default: %(default)s)"),
    Option("--scheduler_async", choices=("on", "off"), default="on", convert=on,
           help="on (a CUDA device): the scheduler's steps don't wait for the device: their small CPU-to-device copies "
                "are made from pinned memory without blocking and their linear solves without the error check that "
                "blocks (checked once after the denoising), so the host issues the next step while the GPU finishes "
                "this one; the same values and kernels as off (recorded in timing.json: run.resolved.scheduler_async, "
                "scheduler_ahead); off: diffusers' blocking step (default: %(default)s)"),
    Option("--attention_prewarm", choices=("on", "off"), default="on", convert=on,
           help="on: compile the attention backend's first-call kernels (fav3_fp8's Triton pre-pass) for this render's "
                "call shapes in a worker process while the model loads, so the first denoising step finds them "
                "compiled (its wait recorded in timing.json: one_time.attention_prewarm_wait_s); off: the first calls "
                "compile them (Triton's JIT), to measure what it saves (default: on)"),
    Option("--no_vae_prewarm", dest="vae_prewarm", action="store_false",
           help="don't compile the fast VAE path's Triton kernels on a background thread while the GPU denoises (by "
                "default they are, so that the decode, a first call in every render, finds them compiled)"),
    Option("--vae_max_memory", type=float, default=None, metavar="GIB",
           help="bound the decode's memory: the frame chunk (or tiles) is chosen from this budget (Wan VAEs)"),
    Option("--vae_timeout", type=float, default=None, metavar="S",
           help="watchdog: a VAE decode or encode running longer is reported as hung (stacks dumped, exit 124)"),
    Option("--vae_tiling", action="store_true",
           help="diffusers' tiled VAE decode (less memory, seams blended)"),
    Option("--vae_slicing", action="store_true",
           help="diffusers' sliced VAE decode (one batch element at a time)"),
    Option("--offload", choices=OFFLOAD_MODES, default="none",
           help="where weights wait off the GPU (needs one): model = diffusers' model offload (each component on the "
                "GPU while it runs), group = diffusers' group offload (a block at a time, the next one prefetched on "
                "a CUDA stream), expert = the idle one of two experts (Wan 2.2 A14B) on the host, swapped block by "
                "block in the last step before its turn, shard = under torchrun each denoiser's weights split over "
                "the ranks by PyTorch's FSDP2, a block's gathered just before it runs (about 1/N of them a rank); "
                "named in the stack (offload=<mode>) (default: %(default)s)"),
    Option("--cpu_offload", fills=None, dest="offload", action="store_const", const="model",
           help="the same as --offload model"),

    Option("--parallel_engine", choices=ENGINE_CHOICES, default="auto",
           help="under torchrun: xfuser (xDiT's USP; CUDA only), diffusers (diffusers' context parallelism; CPU too) "
                "or auto: the engine measured faster for the model family where both serve the request (Wan: "
                "diffusers; CogVideoX: xfuser where it runs), else the one that serves it; the engine that ran and why "
                "are in timing.json (default: %(default)s)"),
    Option("--ulysses_degree", type=int, default=1,
           help="Ulysses sequence-parallel degree under torchrun (default: 1)"),
    Option("--ring_degree", type=int, default=1,
           help="ring-attention degree under torchrun; the backend must return the log-sum-exp (default: 1)"),
    Option("--use_cfg_parallel", action="store_true",
           help="split classifier-free guidance over 2 halves of the ranks (both engines; world size = 2 x ulysses x "
                "ring)"),
    Option("--ulysses_overlap", type=int, default=1, metavar="N",
           help="Ulysses attention in N head chunks, each chunk's all-to-all running beside another chunk's attention "
                "(diffusers engine; the kernel label ends in /overlapN; 1: diffusers' own Ulysses) (default: 1)"),
    Option("--ulysses_async", choices=AUTO_ON_OFF, default="auto", convert=auto_on_off,
           help="Ulysses self-attention with Q, K and V each sent to the other ranks as soon as it is made, while the "
                "next is projected, Q and K written by the RoPE straight into the exchange's layout (Wan; diffusers "
                "engine; the same output as diffusers' Ulysses; the kernel label ends in /async); auto: wherever it "
                "applies (Ulysses without ring or --ulysses_overlap), off: diffusers' own Ulysses (default: "
                "%(default)s)"),
    Option("--ulysses_v_per_rank", choices=("on", "off"), default="on", convert=on,
           help="with --ulysses_async's exchange: V projected per destination rank, the other ranks' heads first and "
                "sent, this rank's own heads projected straight into place while they travel (they never cross the "
                "wire); the same values as off, where V is projected whole, copied into the send layout and sent "
                "whole (recorded in timing.json: parallel.v_per_rank) (default: %(default)s)"),
    Option("--ulysses_fp8_exchange", choices=("off", "on"), default="off", convert=on,
           help="V and the attention output of --ulysses_async's exchange cross as fp8 e4m3 with a scale per (token, "
                "head): half the bytes of the two exchanges nothing hides, quantized inside the layout copies they "
                "need anyway (Triton); the frames are then no longer the one-GPU render's bit for bit: compare them "
                "(bench/parallel_summary.py gives the PSNR); the kernel label ends in /async+fp8 (default: "
                "%(default)s)"),
    Option("--guidance_overlap", choices=AUTO_ON_OFF, default="auto", convert=auto_on_off,
           help="under Ulysses without --use_cfg_parallel: each step's two guidance branches computed together on "
                "every rank, on two host threads taking turns, so each branch's exchanges travel beside the other's "
                "GEMMs (Wan; diffusers engine with --ulysses_async; the same frames); auto: wherever it applies (not "
                "with a cache, the compile or a sparse pattern; timing.json's parallel.guidance_overlap_reason says "
                "why it is off), off: one branch after the other (default: %(default)s)"),

    Option("--overwrite", action="store_true",
           help="replace an existing file at the output path that this tool did not write (a video it wrote is "
                "replaced anyway)"),
    Option("--list_backends", fills=None, action="store_true",
           help="print the backend table for this device and dtype, and exit"),
    Option("--list_available", fills=None, action="store_true",
           help="print the names of the backends that can run on this device and dtype, one per line, and exit"),
    Option("--print_output_path", fills=None, action="store_true",
           help="print the video path(s) these arguments would write (comma-separated --attention_type), and exit"),
)


def add_options(parser, fam: families.Family, names=None, helps: Optional[dict] = None, **defaults) -> None:
    """``parser`` (or an argument group) given the options of ``names`` (every option without), as the render CLIs
    take them, with ``defaults`` in place of the render's (by option name) and ``helps`` in place of their help (a
    command whose default is of another kind: the model's task, say)."""
    for option in OPTIONS:
        if names is None or option.name in names:
            kw = option.arguments(fam)
            if option.name in defaults:
                kw["default"] = defaults[option.name]
            if helps and option.name in helps:
                kw["help"] = helps[option.name]
            parser.add_argument(*option.spellings(), **{"dest": option.name, **kw})
