"""The render's first stage: :func:`validate` -- every refusal that needs no weights (an unknown or unavailable backend,
a parallel path the backend or the family can't serve, a decode mode that doesn't apply, options that exclude each
other) before anything loads -- and the :class:`Plan` it returns: the configuration resolved once into the objects
every later stage takes instead of looking a name up again.

The checks run in a fixed order (:func:`checked_plan` reads as their list): first what the settings alone refuse,
then each thing as it is resolved, so that of two faults the same one is always said first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from .. import backends as B
from .. import families, identity, pipelines
from .. import parallel as P
from ..cache import check_cache, parse_cache
from ..kernels import fused_block_choice, fused_rope_choice
from ..measure.record import settings_speed_options, stack_name
from ..offload import check_offload
from ..patching.schedule import as_schedule, resolve_attention
from ..speed import check_speed_options
from ..vae.decode import GLUES, DecodeOptions, check_decode
from ..vae.decode import MODES as DECODE_MODES
from ..vae.encode import MODES as ENCODE_MODES
from ..vae.encode import EncodeOptions, check_encode
from .config import RenderConfig

__all__ = ["VaeMode", "Plan", "validate", "checked_plan", "DTYPES", "resolve_device", "resolve_dtype"]

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
    fp8_gemms: Optional[str] = None  # the fp8 GEMMs' scope, as speed.check_speed_options resolved it; None: off

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
    """The :class:`Plan` of ``cfg``, or the first refusal, in one pass: what the settings alone refuse, then each thing
    in turn as it is resolved, each checked by the module whose rule it is -- the device and dtypes, the speed options,
    the model (its inputs, its experts, the offload, the fused kernels), the VAE modes, the backend, the step cache,
    the parallel layout, the output file. The plan's ``cfg`` records the backend by its own name (an alias --
    diffusers' or SGLang's -- as ours) and the step cache in its one spelling."""
    _check_settings(cfg)
    device = dctx.device
    dtype = resolve_dtype(cfg.dtype, device)
    vae_dtype = dtype if cfg.vae_dtype in (None, "auto") else resolve_dtype(cfg.vae_dtype, device)
    fp8_scope = check_speed_options(device, compile=cfg.compile, compile_backend=cfg.compile_backend,
                                    compile_mode=cfg.compile_mode, fp8_gemms=cfg.fp8_gemms,
                                    inductor_tuning=cfg.inductor_tuning)
    # the render's one lookup of its family and one parse of its model string, its configs read (no weight): the
    # Model travels from here; an unknown variant is the load's refusal
    model = pipelines.resolve(cfg.model, cfg.task, cfg.family, image=bool(cfg.image))
    model.check_inputs(cfg.task, cfg.image)
    model.check_experts(cfg.boundary_ratio, cfg.guidance_scale_2)
    family = model.family
    if cfg.flow_shift is not None and family.flow_shift is None:
        raise ValueError(f"--flow_shift: the {family.name} pipelines' schedulers have no flow shift\ndrop the flag")
    check_offload(cfg.offload, device=device, parallel=dctx.distributed, compiled=cfg.compile,
                  two_experts=None if model.denoisers is None else "transformer_2" in model.denoisers,
                  fp8_gemms=bool(cfg.fp8_gemms), cache=bool(cfg.cache), cfg_split=dctx.spec.use_cfg_parallel)
    fused = (fused_rope_choice(cfg.fused_rope, device, family, cfg.compile),
             fused_block_choice(cfg.fused_block, device, family, cfg.compile))
    # the VAE modes: the names become the modes' entries here, checked once with their options, refused before the
    # load where they can't apply to this family or can't run here. --vae_glue is the fast encode's alone when only
    # the encode is fast: which modes take the glue option is the modes' (their ``options``), not their names'; an
    # unknown name takes none, and its check refuses it
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
    # unknown names, bad options and malformed schedules fail before the (slow) model load
    backend = resolve_attention(cfg.attention_type)
    schedule = as_schedule(backend)
    cache = parse_cache(cfg.cache)  # an unknown kind, key or value before anything else of the cache's
    # recorded in their own spellings from here: an alias (diffusers' or SGLang's name) as ours, the cache's one
    cfg = replace(cfg, attention_type=backend.name, cache=cache.name if cache else None)
    if cache is not None:  # the family's rules, diffusers' config checks and, on the denoisers built on the meta
        # device from their configs, whether diffusers applies it at all: all before the weights
        check_cache(cache, family, model.denoisers, compiled=cfg.compile, cfg_split=dctx.spec.use_cfg_parallel,
                    steps=cfg.num_inference_steps, pipeline_class=model.pipeline_class)
    P.settle(dctx, device, schedule, family, cfg.task, model.pipeline_class, compiled=cfg.compile,
             num_steps=cfg.num_inference_steps, guidance_scale=cfg.guidance_scale, cache=cache is not None,
             sharded=cfg.offload == "shard")
    # the head dims from the model's config (no weights; the loaded model is checked again): a backend that can't
    # serve them, or can't run on this device at all (sagev1 on a CPU), is refused here
    B.require_here(backend, device, dtype, model.head_dims or [])
    if cfg.rank == 0:  # never a file this tool did not write replaced, nor another render's video
        identity.check_output(asdict(cfg), cfg.output_path, cfg.timing_path, RenderConfig, family,
                              overwrite=cfg.overwrite)
    return Plan(cfg, model, backend, device, dtype, vae_dtype, VaeMode(decode, decode_options),
                VaeMode(encode, encode_options), dctx, cache, cfg.flow_shift, *fused, fp8_gemms=fp8_scope)


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
