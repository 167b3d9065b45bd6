"""The Wan family (Wan 2.1 and 2.2 of Wan-AI, diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline``).

Everything vdbench knows about Wan lives here: the pipeline classes per task (Wan 2.2 TI2V-5B is
text(+image)-to-video: its t2v mode is ``WanPipeline`` with ``expand_timesteps=True``, exactly as diffusers
documents for the real checkpoint), the tiny and random-weight variants, the size and frame rules, the flow shift,
how latents reach the VAE, output file names, what the parallel engines can split, how attention calls are
classified and the benchmark shapes.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Optional

from .. import tiny
from . import CliDefaults, Family, XfuserWiring, model_tag

if TYPE_CHECKING:  # torch is imported where tensors are made: the family tables (labels, listings) stay light
    import torch

# Wan tiny transformer: head_dim 32 (real: 128). Rope splits head_dim into t/h/w parts (h = w = 2*(d//6) = 10,
# t = 12 here) so it must stay reasonably large; 2 heads x 32 = inner dim 64 (real 1536 for 1.3B, 5120 for 14B).
WAN_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,  # = tiny UMT5 d_model (real 4096)
    "freq_dim": 256,
    "ffn_dim": 128,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
}

# Wan 2.1 VAE (also used by Wan 2.2 A14B): real base_dim 96, dim_mult [1, 2, 4, 4] (3 spatial down/up stages ->
# 8x), temporal down-sampling in the last two stages (4x). Only the width (base_dim) and depth are shrunk.
WAN21_VAE = {
    "base_dim": 4,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": False,
    "in_channels": 3,
    "out_channels": 3,
    "patch_size": None,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}

# Wan 2.2 VAE of Wan2.2-TI2V-5B: residual blocks, 48 latent channels, pixel patchify 2 (12 = 3 x 2 x 2 I/O
# channels) on top of the 3 down-sampling stages -> 16x spatial, 4x temporal. Real: base_dim 160,
# decoder_base_dim 256. latents_mean/std are the real checkpoint's statistics (they are plain config data).
WAN22_VAE = {
    "base_dim": 4,
    "decoder_base_dim": 8,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    "latents_mean": [
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
        -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
        -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
        -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
        0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    "latents_std": [
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
        0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
        0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
        0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
        0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
}  # fmt: skip

def _unipc_flow(flow_shift: float) -> dict:
    """The scheduler config the real Wan diffusers checkpoints ship (UniPC in flow-prediction mode)."""
    return {
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "num_train_timesteps": 1000,
        "flow_shift": flow_shift,
    }


# Wan2.1-I2V's image encoder is open-clip ViT-H/14 as a CLIPVisionModel (real: hidden 1280, 32 layers, 16
# heads). Image size 224 / patch 14 are kept so the image context is the real 257 tokens.
_CLIP_VISION = {
    "hidden_size": 32,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 224,
    "patch_size": 14,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "projection_dim": 32,
}
_CLIP_IMAGE_PROCESSOR = {
    "crop_size": {"height": 224, "width": 224},
    "size": {"shortest_edge": 224},
    "do_center_crop": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "rescale_factor": 1 / 255,
}


# The real checkpoints' transformer and VAE configs (their config.json values), for the random-weight models.
_WAN_13B = dict(WAN_TRANSFORMER, num_attention_heads=12, attention_head_dim=128, text_dim=4096, ffn_dim=8960,
                num_layers=30)
_WAN_14B = dict(WAN_TRANSFORMER, num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824,
                num_layers=40)
_WAN_5B = dict(WAN_TRANSFORMER, num_attention_heads=24, attention_head_dim=128, text_dim=4096, ffn_dim=14336,
               num_layers=30, in_channels=48, out_channels=48)
# Wan2.1-I2V-14B-480P: the 14B transformer with 36 input channels (16 noise + 4 mask + 16 image-condition latents),
# CLIP image context (image_dim 1280) and added k/v projections at the inner dim; its image encoder at the real
# open-clip ViT-H/14 width (hidden 1280, MLP 5120, 16 heads, projection 1024) but 2 of its 32 layers (as the text
# encoder keeps 2 of 24: the encoders' cost at full depth is not what the random models are for).
_WAN_I2V_14B = dict(_WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
# Wan2.2-I2V-A14B: each expert the 14B transformer with the 36 input channels, no CLIP image context.
_WAN_I2V_A14B = dict(_WAN_14B, in_channels=36)
_CLIP_VISION_H14_WIDTH = dict(_CLIP_VISION, hidden_size=1280, intermediate_size=5120, num_attention_heads=16,
                              projection_dim=1024)
# The released Wan 2.1 / 2.2 VAEs have 2 residual blocks per stage (diffusers' default); the tiny ones have 1.
WAN21_VAE_REAL = dict(WAN21_VAE, base_dim=96, num_res_blocks=2)
WAN22_VAE_REAL = dict(WAN22_VAE, base_dim=160, decoder_base_dim=256, num_res_blocks=2)


def transformer_init(model) -> None:
    """Make the random Wan transformer's output depend clearly on its attention (deterministic tweak).

    diffusers initialises each block's adaLN table as ``randn / sqrt(dim)``: at the tiny inner dim of 64 every
    gated residual branch (self-attention, FFN) is then scaled by ~0.1 and the prediction is dominated by the
    patch embedding, so even zeroing the attention barely changes the video. Trained checkpoints have O(1)
    modulation, so the table is rescaled to unit variance (``randn``). Measured on wan2.1-t2v (17x128x192, 4
    steps, CFG 5): mean |frame change| when the attention output is zeroed goes from 0.023 to 0.077, and from
    0.0002 to 0.0007 when it is rounded to bfloat16 -- kernel differences become visible in the frames.
    """
    inner_dim = model.config.num_attention_heads * model.config.attention_head_dim
    import torch

    with torch.no_grad():
        for block in model.blocks:
            block.scale_shift_table.mul_(math.sqrt(inner_dim))


def _variant(**kwargs) -> tiny.TinyVariant:
    """A Wan tiny variant: the Wan classes, UMT5 text encoder and UniPC scheduler unless ``kwargs`` say otherwise."""
    common = dict(family="wan", transformer_class="WanTransformer3DModel", vae_class="AutoencoderKLWan",
                  text_encoder=tiny.UMT5_TEXT_ENCODER, scheduler_class="UniPCMultistepScheduler",
                  transformer_init=transformer_init)
    return tiny.TinyVariant(**{**common, **kwargs})


_WAN_I2V_TRANSFORMER = dict(WAN_TRANSFORMER, in_channels=36, image_dim=32, added_kv_proj_dim=64)

TINY_VARIANTS = (
    _variant(
        name="wan2.1-t2v",
        tasks=("t2v",),
        pipeline="WanPipeline",
        mirrors="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        transformer=WAN_TRANSFORMER,
        vae=WAN21_VAE,
        scheduler=_unipc_flow(3.0),
        seed=1,
    ),
    _variant(
        name="wan2.1-i2v",
        tasks=("i2v",),
        pipeline="WanImageToVideoPipeline",
        mirrors="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        # 36 = 16 noise latents + 4 mask channels + 16 image-condition latents; image_dim = CLIP hidden size;
        # added_kv_proj_dim = inner dim, as in the real 14B I2V (1280 / 5120 there).
        transformer=_WAN_I2V_TRANSFORMER,
        vae=WAN21_VAE,
        scheduler=_unipc_flow(3.0),
        image_encoder=_CLIP_VISION,
        image_processor=_CLIP_IMAGE_PROCESSOR,
        seed=2,
    ),
    _variant(
        name="wan2.2-t2v-a14b",
        tasks=("t2v",),
        pipeline="WanPipeline",
        mirrors="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        transformer=WAN_TRANSFORMER,  # high-noise expert
        transformer_2=WAN_TRANSFORMER,  # low-noise expert (own seed -> own weights)
        vae=WAN21_VAE,
        scheduler=_unipc_flow(12.0),
        pipeline_kwargs={"boundary_ratio": 0.875},
        seed=3,
    ),
    _variant(
        name="wan2.2-i2v-a14b",
        tasks=("i2v",),
        pipeline="WanImageToVideoPipeline",
        mirrors="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        # Wan 2.2 I2V conditions through the 36 input channels only: no CLIP image encoder, no added k/v.
        transformer=dict(WAN_TRANSFORMER, in_channels=36),
        transformer_2=dict(WAN_TRANSFORMER, in_channels=36),
        vae=WAN21_VAE,
        scheduler=_unipc_flow(5.0),
        pipeline_kwargs={"boundary_ratio": 0.9},
        seed=4,
    ),
    _variant(
        name="wan2.2-ti2v-5b",
        tasks=("ti2v", "t2v", "i2v"),
        pipeline="WanPipeline",
        mirrors="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        transformer=dict(WAN_TRANSFORMER, in_channels=48, out_channels=48),
        vae=WAN22_VAE,
        scheduler=_unipc_flow(5.0),
        pipeline_kwargs={"expand_timesteps": True},
        seed=5,
    ),
)
# wan2.1-t2v-d64: head dim 64, the smallest the project's Triton kernels take (64 and 128), so a whole tiny pipeline
# runs them (on a CPU under Triton's interpreter); 2 heads x 64 (inner dim 128), so the kernels' per-head scales and
# strides meet the pipeline's own BSHD views. Rope splits 64 into t/h/w = 24/20/20.
TINY_VARIANTS += (tiny.with_head_dim(TINY_VARIANTS[0], 64, seed=8),)
# wan2.2-t2v-a14b-d64: the two experts at head dim 64, so the Triton kernels run on both sides of the switch
TINY_VARIANTS += (tiny.with_head_dim(TINY_VARIANTS[2], 64, seed=10),)

RANDOM_VARIANTS = {
    "wan2.1-t2v-1.3b": ("wan2.1-t2v", dict(transformer=_WAN_13B, vae=WAN21_VAE_REAL, text_encoder=tiny.UMT5_XXL_WIDTH)),
    "wan2.1-t2v-14b": ("wan2.1-t2v", dict(transformer=_WAN_14B, vae=WAN21_VAE_REAL, text_encoder=tiny.UMT5_XXL_WIDTH,
                                          scheduler=_unipc_flow(5.0))),
    "wan2.1-i2v-14b": ("wan2.1-i2v", dict(transformer=_WAN_I2V_14B, vae=WAN21_VAE_REAL, text_encoder=tiny.UMT5_XXL_WIDTH,
                                          image_encoder=_CLIP_VISION_H14_WIDTH)),
    "wan2.2-t2v-a14b": ("wan2.2-t2v-a14b", dict(transformer=_WAN_14B, transformer_2=_WAN_14B, vae=WAN21_VAE_REAL,
                                                text_encoder=tiny.UMT5_XXL_WIDTH)),
    "wan2.2-i2v-a14b": ("wan2.2-i2v-a14b", dict(transformer=_WAN_I2V_A14B, transformer_2=_WAN_I2V_A14B,
                                                vae=WAN21_VAE_REAL, text_encoder=tiny.UMT5_XXL_WIDTH)),
    "wan2.2-ti2v-5b": ("wan2.2-ti2v-5b", dict(transformer=_WAN_5B, vae=WAN22_VAE_REAL,
                                              text_encoder=tiny.UMT5_XXL_WIDTH)),
}


def output_name(task, model, num_frames, steps, attention_type, height, width, layout: str = "") -> str:
    """``wan_result_<task>_<model>_<F>f_<S>s_attn_<type>_<H>x<W>[_<layout>].mp4`` (written under
    ``<dir>/results/``; ``layout`` the parallel layout tag, e.g. ``u2``, absent for one process)."""
    return (f"wan_result_{task}_{model_tag(model)}_{num_frames}f_{steps}s_attn_{attention_type}_"
            f"{height}x{width}{'_' + layout if layout else ''}.mp4")


# Anchoring on the "<frames>f_<steps>s_attn_" run keeps a model tag that itself contains "_attn_" from being taken
# for the start of the type; the looser pattern covers names written without the frames/steps part.
_NAME_RE = re.compile(r"^wan_result_.+?_\d+f_\d+s_attn_(?P<type>.+)_\d+x\d+$")
_LOOSE_NAME_RE = re.compile(r"^wan_result_.*?_attn_(?P<type>.+)_\d+x\d+$")


def parse_label(stem: str):
    """The attention type in a Wan output name (:func:`output_name`), or None for another name."""
    for pattern in (_NAME_RE, _LOOSE_NAME_RE):
        m = pattern.match(stem)
        if m:
            return m.group("type")
    return None


def image_size_multiple(task: str, model: str) -> int:
    """An image-derived output size is rounded to the VAE stride x patch size: 16 x 2 = 32 for Wan 2.2 TI2V-5B
    (the task, or a model named so), 8 x 2 = 16 for the others -- what Wan's image-to-video examples do."""
    return 32 if task == "ti2v" or "ti2v" in model else 16


