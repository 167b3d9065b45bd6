"""SageAttention 2 (the ``sageattention`` package >= 2.0, built from source): its dispatcher and the explicit kernels.

Entries (``docs/notes/sageattention2.md`` has the package's API and numerics, read from 2.2.0):

* ``sagev2`` -- ``sageattn``, the package's own dispatcher. On Hopper it runs ``sageattn_qk_int8_pv_fp8_cuda_sm90``:
  INT8 Q·Kᵀ (per-thread scales, K smoothed), fp8 e4m3 P·V with a per-channel V scale and two-level fp32
  accumulation -- **the accurate fp8 path**: the error of fp8 on the P·V side only, where FA3 fp8's e4m3 Q·Kᵀ with
  one scale per head loses most on peaked attention. Which kernel it picked is observed (the package's functions
  are wrapped for one tiny call per device) and counted by name, e.g.
  ``sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90``.
* ``sagev2_fp8`` -- the fp8 P·V kernel for the GPU (``..._fp8_cuda_sm90`` on sm90, ``..._fp8_cuda`` on sm89/sm120),
  ``pv_accum_dtype="fp32+fp32"`` (the two-level fp32 accumulation; sm90's only mode).
* ``sagev2_fp16`` -- ``sageattn_qk_int8_pv_fp16_cuda``, fp16 P·V with an fp32 accumulator (``pv_accum_dtype="fp32"``).
* ``sagev2_triton`` -- ``sageattn_qk_int8_pv_fp16_triton``: SageAttention 1's algorithm (INT8 per block, fp16 P·V).

``sagev2_fp8`` and ``sagev2_fp16`` take ``gran=per_thread|per_warp`` (the Q/K quantization granularity,
``qk_quant_gran``; default per_thread, the package's): ``--attention_type sagev2_fp8:gran=per_warp``.

Every entry has its log-sum-exp form (``return_lse=True``: natural log, (B, H, S) fp32, the K-mean correction
included by the package), so ring attention runs them. 2.x writes none of its inputs (checked on the GPU by
bench/bench_fp8.py; 1.x smoothed K in place), so the wrappers pass them as they are.

**A V channel that is all zeros** makes the fp8 kernels' output NaN in that channel (its per-channel scale is 0:
0·inf). The fp8 entries take V's per-channel amax (one read of V) and write exact zeros into those output channels
(``vdbench.kernels.channels``: no host sync, nothing written when no channel is zero) -- what any positive scale
for that channel would give, bit for bit; the other channels are untouched. The fp16 kernels need no guard.

Availability: without the package, each entry says how to install it (no wheel on PyPI: built from a source
checkout) and names its ``sagev2_emu`` twin; with 1.x installed, that 2.x is needed; a kernel the installed build
lacks (no such function, or built without that architecture) is refused by its function's name.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from vdbench import kernels
from vdbench.numerics import zero_channels_, zero_v_channels

from .registry import (HALF, Backend, BenchProfile, LSEForm, Option, UnsupportedCall, cuda, register,
                       requires_package, traffic)
from .sage import SageMajor, import_sageattention, sage_version

ORDER = 15

INSTALL_HINT = ("no wheel on PyPI: build it from a thu-ml/SageAttention source checkout as its README says, with "
                "TORCH_CUDA_ARCH_LIST set to your GPU; docs/BACKENDS.md, 'SageAttention 2'")
FP8_SM90 = "sageattn_qk_int8_pv_fp8_cuda_sm90"
FP8_SM89 = "sageattn_qk_int8_pv_fp8_cuda"
FP16_CUDA = "sageattn_qk_int8_pv_fp16_cuda"
FP16_TRITON = "sageattn_qk_int8_pv_fp16_triton"
#: the flag sageattention's core sets when the extension behind a function was built (False: the call asserts)
_BUILT_FLAG = {FP8_SM90: "SM90_ENABLED", FP8_SM89: "SM89_ENABLED", FP16_CUDA: "SM80_ENABLED"}
#: the architectures sageattention 2.2's ``sageattn`` has a branch for (others raise "Unsupported CUDA architecture")
DISPATCH_ARCHS = ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1))
GRAN = Option("gran", "per_thread", ("per_thread", "per_warp"),
              help="Q/K INT8 scale groups (qk_quant_gran): per_thread = the rows one MMA thread holds, per_warp = "
                   "a warp's rows (coarser, a few % faster)")


def _cap(device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(torch.device(device))


def _fp8_function(device) -> str:
    return FP8_SM90 if _cap(device)[0] == 9 else FP8_SM89


@dataclass(frozen=True)
class SageFunction:
    """A check: the installed sageattention has the function ``choose(device)`` names, built for this GPU."""

    choose: Callable[[torch.device], str]

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        mod, why = import_sageattention()
        if mod is None:
            return why
        fn = self.choose(device)
        if not hasattr(mod, fn):
            return f"the installed sageattention ({sage_version(mod)}) has no {fn}"
        flag = _BUILT_FLAG.get(fn)
        core = sys.modules.get(f"{mod.__name__}.core", mod)
        if flag and getattr(core, flag, True) is False:
            return (f"the installed sageattention was built without the kernels of {fn} ({flag} is False): rebuild it "
                    "with TORCH_CUDA_ARCH_LIST including this GPU")
        return None


@dataclass(frozen=True)
class SageDispatch:
    """A check: ``sageattn`` has a branch for this GPU's architecture."""

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        cap = _cap(device)
        if cap in DISPATCH_ARCHS:
            return None
        return (f"sageattention's sageattn dispatches on sm_80/86/89/90/120/121 only, GPU is sm_{cap[0]}{cap[1]}: "
                "use sagev2_fp8 or sagev2_fp16")


