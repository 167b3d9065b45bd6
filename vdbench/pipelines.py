"""Loading Wan, CogVideoX (any registered family's) pipelines: real checkpoints, tiny and random-weight models.

What a family is made of (classes, tasks, default tiny variants, size rules) comes from :mod:`vdbench.families`;
the tiny / random-weight models themselves are built by :mod:`vdbench.tiny` and loaded here through the very
same ``from_pretrained`` call a hub id or a local checkpoint directory goes through, so that loading, dtype
handling and component wiring are exercised too.

Public API (used by the rest of vdbench and its CLIs):

* :func:`resolve` -- the model a render is about, resolved once into a :class:`Model`: its family and task checked,
  its string parsed (:class:`ModelSpec`), its pipeline class, its components' configs read without a weight.
  :meth:`Model.load` loads it; the pipeline it loads carries it (:func:`model_of`).
* :func:`parse_model` -- a model string parsed into a :class:`ModelSpec` (kind, variant, path or hub id, family,
  task, the components' configs) without refusing anything.
* :func:`resolve_model` -- ``"tiny"`` / ``"tiny:<variant>"`` -> a local directory (built on demand); anything
  else is returned unchanged.
* :func:`load_pipeline` -- a model named by strings, resolved and loaded (:meth:`Model.load`: ``from_pretrained``
  with the family's pipeline class, offline-friendly errors).
* :func:`transformers_of`, :func:`check_video_size`, :func:`set_schedule`, :func:`model_summary` -- helpers over
  a loaded pipeline.
* Re-exported from :mod:`vdbench.scheduler`: :func:`prewarm_scheduler`, :func:`run_scheduler_ahead`,
  :func:`run_scheduler_blocking`, :func:`settle_scheduler` (the scheduler around the timed steps).
* :func:`build_vae` -- one family VAE at a tiny or the real checkpoint's config, seeded random weights (benches).
* Re-exported from :mod:`vdbench.tiny` (where callers have always found them): :data:`TINY_VARIANTS`,
  :data:`RANDOM_VARIANTS`, :class:`TinyVariant`, :func:`tiny_model_dir`, :func:`build_tiny`,
  :func:`build_random`, :data:`BUILDER_VERSION`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

import torch

from . import families
from .scheduler import prewarm_scheduler, run_scheduler_ahead, run_scheduler_blocking, settle_scheduler
from .timing import Laps
from .tiny import (BUILDER_VERSION, RANDOM_VARIANTS, TINY_VARIANTS, TinyVariant, build_random, build_tiny,
                   ensure_tiny, get_variant, random_variant, tiny_model_dir, to_device)

__all__ = [
    "prewarm_scheduler",
    "run_scheduler_ahead",
    "run_scheduler_blocking",
    "settle_scheduler",
    "BUILDER_VERSION",
    "MODEL_KINDS",
    "Model",
    "ModelLoadError",
    "ModelSpec",
    "TINY_VARIANTS",
    "TinyVariant",
    "RANDOM_VARIANTS",
    "build_random",
    "build_tiny",
    "build_vae",
    "check_video_size",
    "hub_id_problem",
    "load_pipeline",
    "model_of",
    "model_summary",
    "parse_model",
    "resolve",
    "resolve_model",
    "set_schedule",
    "shipped_schedule",
    "tiny_model_dir",
    "transformers_of",
    "vae_names",
]


class ModelLoadError(RuntimeError):
    """A model (hub id or local path) could not be loaded; the message says why and how to fix it."""


# ----------------------------------------------------------------------------------------------------------------
# Resolving and loading
# ----------------------------------------------------------------------------------------------------------------


#: What ``--model`` names (:attr:`ModelSpec.kind`): an embedded tiny model, a random-weight model of a real
#: architecture, a local path, a hub id.
MODEL_KINDS = ("tiny", "random", "local", "hub")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``--model`` parsed once (:func:`parse_model`), for a family and a task: what the config reads, the load and
    the messages take instead of the string.

    ``model``: the string as given (what messages name). ``kind``: one of :data:`MODEL_KINDS`. ``family``: the
    :class:`vdbench.families.Family` (None where the name given is not a registered family). ``task``: the
    family's task (None: it has no such task). ``variant``: the tiny variant (``tiny`` resolved through the
    family's default for the task) or the random-weight architecture (``random:<arch>``, registered or not), and
    ``built_from`` the registered :class:`~vdbench.tiny.TinyVariant` it is built from (a random-weight
    architecture's: :func:`vdbench.tiny.random_variant`). ``path``: a local model's path, ``~`` expanded;
    ``hub_id``: a hub model's id, and ``hub_problem`` why it can't be one (None if it can). ``components``: component
    name (``transformer``, ``transformer_2``, ``vae``) -> (class name or None, config), read without a weight -- a
    tiny or random-weight model's from the variant it is built from (:meth:`~vdbench.tiny.TinyVariant.components`),
    a local directory's or a cached hub id's from ``<name>/config.json`` --; None where that needs a download; a
    component the model lacks is left out. Parsing refuses nothing: what a name can't resolve to is kept for the
    step that needs it (``task_error``: the family or task is unknown; ``variant_error``: a tiny or random-weight
    name names no variant), so that a config read answers "unknown" and the load refuses, with the family's or the
    variant registry's message."""

    model: str
    kind: str
    family: Optional[families.Family]
    task: Optional[str]
    variant: Optional[str] = None
    path: Optional[str] = None
    hub_id: Optional[str] = None
    hub_problem: Optional[str] = None
    task_error: Optional[str] = None
    variant_error: Optional[str] = None
    built_from: Optional[TinyVariant] = None
    components: Optional[dict] = None


