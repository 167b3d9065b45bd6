"""SageAttention 1.x (the ``sageattention`` package, Triton): INT8 Q·K per block with K smoothing, fp16 P·V."""

from __future__ import annotations

from .registry import ANY_FLOAT, Backend, cuda, register, requires_package, traffic

ORDER = 10


def _sagev1(q, k, v, *, scale=None, is_causal=False):
    from sageattention import sageattn

    # sageattn smooths K in place (k -= mean): give it a copy so the caller's tensor is untouched.
    return sageattn(q, k.clone(), v, tensor_layout="HND", is_causal=is_causal, sm_scale=scale)


register(Backend(
    "sagev1", "SageAttention 1.x (sageattention package, Triton): INT8 Q·K, fp16 P·V", fn=_sagev1,
    kernel="sageattention.sageattn",
    constraints=(requires_package("sageattention", hint="pip install -e '.[sage]'"), cuda(min_arch=(8, 0))),
    head_dims=(64, 96, 128), dtypes=ANY_FLOAT, twin="sagev1_emu",
    aliases=("sage", "sage_attn", "_sage_qk_int8_pv_fp16_triton"),
    no_lse_reason="sageattention 1.0.6's sageattn() has no log-sum-exp output",
    # int8 Q/K, fp16 V; its pre-pass (reads Q/K, writes int8) runs inside sageattn(), which exposes no way to
    # run it alone: counted in the bytes, not timed apart
    bytes_model=traffic((1, 1, 2), (1, 1, 0)), prepass=None,
    notes="quantization inside sageattn() (not timed apart)"))
