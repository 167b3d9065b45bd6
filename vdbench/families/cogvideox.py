"""The CogVideoX family (THUDM's CogVideoX, diffusers' ``CogVideoXPipeline`` / ``CogVideoXImageToVideoPipeline``).

Everything vdbench knows about CogVideoX lives here: pipeline classes, tiny and random-weight variants, the frame
rule (8k+1) and the fixed size of models with learned positional embeddings, how latents reach the VAE (the
pipeline's (B, T, C, H, W) layout, CogVideoX 1.5's padding frames), output file names, what the parallel engines
can split, how its joint text+video attention calls are classified and the benchmark shapes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .. import tiny
from . import CliDefaults, Family, XfuserWiring, model_tag

if TYPE_CHECKING:  # torch is imported where tensors are made: the family tables (labels, listings) stay light
    import torch


def _cogvideox_ddim(snr_shift_scale: float) -> dict:
    """CogVideoX's scheduler config (v-prediction, zero-terminal-SNR, SNR shift) as in the real
    scheduler_config.json: the 2b's DDIM with shift 3.0, the 5b's (CogVideoXDPMScheduler) with 1.0."""
    return {
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "clip_sample": False,
        "clip_sample_range": 1.0,
        "num_train_timesteps": 1000,
        "prediction_type": "v_prediction",
        "rescale_betas_zero_snr": True,
        "sample_max_value": 1.0,
        "set_alpha_to_one": True,
        "snr_shift_scale": snr_shift_scale,
        "steps_offset": 0,
        "timestep_spacing": "trailing",
    }



# CogVideoX transformer: head_dim 32 (real 64; 32 still leaves the 3D rope its t/h/w split: 8/12/12), 2 heads,
# 2 layers (real 30 heads x 30 layers for 2b, 48 x 42 for 5b).
COG_TRANSFORMER = {
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "time_embed_dim": 32,
    "ofs_embed_dim": None,
    "text_embed_dim": 32,
    "num_layers": 2,
    "dropout": 0.0,
    "attention_bias": True,
    "sample_width": 90,
    "sample_height": 60,
    "sample_frames": 49,
    "patch_size": 2,
    "patch_size_t": None,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 226,
    "activation_fn": "gelu-approximate",
    "timestep_activation_fn": "silu",
    "norm_elementwise_affine": True,
    "norm_eps": 1e-5,
    "spatial_interpolation_scale": 1.875,
    "temporal_interpolation_scale": 1.0,
    "use_rotary_positional_embeddings": False,
    "use_learned_positional_embeddings": False,
}

# CogVideoX VAE: 4 blocks (3 spatial down/up stages -> 8x, 2 of them temporal -> 4x). Real: block_out_channels
# (128, 256, 256, 512), 3 layers per block, 32 norm groups.
COG_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["CogVideoXDownBlock3D"] * 4,
    "up_block_types": ["CogVideoXUpBlock3D"] * 4,
    "block_out_channels": [8, 16, 16, 32],
    "latent_channels": 16,
    "layers_per_block": 1,
    "act_fn": "silu",
    "norm_eps": 1e-6,
    "norm_num_groups": 4,
    "temporal_compression_ratio": 4,
    "sample_height": 480,
    "sample_width": 720,
    "scaling_factor": 1.15258426,
    "shift_factor": None,
    "latents_mean": None,
    "latents_std": None,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "invert_scale_latents": False,
}


# The real checkpoints' configs (config.json values), for the random-weight models.
_COG_2B = dict(COG_TRANSFORMER, num_attention_heads=30, attention_head_dim=64, time_embed_dim=512,
               text_embed_dim=4096, num_layers=30)
_COG_5B = dict(_COG_2B, num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True)
COG_VAE_REAL = dict(COG_VAE, block_out_channels=[128, 256, 256, 512], layers_per_block=3, norm_num_groups=32)


def transformer_init(model) -> None:
    """Make the random CogVideoX transformer's output depend clearly on its attention (deterministic tweak).

    Each block gates its attention and FFN branches with ``Linear(silu(temb))`` (``norm1``/``norm2.linear``); at
    the tiny time_embed_dim of 32 the default init leaves those gates small, so attention hardly reaches the
    output. Scaling the two modulation linears by 8 gives O(1) modulation. Measured on cogvideox-t2v (17x128x192,
    4 steps, CFG 5): mean |frame change| with the attention output zeroed 0.004 -> 0.046 (a different seed
    changes frames by ~0.09), with it rounded to bfloat16 < 0.0001 -> 0.0003.
    """
    import torch

    with torch.no_grad():
        for block in model.transformer_blocks:
            for norm in (block.norm1, block.norm2):
                norm.linear.weight.mul_(8.0)
                norm.linear.bias.mul_(8.0)


def _variant(**kwargs) -> tiny.TinyVariant:
    """A CogVideoX tiny variant: the CogVideoX classes, T5 text encoder (226 tokens) and DDIM scheduler."""
    common = dict(family="cogvideox", transformer_class="CogVideoXTransformer3DModel",
                  vae_class="AutoencoderKLCogVideoX", text_encoder=tiny.T5_TEXT_ENCODER,
                  scheduler_class="CogVideoXDDIMScheduler", tokenizer_max_length=226,
                  transformer_init=transformer_init)
    return tiny.TinyVariant(**{**common, **kwargs})


TINY_VARIANTS = (
    _variant(
        name="cogvideox-t2v",
        tasks=("t2v",),
        pipeline="CogVideoXPipeline",
        mirrors="THUDM/CogVideoX-2b",
        transformer=COG_TRANSFORMER,
        vae=COG_VAE,
        scheduler=_cogvideox_ddim(3.0),
        seed=6,
    ),
    _variant(
        name="cogvideox-i2v",
        tasks=("i2v",),
        pipeline="CogVideoXImageToVideoPipeline",
        mirrors="THUDM/CogVideoX-5b-I2V",
        # 5b-I2V: 32 input channels (noise + image latents), 3D rope AND learned positional embeddings. The
        # learned embeddings pin the resolution to sample_height/width x 8 (diffusers refuses others), so the
        # tiny sample size is 16 x 24 latents = 128 x 192 pixels (real 60 x 90 = 480 x 720) and 17 frames
        # (real 49).
        transformer=dict(
            COG_TRANSFORMER,
            in_channels=32,
            sample_height=16,
            sample_width=24,
            sample_frames=17,
            use_rotary_positional_embeddings=True,
            use_learned_positional_embeddings=True,
        ),
        vae=dict(COG_VAE, scaling_factor=0.7),
        scheduler_class="CogVideoXDPMScheduler",  # the 5b checkpoints' (the 2b's is DDIM)
        scheduler=_cogvideox_ddim(1.0),
        seed=7,
    ),
)
# cogvideox-t2v-d64: head dim 64 (the real 2b's), the smallest the project's Triton kernels take, so a whole tiny
# pipeline runs them (on a CPU under Triton's interpreter); 2 heads (inner dim 128)
TINY_VARIANTS += (tiny.with_head_dim(TINY_VARIANTS[0], 64, seed=9),)

RANDOM_VARIANTS = {
    "cogvideox-2b": ("cogvideox-t2v", dict(transformer=_COG_2B, vae=COG_VAE_REAL, text_encoder=tiny.T5_XXL_WIDTH)),
    "cogvideox-5b": ("cogvideox-t2v", dict(transformer=_COG_5B, vae=COG_VAE_REAL, text_encoder=tiny.T5_XXL_WIDTH,
                                           scheduler_class="CogVideoXDPMScheduler", scheduler=_cogvideox_ddim(1.0))),
}


def output_name(task, model, num_frames, steps, attention_type, height, width, layout: str = "") -> str:
    """``cogvideox-<model>_<type>[_<layout>].mp4`` (written directly in the output directory; ``layout`` the
    parallel layout tag, e.g. ``cfg2``); the size, frames and steps are in timing.json, not in the name."""
    return f"cogvideox-{model_tag(model)}_{attention_type}{'_' + layout if layout else ''}.mp4"


# The model tag (2b, 5b-i2v, 1.5-5b, tiny) has no underscore (model_tag), so the type is everything after the first.
_NAME_RE = re.compile(r"^cogvideox-[^_]+_(?P<type>.+)$")


def parse_label(stem: str):
    """The attention type in a CogVideoX output name (:func:`output_name`), or None for another name."""
    m = _NAME_RE.match(stem)
    return m.group("type") if m else None


def fixed_size(transformer, spatial: int):
    """Models with learned positional embeddings (5b-I2V) only run at their sample size (diffusers refuses
    others): (height, width, why), or None for the others."""
    if not transformer.config.use_learned_positional_embeddings:
        return None
    return (transformer.config.sample_height * spatial, transformer.config.sample_width * spatial,
            "this CogVideoX model has learned positional embeddings")


def prepare_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """(B, T, C, H, W) -> (B, C, T, H, W) and divided by the scaling factor, as the pipeline's decode_latents."""
    return (latents.permute(0, 2, 1, 3, 4) / vae.config.scaling_factor).to(vae.dtype)