def parse_model(model: str, task: str | None = None, family: "str | families.Family" = "wan") -> ModelSpec:
    """The one parser of a model string (``tiny``, ``tiny:<variant>``, ``random:<arch>``, a local path, a hub id)
    for ``family`` (a name or the :class:`~vdbench.families.Family`) and ``task`` (None: t2v), the components'
    configs read as it goes: where a path or hub id points (its files), then the family and task, then the tiny or
    random-weight variant (the family's default for the task, for ``tiny``). Never raises: see :class:`ModelSpec`."""
    named = model == "tiny" or model.startswith(("tiny:", "random:"))
    where: dict = {}
    if not named:
        local = os.path.expanduser(model)
        if os.path.exists(local) or _looks_like_path(model):
            where = dict(kind="local", path=local,
                         components=_file_configs(local, None) if os.path.isdir(local) else None)
        else:
            problem = hub_id_problem(model)
            where = dict(kind="hub", hub_id=model, hub_problem=problem,
                         components=None if problem else _file_configs(model, _hf_cache_dir()))
    fam, checked, task_error = None, None, None
    try:
        fam = family if isinstance(family, families.Family) else families.get(family)
        checked = fam.check_task(task)
    except ValueError as e:
        task_error = str(e)
    common = dict(model=model, family=fam, task=checked, task_error=task_error)
    if not named:
        return ModelSpec(**where, **common)
    if model == "tiny" and task_error is not None:
        return ModelSpec(kind="tiny", variant_error=task_error, **common)
    kind, _, name = model.partition(":")
    name = fam.default_tiny[checked] if model == "tiny" else name
    try:
        built = random_variant(name) if kind == "random" else get_variant(name)
    except ValueError as e:  # kept for the load to refuse (ModelSpec)
        return ModelSpec(kind=kind, variant=name if kind == "random" else None, variant_error=str(e), **common)
    return ModelSpec(kind=kind, variant=name, built_from=built, components=built.components(), **common)


def _as_spec(model: "str | ModelSpec", task: str | None, family: "str | families.Family") -> ModelSpec:
    """``model`` itself when it is parsed already (it carries its task and family), else :func:`parse_model`'s."""
    return model if isinstance(model, ModelSpec) else parse_model(model, task, family)


