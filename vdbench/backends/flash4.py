"""FlashAttention-4 (``flash-attn-4``, module ``flash_attn.cute``): Tri Dao's kernels written in the CUTLASS Python
DSL (``nvidia-cutlass-dsl``), compiled on the first call of each configuration; with its log-sum-exp form.

What the package offers (read from flash-attn-4 4.0.0b36, a pre-release): ``flash_attn.cute.flash_attn_func(q, k, v,
softmax_scale=None, causal=False, ..., return_lse=False) -> (out, lse)`` on BSHD tensors, fp16 / bf16 (fp8 on sm100
only, not used here); ``lse`` is (batch, heads, seq_q) fp32, natural log, None unless ``return_lse``. Its forward
dispatches on the GPU's architecture: a Hopper kernel (sm90: head dims 8..256), a Blackwell one (sm100/sm110: head
dims 8..128, and 256), and an SM80-MMA path that sm8x and sm120 share. The package describes itself as for Hopper and
Blackwell, so the entry asks for sm90 or newer; the per-architecture head-dim rule is checked here (availability,
and each call) so that a call the package would refuse with an assertion is refused with the reason instead.

Why a module of its own beside ``flash.py``: FA4 is another package with its own architecture rules; the
``flash_attn`` package name it shares with FlashAttention-2 is why its availability check does not import the
parent package (``registry._findable``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .registry import HALF, Backend, LSEForm, UnsupportedCall, cuda, register, requires_package

ORDER = 22

_MODULE = "flash_attn.cute"
_HINT = "pip install flash-attn-4 --pre; a pre-release, it brings nvidia-cutlass-dsl"
KERNEL = "fa4.flash_attn_func"
#: head dims of FA4's forward per compute capability major (16-bit inputs: multiples of 8); sm8x / sm120 (the SM80
#: path) are not listed: the entry asks for sm90 or newer, and the package checks nothing there.
_HEAD_DIM_RULE = {9: "8..256, a multiple of 8", 10: "8..128 or 256, a multiple of 8", 11: "8..128 or 256, a multiple of 8"}


def _head_dim_problem(major: int, head_dim: int) -> Optional[str]:
    if major == 9:
        ok = 8 <= head_dim <= 256 and head_dim % 8 == 0
    elif major in (10, 11):
        ok = (8 <= head_dim <= 128 or head_dim == 256) and head_dim % 8 == 0
    else:
        return None
    return None if ok else (f"does not support head dim {head_dim} on sm_{major}x (FA4 takes "
                            f"{_HEAD_DIM_RULE[major]} there)")


_CAPS: dict = {}  # device -> compute capability major, asked once (every call checks the head dim against it)


def _major(device: torch.device) -> int:
    if device not in _CAPS:
        _CAPS[device] = torch.cuda.get_device_capability(device)[0]
    return _CAPS[device]


class _HeadDimOnArch:
    """Availability check: the head dim FA4's forward takes on this GPU's architecture."""

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        if head_dim is None or device.type != "cuda":
            return None
        return _head_dim_problem(_major(device), head_dim)


def _fa4_call(q, k, v, scale, is_causal, *, lse: bool):
    """FA4 on BHSD inputs (transposed views to its BSHD; no copy); with ``lse`` also its log-sum-exp (B, H, S)."""
    if q.is_cuda:
        problem = _head_dim_problem(_major(q.device), q.shape[-1])
        if problem:
            raise UnsupportedCall(f"backend 'fav4' {problem}")
    from flash_attn.cute import flash_attn_func

    res = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=is_causal, return_lse=lse)
    # 4.0.0b36 returns (out, lse) always (lse None unless asked); accept a bare output too, as FA3's versions differ
    out = (res[0] if isinstance(res, tuple) else res).transpose(1, 2)
    if not lse:
        return out
    return out, res[1].float()


def _fav4(q, k, v, *, scale=None, is_causal=False):
    return _fa4_call(q, k, v, scale, is_causal, lse=False)


def _lse_fav4(q, k, v, *, scale=None, is_causal=False):
    return _fa4_call(q, k, v, scale, is_causal, lse=True)


register(Backend(
    "fav4", "FlashAttention-4 (flash-attn-4, flash_attn.cute; CUTLASS Python DSL), Hopper and Blackwell", fn=_fav4,
    kernel=KERNEL, layout="BSHD",
    constraints=(requires_package(_MODULE, hint=_HINT), cuda(min_arch=(9, 0)), _HeadDimOnArch()),
    dtypes=HALF, max_head_dim=256, aliases=("fa4",),
    lse=LSEForm(_lse_fav4, ("cuda",), KERNEL + "[lse]"),
    notes="compiles each configuration on its first call (cutlass-dsl, 3-4 s on an H200); head dims: sm90 8..256, "
          "sm100 <=128 or 256; on Hopper at FA3's speed"))
