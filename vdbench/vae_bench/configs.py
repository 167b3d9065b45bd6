"""A VAE bench config applied to the fp32 VAE: its decode and encode functions, what it changed, and why an op
does not apply."""

from __future__ import annotations

import os
import time

from .grammar import MIOPEN_PRESETS, OPS, config_spec, parse_tail, split_config, uses


def injected_stall(name: str, op: str = "decode") -> float:
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


def encode_refusal(base: str, family: str, vae, glue, comp: bool, value, args) -> tuple[str | None, object]:
    """(why the config's encode does not apply or None, the fast encode's options or None)."""
    from ..vae import encode as E

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

    from ..vae import decode as D
    from ..vae import encode as E
    from ..vae import fast as V

    base, mods = split_config(name)
    spec, tail = config_spec(name, value), None
    if base in ("fast", "fast_nocl") and value and "/" in value:  # fast@K/S(/S2): K latent frames a call, then S
        value, tail = value.split("/", 1)
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
        k = value or args.chunk_frames  # none given: the decode's own default (its info says which ran)
        decode_opts = D.DecodeOptions(chunk_frames=int(k) if k else None,
                                      channels_last=base == "fast", fused_glue=glue,
                                      compile_backend=args.compile_backend if comp else None,
                                      tail_frames=parse_tail(tail) if tail else None)
    elif base == "memory":
        decode_opts = D.DecodeOptions(max_memory_gib=float(value or args.vae_max_memory), fused_glue=glue)
    if decode_opts is not None:
        try:
            D.check_decode("fast", decode_opts, vae=vae)
        except ValueError as e:
            refused["decode"] = str(e)
    why_not_encode, encode_opts = encode_refusal(base, family, vae, glue, comp, value, args)
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
        desc["compiled"] = ("fast-path glue (vdbench.vae.lean._norm_silu_cat)" if fast else
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
                desc.update(chunk_frames=decode_opts.chunk_frames, channels_last=decode_opts.channels_last,
                            tail_frames=decode_opts.tail_frames)  # None: the runner records what the decode ran
            else:
                desc["max_memory_gib"] = decode_opts.max_memory_gib
            opts = dataclasses.asdict(decode_opts)
            dfn = lambda z: D.decode_video(vae, z, mode="fast", info=info["decode"], **opts)  # noqa: E731
        else:
            dfn = lambda z: vae.decode(z.to(vae.dtype), return_dict=False)[0]  # noqa: E731
        fns["decode"] = wrapped(dfn, autocast, injected_stall(spec, "decode"), vae, "decode")
    if "encode" not in refused:
        if base == "chunked":
            k = int(value or args.chunk_frames or 4)
            efn = lambda x: E.wan_encode_chunked(vae, x, k).chunk(2, dim=1)[0]  # noqa: E731 (the posterior's mean)
        elif encode_opts is not None:
            eopts = dataclasses.asdict(encode_opts)
            efn = lambda x: E.encode_video(vae, x, mode="fast", info=info["encode"], **eopts)  # noqa: E731
        else:
            efn = lambda x: E.encode_video(vae, x, mode="default", info=info["encode"])  # noqa: E731
        fns["encode"] = wrapped(efn, autocast, injected_stall(spec, "encode"), vae, "encode")
    return vae, fns, desc, info, refused


def wrapped(fn, autocast, stall: float, vae, op: str):
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