#: A pipeline's denoisers, by component name (Wan 2.2 A14B has two experts; :func:`transformers_of`).
DENOISERS = ("transformer", "transformer_2")


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """The model a render is about, resolved once before anything loads (:func:`resolve`); the stages after take
    it, and the pipeline :meth:`load` makes carries it (:func:`model_of`), so that nothing below looks the family
    up by name or derives it back from the pipeline's classes.

    ``spec``: the model string parsed (:class:`ModelSpec`: tiny, random-weight, local or hub). ``family``: its
    :class:`~vdbench.families.Family` and ``task`` the family's task (the spec's, both known here).
    ``image``: a conditioning image goes to a task that takes one. ``pipeline_class``: the diffusers pipeline
    class that serves them; ``requirements``: the packages that class needs at call time, ((module, why), ...),
    the family's ``pipeline_requirements``. Read from the files without a weight -- a tiny or random-weight model's
    variant (:attr:`ModelSpec.built_from`), a local directory's or a cached hub id's ``config.json`` --, None where
    that needs a download: ``denoisers`` (``{"transformer": (class name, config), "transformer_2": ...}``),
    ``vae`` ((class name, config)), :attr:`head_dims` (the denoisers' attention head dims), ``shipped`` (what it
    ships of its schedule, as :func:`shipped_schedule` reads it from a loaded pipeline: the scheduler config's
    ``flow_shift``, the pipeline config's ``boundary_ratio`` and ``expand_timesteps``)."""

    spec: ModelSpec
    family: families.Family
    task: str
    image: bool
    pipeline_class: str
    requirements: tuple[tuple[str, str], ...] = ()
    denoisers: Optional[dict] = None
    vae: Optional[tuple[str, dict]] = None

    @functools.cached_property
    def shipped(self) -> Optional[dict]:
        """What the model ships of its schedule (:func:`_shipped`), read -- without a weight -- when first asked."""
        return _shipped(self.spec)

    @property
    def head_dims(self) -> Optional[list[int]]:
        """The denoisers' attention head dims, from their configs (None unless every one says)."""
        return _head_dims(self.denoisers)

    def load(self, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             vae_dtype: torch.dtype | None = None, timings: dict | None = None, host: tuple = ()):
        """The pipeline, loaded through ``<PipelineClass>.from_pretrained`` (:func:`load_pipeline` says how), carrying
        this model (:func:`model_of`); ``host``: components left on the host (an offloaded expert), never on
        ``device``."""
        return _load(self, dtype, device, vae_dtype, timings, host)

    def check_size(self, pipe, height: int, width: int, num_frames: int) -> None:
        """:func:`check_video_size` of this model's loaded ``pipe``, by its family's rules."""
        _check_video_size(pipe, self.family, height, width, num_frames)

    def check_inputs(self, task: Optional[str], image: Optional[str]) -> None:
        """The conditioning image ``image`` (a path, or None) where ``task`` needs one (and none where the family
        refuses it), the packages the pipeline calls without checking them."""
        import importlib.util
        from pathlib import Path

        family = self.family
        if image and task in family.image_refusals:
            raise ValueError(family.image_refusals[task])
        if task in family.image_tasks and not image:
            raise ValueError(f"task {task} needs --img_file_path (the image to animate)")
        for module, why in self.requirements:
            if importlib.util.find_spec(module) is None:
                raise ValueError(f"task {task} needs the {module} package ({why})\npip install {module}")
        if image and not Path(image).is_file():
            raise ValueError(f"conditioning image {image} does not exist\ngive --img_file_path an image file")

    def check_experts(self, boundary_ratio: Optional[float], guidance_scale_2: Optional[float],
                      loaded: Optional[bool] = None) -> None:
        """``--boundary_ratio`` and ``--guidance_scale_2`` are for a pipeline of two experts (Wan 2.2 A14B): refused
        for one, where its configs (:attr:`denoisers`, before the load) or the loaded pipeline (``loaded``: whether it
        has a second expert) tell."""
        asked = [f for f, v in (("--boundary_ratio", boundary_ratio), ("--guidance_scale_2", guidance_scale_2))
                 if v is not None]
        if boundary_ratio is not None and not 0 < boundary_ratio < 1:
            raise ValueError(f"--boundary_ratio {boundary_ratio:g} is outside (0, 1)\ngive the share of the "
                             "timesteps the high-noise expert runs, e.g. 0.875")
        two = loaded if loaded is not None else (None if self.denoisers is None else "transformer_2" in self.denoisers)
        if asked and two is False:
            raise ValueError(f"{' and '.join(asked)}: {self.spec.model} has one denoiser; they apply to a model of "
                             "two experts (Wan 2.2 A14B)\ndrop the flag(s)")


