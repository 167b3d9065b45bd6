"""Loading real and tiny Wan 2.1/2.2 and CogVideoX pipelines.

Why tiny models: attention-kernel benchmarks must be developed and tested on machines that cannot download
multi-gigabyte checkpoints (no internet, no GPU). A tiny model is only useful for that if it runs *exactly* the
code a real checkpoint runs, so the tiny variants here are made of the real diffusers/transformers classes
(``WanTransformer3DModel``, ``AutoencoderKLWan``, ``UMT5EncoderModel``, ``CogVideoXTransformer3DModel`` ...), keep
the real architecture (patch sizes, VAE down/up-sampling stages and therefore the real 8x/16x spatial and 4x
temporal compression, rope, attention layout, image conditioning, two-expert Wan 2.2 switching) and only shrink
widths, depths and head counts. They are built once with fixed seeds, written with ``save_pretrained`` into a
cache directory, and then loaded by :func:`load_pipeline` through the very same ``from_pretrained`` call a hub
id or a local checkpoint directory goes through, so that loading, dtype handling and component wiring are
exercised too.

Public API (used by the rest of vdbench and its CLIs):

* :data:`TINY_VARIANTS` -- the embedded tiny variants, by name.
* :func:`resolve_model` -- ``"tiny"`` / ``"tiny:<variant>"`` -> a local directory (built on demand); anything
  else is returned unchanged.
* :func:`tiny_model_dir`, :func:`build_tiny` -- the cache location of a variant and its builder.
* :func:`load_pipeline` -- resolve + ``from_pretrained`` with the right pipeline class, offline-friendly errors.
* :func:`transformers_of`, :func:`check_video_size`, :func:`model_summary` -- helpers over a loaded pipeline.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import pathlib
import re
import shutil
import string
import uuid
import zlib
from typing import Any

import torch

__all__ = [
    "BUILDER_VERSION",
    "DEFAULT_TINY",
    "ModelLoadError",
    "TINY_VARIANTS",
    "TinyVariant",
    "RANDOM_VARIANTS",
    "build_random",
    "build_tiny",
    "check_video_size",
    "load_pipeline",
    "model_summary",
    "resolve_model",
    "tiny_model_dir",
    "transformers_of",
]

#: Bump when the saved files change for a reason the cache hash cannot see (the hash already covers the variant
#: specs, the tokenizer corpus, the builder functions' source and the diffusers/transformers versions).
BUILDER_VERSION = 1

FAMILIES = ("wan", "cogvideox")
TASKS: dict[str, tuple[str, ...]] = {"wan": ("t2v", "i2v", "ti2v"), "cogvideox": ("t2v", "i2v")}

#: ``--model tiny`` for a (family, task) picks this variant.
DEFAULT_TINY: dict[tuple[str, str], str] = {
    ("wan", "t2v"): "wan2.1-t2v",
    ("wan", "i2v"): "wan2.1-i2v",
    ("wan", "ti2v"): "wan2.2-ti2v-5b",
    ("cogvideox", "t2v"): "cogvideox-t2v",
    ("cogvideox", "i2v"): "cogvideox-i2v",
}

# Which diffusers pipeline class serves a (family, task). Wan 2.2 TI2V-5B is text(+image)-to-video: its t2v mode
# is WanPipeline (``expand_timesteps=True``), exactly as diffusers documents for the real checkpoint.
_PIPELINE_CLASS: dict[tuple[str, str], str] = {
    ("wan", "t2v"): "WanPipeline",
    ("wan", "ti2v"): "WanPipeline",
    ("wan", "i2v"): "WanImageToVideoPipeline",
    ("cogvideox", "t2v"): "CogVideoXPipeline",
    ("cogvideox", "i2v"): "CogVideoXImageToVideoPipeline",
}
_VAE_CLASS = {"wan": "AutoencoderKLWan", "cogvideox": "AutoencoderKLCogVideoX"}


class ModelLoadError(RuntimeError):
    """A model (hub id or local path) could not be loaded; the message says why and how to fix it."""


# ----------------------------------------------------------------------------------------------------------------
# Tiny variant specifications
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyVariant:
    """Everything needed to build one tiny pipeline: plain-JSON component configs plus the pipeline wiring.

    The configs are the constructor kwargs of the real classes. They are hashed (see :func:`tiny_model_dir`), so
    editing any number here automatically gives a new cache directory instead of silently reusing old weights.
    """

    name: str
    family: str
    tasks: tuple[str, ...]
    pipeline: str
    mirrors: str  # the real hub checkpoint whose structure this variant copies
    transformer: dict
    vae: dict
    text_encoder: dict
    scheduler_class: str
    scheduler: dict
    transformer_2: dict | None = None
    image_encoder: dict | None = None
    image_processor: dict | None = None
    pipeline_kwargs: dict = dataclasses.field(default_factory=dict)
    tokenizer_max_length: int = 512
    seed: int = 0

    def spec(self) -> dict:
        """The variant as plain JSON data (what is hashed, and what is recorded next to the built model)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


