"""The tiny / random-weight model factory: pipelines of the real diffusers/transformers classes, shrunk.

Why tiny models: attention-kernel benchmarks must be developed and tested on machines that cannot download
multi-gigabyte checkpoints (no internet, no GPU). A tiny model is only useful for that if it runs *exactly* the
code a real checkpoint runs, so the tiny variants are made of the real diffusers/transformers classes
(``WanTransformer3DModel``, ``AutoencoderKLWan``, ``UMT5EncoderModel``, ``CogVideoXTransformer3DModel`` ...), keep
the real architecture (patch sizes, VAE down/up-sampling stages and therefore the real 8x/16x spatial and 4x
temporal compression, rope, attention layout, image conditioning, two-expert Wan 2.2 switching) and only shrink
widths, depths and head counts. They are built once with fixed seeds, written with ``save_pretrained`` into a
cache directory, and then loaded by :func:`vdbench.pipelines.load_pipeline` through the very same
``from_pretrained`` call a hub id or a local checkpoint directory goes through, so that loading, dtype handling
and component wiring are exercised too.

This module knows no model family: each family module (:mod:`vdbench.families`) describes its variants as
:class:`TinyVariant` objects -- component configs, the diffusers class names, the init hook that makes its random
transformer's attention matter -- and registers them here (:func:`register_variant`, :func:`register_random`).
The registries are therefore filled once :mod:`vdbench.families` is imported (``vdbench.pipelines`` does).

Public API:

* :data:`TINY_VARIANTS`, :data:`RANDOM_VARIANTS` -- the registered variants, by name.
* :func:`register_variant`, :func:`register_random`, :func:`unregister_variant` -- how families add theirs.
* :func:`get_variant`, :func:`random_variant`, :func:`tiny_model_dir`, :func:`build_tiny`, :func:`ensure_tiny` -- a
  variant (tiny, or the one a random-weight model is built from), its cache location, its builder, and "the cached
  directory, built if missing".
* :func:`build_pipeline` -- a variant as an in-memory pipeline; :func:`build_random` -- real shapes, random weights.
* :data:`UMT5_TEXT_ENCODER`, :data:`T5_TEXT_ENCODER` (and their real-width forms) -- the tiny text encoders that
  go with the tiny tokenizer built here.
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
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # torch is imported where a model is built: importing the registry (video labels, listings) is light
    import torch

__all__ = [
    "BUILDER_VERSION",
    "RANDOM_VARIANTS",
    "T5_TEXT_ENCODER",
    "T5_XXL_WIDTH",
    "TINY_VARIANTS",
    "TinyVariant",
    "UMT5_TEXT_ENCODER",
    "UMT5_XXL_WIDTH",
    "build_pipeline",
    "build_random",
    "build_tiny",
    "ensure_tiny",
    "get_variant",
    "random_variant",
    "register_random",
    "register_variant",
    "tiny_model_dir",
    "unregister_variant",
    "with_head_dim",
]

#: Bump when the saved files change for a reason the cache hash cannot see (the hash already covers the variant
#: specs, the tokenizer corpus, the builder functions' source, each variant's init hook's source and the
#: diffusers/transformers versions).
BUILDER_VERSION = 1


# ----------------------------------------------------------------------------------------------------------------
# Tiny variant specifications
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyVariant:
    """Everything needed to build one tiny pipeline: plain-JSON component configs plus the pipeline wiring.

    The configs are the constructor kwargs of the real classes. They are hashed (see :func:`tiny_model_dir`), so
    editing any number here automatically gives a new cache directory instead of silently reusing old weights.
    ``transformer_class`` / ``vae_class`` are diffusers class names. ``transformer_init`` (optional) runs on each
    freshly seeded transformer: a deterministic tweak (no random draws) that a family needs so that its random
    model's output depends on attention (see the family modules); it is not part of :meth:`spec`, its source is
    hashed instead.
    """

    name: str
    family: str
    tasks: tuple[str, ...]
    pipeline: str
    mirrors: str  # the real hub checkpoint whose structure this variant copies
    transformer_class: str
    transformer: dict
    vae_class: str
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
    transformer_init: Optional[Callable[[torch.nn.Module], None]] = dataclasses.field(default=None, compare=False)

    def components(self) -> dict:
        """Component name (``transformer``, ``transformer_2``, ``vae``) -> (diffusers class name, config) of the
        components this variant has: what a model built from it is made of, known without building it."""
        return {n: (self.vae_class if n == "vae" else self.transformer_class, getattr(self, n))
                for n in ("transformer", "transformer_2", "vae") if getattr(self, n) is not None}

    def spec(self) -> dict:
        """The variant as plain JSON data (what is hashed, and what is recorded next to the built model)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "transformer_init"}
        return json.loads(json.dumps(data))