def resolve(model: str, task: str | None = None, family: "str | families.Family" = "wan", *,
            image: bool = False) -> Model:
    """``model`` (a model string) of ``family`` (a name or the family) for ``task`` (None: t2v), with a conditioning
    image where ``image``, resolved into a :class:`Model`: the family and task checked (ValueError naming the valid
    ones), the string parsed, the pipeline class chosen, the components' configs read without a weight. What the
    string can't resolve to (an unknown tiny variant) is kept for the load to refuse, as :class:`ModelSpec` keeps
    it."""
    spec = parse_model(model, task, family)
    if spec.task_error is not None:
        raise ValueError(spec.task_error)
    fam, task = spec.family, spec.task
    image = image and fam.takes_image(task)
    pipeline_class = fam.pipeline_class(task, image=image)
    requirements = tuple(fam.pipeline_requirements.get(pipeline_class, ()))
    found = spec.components or {}
    denoisers = {n: found[n] for n in DENOISERS if n in found} or None
    vae = found["vae"] if "vae" in found and found["vae"][0] else None
    return Model(spec, fam, task, image, pipeline_class, requirements, denoisers, vae)


def _shipped(spec: ModelSpec) -> Optional[dict]:
    """What ``spec``'s model ships of its schedule (:attr:`Model.shipped`), read without a weight: a tiny or
    random-weight model's from its variant, a local directory's or a cached hub id's from its
    ``scheduler/scheduler_config.json`` and ``model_index.json``; None where that needs a download."""
    from diffusers import ConfigMixin

    if spec.built_from is not None:
        scheduler, pipeline = spec.built_from.scheduler, spec.built_from.pipeline_kwargs
    elif spec.path or (spec.hub_id and not spec.hub_problem):
        class Config(ConfigMixin):  # diffusers' config reader, any config file
            config_name = "model_index.json"

        where, cache = (spec.path, None) if spec.path else (spec.hub_id, _hf_cache_dir())
        try:
            pipeline = dict(Config.load_config(where, local_files_only=True, cache_dir=cache))
            Config.config_name = "scheduler_config.json"
            scheduler = dict(Config.load_config(where, subfolder="scheduler", local_files_only=True,
                                                cache_dir=cache))
        except (OSError, ValueError):
            return None
    else:
        return None
    return {"flow_shift": scheduler.get("flow_shift"), "boundary_ratio": pipeline.get("boundary_ratio"),
            "expand_timesteps": bool(pipeline.get("expand_timesteps"))}


#: The attribute of a pipeline loaded here that holds its :class:`Model`.
_MODEL_ATTR = "vdbench_model"


def model_of(pipe) -> Optional[Model]:
    """The :class:`Model` ``pipe`` was loaded as (:meth:`Model.load`, :func:`load_pipeline`); None for a pipeline
    loaded elsewhere."""
    return getattr(pipe, _MODEL_ATTR, None)


def resolve_model(model: "str | ModelSpec", task: str | None = None, family: "str | families.Family" = "wan") -> str:
    """Map ``--model`` (a string, or a :class:`ModelSpec` that carries its task and family) to something
    ``from_pretrained`` accepts.

    ``"tiny"`` is the family's default tiny variant for ``task`` (:attr:`vdbench.families.Family.default_tiny`;
    wan: t2v -> wan2.1-t2v, i2v -> wan2.1-i2v, ti2v -> wan2.2-ti2v-5b; cogvideox: t2v -> cogvideox-t2v, i2v ->
    cogvideox-i2v), ``"tiny:<variant>"`` an
    explicit one; both are built into the cache if missing and the local directory is returned. Anything else
    (a hub id or a local path) is returned unchanged.
    """
    spec = _as_spec(model, task, family)
    if spec.kind != "tiny":
        return spec.model
    if spec.variant is None:
        raise ValueError(spec.variant_error)
    return str(ensure_tiny(spec.variant))


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


