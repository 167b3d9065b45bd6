"""The attention backend registry: one name -> one callable, its availability and its capabilities.

Every CLI of the project (run_wan.py, sageattn_cogvideo.py, bench/) takes the same names. A backend is a
callable with ONE layout convention, the one of ``torch.nn.functional.scaled_dot_product_attention``::

    out = backend(q, k, v, scale=None, is_causal=False)      # q, k, v, out: (batch, heads, seq, head_dim)

``out`` has q's dtype. Backends whose kernel wants another layout (FlashAttention's BSHD) transpose views
inside; the layout the kernel itself uses is recorded in ``Backend.kernel_layout``.

Why a registry rather than if/else at the call sites: availability needs a *reason* (package missing, no
CUDA, wrong architecture, unsupported head dim or dtype) so a run that asks for a backend that can't run
stops before any work with a message that says why, and every call site (patching, bench, the capability
table of ``--list_backends``) agrees on what a name means. Optional kernel packages are imported lazily:
importing this module never imports ``sageattention`` or ``flash_attn``.

The emulated backends (``sagev1_emu``, ``fp8_emu``) are pure torch. They reproduce the numerics of the
quantized kernels (INT8 per-block Q/K with K smoothing; fp8 e4m3 Q/K/V with per-(batch, head) scales and an
e4m3 P) on any device, so their accuracy can be tested on a CPU and compared with the real kernels on a GPU.
They are slow by construction and never used to report speed.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "Backend",
    "BackendUnavailable",
    "UnsupportedCall",
    "BACKENDS",
    "get_backend",
    "names",
    "availability",
    "available_names",
    "capability_table",
    "reference_attention",
    "exact_attention",
    "sdpa_kernel_choice",
    "sagev1_emulated",
    "fp8_emulated",
    "quantize_fp8",
    "quantize_int8_per_block",
]

LOG2E = 1.4426950408889634
FP8_E4M3_MAX = 448.0


class BackendUnavailable(RuntimeError):
    """A requested backend cannot run here (package, device, architecture, dtype or head dim)."""


class UnsupportedCall(RuntimeError):
    """One attention call has arguments the backend cannot serve (a mask, dropout, a dtype, a head dim)."""


@dataclass(frozen=True)
class Backend:
    """A registry entry. ``fn`` follows the module's layout convention (BHSD in, BHSD out)."""

    name: str
    description: str
    fn: Optional[Callable[..., torch.Tensor]]
    kernel: str  # label of the kernel that runs; call counts are keyed by it
    packages: tuple[str, ...] = ()  # importable modules, any one of which provides the kernel
    cuda_only: bool = False
    min_arch: Optional[tuple[int, int]] = None  # minimum CUDA compute capability
    exact_arch: Optional[tuple[int, ...]] = None  # kernel built only for these majors (FA3: Hopper)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    head_dims: Optional[tuple[int, ...]] = None  # None: any
    max_head_dim: Optional[int] = None
    supports_mask: bool = False
    supports_causal: bool = True
    returns_lse: bool = False
    emulated: bool = False
    kernel_layout: str = "BHSD"
    reserved: Optional[str] = None  # a name kept for a kernel that doesn't exist yet, with the reason
    notes: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def check_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None,
                   dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> None:
        """Raise UnsupportedCall if this backend cannot serve the call exactly as asked."""
        if attn_mask is not None and not self.supports_mask:
            raise UnsupportedCall(f"backend '{self.name}' does not support an attention mask "
                                  f"(got mask of shape {tuple(attn_mask.shape)})")
        if dropout_p:
            raise UnsupportedCall(f"backend '{self.name}' does not support dropout (dropout_p={dropout_p})")
        if is_causal and not self.supports_causal:
            raise UnsupportedCall(f"backend '{self.name}' does not support causal attention")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise UnsupportedCall(f"backend '{self.name}' needs 4-D (batch, heads, seq, dim) inputs, got "
                                  f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if k.shape[1] != q.shape[1] and not enable_gqa:
            raise UnsupportedCall(f"backend '{self.name}': query has {q.shape[1]} heads, key {k.shape[1]} "
                                  "(grouped-query attention not requested)")
        if q.dtype not in self.dtypes:
            raise UnsupportedCall(f"backend '{self.name}' does not support dtype {q.dtype} "
                                  f"(supports {_dtype_names(self.dtypes)})")
        reason = self.head_dim_problem(q.shape[-1])
        if reason:
            raise UnsupportedCall(reason)

    def head_dim_problem(self, head_dim: int) -> Optional[str]:
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"backend '{self.name}' does not support head dim {head_dim} (supports {list(self.head_dims)})"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"backend '{self.name}' supports head dims up to {self.max_head_dim}, got {head_dim}"
        return None

    def __call__(self, q, k, v, *, scale=None, is_causal=False):
        if self.fn is None:
            raise BackendUnavailable(f"backend '{self.name}' has no callable: {self.reserved or 'not runnable'}")
        return self.fn(q, k, v, scale=scale, is_causal=is_causal)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


# ----------------------------------------------------------------------------------------------------------
# Exact references
# ----------------------------------------------------------------------------------------------------------

def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    # bottom-right aligned, as FlashAttention and sdpa (for sq == sk both conventions agree)
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def _query_chunk(q: torch.Tensor, sk: int, itemsize: int, budget_bytes: int = 512 << 20) -> int:
    b, h = q.shape[0], q.shape[1]
    per_row = max(1, b * h * sk * itemsize)
    return max(1, min(q.shape[2], budget_bytes // per_row))


def exact_attention(q, k, v, *, scale=None, is_causal=False, attn_mask=None, dtype=torch.float64,
                    return_lse=False):
    """Softmax attention computed explicitly in ``dtype`` (default fp64), chunked over queries.

    The ground truth for accuracy figures: no fused kernel, no online softmax, no reduced precision.
    Chunking bounds memory at about 512 MiB of scores whatever the sequence length.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    if kd.shape[1] != qd.shape[1]:  # grouped-query attention: repeat K/V heads
        rep = qd.shape[1] // kd.shape[1]
        kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    sq, sk = qd.shape[2], kd.shape[2]
    out = torch.empty(qd.shape[:-1] + (vd.shape[-1],), dtype=dtype, device=q.device)
    lse = torch.empty(qd.shape[:-1], dtype=dtype, device=q.device) if return_lse else None
    step = _query_chunk(qd, sk, torch.finfo(dtype).bits // 8)
    kt = kd.transpose(-1, -2)
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        s = torch.matmul(qd[:, :, s0:s1], kt) * scale
        if is_causal:
            s = s.masked_fill(~_causal_mask(sq, sk, q.device)[s0:s1], float("-inf"))
        if attn_mask is not None:
            m = attn_mask[..., s0:s1, :] if attn_mask.shape[-2] == sq else attn_mask
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(dtype)
        if return_lse:
            lse[:, :, s0:s1] = torch.logsumexp(s, dim=-1)
        out[:, :, s0:s1] = torch.matmul(torch.softmax(s, dim=-1), vd)
    return (out, lse) if return_lse else out


def reference_attention(q, k, v, *, scale=None, is_causal=False):
    """The ``reference`` backend: exact fp32 math-softmax attention, output cast back to q's dtype."""
    return exact_attention(q, k, v, scale=scale, is_causal=is_causal, dtype=torch.float32).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# torch sdpa and its kernels
# ----------------------------------------------------------------------------------------------------------

_SDPA_KERNEL_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
                      "cudnn": "CUDNN_ATTENTION"}


def sdpa_kernel_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False) -> str:
    """Which kernel plain ``F.scaled_dot_product_attention`` picks for these inputs ('flash', 'cudnn', ...).

    Uses torch's own selector (``torch._fused_sdp_choice``), so the call counts of the ``sdpa`` and
    ``default`` backends name the kernel that really ran rather than 'auto'.
    """
    try:
        idx = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                      enable_gqa=enable_gqa)
        name = torch.nn.attention.SDPBackend(idx).name
    except Exception:  # private API: never let bookkeeping break a run
        return "unknown"
    return {v_: k_ for k_, v_ in _SDPA_KERNEL_NAMES.items()}.get(name, name.lower())