# Wan tiny transformer: head_dim 32 (real: 128). Rope splits head_dim into t/h/w parts (h = w = 2*(d//6) = 10,
# t = 12 here) so it must stay reasonably large; 2 heads x 32 = inner dim 64 (real 1536 for 1.3B, 5120 for 14B).
_WAN_TRANSFORMER = {
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
_WAN21_VAE = {
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
_WAN22_VAE = {
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

# umt5-xxl (real: d_model 4096, 24 layers, 64 heads, gated-gelu, relative position buckets 32 / 128).
_UMT5_TEXT_ENCODER = {
    "class": "UMT5EncoderModel",
    "d_model": 32,
    "d_kv": 16,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 2,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.1,
}
# t5-v1_1-xxl for CogVideoX: same layout with T5EncoderModel.
_T5_TEXT_ENCODER = dict(_UMT5_TEXT_ENCODER, **{"class": "T5EncoderModel"})


def _unipc_flow(flow_shift: float) -> dict:
    """The scheduler config the real Wan diffusers checkpoints ship (UniPC in flow-prediction mode)."""
    return {
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "num_train_timesteps": 1000,
        "flow_shift": flow_shift,
    }


def _cogvideox_ddim(snr_shift_scale: float) -> dict:
    """CogVideoX's DDIM (v-prediction, zero-terminal-SNR, SNR shift) as in the real scheduler_config.json."""
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

# CogVideoX transformer: head_dim 32 (real 64; 32 still leaves the 3D rope its t/h/w split: 8/12/12), 2 heads,
# 2 layers (real 30 heads x 30 layers for 2b, 48 x 42 for 5b).
_COG_TRANSFORMER = {
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
_COG_VAE = {
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


def _build_variants() -> dict[str, TinyVariant]:
    wan_i2v_transformer = dict(_WAN_TRANSFORMER, in_channels=36, image_dim=32, added_kv_proj_dim=64)
    variants = [
        TinyVariant(
            name="wan2.1-t2v",
            family="wan",
            tasks=("t2v",),
            pipeline="WanPipeline",
            mirrors="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
            transformer=_WAN_TRANSFORMER,
            vae=_WAN21_VAE,
            text_encoder=_UMT5_TEXT_ENCODER,
            scheduler_class="UniPCMultistepScheduler",
            scheduler=_unipc_flow(3.0),
            seed=1,
        ),
        TinyVariant(
            name="wan2.1-i2v",
            family="wan",
            tasks=("i2v",),
            pipeline="WanImageToVideoPipeline",
            mirrors="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
            # 36 = 16 noise latents + 4 mask channels + 16 image-condition latents; image_dim = CLIP hidden size;
            # added_kv_proj_dim = inner dim, as in the real 14B I2V (1280 / 5120 there).
            transformer=wan_i2v_transformer,
            vae=_WAN21_VAE,
            text_encoder=_UMT5_TEXT_ENCODER,
            scheduler_class="UniPCMultistepScheduler",
            scheduler=_unipc_flow(3.0),
            image_encoder=_CLIP_VISION,
            image_processor=_CLIP_IMAGE_PROCESSOR,
            seed=2,
        ),
        TinyVariant(
            name="wan2.2-t2v-a14b",
            family="wan",
            tasks=("t2v",),
            pipeline="WanPipeline",
            mirrors="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            transformer=_WAN_TRANSFORMER,  # high-noise expert
            transformer_2=_WAN_TRANSFORMER,  # low-noise expert (own seed -> own weights)
            vae=_WAN21_VAE,
            text_encoder=_UMT5_TEXT_ENCODER,
            scheduler_class="UniPCMultistepScheduler",
            scheduler=_unipc_flow(3.0),
            pipeline_kwargs={"boundary_ratio": 0.875},
            seed=3,
        ),
        TinyVariant(
            name="wan2.2-i2v-a14b",
            family="wan",
            tasks=("i2v",),
            pipeline="WanImageToVideoPipeline",
            mirrors="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
            # Wan 2.2 I2V conditions through the 36 input channels only: no CLIP image encoder, no added k/v.
            transformer=dict(_WAN_TRANSFORMER, in_channels=36),
            transformer_2=dict(_WAN_TRANSFORMER, in_channels=36),
            vae=_WAN21_VAE,
            text_encoder=_UMT5_TEXT_ENCODER,
            scheduler_class="UniPCMultistepScheduler",
            scheduler=_unipc_flow(3.0),
            pipeline_kwargs={"boundary_ratio": 0.9},
            seed=4,
        ),
        TinyVariant(
            name="wan2.2-ti2v-5b",
            family="wan",
            tasks=("ti2v", "t2v", "i2v"),
            pipeline="WanPipeline",
            mirrors="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
            transformer=dict(_WAN_TRANSFORMER, in_channels=48, out_channels=48),
            vae=_WAN22_VAE,
            text_encoder=_UMT5_TEXT_ENCODER,
            scheduler_class="UniPCMultistepScheduler",
            scheduler=_unipc_flow(5.0),
            pipeline_kwargs={"expand_timesteps": True},
            seed=5,
        ),
        TinyVariant(
            name="cogvideox-t2v",
            family="cogvideox",
            tasks=("t2v",),
            pipeline="CogVideoXPipeline",
            mirrors="THUDM/CogVideoX-2b",
            transformer=_COG_TRANSFORMER,
            vae=_COG_VAE,
            text_encoder=_T5_TEXT_ENCODER,
            scheduler_class="CogVideoXDDIMScheduler",
            scheduler=_cogvideox_ddim(3.0),
            tokenizer_max_length=226,
            seed=6,
        ),
        TinyVariant(
            name="cogvideox-i2v",
            family="cogvideox",
            tasks=("i2v",),
            pipeline="CogVideoXImageToVideoPipeline",
            mirrors="THUDM/CogVideoX-5b-I2V",
            # 5b-I2V: 32 input channels (noise + image latents), 3D rope AND learned positional embeddings. The
            # learned embeddings pin the resolution to sample_height/width x 8 (diffusers refuses others), so the
            # tiny sample size is 16 x 24 latents = 128 x 192 pixels (real 60 x 90 = 480 x 720) and 17 frames
            # (real 49).
            transformer=dict(
                _COG_TRANSFORMER,
                in_channels=32,
                sample_height=16,
                sample_width=24,
                sample_frames=17,
                use_rotary_positional_embeddings=True,
                use_learned_positional_embeddings=True,
            ),
            vae=dict(_COG_VAE, scaling_factor=0.7),
            text_encoder=_T5_TEXT_ENCODER,
            scheduler_class="CogVideoXDDIMScheduler",
            scheduler=_cogvideox_ddim(1.0),
            tokenizer_max_length=226,
            seed=7,
        ),
    ]
    return {v.name: v for v in variants}


#: The embedded tiny variants, by name (``--model tiny:<name>``).
TINY_VARIANTS: dict[str, TinyVariant] = _build_variants()


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------

# A small English corpus of video-generation prompts (plus Wan's standard negative prompt). The tiny tokenizer's
# vocabulary is derived from it deterministically, so typical prompts map to real word pieces rather than to a
# stream of single characters.
_CORPUS = """
A cat and a dog baking a cake together in a kitchen. The cat is carefully measuring flour, while the dog is
stirring the batter with a wooden spoon. The kitchen is cozy, with sunlight streaming through the window.
Two anthropomorphic cats in comfy boxing gear and bright gloves fight intensely on a spotlighted stage.
An astronaut riding a horse across the surface of the moon, cinematic lighting, highly detailed, 4k.
A panda playing an acoustic guitar in a bamboo forest at sunrise, soft light, gentle breeze.
A drone shot of waves crashing against rugged cliffs along a beach at sunset, golden hour, slow motion.
Close-up of a hummingbird hovering near a red flower, its wings a blur, shallow depth of field.
A busy city street at night in the rain, neon signs reflecting in puddles, people with umbrellas walking by.
A small boat sailing on a calm lake surrounded by mountains covered in snow, clouds drifting across the sky.
A chef slicing fresh vegetables on a wooden board, steam rising from a pot, warm kitchen light.
A golden retriever running through a field of tall grass and flowers on a sunny afternoon.
Time-lapse of a flower blooming, petals slowly opening, black background, studio lighting.
A futuristic train gliding through a glass tunnel under the ocean, fish swimming around it.
An old man reading a book by the fireplace, the fire crackling, a sleeping cat on his lap.
A red sports car driving fast along a winding coastal road, camera tracking from the side.
Children flying colorful kites on a windy hill, laughing and running, bright blue sky.
A butterfly landing on a leaf covered in morning dew, macro shot, sharp focus.
A woman dancing in a long white dress on a beach, the wind moving her hair, waves in the background.
A waterfall in a tropical jungle, mist rising, birds flying over the green trees.
A robot painting a portrait in an art studio, brushes and paint everywhere, soft window light.
Fireworks exploding over a river at night, colorful reflections on the water, crowd cheering.
A steaming cup of coffee on a table next to a window, rain drops running down the glass.
A tiger walking slowly through the snow, its breath visible in the cold air, camera follows.
An aerial view of a forest in autumn, red, orange and yellow leaves, a road winding through it.
A man in a suit walking through an empty office, slowly turning to look at the camera.
The girl smiles and waves at the camera, then turns and walks away down the street.
Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, overall
gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly drawn hands,
poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy background, three
legs, many people in the background, walking backwards.
"""

_PAD, _EOS, _UNK, _SPACE = "<pad>", "</s>", "<unk>", "\u2581"


def _tokenizer_vocab() -> list[tuple[str, float]]:
    """A T5-layout Unigram vocabulary (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2) derived from :data:`_CORPUS`.

    Pieces are every printable ASCII character (so any ASCII prompt tokenizes without ``<unk>``) plus each corpus
    word in lower and capitalised form, both word-initial (``\u2581word``) and word-internal; their scores are
    log frequencies, so Unigram's Viterbi prefers whole words over characters. Counting is exact and ordering is
    sorted, which makes the vocabulary bit-identical on every build (the ``tokenizers`` Unigram *trainer* is not:
    its scores differ in the last digits between runs).
    """
    counts: collections.Counter[str] = collections.Counter()
    for word in re.findall(r"[A-Za-z]+", _CORPUS):
        for form in {word.lower(), word.lower().capitalize()}:
            counts[_SPACE + form] += 1
            counts[form] += 1
    total = sum(counts.values())
    vocab: list[tuple[str, float]] = [(_PAD, 0.0), (_EOS, 0.0), (_UNK, 0.0), (_SPACE, -2.0)]
    # Characters get a score far below any word so they are only a fallback.
    char_score = math.log(1.0 / total) - 6.0
    chars = string.ascii_letters + string.digits + string.punctuation
    vocab += [(c, char_score) for c in chars]
    vocab += [(_SPACE + c, char_score) for c in string.digits + string.punctuation]
    seen = {piece for piece, _ in vocab}
    for piece, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if piece not in seen:  # single letters are already there as characters (but "\u2581a" is added here)
            vocab.append((piece, round(math.log(n / total), 6)))
            seen.add(piece)
    return vocab


def _build_tokenizer(model_max_length: int):
    """T5/UMT5-style tokenizer (Unigram, ``</s>`` eos appended, ``<pad>`` = 0) in the class the pipelines use.

    transformers 5 merged the slow and fast T5 tokenizers: ``T5Tokenizer`` is now backed by the ``tokenizers``
    library and accepts the Unigram vocabulary directly (``T5TokenizerFast`` is an alias of it). No sentencepiece
    model file is needed, and ``save_pretrained`` writes ``tokenizer.json`` + ``tokenizer_config.json`` that
    ``AutoTokenizer`` and the pipelines' ``from_pretrained`` load back.
    """
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=_tokenizer_vocab(), extra_ids=0, model_max_length=model_max_length)


# ----------------------------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------------------------


def _component_seed(variant: TinyVariant, component: str) -> int:
    """A fixed per-component seed, so adding/removing one component never changes another's weights."""
    return (variant.seed * 1_000_003 + zlib.crc32(component.encode())) % (2**31)


@contextlib.contextmanager
def _seeded(seed: int):
    """Run the body with a fixed torch CPU seed without disturbing the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _make_text_encoder(variant: TinyVariant, vocab_size: int):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    cfg = dict(variant.text_encoder)
    cls_name = cfg.pop("class")
    config_cls, model_cls = (
        (UMT5Config, UMT5EncoderModel) if cls_name == "UMT5EncoderModel" else (T5Config, T5EncoderModel)
    )
    config = config_cls(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **cfg)
    with _seeded(_component_seed(variant, "text_encoder")):
        model = model_cls(config)
    return model.eval()


def _make_transformer(variant: TinyVariant, name: str):
    import diffusers

    cfg = getattr(variant, name)
    cls = diffusers.WanTransformer3DModel if variant.family == "wan" else diffusers.CogVideoXTransformer3DModel
    with _seeded(_component_seed(variant, name)):
        model = cls(**cfg)
    # The init tweaks are deterministic functions of the seeded weights (no further random draws).
    if variant.family == "wan":
        _wan_transformer_init(model)
    else:
        _cogvideox_transformer_init(model)
    return model.eval()


def _wan_transformer_init(model) -> None:
    """Make the random Wan transformer's output depend clearly on its attention (deterministic tweak).

    diffusers initialises each block's adaLN table as ``randn / sqrt(dim)``: at the tiny inner dim of 64 every
    gated residual branch (self-attention, FFN) is then scaled by ~0.1 and the prediction is dominated by the
    patch embedding, so even zeroing the attention barely changes the video. Trained checkpoints have O(1)
    modulation, so the table is rescaled to unit variance (``randn``). Measured on wan2.1-t2v (17x128x192, 4
    steps, CFG 5): mean |frame change| when the attention output is zeroed goes from 0.023 to 0.077, and from
    0.0002 to 0.0007 when it is rounded to bfloat16 -- kernel differences become visible in the frames.
    """
    inner_dim = model.config.num_attention_heads * model.config.attention_head_dim
    with torch.no_grad():
        for block in model.blocks:
            block.scale_shift_table.mul_(math.sqrt(inner_dim))


def _cogvideox_transformer_init(model) -> None:
    """Same purpose as :func:`_wan_transformer_init`, for CogVideoX's adaLN-zero blocks.

    Each block gates its attention and FFN branches with ``Linear(silu(temb))`` (``norm1``/``norm2.linear``); at
    the tiny time_embed_dim of 32 the default init leaves those gates small, so attention hardly reaches the
    output. Scaling the two modulation linears by 8 gives O(1) modulation. Measured on cogvideox-t2v (17x128x192,
    4 steps, CFG 5): mean |frame change| with the attention output zeroed 0.004 -> 0.046 (a different seed
    changes frames by ~0.09), with it rounded to bfloat16 < 0.0001 -> 0.0003.
    """
    with torch.no_grad():
        for block in model.transformer_blocks:
            for norm in (block.norm1, block.norm2):
                norm.linear.weight.mul_(8.0)
                norm.linear.bias.mul_(8.0)


def _make_vae(variant: TinyVariant):
    import diffusers

    cls = getattr(diffusers, _VAE_CLASS[variant.family])
    with _seeded(_component_seed(variant, "vae")):
        model = cls(**variant.vae)
    return model.eval()


def _make_image_encoder(variant: TinyVariant):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    with _seeded(_component_seed(variant, "image_encoder")):
        model = CLIPVisionModel(CLIPVisionConfig(**variant.image_encoder))
    return model.eval()


def _make_image_processor(variant: TinyVariant):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(**variant.image_processor)


def _make_scheduler(variant: TinyVariant):
    import diffusers

    return getattr(diffusers, variant.scheduler_class)(**variant.scheduler)


def _saved_float64_to_float32(module: torch.nn.Module) -> None:
    """Store every checkpoint tensor as float32.

    diffusers creates CogVideoX's learned positional embedding (a persistent buffer) in float64; saved as is, the
    checkpoint would hold a float64 tensor the real one does not have. Only parameters and *persistent* buffers
    are touched: non-persistent float64 buffers (Wan's rope tables) are computed in float64 on purpose, and
    ``ModelMixin.to(dtype)`` would convert those too (and warn about ``_keep_in_fp32_modules``).
    """
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.dtype == torch.float64:
                param.data = param.data.float()
        for name, buf in sub._buffers.items():
            if buf is not None and buf.dtype == torch.float64 and name not in sub._non_persistent_buffers_set:
                sub._buffers[name] = buf.float()


def _build_pipeline(variant: TinyVariant, module_device=None):
    """Instantiate the pipeline in memory (eval mode). Models are created on ``module_device`` when given
    (random-weight real shapes are initialised directly on the GPU, or on "meta" to check shapes for free);
    tokenizer and scheduler always live on the CPU, as from_pretrained creates them."""
    import diffusers

    on = (lambda: torch.device(module_device)) if module_device is not None else contextlib.nullcontext
    tokenizer = _build_tokenizer(variant.tokenizer_max_length)
    with on():
        components: dict[str, Any] = {
            "tokenizer": tokenizer,
            "text_encoder": _make_text_encoder(variant, vocab_size=len(tokenizer)),
            "vae": _make_vae(variant),
            "transformer": _make_transformer(variant, "transformer"),
        }
        if variant.family == "wan":
            components["transformer_2"] = (
                _make_transformer(variant, "transformer_2") if variant.transformer_2 is not None else None
            )
        if variant.pipeline == "WanImageToVideoPipeline":
            components["image_encoder"] = _make_image_encoder(variant) if variant.image_encoder else None
    components["scheduler"] = _make_scheduler(variant)
    if variant.pipeline == "WanImageToVideoPipeline":
        components["image_processor"] = _make_image_processor(variant) if variant.image_processor else None
    for component in components.values():
        if isinstance(component, torch.nn.Module):
            _saved_float64_to_float32(component)
    cls = getattr(diffusers, variant.pipeline)
    return cls(**components, **variant.pipeline_kwargs)


def _get_variant(variant: str) -> TinyVariant:
    try:
        return TINY_VARIANTS[variant]
    except KeyError:
        raise ValueError(
            f"Unknown tiny model variant {variant!r}. Valid variants: {', '.join(TINY_VARIANTS)} "
            f"(use --model tiny:<variant>, or plain --model tiny for the task's default)."
        ) from None


@functools.lru_cache(maxsize=None)
def _builder_source_digest() -> str:
    """Digest of the source of every function that shapes the saved files (init tweaks, tokenizer, casting...).

    A cached tiny model is therefore rebuilt automatically when the builder code changes, even if nobody
    remembers to bump :data:`BUILDER_VERSION`. (Builds take well under a second, so a spurious rebuild after a
    cosmetic edit costs nothing.)
    """
    functions = (
        _tokenizer_vocab,
        _build_tokenizer,
        _component_seed,
        _make_text_encoder,
        _make_transformer,
        _wan_transformer_init,
        _cogvideox_transformer_init,
        _make_vae,
        _make_image_encoder,
        _make_image_processor,
        _make_scheduler,
        _saved_float64_to_float32,
        _build_pipeline,
        _canonicalize_model_index,
    )
    digest = hashlib.sha256()
    for fn in functions:
        try:
            digest.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):  # no source available (frozen/compiled install): fall back to bytecode
            digest.update(fn.__code__.co_code)
    return digest.hexdigest()


def _spec_hash(variant: TinyVariant) -> str:
    """Short hash of everything that determines the built files: spec, builder code, corpus, library versions.

    The diffusers/transformers versions are included because their module constructors define the random init
    and the on-disk format; a different version must not silently reuse (or be compared against) old weights.
    """
    import diffusers
    import transformers

    payload = {
        "builder_version": BUILDER_VERSION,
        "builder_source": _builder_source_digest(),
        "spec": variant.spec(),
        "tokenizer_vocab": _tokenizer_vocab(),
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def _cache_root() -> pathlib.Path:
    root = os.environ.get("VDBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vdbench")
    return pathlib.Path(root).expanduser()


def tiny_model_dir(variant: str) -> pathlib.Path:
    """Cache directory of a tiny variant: ``$VDBENCH_CACHE`` (or ``~/.cache/vdbench``)/tiny/<variant>-<hash>."""
    v = _get_variant(variant)
    return _cache_root() / "tiny" / f"{v.name}-{_spec_hash(v)}"


_COMPLETE_MARKER = "vdbench_tiny.json"


def build_tiny(variant: str, path: str | os.PathLike) -> pathlib.Path:
    """Build tiny ``variant`` and ``save_pretrained`` it to ``path`` (which must not exist or be empty).

    The pipeline is written to a temporary sibling directory first and renamed into place at the end, so
    ``path`` either does not exist or holds a complete model -- a reader never sees a half-written one. Same
    variant -> bit-identical weights on every build (each component is seeded on its own).
    """
    v = _get_variant(variant)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        pipe = _build_pipeline(v)
        pipe.save_pretrained(tmp, safe_serialization=True)
        _canonicalize_model_index(tmp / "model_index.json")
        info = {"variant": v.name, "mirrors": v.mirrors, "spec_hash": _spec_hash(v), "spec": v.spec()}
        (tmp / _COMPLETE_MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
        if path.exists() and not any(path.iterdir()):
            path.rmdir()
        os.replace(tmp, path)  # atomic on POSIX; fails if `path` appeared meanwhile and is not empty
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# transformers 5 resolves ``CLIPImageProcessor`` to ``CLIPImageProcessorPil`` when torchvision is missing (and to
# the torchvision-backed class when it is present), and diffusers records the resolved class name. The real
# checkpoints list ``CLIPImageProcessor``; writing that name keeps the tiny model_index identical in layout and
# lets each machine pick its own backend at load time, exactly as it does for the real model.
_CANONICAL_CLASS_NAMES = {"CLIPImageProcessorPil": "CLIPImageProcessor", "CLIPImageProcessorFast": "CLIPImageProcessor"}


def _canonicalize_model_index(path: pathlib.Path) -> None:
    index = json.loads(path.read_text())
    for key, value in index.items():
        if isinstance(value, list) and len(value) == 2 and value[1] in _CANONICAL_CLASS_NAMES:
            index[key] = [value[0], _CANONICAL_CLASS_NAMES[value[1]]]
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _is_complete(path: pathlib.Path) -> bool:
    return (path / _COMPLETE_MARKER).is_file() and (path / "model_index.json").is_file()


def _ensure_tiny(variant: str) -> pathlib.Path:
    """Return the cached directory of ``variant``, building it first if needed (one builder at a time)."""
    from filelock import FileLock

    path = tiny_model_dir(variant)
    if _is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{path.name}.lock")):
        if _is_complete(path):  # another process finished it while we waited for the lock
            return path
        if path.exists():  # leftover from an interrupted, pre-atomic or manual copy: rebuild cleanly
            shutil.rmtree(path)
        build_tiny(variant, path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Resolving and loading
# ----------------------------------------------------------------------------------------------------------------


def _check_family_task(family: str, task: str | None) -> str:
    if family not in FAMILIES:
        raise ValueError(f"Unknown model family {family!r}; expected one of {', '.join(FAMILIES)}.")
    task = task or "t2v"
    if task not in TASKS[family]:
        raise ValueError(f"Unknown task {task!r} for family {family!r}; expected one of {', '.join(TASKS[family])}.")
    return task


def _tiny_variant_name(model: str, task: str | None, family: str) -> str | None:
    """The tiny variant ``model`` names (``tiny`` / ``tiny:<variant>``), or None if it is not a tiny name."""
    if model == "tiny":
        task = _check_family_task(family, task)
        return DEFAULT_TINY[(family, task)]
    if model.startswith("tiny:"):
        return _get_variant(model[len("tiny:") :]).name
    return None


def resolve_model(model: str, task: str | None = None, family: str = "wan") -> str:
    """Map ``--model`` to something ``from_pretrained`` accepts.

    ``"tiny"`` is the default tiny variant for ``(family, task)`` (wan: t2v -> wan2.1-t2v, i2v -> wan2.1-i2v,
    ti2v -> wan2.2-ti2v-5b; cogvideox: t2v -> cogvideox-t2v, i2v -> cogvideox-i2v), ``"tiny:<variant>"`` an
    explicit one; both are built into the cache if missing and the local directory is returned. Anything else
    (a hub id or a local path) is returned unchanged.
    """
    name = _tiny_variant_name(model, task, family)
    if name is None:
        return model
    return str(_ensure_tiny(name))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hf_offline() -> bool:
    """HF offline mode, read at call time (huggingface_hub reads HF_HUB_OFFLINE only once, at import)."""
    return _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE")


def _hf_cache_dir() -> str:
    """The hub cache directory, resolved from the environment now, with huggingface_hub's precedence.

    huggingface_hub fixes its cache path when it is imported; resolving it per call honours an HF_HOME /
    HF_HUB_CACHE set later in the process (tests, notebooks, CLIs that set it from a flag).
    """
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(os.environ["HUGGINGFACE_HUB_CACHE"])
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(hf_home), "hub")


def _looks_like_path(model: str) -> bool:
    """A string meant as a filesystem path (hub ids are ``org/name``: no leading ``/``, ``.``, ``~``)."""
    return model.startswith(("/", "./", "../", "~", ".\\", "..\\")) or os.path.isabs(model)


def _offline_help(model: str, reason: str) -> str:
    return (
        f"Model {model!r} could not be loaded offline: {reason}\n"
        f"To fix it, download it on a machine with internet access, e.g.\n"
        f"    huggingface-cli download {model} --local-dir DIR\n"
        f"(or `hf download {model} --local-dir DIR`), copy DIR to this machine and pass `--model DIR` "
        f"(or `--model_path DIR`); or run with `--model tiny` to use the embedded tiny model of the same "
        f"architecture (random weights, for testing the pipeline and kernels, not for image quality)."
    )


def _pipeline_class(family: str, task: str):
    import diffusers

    return getattr(diffusers, _PIPELINE_CLASS[(family, task)])


# ----------------------------------------------------------------------------------------------------------------
# Real-shape random-weight models (GPU performance work)
# ----------------------------------------------------------------------------------------------------------------

# The transformer and VAE configs of the real checkpoints (their config.json values); the text encoder keeps the
# real width (so the transformer's text projection has the real shape) but only 2 layers: text encoding is not
# what these models are for, and a random 24-layer UMT5-XXL would cost ~11 GB and a minute of init for nothing.
_WAN_13B = dict(_WAN_TRANSFORMER, num_attention_heads=12, attention_head_dim=128, text_dim=4096, ffn_dim=8960,
                num_layers=30)
_WAN_14B = dict(_WAN_TRANSFORMER, num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824,
                num_layers=40)
_WAN_5B = dict(_WAN_TRANSFORMER, num_attention_heads=24, attention_head_dim=128, text_dim=4096, ffn_dim=14336,
               num_layers=30, in_channels=48, out_channels=48)
# The released Wan 2.1 / 2.2 VAEs have 2 residual blocks per stage (diffusers' default); the tiny ones have 1.
_WAN21_VAE_REAL = dict(_WAN21_VAE, base_dim=96, num_res_blocks=2)
_WAN22_VAE_REAL = dict(_WAN22_VAE, base_dim=160, decoder_base_dim=256, num_res_blocks=2)
_UMT5_XXL_WIDTH = dict(_UMT5_TEXT_ENCODER, d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=2)
_T5_XXL_WIDTH = dict(_UMT5_XXL_WIDTH, **{"class": "T5EncoderModel"})
_COG_2B = dict(_COG_TRANSFORMER, num_attention_heads=30, attention_head_dim=64, time_embed_dim=512,
               text_embed_dim=4096, num_layers=30)
_COG_5B = dict(_COG_2B, num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True)
_COG_VAE_REAL = dict(_COG_VAE, block_out_channels=[128, 256, 256, 512], layers_per_block=3, norm_num_groups=32)

#: ``--model random:<name>``: (tiny variant whose wiring it reuses, overrides with the real shapes).
RANDOM_VARIANTS: dict[str, tuple[str, dict]] = {
    "wan2.1-t2v-1.3b": ("wan2.1-t2v", dict(transformer=_WAN_13B, vae=_WAN21_VAE_REAL, text_encoder=_UMT5_XXL_WIDTH)),
    "wan2.1-t2v-14b": ("wan2.1-t2v", dict(transformer=_WAN_14B, vae=_WAN21_VAE_REAL, text_encoder=_UMT5_XXL_WIDTH,
                                          scheduler=_unipc_flow(5.0))),
    "wan2.2-t2v-a14b": ("wan2.2-t2v-a14b", dict(transformer=_WAN_14B, transformer_2=_WAN_14B, vae=_WAN21_VAE_REAL,
                                                text_encoder=_UMT5_XXL_WIDTH, scheduler=_unipc_flow(12.0))),
    "wan2.2-ti2v-5b": ("wan2.2-ti2v-5b", dict(transformer=_WAN_5B, vae=_WAN22_VAE_REAL, text_encoder=_UMT5_XXL_WIDTH)),
    "cogvideox-2b": ("cogvideox-t2v", dict(transformer=_COG_2B, vae=_COG_VAE_REAL, text_encoder=_T5_XXL_WIDTH)),
    "cogvideox-5b": ("cogvideox-t2v", dict(transformer=_COG_5B, vae=_COG_VAE_REAL, text_encoder=_T5_XXL_WIDTH)),
}


def build_random(name: str, *, dtype: torch.dtype = torch.bfloat16, device="cuda"):
    """A pipeline of the real architecture and shapes with random weights, built directly on ``device``.

    For performance work where checkpoints can't be downloaded: speed depends on shapes, not on weight values.
    Not saved or loaded (the loading path is what the tiny models test); the same adaLN rescale as the tiny
    models keeps attention visible in the output, so quality figures between backends mean something.
    """
    try:
        base, overrides = RANDOM_VARIANTS[name]
    except KeyError:
        raise ValueError(f"Unknown random-weight model {name!r}. Valid: {', '.join(RANDOM_VARIANTS)} "
                         "(use --model random:<name>).") from None
    variant = dataclasses.replace(TINY_VARIANTS[base], name=f"random-{name}", **overrides)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype if dtype.is_floating_point else torch.float32)
        pipe = _build_pipeline(variant, module_device=device)
    finally:
        torch.set_default_dtype(previous)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            _cast_like_from_pretrained(component, dtype)
    return pipe.to(device)


def _cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``dtype`` everywhere except what ``from_pretrained(dtype=...)`` keeps in float32 (``_keep_in_fp32_modules``:
    Wan's time embedder, norms and modulation tables), so random-weight timings match a real checkpoint's."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, param in model.named_parameters():
        want = torch.float32 if keep & set(name.split(".")) else dtype
        if param.is_floating_point() and param.dtype != want:
            param.data = param.data.to(want)
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.dtype not in (torch.float64, torch.float32) and dtype == torch.float32:
            buf.data = buf.data.to(torch.float32)


def load_pipeline(
    model: str,
    task: str = "t2v",
    family: str = "wan",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype | None = None,
):
    """Load a Wan or CogVideoX pipeline for ``task`` from a tiny name, a local directory or a hub id.

    Everything goes through ``<PipelineClass>.from_pretrained(path, dtype=dtype)`` (diffusers 0.42's name for
    ``torch_dtype``) -- tiny models included, so they exercise the real loading code. The class is picked from (family, task): Wan t2v/ti2v ->
    WanPipeline, i2v -> WanImageToVideoPipeline; CogVideoX t2v -> CogVideoXPipeline, i2v ->
    CogVideoXImageToVideoPipeline. With ``vae_dtype`` the VAE is loaded on its own in that dtype (as Wan's
    examples load a float32 VAE next to a bfloat16 transformer). Hub ids are looked up in the local Hugging Face
    cache first, without network; only if that fails and HF offline mode is off is the hub contacted. Any
    failure to find the files raises :class:`ModelLoadError` with instructions.
    """
    import diffusers

    task = _check_family_task(family, task)
    if model.startswith("random:"):
        base = RANDOM_VARIANTS.get(model[len("random:"):], ("",))[0]
        if base and TINY_VARIANTS[base].family != family:
            raise ValueError(f"{model!r} is a {TINY_VARIANTS[base].family} model, but family {family!r} was requested.")
        pipe = build_random(model[len("random:"):], dtype=dtype, device=device)
        if vae_dtype is not None and vae_dtype != dtype:
            pipe.vae.to(vae_dtype)
        return pipe
    tiny = _tiny_variant_name(model, task, family)
    if tiny is not None:
        v = TINY_VARIANTS[tiny]
        if v.family != family:
            raise ValueError(f"Tiny variant {tiny!r} is a {v.family} model, but family {family!r} was requested.")
        if task not in v.tasks:
            raise ValueError(
                f"Tiny variant {tiny!r} supports task(s) {', '.join(v.tasks)}, not {task!r}; "
                f"pick a matching --task or another variant ({', '.join(TINY_VARIANTS)})."
            )
    source = resolve_model(model, task, family)
    cls = _pipeline_class(family, task)
    vae_cls = getattr(diffusers, _VAE_CLASS[family])

    def _load(**hub_kwargs):
        # diffusers 0.42 renamed `torch_dtype` to `dtype` (the old name still works but warns on every load).
        kwargs: dict[str, Any] = {"dtype": dtype}
        if vae_dtype is not None and vae_dtype != dtype:
            kwargs["vae"] = vae_cls.from_pretrained(source, subfolder="vae", dtype=vae_dtype, **hub_kwargs)
        return cls.from_pretrained(source, **kwargs, **hub_kwargs)

    local = os.path.expanduser(source)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "model_index.json")):
            raise ModelLoadError(
                f"Model directory {local!r} has no model_index.json, so it is not a diffusers pipeline. Download the "
                f"diffusers-format repository (the hub ids ending in '-Diffusers', e.g. "
                f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers; CogVideoX repos are diffusers-format already) with "
                f"`huggingface-cli download <id> --local-dir DIR` and pass `--model DIR`, or use `--model tiny`."
            )
        source = local
        pipe = _load()
    elif os.path.exists(local):
        raise ModelLoadError(
            f"Model path {local!r} is a file; expected a diffusers pipeline directory (with model_index.json). "
            f"Pass the directory (e.g. from `huggingface-cli download <id> --local-dir DIR`), or use `--model tiny`."
        )
    elif _looks_like_path(source):
        raise ModelLoadError(
            f"Model path {local!r} does not exist. Pass a diffusers pipeline directory (e.g. downloaded with "
            f"`huggingface-cli download <id> --local-dir DIR`), a hub id, or `--model tiny`."
        )
    else:
        cache_dir = _hf_cache_dir()
        try:
            pipe = _load(local_files_only=True, cache_dir=cache_dir)
        except OSError as local_exc:  # huggingface_hub/diffusers report "not (fully) cached" as OSError subclasses
            if _hf_offline():
                raise ModelLoadError(
                    _offline_help(
                        model,
                        f"it is not a local directory and not (fully) in the Hugging Face cache at {cache_dir}, and "
                        f"HF_HUB_OFFLINE is set, so it cannot be downloaded. ({type(local_exc).__name__})",
                    )
                ) from local_exc
            try:
                pipe = _load(cache_dir=cache_dir)
            except Exception as exc:  # noqa: BLE001 - network / auth / missing-repo errors all end the same way
                raise ModelLoadError(
                    _offline_help(
                        model,
                        f"it is not a local directory, not in the Hugging Face cache at {cache_dir}, and downloading "
                        f"it failed ({type(exc).__name__}; the underlying error is shown above).",
                    )
                ) from exc
    return pipe.to(device)


# ----------------------------------------------------------------------------------------------------------------
# Helpers over a loaded pipeline
# ----------------------------------------------------------------------------------------------------------------


def transformers_of(pipe) -> list[tuple[str, torch.nn.Module]]:
    """The pipeline's denoisers: ``[("transformer", m), ("transformer_2", m2)]``, skipping the absent ones.

    Wan 2.2 A14B has two experts (high-noise ``transformer``, low-noise ``transformer_2``); kernels and hooks
    must be installed in both or half the denoising steps would silently run the default attention.
    """
    out = []
    for name in ("transformer", "transformer_2"):
        module = getattr(pipe, name, None)
        if module is not None:
            out.append((name, module))
    return out


def _patch_hw(transformer) -> tuple[int, int]:
    p = transformer.config.patch_size
    if isinstance(p, int):  # CogVideoX: square spatial patch
        return p, p
    return int(p[1]), int(p[2])  # Wan: (t, h, w)


def _nearest_valid(value: int, step: int, offset: int = 0) -> str:
    """The valid values (``offset + k * step``, at least ``offset + step`` or 1) just below and above ``value``."""
    smallest = max(1, offset) if offset else step
    lo = max(smallest, (value - offset) // step * step + offset)
    hi = lo + step if lo <= value else lo
    return f"{lo}" if lo == hi else f"{lo} or {hi}"


def _is_cogvideox(pipe) -> bool:
    return type(pipe).__name__.startswith("CogVideoX")


def check_video_size(pipe, height: int, width: int, num_frames: int) -> None:
    """Raise ``ValueError`` unless (height, width, num_frames) is a size the model renders exactly.

    diffusers' pipelines silently round a bad size (or fail deep inside the model), which makes benchmark rows
    incomparable. Rules: height and width must be multiples of VAE spatial factor x transformer patch size (Wan
    2.1 / A14B / CogVideoX: 8 x 2 = 16; Wan 2.2 TI2V-5B: 16 x 2 = 32). Wan needs num_frames = 4k + 1 (the causal
    VAE maps 1 + 4k frames to 1 + k latents). CogVideoX needs num_frames = 8k + 1: its VAE decodes latents two
    at a time and only an odd latent count comes back as 4 (L - 1) + 1 frames (an even count gives 4L frames),
    which is why the real default is 49. CogVideoX models with learned positional embeddings (5b-I2V) only run
    at their sample size.
    """
    name, transformer = transformers_of(pipe)[0]
    ph, pw = _patch_hw(transformer)
    spatial = int(pipe.vae_scale_factor_spatial)
    temporal = int(pipe.vae_scale_factor_temporal)
    mh, mw = spatial * ph, spatial * pw
    problems = []
    if height <= 0 or height % mh:
        problems.append(
            f"height {height} is not a positive multiple of {mh} (VAE spatial factor {spatial} x patch {ph}); "
            f"nearest valid: {_nearest_valid(height, mh)}"
        )
    if width <= 0 or width % mw:
        problems.append(
            f"width {width} is not a positive multiple of {mw} (VAE spatial factor {spatial} x patch {pw}); "
            f"nearest valid: {_nearest_valid(width, mw)}"
        )
    frame_step = 2 * temporal if _is_cogvideox(pipe) else temporal
    if num_frames < 1 or (num_frames - 1) % frame_step:
        why = (
            f"CogVideoX needs {frame_step}k+1 frames (temporal factor {temporal}, odd latent frame count)"
            if _is_cogvideox(pipe)
            else f"Wan needs {frame_step}k+1 frames (VAE temporal factor {temporal})"
        )
        nearest = _nearest_valid(num_frames, frame_step, 1)
        problems.append(f"num_frames {num_frames} is invalid: {why}; nearest valid: {nearest}")
    if _is_cogvideox(pipe) and transformer.config.use_learned_positional_embeddings:
        sh, sw = transformer.config.sample_height * spatial, transformer.config.sample_width * spatial
        if (height, width) != (sh, sw):
            problems.append(
                f"this CogVideoX model has learned positional embeddings and only renders at its sample size "
                f"{sh}x{sw} (height x width), not {height}x{width}"
            )
    if problems:
        raise ValueError(f"Invalid video size for {type(pipe).__name__}: " + "; ".join(problems) + ".")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def model_summary(pipe) -> dict:
    """Plain-JSON description of a loaded pipeline's architecture, for benchmark reports.

    Records what determines attention cost and VAE work: per transformer its layers, heads, head dim and patch
    size; the VAE class and latent channels / compression; the text (and image) encoder; and the Wan 2.2 switches
    (boundary_ratio for the two experts, expand_timesteps for TI2V-5B).
    """
    summary: dict[str, Any] = {"pipeline": type(pipe).__name__, "transformers": {}}
    for name, t in transformers_of(pipe):
        c = t.config
        summary["transformers"][name] = {
            "class": type(t).__name__,
            "num_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "attention_head_dim": c.attention_head_dim,
            "inner_dim": c.num_attention_heads * c.attention_head_dim,
            "patch_size": _jsonable(c.patch_size),
            "in_channels": c.in_channels,
            "dtype": str(t.dtype).replace("torch.", ""),
        }
        if getattr(c, "patch_size_t", None) is not None:
            summary["transformers"][name]["patch_size_t"] = c.patch_size_t
    vae = getattr(pipe, "vae", None)
    if vae is not None:
        vc = vae.config
        latent = vc.get("z_dim", vc.get("latent_channels"))
        summary["vae"] = {
            "class": type(vae).__name__,
            "latent_channels": latent,
            "z_dim": latent,
            "scale_factor_spatial": int(pipe.vae_scale_factor_spatial),
            "scale_factor_temporal": int(pipe.vae_scale_factor_temporal),
            "dtype": str(vae.dtype).replace("torch.", ""),
        }
    text_encoder = getattr(pipe, "text_encoder", None)
    if text_encoder is not None:
        summary["text_encoder"] = {
            "class": type(text_encoder).__name__,
            "d_model": getattr(text_encoder.config, "d_model", None),
            "num_layers": getattr(text_encoder.config, "num_layers", None),
        }
    image_encoder = getattr(pipe, "image_encoder", None)
    summary["image_encoder"] = type(image_encoder).__name__ if image_encoder is not None else None
    summary["scheduler"] = type(pipe.scheduler).__name__
    cfg = pipe.config
    for key in ("boundary_ratio", "expand_timesteps"):
        if key in cfg:
            summary[key] = _jsonable(cfg[key])
    if "flow_shift" in pipe.scheduler.config:
        summary["flow_shift"] = _jsonable(pipe.scheduler.config["flow_shift"])
    return summary