#: rel L2 vs exact attention above which a self-check call is a broken build (the kernels give ~4e-2 on its inputs;
#: a build that returns uninitialized memory or a permuted output gives ~1.4 or NaN)
SELF_CHECK_MAX_REL_L2 = 0.2
_SELF_CHECKED: dict[tuple, Optional[str]] = {}


def _self_check_device(device) -> torch.device:
    """Where the self-check's tensors live (the device asked; tests pretending a GPU point it at the CPU)."""
    return torch.device(device)


@dataclass(frozen=True)
class SageSelfCheck:
    """A check: the function ``choose(device)`` names, with ``kwargs``, computes attention on this GPU.

    Why: a sageattention build can import, dispatch and run without computing anything -- the 2.2.0 tag's
    ``sm90_compile.py`` registers the sm90 op's fake (meta) implementation under the real wrapper's name, so every
    sm90 call returns uninitialized memory, fast (measured on an H200: ~0.7 ms where the kernel takes 8.5 ms, 18.6 dB
    in a Wan 14B render; fixed upstream by d970424). One tiny call per (GPU, function, options) in both layouts vdbench
    uses (HND, and NHD on BSHD memory), against fp64 attention, before anything is timed; a backend that fails it is
    unavailable, with the figure."""

    choose: Callable[[torch.device], str]
    kwargs: tuple = ()

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        name = self.choose(device)
        key = (str(device), name, self.kwargs)
        if key not in _SELF_CHECKED:
            _SELF_CHECKED[key] = _self_check(name, dict(self.kwargs), device)
        return _SELF_CHECKED[key]


def _self_check(name: str, kwargs: dict, device) -> Optional[str]:
    from vdbench.measure.quality import rel_l2
    from vdbench.numerics import exact_attention

    mod, why = import_sageattention()
    if mod is None:
        return why
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((1, 256, 2, 64), generator=g) for _ in range(3))  # BSHD
    k = k + 2.0 * torch.randn((1, 1, 2, 64), generator=g)  # a K channel bias, as real K has
    ref = exact_attention(*(t.transpose(1, 2).double() for t in (q, k, v)))
    bshd = [t.to(_self_check_device(device), torch.bfloat16) for t in (q, k, v)]
    # through the wrapper the backends call: BHSD memory goes as "HND", BHSD views of BSHD memory as "NHD"
    layouts = (("HND", [t.transpose(1, 2).contiguous() for t in bshd]), ("NHD", [t.transpose(1, 2) for t in bshd]))
    for layout, args in layouts:
        try:
            out = _call(_fixed(name), kwargs, *args, None, False, lse=False)
        except Exception as e:  # noqa: BLE001 -- any failure of the call is the reason
            return f"sageattention.{name} failed vdbench's self-check ({layout}): {type(e).__name__}: {e}"[:300]
        err = rel_l2(out.double().cpu(), ref)
        if not err <= SELF_CHECK_MAX_REL_L2:  # NaN fails too
            return (f"sageattention {sage_version(mod)}: {name} computes wrong attention on this GPU (self-check, "
                    f"layout {layout}: rel L2 {err:.2g} vs exact, limit {SELF_CHECK_MAX_REL_L2}): a broken build -- "
                    "the 2.2.0 tag returns uninitialized memory on sm90 (its fake op shadows the real one); build "
                    "from a revision with upstream commit d970424")
    return None


# ----------------------------------------------------------------------------------------------------------
# Which kernel sageattn picks, the zero-V-channel guard, the calls
# ----------------------------------------------------------------------------------------------------------

_PICKED: dict[str, str] = {}
_TRITON_GUARD: dict[str, bool] = {}


