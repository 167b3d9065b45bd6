"""Render one video with one attention backend, timed: the shared body of run_wan.py and sageattn_cogvideo.py.

Four stages, each a function with one job, so a refusal can never come after work it could have spared:

* :func:`validate` -- every refusal that needs no weights (unknown or unavailable backend, a parallel path the
  backend or the family can't serve, a decode mode that doesn't apply, options that exclude each other) before
  anything loads; returns a :class:`Plan`: the configuration resolved once (the backend or schedule, the family,
  the parsed model, the decode and encode modes with their options, device and dtypes, the scheduler's flow shift,
  the parallel layout), the objects every later stage takes instead of looking a name up again.
* :func:`load` -- the pipeline (real id, local path, tiny or random-weight model), its size and head-dim checks,
  the parallel engine, the speed options; returns a :class:`Loaded`.
* :func:`run_repetitions` -- per repetition: denoise with ``output_type="latent"`` (per-step times from events at
  each step boundary; the encoders before the first step timed by hooks, :mod:`vdbench.stages`), decode with the
  VAE timed on its own, count calls per kernel.
* :func:`finish` -- rank 0 writes the video of the last repetition (atomically) and appends the repetitions to
  ``timing.json``, the first with the render's end-to-end time (the process's start to the video on disk, broken
  into stages: :func:`vdbench.stages.end_to_end`) and each with its one-time costs (:func:`vdbench.stages.one_time`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from . import backends as B
from . import families, identity, pipelines
from .offload import HOST_COMPONENTS, apply_offload, check_offload, expert_swap
from .patching import AttentionPatch
from .patching.schedule import as_schedule, resolve_attention
from .measure.record import Writer, command_line, commit, from_render_entry, settings_speed_options, stack_name
from .power import open_trace
from .stages import Wall, stage_reports
from .timing import (Clock, Laps, StepProfiler, StepTimer, WallStart, append_timing, compile_seconds, describe_steps,
                     device_seconds, gpu_uuid, memory_stage, reset_peak_memory, run_step_stats, step_stats,
                     system_info, wall_start)

__all__ = ["RenderConfig", "Plan", "VaeMode", "Loaded", "render", "validate", "load", "run_repetitions", "finish",
           "resolve_device", "resolve_dtype", "VAEHang"]


class VAEHang(RuntimeError):
    """The VAE decode (or encode) ran past --vae_timeout (the watchdog dumped every thread's stack)."""

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


@dataclass
class RenderConfig:
    family: str  # a vdbench.families name: "wan" | "cogvideox"
    task: str
    model: str
    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    attention_type: str
    output_path: Path
    timing_path: Path
    image: Optional[str] = None
    num_repetitions: int = 1
    device: str = "auto"
    dtype: str = "auto"
    fps: int = 16
    on_unsupported: str = "error"
    time_attention: bool = False
    capture_dir: Optional[Path] = None  # where captures go (see vdbench.capture)
    save_inputs: bool = False  # save Q/K/V of attention calls into capture_dir
    max_captures: int = 0  # 0 = every call
    save_latents: bool = False  # save the latents before VAE decode into capture_dir
    save_frames: bool = False  # also save the raw uint8 frames (.npy beside the video): codec-free comparisons
    rank: int = 0
    warmup_calls: int = 0  # untimed pipeline calls before the timed repetitions (compilation, caches, plans)
    vae_dtype: str = "auto"  # "auto": the pipeline dtype
    flow_shift: Optional[float] = None  # None = the family's default for the model and size (Family.flow_shift)
    boundary_ratio: Optional[float] = None  # two experts: where the low-noise one takes over; None: the model's
    guidance_scale_2: Optional[float] = None  # two experts: the low-noise one's guidance; None: guidance_scale
    profile_output: Optional[str] = None  # torch profiler Chrome traces under <traces_root>/<name>/
    traces_root: Optional[Path] = None
    profile_wait: int = 0
    profile_warmup: int = 1
    profile_active: int = 2
    power_interval_ms: float = 10.0  # the card's energy, clock and power cap sampled per step (vdbench.power); 0 off
    offload: str = "none"  # where weights wait off the GPU: none | model | group | expert (vdbench.offload)
    vae_tiling: bool = False
    vae_slicing: bool = False
    compile: bool = False  # regional torch.compile of the transformer blocks (vdbench.speed)
    compile_backend: str = "inductor"
    compile_mode: Optional[str] = None
    bf16_te_gemms: bool = False  # text encoder in bfloat16 whatever the pipeline dtype
    # torchao float8 GEMMs in the transformer blocks, the scope (vdbench.speed.FP8_GEMM_SCOPES): "all" or "ffn"; None:
    # off (True, as older records say, reads as "all": measure.record.fp8_gemm_scope)
    fp8_gemms: Union[bool, str, None] = None
    inductor_tuning: str = "auto"  # inductor's coordinate-descent tuning: auto | on | off (vdbench.speed.INDUCTOR_TUNING)
    cache: Optional[str] = None  # diffusers' step cache, KIND[:key=value,...] (vdbench.cache); None: none
    vae_decode: str = "default"  # default | fast | parallel (vdbench.vae.decode.MODES)
    vae_encode: str = "default"  # default | fast: the image-conditioned tasks' encode (vdbench.vae.encode.MODES)
    vae_max_memory: Optional[float] = None  # GiB: chunk/tile size chosen from it
    vae_timeout: Optional[float] = None  # seconds: a decode (or encode) running longer is reported as hung (watchdog)
    vae_glue: str = "auto"  # auto | triton | eager: the fast decode's (and encode's) glue (vdbench.vae.decode.GLUES)
    vae_prewarm: bool = True  # compile the fast VAE path's kernels on a thread while the GPU denoises (vdbench.vae.prewarm)
    attention_prewarm: bool = True  # the backend's first-call kernels compiled during the load (backends.prewarm)
    scheduler_prewarm: bool = True  # the scheduler's first-call costs paid in the load (pipelines.prewarm_scheduler)
    scheduler_async: bool = True  # the scheduler's steps never wait for the device (pipelines.run_scheduler_ahead)
    extra_pipe_kwargs: dict = field(default_factory=dict)
    # multi-process (torchrun): see vdbench.parallel
    parallel_engine: str = "auto"  # xfuser | diffusers | auto (the engine that serves the request: vdbench.parallel)
    ulysses_degree: int = 1
    ring_degree: int = 1
    use_cfg_parallel: bool = False
    ulysses_overlap: int = 1  # head chunks of the overlapped Ulysses attention (vdbench.patching.ulysses)
    ulysses_async: Optional[bool] = None  # Q, K, V sent beside the projections (Family.ulysses_self_attention); None: auto
    fused_rope: Optional[bool] = None  # Q and K's RoPE in one kernel (vdbench.kernels.rope); None: auto
    fused_block: Optional[bool] = None  # the blocks' modulations, residuals fused (vdbench.kernels.block); None: auto
    guidance_overlap: Optional[bool] = None  # both guidance branches interleaved on every rank; None: auto
    ulysses_fp8_exchange: bool = False  # V and the output exchanged as e4m3 rows with scales (Fp8Exchange)
    ulysses_v_per_rank: bool = True  # the async exchange's V projected per destination (UlyssesExchange)
    overwrite: bool = False  # replace an existing output file this tool did not write


def _load_image(path: str, width: int, height: int):
    """Center-crop to the target aspect ratio, then resize: the conditioning image gets the video's size."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    w, h = img.size
    target = width / height
    if w / h > target:
        nw = round(h * target)
        img = img.crop(((w - nw) // 2, 0, (w - nw) // 2 + nw, h))
    elif w / h < target:
        nh = round(w / target)
        img = img.crop((0, (h - nh) // 2, w, (h - nh) // 2 + nh))
    return img.resize((width, height), Image.BICUBIC)


class _Progress:
    """A plain line per denoising step (``[sdpa] step 3/50 (rep 1/2): 12.4 s, ETA 3:10``) for a log that is not a
    terminal, where the progress bars are off: a batch run's logs (and the render-all scripts' screen) show the
    render moving. Host-clock progress only; the step times themselves are the events of StepTimer."""

    def __init__(self, name: str, steps: int, reps: int, log, enabled: bool):
        self.name, self.steps, self.reps, self.log, self.enabled = name, steps, reps, log, enabled
        self.rep, self.t0, self.first = 0, 0.0, None

    def begin(self, rep: int) -> None:
        self.rep, self.t0 = rep, time.monotonic()
        if self.first is None:
            self.first = self.t0

    def step(self, step: int) -> None:
        if not self.enabled or self.first is None:  # the untimed warm-up calls print no progress
            return
        now = time.monotonic()
        done = self.rep * self.steps + step + 1
        left = self.reps * self.steps - done
        eta = (now - self.first) / done * left
        rep = f" (rep {self.rep + 1}/{self.reps})" if self.reps > 1 else ""
        self.log(f"[{self.name}] step {step + 1}/{self.steps}{rep}: {now - self.t0:.1f} s, ETA "
                 f"{int(eta) // 60}:{int(eta) % 60:02d}")
        sys.stdout.flush()


def render(cfg: RenderConfig, log=print, exit_code_of=None, started: Optional[WallStart] = None) -> dict:
    """Run the render described by ``cfg``; returns the summary dict (also appended to timing.json).

    ``started``: what ``end_to_end_s`` counts from (:func:`vdbench.timing.wall_start`: the CLIs pass the process's
    start); by default this call.

    Under torchrun with a parallel degree (``cfg.ulysses_degree`` / ``ring_degree``) every rank renders its
    share through the chosen engine (vdbench.parallel); rank 0 alone writes the video and the merged timing.
    ``exit_code_of(exception)``: the exit code an error means (the CLI's mapping), which a rank stopped by
    torchrun on its way out still exits with.
    """
    from . import parallel as P

    started = started if started is not None else wall_start(from_process=False)
    spec = P.ParallelSpec(cfg.parallel_engine, cfg.ulysses_degree, cfg.ring_degree, cfg.use_cfg_parallel,
                          head_chunks=cfg.ulysses_overlap, async_exchange=cfg.ulysses_async,
                          guidance_overlap=cfg.guidance_overlap, fp8_exchange=cfg.ulysses_fp8_exchange,
                          v_per_rank=cfg.ulysses_v_per_rank)
    dctx = P.init_distributed(spec, cfg.device)
    if dctx is None:
        return _stages(cfg, log, None, started)
    watch = P.FailureWatch(dctx)
    try:
        P.maybe_inject_failure(dctx.rank, "start", B.canonical_name(cfg.attention_type))
        out = _stages(replace(cfg, rank=dctx.rank), log if dctx.is_main else (lambda *a, **k: None), dctx, started)
    except BaseException as e:
        P.finish(dctx, watch, e, exit_code_of(e) if exit_code_of is not None else 1)
        raise
    P.finish(dctx, watch, None)
    return out


def _stages(cfg: RenderConfig, log, dctx, started: Optional[WallStart] = None) -> dict:
    started = started if started is not None else wall_start(from_process=False)
    plan = validate(cfg, dctx)
    load_start = time.perf_counter()
    loaded = load(plan)
    entries, frames = run_repetitions(plan, loaded, log)
    return finish(plan, entries, frames, log, wall=Wall(started, load_start, loaded.load_s))


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
    the device and dtypes, the decode and encode modes with their options, the torchrun context and its parallel
    layout (:class:`vdbench.parallel.ParallelSpec`, None for one process)."""

    cfg: RenderConfig
    model: pipelines.Model
    backend: B.Backend
    device: torch.device
    dtype: torch.dtype
    vae_dtype: torch.dtype
    decode: VaeMode
    encode: VaeMode
    dctx: object = None
    cache: object = None  # vdbench.cache.CacheSpec, or None
    flow_shift: Optional[float] = None  # --flow_shift; None: the model's default, read with the load
    fused_rope: Optional[str] = "not decided"  # why the RoPE is not fused (fused_rope_choice); None: it is
    fused_block: Optional[str] = "not decided"  # why the blocks' passes aren't fused (fused_block_choice); None: are

    @property
    def stack(self) -> str:
        """The render's stack name (:func:`vdbench.measure.record.stack_name`): the backend or schedule, the speed
        options, the VAE modes other than default, the step cache -- recorded with every entry (``stack``)."""
        cfg = self.cfg
        return stack_name(self.backend.name, settings_speed_options(asdict(cfg)),
                          self.decode.mode.name, self.encode.mode.name, self.cache.name if self.cache else None,
                          self.dctx.spec.tag if self.dctx is not None else "")

    @property
    def family(self) -> families.Family:
        """The model's family (:attr:`vdbench.pipelines.Model.family`)."""
        return self.model.family

    @property
    def parallel(self):
        """The parallel layout (:class:`vdbench.parallel.ParallelSpec`) under torchrun; None for one process."""
        return self.dctx.spec if self.dctx is not None else None

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
    on whichever rank; a single process raises the refusal itself."""
    from . import parallel as P

    plan, err = None, None
    try:
        plan = _checked_plan(cfg, dctx)
    except Exception as e:  # noqa: BLE001 - handed to every rank by agree() and raised there
        err = e
    P.agree(dctx, err)
    return plan


def _checked_plan(cfg: RenderConfig, dctx) -> Plan:
    from . import parallel as P
    from .vae.decode import GLUES, DecodeOptions, check_decode
    from .vae.decode import MODES as DECODE_MODES
    from .vae.encode import MODES as ENCODE_MODES
    from .vae.encode import EncodeOptions, check_encode
    from .cache import check_cache, parse_cache
    from .speed import check_speed_options
    from .video import written_by_render

    device = dctx.device if dctx is not None else resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    check_speed_options(device, compile=cfg.compile, compile_backend=cfg.compile_backend,
                        compile_mode=cfg.compile_mode, fp8_gemms=cfg.fp8_gemms, inductor_tuning=cfg.inductor_tuning)
    # the render's one lookup of its family and one parse of its model string, its configs read (no weight): the
    # Model travels from here; an unknown variant is the load's refusal
    model = pipelines.resolve(cfg.model, cfg.task, cfg.family, image=bool(cfg.image))
    family = model.family
    # unknown names, bad options and malformed schedules fail before the (slow) model load
    backend = resolve_attention(cfg.attention_type)
    cfg = replace(cfg, attention_type=backend.name)  # an alias (diffusers' / SGLang's name) is recorded as ours
    # --parallel_engine auto: the engine that serves this request (every rank decides alike); the schedule's rules,
    # and under torchrun the chosen engine's: the backend on its path, the compile
    schedule = as_schedule(backend)
    grid_family = family.name if family.grid_hooks is not None else None

    def check_schedule(spec):  # the schedule's own rules on the engine spec names (a sparse pattern under xfuser)
        schedule.check_plan(num_steps=cfg.num_inference_steps, compiled=cfg.compile, parallel=spec,
                            grid_family=grid_family)

    P.settle_engine(dctx, device, P.engine_check(device, schedule.members, family, cfg.task, model.pipeline_class,
                                                 compiled=cfg.compile, check_schedule=check_schedule), family)
    cache = parse_cache(cfg.cache)  # an unknown kind, key or value before anything else of the cache's
    cfg = replace(cfg, cache=cache.name if cache else None)  # recorded in its one spelling
    # the family's rules, diffusers' config checks and, on the denoisers built on the meta device from their
    # configs, whether diffusers applies it at all: all before the weights
    if cache is not None:
        check_cache(cache, family, model.denoisers, compiled=cfg.compile,
                    cfg_split=dctx is not None and dctx.spec.use_cfg_parallel,
                    steps=cfg.num_inference_steps, pipeline_class=model.pipeline_class)
    if dctx is not None:  # --guidance_overlap: where it applies to this request, settled like the engine
        P.settle_guidance_overlap(dctx, P.guidance_overlap_refusal(
            dctx.spec, family, guidance_scale=cfg.guidance_scale, cache=cache is not None, compiled=cfg.compile,
            sparse=any(b.sparse is not None for b in schedule.members)))
    if dctx is not None and dctx.spec.use_cfg_parallel and cfg.guidance_scale <= 1:
        raise ValueError(f"--use_cfg_parallel splits classifier-free guidance's two branches, and "
                         f"--guidance_scale {cfg.guidance_scale:g} runs none\ndrop --use_cfg_parallel, or "
                         "use a guidance scale above 1")
    # the head dims from the model's config (no weights; the loaded model is checked again): a backend that can't
    # serve them, or can't run on this device at all (sagev1 on a CPU), is refused here
    B.require_here(backend, device, dtype, model.head_dims or [])
    if cfg.image and cfg.task in family.image_refusals:
        raise ValueError(family.image_refusals[cfg.task])
    if cfg.task in family.image_tasks and not cfg.image:
        raise ValueError(f"task {cfg.task} needs --img_file_path (the image to animate)")
    for module, why in model.requirements:
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"task {cfg.task} needs the {module} package ({why})\npip install {module}")
    if cfg.image and not Path(cfg.image).is_file():
        raise ValueError(f"conditioning image {cfg.image} does not exist\ngive --img_file_path an image file")
    if cfg.rank == 0 and not cfg.overwrite and cfg.output_path.exists():
        if not written_by_render(cfg.output_path, cfg.timing_path):
            raise ValueError(f"{cfg.output_path} exists and is not a video this tool wrote; not replacing it\n"
                             "move it away, choose another --benchmark_output_directory, or pass --overwrite")
        other = identity.replaced_render(asdict(cfg), cfg.output_path, cfg.timing_path, RenderConfig, family)
        if other is not None:
            raise ValueError(f"{cfg.output_path} holds another render's video (it differs in {other}); not "
                             "replacing it\nwrite to another path, or pass --overwrite")
    _check_experts(cfg, model.denoisers)
    if (cfg.save_inputs or cfg.save_latents) and cfg.capture_dir is None:
        raise ValueError("capturing inputs or latents needs a capture directory")
    if cfg.save_inputs and cfg.compile:
        raise ValueError("--save_inputs runs eagerly (compiled graphs don't know which layer a call is); drop "
                         "the compile option for capture runs -- the captured Q/K/V are the same")
    if cfg.vae_glue not in GLUES:
        raise ValueError(f"unknown --vae_glue {cfg.vae_glue!r}; valid: {', '.join(GLUES)}")
    # the decode and encode asked for, refused before the load where they can't apply to this family or can't run
    # here; --vae_glue is the fast encode's alone when only the encode is fast
    # which modes take the glue option is the modes' (their ``options``), not their names'; an unknown name takes
    # none, and its check refuses it
    # the names become the modes' entries here, checked once with their options; every later stage takes the entries
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
    vae_dtype = dtype if cfg.vae_dtype in (None, "auto") else resolve_dtype(cfg.vae_dtype, device)
    check_offload(cfg.offload, device=device, parallel=dctx is not None, compiled=cfg.compile,
                  two_experts=None if model.denoisers is None else "transformer_2" in model.denoisers)
    if cfg.flow_shift is not None and family.flow_shift is None:
        raise ValueError(f"--flow_shift: the {family.name} pipelines' schedulers have no flow shift\ndrop the flag")
    steps_profiled = cfg.profile_wait + cfg.profile_warmup + cfg.profile_active
    if cfg.profile_output and steps_profiled > cfg.num_inference_steps:
        raise ValueError(f"--profile_wait + --profile_warmup + --profile_active = {steps_profiled} exceeds the "
                         f"{cfg.num_inference_steps} denoising steps of the profiled repetition")
    return Plan(cfg, model, backend, device, dtype, vae_dtype, VaeMode(decode, decode_options),
                VaeMode(encode, encode_options), dctx, cache, cfg.flow_shift, fused_rope_choice(cfg, device, family),
                fused_block_choice(cfg, device, family))


def _check_experts(cfg: RenderConfig, denoisers: Optional[dict], loaded: Optional[bool] = None) -> None:
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


def _fused_choice(setting: Optional[bool], flag: str, kernel: str, device: torch.device, compiled: bool,
                  family_lacks: Optional[str], inductor: str) -> Optional[str]:
    """Why one of the render's fused kernels (``--fused_rope``, ``--fused_block``: diffusers' values bit for bit) does
    not run, None where it does. ``auto`` runs it on CUDA where Triton can (:func:`vdbench.kernels.probe` of the
    registered ``kernel``), for a family with the code that calls it (``family_lacks``: why not, else None), except
    under torch.compile (``inductor``: what inductor fuses itself); ``on`` runs it there too, and on a CPU under
    Triton's interpreter (tests); ``on`` where it can't: ValueError with the reason (one line, then a hint)."""
    from .kernels import probe

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


@dataclass
class Loaded:
    """What :func:`load` made: the pipeline (parallel and sped up as asked), its denoisers, the call's keyword
    arguments and the run's header (settings, resolved values, backend, model, system) recorded with every entry."""

    pipe: object
    models: list
    kwargs: dict
    header: dict
    load_s: Optional[float] = None  # the whole load stage (weights, checks, engine, speed options), host clock
    prewarm: object = None  # vdbench.vae.prewarm.Prewarm started for this render (_start_prewarm), or None
    cache: object = None  # vdbench.cache.CacheCounter of the step cache applied, or None
    # vdbench.backends.prewarm.Prewarm started for this render (_start_attention_prewarm), or None; where a backend
    # has a prewarm that did not start, why (recorded as the first entry's attention_prewarm)
    attention_prewarm: object = None
    attention_prewarm_skipped: Optional[dict] = None
    rope_prewarm: object = None  # _KernelPrewarm of the fused RoPE started for this render (--fused_rope), or None
    block_prewarm: object = None  # _KernelPrewarm of the fused block's kernels (--fused_block), or None
    memory: Optional[dict] = None  # the load stage's allocated and reserved peaks (vdbench.timing.memory_stage)


