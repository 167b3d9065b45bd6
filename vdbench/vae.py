"""VAE decode of a pipeline's latents, separated from the denoising loop so it can be timed on its own.

The pipelines are called with ``output_type="latent"``; decoding here repeats exactly what each diffusers
pipeline does after its loop (Wan: un-normalize with the VAE's latents_mean/std; CogVideoX: divide by the
scaling factor and move frames to the channel-first layout), so the video is the one the pipeline would
have produced.
"""

from __future__ import annotations

import torch

__all__ = ["decode_latents"]


@torch.no_grad()
def decode_latents(pipe, latents: torch.Tensor, family: str, num_frames: int | None = None):
    """Latents from ``pipe(..., output_type="latent")`` -> float frames (T, H, W, 3) in [0, 1] (numpy).

    ``num_frames`` (CogVideoX only): the requested frame count, to drop the padding latent frames that
    CogVideoX 1.5 (temporal patch size) adds, as its pipeline does before decoding.
    """
    vae = pipe.vae
    if family == "wan":
        latents = latents.to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
    elif family == "cogvideox":
        patch_t = getattr(pipe.transformer.config, "patch_size_t", None)
        if patch_t and num_frames is not None:
            latent_frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
            extra = (patch_t - latent_frames % patch_t) % patch_t
            latents = latents[:, extra:]
        video = pipe.decode_latents(latents.to(vae.dtype))
    else:
        raise ValueError(f"unknown pipeline family {family!r}")
    return pipe.video_processor.postprocess_video(video, output_type="np")[0]
