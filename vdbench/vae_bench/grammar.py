"""The VAE bench's configs as text: ``name[+modifier...][@value]``, the ops (``--ops``), the sizes, and the
environment a child process that runs a config gets (MIOpen presets)."""

from __future__ import annotations

import os

MODELS = ("wan2.1", "wan2.2", "cogvideox", "hunyuanvideo")
CONFIGS = ("fp32", "bf16", "bf16_autocast", "tiled", "chunked", "channels_last_3d", "cudnn_benchmark", "compile",
           "fast", "fast_nocl", "memory", "miopen_fast", "miopen_immediate", "miopen_naive_off")
#: Modifiers that compose with any config: ``fast+cudnn_benchmark``, ``fast+compile``, ``bf16+cudnn_benchmark``...
MODIFIERS = ("cudnn_benchmark", "compile", "fused", "eager_glue")
#: What a config times (``--ops``), and what the encode gets (``--input``, :func:`make_video`).
OPS = ("decode", "encode")
INPUTS = ("video", "i2v")
DEFAULT_CONFIGS = "fp32,bf16,bf16_autocast,tiled,chunked,channels_last_3d,cudnn_benchmark,fast,memory"
# On a CPU the bench checks the plumbing, never speed (host clock, shared machine): the fp32 configs that run there in
# seconds. The rest are for a GPU: bf16 runs in emulation-slow kernels on most CPUs, cudnn/channels_last/fast/memory
# are choices of the GPU's kernels.
CPU_DEFAULT_CONFIGS = "fp32,chunked"
CPU_DEFAULT_REPEATS = 1
GPU_DEFAULT_REPEATS = 5

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


def parse_tail(text: str):
    """The ``S`` of ``fast@K/S`` -> latent frames a call past the decoder's last temporal upsampling (an int), or
    ``S1/S2`` past its last two (a tuple: ``vdbench.vae.lean.fast_layers``' ``tail_frames``); refused unless each is
    a whole number of at least 1."""
    try:
        parts = tuple(int(p) for p in text.split("/"))
    except ValueError:
        parts = ()
    if not 1 <= len(parts) <= 2 or min(parts) < 1:
        raise ValueError(f"fast@K/S: S is latent frames a call past the last temporal upsampling (S) or the last two "
                         f"(S1/S2), each 1 or more, not {text!r}")
    return parts[0] if len(parts) == 1 else parts


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


def config_spec(name: str, value) -> str:
    return name + (f"@{value}" if value else "")
