"""What a render is asked to do (:class:`RenderConfig`: every setting, as the CLIs or a library caller give it), and
the error a hung VAE stage raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

__all__ = ["RenderConfig", "VAEHang"]


class VAEHang(RuntimeError):
    """The VAE decode (or encode) ran past --vae_timeout (the watchdog dumped every thread's stack)."""


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
    offload: str = "none"  # where weights wait off the GPU: none | model | group | expert | shard (vdbench.offload)
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
