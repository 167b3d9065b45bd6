"""VAE decode and encode configs side by side: time, peak memory and quality against the fp32 untiled ones.

    python -m vdbench.vae_bench --model wan2.1 --frames 81 --size 832*480 --configs fp32,bf16,tiled,fast -o vae.json
    python -m vdbench.vae_bench --model wan2.1 --frames 81 --input i2v --ops encode --configs fp32,bf16,fast  # Wan I2V
    python -m vdbench.vae_bench --model wan2.1 --frames 21 --tile_px 256        # the quick case: encode + decode
    python -m vdbench.vae_bench --model wan2.1 --latents outputs/x/captures/latents_sdpa_rank0_000.pt --isolate
    python -m vdbench.vae_bench --model tiny --frames 9 --size 64*48 --device cpu        # CI-sized (tiny Wan 2.1 VAE)

Models: ``wan2.1``, ``wan2.2`` (TI2V-5B VAE), ``cogvideox``, ``hunyuanvideo`` — the real diffusers classes at
the real checkpoints' configs with random weights (seeded, built on the device, so every process gets the same
weights); ``tiny`` (the tiny Wan 2.1 VAE) or ``tiny:<one of those>`` for CI, spelled as every vdbench tool spells
the tiny models (``tiny-<name>`` is still read); or a local path / hub id (``vae`` subfolder if there is one). A
name that is neither is refused at once, with no network attempt.

Configs (``--configs``, comma-separated; ``name@value`` sets its parameter; ``name+modifier`` composes):
  fp32, bf16 (weights cast), bf16_autocast (fp32 weights, autocast), tiled (``--tile_px``),
  chunked[@K] (temporal chunks of K latent frames, stock layers), channels_last_3d, cudnn_benchmark, compile
  (torch.compile of the decoder / encoder), fast[@K[/S[/S2]]] (the fast paths, bf16: lean layers + channels_last, K
  latent frames per decoder / encoder call, defaults ``vdbench.vae.fast.FAST_DEFAULT_CHUNK`` / ``vdbench.vae.encode.
  FAST_ENCODE_DEFAULT_CHUNK`` as in ``--vae_decode fast`` / ``--vae_encode fast``; S: the decoder's
  full-resolution tail's latent frames a call; S/S2: those of the blocks past its last two temporal upsamplings;
  default ``FAST_DEFAULT_TAIL``), fast_nocl[@K[/S[/S2]]]
  (the same without channels_last), memory[@GiB] (fast decode bounded by ``--vae_max_memory``; no encode), miopen_fast /
  miopen_immediate / miopen_naive_off (ROCm MIOpen presets, set in a child process's environment before torch
  loads; "not applicable" elsewhere).
  Modifiers ``+cudnn_benchmark`` (cudnn.benchmark on) and ``+compile`` (fast/fast_nocl: the fast path's
  norm/SiLU glue compiled, convs stay cuDNN's; other configs: torch.compile of the decoder) compose with any
  config, e.g. ``fast+cudnn_benchmark@2``, ``fast+compile``, ``channels_last_3d+cudnn_benchmark``. Compiling
  configs report their graph breaks and graphs (``graph_breaks``, ``compiled_graphs``; compile time is in the
  first call, ``first_call_s``, never in the warm median). The fast configs (fast, fast_nocl, memory) run the glue as
  ``--vae_decode fast`` does by default: ``vdbench.kernels.glue``'s Triton row kernels where they run (a GPU:
  one read and one write per norm instead of four passes, conv biases folded into the next pass), else the
  eager glue -- ``decode_info.glue`` says which ran. ``+fused`` requires the Triton glue (an error where it
  can't run; Triton's interpreter on a CPU), ``+eager_glue`` forces the PyTorch ops (the fast path before them).
``--ops`` (default both): each config decodes seeded latents (``--frames`` frames' worth) and encodes a video of
``--frames`` frames (``--input``: ``video``, a synthetic panning scene, the quick case; ``i2v``, Wan
image-to-video's conditioning input, the image then zero frames: what every I2V render encodes), each first
called once on its own, timed (``first_call_s``, ``encode_first_call_s``: what the first call pays once -- cuDNN's
plans, Triton JIT, compiles, allocator growth -- is in it; ``first_call_excess_s`` = first - warm median), then
``--warmup`` - 1 more untimed calls, then ``--repeats`` timed warm calls (CUDA events after a synchronize; host
clock on CPU): their median with n, p20–p80 and min/max (``time_s_n``, ``time_s_p20``, ``time_s_p80``;
``vdbench.timing.spread``) and the speed verdict (``speed_figure``, ``why_not_speed``: a CPU timing or fewer than 3
warm samples is no speed figure); peak memory (torch allocator) over the warm calls per op. The encode's first call
comes after the decode's calls in the same process. Decode quality: the frames against the fp32 untiled decode of
the same latents, PSNR and SSIM per frame (min and mean). Encode quality: the latents (the posterior's mean, what
Wan I2V conditions on) against the fp32 encode's (relative L2, ``latent_rel_l2``) and the round trip -- the
config's encode then the config's decode -- against the fp32 round trip (``roundtrip_psnr_*``, ``roundtrip_ssim_*``:
random weights don't reconstruct the input, so round trips are compared, not the input). The decode's keys are
unprefixed (``time_s_median`` ...), the encode's ``encode_*``, both together ``total_time_s_median``. Below
``--min_psnr`` (either) is flagged. An op a config doesn't apply to is ``<op>_status: not_applicable`` with
``<op>_reason``; a config no asked op applies to is not applicable as a whole.
``--profile N``: after the timed repeats, one more decode (and encode) under ``torch.profiler`` (CUDA activities on
a GPU); the top N kernels by self device time (self CPU time of aten ops on the CPU) with calls, total ms and % of
the total go into the row (``profile``, ``encode_profile``) and are printed; ``--profile_configs 'bf16,fast*'``
limits it to matching configs.
``--timeout``: each config (its decode and encode) runs under a watchdog (all stacks dumped, reported as hung with
its last stage, e.g. ``encode repeat 2/3``); with
``--isolate`` each config runs in its own process and the parent kills a child that outlives the timeout.
``--cold``: ``--isolate``, and each config's process gets ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` in new
empty temporary folders (removed afterwards), so its first call compiles and plans everything: the cold figure.
Every row says how it ran: ``cold`` (true/false) and ``caches``, the state of the compile caches when its process
started (``empty``; ``default (not cleared)`` when they were the user's; in-process rows after the first: ``shared
with earlier configs in this process``), with ``cache_dirs`` in the JSON.

Exit code: 0 all ran and passed the quality bound; 1 a config failed, hung or was refused; 2 only quality flags.
Not applicable configs (e.g. MIOpen presets on CUDA) don't count as failures; they are listed as such.
"""