def with_head_dim(variant: TinyVariant, head_dim: int, seed: int) -> TinyVariant:
    """``variant`` with its transformer's (and second expert's) attention head dim set to ``head_dim`` (head count,
    depth, wiring, VAE, scheduler unchanged), named ``<name>-d<head_dim>``, with weights of its own ``seed``. Why:
    the project's Triton kernels take head dims 64 and 128 only, and the tiny models are built at 32 to stay
    cheap."""
    second = None if variant.transformer_2 is None else dict(variant.transformer_2, attention_head_dim=head_dim)
    return dataclasses.replace(variant, name=f"{variant.name}-d{head_dim}", seed=seed,
                               transformer=dict(variant.transformer, attention_head_dim=head_dim), transformer_2=second)


#: The registered tiny variants, by name (``--model tiny:<name>``), in registration order.
TINY_VARIANTS: dict[str, TinyVariant] = {}

#: ``--model random:<name>``: (tiny variant whose wiring it reuses, overrides with the real shapes).
RANDOM_VARIANTS: dict[str, tuple[str, dict]] = {}


def register_variant(variant: TinyVariant) -> None:
    """Add a family's tiny variant; a name can be registered once (two families must not share one)."""
    if variant.name in TINY_VARIANTS and TINY_VARIANTS[variant.name] is not variant:
        raise ValueError(f"tiny variant {variant.name!r} is already registered "
                         f"(by family {TINY_VARIANTS[variant.name].family!r})")
    TINY_VARIANTS[variant.name] = variant


def register_random(name: str, base: str, overrides: dict) -> None:
    """Add a real-shape random-weight model: tiny variant ``base``'s wiring with ``overrides`` (real configs)."""
    if base not in TINY_VARIANTS:
        raise ValueError(f"random-weight model {name!r}: its base tiny variant {base!r} is not registered")
    if name in RANDOM_VARIANTS and RANDOM_VARIANTS[name] != (base, overrides):
        raise ValueError(f"random-weight model {name!r} is already registered")
    RANDOM_VARIANTS[name] = (base, overrides)


def unregister_variant(name: str) -> None:
    """Remove tiny variant ``name`` and the random-weight models built on it (a family being unregistered)."""
    TINY_VARIANTS.pop(name, None)
    for random_name in [n for n, (base, _) in RANDOM_VARIANTS.items() if base == name]:
        del RANDOM_VARIANTS[random_name]