def hub_id_problem(model: str) -> str | None:
    """Why ``model`` can't be a Hugging Face hub id (None if it can), so a name that is neither a local path nor a
    hub id is refused without a network attempt (and its retries). Pipelines on the hub live under an
    organisation (``org/name``); a bare name is taken for a misspelt embedded model, not looked up."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if "/" not in model:
        return "a hub id has the form org/name"
    try:
        validate_repo_id(model)
    except HFValidationError as e:
        return str(e).splitlines()[0]
    return None


def _file_configs(where: str, cache_dir: Optional[str]) -> dict:
    """Component name (``transformer``, ``transformer_2``, ``vae``) -> (class name or None, config) of the pipeline
    at ``where`` (a local directory, or a hub id looked up in ``cache_dir``), from ``<name>/config.json`` without
    loading a weight (diffusers' ``load_config``, local files only; the class from its ``_class_name``); a
    component whose config is not there is left out."""
    from diffusers import ConfigMixin

    class ModelConfig(ConfigMixin):  # diffusers' config reader for any model's config.json, no class needed
        config_name = "config.json"

    out: dict = {}
    for n in DENOISERS + ("vae",):
        try:
            cfg = dict(ModelConfig.load_config(where, subfolder=n, local_files_only=True, cache_dir=cache_dir))
        except (OSError, ValueError):
            continue
        out[n] = (cfg.get("_class_name"), cfg)
    return out


def _head_dims(denoisers: Optional[dict]) -> list[int] | None:
    """The attention head dims of ``denoisers`` (:attr:`ModelSpec.components`' entries); None unless every one says."""
    if not denoisers or "transformer" not in denoisers:
        return None
    dims = [cfg.get("attention_head_dim") for _, cfg in denoisers.values()]
    return [int(d) for d in dims] if all(isinstance(d, int) for d in dims) else None


def _offline_help(model: str, reason: str) -> str:
    return (
        f"Model {model!r} could not be loaded offline: {reason}\n"
        f"To fix it, download it on a machine with internet access, e.g.\n"
        f"    huggingface-cli download {model} --local-dir DIR\n"
        f"(or `hf download {model} --local-dir DIR`), copy DIR to this machine and pass `--model DIR` "
        f"(or `--model_path DIR`); or run with `--model tiny` to use the embedded tiny model of the same "
        f"architecture (random weights, for testing the pipeline and kernels, not for image quality)."
    )


def load_pipeline(
    model: str,
    task: str = "t2v",
    family: "str | families.Family" = "wan",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype | None = None,
    image: bool = False,
    timings: dict | None = None,
):
    """Load a pipeline of ``family`` (a registered :mod:`vdbench.families` name, or the family itself) for ``task``
    from a tiny name, a random-weight name, a local directory or a hub id: :func:`resolve`, then
    :meth:`Model.load`; the pipeline carries its :class:`Model` (:func:`model_of`).

    Everything goes through ``<PipelineClass>.from_pretrained(path, dtype=dtype)`` (diffusers 0.42's name for
    ``torch_dtype``) -- tiny models included, so they exercise the real loading code. The class is the family's
    for the task (:meth:`vdbench.families.Family.pipeline_class`; Wan t2v/ti2v -> WanPipeline, i2v ->
    WanImageToVideoPipeline; CogVideoX t2v -> CogVideoXPipeline, i2v -> CogVideoXImageToVideoPipeline). With
    ``vae_dtype`` the VAE is loaded on its own in that dtype (as Wan's examples load a float32 VAE next to a
    bfloat16 transformer). Hub ids are looked up in the local Hugging Face
    cache first, without network; only if that fails and HF offline mode is off is the hub contacted (never for a
    name that can't be a hub id). Any failure to find the files raises :class:`ModelLoadError` with instructions.
    ``image``: the task runs with a conditioning image (the family's image pipeline for tasks that take one
    optionally: Wan TI2V). ``timings``: filled with the seconds of the load's parts, host clock (a random-weight
    build's per component, :func:`vdbench.tiny.build_random`; otherwise the imports, ``from_pretrained`` and the
    move to ``device``).
    """
    return resolve(model, task, family, image=image).load(dtype=dtype, device=device, vae_dtype=vae_dtype,
                                                          timings=timings)


def _load(model: Model, dtype: torch.dtype, device, vae_dtype: torch.dtype | None, timings: dict | None,
          host: tuple = ()):
    """:meth:`Model.load`: the variant's refusals, then a random-weight build or ``from_pretrained``."""
    laps = Laps(timings, device)
    import diffusers

    spec, fam, task = model.spec, model.family, model.task
    name = spec.model
    v = spec.built_from
    if spec.kind in ("random", "tiny") and v is None:
        raise ValueError(spec.variant_error)
    if spec.kind == "random":
        if v.family != fam.name:
            raise ValueError(f"{name!r} is a {v.family} model, but family {fam.name!r} was requested.")
        pipe = build_random(spec.variant, dtype=dtype, device=device, timings=timings, host=host)
        if vae_dtype is not None and vae_dtype != dtype:
            pipe.vae.to(vae_dtype)
        setattr(pipe, _MODEL_ATTR, model)
        return pipe
    if spec.kind == "tiny":
        if v.family != fam.name:
            raise ValueError(f"Tiny variant {v.name!r} is a {v.family} model, but family {fam.name!r} was "
                             "requested.")
        if task not in v.tasks:
            raise ValueError(
                f"Tiny variant {v.name!r} supports task(s) {', '.join(v.tasks)}, not {task!r}; "
                f"pick a matching --task or another variant ({', '.join(TINY_VARIANTS)})."
            )
    cls = getattr(diffusers, model.pipeline_class)
    vae_cls = getattr(diffusers, fam.vae_class)
    laps.lap("imports")
    local = str(ensure_tiny(spec.variant)) if spec.kind == "tiny" else spec.path
    source = spec.hub_id

    def from_pretrained(**hub_kwargs):
        # diffusers 0.42 renamed `torch_dtype` to `dtype` (the old name still works but warns on every load).
        kwargs: dict[str, Any] = {"dtype": dtype}
        if vae_dtype is not None and vae_dtype != dtype:
            kwargs["vae"] = vae_cls.from_pretrained(source, subfolder="vae", dtype=vae_dtype, **hub_kwargs)
        return cls.from_pretrained(source, **kwargs, **hub_kwargs)

    if local is not None and os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "model_index.json")):
            raise ModelLoadError(
                f"Model directory {local!r} has no model_index.json, so it is not a diffusers pipeline. Download the "
                f"diffusers-format repository (the hub ids ending in '-Diffusers', e.g. "
                f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers; CogVideoX repos are diffusers-format already) with "
                f"`huggingface-cli download <id> --local-dir DIR` and pass `--model DIR`, or use `--model tiny`."
            )
        source = local
        pipe = from_pretrained()
    elif local is not None and os.path.exists(local):
        raise ModelLoadError(
            f"Model path {local!r} is a file; expected a diffusers pipeline directory (with model_index.json). "
            f"Pass the directory (e.g. from `huggingface-cli download <id> --local-dir DIR`), or use `--model tiny`."
        )
    elif local is not None:
        raise ModelLoadError(
            f"Model path {local!r} does not exist. Pass a diffusers pipeline directory (e.g. downloaded with "
            f"`huggingface-cli download <id> --local-dir DIR`), a hub id, or `--model tiny`."
        )
    elif spec.hub_problem:
        raise ModelLoadError(
            f"Model {name!r} is not a local directory and can't be a hub id ({spec.hub_problem}); nothing "
            f"was downloaded.\nThe embedded tiny models are spelled `tiny` or `tiny:<variant>` "
            f"({', '.join(TINY_VARIANTS)}); a real checkpoint is a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers "
            f"or a local diffusers directory.")
    else:
        cache_dir = _hf_cache_dir()
        try:
            pipe = from_pretrained(local_files_only=True, cache_dir=cache_dir)
        except OSError as local_exc:  # huggingface_hub/diffusers report "not (fully) cached" as OSError subclasses
            if _hf_offline():
                raise ModelLoadError(
                    _offline_help(
                        name,
                        f"it is not a local directory and not (fully) in the Hugging Face cache at {cache_dir}, and "
                        f"HF_HUB_OFFLINE is set, so it cannot be downloaded. ({type(local_exc).__name__})",
                    )
                ) from local_exc
            try:
                pipe = from_pretrained(cache_dir=cache_dir)
            except Exception as exc:  # noqa: BLE001 - network / auth / missing-repo errors all end the same way
                raise ModelLoadError(
                    _offline_help(
                        name,
                        f"it is not a local directory, not in the Hugging Face cache at {cache_dir}, and downloading "
                        f"it failed ({type(exc).__name__}; the underlying error is shown above).",
                    )
                ) from exc
    laps.lap("from_pretrained")
    setattr(pipe, _MODEL_ATTR, model)
    return laps.lap("to_device", to_device(pipe, device, host))