def _start_prewarm(plan: Plan, pipe=None, *, encode_only: bool = False):
    """The fast VAE path's first-call compiles started on a thread (:mod:`vdbench.vae.prewarm`), on a meta-device VAE
    built from the model's VAE config; None where there is nothing to compile ahead, ``--no_vae_prewarm``, or
    (``encode_only``) the prewarm has no encode part. ``pipe``: the loaded pipeline, whose VAE's config serves where
    the model's could not be read before the load (a hub id downloaded by it).

    When: the compile holds the GIL for tens of ms at a time, so beside the load's Python (random-weight init,
    module building) it slows the load by about its own length (an H200's Wan 1.3B renders: load 11.2 s without,
    12.1-15.7 s with it on the load); beside the denoising, whose thread mostly waits on the GPU, it costs
    nothing. So the render starts it when the load ends -- except an image-to-video encode part, which runs before
    the denoising: only the load can hide that one (``encode_only`` at the load's start)."""
    from .vae import prewarm as W

    cfg, device = plan.cfg, plan.device
    if not cfg.vae_prewarm or device.type != "cuda" or cfg.offload != "none" or cfg.vae_tiling:
        return None
    image = plan.model.image
    if encode_only and not image:
        return None
    spec = plan.model.vae if pipe is None else (type(pipe.vae).__name__, dict(pipe.vae.config))
    if spec is None:
        return None
    p = W.plan(vae_class=spec[0], device=device, decode_mode=plan.decode.mode, decode_options=plan.decode.options,
               encode_mode=plan.encode.mode if image else None, encode_options=plan.encode.options,
               pixel_hw=(cfg.height, cfg.width), first_use=not cfg.compile)
    if encode_only and (p is None or p.encode is None):
        return None
    dtype = plan.vae_dtype or plan.dtype
    return W.start_thread(lambda: W.meta_vae(spec[0], spec[1]).to(dtype), p)


