#!/usr/bin/env python3
"""VAE decode and encode configs side by side: time, peak memory and quality against the fp32 untiled ones.

    python bench/bench_vae.py --model wan2.1 --frames 81 --size 832*480 --configs fp32,bf16,tiled,fast -o vae.json
    python bench/bench_vae.py --model wan2.1 --frames 81 --input i2v --ops encode --configs fp32,bf16,fast  # Wan I2V
    python bench/bench_vae.py --model wan2.1 --frames 21 --tile_px 256        # the quick case: encode + decode
    python bench/bench_vae.py --model wan2.1 --latents outputs/x/captures/latents_sdpa_rank0_000.pt --isolate
    python bench/bench_vae.py --model tiny --frames 9 --size 64*48 --device cpu        # CI-sized (tiny Wan 2.1 VAE)

Models: ``wan2.1``, ``wan2.2`` (TI2V-5B VAE), ``cogvideox``, ``hunyuanvideo`` — the real diffusers classes at
the real checkpoints' configs with random weights (seeded, built on the device, so every process gets the same
weights); ``tiny`` (the tiny Wan 2.1 VAE) or ``tiny:<one of those>`` for CI, spelled as every vdbench tool spells
the tiny models (``tiny-<name>`` is still read); or a local path / hub id (``vae`` subfolder if there is one). A
name that is neither is refused at once, with no network attempt.

Configs (``--configs``, comma-separated; ``name@value`` sets its parameter; ``name+modifier`` composes):
  fp32, bf16 (weights cast), bf16_autocast (fp32 weights, autocast), tiled (``--tile_px``),
  chunked[@K] (temporal chunks of K latent frames, stock layers), channels_last_3d, cudnn_benchmark, compile
  (torch.compile of the decoder / encoder), fast[@K] (the fast paths, bf16: lean layers + channels_last, K latent
  frames per decoder / encoder call, defaults ``vdbench.vae.fast.FAST_DEFAULT_CHUNK`` / ``vdbench.vae.encode.
  FAST_ENCODE_DEFAULT_CHUNK`` as in ``--vae_decode fast`` / ``--vae_encode fast``), fast_nocl[@K]
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
import csv
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the working directory of --isolate's children

# No torch import at module level: a child must get its environment (MIOpen presets) before torch loads.

MODELS = ("wan2.1", "wan2.2", "cogvideox", "hunyuanvideo")
CONFIGS = ("fp32", "bf16", "bf16_autocast", "tiled", "chunked", "channels_last_3d", "cudnn_benchmark", "compile",
           "fast", "fast_nocl", "memory", "miopen_fast", "miopen_immediate", "miopen_naive_off")
#: Modifiers that compose with any config: ``fast+cudnn_benchmark``, ``fast+compile``, ``bf16+cudnn_benchmark``...
MODIFIERS = ("cudnn_benchmark", "compile", "fused", "eager_glue")
#: What a config times (``--ops``), and what the encode gets (``--input``, :func:`make_video`).
OPS = ("decode", "encode")
INPUTS = ("video", "i2v")
DEFAULT_CONFIGS = "fp32,bf16,bf16_autocast,tiled,chunked,channels_last_3d,cudnn_benchmark,fast,memory"
#: ``caches`` of a config run in-process after another: it finds what the earlier configs compiled and planned.
SHARED_CACHES = "shared with earlier configs in this process"

#: ROCm MIOpen presets: environment variables read by MIOpen when the process loads it.
MIOPEN_PRESETS: dict[str, dict[str, str]] = {
    # Find mode FAST: no exhaustive kernel search (the Find phase is what hangs on 3-D convs).
    "miopen_fast": {"MIOPEN_FIND_MODE": "FAST"},
    # Immediate mode with fallback: solutions from the find-db / heuristics, no Find at all.
    "miopen_immediate": {"MIOPEN_FIND_MODE": "FAST", "MIOPEN_DEBUG_CONV_IMMED_FALLBACK": "1",
                         "MIOPEN_FIND_ENFORCE": "NONE"},
    # The naive direct convolution kernels off (they are picked for 3-D shapes and are very slow).
    "miopen_naive_off": {"MIOPEN_DEBUG_CONV_DIRECT_NAIVE_CONV_FWD": "0",
                         "MIOPEN_DEBUG_CONV_DIRECT_NAIVE_CONV_BWD": "0",
                         "MIOPEN_DEBUG_CONV_DIRECT_NAIVE_CONV_WRW": "0"},
}


def parse_config(spec: str) -> tuple[str, str | None]:
    """``name[+modifier...][@value]`` -> (name with its modifiers, value)."""
    name, _, value = spec.partition("@")
    name = name.strip()
    split_config(name)
    return name, (value.strip() or None)


def split_config(name: str) -> tuple[str, tuple[str, ...]]:
    """``fast+compile+cudnn_benchmark`` -> ("fast", ("compile", "cudnn_benchmark")); unknown parts refused."""
    base, *mods = [p.strip() for p in name.split("+")]
    if base not in CONFIGS:
        raise ValueError(f"unknown config {base!r}; valid: {', '.join(CONFIGS)} (optionally +{'/+'.join(MODIFIERS)})")
    for m in mods:
        if m not in MODIFIERS or mods.count(m) > 1 or m == base:
            raise ValueError(f"config {name!r}: {m!r} is not a modifier (valid: {', '.join(MODIFIERS)}, each once)")
    return base, tuple(mods)


def uses(name: str, part: str) -> bool:
    """Whether config ``name`` is ``part`` or carries it as a modifier (``compile`` for both ``compile`` and
    ``fast+compile``)."""
    base, mods = split_config(name)
    return part in (base, *mods)


def child_env(config: str, base: dict | None = None) -> dict:
    """The environment for a child process that runs ``config``: ``base`` (default: os.environ) plus the
    config's preset variables, which win over inherited ones (they are the point of the config)."""
    env = dict(os.environ if base is None else base)
    env.update(MIOPEN_PRESETS.get(split_config(parse_config(config)[0])[0], {}))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def parse_ops(s: str) -> tuple[str, ...]:
    """'encode,decode' -> ("decode", "encode") (the order they run in); unknown or none refused."""
    ops = {o.strip() for o in s.split(",") if o.strip()}
    if not ops or ops - set(OPS):
        raise ValueError(f"--ops must name {' and/or '.join(OPS)}, got {s!r}")
    return tuple(o for o in OPS if o in ops)


