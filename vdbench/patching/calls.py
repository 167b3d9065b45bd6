"""What a patch records of the attention calls it serves: counts (``PatchStats``), what an observer sees of one
call (``CallInfo``), and how a call is classified (``call_kind``) -- shared by the core and the adapters.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["CallInfo", "PatchStats", "call_kind", "call_args", "torch_sdpa"]


@dataclass
class CallInfo:
    """What an observer (capture, bench recorders) sees of one attention call. Tensors are BHSD."""

    index: int
    layer: str
    kind: str  # "self", "cross", "cross_img" (an image context's cross-attention), "joint" (text+video together)
    step: int
    model: str  # "transformer" / "transformer_2"
    kernel: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    args: dict  # the call's non-tensor arguments (scale, is_causal, dropout_p, has_mask, ...)


@dataclass
class PatchStats:
    """The calls of one run: by the kernel that actually ran (its label), by kind (self/cross/joint), by denoising
    step (a dense-step schedule shows which kernel ran where), by denoiser and kernel (Wan 2.2's two experts each
    their own: ``transformer``, ``transformer_2``), and the (query, key) block pairs each kernel
    computed per call kind (``block_pairs``: a sparse pattern's own count, dense calls all their pairs), from
    which the work figure -- the fraction of block pairs computed -- is read per kind."""

    backend: str
    calls: Counter = field(default_factory=Counter)  # by kernel label
    calls_by_kind: Counter = field(default_factory=Counter)
    calls_by_step: defaultdict = field(default_factory=lambda: defaultdict(Counter))  # step -> Counter by label
    calls_by_denoiser: defaultdict = field(default_factory=lambda: defaultdict(Counter))  # model -> by label
    block_pairs: defaultdict = field(default_factory=lambda: defaultdict(dict))  # label -> kind -> SparsityTally
    fallbacks: int = 0
    attention_time_s: Optional[float] = None  # filled by ``finish_timing`` when timing was asked
    # the rotary embeddings the family's processor ran (--fused_rope): by the kernel (vdbench.kernels.rope) or by
    # the eager expressions, and why the first eager one could not be fused
    rope: Counter = field(default_factory=Counter)
    rope_eager_why: Optional[str] = None
    # the block passes the family's block forward ran (--fused_block), by kernel (modulate, residual) and form
    # ("modulate", "fused") / ("modulate", "eager") (vdbench.kernels.block, or the eager expressions), and why the
    # first eager one could not be fused; its norms likewise ("norm_modulate": a norm and its modulation, "norm": a
    # norm cast to the hidden state's dtype; eager: diffusers' norm, then a "modulate" pass), why the first eager one
    # was not fused, and each form's first-call check of the fused norm against diffusers' (that call eager)
    block: Counter = field(default_factory=Counter)
    block_eager_why: Optional[str] = None
    block_norm_why: Optional[str] = None
    block_norm_checks: list = field(default_factory=list)

    def tally(self, label: str, kind: str, blocks) -> None:
        """Add one call's ``vdbench.sparse.BlockStats``."""
        from ..sparse import SparsityTally

        self.block_pairs[label].setdefault(kind, SparsityTally()).add(blocks)

    def fraction_computed(self) -> dict:
        """kind -> block pairs computed / block pairs of the sequences run, over every kernel (1.0: dense)."""
        from ..sparse import SparsityTally

        out: dict[str, SparsityTally] = {}
        for kinds in self.block_pairs.values():
            for kind, t in kinds.items():
                out.setdefault(kind, SparsityTally()).merge(t)
        return {kind: t.fraction for kind, t in out.items()}

    def as_dict(self) -> dict:
        return {"backend": self.backend, "calls_by_kernel": dict(self.calls),
                "calls_by_kind": dict(self.calls_by_kind), "total_calls": sum(self.calls.values()),
                "calls_by_step": {str(s): dict(c) for s, c in sorted(self.calls_by_step.items())},
                "calls_by_denoiser": {m: dict(c) for m, c in self.calls_by_denoiser.items()},
                "block_pairs": {label: {kind: t.as_dict() for kind, t in kinds.items()}
                                for label, kinds in self.block_pairs.items()},
                "fraction_computed": self.fraction_computed(),
                "fallback_calls": self.fallbacks, "attention_time_s": self.attention_time_s,
                "rope": {"fused_calls": self.rope["fused"], "eager_calls": self.rope["eager"],
                         "eager_why": self.rope_eager_why},
                "block": {**{k: {"fused_calls": self.block[k, "fused"], "eager_calls": self.block[k, "eager"]}
                             for k in ("modulate", "residual", "norm_modulate", "norm")},
                          "eager_why": self.block_eager_why, "norm_eager_why": self.block_norm_why,
                          "norm_checks": list(self.block_norm_checks)}}


def call_kind(mode: str, attn, encoder_hidden_states) -> str:
    """'self', 'cross' or 'joint' for one processor call (``mode``: the adapter that serves the processor), read
    from the attention module alone: what a patch uses for a transformer no registered model family claims (a
    family's own rule is ``Family.call_kind``).

    A processor handed a context whose ``Attention`` says ``is_cross_attention=False`` attends over both token sets
    together (joint); a processor reaching F.scaled_dot_product_attention directly (mode 'sdpa') is taken as joint.
    Under xfuser the kind decides the path: cross-attention is local, joint/self goes through USP (Ulysses, ring).
    """
    if mode == "sdpa":
        return "joint"
    if encoder_hidden_states is None:
        return "self"
    return "joint" if getattr(attn, "is_cross_attention", True) is False else "cross"


def call_args(attn_mask, dropout_p, is_causal, scale) -> dict:
    """A call's non-tensor arguments as observers see them (``CallInfo.args``; captures save them)."""
    return dict(scale=scale, is_causal=is_causal, dropout_p=dropout_p, has_mask=attn_mask is not None)


def torch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's own sdpa on one call's arguments (BHSD): what the 'default' pass-through and the explicit
    ``fallback:sdpa`` run. ``enable_gqa`` is passed only when asked, as the processors themselves do."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, **({"enable_gqa": True} if enable_gqa else {}))