def _attention_calls(plan: Plan, pipe=None) -> tuple[Optional[list], str]:
    """(the distinct attention call shapes of this render -- :class:`vdbench.backends.CallShape`, from its family's
    ``attention_calls`` over every denoiser's config --, or None and why not). ``pipe``: the loaded pipeline, whose
    components' configs serve where the model's could not be read before the load."""
    cfg, family, model = plan.cfg, plan.family, plan.model
    if family.attention_calls is None:
        return None, f"family {family.name!r} does not give its attention call shapes (Family.attention_calls)"
    if pipe is not None:
        from .pipelines import transformers_of

        denoisers = [dict(m.config) for _, m in transformers_of(pipe)]
        vae = dict(pipe.vae.config)
    elif model.denoisers and model.vae:
        denoisers, vae = [c for _, c in model.denoisers.values()], model.vae[1]
    else:
        return None, "the model's configs are read with the load"
    calls = []
    for den in denoisers:
        calls += family.attention_calls(den, vae, cfg.height, cfg.width, cfg.num_frames, cfg.guidance_scale,
                                        dict(cfg.extra_pipe_kwargs))
    return [B.CallShape(*c) for c in dict.fromkeys(calls)], ""


def _start_attention_prewarm(plan: Plan, pipe=None) -> tuple[object, Optional[dict]]:
    """(the attention prewarm started for this render -- :mod:`vdbench.backends.prewarm`: the first-call kernels of
    every backend it runs that has a ``prewarm``, compiled for its call shapes --, or None and, where such a backend
    runs, the record of why it did not start). ``pipe``: see :func:`_attention_calls`."""
    from .backends import prewarm as AP

    entries = [b for b in as_schedule(plan.backend).members if b.prewarm is not None]
    if not entries:  # nothing to compile ahead: nothing recorded
        return None, None
    names = [b.name for b in entries]
    if not plan.cfg.attention_prewarm:
        return None, {"status": "off", "backends": names, "why": "--attention_prewarm off"}
    if plan.dctx is not None:
        return None, {"status": "skipped", "backends": names,
                      "why": "under torchrun each rank's call shapes follow the parallel split: the first calls "
                             "compile their own kernels"}
    try:
        calls, why = _attention_calls(plan, pipe)
    except Exception as e:  # noqa: BLE001 - a config the family's rule can't read: recorded and said, never raised
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, {"status": "failed", "backends": names,
                      "error": f"the call shapes: {type(e).__name__}{': ' + first if first else ''}"}
    if calls is None:
        return None, {"status": "skipped", "backends": names, "why": why}
    return AP.start(entries, calls, plan.device, plan.dtype), None