def trim_latents(pipe, latents: torch.Tensor, num_frames):
    """Drop the padding latent frames CogVideoX 1.5 (temporal patch size) adds at the front, as its pipeline does
    before decoding; ``num_frames`` is the requested frame count (None: keep all)."""
    patch_t = getattr(pipe.transformer.config, "patch_size_t", None)
    if patch_t and num_frames is not None:
        latent_frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        extra = (patch_t - latent_frames % patch_t) % patch_t
        latents = latents[:, extra:]
    return latents


def attention_calls(denoiser: dict, vae: dict, height: int, width: int, num_frames: int, guidance_scale: float,
                    pipe_kwargs: dict) -> tuple:
    """(batch, heads, seq, heads_kv, seq_kv, head_dim) of a CogVideoX render's one attention call: joint attention
    over the text tokens (``max_sequence_length``, 226 by default) and the latent tokens ((frames - 1) / t + 1,
    padded to the temporal patch where the transformer has one, height / s, width / s, patchified); both guidance
    passes in one batch (2 videos) when the guidance scale is above 1."""
    t = int(vae.get("temporal_compression_ratio", 4))
    s = 2 ** (len(vae.get("block_out_channels", (0, 0, 0, 0))) - 1)
    p, pt = int(denoiser.get("patch_size", 2)), denoiser.get("patch_size_t")
    frames = (num_frames - 1) // t + 1
    if pt:
        frames = -(-frames // pt)
    tokens = frames * (height // s // p) * (width // s // p)
    seq = int(pipe_kwargs.get("max_sequence_length", denoiser.get("max_text_seq_length", 226))) + tokens
    heads, d = int(denoiser["num_attention_heads"]), int(denoiser["attention_head_dim"])
    return ((2 if guidance_scale > 1 else 1, heads, seq, heads, seq, d),)


def parallel_refusal(engine: str, task: str, world_size: int, use_cfg_parallel: bool):
    """What each engine can split, as shipped (diffusers 0.42.1, xfuser 0.7.0): xfuser T2V with Ulysses, ring,
    hybrid and CFG (``xFuserCogVideoXPipeline``), not image-to-video; diffusers' engine the CFG split alone (the
    guidance batch halved over two ranks, :class:`vdbench.parallel.GuidanceSplit`): diffusers has no
    context-parallel plan (``_cp_plan``) for CogVideoXTransformer3DModel, so no sequence split."""
    if world_size > 1 and task == "i2v":
        return ("CogVideoX image-to-video under torchrun: neither engine splits it (xfuser 0.7 wraps "
                "CogVideoXPipeline only; diffusers 0.42 has no _cp_plan for CogVideoX); run it on one GPU")
    if world_size // (2 if use_cfg_parallel else 1) > 1 and engine != "xfuser":
        return ("CogVideoX Ulysses/ring under --parallel_engine diffusers: diffusers 0.42 has no context-parallel "
                "plan for CogVideoXTransformer3DModel (no _cp_plan); use --parallel_engine xfuser "
                "(xFuserCogVideoXPipeline), or --use_cfg_parallel alone")
    return None


def call_kind(mode: str, attn, encoder_hidden_states) -> str:
    """CogVideoX attends over text and video tokens together (joint), although its processors are handed the text
    as ``encoder_hidden_states``; the stock processor (F.scaled_dot_product_attention, mode 'sdpa') always is.
    A call without text (xfuser's processors can make one) is self-attention."""
    return "joint" if mode == "sdpa" or encoder_hidden_states is not None else "self"


def token_grid(transformer, args, kwargs):
    """Grid of a CogVideoX forward: latents (B, F, C, H, W) over ``patch_size`` (and ``patch_size_t`` for 1.5),
    with the text tokens first (CogVideoX's joint attention concatenates [text, video])."""
    from ..sparse import TokenGrid
    from ..sparse.hooks import call_arg

    p, pt = transformer.config.patch_size, transformer.config.patch_size_t
    _, f, _, h, w = call_arg(args, kwargs, 0, "hidden_states").shape
    text = call_arg(args, kwargs, 1, "encoder_hidden_states")
    return TokenGrid(f // pt if pt else f, h // p, w // p, text_tokens=text.shape[1], text_first=True)


def grid_hooks(transformer, spec, *, once_per_forward: bool = True, active=None):
    """The token grid of each forward for the sparse patterns, per call (:class:`vdbench.sparse.hooks.GridTracker`)
    -- a once-per-forward tile order would have to move the text tokens and CogVideoX's 3-D RoPE inside its
    processors, which is not implemented; the per-call form permutes q, k, v in every call instead (what
    ``once_per_forward`` and ``active`` would change is ignored). Imported here, when a sparse backend is installed,
    so the family table stays free of torch."""
    from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXTransformer3DModel

    from ..sparse.hooks import GridTracker

    if not isinstance(transformer, CogVideoXTransformer3DModel):
        raise TypeError(f"the CogVideoX grid hooks need diffusers' CogVideoXTransformer3DModel, not "
                        f"{type(transformer).__name__}")
    return GridTracker(transformer, spec, token_grid)


FAMILY = Family(
    name="cogvideox",
    tasks=("t2v", "i2v"),
    pipeline_classes={"t2v": "CogVideoXPipeline", "i2v": "CogVideoXImageToVideoPipeline"},
    vae_class="AutoencoderKLCogVideoX",
    transformer_classes=("CogVideoXTransformer3DModel",),
    # the render command line's --model_path default, for either task
    default_models={"t2v": "THUDM/CogVideoX-2b", "i2v": "THUDM/CogVideoX-5b-I2V"},
    default_tiny={"t2v": "cogvideox-t2v", "i2v": "cogvideox-i2v"},
    cli=CliDefaults(real=dict(height=480, width=720, num_frames=49, num_inference_steps=50),
                    tiny=dict(height=128, width=192, num_frames=9, num_inference_steps=4),
                    prompt="A panda playing a guitar in a bamboo forest, cinematic", negative_prompt="",
                    guidance_scale=6.0, fps=8, output_dir="outputs/cogvideox", results_subdir=""),
    output_name=output_name,
    name_settings=("model", "attention_type"),
    parse_label=parse_label,
    # its VAE decodes latents two at a time and only an odd latent count comes back as 4 (L - 1) + 1 frames (an
    # even count gives 4L frames), which is why the real default is 49
    frame_multiple=2,
    frame_rule="CogVideoX needs {step}k+1 frames (temporal factor {temporal}, odd latent frame count)",
    fixed_size=fixed_size,
    prepare_latents=prepare_latents,
    trim_latents=trim_latents,
    pipeline_decode=True,
    guidance_in_one_batch=True,  # latent_model_input = torch.cat([latents] * 2)
    # joint attention: the text tokens are transformed by every block with the video's
    text_kv="cogvideox model's text tokens pass through every block beside the video's, so their K/V change with "
            "each step and can't be cached exactly",
    latent_format="BFCHW",  # the pipeline's (B, T, C, H, W) latents
    parallel_refusal=parallel_refusal,
    xfuser={"CogVideoXPipeline": XfuserWiring(
        pipeline_wrapper="xfuser.model_executor.pipelines:xFuserCogVideoXPipeline")},
    call_kind=call_kind,
    grid_hooks=grid_hooks,
    attention_calls=attention_calls,
    tiny_variants=TINY_VARIANTS,
    random_variants=RANDOM_VARIANTS,
    attention_presets={
        "cogvideox-2b": (1, 30, 17776, 17776, 64),  # 720x480, 49 frames: 13x30x45 + 226 text tokens
        "cogvideox-5b": (1, 48, 17776, 17776, 64),
    },
    attention_grids={"cogvideox-2b": "13x30x45+226", "cogvideox-5b": "13x30x45+226"},
    # 4x in time (the first frame alone), 8x in space, 2x2 patches; the 226 text tokens come first in the joint
    # attention
    size_grid=lambda height, width, num_frames: (f"{(num_frames - 1) // 4 + 1}x{height // 16}x{width // 16}"
                                                 "+226"),
    vae_configs={"cogvideox": (COG_VAE, COG_VAE_REAL)},
    order=1,
)
