"""Attention on PyTorch's FlexAttention: the dense baseline ``flex`` and the sparse patterns ``sta`` / ``radial``.

Why FlexAttention: one kernel family runs the dense baseline and every pattern, so a figure compares *patterns*,
not kernels; the pattern reaches the kernel as a ``BlockMask`` (:func:`vdbench.sparse.masks.block_mask`), whose
empty blocks are skipped and whose full blocks run without any per-token mask.

Where it runs: on CUDA through ``torch.compile(flex_attention)`` (the fused Triton kernel; compiled once per
process, recompiled per new shape or mask by torch's own guards). On a CPU, eagerly: torch 2.13's eager
``flex_attention`` runs on CPU tensors (it warns once that it is unfused) by materializing the scores and
evaluating ``mask_mod`` on every (query, key) pair -- it ignores the BlockMask's block lists, so the CPU result
follows the token mask exactly (the tests check the block lists separately, through the mask a fused kernel
applies). That path is for correctness tests only: it is O(L**2) in memory.

Layout convention: q, k, v, out are (batch, heads, seq, head_dim), as every backend of the registry; the output
has q's dtype. ``sparse_attention`` takes the tokens in the model's order and permutes them into the pattern's
tile layout and back inside the call, or -- ``already_tile_ordered=True`` -- takes them already in that layout
(the once-per-forward form of :mod:`vdbench.sparse.hooks`).

Where no grid applies (cross-attention: the keys are text, not the video grid; or no grid known), a sparse
backend runs dense attention on the same FlexAttention path and says so in its
:class:`~vdbench.sparse.masks.BlockStats` (``sparse_call=False``), so the reports count those calls as dense.
"""

from __future__ import annotations

import threading
from typing import Optional, Union

import torch

from .layout import from_layout, layout_for, to_layout
from .masks import BlockStats, block_mask
from .spec import SparseSpec, TokenGrid, parse_spec

__all__ = ["flex_attention_dense", "sparse_attention", "flex_callable", "expected_length"]

_COMPILED = None
_COMPILE_LOCK = threading.Lock()
_CAUSAL_MASKS: dict = {}


def flex_callable(device: torch.device):
    """``torch.compile(flex_attention)`` for CUDA tensors (built once), eager ``flex_attention`` elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED
    if device.type != "cuda":
        return flex_attention
    with _COMPILE_LOCK:
        if _COMPILED is None:
            _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def _recompile_guard() -> dict:
    """Dynamo settings for the compiled call: every distinct (shape, mask) is one more compile of the same
    ``flex_attention`` code object, and past dynamo's recompile limit (8 by default) it would silently run the
    frame eagerly -- on a GPU, a materialized (S, S) score matrix per head instead of the fused kernel. A run meets
    a handful of them (self and cross shapes, one mask per grid and pattern), a bench sweep a few dozen: the limit
    is raised for this call only, and hitting it raises instead of falling back (settings feature-detected: torch
    2.11 and 2.13 both have them, older ones may not)."""
    import torch._dynamo.config as dc

    want = {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}
    return {k: v for k, v in want.items() if hasattr(dc, k)}


def _run(q, k, v, block_mask, scale):
    fn = flex_callable(q.device)
    if q.device.type == "cuda":
        with torch._dynamo.config.patch(**_recompile_guard()):
            out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    else:
        out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.to(q.dtype)


def _causal_mask(sq: int, sk: int, device: torch.device):
    """Bottom-right aligned causal BlockMask (the registry's convention; for sq == sk plain causal), cached."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (sq, sk, str(device))
    if key not in _CAUSAL_MASKS:
        offset = sk - sq
        _CAUSAL_MASKS[key] = create_block_mask(lambda b, h, qi, ki: ki <= qi + offset, None, None, sq, sk,
                                               device=device)
    return _CAUSAL_MASKS[key]


def flex_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                         is_causal: bool = False) -> torch.Tensor:
    """The ``flex`` backend: dense (or causal) softmax attention on FlexAttention, BHSD in and out.

    The baseline the sparse patterns are measured against: same kernel family, no mask.
    """
    bm = _causal_mask(q.shape[2], k.shape[2], q.device) if is_causal else None
    return _run(q, k, v, bm, scale)


def expected_length(grid: TokenGrid, spec: Union[str, SparseSpec], already_tile_ordered: bool) -> int:
    """Sequence length of a self-attention call on ``grid``: the model's (raster) or the layout's (padded)."""
    return layout_for(spec, grid).length if already_tile_ordered else grid.seq_len


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, grid: Optional[TokenGrid],
                     spec: Union[str, SparseSpec], scale: Optional[float] = None, is_causal: bool = False,
                     already_tile_ordered: bool = False, return_stats: bool = False):
    """Attention under a sparse pattern (``spec``: ``"sta:window=3x3x3,tile=6x8x8"``, ``"radial"``, ``"flex"``).

    ``grid`` is the token grid of the call (None: no grid applies -> dense). A call whose query and key lengths
    differ is cross-attention -> dense. A self-attention call must have the grid's length (``grid.seq_len`` in
    the model's order; the layout's length with ``already_tile_ordered``), else ``ValueError``: a grid that does
    not match the call is a bug in whoever supplied it, and silently running dense would misreport the pattern.
    Causal attention is refused (the patterns are bidirectional).

    Returns the output (BHSD, q's dtype), or ``(output, BlockStats)`` with ``return_stats``.
    """
    spec = parse_spec(spec)
    sq, sk = q.shape[2], k.shape[2]
    if spec.dense or grid is None or sq != sk:
        out = flex_attention_dense(q, k, v, scale=scale, is_causal=is_causal)
        return (out, BlockStats.dense_call(sq, sk, spec.block)) if return_stats else out
    if is_causal:
        raise ValueError(f"sparse pattern {spec} is bidirectional; a causal call cannot run under it")
    want = expected_length(grid, spec, already_tile_ordered)
    if sq != want:
        order = "tile-ordered (padded) layout" if already_tile_ordered else "model's order"
        raise ValueError(f"sparse pattern {spec}: a self-attention call of {sq} tokens does not match the grid "
                         f"{grid} ({want} tokens in the {order})")
    bm, stats, layout = block_mask(spec, grid, q.device)
    if already_tile_ordered or layout.is_identity:
        out = _run(q, k, v, bm, scale)
    else:
        ql, kl, vl = (to_layout(t, layout, 2) for t in (q, k, v))
        out = from_layout(_run(ql, kl, vl, bm, scale), layout, 2)
    return (out, stats) if return_stats else out
