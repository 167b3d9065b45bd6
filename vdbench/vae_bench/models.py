"""The VAE bench's models and inputs: the VAE of a ``--model`` value (a family's, HunyuanVideo's, a checkpoint),
the latents its decode gets, the video its encode gets, and the system the run is on."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from .grammar import INPUTS, MODELS


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


def tiny_name(model: str) -> tuple[bool, str]:
    """``(tiny, VAE name)`` of a ``--model`` value: ``tiny`` -> the tiny Wan 2.1 VAE, ``tiny:<name>`` (and the older
    ``tiny-<name>``) -> that VAE's tiny config; anything else -> ``(False, model)``."""
    if model == "tiny":
        return True, MODELS[0]
    for prefix in ("tiny:", "tiny-"):
        if model.startswith(prefix):
            return True, model[len(prefix):]
    return False, model


def vae_spec(model: str):
    """(diffusers class name, config kwargs) of HunyuanVideo's VAE, the one named model that is no render family's
    (the families' VAEs come from ``vdbench.pipelines.build_vae``); None for another name."""
    tiny, name = tiny_name(model)
    if name == "hunyuanvideo":
        cfg = dict(block_out_channels=(8, 16, 16, 16), norm_num_groups=4, layers_per_block=1) if tiny else {}
        return "AutoencoderKLHunyuanVideo", cfg
    return None


def family_of(vae) -> str:
    """The latent handling ``vae`` needs: its render family's name, or ``hunyuanvideo``."""
    from .. import families

    return "hunyuanvideo" if type(vae).__name__ == "AutoencoderKLHunyuanVideo" else families.for_vae(vae).name


def build_vae(model: str, device: str, seed: int = 0):
    """fp32 VAE on ``device``: a named architecture with seeded random weights, or a checkpoint."""
    import diffusers
    import torch

    from .. import pipelines as P

    tiny, name = tiny_name(model)
    if name in P.vae_names():
        return P.build_vae(name, device=device, seed=seed, tiny=tiny)
    spec = vae_spec(model)
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


def factors(vae, family: str, width: int, height: int) -> tuple[int, int, int]:
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

    factors(vae, family, width, height)
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

    from ..vae.fast import prepare_latents

    if latents_file:
        from ..capture import load_latents

        lat, _meta = load_latents(latents_file)
        lat = lat.float()
        if lat.dim() != 5:
            raise ValueError(f"{latents_file}: expected 5-D latents, got shape {tuple(lat.shape)}")
        if family == "cogvideox" and lat.shape[1] == vae.config.latent_channels != lat.shape[2]:
            lat = lat.permute(0, 2, 1, 3, 4)  # channel-first capture: to the pipeline layout (B, T, C, h, w)
    else:
        c, ts, ss = factors(vae, family, width, height)
        g = torch.Generator(device="cpu").manual_seed(seed)
        lat = torch.randn(1, c, (frames - 1) // ts + 1, height // ss, width // ss, generator=g)
        if family == "cogvideox":
            lat = lat.permute(0, 2, 1, 3, 4)  # the pipeline's layout
    if family == "hunyuanvideo":  # no render family: its pipeline divides by the scaling factor
        return (lat.to(device) / vae.config.scaling_factor).to(vae.dtype).float()
    return prepare_latents(vae, lat.to(device), family).float()
