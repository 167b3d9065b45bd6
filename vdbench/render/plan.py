"""The render's first stage: :func:`validate` -- every refusal that needs no weights (an unknown or unavailable backend,
a parallel path the backend or the family can't serve, a decode mode that doesn't apply, options that exclude each
other) before anything loads -- and the :class:`Plan` it returns: the configuration resolved once into the objects
every later stage takes instead of looking a name up again.

The checks run in a fixed order (:func:`checked_plan` reads as their list): first what the settings alone refuse,
then each thing as it is resolved, so that of two faults the same one is always said first.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from .. import backends as B
from .. import families, identity, pipelines
from .. import parallel as P
from ..cache import check_cache, parse_cache
from ..kernels import probe
from ..measure.record import settings_speed_options, stack_name
from ..offload import check_offload
from ..patching.schedule import as_schedule, resolve_attention
from ..speed import check_speed_options
from ..vae.decode import GLUES, DecodeOptions, check_decode
from ..vae.decode import MODES as DECODE_MODES
from ..vae.encode import MODES as ENCODE_MODES
from ..vae.encode import EncodeOptions, check_encode
from ..video import written_by_render
from .config import RenderConfig

__all__ = ["VaeMode", "Plan", "validate", "checked_plan", "check_experts", "fused_rope_choice", "fused_block_choice",
           "DTYPES", "resolve_device", "resolve_dtype"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def resolve_device(arg: str = "auto") -> torch.device:
    if arg in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(arg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise B.BackendUnavailable(f"--device {arg} asked for, but torch.cuda.is_available() is False")
    return dev


def resolve_dtype(arg: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU (what the models are run in), fp32 on a CPU (bf16 matmuls are slow there)."""
    if arg in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[arg]
    except KeyError:
        raise ValueError(f"unknown dtype {arg!r}; choose from auto, {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class VaeMode:
    """A VAE mode as the render runs it: its entry (:data:`vdbench.vae.decode.MODES` / :data:`vdbench.vae.encode.MODES`)
    and the options it runs with (:class:`~vdbench.vae.decode.DecodeOptions` / :class:`~vdbench.vae.encode.EncodeOptions`),
    both checked by :func:`validate`."""

    mode: object
    options: object


@dataclass
class Plan:
    """What :func:`validate` settled before any weight loads, each thing resolved once into the object the later
    stages take (none of them looks a name of ``cfg`` up again): the backend entry (or schedule), the model
    (:class:`vdbench.pipelines.Model`: its family, its parsed string, its pipeline class, its components' configs),
    the device and dtypes, the decode and encode modes with their options, the process context (``dctx``: under
    torchrun :class:`vdbench.parallel.DistContext` with its parallel layout, else
    :class:`vdbench.parallel.OneProcess`)."""

    cfg: RenderConfig
    model: pipelines.Model
    backend: B.Backend
    device: torch.device
    dtype: torch.dtype
    vae_dtype: torch.dtype
    decode: VaeMode
    encode: VaeMode
    dctx: object
    cache: object = None  # vdbench.cache.CacheSpec, or None
    flow_shift: Optional[float] = None  # --flow_shift; None: the model's default, read with the load
    fused_rope: Optional[str] = "not decided"  # why the RoPE is not fused (fused_rope_choice); None: it is
    fused_block: Optional[str] = "not decided"  # why the blocks' passes aren't fused (fused_block_choice); None: are

    @property
    def stack(self) -> str:
        """The render's stack name (:func:`vdbench.measure.record.stack_name`): the backend or schedule, the speed
        options, the VAE modes other than default, the step cache -- recorded with every entry (``stack``)."""
        cfg = self.cfg
        return stack_name(self.backend.name, settings_speed_options(asdict(cfg)), self.decode.mode.name,
                          self.encode.mode.name, self.cache.name if self.cache else None,
                          self.dctx.spec.tag)

    @property
    def family(self) -> families.Family:
        """The model's family (:attr:`vdbench.pipelines.Model.family`)."""
        return self.model.family

    @property
    def parallel(self):
        """The parallel layout (:class:`vdbench.parallel.ParallelSpec`) under torchrun; None for one process."""
        return self.dctx.spec if self.dctx.distributed else None

    @property
    def fused_glue(self) -> Optional[bool]:
        """The decode's glue choice (:class:`~vdbench.vae.decode.DecodeOptions`' ``fused_glue``)."""
        return self.decode.options.fused_glue

    @property
    def encode_glue(self) -> Optional[bool]:
        """The encode's glue choice: set where the encode takes it (``--vae_encode fast``)."""
        return self.encode.options.fused_glue


def validate(cfg: RenderConfig, dctx=None) -> Plan:
    """Every refusal that needs no weights, before anything loads. Under torchrun every rank checks and the ranks
    agree (one collective), so all stop together, with the reason and the same exit code, whichever check failed
    on whichever rank; a single process raises the refusal itself. ``dctx``: the process context
    (:func:`vdbench.render.render` makes it); by default one process on ``cfg.device``."""
    dctx = dctx if dctx is not None else P.OneProcess(resolve_device(cfg.device), rank=cfg.rank)
    plan, err = None, None
    try:
        plan = checked_plan(cfg, dctx)
    except Exception as e:  # noqa: BLE001 - handed to every rank by agree() and raised there
        err = e
    P.agree(dctx, err)
    return plan


def checked_plan(cfg: RenderConfig, dctx) -> Plan:
    """The :class:`Plan` of ``cfg``, or the first refusal: what the settings alone refuse, then each thing in turn as it
    is resolved -- the device and dtypes, the speed options, the model (and what its family refuses, the offload, the
    fused kernels), the VAE modes, the backend, the step cache, the parallel layout, the output file. The plan's ``cfg``
    records the backend by its own name (an alias -- diffusers' or SGLang's -- as ours) and the step cache in its one
    spelling."""
    _check_settings(cfg)
    device = dctx.device
    dtype = resolve_dtype(cfg.dtype, device)
    vae_dtype = dtype if cfg.vae_dtype in (None, "auto") else resolve_dtype(cfg.vae_dtype, device)
    check_speed_options(device, compile=cfg.compile, compile_backend=cfg.compile_backend,
                        compile_mode=cfg.compile_mode, fp8_gemms=cfg.fp8_gemms, inductor_tuning=cfg.inductor_tuning)
    # the render's one lookup of its family and one parse of its model string, its configs read (no weight): the
    # Model travels from here; an unknown variant is the load's refusal
    model = pipelines.resolve(cfg.model, cfg.task, cfg.family, image=bool(cfg.image))
    family = model.family
    if cfg.flow_shift is not None and family.flow_shift is None:
        raise ValueError(f"--flow_shift: the {family.name} pipelines' schedulers have no flow shift\ndrop the flag")
    check_offload(cfg.offload, device=device, parallel=dctx.distributed, compiled=cfg.compile,
                  two_experts=None if model.denoisers is None else "transformer_2" in model.denoisers,
                  fp8_gemms=bool(cfg.fp8_gemms), cache=bool(cfg.cache), cfg_split=dctx.spec.use_cfg_parallel)
    _check_inputs(cfg, model)
    check_experts(cfg, model.denoisers)
    fused = fused_rope_choice(cfg, device, family), fused_block_choice(cfg, device, family)
    decode, encode = _vae_modes(cfg, family, device)
    # unknown names, bad options and malformed schedules fail before the (slow) model load
    backend = resolve_attention(cfg.attention_type)
    cache = parse_cache(cfg.cache)  # an unknown kind, key or value before anything else of the cache's
    # recorded in their own spellings from here: an alias (diffusers' or SGLang's name) as ours, the cache's one
    cfg = replace(cfg, attention_type=backend.name, cache=cache.name if cache else None)
    if cache is not None:  # the family's rules, diffusers' config checks and, on the denoisers built on the meta
        # device from their configs, whether diffusers applies it at all: all before the weights
        check_cache(cache, family, model.denoisers, compiled=cfg.compile, cfg_split=dctx.spec.use_cfg_parallel,
                    steps=cfg.num_inference_steps, pipeline_class=model.pipeline_class)
    _settle_parallel(cfg, dctx, device, model, backend, cache)
    # the head dims from the model's config (no weights; the loaded model is checked again): a backend that can't
    # serve them, or can't run on this device at all (sagev1 on a CPU), is refused here
    B.require_here(backend, device, dtype, model.head_dims or [])
    _check_output(cfg, family)
    return Plan(cfg, model, backend, device, dtype, vae_dtype, decode, encode, dctx, cache, cfg.flow_shift, *fused)


def _check_settings(cfg: RenderConfig) -> None:
    """What the settings refuse by themselves: a capture without its directory or under the compile, profiled steps
    beyond the profiled repetition, an unknown glue."""
    if (cfg.save_inputs or cfg.save_latents) and cfg.capture_dir is None:
        raise ValueError("capturing inputs or latents needs a capture directory")
    if cfg.save_inputs and cfg.compile:
        raise ValueError("--save_inputs runs eagerly (compiled graphs don't know which layer a call is); drop "
                         "the compile option for capture runs -- the captured Q/K/V are the same")
    steps_profiled = cfg.profile_wait + cfg.profile_warmup + cfg.profile_active
    if cfg.profile_output and steps_profiled > cfg.num_inference_steps:
        raise ValueError(f"--profile_wait + --profile_warmup + --profile_active = {steps_profiled} exceeds the "
                         f"{cfg.num_inference_steps} denoising steps of the profiled repetition")
    if cfg.vae_glue not in GLUES:
        raise ValueError(f"unknown --vae_glue {cfg.vae_glue!r}; valid: {', '.join(GLUES)}")


def _settle_parallel(cfg: RenderConfig, dctx, device: torch.device, model: pipelines.Model, backend, cache) -> None:
    """``--parallel_engine auto``: the engine that serves this request (every rank decides alike); the schedule's
    rules, and under torchrun the chosen engine's (the backend on its path, the compile), ``--guidance_overlap``
    settled like it, a CFG split refused where guidance runs one branch."""
    family, schedule = model.family, as_schedule(backend)
    grid_family = family.name if family.grid_hooks is not None else None

    def check_schedule(spec):  # the schedule's own rules on the engine spec names (a sparse pattern under xfuser)
        schedule.check_plan(num_steps=cfg.num_inference_steps, compiled=cfg.compile, parallel=spec,
                            grid_family=grid_family)

    P.settle_engine(dctx, device, P.engine_check(device, schedule.members, family, cfg.task, model.pipeline_class,
                                                 compiled=cfg.compile, check_schedule=check_schedule), family)
    P.settle_guidance_overlap(dctx, P.guidance_overlap_refusal(
        dctx.spec, family, guidance_scale=cfg.guidance_scale, cache=cache is not None, compiled=cfg.compile,
        sparse=any(b.sparse is not None for b in schedule.members), sharded=cfg.offload == "shard"))
    if dctx.spec.use_cfg_parallel and cfg.guidance_scale <= 1:
        raise ValueError(f"--use_cfg_parallel splits classifier-free guidance's two branches, and "
                         f"--guidance_scale {cfg.guidance_scale:g} runs none\ndrop --use_cfg_parallel, or "
                         "use a guidance scale above 1")


def _check_inputs(cfg: RenderConfig, model: pipelines.Model) -> None:
    """The conditioning image where the task needs one (and none where the family refuses it), the packages the
    pipeline calls without checking them."""
    family = model.family
    if cfg.image and cfg.task in family.image_refusals:
        raise ValueError(family.image_refusals[cfg.task])
    if cfg.task in family.image_tasks and not cfg.image:
        raise ValueError(f"task {cfg.task} needs --img_file_path (the image to animate)")
    for module, why in model.requirements:
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"task {cfg.task} needs the {module} package ({why})\npip install {module}")
    if cfg.image and not Path(cfg.image).is_file():
        raise ValueError(f"conditioning image {cfg.image} does not exist\ngive --img_file_path an image file")