def parse_size(s: str) -> tuple[int, int]:
    """'832*480' or '832x480' -> (width, height)."""
    for sep in ("*", "x", "X"):
        if sep in s:
            w, h = s.split(sep)
            return int(w), int(h)
    raise ValueError(f"--size must be W*H (e.g. 832*480), got {s!r}")


# ----------------------------------------------------------------------------------------------------------------
# System context
# ----------------------------------------------------------------------------------------------------------------

def system_context(device: str) -> dict:
    import torch

    ctx = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "hip": getattr(torch.version, "hip", None), "kernel": platform.release(), "machine": platform.machine()}
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                ctx["distro"] = line.split("=", 1)[1].strip('"')
    except OSError:
        ctx["distro"] = platform.platform()
    try:
        from importlib.metadata import version
        ctx["diffusers"] = version("diffusers")
    except Exception:  # noqa: BLE001
        ctx["diffusers"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        ctx["gpu"] = p.name
        ctx["gpu_arch"] = getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"
        ctx["gpu_memory_gib"] = round(p.total_memory / 2 ** 30, 1)
        ctx["cudnn"] = torch.backends.cudnn.version()
    else:
        ctx["gpu"] = None
        ctx["cpu"] = platform.processor() or platform.machine()
    return ctx


# ----------------------------------------------------------------------------------------------------------------
# Models and latents
# ----------------------------------------------------------------------------------------------------------------

def tiny_name(model: str) -> tuple[bool, str]:
    """``(tiny, VAE name)`` of a ``--model`` value: ``tiny`` -> the tiny Wan 2.1 VAE, ``tiny:<name>`` (and the older
    ``tiny-<name>``) -> that VAE's tiny config; anything else -> ``(False, model)``."""
    if model == "tiny":
        return True, MODELS[0]
    for prefix in ("tiny:", "tiny-"):
        if model.startswith(prefix):
            return True, model[len(prefix):]
    return False, model


def _vae_spec(model: str):
    """(diffusers class name, config kwargs) of HunyuanVideo's VAE, the one named model that is no render family's
    (the families' VAEs come from ``vdbench.pipelines.build_vae``); None for another name."""
    tiny, name = tiny_name(model)
    if name == "hunyuanvideo":
        cfg = dict(block_out_channels=(8, 16, 16, 16), norm_num_groups=4, layers_per_block=1) if tiny else {}
        return "AutoencoderKLHunyuanVideo", cfg
    return None


def _family_of(vae) -> str:
    """The latent handling ``vae`` needs: its render family's name, or ``hunyuanvideo``."""
    from vdbench import families

    return "hunyuanvideo" if type(vae).__name__ == "AutoencoderKLHunyuanVideo" else families.for_vae(vae).name


def build_vae(model: str, device: str, seed: int = 0):
    """fp32 VAE on ``device``: a named architecture with seeded random weights, or a checkpoint."""
    import diffusers
    import torch

    from vdbench import pipelines as P

    tiny, name = tiny_name(model)
    if name in P.vae_names():
        return P.build_vae(name, device=device, seed=seed, tiny=tiny)
    spec = _vae_spec(model)
    if spec is not None:
        cls_name, cfg = spec
        torch.manual_seed(seed)
        if device.startswith("cuda"):
            torch.cuda.manual_seed_all(seed)
        with torch.device(device):
            vae = getattr(diffusers, cls_name)(**cfg)
        return vae.eval().requires_grad_(False)
    path = Path(model)
    unknown = (f"--model {model!r}: not one of {', '.join(MODELS)}, tiny or tiny:<one of those>, and not a local "
               "path or hub id holding a Wan/CogVideoX/HunyuanVideo VAE")
    if tiny or (not path.exists() and P.hub_id_problem(model)):  # nothing to look up: no network attempt
        raise ValueError(unknown)
    sub = "vae" if (path / "vae").is_dir() or not path.exists() else None
    for cls_name in ("AutoencoderKLWan", "AutoencoderKLCogVideoX", "AutoencoderKLHunyuanVideo"):
        cls = getattr(diffusers, cls_name)
        try:
            cfg = cls.load_config(model, subfolder=sub)
        except Exception:  # noqa: BLE001
            continue
        if cfg.get("_class_name") == cls_name:
            return cls.from_pretrained(model, subfolder=sub, torch_dtype=torch.float32).to(device).eval()
    raise ValueError(unknown + " (a 'vae' subfolder is looked for)")


def _factors(vae, family: str, width: int, height: int) -> tuple[int, int, int]:
    """(latent channels, temporal factor, spatial factor) of ``vae``; a size that isn't a multiple of the spatial
    factor is refused."""
    if family == "wan":
        c, ts, ss = vae.config.z_dim, vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
    else:
        c, ts, ss = vae.config.latent_channels, vae.config.temporal_compression_ratio, 8
    if height % ss or width % ss:
        raise ValueError(f"--size {width}*{height} must be a multiple of the VAE's spatial factor {ss}")
    return c, ts, ss


def make_video(vae, family: str, frames: int, width: int, height: int, seed: int, kind: str = "video"):
    """The encode's input (1, 3, F, H, W) in [-1, 1], fp32, on the CPU, deterministic from ``seed``: ``video``, a
    smooth random scene with fine texture panning 2 px per frame (low and high frequencies and motion, as
    footage has); ``i2v``, Wan image-to-video's conditioning input (``WanImageToVideoPipeline.prepare_latents``):
    that scene's first frame, then F - 1 zero frames."""
    import torch
    import torch.nn.functional as F

    _factors(vae, family, width, height)
    if kind not in INPUTS:
        raise ValueError(f"--input must be one of {', '.join(INPUTS)}, got {kind!r}")
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    pan = 2 * (frames - 1)
    coarse = torch.randn(1, 3, height // 16 + 2, (width + pan) // 16 + 2, generator=g)
    scene = F.interpolate(coarse, size=(height, width + pan), mode="bicubic", align_corners=False)
    scene = torch.tanh(scene + 0.25 * torch.randn(1, 3, height, width + pan, generator=g))
    video = torch.stack([scene[..., 2 * t:2 * t + width] for t in range(frames)], dim=2)
    if kind == "i2v":
        video[:, :, 1:] = 0.0
    return video.contiguous()


def make_latents(vae, family: str, frames: int, width: int, height: int, seed: int, device: str, latents_file=None):
    """VAE-space latents (B, C, T, h, w) in fp32: the captured ones, or seeded N(0, 1) in the pipeline's latent
    space (what a denoiser produces) mapped through the pipeline's un-normalization — never zeros."""
    import torch

    from vdbench.vae.fast import prepare_latents

    if latents_file:
        from vdbench.capture import load_latents

        lat, _meta = load_latents(latents_file)
        lat = lat.float()
        if lat.dim() != 5:
            raise ValueError(f"{latents_file}: expected 5-D latents, got shape {tuple(lat.shape)}")
        if family == "cogvideox" and lat.shape[1] == vae.config.latent_channels != lat.shape[2]:
            lat = lat.permute(0, 2, 1, 3, 4)  # channel-first capture: to the pipeline layout (B, T, C, h, w)
    else:
        c, ts, ss = _factors(vae, family, width, height)
        g = torch.Generator(device="cpu").manual_seed(seed)
        lat = torch.randn(1, c, (frames - 1) // ts + 1, height // ss, width // ss, generator=g)
        if family == "cogvideox":
            lat = lat.permute(0, 2, 1, 3, 4)  # the pipeline's layout
    if family == "hunyuanvideo":  # no render family: its pipeline divides by the scaling factor
        return (lat.to(device) / vae.config.scaling_factor).to(vae.dtype).float()
    return prepare_latents(vae, lat.to(device), family).float()


# ----------------------------------------------------------------------------------------------------------------
# One config
# ----------------------------------------------------------------------------------------------------------------

def _to_frames(video):
    """(1, 3, F, H, W) in [-1, 1] -> (F, H, W, 3) float32 in [0, 1], as diffusers' VideoProcessor does."""
    return (video[0].permute(1, 2, 3, 0).float() / 2 + 0.5).clamp(0, 1)


def quality(frames, ref) -> dict:
    """This bench's columns of ``frames`` vs ``ref`` ((F, H, W, 3) tensors in [0, 1]): the shared frame-quality
    dict (``vdbench.measure.quality.frame_quality``, float64 on the frames' device) under the names its CSV and
    JSON have always used."""
    from vdbench.measure.quality import frame_quality

    q = frame_quality(frames, ref)
    return {"psnr_min": q["psnr_min"], "psnr_mean": q["psnr_mean"], "psnr_all": q["psnr"],
            "ssim_min": q["ssim_min"], "ssim_mean": q["ssim"], "psnr_per_frame": q["psnr_per_frame"],
            "ssim_per_frame": q["ssim_per_frame"]}


def _injected_stall(name: str, op: str = "decode") -> float:
    """``VDBENCH_TEST_STALL=[<op>:]<config>:<seconds>``: that config's decode (or, with ``encode:``, its encode)
    sleeps first (tests of the watchdog)."""
    spec = os.environ.get("VDBENCH_TEST_STALL", "")
    head, _, secs = spec.rpartition(":")
    which, sep, cfg = head.partition(":")
    if not sep or which not in OPS:
        which, cfg = "decode", head
    return float(secs) if spec and cfg == name and which == op else 0.0


class NotApplicable(Exception):
    """The config does not apply to this VAE / device (reported, not a failure)."""


def _encode_refusal(base: str, family: str, vae, glue, comp: bool, value, args) -> tuple[str | None, object]:
    """(why the config's encode does not apply or None, the fast encode's options or None)."""
    from vdbench.vae import encode as E

    if base == "memory":
        return ("memory@GiB bounds the decode's activations; the encode has no memory-bounded mode (its chunk is "
                "fast@K's)"), None
    if base == "chunked" and family != "wan":
        return f"{base}: the encode's chunks are the Wan encoder's (causal caches), not {type(vae).__name__}'s", None
    if base not in ("fast", "fast_nocl"):
        return None, None
    opts = E.EncodeOptions(chunk_frames=int(value or args.chunk_frames or E.FAST_ENCODE_DEFAULT_CHUNK),
                           channels_last=base == "fast", fused_glue=glue,
                           compile_backend=args.compile_backend if comp else None)
    try:
        E.check_encode("fast", opts, vae=vae)
    except ValueError as e:
        return str(e), None
    return None, opts


def prepare_config(name: str, value, vae, family: str, args, device: str, ops=("decode",)):
    """Apply config ``name`` (with its ``+modifiers``) to the fp32 ``vae``: returns (vae, {op: fn}, description,
    {op: info dict}, {op: why it does not apply}). ``fns["decode"](z) -> video`` (built whenever the decode
    applies: the encode's round trip decodes with it), ``fns["encode"](x) -> latents`` (the posterior's mean). A
    config none of whose ``ops`` applies raises :class:`NotApplicable`."""
    import contextlib
    import dataclasses

    import torch

    from vdbench.vae import decode as D
    from vdbench.vae import encode as E
    from vdbench.vae import fast as V

    base, mods = split_config(name)
    bench, comp = uses(name, "cudnn_benchmark"), uses(name, "compile")
    fused, eager_glue = "fused" in mods, "eager_glue" in mods
    if (fused or eager_glue) and (base not in ("fast", "fast_nocl", "memory") or comp or (fused and eager_glue)):
        raise NotApplicable("+fused / +eager_glue: the fast path's glue as Triton kernels (required) / as PyTorch "
                            "ops (fast / fast_nocl / memory; one of them, not with +compile)")
    glue = True if fused else False if eager_glue else None  # None: --vae_decode fast's default (auto)
    is_rocm = bool(getattr(torch.version, "hip", None))
    if base.startswith("miopen_"):
        if not (is_rocm and device.startswith("cuda")):
            raise NotApplicable("MIOpen presets apply to ROCm GPUs only")
        if os.environ.get(next(iter(MIOPEN_PRESETS[base]))) != MIOPEN_PRESETS[base][next(iter(MIOPEN_PRESETS[base]))]:
            raise RuntimeError(f"{name}: the MIOpen preset is not in this process's environment (needs a child)")
    bf16 = torch.bfloat16
    if bench and not device.startswith("cuda"):
        raise NotApplicable("cudnn.benchmark applies to CUDA/ROCm devices only")
    refused: dict[str, str] = {}
    if base == "chunked" and family != "wan":
        refused["decode"] = (f"{base}: implemented for the Wan VAE only (its causal-conv cache makes chunking "
                             f"exact; {type(vae).__name__}'s decode is not chunk-equivalent: CogVideoX's group norms "
                             "span its frame batches)")
    # the configs that run --vae_decode fast: its options, refused by the render's own check where they don't apply
    decode_opts = None
    if base in ("fast", "fast_nocl"):
        decode_opts = D.DecodeOptions(chunk_frames=int(value or args.chunk_frames or V.FAST_DEFAULT_CHUNK),
                                      channels_last=base == "fast", fused_glue=glue,
                                      compile_backend=args.compile_backend if comp else None)
    elif base == "memory":
        decode_opts = D.DecodeOptions(max_memory_gib=float(value or args.vae_max_memory), fused_glue=glue)
    if decode_opts is not None:
        try:
            D.check_decode("fast", decode_opts, vae=vae)
        except ValueError as e:
            refused["decode"] = str(e)
    why_not_encode, encode_opts = _encode_refusal(base, family, vae, glue, comp, value, args)
    if why_not_encode:
        refused["encode"] = why_not_encode
    if all(op in refused for op in ops):
        raise NotApplicable("; ".join(dict.fromkeys(refused[op] for op in ops)))
    if base != "fp32" and base != "bf16_autocast":
        vae = vae.to(bf16)
    autocast = (torch.autocast(device_type=torch.device(device).type, dtype=bf16) if base == "bf16_autocast"
                else contextlib.nullcontext())
    desc = {"dtype": "float32" if base in ("fp32", "bf16_autocast") else "bfloat16"}
    if base == "tiled":
        px = int(value or args.tile_px)
        kw = {}
        if px:  # 0: the VAE's own enable_tiling() defaults, as users call it
            kw = dict(tile_sample_min_height=px, tile_sample_min_width=px)
            if family in ("wan", "hunyuanvideo"):
                kw.update(tile_sample_stride_height=px * 3 // 4, tile_sample_stride_width=px * 3 // 4)
        vae.enable_tiling(**kw)
        desc["tile_px"] = [getattr(vae, "tile_sample_min_height", None), getattr(vae, "tile_sample_min_width", None)]
    if base == "channels_last_3d":
        V.channels_last_3d(vae)
    if bench:
        torch.backends.cudnn.benchmark = True
        desc["cudnn_benchmark"] = True
    fast = decode_opts is not None and decode_opts.max_memory_gib is None
    if comp:
        desc["compile_backend"] = args.compile_backend
        # fast paths: the norm/SiLU glue of the lean layers compiled (convs stay cuDNN's); others: the decoder and
        # the encoder (each compiled where its op is run)
        desc["compiled"] = ("fast-path glue (vdbench.vae.fast._norm_silu_cat)" if fast else
                            " and ".join(f"vae.{m}" for op, m in (("decode", "decoder"), ("encode", "encoder"))
                                         if op in ops))
        if not fast:
            vae.decoder = torch.compile(vae.decoder, backend=args.compile_backend)
            vae.encoder = torch.compile(vae.encoder, backend=args.compile_backend)
    info: dict = {"decode": {}, "encode": {}}
    fns: dict = {}
    if "decode" not in refused:
        if base == "chunked":
            k = int(value or args.chunk_frames or 4)
            desc["chunk_frames"] = k
            dfn = lambda z: V.wan_decode_chunked(vae, z, k, native_upsample=False)  # noqa: E731
        elif decode_opts is not None:
            if fast:
                desc.update(chunk_frames=decode_opts.chunk_frames, channels_last=decode_opts.channels_last)
            else:
                desc["max_memory_gib"] = decode_opts.max_memory_gib
            opts = dataclasses.asdict(decode_opts)
            dfn = lambda z: D.decode_video(vae, z, mode="fast", info=info["decode"], **opts)  # noqa: E731
        else:
            dfn = lambda z: vae.decode(z.to(vae.dtype), return_dict=False)[0]  # noqa: E731
        fns["decode"] = _wrapped(dfn, autocast, _injected_stall(_spec(name, value), "decode"), vae, "decode")
    if "encode" not in refused:
        if base == "chunked":
            k = int(value or args.chunk_frames or 4)
            efn = lambda x: E.wan_encode_chunked(vae, x, k).chunk(2, dim=1)[0]  # noqa: E731 (the posterior's mean)
        elif encode_opts is not None:
            eopts = dataclasses.asdict(encode_opts)
            efn = lambda x: E.encode_video(vae, x, mode="fast", info=info["encode"], **eopts)  # noqa: E731
        else:
            efn = lambda x: E.encode_video(vae, x, mode="default", info=info["encode"])  # noqa: E731
        fns["encode"] = _wrapped(efn, autocast, _injected_stall(_spec(name, value), "encode"), vae, "encode")
    return vae, fns, desc, info, refused


def _spec(name: str, value) -> str:
    return name + (f"@{value}" if value else "")


def _wrapped(fn, autocast, stall: float, vae, op: str):
    """``fn`` on its input cast to the VAE's dtype, under the config's autocast, as a function named ``op`` (what a
    hung config's stack dump shows); ``stall``: a test hook (VDBENCH_TEST_STALL) that proves the watchdog catches
    an op that never returns."""
    def run(t):
        if stall:
            time.sleep(stall)
        with autocast:
            return fn(t.to(vae.dtype))

    def decode(z):
        return run(z)

    def encode(x):
        return run(x)

    return {"decode": decode, "encode": encode}[op]


def profile_wanted(spec: str, patterns) -> bool:
    """``--profile_configs``: comma-separated shell patterns matched against the config spec (None: all)."""
    import fnmatch

    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(spec, p.strip()) for p in patterns.split(",") if p.strip())


def profile_op(fn, inp, device: str, top: int) -> dict:
    """One decode (or encode) under ``torch.profiler``: the ``top`` kernels by device time (CUDA/HIP kernels,
    memcpy and memset on a GPU; aten ops by self CPU time on the CPU), with calls, total ms and % of the total."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        out = fn(inp)
        if cuda:
            torch.cuda.synchronize()
    del out
    # one aggregation for every profile the project writes (vdbench.timing.kernel_summary: device kernels without
    # the GPU-side annotations, or aten ops' self CPU time on a CPU)
    from vdbench.timing import kernel_summary

    summary = kernel_summary(prof.events(), top=top)
    return {"time_kind": "self device time" if summary["source"] == "device kernels" else "self CPU time",
            "total_ms": summary["total_ms"],
            "kernels": [{"name": k["name"], "calls": int(k["calls"]), "total_ms": round(k["ms"], 3),
                         "pct": round(100.0 * k["share"], 2)} for k in summary["top"]]}


def _timed(fn, inp, args, device: str, stage, op: str):
    """The first call of ``fn(inp)`` timed on its own, ``--warmup`` - 1 more untimed calls, then ``--repeats`` timed
    warm calls (CUDA events after a synchronize; host clock on CPU): (warm times, the first call's time, peak bytes
    of the torch allocator over the warm calls, the last output). The first call is never a warm sample: it pays
    what is paid once (cuDNN plans, Triton JIT, compiles, allocator growth)."""
    import torch

    from vdbench.timing import Clock

    cuda = device.startswith("cuda")
    times, peak, out = [], 0, None
    warmups = max(1, args.warmup)  # the first call is one of them
    with torch.no_grad():
        stage(f"{op} first call")
        if cuda:
            torch.cuda.synchronize()
        t0 = Clock(torch.device(device))
        out = fn(inp)
        first = t0.seconds_until(Clock(torch.device(device)))
        del out
        for i in range(1, warmups):
            stage(f"{op} warmup {i + 1}/{warmups}")
            out = fn(inp)
            del out
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        out = None
        for i in range(args.repeats):
            stage(f"{op} repeat {i + 1}/{args.repeats}")
            out = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = Clock(torch.device(device))
            out = fn(inp)
            t1 = Clock(torch.device(device))
            times.append(t0.seconds_until(t1))
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated())
    return times, first, peak, out


def _time_fields(times, first: float, peak, device: str, prefix: str = "") -> dict:
    """An op's time keys: the warm calls' median with n, p20–p80 and min/max (``vdbench.timing.spread``), the first
    call and its excess over the warm median, the speed verdict, the peak memory."""
    from vdbench.timing import speed_verdict, spread

    st = spread(times)
    ok, why = speed_verdict(device, st["n"])
    out = {f"{prefix}time_s_{k}": st[k] for k in ("median", "min", "max", "p20", "p80", "n")}
    out.update({f"{prefix}times_s": times, f"{prefix}first_call_s": first,
                f"{prefix}first_call_excess_s": first - st["median"], f"{prefix}speed_figure": ok,
                f"{prefix}why_not_speed": why,
                f"{prefix}peak_memory_gib": (peak / 2 ** 30) if device.startswith("cuda") else None})
    return out


def run_config(spec: str, args, device: str, ref: dict | None = None, wd=None) -> tuple[dict, dict]:
    """Build, warm up, time and check one config in this process: the decode of the latents and the encode of the
    video (``--ops``), each against the fp32 reference's (``ref``: its outputs). Returns (result row, outputs:
    ``frames`` of the decode, ``latents`` and ``roundtrip`` frames of the encode, on the CPU)."""
    import torch

    from vdbench.measure.quality import rel_l2

    name, value = parse_config(spec)
    ops = parse_ops(args.ops)
    stage = wd.stage if wd is not None else (lambda s: None)
    res: dict = {"config": spec, "status": "ok"}
    stage("build vae")
    vae = build_vae(args.model, device, args.seed)
    family = _family_of(vae)
    w, h = parse_size(args.size)
    stage("inputs")
    z = make_latents(vae, family, args.frames, w, h, args.seed, device, args.latents) if "decode" in ops else None
    video = make_video(vae, family, args.frames, w, h, args.seed, args.input) if "encode" in ops else None
    if z is not None:
        res["latent_shape"] = list(z.shape)
    stage("prepare config")
    comp = uses(name, "compile")
    if comp:
        from torch._dynamo.utils import counters

        breaks0 = dict(counters["graph_break"])
        graphs0 = counters["stats"]["unique_graphs"]
    try:
        vae, fns, desc, info, refused = prepare_config(name, value, vae, family, args, device, ops)
    except NotApplicable as e:
        return {**res, "status": "not_applicable", "reason": str(e)}, {}
    res.update(desc)
    for op in ops:
        if op in refused:
            res.update({f"{op}_status": "not_applicable", f"{op}_reason": refused[op]})
    ref = ref or {}
    outputs: dict = {}
    prof = getattr(args, "profile", 0) and profile_wanted(spec, getattr(args, "profile_configs", None))
    flags = []
    if "decode" in ops and "decode" in fns:
        times, first, peak, out = _timed(fns["decode"], z, args, device, stage, "decode")
        res.update(**_time_fields(times, first, peak, device), output_shape=list(out.shape),
                   decode_info=dict(info["decode"]))
        frames = _to_frames(out)
        del out
        if prof:
            stage("decode profile")
            res["profile"] = profile_op(fns["decode"], z, device, args.profile)
        stage("decode quality")
        if "frames" in ref:
            res.update(quality(frames, ref["frames"]))
            res["decode_quality_flag"] = res["psnr_min"] < args.min_psnr
            flags.append(res["decode_quality_flag"])
        outputs["frames"] = frames.cpu()
        del frames
    if "encode" in ops and "encode" in fns:
        x = video.to(device=device, dtype=vae.dtype)  # as the pipeline hands it over: in the VAE's dtype
        times, first, peak, lat = _timed(fns["encode"], x, args, device, stage, "encode")
        res.update(**_time_fields(times, first, peak, device, "encode_"), input_shape=list(x.shape),
                   encode_latent_shape=list(lat.shape), encode_info=dict(info["encode"]))
        if prof:
            stage("encode profile")
            res["encode_profile"] = profile_op(fns["encode"], x, device, args.profile)
        del x
        stage("round trip")
        rt_decode = fns.get("decode") or (lambda q: vae.decode(q.to(vae.dtype), return_dict=False)[0])
        with torch.no_grad():
            rt = _to_frames(rt_decode(lat))
        res["roundtrip_decode"] = "this config's" if "decode" in fns else "diffusers' (the config's doesn't apply)"
        stage("encode quality")
        if "latents" in ref:
            res["latent_rel_l2"] = rel_l2(lat, ref["latents"], keep_device=True)
            q = quality(rt, ref["roundtrip"])
            res.update({f"roundtrip_{k}": v for k, v in q.items()})
            res["encode_quality_flag"] = q["psnr_min"] < args.min_psnr
            flags.append(res["encode_quality_flag"])
        outputs.update(latents=lat.float().cpu(), roundtrip=rt.cpu())
        del lat, rt
        if "time_s_median" in res:  # encode and decode apart (above) and together
            res["total_time_s_median"] = res["encode_time_s_median"] + res["time_s_median"]
    if comp:  # this config's compilations only (counters are per process)
        new = {k: v - breaks0.get(k, 0) for k, v in counters["graph_break"].items() if v > breaks0.get(k, 0)}
        res["graph_breaks"] = int(sum(new.values()))
        res["compiled_graphs"] = int(counters["stats"]["unique_graphs"] - graphs0)
        res["graph_break_reasons"] = sorted(str(k)[:200] for k in new)[:10]
    if flags:
        res["quality_flag"] = any(flags)
    return res, outputs


# ----------------------------------------------------------------------------------------------------------------
# Drivers: in-process and isolated (child processes)
# ----------------------------------------------------------------------------------------------------------------

def _run_guarded(spec, args, device, ref):
    """``run_config`` under the watchdog; errors and hangs become result rows, never exceptions."""
    from vdbench.watchdog import Watchdog, WatchdogTimeout

    try:
        with Watchdog(args.timeout, label=f"config {spec}") as wd:
            return run_config(spec, args, device, ref, wd=wd)
    except WatchdogTimeout as e:
        r = e.report
        return {"config": spec, "status": "hung", "reason": str(e), "last_completed_stage": r.last_completed_stage,
                "current_stage": r.current_stage, "timeout_s": r.timeout_s}, {}
    except Exception as e:  # noqa: BLE001 - one config's failure (OOM, compile error) must not stop the others
        import traceback

        traceback.print_exc()
        return {"config": spec, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:500]}"}, {}
    finally:
        _free(device)


def _free(device):
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
        torch.backends.cudnn.benchmark = False


def child_main(args) -> int:
    """``--_child SPEC``: run one config, write its row (and outputs, for the reference) to the given files."""
    import torch

    ref = None
    if args._ref:
        ref = torch.load(args._ref, map_location="cpu", weights_only=True)  # to the GPU only for metrics

    def on_hang(report):  # the process may be ended right after this (stuck in native code): leave the row
        Path(args._result).write_text(json.dumps({"config": args._child, "status": "hung",
                                                  "last_completed_stage": report.last_completed_stage,
                                                  "current_stage": report.current_stage,
                                                  "timeout_s": report.timeout_s}))

    from vdbench.watchdog import Watchdog, WatchdogTimeout

    try:
        with Watchdog(args.timeout, label=f"config {args._child}", on_hang=on_hang, grace_s=5) as wd:
            res, outputs = run_config(args._child, args, args.device, ref, wd=wd)
    except WatchdogTimeout as e:
        r = e.report
        res, outputs = {"config": args._child, "status": "hung", "reason": str(e),
                        "last_completed_stage": r.last_completed_stage, "current_stage": r.current_stage,
                        "timeout_s": r.timeout_s}, {}
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        res, outputs = {"config": args._child, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:500]}"}, {}
    res["pid"] = os.getpid()
    res.update(_how_it_ran(args, first=True))
    if args._save_ref and outputs:
        torch.save(outputs, args._save_ref)
    Path(args._result).write_text(json.dumps(res, default=str))
    return 0


def _how_it_ran(args, first: bool) -> dict:
    """A row's ``cold``, ``caches`` and ``cache_dirs``: the compile caches' state when this process started
    (``args._cache_state``, taken before anything compiled); a config after the first in one process finds what
    the earlier ones left."""
    state = getattr(args, "_cache_state", None) or {"caches": None, "cache_dirs": None}
    return {"cold": bool(args.cold), "caches": state["caches"] if first else SHARED_CACHES,
            "cache_dirs": state["cache_dirs"]}


def _child_cmd(spec, args, result, ref=None, save_ref=None):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", spec, "--_result", str(result),
           "--model", args.model, "--frames", str(args.frames), "--size", args.size, "--tile_px", str(args.tile_px),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--min_psnr", str(args.min_psnr),
           "--device", args.device, "--seed", str(args.seed), "--vae_max_memory", str(args.vae_max_memory),
           "--compile_backend", args.compile_backend, "--profile", str(args.profile), "--ops", args.ops,
           "--input", args.input]
    if args.chunk_frames:
        cmd += ["--chunk_frames", str(args.chunk_frames)]
    if args.profile_configs:
        cmd += ["--profile_configs", args.profile_configs]
    if args.timeout:
        cmd += ["--timeout", str(args.timeout)]
    if args.cold:
        cmd += ["--cold"]
    if args.latents:
        cmd += ["--latents", args.latents]
    if ref:
        cmd += ["--_ref", str(ref)]
    if save_ref:
        cmd += ["--_save_ref", str(save_ref)]
    return cmd


def _run_child(spec, args, tmp: Path, ref=None, save_ref=None) -> dict:
    """One config in its own process, with its environment presets (and with ``--cold`` new empty compile caches,
    removed when it ends); the parent enforces the timeout too (the child's own watchdog dumps stacks first; a
    child that is stuck beyond it is killed here)."""
    import contextlib

    from vdbench.timing import fresh_cache_env

    result = tmp / f"{spec.replace('@', '_')}.json"
    result.unlink(missing_ok=True)
    cmd = _child_cmd(spec, args, result, ref, save_ref)
    limit = (args.timeout + 30) if args.timeout else None
    t0 = time.monotonic()
    caches = fresh_cache_env(child_env(spec)) if args.cold else contextlib.nullcontext(child_env(spec))
    with caches as env:
        try:
            proc = subprocess.run(cmd, env=env, timeout=limit, cwd=str(ROOT))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    if result.exists():
        try:
            res = json.loads(result.read_text())
        except json.JSONDecodeError:
            res = {"config": spec, "status": "error", "reason": "child wrote an unreadable result"}
        if rc not in (0, None) and res.get("status") == "ok":
            res.update(status="error", reason=f"child exited {rc}")
        res["child_exit_code"] = rc
        return res
    if rc is None:
        return {"config": spec, "status": "hung", "reason": f"killed by the parent after {limit} s",
                "last_completed_stage": None, "timeout_s": args.timeout, "cold": bool(args.cold)}
    return {"config": spec, "status": "error", "reason": f"child exited {rc} without a result",
            "wall_s": time.monotonic() - t0, "cold": bool(args.cold)}


def run_all(args, on_row=None) -> list[dict]:
    """The fp32 reference, then every config; ``on_row(rows)`` after each (results are written as they come,
    so a run killed from outside still leaves every finished config on disk)."""
    import torch

    specs = [s.strip() for s in args.configs.split(",") if s.strip()]
    for s in specs:
        parse_config(s)
    if "fp32" not in specs:  # the reference is always measured and reported
        specs.insert(0, "fp32")
    rows = []
    device = args.device
    with tempfile.TemporaryDirectory(prefix="bench_vae_") as td:
        tmp = Path(td)
        ref_path = tmp / "ref.pt"
        needs_child = lambda s: args.isolate or parse_config(s)[0].startswith("miopen_")  # noqa: E731
        # (a miopen_* base is always first in the name, so the prefix test covers its composites too)
        # The reference: fp32, untiled, stock decode of the same latents and stock encode of the same video.
        print(f"[bench_vae] reference: fp32 untiled {' and '.join(parse_ops(args.ops))}", flush=True)
        if args.isolate:
            ref_row = _run_child("fp32", args, tmp, save_ref=ref_path)
            ref = torch.load(ref_path, map_location="cpu", weights_only=True) if ref_path.exists() else None
        else:
            ref_row, ref = _run_guarded("fp32", args, device, None)  # its outputs are on the CPU: they must not
            ref_row.update(_how_it_ran(args, first=True))            # count in later configs' peak memory
            if ref:
                torch.save(ref, ref_path)
        if not ref:
            ref = None
            print(f"[bench_vae] the fp32 reference did not complete: {ref_row.get('reason')}", flush=True)
        else:
            if "frames" in ref:
                ref_row.update(psnr_min=math.inf, psnr_mean=math.inf, ssim_min=1.0, ssim_mean=1.0,
                               decode_quality_flag=False)
            if "latents" in ref:
                ref_row.update(latent_rel_l2=0.0, roundtrip_psnr_min=math.inf, roundtrip_psnr_mean=math.inf,
                               roundtrip_ssim_min=1.0, roundtrip_ssim_mean=1.0, encode_quality_flag=False)
            ref_row.update(quality_flag=False, reference=True)
        for spec in specs:
            if spec == "fp32":
                rows.append(ref_row)
                _print_row(ref_row)
                if on_row:
                    on_row(rows)
                continue
            print(f"[bench_vae] config {spec}", flush=True)
            if ref is None:
                row = {"config": spec, "status": "error", "reason": "no fp32 reference to compare with"}
            elif needs_child(spec):
                row = _run_child(spec, args, tmp, ref=ref_path)
            else:
                row, _outputs = _run_guarded(spec, args, device, ref)
                row.update(_how_it_ran(args, first=False))
                del _outputs
            rows.append(row)
            _print_row(row)
            if on_row:
                on_row(rows)
    return rows


def _fmt_time(r, prefix: str = "") -> str:
    """The warm median with its n and spread, the first call apart, the peak memory."""
    mem = r.get(f"{prefix}peak_memory_gib")
    first = r.get(f"{prefix}first_call_s")
    return (f"{r[prefix + 'time_s_median']:.3f} s (warm, n={r.get(prefix + 'time_s_n')}, p20–p80 "
            f"{r[prefix + 'time_s_p20']:.3f}–{r[prefix + 'time_s_p80']:.3f}, min {r[prefix + 'time_s_min']:.3f}, "
            f"max {r[prefix + 'time_s_max']:.3f})"
            + (f", first call {first:.3f} s (+{r[prefix + 'first_call_excess_s']:.3f})" if first is not None else "")
            + f"  peak {f'{mem:.2f} GiB' if mem is not None else 'n/a (CPU)'}")


def _fmt_quality(r, prefix: str = "") -> str:
    if r.get(f"{prefix}psnr_min") is None:
        return ""
    q = f"PSNR min/mean {r[prefix + 'psnr_min']:.2f}/{r.get(prefix + 'psnr_mean', float('nan')):.2f} dB"
    return q + (f", SSIM min {r[prefix + 'ssim_min']:.4f}" if r.get(f"{prefix}ssim_min") is not None else "")


def _print_row(r):
    """The config's decode, encode (latents and round trip against the fp32 ones) and both together."""
    if r.get("status") != "ok":
        extra = f" (last completed stage: {r.get('last_completed_stage')})" if r.get("status") == "hung" else ""
        print(f"  {r['config']:<18} {r['status'].upper()}: {r.get('reason', '')}{extra}", flush=True)
        return
    flag = "  ** BELOW --min_psnr **"
    lines = []
    if "time_s_median" in r:
        lines.append(f"decode {_fmt_time(r)}  {_fmt_quality(r)}{flag if r.get('decode_quality_flag') else ''}")
    for op in OPS:
        if r.get(f"{op}_status") == "not_applicable":
            lines.append(f"{op} not applicable: {r.get(f'{op}_reason')}")
    if "encode_time_s_median" in r:
        rel = r.get("latent_rel_l2")
        lines.append(f"encode {_fmt_time(r, 'encode_')}  latents rel L2 "
                     f"{'n/a' if rel is None else f'{rel:.2e}'}, round trip {_fmt_quality(r, 'roundtrip_')}"
                     f"{flag if r.get('encode_quality_flag') else ''}")
    if "total_time_s_median" in r:
        lines.append(f"encode + decode {r['total_time_s_median']:.3f} s")
    print(f"  {r['config']:<18} " + ("\n" + " " * 21).join(lines), flush=True)
    if "graph_breaks" in r:
        print(f"    compile: {r['graph_breaks']} graph breaks, {r.get('compiled_graphs')} graphs", flush=True)
    for op, key in (("decode", "decode_info"), ("encode", "encode_info")):
        glue = (r.get(key) or {}).get("glue")
        if glue:
            print(f"    {op} glue: {glue}", flush=True)
    for op, key in (("decode", "profile"), ("encode", "encode_profile")):
        prof = r.get(key)
        if prof:
            print(f"    {op}: top {len(prof['kernels'])} by {prof['time_kind']} (total {prof['total_ms']:.1f} ms):",
                  flush=True)
            for k in prof["kernels"]:
                print(f"    {k['pct']:5.1f}% {k['total_ms']:9.2f} ms {k['calls']:6d}x  {k['name'][:110]}", flush=True)


def write_output(path: str, header: dict, rows: list[dict]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".csv":
        timing = ["time_s_median", "time_s_min", "time_s_max", "time_s_p20", "time_s_p80", "time_s_n",
                  "first_call_s", "first_call_excess_s", "speed_figure", "why_not_speed"]
        keys = ["config", "status", "dtype", *timing, "peak_memory_gib",
                "psnr_min", "psnr_mean", "ssim_min", "ssim_mean", "quality_flag", "reason", "last_completed_stage",
                *(f"encode_{k}" for k in timing), "encode_peak_memory_gib",
                "latent_rel_l2", "roundtrip_psnr_min", "roundtrip_psnr_mean", "roundtrip_ssim_min",
                "encode_quality_flag", "total_time_s_median", "encode_status", "encode_reason", "cold", "caches"]
        with open(p, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=["model", "latents", "output_shape", *keys, "video"],
                                extrasaction="ignore")
            wr.writeheader()
            a = header["args"]
            for r in rows:
                shape = r.get("output_shape")
                wr.writerow({"model": a["model"], "latents": a.get("latents") or f"random {a['frames']}f {a['size']}",
                             **r, "output_shape": "x".join(map(str, shape)) if shape else "",
                             "video": f"{a['input']} {a['frames']}f {a['size']}" if "encode" in a["ops"] else ""})
    else:
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps({**header, "results": rows}, indent=1, default=str))
        os.replace(tmp, p)


def exit_code(rows: list[dict]) -> int:
    if any(r.get("status") not in ("ok", "not_applicable") for r in rows):
        return 1
    if any(r.get("quality_flag") for r in rows):
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vdbench.helptext import DefaultsHelpFormatter
    from vdbench.vae.fast import FAST_DEFAULT_CHUNK

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
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed warm decodes (and encodes) per config: their median with n and p20–p80 "
                         "(fewer than 3: not a speed figure)")
    ap.add_argument("--latents", default=None, help="latents file captured by a render (--save_latents)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma-separated, of: {', '.join(CONFIGS)}; each optionally +{' / +'.join(MODIFIERS)}")
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

    import vdbench.vae.decode  # noqa: F401
    import vdbench.vae.encode  # noqa: F401
    import vdbench.measure.quality  # noqa: F401
    import vdbench.pipelines  # noqa: F401
    import vdbench.vae.fast  # noqa: F401


def main(argv=None) -> int:
    from vdbench.timing import cache_state

    ap = build_parser()
    args = ap.parse_args(argv)
    args._cache_state = cache_state()  # before anything compiles: what this process's first calls find
    parse_ops(args.ops)  # refused before any work
    if args.repeats < 1:
        ap.error("--repeats must be at least 1 (the warm calls the median is taken over)")
    if args.cold:
        args.isolate = True  # a cold first call needs a fresh process (and the empty caches it is given)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
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
        from vdbench.measure.record import write_beside

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


if __name__ == "__main__":
    sys.exit(main())