# The tiny text encoders go with the tiny tokenizer below (a T5-layout Unigram vocabulary): umt5-xxl (real:
# d_model 4096, 24 layers, 64 heads, gated-gelu, relative position buckets 32 / 128) ...
UMT5_TEXT_ENCODER = {
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
# ... and t5-v1_1-xxl: the same layout with T5EncoderModel.
T5_TEXT_ENCODER = dict(UMT5_TEXT_ENCODER, **{"class": "T5EncoderModel"})
# The real-shape random-weight models keep the text encoder's real width (so the transformer's text projection has
# the real shape) but only 2 layers: text encoding is not what those models are for, and a random 24-layer
# UMT5-XXL would cost ~11 GB and a minute of init for nothing.
UMT5_XXL_WIDTH = dict(UMT5_TEXT_ENCODER, d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=2)
T5_XXL_WIDTH = dict(UMT5_XXL_WIDTH, **{"class": "T5EncoderModel"})


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
    import torch

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
    cls = getattr(diffusers, variant.transformer_class)
    with _seeded(_component_seed(variant, name)):
        model = cls(**cfg)
    # The family's init tweak is a deterministic function of the seeded weights (no further random draws).
    if variant.transformer_init is not None:
        variant.transformer_init(model)
    return model.eval()


def _make_vae(variant: TinyVariant):
    import diffusers

    cls = getattr(diffusers, variant.vae_class)
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
    import torch

    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.dtype == torch.float64:
                param.data = param.data.float()
        for name, buf in sub._buffers.items():
            if buf is not None and buf.dtype == torch.float64 and name not in sub._non_persistent_buffers_set:
                sub._buffers[name] = buf.float()


def build_pipeline(variant: TinyVariant, module_device=None, timings: Optional[dict] = None, host: tuple = ()):
    """Instantiate the pipeline in memory (eval mode). Models are created on ``module_device`` when given
    (random-weight real shapes are initialised directly on the GPU, or on "meta" to check shapes for free);
    tokenizer and scheduler always live on the CPU, as from_pretrained creates them.

    The optional slots the pipeline class takes (``transformer_2``, ``image_encoder``, ``image_processor``) are
    filled from the variant's configs, or passed as None when it has none, as the real checkpoints record them.
    ``timings``: filled with the seconds of each part (the imports of the classes, each component's build), host
    clock -- where a load's time goes, so a slow or variable load can be told apart from the work it measures.
    ``host``: denoisers (``transformer_2``; under ``--offload group`` and ``shard`` both) built first, each block
    moved into a flat host buffer as soon as it is built (:func:`_make_transformer_into`; the buffer made on a thread
    from just after the denoiser's class is imported), so the device never holds more than a block of them beside
    the others (an offloaded expert, a sharded denoiser: :mod:`vdbench.offload`).
    """
    import torch

    from .timing import Laps

    # a GPU build's kernels run behind the host: each part waits for its own, so none is billed to the next
    on_gpu = module_device is not None and torch.device(module_device).type == "cuda"
    part = Laps(timings, module_device).lap
    if on_gpu and timings is not None:  # the CUDA context, created here unless something before the load did
        torch.empty(0, device=module_device)
        part("cuda_init", None)
    import diffusers

    from .hostmem import HostBuffer, check_room, layout, weights

    # each host component's buffer made (allocated, faulted in, pinned) on a thread from here on, beside the rest of
    # the imports and its own build: its size needs only the denoiser's class, built on the meta device (a build on
    # the meta device itself has no weights to keep anywhere)
    shapes_only = module_device is not None and torch.device(module_device).type == "meta"
    metas = {name: _meta_transformer(variant, name) for name in host
             if getattr(variant, name, None) and not shapes_only}
    sizes = {name: layout(weights(meta))[1] for name, meta in metas.items()}
    if sizes:  # refused here, before anything is made: past the host's memory the OOM killer ends the load unsaid
        check_room(sizes, "the load", "use a host with more memory, or --offload none on a card that holds "
                                      "every weight")
    buffers = {name: HostBuffer(size, pinned=on_gpu, background=True) for name, size in sizes.items()}
    if buffers:
        part("host_buffers_started", None)
    import transformers  # noqa: F401 - the text encoders' package, imported in the "imports" part

    cls = getattr(diffusers, variant.pipeline)
    for name in (variant.transformer_class, variant.vae_class):
        getattr(diffusers, name)
    slots = inspect.signature(cls.__init__).parameters
    on = (lambda: torch.device(module_device)) if module_device is not None else contextlib.nullcontext
    part("imports", None)
    early, tokenizer = {}, None
    if buffers:  # the host's, while the first buffer is made
        tokenizer = part("tokenizer", _build_tokenizer(variant.tokenizer_max_length))
    for name, buffer in buffers.items():  # each block on the host once built: the device holds one block at most
        with on():
            early[name] = part(name, _make_transformer_into(variant, name, buffer, metas[name]))
    if tokenizer is None:
        tokenizer = part("tokenizer", _build_tokenizer(variant.tokenizer_max_length))
    with on():
        components: dict[str, Any] = {
            "tokenizer": tokenizer,
            "text_encoder": part("text_encoder", _make_text_encoder(variant, vocab_size=len(tokenizer))),
            "vae": part("vae", _make_vae(variant)),
            "transformer": early.get("transformer") or part("transformer", _make_transformer(variant, "transformer")),
        }
        if "transformer_2" in slots:
            components["transformer_2"] = early.get("transformer_2") or part("transformer_2", (
                _make_transformer(variant, "transformer_2") if variant.transformer_2 is not None else None
            ))
        if "image_encoder" in slots:
            components["image_encoder"] = part(
                "image_encoder", _make_image_encoder(variant) if variant.image_encoder else None)
    components["scheduler"] = _make_scheduler(variant)
    if "image_processor" in slots:
        components["image_processor"] = _make_image_processor(variant) if variant.image_processor else None
    for component in components.values():
        if isinstance(component, torch.nn.Module):
            _saved_float64_to_float32(component)
    return part("assemble", cls(**components, **variant.pipeline_kwargs))


def _final_dtypes(module) -> None:
    """The dtypes a build ends with (:func:`build_pipeline`'s float64 rule, :func:`build_random`'s cast to the default
    dtype), applied now: the host copy holds the weights the render uses, and the later passes find nothing to do."""
    import torch

    _saved_float64_to_float32(module)
    _cast_like_from_pretrained(module, torch.get_default_dtype())


def _meta_transformer(variant: TinyVariant, name: str):
    """Component ``name`` built on the meta device in its final dtypes (no memory, no weights drawn): what a host
    buffer for its weights is laid out and sized from (:func:`vdbench.hostmem.layout`)."""
    import torch

    with torch.device("meta"):
        model = _make_transformer(variant, name)
    _final_dtypes(model)
    return model


def _make_transformer_into(variant: TinyVariant, name: str, buffer, meta):
    """Component ``name`` built as :func:`_make_transformer` builds it -- the same seeded draws in the same order on
    the same device, the family's init tweak, the final dtypes: the same bytes -- with each of its blocks moved into
    its views of ``buffer`` (a :class:`vdbench.hostmem.HostBuffer`, pinned where a GPU is there, laid out by
    ``meta``: :func:`_meta_transformer`) as soon as the block is built, then what lies outside the blocks: the device
    never holds more than a block of it (a 14B expert built whole on the card and then moved out needed 27 GiB there
    for a moment, more than a 24 GB card has). The
    module carries the buffer (:data:`vdbench.hostmem.HOST_BUFFER`): what an offloaded expert's copies to the device
    come from (:mod:`vdbench.offload` takes it as it is). The family's tweak is a function of each block alone, so
    it runs on each block as it is built, before its cast."""
    import itertools
    import time
    import types

    import diffusers

    from .hostmem import HOST_BUFFER, block_list, held, layout, move_into, nbytes

    cfg = getattr(variant, name)
    cls = getattr(diffusers, variant.transformer_class)
    named = [*meta.named_parameters(), *meta.named_buffers()]
    views = dict(zip((n for n, _ in named), buffer.views([t for _, t in named])))
    ends = {n: o + nbytes(t) for (n, t), o in zip(named, layout([t for _, t in named])[0])}
    list_name = block_list(meta)[0]
    if list_name is None:  # no list of blocks to stream: built whole on the device, then moved
        model = _make_transformer(variant, name)
        _final_dtypes(model)
        move_into(model, buffer)
        return model
    block_cls, built = type(getattr(meta, list_name)[0]), itertools.count()
    buffer.parts["copy_s"] = 0.0  # the copies' own seconds (the buffer's making waited for apart: waited_s)

    def to_host(module, prefix: str) -> None:
        for n, t in [*module.named_parameters(), *module.named_buffers()]:
            view = views.get(prefix + n)  # None: not a name of the model (the check at the end says so)
            if view is not None and t.data_ptr() != view.data_ptr():
                buffer.wait(ends[prefix + n])
                start = time.perf_counter()
                view.copy_(t.detach())  # to its final dtype; from a GPU: waits for the copy
                t.data = view
                buffer.parts["copy_s"] = round(buffer.parts["copy_s"] + time.perf_counter() - start, 4)

    original = block_cls.__init__

    def init(block, *args, **kwargs):
        original(block, *args, **kwargs)
        if variant.transformer_init is not None:
            variant.transformer_init(types.SimpleNamespace(config=meta.config, **{list_name: [block]}))
        to_host(block, f"{list_name}.{next(built)}.")

    block_cls.__init__ = init
    try:
        with _seeded(_component_seed(variant, name)):
            model = cls(**cfg)
    finally:
        block_cls.__init__ = original
    to_host(model, "")  # what lies outside the blocks, and any weight a block built outside the list misplaced
    setattr(model, HOST_BUFFER, buffer)
    if held(model) is not buffer:
        raise RuntimeError(f"{name}: the block-by-block build left weights outside its host buffer")
    return model.eval()


def get_variant(variant: str) -> TinyVariant:
    """The registered tiny variant ``variant``; ValueError naming the valid ones otherwise."""
    try:
        return TINY_VARIANTS[variant]
    except KeyError:
        raise ValueError(
            f"Unknown tiny model variant {variant!r}. Valid variants: {', '.join(TINY_VARIANTS)} "
            f"(use --model tiny:<variant>, or plain --model tiny for the task's default)."
        ) from None


def random_variant(name: str) -> TinyVariant:
    """``random:<name>`` as the variant it is built from (``random-<name>``: its base tiny variant's wiring with the
    real shapes); ValueError naming the valid ones otherwise."""
    try:
        base, overrides = RANDOM_VARIANTS[name]
    except KeyError:
        raise ValueError(f"Unknown random-weight model {name!r}. Valid: {', '.join(RANDOM_VARIANTS)} "
                         "(use --model random:<name>).") from None
    return dataclasses.replace(TINY_VARIANTS[base], name=f"random-{name}", **overrides)


def _source_digest(functions) -> str:
    digest = hashlib.sha256()
    for fn in functions:
        try:
            digest.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):  # no source available (frozen/compiled install): fall back to bytecode
            digest.update(fn.__code__.co_code)
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _builder_source_digest() -> str:
    """Digest of the source of every function that shapes the saved files (tokenizer, seeding, casting...).

    A cached tiny model is therefore rebuilt automatically when the builder code changes, even if nobody
    remembers to bump :data:`BUILDER_VERSION`. (Builds take well under a second, so a spurious rebuild after a
    cosmetic edit costs nothing.) A variant's own init hook is hashed with its spec (:func:`_spec_hash`).
    """
    return _source_digest((
        _tokenizer_vocab,
        _build_tokenizer,
        _component_seed,
        _make_text_encoder,
        _make_transformer,
        _make_vae,
        _make_image_encoder,
        _make_image_processor,
        _make_scheduler,
        _saved_float64_to_float32,
        build_pipeline,
        _canonicalize_model_index,
    ))