def _check_output(cfg: RenderConfig, family: families.Family) -> None:
    """Never a file this tool did not write replaced, nor another render's video (its identity differs)."""
    if cfg.rank == 0 and not cfg.overwrite and cfg.output_path.exists():
        if not written_by_render(cfg.output_path, cfg.timing_path):
            raise ValueError(f"{cfg.output_path} exists and is not a video this tool wrote; not replacing it\n"
                             "move it away, choose another --benchmark_output_directory, or pass --overwrite")
        other = identity.replaced_render(asdict(cfg), cfg.output_path, cfg.timing_path, RenderConfig, family)
        if other is not None:
            raise ValueError(f"{cfg.output_path} holds another render's video (it differs in {other}); not "
                             "replacing it\nwrite to another path, or pass --overwrite")


def check_experts(cfg: RenderConfig, denoisers: Optional[dict], loaded: Optional[bool] = None) -> None:
    """``--boundary_ratio`` and ``--guidance_scale_2`` are for a pipeline of two experts (Wan 2.2 A14B): refused for
    one, where its configs (``denoisers``, before the load) or the loaded pipeline (``loaded``: whether it has a
    second expert) tell."""
    asked = [f for f, v in (("--boundary_ratio", cfg.boundary_ratio), ("--guidance_scale_2", cfg.guidance_scale_2))
             if v is not None]
    if cfg.boundary_ratio is not None and not 0 < cfg.boundary_ratio < 1:
        raise ValueError(f"--boundary_ratio {cfg.boundary_ratio:g} is outside (0, 1)\ngive the share of the "
                         "timesteps the high-noise expert runs, e.g. 0.875")
    two = loaded if loaded is not None else (None if denoisers is None else "transformer_2" in denoisers)
    if asked and two is False:
        raise ValueError(f"{' and '.join(asked)}: {cfg.model} has one denoiser; they apply to a model of two "
                         "experts (Wan 2.2 A14B)\ndrop the flag(s)")