def default_flow_shift(task: str, height: int, width: int, shipped: Optional[dict] = None) -> float:
    """The flow shift a Wan model is made for. Wan 2.2's pipelines (two experts with their ``boundary_ratio``, or
    TI2V-5B's ``expand_timesteps``) run the shift their scheduler config ships (T2V-A14B 12.0, I2V-A14B 5.0,
    TI2V-5B 5.0; with two experts it also moves the step where the low-noise expert takes over); Wan 2.1 takes its
    model card's rule, 3.0 below 720p and 5.0 at 720p and up. ``shipped`` unknown (None): the rule, and 5.0 for the
    ti2v task (TI2V-5B's)."""
    shipped = shipped or {}
    if (shipped.get("boundary_ratio") is not None or shipped.get("expand_timesteps")) \
            and shipped.get("flow_shift") is not None:
        return float(shipped["flow_shift"])
    if task == "ti2v":
        return 5.0
    return 5.0 if height * width >= 720 * 1280 else 3.0


def prepare_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """``latents * std + mean`` with the VAE's latent statistics (channel-first (B, C, T, H, W) already), as
    WanPipeline does before ``vae.decode``."""
    import torch

    latents = latents.to(vae.dtype)
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    return latents / inv_std + mean


#: The text tokens of a Wan prompt (the pipelines' ``max_sequence_length``: prompts are padded to it).
TEXT_TOKENS = 512
#: The image context of Wan 2.1's image-to-video transformers: CLIP ViT-H/14's tokens at 224 px (16 x 16 + 1).
IMAGE_TOKENS = 257