# ----------------------------------------------------------------------------------------------------------------
# Helpers over a loaded pipeline
# ----------------------------------------------------------------------------------------------------------------


def transformers_of(pipe) -> list[tuple[str, torch.nn.Module]]:
    """The pipeline's denoisers: ``[("transformer", m), ("transformer_2", m2)]``, skipping the absent ones.

    Wan 2.2 A14B has two experts (high-noise ``transformer``, low-noise ``transformer_2``); kernels and hooks
    must be installed in both or half the denoising steps would silently run the default attention.
    """
    out = []
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if module is not None:
            out.append((name, module))
    return out


def shipped_schedule(pipe) -> dict:
    """What a loaded pipeline ships of its schedule: its scheduler config's ``flow_shift`` (None: a scheduler
    without one), the experts' ``boundary_ratio`` and ``expand_timesteps`` (Wan 2.2) from the pipeline's config."""
    return {"flow_shift": pipe.scheduler.config.get("flow_shift"),
            "boundary_ratio": pipe.config.get("boundary_ratio"),
            "expand_timesteps": bool(pipe.config.get("expand_timesteps"))}


def step_denoisers(pipe, steps: int) -> list[tuple[str, float]]:
    """Each denoising step's (denoiser, timestep) in a call of ``steps`` steps: the timesteps of a copy of the
    pipeline's scheduler set to ``steps`` (the pipeline's own untouched: its call sets them again), and diffusers'
    Wan 2.2 rule for the denoiser -- ``transformer`` (the high-noise expert) while the timestep is at or above
    ``boundary_ratio`` x the scheduler's training steps, ``transformer_2`` below; with one denoiser, every step
    ``transformer``. What a step cache fills in per denoiser (its own step count, its first timestep) and what the
    render records (``run.resolved.schedule``)."""
    import copy

    sch = copy.deepcopy(pipe.scheduler)
    sch.set_timesteps(steps, device="cpu")
    boundary = pipe.config.get("boundary_ratio") if getattr(pipe, "transformer_2", None) is not None else None
    edge = None if boundary is None else boundary * sch.config.num_train_timesteps
    return [("transformer" if edge is None or t >= edge else "transformer_2", float(t)) for t in sch.timesteps]