def _vae_modes(cfg: RenderConfig, family: families.Family, device: torch.device) -> tuple[VaeMode, VaeMode]:
    """(decode, encode): the names become the modes' entries here, checked once with their options, refused before
    the load where they can't apply to this family or can't run here; every later stage takes the entries.
    ``--vae_glue`` is the fast encode's alone when only the encode is fast: which modes take the glue option is the
    modes' (their ``options``), not their names'; an unknown name takes none, and its check refuses it."""
    encode_takes_glue = cfg.vae_encode in ENCODE_MODES and "fused_glue" in ENCODE_MODES[cfg.vae_encode].options
    decode_takes_glue = cfg.vae_decode in DECODE_MODES and "fused_glue" in DECODE_MODES[cfg.vae_decode].options
    encode_glue = GLUES[cfg.vae_glue] if encode_takes_glue else None
    decode_glue = None if (encode_glue is not None and not decode_takes_glue) else GLUES[cfg.vae_glue]
    decode_options = DecodeOptions(max_memory_gib=cfg.vae_max_memory, fused_glue=decode_glue)
    encode_options = EncodeOptions(fused_glue=encode_glue)
    encode = check_encode(cfg.vae_encode, encode_options, family=family, device=device)
    decode = check_decode(cfg.vae_decode, decode_options, family=family, device=device)
    if not encode.stock and cfg.task not in family.image_tasks:
        raise ValueError(f"--vae_encode {cfg.vae_encode}: task {cfg.task} encodes no video (the image-conditioned "
                         f"task(s) {', '.join(family.image_tasks)} do); drop the flag")
    if not encode.stock and cfg.vae_tiling:
        raise ValueError(f"--vae_encode {cfg.vae_encode} does not tile; drop --vae_tiling or use --vae_encode default")
    return VaeMode(decode, decode_options), VaeMode(encode, encode_options)