def attention_calls(denoiser: dict, vae: dict, height: int, width: int, num_frames: int, guidance_scale: float,
                    pipe_kwargs: dict) -> tuple:
    """(batch, heads, seq, heads_kv, seq_kv, head_dim) of a Wan render's attention calls: self-attention over the
    latent tokens ((frames - 1) / t + 1, height / s, width / s, by the VAE's scale factors, patchified), the
    cross-attention to the text, and on an image-to-video transformer (``image_dim`` set) the one to the image
    context. One video per call: the pipelines run classifier-free guidance's two passes as separate calls."""
    t, s = int(vae.get("scale_factor_temporal", 4)), int(vae.get("scale_factor_spatial", 8))
    pt, ph, pw = denoiser.get("patch_size", (1, 2, 2))
    tokens = (((num_frames - 1) // t + 1) // pt) * (height // s // ph) * (width // s // pw)
    heads, d = int(denoiser["num_attention_heads"]), int(denoiser["attention_head_dim"])
    text = int(pipe_kwargs.get("max_sequence_length", TEXT_TOKENS))
    calls = [(1, heads, tokens, heads, tokens, d), (1, heads, tokens, heads, text, d)]
    if denoiser.get("image_dim") is not None:
        calls.append((1, heads, tokens, heads, int(denoiser.get("pos_embed_seq_len") or IMAGE_TOKENS), d))
    return tuple(calls)


def parallel_refusal(engine: str, task: str, world_size: int, use_cfg_parallel: bool):
    """What each engine can split, as shipped (diffusers 0.42.1, xfuser 0.7.0): every task with Ulysses, ring, hybrid
    and the CFG split on both engines. The CFG split is xfuser's own pipeline for I2V
    (``xFuserWanImageToVideoPipeline``) and vdbench's :class:`vdbench.parallel.GuidanceSplit` elsewhere (diffusers'
    pipelines, which xfuser runs for T2V too, evaluate both branches on every rank)."""
    return None


_XFUSER_TRANSFORMER = "xfuser.model_executor.models.transformers.transformer_wan:xFuserWanTransformer3DWrapper"


def call_kind(mode: str, attn, encoder_hidden_states) -> str:
    """Self-attention over the video tokens, or cross-attention to the text context; under xfuser cross-attention
    stays local and self-attention goes through USP. Wan 2.1 I2V's cross-attention modules carry ``add_k_proj``
    (the image context's own keys and values): such a processor call makes two attention calls, image context
    first, hence ``cross+img`` (counted as ``cross_img`` then ``cross``)."""
    if encoder_hidden_states is None:
        return "self"
    return "cross+img" if getattr(attn, "add_k_proj", None) is not None else "cross"


# ----- Ulysses with the exchange beside the projections -----

def _eager_rope(x, freqs_cos, freqs_sin, dst, eager):
    eager(x, freqs_cos, freqs_sin, dst)


def self_attention(attn, hidden_states, rotary_emb, attend, rope=_eager_rope):
    """Wan's self-attention (diffusers 0.42's ``WanAttnProcessor`` for a call without text, mask or image context)
    op for op, with the rotary embedding handed to ``rope(x, cos, sin, dst, eager)`` -- the patch's, which runs
    :func:`vdbench.kernels.rope.rope_pairs` (diffusers' RoPE in one pass, its values bit for bit) where it can and
    ``eager`` (these expressions) where it can't. ``attend(q, k, v)``: the patched dispatcher on BSHD tensors."""
    import torch

    if attn.fused_projections:
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
    key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    if rotary_emb is not None:
        q_rot, k_rot = torch.empty_like(query), torch.empty_like(key)
        rope(query, *rotary_emb, q_rot, rope_into)
        rope(key, *rotary_emb, k_rot, rope_into)
        query, key = q_rot, k_rot
    out = attend(query, key, value).flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


def ulysses_self_attention(attn, hidden_states, rotary_emb, exchange, attend, rope=_eager_rope):
    """Wan's self-attention (diffusers 0.42's ``WanAttnProcessor`` for a call without text or mask) under Ulysses,
    with each of Q, K and V handed to the exchange as soon as it is made, so Q's all-to-all runs while K and V are
    projected, and K's while V is. Q and K leave the rotary embedding already in the exchange's send layout (the
    RoPE writes there instead of into a tensor of its own); V is projected per destination
    (``exchange.send_projected``): the other ranks' heads into the send layout, then this rank's own heads into
    place while those travel.

    ``exchange``: :class:`vdbench.patching.ulysses.UlyssesExchange` (``send_buffer``, ``start``, ``send``,
    ``whole``, ``back_start``, ``back_wait``, ``turn``); ``attend(q, k, v)``: the patched kernel on BSHD tensors
    holding the whole sequence for this rank's heads; ``rope``: as in :func:`self_attention`. The arithmetic is the
    processor's, op for op (the same projections, norms and RoPE expressions, the products rounded where diffusers
    rounds them), so the output equals diffusers' Ulysses template bit for bit.
    """
    heads = attn.heads
    if attn.fused_projections:
        q_lin, k_lin, v_lin = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        q_of, k_of = (lambda: q_lin), (lambda: k_lin)
        v_sent = lambda: exchange.send(v_lin.unflatten(2, (heads, -1)))  # noqa: E731
    else:
        q_of, k_of = (lambda: attn.to_q(hidden_states)), (lambda: attn.to_k(hidden_states))
        # V, which nothing transforms: projected per destination, this rank's heads while the others' travel
        v_sent = lambda: exchange.send_projected(attn.to_v, hidden_states, heads)  # noqa: E731

    def sent(x, norm):
        x = norm(x).unflatten(2, (heads, -1))
        buf, dst = exchange.send_buffer(x)  # dst: the send buffer as (B, S_loc, P, h, D), heads split by rank
        x = x.unflatten(2, dst.shape[2:4])
        if rotary_emb is None:
            dst.copy_(x)
        else:  # the frequencies (1, S_loc, 1, D) broadcast over both head dims
            rope(x, *(f.unsqueeze(2) for f in rotary_emb), dst, rope_into)
        return exchange.start(buf)

    # exchange.turn(): a phase's end, where an interleaved guidance branch takes over (--guidance_overlap); its
    # exchanges then travel beside this branch's next phase
    exchange.turn()
    q = q_of()
    dtype = q.dtype
    q = sent(q, attn.norm_q)
    k = sent(k_of(), attn.norm_k)
    v = v_sent()
    exchange.turn()
    out = attend(exchange.whole(q), exchange.whole(k), exchange.whole(v))
    # the processor casts the kernel's output to the projections' dtype; here before the exchange (the same values)
    back = exchange.back_start(out.to(dtype))
    exchange.turn()
    out = exchange.back_wait(back)  # (B, S_loc, H * D): this rank's tokens, every head
    return attn.to_out[1](attn.to_out[0](out))


def rope_into(x, freqs_cos, freqs_sin, dst) -> None:
    """diffusers' Wan RoPE of ``x`` written into ``dst`` (a view of ``x``'s shape; the pairs in the last dim, the
    frequencies broadcast over the rest): the same expressions, each computed in the frequencies' dtype and cast once
    on the write, as diffusers' slice assignment does."""
    import torch

    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    pairs = dst.unflatten(-1, (-1, 2))
    torch.sub(x1 * cos, x2 * sin, out=pairs[..., 0])
    torch.add(x1 * sin, x2 * cos, out=pairs[..., 1])


# ----- the block, its modulations and gated residuals handed to the patch -----

def _chunk(table, temb, k):
    """Chunk ``k`` of diffusers' ``scale_shift_table + temb.float()`` as the block broadcasts it over (B, S, D):
    (B, S, D) for a per-token ``temb`` (B, S, 6, D: Wan 2.2 TI2V), else (B, 1, D) (``temb`` (B, 6, D)) or (1, D)."""
    p = table[k] + temb[..., k, :].float()
    return p if temb.ndim == 4 else p.unsqueeze(-2)


def modulation(norm, table, temb, shift: int, scale: int, like):
    """diffusers' ``(norm * (1 + scale) + shift).type_as(like)``, ``shift`` and ``scale`` chunks of the table plus
    ``temb`` (:func:`_chunk`): each operator a pass of its own, rounded as eager PyTorch rounds it."""
    return (norm * (1 + _chunk(table, temb, scale)) + _chunk(table, temb, shift)).type_as(like)


def attention_residual(x, y, table, temb, gate: int):
    """diffusers' self-attention residual ``(x.float() + y * gate).type_as(x)``, ``gate`` a chunk of the table plus
    ``temb``."""
    return (x.float() + y * _chunk(table, temb, gate)).type_as(x)


def ffn_residual(x, y, table, temb, gate: int):
    """diffusers' feed-forward residual ``(x.float() + y.float() * gate).type_as(x)`` (the same values as
    :func:`attention_residual` but for a ``y`` wider than fp32)."""
    return (x.float() + y.float() * _chunk(table, temb, gate)).type_as(x)


def layer_norm_of(norm) -> Optional[tuple]:
    """``(eps, weight, bias)`` of a block's norm where it is diffusers' ``FP32LayerNorm`` over the last dimension
    (torch's layer norm of the input's fp32 copy, the weight and bias made fp32: without an affine, None and None);
    None for another module (Wan's norm2 without ``cross_attn_norm`` is an Identity)."""
    from diffusers.models.normalization import FP32LayerNorm

    if type(norm) is not FP32LayerNorm or len(norm.normalized_shape) != 1:
        return None
    return norm.eps, norm.weight, norm.bias


class EagerBlockOps:
    """The passes of :func:`block_forward` as diffusers runs them (the family's expressions, unfused)."""

    @staticmethod
    def modulate(norm, table, temb, shift, scale, like, eager):
        return eager(norm, table, temb, shift, scale, like)

    @staticmethod
    def norm_modulate(x, norm, ln, table, temb, shift, scale, eager):
        return eager(norm(x.float()), table, temb, shift, scale, x)

    @staticmethod
    def norm(x, norm, ln):
        return norm(x.float()).type_as(x)

    @staticmethod
    def residual(x, y, table, temb, gate, eager):
        return eager(x, y, table, temb, gate)


def block_forward(block, hidden_states, encoder_hidden_states, temb, rotary_emb, *, ops=EagerBlockOps):
    """diffusers 0.42's ``WanTransformerBlock.forward`` op for op, with its three norms, two modulations and two gated
    residuals handed to ``ops``, the patch's, which run :mod:`vdbench.kernels.block` (the same values bit for bit)
    where it can and ``eager`` (:func:`modulation`, :func:`attention_residual`, :func:`ffn_residual`) where it can't:
    ``ops.norm_modulate(x, norm, ln, table, temb, shift, scale, eager)`` -- ``(norm(x.float()) * (1 + scale) +
    shift).type_as(x)``, the norm by the patch or ``ops.modulate(norm, table, temb, shift, scale, like, eager)`` after
    diffusers' --, ``ops.norm(x, norm, ln)`` -- ``norm(x.float()).type_as(x)`` -- and ``ops.residual(x, y, table,
    temb, gate, eager)``; ``ln``: the norm's parameters (:func:`layer_norm_of`). ``table``: the block's
    ``scale_shift_table`` (1, 6, D) as (6, D); ``temb``: the blocks' timestep rows, (B, 6, D) or per token (B, S, 6,
    D); the chunks are diffusers' (shift, scale, gate of the self-attention, then of the feed-forward). The
    cross-attention's residual and the attention calls are diffusers' own expressions."""
    table = block.scale_shift_table[0]
    x = ops.norm_modulate(hidden_states, block.norm1, layer_norm_of(block.norm1), table, temb, 0, 1, modulation)
    attn_output = block.attn1(x, None, None, rotary_emb)
    hidden_states = ops.residual(hidden_states, attn_output, table, temb, 2, attention_residual)
    norm_hidden_states = ops.norm(hidden_states, block.norm2, layer_norm_of(block.norm2))
    hidden_states = hidden_states + block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    x = ops.norm_modulate(hidden_states, block.norm3, layer_norm_of(block.norm3), table, temb, 3, 4, modulation)
    return ops.residual(hidden_states, block.ffn(x), table, temb, 5, ffn_residual)


# ----- sparse attention: the token grid and the tile order once per forward -----
#
# Hook points, read from diffusers 0.42's ``WanTransformer3DModel.forward``: ``rotary_emb = self.rope(hidden_states)``
# is computed once before the blocks and passed to every block -> a forward hook on ``rope`` permutes its (cos, sin)
# outputs, shape (1, S, 1, D), along dim 1; ``timestep_proj`` comes out of ``condition_embedder`` with a token
# dimension only for ti2v (batch, S, 6 * dim) -> a forward hook there permutes it, while ``temb`` (used after the
# blocks, in raster order) is left alone; the blocks are called as ``block(hidden_states, encoder_hidden_states,
# timestep_proj, rotary_emb)`` -> a forward pre-hook on ``blocks[0]`` permutes ``hidden_states`` (B, S, C) and a
# forward hook on ``blocks[-1]`` permutes its output back before ``norm_out`` / ``proj_out`` / unpatchify. These are
# the very points diffusers' own context-parallel plan (``_cp_plan``) splits and gathers the sequence at, which is
# why they are the least invasive: nothing of the model's code is replaced.
#
# Padding decision for the once-per-forward form: the layout is the pattern's own (``pad`` option, default
# ``block``), so pad tokens do flow through the blocks. Every op of a Wan block but attention is per token (norms,
# modulation, projections, FFN, cross-attention queries), so pads never change a real token (pad keys are masked in
# self-attention, and pads are dropped at the exit); they cost work in proportion to their count. Measured with
# vdbench.sparse.block_mask on the two grids of the H200 probe (STA window 3x3x3, tile 6x8x8):
#
#   grid                   pad       extra tokens   partial / computed blocks
#   21x30x52 (1.3B 480p)   block     14.1 %         12.7 %
#   21x30x52               none      0              37.1 %
#   21x45x80 (14B 720p)    block     5.0 %          8.5 %
#   21x45x80               none      0              33.1 %
#
# Unpadded tile order (partial edge tiles) makes a third of the computed blocks partial -- blocks that straddle two
# tiles and need the per-token ``mask_mod`` at 3-8x the cost of a full block (H200 probe) -- which costs more than the
# 5-14 % extra tokens through the per-token layers of the padded layout. ``pad=none`` stays available (the spec's
# option) to measure the other side. Radial's layout is raster order with frames padded to whole blocks (6.7 % /
# 3.1 % extra tokens; with ``pad=none`` it is the model's own order and the hook permutes nothing).


def token_grid(transformer, args, kwargs):
    """Grid of a Wan forward: latents (B, C, F, H, W) over ``patch_size`` (t, h, w), as the model patchifies."""
    from ..sparse import TokenGrid
    from ..sparse.hooks import call_arg

    pt, ph, pw = transformer.config.patch_size
    _, _, f, h, w = call_arg(args, kwargs, 0, "hidden_states").shape
    return TokenGrid(f // pt, h // ph, w // pw)


def _check_transformer(transformer) -> None:
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    if not isinstance(transformer, WanTransformer3DModel):
        raise TypeError(f"the Wan grid hooks need diffusers' WanTransformer3DModel, not {type(transformer).__name__}"
                        " (its forward computes rope, the blocks and the output stage where the hooks expect)")


def _permute_rope(output, permute):
    return tuple(permute(t) for t in output)


def _permute_timestep_proj(output, permute):
    temb, timestep_proj, *rest = output
    if timestep_proj.ndim != 3:
        return None  # one modulation per sample (Wan 2.1, 2.2 A14B): nothing per token to permute
    return (temb, permute(timestep_proj), *rest)


def tile_order(transformer, spec, active=None):
    """The once-per-forward tile order on a ``WanTransformer3DModel`` (:class:`vdbench.sparse.hooks.TileOrder` at
    the hook points above: RoPE and per-token timesteps permuted with the hidden states)."""
    from ..sparse.hooks import TileOrder

    _check_transformer(transformer)
    return TileOrder(transformer, spec, token_grid, entry=transformer.blocks[0], exit=transformer.blocks[-1],
                     rewrites=((transformer.rope, _permute_rope),
                               (transformer.condition_embedder, _permute_timestep_proj)),
                     active=active)


def grid_hooks(transformer, spec, *, once_per_forward: bool = True, active=None):
    """The token grid of each forward for the sparse patterns: the tile order once per forward (:func:`tile_order`),
    or the per-call form (:class:`vdbench.sparse.hooks.GridTracker`: under torch.compile, whose compiled blocks
    would trace the block hooks, and for schedules by layer, where one forward mixes backends). Imported here,
    when a sparse backend is installed, so the family table stays free of torch."""
    if once_per_forward:
        return tile_order(transformer, spec, active=active)
    from ..sparse.hooks import GridTracker

    _check_transformer(transformer)
    return GridTracker(transformer, spec, token_grid)


FAMILY = Family(
    name="wan",
    tasks=("t2v", "i2v", "ti2v"),
    pipeline_classes={"t2v": "WanPipeline", "ti2v": "WanPipeline", "i2v": "WanImageToVideoPipeline"},
    vae_class="AutoencoderKLWan",
    transformer_classes=("WanTransformer3DModel",),
    default_models={"t2v": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "i2v": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                    "ti2v": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"},
    default_tiny={"t2v": "wan2.1-t2v", "i2v": "wan2.1-i2v", "ti2v": "wan2.2-ti2v-5b"},
    # Real checkpoints render 480x832, 81 frames, 50 steps; the tiny model defaults to a CPU-sized clip.
    cli=CliDefaults(real=dict(height=480, width=832, num_frames=81, num_inference_steps=50),
                    tiny=dict(height=128, width=192, num_frames=17, num_inference_steps=4),
                    prompt="A cat walks on the grass, realistic, daylight",
                    negative_prompt="blurry, low quality, distorted, static", guidance_scale=5.0, fps=16,
                    output_dir="outputs", results_subdir="results"),
    output_name=output_name,
    parse_label=parse_label,
    image_size_multiple=image_size_multiple,
    # the causal VAE maps 1 + 4k frames to 1 + k latents
    frame_rule="Wan needs {step}k+1 frames (VAE temporal factor {temporal})",
    # TI2V-5B is text(+image)-to-video: with an image, diffusers' WanImageToVideoPipeline runs the same checkpoint
    # (its expand_timesteps config conditions on the first frame's latents; no image encoder, no second expert)
    image_pipeline_classes={"ti2v": "WanImageToVideoPipeline"},
    # diffusers 0.42: WanPipeline passes step_index, sigma and the step count to cache_context; its I2V pipeline none
    step_context_pipelines=("WanPipeline",),
    text_kv="Wan's cross-attention (attn2) projects the text K/V again every step and diffusers has no cache for "
            "them",
    # diffusers 0.42's Wan I2V pipeline calls ftfy.fix_text on every prompt without checking it is installed (its T2V
    # pipeline checks): without ftfy it fails with a NameError after the model has loaded
    pipeline_requirements={"WanImageToVideoPipeline": (("ftfy", "diffusers' WanImageToVideoPipeline cleans every "
                                                                "prompt with ftfy"),)},
    flow_shift=default_flow_shift,
    prepare_latents=prepare_latents,
    # the decoder's causal-conv cache makes decoding a few latent frames per call exact (vdbench.vae.fast's chunked path)
    vae_frame_chunks=True,
    parallel_refusal=parallel_refusal,
    # diffusers' context parallelism with vdbench's Ulysses beats xfuser's Wan wrapper on the same GPUs (4x H200, fav3,
    # 1.3B 480p: CFG-2 1.98x vs 1.82x, Ulysses-2 1.83x vs 1.61x; docs/PERFORMANCE.md section 10.0)
    preferred_engine="diffusers",
    xfuser={"WanPipeline": XfuserWiring(transformer_wrapper=_XFUSER_TRANSFORMER),
            "WanImageToVideoPipeline": XfuserWiring(
                transformer_wrapper=_XFUSER_TRANSFORMER,
                cfg_pipeline="xfuser.model_executor.pipelines.pipeline_wan_i2v:xFuserWanImageToVideoPipeline")},
    call_kind=call_kind,
    grid_hooks=grid_hooks,
    ulysses_self_attention=ulysses_self_attention,
    self_attention=self_attention,
    block_forward=block_forward,
    block_classes=("WanTransformerBlock",),
    attention_calls=attention_calls,
    tiny_variants=TINY_VARIANTS,
    random_variants=RANDOM_VARIANTS,
    attention_presets={
        "wan2.1-1.3b-480p": (1, 12, 32760, 32760, 128),  # 832x480, 81 frames: 21x30x52 latent tokens
        "wan2.1-14b-720p": (1, 40, 75600, 75600, 128),  # 1280x720, 81 frames: 21x45x80
        "wan2.2-a14b-720p": (1, 40, 75600, 75600, 128),
    },
    attention_grids={"wan2.1-1.3b-480p": "21x30x52", "wan2.1-14b-720p": "21x45x80", "wan2.2-a14b-720p": "21x45x80"},
    # the VAE compresses time 4x (the first frame alone) and space 8x; the transformer patchifies 1x2x2
    size_grid=lambda height, width, num_frames: f"{(num_frames - 1) // 4 + 1}x{height // 16}x{width // 16}",
    vae_configs={"wan2.1": (WAN21_VAE, WAN21_VAE_REAL), "wan2.2": (WAN22_VAE, WAN22_VAE_REAL)},
    order=0,
)