def set_schedule(pipe, family: families.Family, task: str, height: int, width: int, *,
                 flow_shift: Optional[float] = None, boundary_ratio: Optional[float] = None,
                 guidance_scale: Optional[float] = None, guidance_scale_2: Optional[float] = None) -> dict:
    """Set the loaded pipeline's schedule and say what it is: the flow shift given, else the family's default for
    this model and size (:attr:`vdbench.families.Family.flow_shift`, from what the model ships:
    :func:`shipped_schedule`), the scheduler rebuilt with it (flow-matching schedulers only); the experts' boundary
    given (two experts), else the model's. Returns ``flow_shift`` / ``flow_shift_from``, ``boundary_ratio`` /
    ``boundary_from``, ``guidance_scale`` and ``guidance_scale_2`` (the low-noise expert's: the first's where not
    given, as diffusers takes it; None without two experts): what the render records it ran with."""
    shipped = shipped_schedule(pipe)
    shift, shift_from = flow_shift, "--flow_shift"
    if shift is None and family.flow_shift is not None and shipped["flow_shift"] is not None:
        shift, shift_from = family.flow_shift(task, height, width, shipped), "the family's default for the model"
    if shift is not None and shipped["flow_shift"] is not None:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, flow_shift=shift)
    else:
        shift, shift_from = shipped["flow_shift"], "the model's scheduler config"
    boundary, boundary_from = shipped["boundary_ratio"], "the model's config"
    if boundary_ratio is not None:
        pipe.register_to_config(boundary_ratio=boundary_ratio)
        boundary, boundary_from = boundary_ratio, "--boundary_ratio"
    two = getattr(pipe, "transformer_2", None) is not None and boundary is not None
    return {"flow_shift": shift, "flow_shift_from": shift_from if shift is not None else None,
            "boundary_ratio": boundary if two else None, "boundary_from": boundary_from if two else None,
            "guidance_scale": guidance_scale,
            "guidance_scale_2": (guidance_scale_2 if guidance_scale_2 is not None else guidance_scale) if two else None}


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


