"""Model families: everything vdbench knows about one family of video pipelines, one module per family.

Why: a family's knowledge (which diffusers classes, which sizes render exactly, how its latents reach the VAE,
how its outputs are named, what the parallel engines can split, how its attention calls are classified ...) used
to be spread over a dozen files as ``if family == "wan"`` branches. Here it is one :class:`Family` object per
module (``wan.py``, ``cogvideox.py``); the rest of vdbench asks the family instead of naming it.

Adding a family = adding one module to this package that defines ``FAMILY = Family(...)``: :func:`discover` (run
when this package is imported) imports every module of the package and registers its ``FAMILY``, in the order
of :attr:`Family.order`. :func:`register` adds a family from anywhere else (a plugin, a test).

Layering: this package sits below ``pipelines``, ``vae``, ``video``, ``render``, ``parallel`` and ``patching``
(they import it) and above :mod:`vdbench.tiny` (families register their tiny variants there).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from typing import Any, Callable, Mapping, Optional

from .. import tiny
from ..measure import record

__all__ = ["CliDefaults", "Family", "XfuserWiring", "attention_grids", "attention_presets", "discover", "for_pipeline",
           "for_transformer", "for_vae", "get", "layout_tag", "model_tag", "names", "register",
           "split_layout", "split_cache", "split_options", "stem_stack", "unregister", "vae_config", "vae_names"]


def model_tag(model: str) -> str:
    """A file-name-safe tag for a model argument (no underscores, so file names parse unambiguously)."""
    base = model.rstrip("/").split("/")[-1] if not model.startswith("tiny") else model
    return re.sub(r"[^A-Za-z0-9.\-]+", "-", base).strip("-") or "model"


def layout_tag(ulysses: int = 1, ring: int = 1, cfg: bool = False) -> str:
    """The parallel layout as a file-name tag: ``u2``, ``r2``, ``u2r2``, ``cfg2``, ``u2cfg2``; ``""`` for one
    process (:func:`vdbench.measure.record.layout_tag`, the one definition). Output names end with it
    (``..._u2.mp4``) so a Ulysses-2 render never overwrites the one-GPU render of the same settings."""
    return record.layout_tag(ulysses, ring, cfg)


#: A layout tag (:func:`layout_tag`) at the end of a file stem, after an underscore.
_LAYOUT_RE = re.compile(r"^(?P<rest>.+)_(?P<tag>(?=[urc])(?:u\d+)?(?:r\d+)?(?:cfg\d+)?)$")


def split_layout(stem: str) -> tuple[str, str]:
    """``(stem without its layout tag, tag)``: ``"x_64x96_u2"`` -> ``("x_64x96", "u2")``; ``(stem, "")`` when it
    ends in none. The identity tags, which follow it (``_seed7_id-3fa9c1d2``:
    :func:`vdbench.measure.record.identity_tags`), are split off first."""
    stem = record.split_identity_tags(stem)[0]
    m = _LAYOUT_RE.match(stem)
    return (m["rest"], m["tag"]) if m and m["tag"] else (stem, "")


#: A step cache's tag (:func:`vdbench.measure.record.cache_tag`) at the end of a stem (its layout tag split off).
_CACHE_RE = re.compile(r"^(?P<rest>.+)_(?P<tag>cache-[a-z]+(?:-.*)?)$")


def split_cache(stem: str) -> tuple[str, str]:
    """``(stem without its cache tag, the cache's spec)``: ``"x_64x96_cache-fbc-threshold=0.1"`` -> ``("x_64x96",
    "fbc:threshold=0.1")``; ``(stem, "")`` when it has none. The layout tag, which follows it, is split off first
    (:func:`split_layout`)."""
    m = _CACHE_RE.match(stem)
    return (m["rest"], record.spec_from_tag(m["tag"])) if m else (stem, "")


#: A stack's options tag (:func:`vdbench.measure.record.options_tag`) at the end of a stem (its layout and cache tags
#: split off): it starts with an option's name.
_OPTIONS_RE = re.compile(r"^(?P<rest>.+)_(?P<tag>(?:compile|fp8gemm|bf16te|fp8x|eagerblock|offload=|vae=|encode=)[^_]*"
                         r"(?:_[^_]+)*)$")


def split_options(stem: str) -> tuple[str, str]:
    """``(stem without its options tag, the tag)``: ``"x_64x96_compile-vae=fast"`` -> ``("x_64x96",
    "compile-vae=fast")``; ``(stem, "")`` when it has none. The layout and cache tags, which follow it, are split off
    first (:func:`split_layout`, :func:`split_cache`)."""
    m = _OPTIONS_RE.match(stem)
    return (m["rest"], m["tag"]) if m else (stem, "")


def stem_stack(stem: str) -> dict:
    """What a video's file name tells of its stack beyond the attention type: ``speed`` (the speed options),
    ``vae_decode``, ``vae_encode`` and ``cache`` (None where the name has none) -- the fallback for a video no record
    names (:func:`vdbench.measure.record.options_from_tag`, :func:`split_cache`)."""
    rest, cache = split_cache(split_layout(stem)[0])
    speed, decode, encode = record.options_from_tag(split_options(rest)[1])
    return {"speed": speed, "vae_decode": decode, "vae_encode": encode, "cache": cache or None}


@dataclasses.dataclass(frozen=True)
class CliDefaults:
    """What a render command line uses when a flag is not given, per family.

    ``real`` / ``tiny``: height, width, num_frames and num_inference_steps for a real checkpoint and for a tiny
    model (CPU-sized). ``output_dir`` is the default output directory; the video and ``timing.json`` go to
    ``output_dir / results_subdir`` (Wan: ``<dir>/results/``; CogVideoX: ``""``, directly in ``<dir>``).
    """

    real: Mapping[str, int]
    tiny: Mapping[str, int]
    prompt: str
    negative_prompt: str
    guidance_scale: float
    fps: int
    output_dir: str
    results_subdir: str


@dataclasses.dataclass(frozen=True)
class XfuserWiring:
    """How xfuser (xDiT) makes one pipeline class parallel; each entry is ``"module:Class"`` of xfuser's.

    ``transformer_wrapper``: a transformer class built from the loaded transformers' config that takes over their
    tensors (the pipeline stays diffusers'). ``pipeline_wrapper``: a class wrapping the whole loaded pipeline
    (``cls(pipe, engine_config)``). ``cfg_pipeline``: the pipeline subclass that splits the guidance branches over
    ranks (``--use_cfg_parallel``), rebuilt from the loaded pipeline's modules. The mechanics are in
    :mod:`vdbench.parallel`.
    """

    transformer_wrapper: Optional[str] = None
    pipeline_wrapper: Optional[str] = None
    cfg_pipeline: Optional[str] = None


def _no_fixed_size(transformer, spatial: int) -> None:
    """Families whose models render at any valid size."""
    return None


def _always_allowed(engine: str, task: str, world_size: int, use_cfg_parallel: bool) -> None:
    """Families whose every task runs under every engine and path."""
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """One model family. Data fields, then the behaviour the rest of vdbench delegates to (callables):

    Identity and loading
        ``name``; ``tasks`` (``--task`` values); ``pipeline_classes`` (task -> diffusers pipeline class name;
        :meth:`pipeline_class`); ``image_pipeline_classes`` (task -> the class that serves it when a conditioning
        image is given, for tasks that take one optionally: Wan TI2V's image-to-video path); ``vae_class``
        (diffusers VAE class name; :func:`for_vae`); ``transformer_classes`` (diffusers transformer class
        names: how a bare transformer, patched with no family named, finds its family; :func:`for_transformer`);
        ``default_models`` (task -> the checkpoint a CLI loads when no model is given);
        ``default_tiny`` (task -> the tiny variant ``--model tiny`` picks); ``tiny_variants``
        (:class:`vdbench.tiny.TinyVariant` objects, registered into :mod:`vdbench.tiny`); ``random_variants``
        (``random:<name>`` -> (base tiny variant, real-shape overrides)).
    Command lines
        ``cli`` (:class:`CliDefaults`); ``output_name(task, model, num_frames, steps, attention_type, height,
        width, layout="") -> str`` (the video's file name; ``layout`` the parallel layout's :func:`layout_tag`,
        which ends the name); ``parse_label(stem) -> str | None`` (the attention type back from a file name this
        family wrote, None if not one of its names; :meth:`parse_name` adds a name's layout tag: the fallback
        for a video without a record); ``name_settings`` (the render settings ``output_name`` writes into the
        name; the others that change the frames go into the name's identity id, :mod:`vdbench.identity`);
        ``image_size_multiple(task, model) -> int | None`` (the multiple an image-derived output size is rounded
        to; None: the family renders the requested size).
    Sizes
        ``frame_multiple`` (valid frame counts are ``frame_multiple * temporal_factor * k + 1``); ``frame_rule``
        (why, for the error: a format string with ``{step}`` and ``{temporal}``); ``fixed_size(transformer,
        spatial) -> (height, width, reason) | None`` (the only size a model renders at, e.g. learned positional
        embeddings).
    Rendering
        ``image_tasks`` (tasks that take the conditioning image); ``image_refusals`` (task -> why an image is
        refused there); ``flow_shift(task, height, width, shipped) -> float`` or None (the family's default
        flow-matching shift for a model that ships ``shipped``: its scheduler config's ``flow_shift``, its
        ``boundary_ratio`` and ``expand_timesteps``, :func:`vdbench.pipelines.shipped_schedule`; the function
        itself None: its scheduler has none and the pipeline's is left alone).
    Latents
        ``prepare_latents(vae, latents) -> z`` (pipeline latents -> what ``vae.decode`` takes, as the diffusers
        pipeline does it); ``trim_latents(pipe, latents, num_frames) -> latents`` (drop latent frames the
        pipeline pads, before decoding); ``pipeline_decode`` (the default decode is the pipeline's own
        ``decode_latents`` instead of :func:`vdbench.vae.decode.decode_video`); ``vae_frame_chunks`` (the VAE decoder
        can be driven a few latent frames per call, exactly -- a causal-conv cache carries the rest
        (:func:`vdbench.vae.fast.wan_decode_chunked`): the parallel band decode drives it so and takes
        ``chunk_frames``; False: the VAE's own ``decode`` runs on each band).
    Parallel
        ``parallel_refusal(engine, task, world_size, use_cfg_parallel) -> str | None`` (why an engine/path can't
        split this family's task, None if it can); ``xfuser`` (pipeline class name -> :class:`XfuserWiring`);
        ``preferred_engine`` (what ``--parallel_engine auto`` picks where both engines serve the request: the one
        measured faster for the family's models).
    Attention
        ``call_kind(mode, attn, encoder_hidden_states) -> str`` ('self', 'cross' or 'joint' for one processor
        call; ``mode`` is how the processor reaches attention: 'dispatcher', 'sdpa' or 'xfuser'; 'cross+img'
        for a cross-attention processor that makes two attention calls, image context first, then text).
        ``grid_hooks(transformer, spec, *, once_per_forward, active) -> hooks`` (the token grid of each forward
        for the sparse patterns: a :class:`vdbench.sparse.hooks.GridTracker` or
        :class:`~vdbench.sparse.hooks.TileOrder` built with the family's own grid rule and hook points;
        ``hooks.grid``, ``hooks.layout``, ``hooks.remove()``; a TypeError for a transformer it can't hook);
        None: the family has no token grid and the sparse backends are refused before the load.
        ``pipeline_requirements`` (pipeline class name -> ((module, why), ...)): packages a pipeline class needs at
        call time though diffusers imports it without them; checked before the load.
        ``attention_calls(denoiser_config, vae_config, height, width, num_frames, guidance_scale, pipe_kwargs)`` ->
        the distinct (batch, heads, seq, heads_kv, seq_kv, head_dim) of the attention calls one render of that size
        makes on one GPU, from the denoiser's and the VAE's configs (no weights; ``pipe_kwargs``: the extra pipeline
        arguments, a text length among them): what a backend's kernels are compiled for ahead of the first step
        (:mod:`vdbench.backends.prewarm`). None: the family does not say, and nothing is compiled ahead.
        ``ulysses_self_attention(attn, hidden_states, rotary_emb, exchange, attend) -> out``: the family's
        self-attention processor call under Ulysses with Q, K and V handed to ``exchange``
        (:class:`vdbench.patching.ulysses.UlyssesExchange`) as each is made, so the all-to-all of one runs while the
        next is projected (``--ulysses_async``); ``attend(q, k, v)`` the patched kernel. None: the family has none,
        and ``--ulysses_async`` is refused for it. Both it and ``self_attention(attn, hidden_states, rotary_emb,
        attend) -> out`` (the same call on one GPU, op for op diffusers' processor) take ``rope=`` (``rope(x, cos,
        sin, dst, eager)``: the rotary embedding of ``x`` into ``dst``, the patch's fused kernel or ``eager``, the
        family's expressions: ``--fused_rope``). None: diffusers' processor runs, with its own RoPE.
        ``block_forward(block, hidden_states, encoder_hidden_states, temb, rotary_emb, *, ops) -> hidden_states``: the
        family's transformer block forward, op for op diffusers', with its elementwise passes (modulations, gated
        residuals) handed to ``ops`` (the patch's: :mod:`vdbench.kernels.block` where it can, the family's eager
        expressions where it can't: ``--fused_block``), installed on the modules whose class is one of
        ``block_classes``. None: diffusers' block forward runs.
    Benchmarks
        ``attention_presets`` (name -> (B, H, Sq, Sk, D) of a real model's attention, bench/bench_attention.py);
        ``attention_grids`` (preset name -> its token grid, ``FxHxW[+T]``: what the sparse patterns need);
        ``size_grid(height, width, num_frames)`` -> the self-attention token grid of a render of that size (the
        same ``FxHxW[+T]``), for benching captured inputs with the sparse patterns;
        ``vae_configs`` (:func:`vdbench.pipelines.build_vae` name -> (tiny config, real config) of the VAE class).
    Step caches (:mod:`vdbench.cache`)
        ``guidance_in_one_batch`` (the pipeline runs classifier-free guidance's two passes as one batch, which
        FasterCache's unconditional skip splits; Wan calls the denoiser twice); ``latent_format`` (the layout of
        the denoiser's video latents, FasterCache's ``tensor_format``); ``step_context_pipelines`` (the pipeline
        classes that pass the step index, sigma and step count to the denoiser's ``cache_context``: SeaCache reads
        them, and caches nothing without them); ``text_kv`` (how the text reaches the family's attention, why
        diffusers' text K/V cache has nothing to cache there: its refusal's reason).
    Listing
        ``order``: where the family is listed (names, variants, error messages); lower first.
    """

    name: str
    tasks: tuple[str, ...]
    pipeline_classes: Mapping[str, str]
    vae_class: str
    default_models: Mapping[str, str]
    default_tiny: Mapping[str, str]
    cli: CliDefaults
    output_name: Callable[..., str]
    parse_label: Callable[[str], Optional[str]]
    frame_rule: str
    prepare_latents: Callable[[Any, Any], Any]
    call_kind: Callable[[str, Any, Any], str]
    tiny_variants: tuple[tiny.TinyVariant, ...] = ()
    name_settings: tuple[str, ...] = ("task", "model", "num_frames", "num_inference_steps", "attention_type",
                                      "height", "width")
    random_variants: Mapping[str, tuple[str, dict]] = dataclasses.field(default_factory=dict)
    image_size_multiple: Callable[[str, str], Optional[int]] = lambda task, model: None
    frame_multiple: int = 1
    fixed_size: Callable[[Any, int], Optional[tuple[int, int, str]]] = _no_fixed_size
    image_tasks: tuple[str, ...] = ("i2v",)
    image_pipeline_classes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    image_refusals: Mapping[str, str] = dataclasses.field(default_factory=dict)
    flow_shift: Optional[Callable[[str, int, int, Optional[dict]], float]] = None
    trim_latents: Callable[[Any, Any, Optional[int]], Any] = lambda pipe, latents, num_frames: latents
    pipeline_decode: bool = False
    vae_frame_chunks: bool = False
    transformer_classes: tuple[str, ...] = ()
    parallel_refusal: Callable[[str, str, int, bool], Optional[str]] = _always_allowed
    xfuser: Mapping[str, XfuserWiring] = dataclasses.field(default_factory=dict)
    preferred_engine: str = "xfuser"
    attention_presets: Mapping[str, tuple[int, int, int, int, int]] = dataclasses.field(default_factory=dict)
    attention_grids: Mapping[str, str] = dataclasses.field(default_factory=dict)
    size_grid: Optional[Callable[[int, int, int], str]] = None
    vae_configs: Mapping[str, tuple[dict, dict]] = dataclasses.field(default_factory=dict)
    grid_hooks: Optional[Callable[..., Any]] = None
    pipeline_requirements: Mapping[str, tuple[tuple[str, str], ...]] = dataclasses.field(default_factory=dict)
    attention_calls: Optional[Callable[..., tuple[tuple[int, int, int, int, int, int], ...]]] = None
    ulysses_self_attention: Optional[Callable[..., Any]] = None
    self_attention: Optional[Callable[..., Any]] = None
    block_forward: Optional[Callable[..., Any]] = None
    block_classes: tuple[str, ...] = ()
    guidance_in_one_batch: bool = False
    latent_format: str = "BCFHW"
    step_context_pipelines: tuple[str, ...] = ()
    text_kv: str = ""
    order: int = 100

    def pipeline_class(self, task: str, image: bool = False) -> str:
        """The diffusers pipeline class name that serves ``task`` (with a conditioning image when ``image``)."""
        task = self.check_task(task)
        if image and task in self.image_pipeline_classes:
            return self.image_pipeline_classes[task]
        return self.pipeline_classes[task]

    def takes_image(self, task: str) -> bool:
        """Whether ``task`` uses a conditioning image (always, or optionally through its image pipeline)."""
        return task in self.image_tasks or task in self.image_pipeline_classes

    def parse_name(self, stem: str) -> Optional[tuple[str, str]]:
        """``(attention type, layout tag)`` of a video this family wrote, read back from its file name; None for a
        name that isn't this family's. The fallback for a video no record names: a render's identity is its
        record's (:func:`vdbench.measure.record.identity`)."""
        stem = record.split_identity_tags(stem)[0]
        rest, tag = split_layout(stem)
        if tag:
            inner = self.parse_label(split_options(split_cache(rest)[0])[0])
            if inner is not None:
                return inner, tag
        inner = self.parse_label(split_options(split_cache(stem)[0])[0])
        return None if inner is None else (inner, "")

    def label(self, stem: str) -> Optional[str]:
        """The label of a video this family wrote (:func:`vdbench.measure.record.run_label` of its
        :meth:`parse_name` and :func:`stem_stack`: ``sdpa``, ``sdpa+u2``, ``sdpa+compile+fbc+u2``); None for a
        name that isn't this family's."""
        parsed = self.parse_name(stem)
        return None if parsed is None else record.run_label(*parsed, **stem_stack(stem))

    def check_task(self, task: Optional[str]) -> str:
        """``task`` (None: t2v) if this family has it; ValueError naming the valid ones otherwise."""
        task = task or "t2v"
        if task not in self.tasks:
            raise ValueError(f"Unknown task {task!r} for family {self.name!r}; "
                             f"expected one of {', '.join(self.tasks)}.")
        return task


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (and its tiny and random-weight variants); names are unique. Returns the family."""
    if family.name in _REGISTRY and _REGISTRY[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is already registered")
    for variant in family.tiny_variants:
        if variant.family != family.name:
            raise ValueError(f"tiny variant {variant.name!r} says family {variant.family!r}, not {family.name!r}")
        tiny.register_variant(variant)
    for name, (base, overrides) in family.random_variants.items():
        tiny.register_random(name, base, overrides)
    _REGISTRY[family.name] = family
    ordered = sorted(_REGISTRY.values(), key=lambda f: f.order)  # stable: registration order within an order
    _REGISTRY.clear()
    _REGISTRY.update((f.name, f) for f in ordered)
    return family


def unregister(name: str) -> None:
    """Remove family ``name`` and its tiny / random-weight variants (a plugin unloaded, a test cleaned up)."""
    family = _REGISTRY.pop(name, None)
    if family is not None:
        for variant in family.tiny_variants:
            tiny.unregister_variant(variant.name)


def get(name: str) -> Family:
    """The registered family ``name``; ValueError listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unknown model family {name!r}; expected one of {', '.join(_REGISTRY)}.") from None


def names() -> tuple[str, ...]:
    """The registered families' names, in listing order."""
    return tuple(_REGISTRY)


def _class_names(obj) -> list[str]:
    return [cls.__name__ for cls in type(obj).__mro__]


def for_pipeline(pipe) -> Family:
    """The family whose pipeline classes include ``pipe``'s class (or a base class of it: xfuser's subclasses);
    the first in listing order when several families share a class."""
    for cls_name in _class_names(pipe):
        for family in _REGISTRY.values():
            if cls_name in family.pipeline_classes.values():
                return family
    raise ValueError(f"no registered model family serves pipeline class {type(pipe).__name__} "
                     f"(families: {', '.join(_REGISTRY)})")


def for_vae(vae) -> Family:
    """The family whose VAE class ``vae`` is (or derives from); the first in listing order."""
    for cls_name in _class_names(vae):
        for family in _REGISTRY.values():
            if cls_name == family.vae_class:
                return family
    raise ValueError(f"unsupported VAE class {type(vae).__name__} (no registered model family uses it; "
                     f"families: {', '.join(_REGISTRY)})")


def for_transformer(transformer) -> Family:
    """The family whose transformer classes include ``transformer``'s class (or a base class of it); the first in
    listing order. ValueError when no registered family claims it."""
    for cls_name in _class_names(transformer):
        for family in _REGISTRY.values():
            if cls_name in family.transformer_classes:
                return family
    raise ValueError(f"no registered model family uses transformer class {type(transformer).__name__} "
                     f"(families: {', '.join(_REGISTRY)})")


def attention_presets() -> dict[str, tuple[int, int, int, int, int]]:
    """Every family's attention shapes (B, H, Sq, Sk, D) of real models, by preset name."""
    return {name: shape for family in _REGISTRY.values() for name, shape in family.attention_presets.items()}


def attention_grids() -> dict[str, str]:
    """The token grid (``FxHxW[+T]``, :func:`vdbench.sparse.parse_grid`) of every attention preset that has one."""
    return {name: grid for family in _REGISTRY.values() for name, grid in family.attention_grids.items()}


def xfuser_wired() -> tuple[str, ...]:
    """The pipeline classes some registered family wires to xfuser (:attr:`Family.xfuser`), in listing order."""
    return tuple(cls for family in _REGISTRY.values() for cls in family.xfuser)


def vae_names() -> tuple[str, ...]:
    """The VAE names :func:`vae_config` (and ``vdbench.pipelines.build_vae``) know, in listing order."""
    return tuple(name for family in _REGISTRY.values() for name in family.vae_configs)


def vae_config(name: str, *, tiny: bool = False) -> tuple[Family, dict]:
    """(family, config) of VAE ``name``: the real checkpoint's config, or the tiny models' with ``tiny``."""
    for family in _REGISTRY.values():
        if name in family.vae_configs:
            tiny_cfg, real_cfg = family.vae_configs[name]
            return family, dict(tiny_cfg if tiny else real_cfg)
    raise ValueError(f"Unknown VAE {name!r}; valid: {', '.join(vae_names())}.")


def discover() -> tuple[str, ...]:
    """Import every module of this package and register the ``FAMILY`` it defines (modules already imported and
    registered are skipped). Returns the names of the families registered by this call."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family) and _REGISTRY.get(family.name) is not family:
            found.append(family)
    for family in sorted(found, key=lambda f: f.order):
        register(family)
    return tuple(f.name for f in found)


discover()