def picked_kernel(device) -> str:
    """``sageattention.<function>`` that ``sageattn`` calls on ``device``: observed once per device by wrapping the
    package's public functions around one tiny call (its dispatch depends on the GPU's architecture only)."""
    key = str(torch.device(device))
    if key not in _PICKED:
        _PICKED[key] = _observe_dispatch(torch.device(device))
    return _PICKED[key]


def _observe_dispatch(device: torch.device) -> str:
    sage = importlib.import_module("sageattention")
    core = sys.modules.get(f"{sage.__name__}.core", sage)
    saved = {n: f for n, f in vars(core).items() if n.startswith("sageattn_") and callable(f)}
    seen: list[str] = []

    def spy(name, fn):
        def call(*a, **kw):
            seen.append(name)
            return fn(*a, **kw)

        return call

    for name, fn in saved.items():
        setattr(core, name, spy(name, fn))
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((1, 1, 128, 64), generator=g, device=device).to(torch.bfloat16)
        sage.sageattn(x, x, x, tensor_layout="HND", is_causal=False)
    finally:
        for name, fn in saved.items():
            setattr(core, name, fn)
    return f"sageattention.{seen[0]}" if seen else "sageattention.sageattn[dispatch not observed]"


def _guard_zero_v(out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact zeros in the output channels whose V channel is all zeros (the fp8 kernels' NaN): Triton where it runs
    (no host sync), the eager form elsewhere."""
    key = str(out.device)
    if key not in _TRITON_GUARD:
        _TRITON_GUARD[key] = out.is_cuda and kernels.probe("zero_channels", out.device)[0]
    flags = zero_v_channels(v)
    return kernels.zero_channels_(out, flags) if _TRITON_GUARD[key] else zero_channels_(out, flags)


def tensor_layout(q, k, v) -> str:
    """sageattention's ``tensor_layout`` for BHSD views: "NHD" when all three are transposed BSHD tensors (what
    diffusers' dispatcher passes), "HND" otherwise. Why: sageattention allocates its output in the layout it is told,
    so calling it "HND" on BSHD memory returns a BHSD tensor that the caller then copies back to BSHD for the output
    projection -- one full read and write of the output per call."""
    bshd = all(t.transpose(1, 2).is_contiguous() for t in (q, k, v))
    return "NHD" if bshd and not all(t.is_contiguous() for t in (q, k, v)) else "HND"


def _call(function: Callable[[torch.device], str], kwargs: dict, q, k, v, scale, is_causal, lse: bool):
    """One sageattention call on BHSD inputs (in the layout their memory has), the zero-V guard after an fp8 kernel."""
    if is_causal and q.shape[2] != k.shape[2]:
        raise UnsupportedCall("sageattention masks causal attention top-left aligned (query i sees keys j <= i); "
                              f"with q_len {q.shape[2]} != kv_len {k.shape[2]} that is not vdbench's bottom-right "
                              "convention (FlashAttention's)")
    name = function(q.device)
    fn = getattr(importlib.import_module("sageattention"), name)
    layout = tensor_layout(q, k, v)
    if layout == "NHD":  # BSHD memory (diffusers' dispatcher): call on it, the output stays BSHD (no copy after)
        res = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), tensor_layout="NHD", is_causal=is_causal,
                 sm_scale=scale, return_lse=lse, **kwargs)
        res = (res[0].transpose(1, 2), res[1]) if lse else res.transpose(1, 2)  # lse is (B, H, S) in both layouts
    else:
        res = fn(q, k, v, tensor_layout="HND", is_causal=is_causal, sm_scale=scale, return_lse=lse, **kwargs)
    out, lse_ = (res[0], res[1].float()) if lse else (res, None)
    ran = picked_kernel(q.device) if name == "sageattn" else name  # the dispatcher: the kernel it picks here
    if "pv_fp8" in ran:
        _guard_zero_v(out, v)
    return (out, lse_) if lse else out


def _entry(name: str, description: str, function: Callable[[torch.device], str], kwargs: dict, *, kernel: str,
           label: Callable[[torch.device], str], twin: str, min_arch, checks: tuple, widths: tuple,
           prepass_reads: tuple, **extra) -> Backend:
    return Backend(
        name, description, fn=partial(_call_fn, function, kwargs), kernel=kernel,
        constraints=(requires_package("sageattention", hint=INSTALL_HINT),
                     SageMajor(2, "install sageattention >= 2: " + INSTALL_HINT), cuda(min_arch=min_arch),
                     *checks, SageSelfCheck(function, tuple(sorted(kwargs.items())))),
        dtypes=HALF, max_head_dim=128, twin=twin, install_hint=INSTALL_HINT,
        lse=LSEForm(partial(_call_lse, function, kwargs), ("cuda",), lambda q: label(q.device) + "[lse]"),
        label=lambda q, *_: label(q.device), bench=BenchProfile(traffic(widths, prepass_reads)),
        notes="quantization inside sageattention's call (not timed apart)", **extra)


def _call_fn(function, kwargs, q, k, v, *, scale=None, is_causal=False):
    return _call(function, kwargs, q, k, v, scale, is_causal, lse=False)


def _call_lse(function, kwargs, q, k, v, *, scale=None, is_causal=False):
    return _call(function, kwargs, q, k, v, scale, is_causal, lse=True)


def _fixed(name: str) -> Callable[[torch.device], str]:
    return lambda device: name


def _gran_label(function: Callable[[torch.device], str], gran: str) -> Callable[[torch.device], str]:
    return lambda device: f"sageattention.{function(device)}[gran={gran}]"


def _bind_gran(pv: str):
    """The bind hook of sagev2_fp8 / sagev2_fp16: the same function with ``qk_quant_gran`` set."""

    def bind(base: Backend, opts: dict) -> Backend:
        gran = opts["gran"]
        function = _fp8_function if pv == "fp8" else _fixed(FP16_CUDA)
        kwargs = dict(qk_quant_gran=gran, pv_accum_dtype="fp32+fp32" if pv == "fp8" else "fp32")
        label = _gran_label(function, gran)
        twin = "sagev2_emu" + {("fp8", "per_thread"): "", ("fp8", "per_warp"): ":gran=per_warp",
                               ("fp16", "per_thread"): ":pv=fp16", ("fp16", "per_warp"): ":pv=fp16+gran=per_warp"}[
            (pv, gran)]
        constraints = (*(c for c in base.constraints if not isinstance(c, SageSelfCheck)),
                       SageSelfCheck(function, tuple(sorted(kwargs.items()))))  # the bound options' own call
        return dataclasses.replace(
            base, fn=partial(_call_fn, function, kwargs), twin=twin, constraints=constraints,
            kernel=f"{base.kernel.split('[')[0]}[gran={gran}]",
            label=lambda q, *_: label(q.device),
            lse=LSEForm(partial(_call_lse, function, kwargs), ("cuda",), lambda q: label(q.device) + "[lse]"))

    return bind


register(_entry(
    "sagev2", "SageAttention 2's dispatcher (sageattn): on Hopper INT8 Q·Kᵀ + fp8 P·V with two-level fp32 "
    "accumulation -- the accurate fp8 path", lambda device: "sageattn", {},
    label=lambda device: picked_kernel(device), twin="sagev2_emu", min_arch=(8, 0), checks=(SageDispatch(),),
    widths=(1, 1, 1), prepass_reads=(1, 2, 3), kernel="sageattention.sageattn[picked per GPU]"))
register(_entry(
    "sagev2_fp8", "SageAttention 2, fp8 P·V kernel for the GPU (sm90: ..._fp8_cuda_sm90; sm89/sm120: ..._fp8_cuda), "
    "INT8 Q·Kᵀ, pv_accum fp32+fp32", _fp8_function,
    dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32+fp32"),
    label=_gran_label(_fp8_function, "per_thread"), twin="sagev2_emu", min_arch=(8, 9),
    checks=(SageFunction(_fp8_function),), widths=(1, 1, 1), prepass_reads=(1, 2, 3),
    kernel="sageattention.sageattn_qk_int8_pv_fp8_cuda(_sm90)[gran=per_thread]", options=(GRAN,),
    bind=_bind_gran("fp8")))
register(_entry(
    "sagev2_fp16", "SageAttention 2, INT8 Q·Kᵀ + fp16 P·V with an fp32 accumulator (sageattn_qk_int8_pv_fp16_cuda)",
    _fixed(FP16_CUDA), dict(qk_quant_gran="per_thread", pv_accum_dtype="fp32"),
    label=_gran_label(_fixed(FP16_CUDA), "per_thread"), twin="sagev2_emu:pv=fp16", min_arch=(8, 0),
    checks=(SageFunction(_fixed(FP16_CUDA)),), widths=(1, 1, 2), prepass_reads=(1, 2, 1),
    kernel=f"sageattention.{FP16_CUDA}[gran=per_thread]", options=(GRAN,), bind=_bind_gran("fp16")))
register(_entry(
    "sagev2_triton", "SageAttention 2's Triton kernel (sageattn_qk_int8_pv_fp16_triton): SageAttention 1's INT8 per "
    "block + fp16 P·V", _fixed(FP16_TRITON), {}, label=lambda device: f"sageattention.{FP16_TRITON}",
    twin="sagev2_emu:pv=fp16+gran=per_block", min_arch=(8, 0), checks=(SageFunction(_fixed(FP16_TRITON)),),
    widths=(1, 1, 2), prepass_reads=(1, 2, 1), kernel=f"sageattention.{FP16_TRITON}"))