def _sdpa_auto(q, k, v, *, scale=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def _make_forced_sdpa(kernel: str) -> Callable:
    from torch.nn.attention import SDPBackend

    backend = getattr(SDPBackend, _SDPA_KERNEL_NAMES[kernel])

    def fn(q, k, v, *, scale=None, is_causal=False):
        # sdpa_kernel with a single backend raises ("No available kernel") instead of falling back.
        with torch.nn.attention.sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

    fn.__name__ = f"sdpa_{kernel}"
    return fn


# ----------------------------------------------------------------------------------------------------------
# Quantization shared by real kernels and their emulations
# ----------------------------------------------------------------------------------------------------------

def quantize_int8_per_block(x: torch.Tensor, block: int, pre_scale: float = 1.0):
    """SageAttention v1's per-block INT8 quantization of a (B, H, S, D) tensor.

    One scale per ``block`` consecutive tokens per head: scale = max|x·pre_scale| / 127, values rounded
    half away from zero (as the Triton kernel does: ``x/scale + 0.5·sign`` then truncation).
    Returns (int-valued float32 tensor of the padded length, scales of shape (B, H, n_blocks, 1)).
    """
    b, h, s, d = x.shape
    xs = x.float() * pre_scale
    pad = (-s) % block
    if pad:
        xs = F.pad(xs, (0, 0, 0, pad))
    xb = xs.view(b, h, -1, block, d)
    scale = xb.abs().amax(dim=(-1, -2)) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    qv = xb / safe[..., None, None]
    qv = torch.trunc(qv + 0.5 * torch.sign(qv)).clamp_(-127, 127)
    return qv.view(b, h, -1, d), scale[..., None]


def quantize_fp8(x: torch.Tensor, granularity: str = "bh", block: int = 128):
    """Quantize a (B, H, S, D) tensor to fp8 e4m3 with scales as FA3's fp8 path takes them.

    ``granularity``: ``"tensor"`` (one scale), ``"bh"`` (one per batch and head: the shape of FA3's
    ``q_descale``/``k_descale``/``v_descale``, (B, H)) or ``"block"`` (one per ``block`` tokens per head,
    finer than FA3 can take; used by the emulation to show what finer scales buy).
    Returns (e4m3 tensor, descale broadcastable to x, the descale in FA3's (B, H) shape or None).
    """
    xf = x.float()
    b, h, s, d = x.shape
    if granularity == "tensor":
        amax = xf.abs().amax().reshape(1, 1, 1, 1)
    elif granularity == "bh":
        amax = xf.abs().amax(dim=(-1, -2), keepdim=True)
    elif granularity == "block":
        pad = (-s) % block
        xp = F.pad(xf, (0, 0, 0, pad)) if pad else xf
        amax = xp.view(b, h, -1, block, d).abs().amax(dim=(-1, -2), keepdim=True)
        amax = amax.expand(b, h, xp.shape[2] // block, block, 1).reshape(b, h, -1, 1)[:, :, :s]
    else:
        raise ValueError(f"unknown fp8 scale granularity {granularity!r} (tensor, bh, block)")
    descale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    x8 = (xf / descale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    fa3_descale = None
    if granularity in ("tensor", "bh"):
        fa3_descale = descale.reshape(descale.shape[0], descale.shape[1]).expand(b, h).contiguous()
    return x8, descale, fa3_descale


# ----------------------------------------------------------------------------------------------------------
# Emulations (pure torch, any device)
# ----------------------------------------------------------------------------------------------------------

SAGE_BLKQ, SAGE_BLKK = 128, 64


def sagev1_emulated(q, k, v, *, scale=None, is_causal=False, smooth_k=True):
    """SageAttention v1 numerics in pure torch.

    K is mean-smoothed over the sequence (softmax is invariant to it), Q (pre-multiplied by
    scale·log2 e) and K are quantized to INT8 per block of 128 / 64 tokens, S = Q8·K8ᵀ is exact integer
    arithmetic times the two scales, the softmax uses exp2, and P·V takes P and V rounded to fp16 with an
    fp32 accumulator — the operand precisions of the Triton kernel. Chunked over query blocks.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kf = k.float()
    if smooth_k:
        kf = kf - kf.mean(dim=2, keepdim=True)
    sq, sk = q.shape[2], k.shape[2]
    q8, qs = quantize_int8_per_block(q, SAGE_BLKQ, pre_scale=scale * LOG2E)
    k8, ks = quantize_int8_per_block(kf, SAGE_BLKK)
    k8, ks = k8[:, :, :sk], ks.repeat_interleave(SAGE_BLKK, dim=2)[:, :, :sk, 0]  # per-key scale
    vh = v.to(torch.float16).float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    step = max(SAGE_BLKQ, _query_chunk(q, sk, 4) // SAGE_BLKQ * SAGE_BLKQ)
    k8t = k8.transpose(-1, -2)
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        qblk = q8[:, :, s0:s1]
        qsc = qs.repeat_interleave(SAGE_BLKQ, dim=2)[:, :, s0:s1]  # (B,H,n,1)
        s = torch.matmul(qblk, k8t) * qsc * ks[:, :, None, :]  # log2-domain scores
        if is_causal:
            s = s.masked_fill(~_causal_mask(sq, sk, q.device)[s0:s1], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp2(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        out[:, :, s0:s1] = torch.matmul(p.to(torch.float16).float(), vh) / denom
    return out.to(q.dtype)


def fp8_emulated(q, k, v, *, scale=None, is_causal=False, granularity="bh"):
    """FA3 fp8 numerics in pure torch: e4m3 Q, K, V with the same scales ``fav3_fp8`` passes to FA3.

    S = Q8·K8ᵀ · q_descale · k_descale · scale in fp32; P = exp(S - max) in fp32, its row sum taken in
    fp32, then P rounded to e4m3 for the P·V product (as the FA3 fp8 kernel feeds P to its fp8 wgmma);
    O = (P8·V8) · v_descale / rowsum.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q8, qd, _ = quantize_fp8(q, granularity)
    k8, kd, _ = quantize_fp8(k, granularity)
    v8, vd, _ = quantize_fp8(v, granularity)
    qf, kf, vf = q8.float() * qd, k8.float() * kd, v8.float()
    sq, sk = q.shape[2], k.shape[2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    step = _query_chunk(q, sk, 4)
    kt = kf.transpose(-1, -2)
    v_descale = vd if vd.shape[2] == 1 else None
    if v_descale is None:  # per-block V scales: fold them into V (what a per-block kernel does per tile)
        vf = vf * vd
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        s = torch.matmul(qf[:, :, s0:s1], kt) * scale
        if is_causal:
            s = s.masked_fill(~_causal_mask(sq, sk, q.device)[s0:s1], float("-inf"))
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(p.to(torch.float8_e4m3fn).float(), vf)
        if v_descale is not None:
            o = o * v_descale
        out[:, :, s0:s1] = o / denom
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Real kernels from optional packages (imported lazily)
# ----------------------------------------------------------------------------------------------------------

def _sagev1(q, k, v, *, scale=None, is_causal=False):
    from sageattention import sageattn

    # sageattn smooths K in place (k -= mean): give it a copy so the caller's tensor is untouched.
    return sageattn(q, k.clone(), v, tensor_layout="HND", is_causal=is_causal, sm_scale=scale)


def _fav2(q, k, v, *, scale=None, is_causal=False):
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=is_causal)
    return out.transpose(1, 2)


def _fa3_module():
    for mod in ("flash_attn_interface", "fa3_fwd_interface"):
        if importlib.util.find_spec(mod) is not None:
            return importlib.import_module(mod)
    raise BackendUnavailable("no FlashAttention-3 module (flash_attn_interface or fa3_fwd_interface)")


def _fa3_out(res):
    # flash_attn_interface versions differ: some return (out, lse), newer ones out alone.
    return res[0] if isinstance(res, tuple) else res


def _fa3_call(q, k, v, scale, is_causal, *, fp8: bool, lse: bool):
    """FA3 on BHSD inputs: bf16, or e4m3 with one scale per (batch, head) (the finest FA3's descale arguments
    take); with ``lse`` also its log-sum-exp (B, H, S) fp32, for ring attention. One call site for all four
    backends (plain / fp8, with / without LSE), so they can't drift apart."""
    fa3 = _fa3_module()
    kw = dict(causal=is_causal)
    if fp8:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        (q8, _, qd), (k8, _, kd), (v8, _, vd) = (quantize_fp8(t, "bh") for t in (q, k, v))
        q_, k_, v_ = q8, k8, v8
        kw.update(q_descale=qd, k_descale=kd, v_descale=vd)
    else:
        q_, k_, v_ = q, k, v
    if lse:
        kw["return_attn_probs"] = True
    res = fa3.flash_attn_func(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), softmax_scale=scale,
                              **kw)
    out = (res[0] if lse else _fa3_out(res)).transpose(1, 2)
    if fp8:
        out = out.to(q.dtype)
    return (out, res[1].float()) if lse else out


def _fav3(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=False, lse=False)


def _fav3_fp8(q, k, v, *, scale=None, is_causal=False):
    """FA3 on e4m3 inputs, one scale per (batch, head) (the finest FA3's descale arguments take)."""
    return _fa3_call(q, k, v, scale, is_causal, fp8=True, lse=False)


def _triton_kernel(name: str) -> Callable:
    """The project's own Triton kernels (vdbench/kernels), imported on first call."""

    def fn(q, k, v, *, scale=None, is_causal=False):
        from vdbench.kernels import attention

        return attention.KERNELS[name](q, k, v, scale=scale, is_causal=is_causal)

    fn.__name__ = name
    return fn


def _triton_probe(name: str) -> Callable:
    def probe(dev):
        from vdbench.kernels import probe as kernels_probe  # never imports triton

        return kernels_probe(name, dev)

    return probe


# ----------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)
_ANY = (torch.float16, torch.bfloat16, torch.float32)

_ENTRIES = [
    Backend("default", "the pipeline's own attention, untouched (diffusers' dispatcher / F.sdpa as shipped)",
            fn=_sdpa_auto, kernel="default", supports_mask=True,
            notes="installed as a counting pass-through: the pipeline's own call runs"),
    Backend("sdpa", "torch F.scaled_dot_product_attention, kernel chosen by torch", fn=_sdpa_auto,
            kernel="sdpa", supports_mask=True),
    Backend("sdpa_flash", "torch sdpa forced to its FlashAttention-2 kernel", fn=_make_forced_sdpa("flash"),
            kernel="sdpa_flash", max_head_dim=256),
    Backend("sdpa_cudnn", "torch sdpa forced to the cuDNN attention kernel", fn=_make_forced_sdpa("cudnn"),
            kernel="sdpa_cudnn", cuda_only=True, min_arch=(8, 0), dtypes=_HALF, max_head_dim=128),
    Backend("sdpa_efficient", "torch sdpa forced to the memory-efficient (xformers-style) kernel",
            fn=_make_forced_sdpa("efficient"), kernel="sdpa_efficient", cuda_only=True, supports_mask=True),
    Backend("sdpa_math", "torch sdpa forced to the math (unfused) kernel", fn=_make_forced_sdpa("math"),
            kernel="sdpa_math", supports_mask=True),
    Backend("reference", "exact: fp32 math softmax attention (explicit, chunked), cast back",
            fn=reference_attention, kernel="reference", supports_mask=False),
    Backend("sagev1", "SageAttention 1.x (sageattention package, Triton): INT8 Q·K, fp16 P·V", fn=_sagev1,
            kernel="sageattention.sageattn", packages=("sageattention",), cuda_only=True, min_arch=(8, 0),
            head_dims=(64, 96, 128), dtypes=_ANY),
    Backend("fav2", "FlashAttention-2 (flash_attn package)", fn=_fav2, kernel="flash_attn.flash_attn_func",
            packages=("flash_attn",), cuda_only=True, min_arch=(8, 0), dtypes=_HALF, max_head_dim=256,
            kernel_layout="BSHD"),
    Backend("fav3", "FlashAttention-3 (flash_attn_interface or fa3_fwd_interface), Hopper", fn=_fav3,
            kernel="fa3.flash_attn_func", packages=("flash_attn_interface", "fa3_fwd_interface"),
            cuda_only=True, exact_arch=(9,), dtypes=(torch.bfloat16,), head_dims=(64, 96, 128, 192, 256),
            kernel_layout="BSHD", notes="fp16 is not built into fa3-fwd: bf16 only"),
    Backend("fav3_fp8", "FlashAttention-3 on fp8 e4m3 Q/K/V, one scale per (batch, head)", fn=_fav3_fp8,
            kernel="fa3.flash_attn_func[e4m3]", packages=("flash_attn_interface", "fa3_fwd_interface"),
            cuda_only=True, exact_arch=(9,), dtypes=_HALF, head_dims=(64, 96, 128, 192, 256),
            kernel_layout="BSHD"),
    Backend("fav3_sage", "the project's Triton kernel: INT8 Q·K per block (K smoothed), exp2 softmax, e4m3 P·V "
            "with a per-channel V scale", fn=_triton_kernel("fav3_sage"), kernel="vdbench.fav3_sage",
            packages=("triton",), dtypes=_HALF, head_dims=(64, 128), extra={"probe": _triton_probe("fav3_sage")},
            notes="quantization pre-pass (Triton) inside the call"),
    Backend("fp8_triton", "the project's Triton kernel: e4m3 Q/K/V with one scale per tile of tokens (K smoothed), "
            "e4m3 P", fn=_triton_kernel("fp8_triton"), kernel="vdbench.fp8_triton", packages=("triton",),
            dtypes=_HALF, head_dims=(64, 128), extra={"probe": _triton_probe("fp8_triton")},
            notes="quantization pre-pass (Triton) inside the call"),
    Backend("fav2_triton", "the project's Triton kernel: plain bf16/fp16 flash-attention forward",
            fn=_triton_kernel("fav2_triton"), kernel="vdbench.fav2_triton", packages=("triton",), dtypes=_HALF,
            head_dims=(64, 128), extra={"probe": _triton_probe("fav2_triton")}),
    Backend("sagev1_emu", "SageAttention v1 numerics emulated in torch (INT8 per-block Q/K, K smoothing, fp16 P·V)",
            fn=sagev1_emulated, kernel="emu.sagev1", emulated=True, dtypes=_ANY),
    Backend("fp8_emu", "FA3 fp8 numerics emulated in torch (e4m3 Q/K/V per-(batch,head) scales, e4m3 P)",
            fn=fp8_emulated, kernel="emu.fp8", emulated=True, dtypes=_ANY),
]

BACKENDS: dict[str, Backend] = {b.name: b for b in _ENTRIES}


def names() -> list[str]:
    return list(BACKENDS)


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown attention backend {name!r}; valid: {', '.join(BACKENDS)}") from None


def _device_of(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def availability(name: str, device=None, dtype: Optional[torch.dtype] = None,
                 head_dim: Optional[int] = None) -> tuple[bool, str]:
    """(available, reason). The reason says what is missing, or what will run when available."""
    b = get_backend(name)
    dev = _device_of(device)
    if b.reserved:
        return False, b.reserved
    if b.packages:
        found = [p for p in b.packages if importlib.util.find_spec(p) is not None]
        if not found:
            return False, f"package not installed: {' or '.join(b.packages)}"
    if b.extra.get("probe") is not None:  # the project's Triton kernels: GPU, or the interpreter on CPU
        ok, why = b.extra["probe"](dev)
        if not ok:
            return False, why
    if b.cuda_only or (b.name == "sdpa_flash" and dev.type == "cuda"):
        if dev.type != "cuda":
            return False, f"needs a CUDA GPU (device is {dev.type})"
        if not torch.cuda.is_available():
            return False, "needs a CUDA GPU (torch.cuda.is_available() is False)"
        cap = torch.cuda.get_device_capability(dev)
        if b.min_arch and cap < b.min_arch:
            return False, f"needs compute capability >= {b.min_arch[0]}.{b.min_arch[1]}, GPU is {cap[0]}.{cap[1]}"
        if b.exact_arch and cap[0] not in b.exact_arch:
            return False, f"built for sm_{b.exact_arch[0]}0 (Hopper) only, GPU is sm_{cap[0]}{cap[1]}"
    if b.name == "sdpa_efficient" and dev.type != "cuda":
        return False, "torch has no memory-efficient kernel on CPU"
    if dtype is not None:
        eff = b.dtypes if not (b.name == "sdpa_flash" and dev.type == "cuda") else _HALF
        if dtype not in eff:
            return False, f"dtype {str(dtype).replace('torch.', '')} unsupported (supports {_dtype_names(eff)})"
    if head_dim is not None:
        problem = b.head_dim_problem(head_dim)
        if problem:
            return False, problem.replace(f"backend '{b.name}' ", "")
    return True, "ok"


def available_names(device=None, dtype=None, head_dim=None) -> list[str]:
    return [n for n in BACKENDS if availability(n, device, dtype, head_dim)[0]]


def capability_table(device=None, dtype=None, head_dim=None) -> str:
    """The table ``--list_backends`` prints: name, availability and reason, dtypes, head dims, layout, flags."""
    dev = _device_of(device)
    rows = [("backend", "available", "kernel", "dtypes", "head dims", "mask", "causal", "lse", "layout",
             "reason / notes")]
    for b in BACKENDS.values():
        ok, reason = availability(b.name, dev, dtype, head_dim)
        hd = ",".join(map(str, b.head_dims)) if b.head_dims else (f"<={b.max_head_dim}" if b.max_head_dim else "any")
        note = reason if not ok else (b.notes or ("emulated, slow" if b.emulated else ""))
        rows.append((b.name, "yes" if ok else "no", b.kernel, _dtype_names(b.dtypes).replace("float", "f"), hd,
                     "y" if b.supports_mask else "-", "y" if b.supports_causal else "-",
                     "y" if b.returns_lse else "-", b.kernel_layout, note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"attention backends on {dev}" + (f", dtype {dtype}" if dtype else "")
             + (f", head dim {head_dim}" if head_dim else "") + " (layout convention: BHSD)"]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Log-sum-exp variants (ring attention merges partial results with each block's LSE)
# ----------------------------------------------------------------------------------------------------------
# ``lse_function(name, device)`` returns a BHSD callable ``fn(q, k, v, *, scale=None, is_causal=False) ->
# (out, lse)`` with ``lse`` of shape (batch, heads, seq_q), float32, the natural-log LSE of the scaled scores
# — the kernel's own LSE, never recomputed beside it — or None with the reason. A backend without one can't
# serve ring attention; the parallel setup refuses it before any work (vdbench.parallel).

def _lse_reference(q, k, v, *, scale=None, is_causal=False):
    out, lse = exact_attention(q, k, v, scale=scale, is_causal=is_causal, dtype=torch.float32, return_lse=True)
    return out.to(q.dtype), lse


def _lse_sdpa_flash(q, k, v, *, scale=None, is_causal=False):
    if q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    else:  # the CPU flash kernel (what plain sdpa runs on a CPU for unmasked fp32/bf16 inputs)
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return res[0], res[1].float()


def _lse_sdpa_cudnn(q, k, v, *, scale=None, is_causal=False):
    # contiguous: the cuDNN aten op gives wrong results on non-contiguous inputs (diffusers notes the same)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                             None, True, 0.0, is_causal, False, scale=scale)
    lse = res[1]
    return res[0], (lse.squeeze(-1) if lse.dim() == 4 else lse).float()


def _lse_sdpa_efficient(q, k, v, *, scale=None, is_causal=False):
    res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)
    return res[0], res[1][:, :, :q.shape[2]].float()  # the kernel pads LSE's sequence dim to a multiple of 32


def _lse_fav3(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=False, lse=True)


def _lse_fav3_fp8(q, k, v, *, scale=None, is_causal=False):
    return _fa3_call(q, k, v, scale, is_causal, fp8=True, lse=True)


# name -> (fn, devices it gives an LSE on, label of the kernel that runs)
_LSE_FUNCTIONS: dict[str, tuple[Callable, tuple[str, ...], str]] = {
    "reference": (_lse_reference, ("cpu", "cuda"), "reference[lse]"),
    "sdpa": (_lse_sdpa_flash, ("cpu",), "sdpa[flash][lse]"),  # on CUDA torch may pick cuDNN: name it instead
    "sdpa_flash": (_lse_sdpa_flash, ("cpu", "cuda"), "sdpa_flash[lse]"),
    "sdpa_cudnn": (_lse_sdpa_cudnn, ("cuda",), "sdpa_cudnn[lse]"),
    "sdpa_efficient": (_lse_sdpa_efficient, ("cuda",), "sdpa_efficient[lse]"),
    "fav3": (_lse_fav3, ("cuda",), "fa3.flash_attn_func[lse]"),
    "fav3_fp8": (_lse_fav3_fp8, ("cuda",), "fa3.flash_attn_func[e4m3][lse]"),
}

_NO_LSE_REASONS = {
    "default": "the pipeline's own attention (diffusers 'native' sdpa) does not return the log-sum-exp",
    "sdpa_math": "torch's math kernel returns the attention weights, not the log-sum-exp",
    "sagev1": "sageattention 1.0.6's sageattn() has no log-sum-exp output",
    "fav2": "the fav2 wrapper does not return flash_attn's log-sum-exp",
    "sagev1_emu": "the SageAttention emulation does not compute a log-sum-exp",
    "fp8_emu": "the fp8 emulation does not compute a log-sum-exp",
}


def lse_function(name: str, device=None) -> tuple[Optional[Callable], Optional[str], str]:
    """(fn, kernel label, reason): the LSE-returning form of backend ``name`` on ``device``, or (None, None, why)."""
    get_backend(name)
    dev = _device_of(device).type
    entry = _LSE_FUNCTIONS.get(name)
    if entry is None:
        return None, None, _NO_LSE_REASONS.get(name, f"backend '{name}' has no log-sum-exp-returning form")
    fn, devices, label = entry
    if dev not in devices:
        return None, None, f"backend '{name}' returns the log-sum-exp only on {', '.join(devices)} (device is {dev})"
    return fn, label, "ok"


for _n in _LSE_FUNCTIONS:  # the capability flag --list_backends shows (lse column)
    if _n in BACKENDS:
        BACKENDS[_n] = replace(BACKENDS[_n], returns_lse=True)