from __future__ import annotations

import argparse

from .configs import NotApplicable, prepare_config
from .grammar import (CONFIGS, CPU_DEFAULT_CONFIGS, CPU_DEFAULT_REPEATS, DEFAULT_CONFIGS, GPU_DEFAULT_REPEATS, INPUTS,
                      MIOPEN_PRESETS, MODELS, MODIFIERS, OPS, child_env, parse_config, parse_ops, parse_size,
                      split_config, uses)
from .measure import quality
from .models import build_vae, make_latents, make_video, system_context, tiny_name
from .profiler import profile_op, profile_wanted
from .runner import SHARED_CACHES, child_main, run_all, run_config
from .writer import exit_code, write_output

__all__ = ["CONFIGS", "CPU_DEFAULT_CONFIGS", "DEFAULT_CONFIGS", "INPUTS", "MIOPEN_PRESETS", "MODELS", "MODIFIERS", "OPS",
           "SHARED_CACHES", "NotApplicable", "device_defaults", "build_parser", "build_vae", "child_env", "child_main",
           "exit_code", "main", "make_latents", "make_video", "parse_config", "parse_ops", "parse_size",
           "prepare_config", "profile_op", "profile_wanted", "quality", "run_all", "run_config", "split_config",
           "system_context", "tiny_name", "uses", "write_output"]