def _spec_hash(variant: TinyVariant) -> str:
    """Short hash of everything that determines the built files: spec, builder code (the variant's init hook
    included), corpus, library versions.

    The diffusers/transformers versions are included because their module constructors define the random init
    and the on-disk format; a different version must not silently reuse (or be compared against) old weights.
    torch's version and the CPU kernels it picks (its SIMD capability) too: the init runs torch's RNG and math,
    whose float results may differ in the last bits between versions and between AVX2 and AVX-512 kernels, so a
    cache folder shared between machines is never read as another machine's build.
    """
    import diffusers
    import torch
    import transformers

    payload = {
        "builder_version": BUILDER_VERSION,
        "builder_source": _builder_source_digest(),
        "init_source": _source_digest([variant.transformer_init] if variant.transformer_init else []),
        "spec": variant.spec(),
        "tokenizer_vocab": _tokenizer_vocab(),
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def _cache_root() -> pathlib.Path:
    root = os.environ.get("VDBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vdbench")
    return pathlib.Path(root).expanduser()


def tiny_model_dir(variant: str) -> pathlib.Path:
    """Cache directory of a tiny variant: ``$VDBENCH_CACHE`` (or ``~/.cache/vdbench``)/tiny/<variant>-<hash>."""
    v = get_variant(variant)
    return _cache_root() / "tiny" / f"{v.name}-{_spec_hash(v)}"


_COMPLETE_MARKER = "vdbench_tiny.json"


@contextlib.contextmanager
def _every_rank_writes():
    """transformers writes a model's weights on rank 0 only once torch.distributed is initialized; the tiny model is
    built by whichever rank takes the cache's lock first, so under torchrun a rank 1 build would leave the text
    encoder without weights. Inside this block transformers sees no process group (only its save decision reads it)."""
    import torch.distributed as dist

    try:
        from transformers.distributed import mixin
    except ImportError:  # a transformers without the rank check
        yield
        return
    if not (dist.is_available() and dist.is_initialized()) or not hasattr(mixin, "_is_torch_distributed_initialized"):
        yield
        return
    real = mixin._is_torch_distributed_initialized
    mixin._is_torch_distributed_initialized = lambda: False
    try:
        yield
    finally:
        mixin._is_torch_distributed_initialized = real


def _check_weights_written(folder: pathlib.Path) -> None:
    """Every saved model component holds its weights (a save that skipped them must not pass for a complete model)."""
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "config.json").is_file()):
        if not any(sub.glob("*.safetensors")) and not any(sub.glob("*.bin")):
            raise RuntimeError(f"building the tiny model: {sub.name} was saved without its weights ({folder})")