def _load_checked(plan: Plan, laps: Laps) -> tuple:
    """(pipeline, its denoisers, load time, its schedule): loaded, its scheduler's shift and experts' boundary set
    (:func:`vdbench.pipelines.set_schedule`), its exact size rules
    and the backend against its head dims checked; ``laps``: the load's parts, the loading's own
    (:meth:`vdbench.pipelines.Model.load`) among them."""
    from .pipelines import set_schedule, transformers_of

    cfg, model, device = plan.cfg, plan.model, plan.device
    t_load = time.perf_counter()
    on_host = cfg.offload in ("model", "group")  # loaded on the host; the offload places what runs
    pipe = model.load(dtype=plan.dtype, device="cpu" if on_host else device, vae_dtype=plan.vae_dtype,
                      timings=laps.parts, host=HOST_COMPONENTS.get(cfg.offload, ()))
    if cfg.vae_tiling:
        pipe.vae.enable_tiling()
    if cfg.vae_slicing:
        pipe.vae.enable_slicing()
    load_time = time.perf_counter() - t_load
    laps.lap("pipeline_other")  # outside the parts the load names
    model.check_size(pipe, cfg.height, cfg.width, cfg.num_frames)
    models = transformers_of(pipe)
    _check_experts(cfg, None, loaded=getattr(pipe, "transformer_2", None) is not None)
    schedule = set_schedule(pipe, plan.family, cfg.task, cfg.height, cfg.width, flow_shift=plan.flow_shift,
                            boundary_ratio=cfg.boundary_ratio, guidance_scale=cfg.guidance_scale,
                            guidance_scale_2=cfg.guidance_scale_2)
    schedule["offload"] = apply_offload(cfg.offload, pipe, device)  # the boundary set: the expert swap reads it
    pipe.set_progress_bar_config(disable=not sys.stderr.isatty(), leave=False)
    laps.lap("size_checks")
    # the backend's availability here (its package imported, the device queried)
    B.require_here(plan.backend, device, plan.dtype, [m.config.attention_head_dim for _, m in models])
    laps.lap("preflight")
    return pipe, models, load_time, schedule


def load(plan: Plan) -> Loaded:
    """Load the pipeline and check what only the loaded model can tell (its exact size rules, its head dims)."""
    from . import parallel as P
    from .pipelines import ModelLoadError, model_summary, prewarm_scheduler, run_scheduler_ahead, \
        run_scheduler_blocking
    from .speed import apply_speed_options

    cfg, family, device, dctx = plan.cfg, plan.family, plan.device, plan.dctx
    t0 = time.perf_counter()
    err = pipe = models = load_time = schedule = None
    laps = Laps({})  # where the load's time goes (host clock): its variation is read here, not guessed
    part = laps.lap
    prewarm = _start_prewarm(plan, encode_only=True)  # an image's encode comes before the denoising: hide it here
    # the attention backend's first-call kernels: its first call comes right after the load and the text encode, so
    # only the load can hide them (compiled by a worker process: no GIL taken from the load)
    attn_prewarm, attn_skipped = _start_attention_prewarm(plan)
    part("prewarm_start")
    try:  # what only the files or the loaded model can refuse is agreed like validate's refusals (torchrun)
        pipe, models, load_time, schedule = _load_checked(plan, laps)
    except (ModelLoadError, B.BackendUnavailable, ValueError, OSError) as e:
        err = e
    if err is not None and attn_prewarm is not None:
        attn_prewarm.close()
    P.agree(dctx, err)  # single process: raises err itself
    part("agree")  # the ranks agreeing on the outcome (torchrun)
    # the fused RoPE's kernel, ready before the first step: from here the load's remaining parts (the parallel
    # engine's set-up, the collectives' warm-up, the speed options) and the text encode mostly wait on the GPU
    rope_prewarm = _start_rope_prewarm(plan, pipe)
    block_prewarm = _start_block_prewarm(plan, pipe)
    head_dims = [m.config.attention_head_dim for _, m in models]

    def sped_up(pipe, models) -> tuple:
        """(the speed options' record, the step cache's counter or None): both applied to the pipeline as it runs."""
        speed = apply_speed_options(pipe, models, device=device, compile=cfg.compile,
                                    compile_backend=cfg.compile_backend, compile_mode=cfg.compile_mode,
                                    bf16_te_gemms=cfg.bf16_te_gemms, fp8_gemms=cfg.fp8_gemms,
                                    inductor_tuning=cfg.inductor_tuning)
        part("speed_options")
        if plan.cache is None:
            return speed, None
        from .cache import apply_cache

        # beside the speed options: diffusers' hooks on every denoiser, counted
        shares = dctx is not None and P.shares_calls(dctx, family.guidance_in_one_batch)
        counter = apply_cache(plan.cache, pipe, models, steps=cfg.num_inference_steps, family=family,
                              group=(lambda: P.shard_group(dctx)) if shares else None)
        speed["cache"] = {**plan.cache.as_dict(), "units": len(counter.units)}
        part("cache")
        return speed, counter

    # an engine that hooks the denoisers in place (diffusers' context parallelism) goes on last: its split and
    # gather hooks wrap the compiled blocks and the cache's hooks, which then see the shard each rank computes; an
    # engine that rebuilds the pipeline (xfuser) goes first, and the speed options and cache apply to what it built
    engine_last = dctx is not None and P.hooks_in_place(dctx.spec)
    if engine_last:
        speed, counter = sped_up(pipe, models)
    if dctx is not None:
        pipe, models = P.apply_engine(dctx, pipe, models, family)
        part("engine")
    if not engine_last:
        speed, counter = sped_up(pipe, models)
    split = P.guidance_split(dctx, pipe) if counter is not None and dctx is not None else None
    if split is not None:  # the cache's counts are of what this rank computed: one guidance branch per step
        counter.split_guidance(*split)

    backend = plan.backend
    header = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "resolved": {"device": str(device), "dtype": str(plan.dtype).replace("torch.", ""), "head_dims": head_dims,
                     "vae_dtype": str(pipe.vae.dtype).replace("torch.", ""), "flow_shift": schedule["flow_shift"],
                     "schedule": {k: v for k, v in schedule.items() if k != "offload"},
                     "offload": schedule["offload"],
                     "speed_options": speed},
        "backend": {"name": backend.name, "kernel": backend.kernel, "emulated": backend.emulated,
                    "exact": backend.exact, "description": backend.description},
        "model": model_summary(pipe),
        "system": system_info(device),
        "load_time": load_time,
        "command": command_line(),
        "commit": commit(),
    }
    # the pipeline call's arguments, the conditioning image read and sized
    kwargs = dict(prompt=cfg.prompt, negative_prompt=cfg.negative_prompt, height=cfg.height, width=cfg.width,
                  num_frames=cfg.num_frames, num_inference_steps=cfg.num_inference_steps,
                  guidance_scale=cfg.guidance_scale, output_type="latent", **cfg.extra_pipe_kwargs)
    if cfg.guidance_scale_2 is not None:
        kwargs["guidance_scale_2"] = cfg.guidance_scale_2
    if plan.model.image:
        kwargs["image"] = _load_image(cfg.image, cfg.width, cfg.height)
    part("header")
    # the scheduler's first-call costs (cuSOLVER's load at a multistep solver's third step) paid here, not in a step
    if not cfg.scheduler_prewarm:
        header["resolved"]["scheduler_prewarm"] = {"status": "skipped", "why": "--scheduler_prewarm off"}
    elif device.type != "cuda":
        header["resolved"]["scheduler_prewarm"] = {"status": "skipped", "why": "not a CUDA device"}
    else:
        header["resolved"]["scheduler_prewarm"] = prewarm_scheduler(pipe.scheduler, cfg.num_inference_steps, device,
                                                                    plan.dtype)
    part("scheduler_prewarm")
    # after the prewarm (whose dry run copies the scheduler): no step of the render waits for the device
    if not cfg.scheduler_async or device.type != "cuda":
        run_scheduler_blocking(pipe.scheduler)  # a pipeline loaded once keeps what an earlier render set
        header["resolved"]["scheduler_async"] = {
            "status": "skipped", "why": "--scheduler_async off" if not cfg.scheduler_async else "not a CUDA device"}
    else:
        header["resolved"]["scheduler_async"] = run_scheduler_ahead(pipe.scheduler)
    if device.type == "cuda":  # the load's last copies and quantization kernels are the load's time
        torch.cuda.synchronize(device)
    part("sync")
    load_s = time.perf_counter() - t0
    header["load_parts"] = {k: round(v, 4) for k, v in laps.parts.items()}
    if prewarm is None:  # under the text encode and the denoising, where the main thread waits on the GPU
        prewarm = _start_prewarm(plan, pipe)
    if attn_skipped is not None and attn_skipped.get("why") == "the model's configs are read with the load":
        attn_prewarm, attn_skipped = _start_attention_prewarm(plan, pipe)  # its configs now known
    return Loaded(pipe, models, kwargs, header, load_s=load_s, prewarm=prewarm, cache=counter,
                  attention_prewarm=attn_prewarm, attention_prewarm_skipped=attn_skipped,
                  rope_prewarm=rope_prewarm, block_prewarm=block_prewarm, memory=memory_stage(device))