def build_parser() -> argparse.ArgumentParser:
    from ..helptext import DefaultsHelpFormatter
    from ..vae.fast import FAST_DEFAULT_CHUNK

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default="wan2.1",
                    help=f"{', '.join(MODELS)} (real configs, random weights), tiny or tiny:<one of those>, or a "
                         "path/hub id")
    ap.add_argument("--frames", type=int, default=81, help="video frames (latent frames = (N-1)/4 + 1)")
    ap.add_argument("--ops", default="decode,encode",
                    help="what each config times: decode, encode or both, comma-separated (default: %(default)s)")
    ap.add_argument("--input", choices=INPUTS, default="video",
                    help="the encode's video: 'video', a synthetic panning scene of --frames frames (the quick "
                         "case); 'i2v', Wan image-to-video's conditioning input: its first frame, then zero frames "
                         "(default: %(default)s)")
    ap.add_argument("--size", default="832*480", help="W*H in pixels")
    ap.add_argument("--tile_px", type=int, default=0,
                    help="tile size of the 'tiled' config in pixels (0: the VAE's enable_tiling() defaults)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="decodes (and encodes) per config before the timed ones, at least one: the first call, "
                         "timed on its own (first_call_s), never a warm sample; the others untimed")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed warm decodes (and encodes) per config: their median with n and p20–p80 "
                         f"(fewer than 3: not a speed figure; default {GPU_DEFAULT_REPEATS} on a GPU, "
                         f"{CPU_DEFAULT_REPEATS} on a CPU, where no time is a speed figure)")
    ap.add_argument("--latents", default=None, help="latents file captured by a render (--save_latents)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated, of: {', '.join(CONFIGS)}; each optionally +{' / +'.join(MODIFIERS)} "
                         f"(default on a GPU: {DEFAULT_CONFIGS}; on a CPU: {CPU_DEFAULT_CONFIGS}, the rest left for "
                         "a GPU)")
    ap.add_argument("--isolate", action="store_true", help="each config in its own process")
    ap.add_argument("--cold", action="store_true",
                    help="--isolate, and each config's process with its Triton and inductor caches in new empty "
                         "temporary folders (removed afterwards): its first_call_s is the cold first call (default: "
                         "off, the caches as found)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per config (watchdog)")
    ap.add_argument("--min_psnr", type=float, default=40.0, help="flag configs whose min per-frame PSNR is lower")
    ap.add_argument("--chunk_frames", type=int, default=None,
                    help="latent frames per call of chunked (default: 4) and fast/fast_nocl (default: "
                         f"{FAST_DEFAULT_CHUNK}, what --vae_decode fast uses); name@K overrides")
    ap.add_argument("--vae_max_memory", type=float, default=1.45, help="GiB budget of the 'memory' config")
    ap.add_argument("--compile_backend", default="inductor", help="torch.compile backend of the 'compile' config")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each config's timed repeats, one more decode under torch.profiler: its top N kernels "
                         "by self device time go into the row ('profile') and are printed (0: off)")
    ap.add_argument("--profile_configs", default=None, metavar="PATTERNS",
                    help="with --profile: only the configs matching these comma-separated shell patterns "
                         "(e.g. 'bf16,fast*'; default: every config)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and latents")
    ap.add_argument("-o", "--output", default=None, help="results .json or .csv, written after each config")
    for hidden in ("--_child", "--_result", "--_ref", "--_save_ref"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    return ap


def _preimport():
    """Heavy imports before any watchdog starts: a config's timeout measures its own work, not module loading."""
    import diffusers  # noqa: F401
    from diffusers import AutoencoderKLCogVideoX, AutoencoderKLHunyuanVideo, AutoencoderKLWan  # noqa: F401

    from .. import pipelines  # noqa: F401
    from ..measure import quality  # noqa: F401
    from ..vae import decode, encode, fast  # noqa: F401


def device_defaults(args) -> list[str]:
    """Fill in the configs and repeats left unset for ``args.device``: every config and 5 timed calls on a GPU; on a
    CPU, where no time is a speed figure, the fp32 configs that run there in seconds and one timed call. Returns the
    default configs left for a GPU (none where the configs were given or the device is a GPU)."""
    on_cpu = args.device == "cpu"
    left = []
    if args.configs is None:
        args.configs = CPU_DEFAULT_CONFIGS if on_cpu else DEFAULT_CONFIGS
        left = [c for c in DEFAULT_CONFIGS.split(",") if c not in args.configs.split(",")]
    if args.repeats is None:
        args.repeats = CPU_DEFAULT_REPEATS if on_cpu else GPU_DEFAULT_REPEATS
    return left


def main(argv=None) -> int:
    from ..timing import cache_state

    ap = build_parser()
    args = ap.parse_args(argv)
    args._cache_state = cache_state()  # before anything compiles: what this process's first calls find
    parse_ops(args.ops)  # refused before any work
    if args.repeats is not None and args.repeats < 1:
        ap.error("--repeats must be at least 1 (the warm calls the median is taken over)")
    if args.cold:
        args.isolate = True  # a cold first call needs a fresh process (and the empty caches it is given)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    left = device_defaults(args)
    if left and not args._child:
        print(f"[bench_vae] on a CPU: configs {args.configs}, {args.repeats} timed call(s) each (the plumbing; no time "
              f"here is a speed figure); left for a GPU: {','.join(left)} (name them with --configs to run them "
              "here)", flush=True)
    _preimport()
    if args._child:
        return child_main(args)
    ctx = system_context(args.device)
    print("[bench_vae] system: " + ", ".join(f"{k}={v}" for k, v in ctx.items() if v is not None), flush=True)
    w, h = parse_size(args.size)
    print(f"[bench_vae] model {args.model}, "
          f"{'latents from ' + args.latents if args.latents else f'{args.frames} frames at {w}x{h}'}; "
          f"{' and '.join(parse_ops(args.ops))}"
          f"{f' (encode input: {args.input})' if 'encode' in parse_ops(args.ops) else ''}; "
          f"first call timed apart, warmup {max(1, args.warmup)} (the first call included), repeats {args.repeats}"
          f"{', cold (each config in a fresh process, empty compile caches)' if args.cold else ''}"
          f"{', isolated' if args.isolate and not args.cold else ''}, timeout {args.timeout or 'none'}", flush=True)
    header = {"system": ctx, "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
              "time": "time_s_*: the warm calls (median, min/max, p20/p80, n); first_call_s: the first call on its "
                      "own; first_call_excess_s = first - warm median"}
    rows = run_all(args, on_row=(lambda rs: write_output(args.output, header, rs)) if args.output else None)
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        shapes = []
        if "output_shape" in ok[0]:
            shapes.append(f"latents {ok[0].get('latent_shape')} -> video {ok[0].get('output_shape')}")
        if "input_shape" in ok[0]:
            shapes.append(f"encode: {args.input} input {ok[0]['input_shape']} -> latents {ok[0]['encode_latent_shape']}")
        print(f"[bench_vae] shapes: {'; '.join(shapes)}")
    if args.output:
        write_output(args.output, header, rows)
        from ..measure.record import write_beside

        write_beside(args.output, {"system": header["system"], "args": header["args"], "results": rows})
        print(f"[bench_vae] wrote {args.output} and records.jsonl beside it")
    whys = dict.fromkeys(r.get(k) for r in ok for k in ("why_not_speed", "encode_why_not_speed") if r.get(k))
    for why in whys:
        print(f"[bench_vae] warning: these times are not speed figures: {why}")
    rc = exit_code(rows)
    bad = [r["config"] for r in rows if r.get("status") not in ("ok", "not_applicable")]
    flagged = [r["config"] for r in rows if r.get("quality_flag")]
    print(f"[bench_vae] exit {rc}" + (f"; failed/hung: {', '.join(bad)}" if bad else "")
          + (f"; below {args.min_psnr} dB: {', '.join(flagged)}" if flagged else ""))
    return rc