def build_tiny(variant: str, path: str | os.PathLike) -> pathlib.Path:
    """Build tiny ``variant`` and ``save_pretrained`` it to ``path`` (which must not exist or be empty).

    The pipeline is written to a temporary sibling directory first and renamed into place at the end, so
    ``path`` either does not exist or holds a complete model -- a reader never sees a half-written one. Same
    variant -> bit-identical weights on every build (each component is seeded on its own).
    """
    v = get_variant(variant)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        pipe = build_pipeline(v)
        with _every_rank_writes():
            pipe.save_pretrained(tmp, safe_serialization=True)
        _check_weights_written(tmp)
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


def ensure_tiny(variant: str) -> pathlib.Path:
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
# Real-shape random-weight models (GPU performance work)
# ----------------------------------------------------------------------------------------------------------------


def build_random(name: str, *, dtype: Optional[torch.dtype] = None, device="cuda", timings: Optional[dict] = None,
                 host: tuple = ()):
    """A pipeline of the real architecture and shapes with random weights, built directly on ``device``, in
    ``dtype`` (None: bfloat16); ``timings``: filled with the seconds of each part (:func:`build_pipeline`'s, then
    ``cast`` and ``to_device``); ``host``: components kept on the host (:func:`build_pipeline`).

    For performance work where checkpoints can't be downloaded: speed depends on shapes, not on weight values.
    Not saved or loaded (the loading path is what the tiny models test); the same adaLN rescale as the tiny
    models keeps attention visible in the output, so quality figures between backends mean something.
    """
    variant = random_variant(name)
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype if dtype.is_floating_point else torch.float32)
        pipe = build_pipeline(variant, module_device=device, timings=timings, host=host)
    finally:
        torch.set_default_dtype(previous)
    from .timing import Laps

    laps = Laps(timings, device)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            _cast_like_from_pretrained(component, dtype)
    laps.lap("cast")
    return laps.lap("to_device", to_device(pipe, device, host))


def to_device(pipe, device, host: tuple = ()):
    """``pipe.to(device)``, but for the components named in ``host``, which stay where they are."""
    import torch

    if not host:
        return pipe.to(device)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name not in host:
            component.to(device)
    return pipe


def _cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``dtype`` everywhere except what ``from_pretrained(dtype=...)`` keeps in float32 (``_keep_in_fp32_modules``:
    Wan's time embedder, norms and modulation tables), so random-weight timings match a real checkpoint's."""
    import torch

    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, param in model.named_parameters():
        want = torch.float32 if keep & set(name.split(".")) else dtype
        if param.is_floating_point() and param.dtype != want:
            param.data = param.data.to(want)
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.dtype not in (torch.float64, torch.float32) and dtype == torch.float32:
            buf.data = buf.data.to(torch.float32)