def _fused_choice(setting: Optional[bool], flag: str, kernel: str, device: torch.device, compiled: bool,
                  family_lacks: Optional[str], inductor: str) -> Optional[str]:
    """Why one of the render's fused kernels (``--fused_rope``, ``--fused_block``: diffusers' values bit for bit) does
    not run, None where it does. ``auto`` runs it on CUDA where Triton can (:func:`vdbench.kernels.probe` of the
    registered ``kernel``), for a family with the code that calls it (``family_lacks``: why not, else None), except
    under torch.compile (``inductor``: what inductor fuses itself); ``on`` runs it there too, and on a CPU under
    Triton's interpreter (tests); ``on`` where it can't: ValueError with the reason (one line, then a hint)."""
    if setting is False:
        return f"off ({flag} off)"
    why = family_lacks or (f"compiled blocks ({inductor})" if compiled else None)
    if why is None and device.type != "cuda" and setting is None:
        why = f"a {device.type} device (the kernel runs on CUDA)"
    if why is None:
        ok, reason = probe(kernel, device)
        why = None if ok else reason
    if why is not None and setting is True:
        raise ValueError(f"{flag} on: not here: {why}\n{flag} auto uses it where it can")
    return why


def fused_rope_choice(cfg: RenderConfig, device: torch.device, family: families.Family) -> Optional[str]:
    """Why this render's RoPE is not fused (``--fused_rope``: :func:`vdbench.kernels.rope.rope_pairs`), None where
    it is (:func:`_fused_choice`): for a family with a processor of its own (``Family.self_attention``)."""
    return _fused_choice(cfg.fused_rope, "--fused_rope", "wan_rope", device, cfg.compile,
                         "the model family runs diffusers' own processor" if family.self_attention is None else None,
                         "inductor fuses the RoPE itself")


def fused_block_choice(cfg: RenderConfig, device: torch.device, family: families.Family) -> Optional[str]:
    """Why this render's blocks don't run their elementwise passes fused (``--fused_block``:
    :mod:`vdbench.kernels.block`), None where they do (:func:`_fused_choice`): for a family with a block forward of its
    own (``Family.block_forward``)."""
    return _fused_choice(cfg.fused_block, "--fused_block", "wan_block", device, cfg.compile,
                         "the model family runs diffusers' own block forward" if family.block_forward is None else None,
                         "inductor fuses the block's elementwise passes itself")
