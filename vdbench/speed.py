"""Speed options applied to a loaded pipeline: regional compile, bf16 text-encoder GEMMs, fp8 GEMMs (torchao).

Each option either takes effect or refuses with a reason before any rendering (``SpeedOptionError``): a run
that asked for fp8 GEMMs and silently ran bf16 would report a speed that belongs to another configuration.
``apply_speed_options`` returns what it did, for the run's timing.json.

* **compile** -- *regional* compile: the repeated transformer blocks (the classes the model declares in
  ``_repeated_blocks``, e.g. Wan's; otherwise the blocks of its block list, e.g. CogVideoX's) each get their own
  ``forward`` compiled, and the compiled code is shared by all blocks (one code object). Compile time stays
  seconds instead of minutes and the speed is that of a whole-model compile. The block's ``forward`` itself, not
  its module call: whatever hooks the block afterwards -- a step cache's decision (diffusers' hooks replace
  ``forward``), diffusers' context-parallel split -- wraps the compiled code from outside and runs eagerly, as
  ParaAttention keeps its First Block Cache beside a compiled model. The attention patch survives compile because
  each call is one opaque ``vdbench::attention`` op (see ``vdbench.patching``), so every backend keeps running its
  own kernel and its calls are still counted. ``fullgraph=True``: a graph break would be a silent slowdown, so it
  is an error instead.
* **bf16 text-encoder GEMMs** -- the text encoder (UMT5 for Wan, T5 for CogVideoX) runs in bfloat16 whatever
  the pipeline dtype: T5-family encoders overflow in float16 and are needlessly slow in float32. The
  embeddings are cast to the transformer's dtype by the pipelines, as they are anyway.
* **fp8 GEMMs** -- torchao's float8 dynamic-activation/float8-weight quantization (per-row scales by default)
  of the Linear layers inside the transformer blocks, the layers that carry the FLOPs. Its scope
  (:data:`FP8_GEMM_SCOPES`): ``all`` of the blocks' Linear layers, or ``ffn``, only those inside a diffusers
  ``FeedForward``, so that the attention projections, whose rounding errors feed the softmax, stay in the
  pipeline's dtype. torchao needs a GPU with fp8 (CUDA compute capability >= 8.9, MI300+); anywhere else this
  refuses.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .hostmem import block_list
from .measure.record import fp8_gemm_scope

__all__ = ["SpeedOptionError", "apply_speed_options", "check_speed_options", "compile_blocks", "quantize_fp8_gemms",
           "fp8_gemm_targets", "COMPILE_BACKENDS", "FP8_GEMM_SCOPES"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # eager/aot_eager: debugging what dynamo traces
#: Which Linear layers of the transformer blocks ``--use_fp8_gemms`` quantizes: ``all`` of them, or ``ffn``, those
#: inside a diffusers ``FeedForward`` (the attention projections stay in the pipeline's dtype).
FP8_GEMM_SCOPES = ("all", "ffn")
#: ``--inductor_tuning``: ``auto`` leaves inductor's coordinate-descent tuning as the process has it (off unless set
#: before: the fp8 GEMMs are told to leave inductor alone); ``on`` sets it, with the fp8 GEMMs' recommended inductor
#: settings (torchao's) too; ``off`` clears it.
INDUCTOR_TUNING = ("auto", "on", "off")


class SpeedOptionError(RuntimeError):
    """A requested speed option cannot take effect here (package, device, model)."""


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    blocks = block_list(model)[1]
    if blocks:
        return blocks
    raise SpeedOptionError(f"{type(model).__name__} has no list of repeated blocks to compile regionally")


def compile_blocks(models, backend: str = "inductor", mode: Optional[str] = None) -> dict:
    """Regionally compile each model's repeated blocks in place; returns a description for timing.json."""
    if backend not in COMPILE_BACKENDS:
        raise SpeedOptionError(f"compile backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    kwargs = dict(backend=backend, fullgraph=True)
    if mode and backend == "inductor":
        kwargs["mode"] = mode
    done = {}
    aliasing_check = _no_custom_op_aliasing_check()
    for name, model in models:
        declared = getattr(model, "_repeated_blocks", None)
        blocks = ([m for m in model.modules() if type(m).__name__ in declared] if declared else _blocks(model))
        for b in blocks:
            if "forward" in b.__dict__:  # hooked already: the compile would trace the hooks' Python
                raise SpeedOptionError(f"{type(b).__name__}'s forward is already replaced (hooks installed before "
                                       "the compile); compile the blocks first")
            b.forward = torch.compile(b.forward, **kwargs)
        done[name] = {"how": "block forward", "blocks": len(blocks)}
    return {"backend": backend, "mode": kwargs.get("mode"), "fullgraph": True, "models": done,
            "custom_op_aliasing_check": aliasing_check}


def _no_custom_op_aliasing_check() -> str:
    """Turn off AOTAutograd's first-call aliasing analysis of custom ops (torch >= 2.13), for this process.

    Why: it runs the first call of every compiled graph under a Python dispatch mode, and the opaque
    ``vdbench::attention`` op runs FlexAttention inside (the sparse backends: ``BlockMask.from_kv_blocks`` and the
    eager kernel go through ``vmap``), which fails under such a mode ("Cannot access storage of
    BatchedTensorImpl"). The op returns a new tensor (no aliasing to check), so the analysis has nothing to find.
    The flag is read when a compiled graph first runs, not when it is built, hence process-wide."""
    from torch._functorch import config

    if not hasattr(config, "check_custom_op_aliasing"):
        return "not in this torch"
    config.check_custom_op_aliasing = False
    return "off (the attention op runs FlexAttention's vmap code, which that analysis's dispatch mode breaks)"


def _fp8_support_reason(device: torch.device) -> Optional[str]:
    """None when torchao's float8 GEMMs can run on ``device``, else why not."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        return "package not installed: torchao (pip install 'vdbench[fp8]')"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"float8 GEMMs need a GPU with fp8 support; this run is on {device.type}"
    if torch.version.hip is None and torch.cuda.get_device_capability(device) < (8, 9):
        cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
        return f"float8 GEMMs need CUDA compute capability >= 8.9 (this GPU: {cc})"
    return None


def check_speed_options(device: torch.device, *, compile: bool = False, compile_backend: str = "inductor",
                        compile_mode: Optional[str] = None, fp8_gemms: Union[bool, str, None] = None,
                        inductor_tuning: str = "auto") -> Optional[str]:
    """Refuse (SpeedOptionError: the fact, then the hint) a combination of speed options that can't take effect,
    from the device and the options alone: before any weight loads. A compile option without the compile, or a mode
    the backend ignores, would otherwise be recorded in the run's settings while changing nothing. ``fp8_gemms``:
    the scope (:data:`FP8_GEMM_SCOPES`; True: ``all``), None or False: off. Returns the fp8 GEMMs' scope the setting
    resolves to (None: off), what :func:`apply_speed_options` takes."""
    if not compile and (compile_mode or compile_backend not in (None, "inductor")):
        given = f"--compile_mode {compile_mode}" if compile_mode else f"--compile_backend {compile_backend}"
        raise SpeedOptionError(f"{given} without --use_torch_compile: nothing is compiled\nadd --use_torch_compile "
                               "or drop the option")
    if inductor_tuning not in INDUCTOR_TUNING:
        raise SpeedOptionError(f"--inductor_tuning {inductor_tuning}: unknown\nvalid: {', '.join(INDUCTOR_TUNING)}")
    if inductor_tuning != "auto" and not (compile and compile_backend == "inductor"):
        raise SpeedOptionError(f"--inductor_tuning {inductor_tuning} without inductor's compile: nothing is tuned\n"
                               "add --use_torch_compile (inductor) or drop the option")
    if compile and compile_mode and compile_backend != "inductor":
        raise SpeedOptionError(f"--compile_mode {compile_mode} with --compile_backend {compile_backend}: only inductor "
                               "takes a mode\ndrop --compile_mode or use --compile_backend inductor")
    scope = fp8_gemm_scope(fp8_gemms)
    if scope is not None:  # a RenderConfig built in code gets past argparse's choices
        _known_scope(scope)
    reason = _fp8_support_reason(device) if scope else None
    if reason:
        raise SpeedOptionError(f"--use_fp8_gemms can't run here: {reason}\nrender without --use_fp8_gemms, or on a "
                               "GPU with fp8 and torchao installed")
    return scope


def _known_scope(layers: str) -> None:
    if layers not in FP8_GEMM_SCOPES:
        raise SpeedOptionError(f"--use_fp8_gemms {layers}: unknown scope\nvalid: {', '.join(FP8_GEMM_SCOPES)}")


def fp8_gemm_targets(model: torch.nn.Module, layers: str = "all") -> list[str]:
    """The fully qualified names (``model.named_modules()``'s) of the Linear layers ``--use_fp8_gemms <layers>``
    quantizes in ``model``: those inside its repeated blocks with both dims multiples of 16 (fp8 GEMM kernels want
    them; the small layers outside the blocks carry no FLOPs worth it), and for ``layers="ffn"`` only those inside a
    diffusers ``FeedForward`` (told by its type, whatever the model names it)."""
    _known_scope(layers)
    scope = _blocks(model)
    if layers == "ffn":
        from diffusers.models.attention import FeedForward

        scope = [m for b in scope for m in b.modules() if isinstance(m, FeedForward)]
    inside = {id(m) for s in scope for m in s.modules()}
    return [fqn for fqn, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m) in inside and m.in_features % 16 == 0
            and m.out_features % 16 == 0]


def quantize_fp8_gemms(models, device: torch.device, granularity: str = "row", layers: str = "all",
                       inductor_settings: bool = False) -> dict:
    """float8 dynamic-activation/weight quantization of the Linear layers :func:`fp8_gemm_targets` picks in each
    model (``layers``: the scope, :data:`FP8_GEMM_SCOPES`); returns the scope and the layers quantized per model.
    ``inductor_settings``: let torchao set its recommended inductor settings for the whole process (coordinate-descent
    tuning of every compiled kernel among them: most of a compiled fp8 render's first call)."""
    _known_scope(layers)
    reason = _fp8_support_reason(device)
    if reason:
        raise SpeedOptionError(f"--use_fp8_gemms can't run here: {reason}")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    gran = {"row": PerRow(), "tensor": PerTensor()}[granularity]
    done = {}
    for name, model in models:
        targets = fp8_gemm_targets(model, layers)
        if not targets:
            raise SpeedOptionError(f"--use_fp8_gemms {layers}: {type(model).__name__} has no Linear layer in that "
                                   "scope\nuse --use_fp8_gemms all, or drop it")
        # the modules themselves, not their names: torchao's filter is told each module's path its own way
        wanted = {id(model.get_submodule(fqn)) for fqn in targets}
        picked = []

        def pick(mod, fqn, wanted=wanted, picked=picked):
            ok = id(mod) in wanted
            if ok:
                picked.append(fqn)
            return ok

        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=gran,
                                                                   set_inductor_config=inductor_settings),
                  filter_fn=pick)
        done[name] = len(picked)
    return {"granularity": granularity, "scope": layers, "linear_layers": done,
            "torchao_inductor_settings": inductor_settings}


def apply_speed_options(pipe, models, *, device: torch.device, compile: bool = False,
                        compile_backend: str = "inductor", compile_mode: Optional[str] = None,
                        bf16_te_gemms: bool = False, fp8_gemms: Optional[str] = None,
                        inductor_tuning: str = "auto") -> dict:
    """Apply the requested options in the order that works (quantize, then compile); return what was done, with
    inductor's coordinate-descent tuning as it stands for the compile (``inductor_tuning``: :data:`INDUCTOR_TUNING`),
    since it changes every compiled kernel and its first call, whoever set it. ``fp8_gemms``: the fp8 GEMMs' scope
    as :func:`check_speed_options` resolved it (None: off)."""
    done: dict = {}
    if bf16_te_gemms:
        te = getattr(pipe, "text_encoder", None)
        if te is None:
            raise SpeedOptionError("--use_bf16_te_gemms: this pipeline has no text encoder")
        done["text_encoder_dtype"] = {"from": str(te.dtype).replace("torch.", ""), "to": "bfloat16"}
        te.to(torch.bfloat16)
    if fp8_gemms:
        # torchao's recommended inductor settings (coordinate-descent tuning for the whole process among them) only
        # with ``on``: measured on an H200, they cost the fp8 stack's first call 119 s for no warm-step gain
        done["fp8_gemms"] = quantize_fp8_gemms(models, device, layers=fp8_gemms,
                                               inductor_settings=inductor_tuning == "on")
    if compile:
        done["compile"] = compile_blocks(models, compile_backend, compile_mode)
        if compile_backend == "inductor":
            done["compile"]["coordinate_descent_tuning"] = _coordinate_descent_tuning(inductor_tuning)
    return done


def _coordinate_descent_tuning(setting: str) -> dict:
    """inductor's coordinate-descent tuning for this process: set by ``on`` / ``off``, read as it stands for
    ``auto`` (inductor's default, or what the process set before)."""
    from torch._inductor import config

    if setting in ("on", "off"):
        config.coordinate_descent_tuning = setting == "on"
        return {"on": setting == "on", "set_by": "--inductor_tuning"}
    on = bool(config.coordinate_descent_tuning)
    return {"on": on, "set_by": "already on in this process" if on else "inductor's default"}