def check_video_size(pipe, height: int, width: int, num_frames: int,
                     family: "str | families.Family | None" = None) -> None:
    """Raise ``ValueError`` unless (height, width, num_frames) is a size the model renders exactly.

    diffusers' pipelines silently round a bad size (or fail deep inside the model), which makes benchmark rows
    incomparable. Rules: height and width must be multiples of VAE spatial factor x transformer patch size (Wan
    2.1 / A14B / CogVideoX: 8 x 2 = 16; Wan 2.2 TI2V-5B: 16 x 2 = 32). The frame count and any fixed size are the
    family's (``family``: a name or the :class:`vdbench.families.Family`; by default the pipeline's own: the
    :class:`Model` it was loaded as, else the family serving its class; :meth:`Model.check_size`):
    Wan needs num_frames = 4k + 1 (the causal VAE maps 1 + 4k frames to 1 + k latents); CogVideoX needs 8k + 1
    (its VAE decodes latents two at a time and only an odd latent count comes back as 4 (L - 1) + 1 frames, an
    even count gives 4L frames, which is why the real default is 49), and its models with learned positional
    embeddings (5b-I2V) only run at their sample size.
    """
    if isinstance(family, str):
        family = families.get(family)
    elif family is None:
        loaded = model_of(pipe)
        family = loaded.family if loaded is not None else families.for_pipeline(pipe)
    _check_video_size(pipe, family, height, width, num_frames)


def _check_video_size(pipe, fam: families.Family, height: int, width: int, num_frames: int) -> None:
    """:func:`check_video_size` by ``fam``'s rules."""
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
    frame_step = fam.frame_multiple * temporal
    if num_frames < 1 or (num_frames - 1) % frame_step:
        why = fam.frame_rule.format(step=frame_step, temporal=temporal)
        nearest = _nearest_valid(num_frames, frame_step, 1)
        problems.append(f"num_frames {num_frames} is invalid: {why}; nearest valid: {nearest}")
    fixed = fam.fixed_size(transformer, spatial)
    if fixed is not None and (height, width) != fixed[:2]:
        sh, sw, reason = fixed
        problems.append(f"{reason} and only renders at its sample size {sh}x{sw} (height x width), "
                        f"not {height}x{width}")
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


# ----------------------------------------------------------------------------------------------------------------
# VAEs on their own (benchmarks)
# ----------------------------------------------------------------------------------------------------------------


def vae_names() -> tuple[str, ...]:
    """The names :func:`build_vae` knows (every family's ``vae_configs``: wan2.1, wan2.2, cogvideox)."""
    return families.vae_names()


def build_vae(name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
              tiny: bool = False, **config):
    """VAE ``name`` (:func:`vae_names`) with seeded random weights, at the real checkpoint's config or, with
    ``tiny``, the tiny models'; ``config`` overrides entries (e.g. ``num_res_blocks``).

    The one builder of the VAE benchmarks (bench/bench_vae.py, the band-parallel decode's harness): weights come
    from ``torch.manual_seed(seed)`` and are created directly on ``device`` (so every process of a multi-process
    run gets the same weights from the same seed), then cast to ``dtype``. Inference only: no parameter requires
    grad -- diffusers builds them requiring grad, and a decode outside ``no_grad`` (diffusers' own ``vae.decode``
    is not decorated) would then record the autograd graph and keep every intermediate activation alive
    (CogVideoX VAE, 3x20x30 latent, fp32, CPU: 19.1 GB max RSS instead of 4.1 GB).
    """
    import diffusers

    fam, cfg = families.vae_config(name, tiny=tiny)
    cfg.update(config)
    torch.manual_seed(seed)
    with torch.device(device):
        vae = getattr(diffusers, fam.vae_class)(**cfg)
    return vae.to(dtype).eval().requires_grad_(False)