class _KernelPrewarm:
    """One of the render's fused kernels (``--fused_rope``, ``--fused_block``) imported, compiled and loaded on a
    thread (``compile()``: its module's ``prewarm`` for the render's shapes, returning how many kernels) from the end
    of the weights' load to the text encode (where the main thread mostly waits on the GPU); the first fused call waits
    for it (:meth:`wait`). Without it that call pays Triton's import, the compile on an empty cache and the module load
    inside the first step. A failure is recorded, never raised: the first call then compiles its own. ``record``: what
    it compiles for, recorded with its outcome."""

    def __init__(self, name: str, record: dict, compile: Callable[[], int]):
        self.record: dict = {"status": "running", **record}
        self._waited: Optional[float] = None
        self._compile = compile
        self._thread = threading.Thread(target=self._run, name=f"vdbench-{name}-prewarm", daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        try:
            self.record.update(status="done", compiled=self._compile())
        except Exception as e:  # noqa: BLE001 - recorded; the first call compiles its own kernel instead
            self.record.update(status="failed", error=f"{type(e).__name__}: {str(e).strip()[:200]}")
        self.record["seconds"] = round(time.perf_counter() - self._t0, 4)

    def wait(self) -> None:
        t = time.perf_counter()
        self._thread.join()
        self._waited = time.perf_counter() - t

    def as_dict(self) -> dict:
        return {**self.record, "waited_s": None if self._waited is None else round(self._waited, 4)}


def _rope_prewarm(calls: list, device, dtype, ulysses: int) -> _KernelPrewarm:
    """The fused RoPE's kernel for these self-attention calls at Ulysses degree ``ulysses``
    (:func:`vdbench.kernels.rope.prewarm`), on a thread."""
    def compile() -> int:
        from .kernels.rope import prewarm

        return sum(prewarm(c.seq, c.heads, c.head_dim, dtype, device, ulysses) for c in calls)

    return _KernelPrewarm("rope", {"calls": [list(c) for c in calls], "ulysses": ulysses}, compile)


def _block_prewarm(forms: list, device, dtype) -> _KernelPrewarm:
    """The fused block's kernels for these (tokens, width) of a block call (:func:`vdbench.kernels.block.prewarm`),
    on a thread."""
    def compile() -> int:
        from .kernels.block import prewarm

        return sum(prewarm(tokens, dim, dtype, device) for tokens, dim in forms)

    return _KernelPrewarm("block", {"forms": [list(f) for f in forms]}, compile)


def _self_attention_calls(plan: Plan, pipe) -> Optional[list]:
    """The render's self-attention call shapes (its family's call shapes with as many keys as queries), or None
    where they can't be read."""
    try:
        calls, _ = _attention_calls(plan, pipe)
    except Exception:  # noqa: BLE001 - no shapes, no prewarm: the first call compiles its own kernel
        return None
    return [c for c in calls if c.seq == c.seq_kv and c.heads == c.heads_kv] if calls else None


def _start_rope_prewarm(plan: Plan, pipe) -> Optional[_KernelPrewarm]:
    """The fused RoPE's prewarm for a render that fuses its RoPE on CUDA, for its self-attention calls at its Ulysses
    degree (1 under CFG alone); None otherwise."""
    spec = plan.parallel
    if plan.fused_rope is not None or plan.device.type != "cuda" or (spec is not None and spec.ring_degree > 1):
        return None
    own = _self_attention_calls(plan, pipe)
    return _rope_prewarm(own, plan.device, plan.dtype, spec.ulysses_degree if spec else 1) if own else None


def _start_block_prewarm(plan: Plan, pipe) -> Optional[_KernelPrewarm]:
    """The fused block's prewarm for a render that fuses its blocks on CUDA: each self-attention call's tokens (a
    rank's share of the sequence under context parallelism) by the model's width; None otherwise."""
    if plan.fused_block is not None or plan.device.type != "cuda":
        return None
    own = _self_attention_calls(plan, pipe)
    share = plan.parallel.sequence_degree if plan.parallel is not None else 1
    forms = sorted({(c.seq // share, c.heads * c.head_dim) for c in own or ()})
    return _block_prewarm(forms, plan.device, plan.dtype) if forms else None


class _Watch:
    """What watches a render's pipeline calls, set up once before them and closed after (:meth:`close`): the
    attention patch (counts, timing, its observers), the stage timers (the encoders, the VAE encode under
    ``--vae_timeout``'s watchdog, the first denoiser call), the attention capture, the step cache's counter, the
    progress lines, the encode's reports (``encode_info``, across the calls) and the run id every entry carries. What
    a call counts itself (its step times, the graphs compiled in each step, its profiler's steps) is its own
    :class:`~vdbench.timing.StepTimer`'s, whose steps :meth:`advance` the watch."""

    def __init__(self, plan: Plan, loaded: Loaded, log):
        from .stages import StageTimers
        from .watchdog import Watchdog

        cfg, device = plan.cfg, plan.device
        # one render's entries, told apart from a re-run's (two renders in one process and second differ by the
        # suffix)
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.progress = _Progress(plan.stack, cfg.num_inference_steps, cfg.num_repetitions, log,
                                  enabled=not sys.stderr.isatty())
        watch_encode = (lambda: Watchdog(cfg.vae_timeout, label="vae encode")) if cfg.vae_timeout else None
        self.stage_timers = StageTimers(loaded.pipe, [m for _, m in loaded.models], device, encode_around=watch_encode)
        self.capture = None
        if cfg.save_inputs:
            from .capture import AttentionCapture

            self.capture = AttentionCapture(cfg.capture_dir, cfg.attention_type, rank=cfg.rank,
                                            max_captures=cfg.max_captures)
        self.log, self.stack = log, plan.stack
        self.attention_prewarm = loaded.attention_prewarm  # its record once waited for (wait_for_prewarm)
        self.attention_prewarm_record: Optional[dict] = loaded.attention_prewarm_skipped
        if (self.attention_prewarm_record or {}).get("status") == "failed":
            log(f"warning: [{plan.stack}] attention prewarm failed ({self.attention_prewarm_record['error']}); the "
                "first attention calls compile their own kernels")
        self.patch = AttentionPatch(loaded.models, plan.backend, on_unsupported=cfg.on_unsupported,
                                    time_attention=cfg.time_attention,
                                    before_first_call=self.wait_for_prewarm if loaded.attention_prewarm else None,
                                    observers=[self.capture] if self.capture else None,
                                    # the family's call classifier, grid hooks (none: a grid backend is refused)
                                    # and Ulysses self-attention, not found again from the transformers' classes
                                    family=plan.family,
                                    # compiled blocks would trace the tile-order hooks; a step cache compares and
                                    # reuses block outputs across steps, which a schedule's switch to tile order
                                    # (padded) breaks; context parallelism splits the sequence at the blocks'
                                    # entry, while each Ulysses attention call holds the whole sequence again
                                    tile_order_once=not cfg.compile and plan.cache is None and plan.dctx is None,
                                    fused_rope=plan.fused_rope is None,
                                    rope_ready=loaded.rope_prewarm.wait if loaded.rope_prewarm else None,
                                    fused_block=plan.fused_block is None,
                                    block_ready=loaded.block_prewarm.wait if loaded.block_prewarm else None)
        self.counter = loaded.cache
        self.encode_info: dict = {}
        self.began: Optional[_Mark] = None  # the repetition in progress's start (:meth:`begin`)
        self.device, self.dctx, self.attention_type = device, plan.dctx, cfg.attention_type
        self.settings = loaded.header["settings"]  # recorded beside the capture

    def wait_for_prewarm(self) -> dict:
        """The attention prewarm waited for (the first attention call's, or the first repetition's end where no call
        came) and its record kept; a failure said in one line -- the first calls then compile their own kernels."""
        if self.attention_prewarm is not None and self.attention_prewarm_record is None:
            rec = self.attention_prewarm_record = self.attention_prewarm.wait()
            if rec["status"] != "done":
                self.log(f"warning: [{self.stack}] attention prewarm failed ({rec.get('error')}); the first "
                         "attention calls compile their own kernels")
        return self.attention_prewarm_record

    def mark(self) -> "_Mark":
        """torch.compile's time and the encode's one-time reports so far."""
        return _Mark(compile_seconds(), dict(self.encode_info.get("one_time") or {}))

    def advance(self, step: int) -> None:
        """A denoising step ended (the ``then`` of the call's :class:`~vdbench.timing.StepTimer`, which keeps its own
        counts): the schedule's step, the cache counter's, the progress line."""
        from . import parallel as P

        self.patch.step = step + 1
        if self.counter is not None:
            self.counter.end_step()
        self.progress.step(step)
        if self.dctx is not None:
            P.maybe_inject_failure(self.dctx.rank, "step", self.attention_type)

    def reset(self) -> None:
        """Before a pipeline call: its steps and cache counted from its first step (a schedule warms every backend
        it names in the warm-up calls as in a timed one)."""
        self.patch.step = 0
        if self.counter is not None:
            self.counter.reset()

    def begin(self, rep: int) -> None:
        """Before a timed repetition: the counts, the stage timers and the peak memory afresh."""
        self.reset()
        self.patch.reset_counts()
        self.stage_timers.reset()
        reset_peak_memory(self.device)
        self.progress.begin(rep)
        self.began = self.mark()

    def close(self, log) -> None:
        """After the calls, also on error: the stage timers' hooks removed, the capture's files closed, the attention
        prewarm's worker stopped if it still runs."""
        self.stage_timers.close()
        if self.attention_prewarm is not None:
            self.attention_prewarm.close()
        if self.capture is not None:
            meta_path = self.capture.close(extra={"settings": self.settings})
            stats = self.capture.stats
            log(f"captured {stats.saved} of {stats.seen} attention calls ({stats.bytes / 2**20:.1f} MiB, "
                f"{stats.host_time_s:.3f} s on the run's thread, {stats.writer_time_s:.3f} s in the writer) "
                f"-> {meta_path}")


@dataclass(frozen=True)
class _Mark:
    """torch.compile's time and the encode's one-time reports at a point of the render: what the one-time costs
    after it are counted from (:meth:`_Watch.mark`)."""

    compiled: float
    encode: dict


def run_repetitions(plan: Plan, loaded: Loaded, log) -> tuple[list[dict], object]:
    """The untimed warm-up calls, then the timed repetitions: one timing entry each, and the last one's frames."""
    from tqdm.auto import tqdm

    from .vae.encode import use_encode

    cfg = plan.cfg
    watch = _Watch(plan, loaded, log)
    entries, frames = [], None
    try:  # a calibrating MagCache's ratios recorded from diffusers' log while the pipeline runs
        with (watch.patch, torch.inference_mode(),
              use_encode(loaded.pipe.vae, plan.encode.mode, plan.encode.options, info=watch.encode_info),
              watch.counter.listening() if watch.counter is not None else contextlib.nullcontext()):
            # torch.compile's time from here on is this render's; what the encode reported before any call (on
            # setting up) is the first repetition's
            set_up = watch.mark()
            warmup_s = _warm_up(plan, loaded, watch)
            for rep in tqdm(range(cfg.num_repetitions), desc=plan.stack, unit="rep",
                            disable=cfg.num_repetitions < 2 or not sys.stderr.isatty()):
                repetition = _Repetition(plan, loaded, watch, rep, (set_up, warmup_s) if rep == 0 else None)
                frames = repetition.denoise_and_decode()
                entries.append(repetition.entry())
    finally:
        watch.close(log)
    return entries, frames


def _warm_up(plan: Plan, loaded: Loaded, watch: _Watch) -> Optional[float]:
    """The untimed calls before the timed repetitions (compilation, cuDNN plans, Triton JIT, the allocator); their
    whole time, one-time costs and all (None without them): not a step time."""
    from .pipelines import settle_scheduler

    cfg = plan.cfg
    if not cfg.warmup_calls:
        return None

    def calls():
        for _ in range(cfg.warmup_calls):  # steps advance as in a timed call; their times unread
            watch.reset()
            steps = StepTimer(plan.device, then=watch.advance)
            steps.run_pipe(loaded.pipe, generator=torch.Generator("cpu").manual_seed(cfg.seed), **loaded.kwargs)
            settle_scheduler(loaded.pipe.scheduler)  # a failed solve raises here too

    return device_seconds(plan.device, calls)


def _profiler(plan: Plan) -> Optional[StepProfiler]:
    """The profiler of the first repetition (``--profile_output``), made as it begins: its traces under the traces
    root; None without the flag."""
    cfg = plan.cfg
    if not cfg.profile_output:
        return None
    root = cfg.traces_root if cfg.traces_root is not None else cfg.output_path.parent.parent / "traces"
    return StepProfiler(Path(root) / cfg.profile_output, cfg.rank, cfg.profile_wait, cfg.profile_warmup,
                        cfg.profile_active, plan.device)


class _Repetition:
    """One timed repetition: :meth:`denoise_and_decode` -- the pipeline call to latents, then the decode timed on its
    own -- makes its frames and marks its clocks; :meth:`entry` reads what it measured, once, into its timing entry.
    ``first``: the first repetition's (the mark before the warm-up calls, their time)."""

    def __init__(self, plan: Plan, loaded: Loaded, watch: _Watch, rep: int,
                 first: Optional[tuple[_Mark, Optional[float]]] = None):
        self.plan = plan
        self.loaded = loaded
        self.watch = watch
        self.rep = rep
        self.first = first
        self.timer: Optional[StepTimer] = None  # the pipeline call's steps
        self.after_pipe = self.after_decode = None  # the clocks after the call and after the decode
        self.vae_info: dict = {}  # what the decode reported
        self.scheduler_ahead: Optional[dict] = None  # what the scheduler made ahead (pipelines.settle_scheduler)
        self.memory: dict = {}  # each stage's allocated and reserved peaks (vdbench.timing.memory_stage)

    def denoise_and_decode(self):
        """The pipeline call to latents (the first repetition's profiled), then the decode; the frames."""
        from . import parallel as P
        from .pipelines import settle_scheduler
        from .vae.decode import decode_latents
        from .watchdog import WatchdogTimeout

        plan, loaded, watch, rep = self.plan, self.loaded, self.watch, self.rep
        cfg, device = plan.cfg, plan.device
        watch.begin(rep)
        profiler = _profiler(plan) if rep == 0 else None  # the first repetition is profiled
        self.timer = StepTimer(device, then=watch.advance, profiler=profiler,
                               power=open_trace(device, cfg.power_interval_ms, gpu_uuid(device)))
        try:
            latents = self.timer.run_pipe(loaded.pipe, generator=torch.Generator("cpu").manual_seed(cfg.seed),
                                          **loaded.kwargs).frames
            # what the scheduler made ahead of the device (--scheduler_async); a solve that failed raises here
            self.scheduler_ahead = settle_scheduler(loaded.pipe.scheduler)
            latents = P.share_output(plan.dctx, latents)  # xfuser's CogVideoX: only its last ranks return them
        except WatchdogTimeout as e:  # the VAE encode inside the pipeline call (the stage timers' watchdog)
            raise VAEHang(f"VAE encode hung (> {cfg.vae_timeout} s, --vae_timeout); all threads' stacks were dumped "
                          "to stderr") from e
        self.after_pipe = Clock(device)
        self.memory["denoise"] = memory_stage(device)  # the text encode and the steps: the pipeline call
        try:
            frames = decode_latents(loaded.pipe, latents, plan.family, num_frames=cfg.num_frames,
                                    mode=plan.decode.mode, options=plan.decode.options, timeout_s=cfg.vae_timeout,
                                    info=self.vae_info, prewarm=loaded.prewarm if rep == 0 else None, uint8=True)
        except WatchdogTimeout as e:  # never wait forever: say where it hung, exit non-zero
            raise VAEHang(f"VAE decode hung (> {cfg.vae_timeout} s, --vae_timeout); last completed stage: "
                          f"{e.report.last_completed_stage}; all threads' stacks were dumped to stderr") from e
        self.after_decode = Clock(device)
        self.memory["decode"] = memory_stage(device)
        if cfg.save_latents:
            from .capture import save_latents

            save_latents(cfg.capture_dir, latents, cfg.attention_type, rank=cfg.rank, repetition=rep,
                         meta={"family": plan.family.name, "model": plan.model.spec.model, "height": cfg.height,
                               "width": cfg.width, "num_frames": cfg.num_frames})
        return frames

    def _one_time(self, reported: dict) -> dict:
        """What this repetition paid once (completed in finish: :func:`vdbench.stages.one_time`): the first carries
        the render's -- the load, the warm-up calls, torch.compile's time since the load, the wait for the attention
        prewarm --, each what its stages reported themselves (``reported``: :func:`vdbench.stages.stage_reports`)."""
        watch, first = self.watch, self.first
        set_up, warmup_s = first if first is not None else (None, None)
        compiled = compile_seconds() - (set_up or watch.began).compiled
        once: dict = {"load_s": self.loaded.load_s, "warmup_calls_s": warmup_s} if first is not None else {}
        once["compile_s"] = compiled if compiled > 0 else None
        prewarm = watch.wait_for_prewarm() if first is not None else None
        if prewarm is not None and "waited_s" in prewarm:  # inside the first attention call's step: not added again
            once["attention_prewarm_wait_s"] = prewarm["waited_s"]
        once.update(reported)
        return once

    def entry(self) -> dict:
        """The repetition's timing entry: its step times and their statistics, the stages, the decode and the encode,
        the attention's counts, the cache's, the compiler's, the memory, what it paid once (:meth:`_one_time`), the
        run it is part of."""
        plan, watch, timer, rep = self.plan, self.watch, self.timer, self.rep
        cfg, device, backend, patch = plan.cfg, plan.device, plan.backend, watch.patch
        # the step times (the encoders before the first step are no step's) and the one-time costs the stages
        # reported themselves
        timer.starts_at(watch.stage_timers.denoise_start)
        step_times = timer.step_times()
        last_step = timer.marks[-1] if len(timer.marks) > 1 else None
        once = self._one_time(stage_reports(watch.encode_info, self.vae_info, watch.began.encode,
                                            set_up=self.first[0].encode if self.first is not None else None))
        start, after_pipe, after_decode = timer.started, self.after_pipe, self.after_decode
        attn_time = patch.finish_timing()
        decode_time = after_pipe.seconds_until(after_decode)
        stages = watch.stage_timers.entry(start=start, after_pipe=after_pipe, after_decode=after_decode,
                                          last_step=last_step, step_times=step_times, vae_decode=decode_time)
        encode_info, vae_info, capture, profiler = watch.encode_info, self.vae_info, watch.capture, timer.profiler
        return {
            "attention_type": cfg.attention_type,
            "stack": plan.stack,  # the whole configuration as one name: vdbench.measure.record.stack_name
            "repetition": rep,
            "pipe_time": start.seconds_until(after_pipe),
            "text_encode_time": stages.pop("text_encode_time"),
            "image_encode_time": stages.pop("image_encode_time"),
            "vae_encode_time": stages.pop("vae_encode_time"),
            "vae_encode": ({"mode": plan.encode.mode.name, **{k: v for k, v in encode_info.items()
                                                           if isinstance(v, (int, float, str, bool))}}
                           if stages["stages"]["vae_encode"] is not None else None),
            "step_times": step_times,
            **step_stats(step_times, device, backend.emulated),  # warm step, first step, spread, verdict
            "vae_decode_time": decode_time,
            "vae_decode": {"mode": plan.decode.mode.name, "max_memory_gib": cfg.vae_max_memory,
                           **{k: v for k, v in vae_info.items() if isinstance(v, (int, float, str, bool))}},
            "total_time": start.seconds_until(after_decode),
            **stages,  # stages, unaccounted (+ share, where): vdbench.stages.breakdown
            "one_time": once,  # + steady_s; end_to_end_s and end_to_end on the first: finish
            "cache": watch.counter.summary() if watch.counter is not None else None,
            # the backend's first-call kernels compiled ahead (vdbench.backends.prewarm): the render's, on the first
            "attention_prewarm": watch.attention_prewarm_record if rep == 0 else None,
            # --use_torch_compile: the graphs dynamo made in each step (the first step's compile; any later one is a
            # recompile) and its graph breaks in this call (none: the blocks compile with fullgraph=True)
            "compile": ({"graphs_per_step": list(timer.graphs_per_step), "graph_breaks": timer.graph_breaks}
                        if cfg.compile else None),
            "host": timer.host(),  # the garbage collector's pauses per step (a multi-GPU step's host stalls)
            "power": timer.power_record(),  # each step's joules, power, SM clock, power-capped share (vdbench.power)
            "scheduler_ahead": self.scheduler_ahead,  # copies and solves made without waiting (--scheduler_async)
            "attention": patch.stats.as_dict(),  # + the RoPE's calls, fused or eager
            "fused_rope": _fused_record(plan.cfg.fused_rope, plan.fused_rope, patch.stats.rope["fused"],
                                        "no call went through the family's processor (diffusers' own ran)",
                                        self.loaded.rope_prewarm if rep == 0 else None),
            "fused_block": _fused_record(plan.cfg.fused_block, plan.fused_block,
                                         sum(n for (_, form), n in patch.stats.block.items() if form == "fused"),
                                         patch.stats.block_eager_why or "no block ran the family's forward",
                                         self.loaded.block_prewarm if rep == 0 else None),
            # --offload expert: the units swapped since the load, those left to the incoming expert's first call
            "offload": swap.as_dict() if (swap := expert_swap(self.loaded.pipe)) is not None else None,
            "attention_share": (attn_time / sum(step_times)) if attn_time and step_times else None,
            "memory": {"load": self.loaded.memory, **self.memory},  # each stage's peaks, this rank's card
            "peak_memory_bytes": _peak(self.memory, "allocated_peak"),
            "peak_reserved_bytes": _peak(self.memory, "reserved_peak"),
            "traces": [str(p) for p in profiler.paths] if profiler is not None else None,
            "capture": ({"saved": capture.stats.saved, "bytes": capture.stats.bytes,
                         "host_time_s": capture.stats.host_time_s} if capture else None),
            "output": str(cfg.output_path),
            "run_id": watch.run_id,
            "run": self.loaded.header,
        }


def _peak(memory: dict, key: str) -> Optional[int]:
    """A repetition's peak (the denoising's and the decode's; the load's is its own stage), None on a CPU."""
    values = [m[key] for m in memory.values() if m]
    return max(values) if values else None


def _fused_record(setting: Optional[bool], why: Optional[str], fused: int, none_ran: str, prewarm) -> dict:
    """A fused kernel's part of a render's entry (``fused_rope``, ``fused_block``): the setting, whether the kernel ran
    (``fused``: its calls), why not (the plan's reason, else ``none_ran`` where no call was fused: a context-parallel
    render without the family's processor runs diffusers' RoPE; block calls the kernels can't serve run the eager
    expressions), and, given (the first repetition), its prewarm."""
    out = {"setting": {None: "auto", True: "on", False: "off"}[setting], "used": bool(fused),
           "why_not": why or (None if fused else none_ran)}
    if prewarm is not None:
        out["prewarm"] = prewarm.as_dict()
    return out


def _log_compile(comp: Optional[dict], stack: str, log) -> None:
    """A compiled render's graphs per step; a warning where a step after the first compiled (a recompile: the step
    waits for the compiler again) or where dynamo broke a graph."""
    if not comp:
        return
    per = comp["graphs_per_step"]
    log(f"[{stack}] torch.compile: graphs made per step {per}, graph breaks {comp['graph_breaks']}")
    later = [i + 1 for i, n in enumerate(per) if i and n]
    if later:
        log(f"warning: [{stack}] torch.compile compiled again in step(s) {later}: a guard failed and the blocks "
            "recompiled")
        log("hint: TORCH_LOGS=recompiles names the guard")


def _log_calibration(c: dict, stack: str, timing_path: Path, log) -> None:
    """A calibrating MagCache's outcome, one line and a hint: the spec to render with next time, or why there is
    none; a calibration message that held no list of numbers said too."""
    cal = c.get("calibration")
    if not cal:
        return
    for why in cal.get("ignored") or []:
        log(f"warning: [{stack}] cache {c['spec']}: a MagCache calibration message ignored: {why}")
    if cal.get("use"):
        n = len(cal["ratios"])
        log(f"[{stack}] cache calibrated ({len(cal['ratios'][0])} steps, {n} cache context{'s' if n != 1 else ''}; "
            f"the first, the conditional pass's, kept): next time --cache {cal['use']}")
        log(f"hint: or --cache mag:mag_ratios=@{timing_path} (the same ratios, read from this render's timing.json)")
    else:
        log(f"warning: [{stack}] cache {c['spec']}: diffusers logged no calibration ratios")
        log("hint: it logs them when a denoiser has run every step; Wan 2.2's two experts each run part of them")


def finish(plan: Plan, entries: list[dict], frames, log, wall: Optional[Wall] = None) -> dict:
    """Merge the ranks' entries; rank 0 writes the video (and raw frames) and appends to timing.json.

    Each entry's ``one_time`` is completed (:func:`vdbench.stages.one_time`). With ``wall`` (the render's marks), the
    first repetition's entry gets ``end_to_end_s`` -- the render's start (the process's, from the CLIs) to the video
    and raw frames on disk, every repetition included -- and its ``end_to_end`` breakdown
    (:func:`vdbench.stages.render_end_to_end`); the later repetitions' entries get None for both (the render's wait
    is counted once)."""
    from . import parallel as P
    from .stages import describe as describe_stages
    from .stages import describe_end_to_end, one_time, render_end_to_end
    from .video import MADE_BY_RENDER, render_comment, save_frames, write_video

    cfg, device, backend = plan.cfg, plan.device, plan.backend
    merged = P.merge_rank_entries(plan.dctx, entries)  # a collective under torchrun; None on ranks other than 0
    if merged is None:
        return {"attention_type": cfg.attention_type, "rank": cfg.rank, "output": None,
                "calls_by_kernel": entries[-1]["attention"]["calls_by_kernel"]}
    # the files first: what the render's end-to-end time counts to
    write_start = time.perf_counter()
    run_id = merged[-1].get("run_id")
    write_video(frames, cfg.output_path, fps=cfg.fps, made_by=render_comment(run_id) if run_id else MADE_BY_RENDER)
    if cfg.save_frames:
        save_frames(frames, cfg.output_path.with_suffix(".npy"))
    end = time.perf_counter()
    # what the record vouches for: the render's identity and the bytes it wrote (the readers refuse a file that
    # no longer matches its entry)
    written = {"identity": identity.of(asdict(cfg), RenderConfig, plan.family).as_dict(),
               "output_sha256": identity.file_sha256(cfg.output_path),
               "frames_sha256": identity.file_sha256(cfg.output_path.with_suffix(".npy")) if cfg.save_frames else None}
    # then the entries completed: what each repetition paid once, the render's end to end on the first
    entries = one_time(merged)
    for i, e in enumerate(entries):
        e.update(written)
        e2e = render_end_to_end(entries, wall, end - write_start, end) if (wall is not None and i == 0) else None
        e["end_to_end_s"] = (end - wall.started.t) if e2e else None
        e["end_to_end"] = e2e
    last = entries[-1]
    stages_line, e2e_line = describe_stages(last), describe_end_to_end(entries[0])
    # the repetitions in the record schema every tool writes (vdbench.measure.record), beside timing.json
    Writer(cfg.timing_path.with_name("records.jsonl")).write(*(from_render_entry(e) for e in entries))
    append_timing(cfg.timing_path, entries)
    steps = run_step_stats([e["step_times"] for e in entries], device, backend.emulated)
    timing_text = ("emulated backend: no speed figure" if backend.emulated
                   else describe_steps(steps, cached=plan.cache is not None))
    stack = plan.stack
    summary = {
        "attention_type": cfg.attention_type, "stack": stack, "output": str(cfg.output_path),
        "timing": str(cfg.timing_path),
        "warm_step_median": None if backend.emulated else steps["warm_step_median"],
        "warm_step_n": steps["warm_step_n"], "speed_figure": steps["speed_figure"],
        "why_not_speed": steps["why_not_speed"], "vae_decode_time": last["vae_decode_time"],
        "vae_encode_time": last.get("vae_encode_time"),
        "calls_by_kernel": last["attention"]["calls_by_kernel"], "fallback_calls": last["attention"]["fallback_calls"],
        "end_to_end_s": entries[0].get("end_to_end_s"), "one_time_s": entries[0]["one_time"]["total_s"],
        "load_s": entries[0]["one_time"].get("load_s"),
        "denoise_s": steps["denoise_s"], "step_mean": steps["step_mean"], "cache": last.get("cache"),
    }
    kernels = ", ".join(f"{k}×{v}" for k, v in last["attention"]["calls_by_kernel"].items())
    log(f"[{stack}] {timing_text}, decode {last['vae_decode_time']:.2f} s, kernels: {kernels} "
        f"-> {cfg.output_path}")
    log(f"[{stack}] {stages_line}")
    if last.get("cache"):
        c = last["cache"]
        share = "n/a" if c["skipped_share"] is None else f"{c['skipped_share']:.0%}"
        mine = f" (rank 0: {c['guidance_split']['this_rank_computes']})" if c.get("guidance_split") else ""
        log(f"[{stack}] cache {c['spec']}: {share} of the {c['unit']} calls reused; computed per "
            f"step {c['computed_blocks_per_step']}, reused {c['reused_blocks_per_step']}{mine}")
        if c.get("ranks_agree") is False:  # made one by vdbench.cache.share_decisions: a difference is a fault
            log(f"warning: [{stack}] cache {c['spec']}: the ranks computed different blocks (ranks[].cache in "
                f"{cfg.timing_path})")
        _log_calibration(c, stack, cfg.timing_path, log)
    _log_compile(last.get("compile"), stack, log)
    par = last.get("parallel")
    if par:
        log(f"[{stack}] parallel {par['label']} over {par['world_size']} ranks on the {par['engine']} engine "
            f"({par.get('engine_reason')})")
    if e2e_line:
        log(f"[{stack}] {e2e_line}")
    if not steps["speed_figure"] and not backend.emulated:
        log(f"warning: [{stack}] not a speed figure: {steps['why_not_speed']}")
    log(f"output: {cfg.output_path}")
    return summary
