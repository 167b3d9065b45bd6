"""FlexAttention BlockMasks of the sparse patterns, their cache, and their accounting.

* :func:`block_mask` -- the ``torch.nn.attention.flex_attention.BlockMask`` of a (spec, grid, device), built once
  and cached, with its :class:`BlockStats` (block pairs computed out of all; the sparsity figure).
* :class:`BlockStats` / :class:`SparsityTally` -- one call's block pairs and a run's totals: every patched
  attention call reports one, sparse or dense.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Union

import torch

from .layout import layout_for
from .patterns import block_structure, pattern_cells
from .spec import DEFAULT_BLOCK, SparseSpec, TokenGrid, parse_spec

__all__ = ["BlockStats", "SparsityTally", "block_mask", "clear_block_mask_cache"]


@dataclass(frozen=True)
class BlockStats:
    """Block pairs of one attention call. ``computed`` = full + partial pairs; ``total`` = all pairs of the
    sequence the kernel ran (the layout, pads included); ``dense`` = the pairs dense attention computes on the
    unpadded sequence (ceil(Sq/B) * ceil(Sk/B)). ``fraction`` is the figure the reports show (the density of the
    kernel's mask); ``relative_to_dense`` compares the work with dense attention on the model's own sequence.
    """

    computed: int
    full: int
    partial: int
    total: int
    dense: int
    sparse_call: bool  # False: the call ran dense (no grid applies, or the dense pattern)

    @property
    def fraction(self) -> float:
        return self.computed / self.total if self.total else 1.0

    @property
    def relative_to_dense(self) -> float:
        return self.computed / self.dense if self.dense else 1.0

    @classmethod
    def dense_call(cls, sq: int, sk: int, block: int = DEFAULT_BLOCK) -> "BlockStats":
        n = (-(-sq // block)) * (-(-sk // block))
        return cls(computed=n, full=n, partial=0, total=n, dense=n, sparse_call=False)


@dataclass
class SparsityTally:
    """Running totals over many calls (what a run reports: calls run sparse vs dense, block pairs computed)."""

    sparse_calls: int = 0
    dense_calls: int = 0
    computed: int = 0
    partial: int = 0
    total: int = 0
    dense: int = 0

    def add(self, s: BlockStats) -> None:
        if s.sparse_call:
            self.sparse_calls += 1
        else:
            self.dense_calls += 1
        self.computed += s.computed
        self.partial += s.partial
        self.total += s.total
        self.dense += s.dense

    def merge(self, other: "SparsityTally") -> "SparsityTally":
        """Add another tally's totals (a run's figure over kernels)."""
        for name in ("sparse_calls", "dense_calls", "computed", "partial", "total", "dense"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    @property
    def fraction(self) -> float:
        return self.computed / self.total if self.total else 1.0

    def as_dict(self) -> dict:
        return {"sparse_calls": self.sparse_calls, "dense_calls": self.dense_calls,
                "block_pairs_computed": self.computed, "block_pairs_partial": self.partial,
                "block_pairs_total": self.total, "block_pairs_dense": self.dense,
                "fraction_computed": self.fraction,
                "relative_to_dense": self.computed / self.dense if self.dense else 1.0}


def _indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num = m.sum(1).to(torch.int32)
    idx = torch.argsort((~m).to(torch.int8), dim=1, stable=True).to(torch.int32)  # True columns first, ascending
    return num[None, None].contiguous(), idx[None, None].contiguous()


def _make_mask_mod(allow: torch.Tensor, cell: torch.Tensor) -> Callable:
    n_cells = allow.shape[0]
    allow_flat = allow.flatten().contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return allow_flat[cell[q_idx] * n_cells + cell[kv_idx]]

    return mask_mod


def _seq_lengths(length: int) -> dict:
    """``seq_lengths=(L, L)`` for ``BlockMask.from_kv_blocks`` (feature-detected). Without it the mask would
    claim whole blocks (ceil(L / B) * B tokens) and FlexAttention would refuse or misread a layout whose length
    is not a block multiple; a torch without the argument is refused, not worked around."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    if "seq_lengths" not in inspect.signature(BlockMask.from_kv_blocks).parameters:
        raise RuntimeError(f"torch {torch.__version__}: BlockMask.from_kv_blocks takes no seq_lengths; the sparse "
                           "patterns need a torch that does (2.6 or newer)")
    return {"seq_lengths": (length, length)}


_CACHE_LOCK = threading.Lock()
_BLOCK_MASKS: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_SIZE = 32


def clear_block_mask_cache() -> None:
    with _CACHE_LOCK:
        _BLOCK_MASKS.clear()


def block_mask(spec: Union[str, SparseSpec], grid: TokenGrid, device="cpu"):
    """(BlockMask, BlockStats, TileLayout) of ``spec`` on ``grid`` for q = kv = the layout, built once per
    (spec, grid, device) and cached (LRU of 32 entries: one per distinct grid of a run in practice).

    The mask is built from its blocks (``BlockMask.from_kv_blocks``): full pairs go in the ``full_kv`` lists (no
    ``mask_mod`` in the kernel), partial pairs in ``kv`` with the token ``mask_mod`` (two table look-ups), empty
    pairs nowhere. Building from blocks avoids ``create_block_mask``'s O(L**2) evaluation of ``mask_mod``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    spec = parse_spec(spec)
    if spec.dense:
        raise ValueError("block_mask: the dense pattern 'flex' has no mask (run FlexAttention without one)")
    dev = torch.device(device)
    key = (spec, grid, str(dev))
    with _CACHE_LOCK:
        hit = _BLOCK_MASKS.get(key)
        if hit is not None:
            _BLOCK_MASKS.move_to_end(key)
            return hit
    layout = layout_for(spec, grid)
    cell, allow, pad_cell = pattern_cells(spec, layout)
    full, partial = block_structure(cell, allow, pad_cell, spec.block)
    kv_num, kv_idx = _indices(partial)
    full_num, full_idx = _indices(full)
    mask_mod = _make_mask_mod(allow.to(dev), cell.to(dev))
    bm = BlockMask.from_kv_blocks(kv_num.to(dev), kv_idx.to(dev), full_num.to(dev), full_idx.to(dev),
                                  BLOCK_SIZE=spec.block, mask_mod=mask_mod, **_seq_lengths(layout.length))
    n_full, n_partial = int(full.sum()), int(partial.sum())
    nb = full.shape[0]
    nd = -(-grid.seq_len // spec.block)
    stats = BlockStats(computed=n_full + n_partial, full=n_full, partial=n_partial, total=nb * nb, dense=nd * nd,
                       sparse_call=True)
    value = (bm, stats, layout)
    with _CACHE_LOCK:
        _BLOCK_MASKS[key] = value
        _BLOCK_MASKS.move_to_end(key)
        while len(_BLOCK_MASKS) > _CACHE_SIZE:
            _BLOCK_MASKS.popitem(last=False)
    return value
