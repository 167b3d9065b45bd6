"""torch's own attention: the pipeline's untouched call, ``F.scaled_dot_product_attention`` (auto or forced to one
of its kernels) and the exact fp32 reference, with their log-sum-exp forms for ring attention."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from vdbench.numerics import exact_attention, reference_attention

from .registry import HALF, Backend, LSEForm, cuda, cuda_dtypes, register

ORDER = 0

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


def _sdpa_label(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str:
    return f"sdpa[{sdpa_kernel_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)}]"


def _sdpa_auto(q, k, v, *, scale=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def _sdp_switches(backend) -> Optional[list[tuple[Callable, Callable, bool]]]:
    """(getter, setter, on) for each of torch's sdpa backend switches, ``on`` for ``backend`` alone: the switches
    ``torch.nn.attention.sdpa_kernel`` flips (its own table of them), or None where this torch has no such table."""
    names = getattr(torch.nn.attention, "_backend_names", None)
    if not isinstance(names, dict):
        return None
    try:
        return [(getattr(torch._C, f"_get_{name}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{name}"),
                 getattr(torch.nn.attention.SDPBackend, member) == backend) for name, member in names.items()]
    except AttributeError:
        return None


def _make_forced_sdpa(kernel: str) -> Callable:
    """torch sdpa with only ``kernel`` enabled: it raises ("No available kernel") where that kernel can't run instead
    of falling back. The switches are flipped around each call as ``sdpa_kernel([backend])`` flips them, but directly:
    the context manager's generator and name lookups cost ~17 us a call (measured on the CI CPU), the direct flips
    ~2 us -- vdbench's share of a call that diffusers' and xfuser's cuDNN backends make with no switch at all."""
    from torch.nn.attention import SDPBackend

    backend = getattr(SDPBackend, _SDPA_KERNEL_NAMES[kernel])
    switches = _sdp_switches(backend)

    if switches is None:  # a torch without sdpa_kernel's switch table: the context manager itself, same semantics
        def fn(q, k, v, *, scale=None, is_causal=False):
            with torch.nn.attention.sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    else:
        def fn(q, k, v, *, scale=None, is_causal=False):
            before = [get() for get, _, _ in switches]
            try:
                for _, put, on in switches:
                    put(on)
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
            finally:
                for (_, put, _), was in zip(switches, before):
                    put(was)

    fn.__name__ = f"sdpa_{kernel}"
    return fn


# ----- log-sum-exp forms: the aten ops under sdpa return it beside the output -----

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


register(Backend(
    "default", "the pipeline's own attention, untouched (diffusers' dispatcher / F.sdpa as shipped)",
    fn=_sdpa_auto, kernel="default", supports_mask=True, passthrough=True, label=_sdpa_label,
    no_lse_reason="the pipeline's own attention (diffusers 'native' sdpa) does not return the log-sum-exp",
    notes="installed as a counting pass-through: the pipeline's own call runs"))
register(Backend(
    "sdpa", "torch F.scaled_dot_product_attention, kernel chosen by torch", fn=_sdpa_auto, kernel="sdpa",
    supports_mask=True, label=_sdpa_label, aliases=("native", "torch_sdpa"),
    # on CUDA torch may pick cuDNN or the efficient kernel: name those instead
    lse=LSEForm(_lse_sdpa_flash, ("cpu",), "sdpa[flash][lse]")))
register(Backend(
    "sdpa_flash", "torch sdpa forced to its FlashAttention-2 kernel", fn=_make_forced_sdpa("flash"),
    kernel="sdpa_flash", max_head_dim=256, constraints=(cuda_dtypes(*HALF),), aliases=("_native_flash",),
    lse=LSEForm(_lse_sdpa_flash, ("cpu", "cuda"), "sdpa_flash[lse]")))
register(Backend(
    "sdpa_cudnn", "torch sdpa forced to the cuDNN attention kernel", fn=_make_forced_sdpa("cudnn"),
    kernel="sdpa_cudnn", constraints=(cuda(min_arch=(8, 0)),), dtypes=HALF, max_head_dim=128,
    aliases=("_native_cudnn",), lse=LSEForm(_lse_sdpa_cudnn, ("cuda",), "sdpa_cudnn[lse]")))
register(Backend(
    "sdpa_efficient", "torch sdpa forced to the memory-efficient (xformers-style) kernel",
    fn=_make_forced_sdpa("efficient"), kernel="sdpa_efficient", supports_mask=True,
    constraints=(cuda(),), aliases=("_native_efficient",),
    lse=LSEForm(_lse_sdpa_efficient, ("cuda",), "sdpa_efficient[lse]")))
register(Backend(
    "sdpa_math", "torch sdpa forced to the math (unfused) kernel", fn=_make_forced_sdpa("math"), kernel="sdpa_math",
    supports_mask=True, aliases=("_native_math",),
    no_lse_reason="torch's math kernel returns the attention weights, not the log-sum-exp"))
register(Backend(
    "reference", "exact: fp32 math softmax attention (explicit, chunked), cast back", fn=reference_attention,
    kernel="reference", lse=LSEForm(_lse_reference, ("cpu", "cuda"), "reference[lse]")))
