"""Sparse video attention: the STA and radial patterns over a call's token grid, on FlexAttention.

One unit per concern, each importing only the ones above it in this list (and nothing else of vdbench, so the
backend registry can import the package):

* :mod:`~vdbench.sparse.spec` -- the grammar: :class:`TokenGrid` / :func:`parse_grid`, :data:`PATTERNS`,
  :class:`SparseSpec` / :func:`parse_spec`, :func:`split_attention_types`.
* :mod:`~vdbench.sparse.layout` -- tile order: :class:`TileLayout`, :func:`tile_layout`, :func:`layout_for`,
  :func:`to_layout` / :func:`from_layout` (and why a pattern needs tile order to pay off).
* :mod:`~vdbench.sparse.patterns` -- the pattern definitions (STA, radial) per token pair, per cell and per block.
* :mod:`~vdbench.sparse.masks` -- the FlexAttention ``BlockMask`` of a (spec, grid, device) and its cache,
  :class:`BlockStats` / :class:`SparsityTally` (what every patched attention call reports), :func:`kernel_view_mask`.
* :mod:`~vdbench.sparse.attention` -- the FlexAttention callables: ``flex`` (dense) and a pattern's attention.
* :mod:`~vdbench.sparse.hooks` -- the transformer hooks that give each forward its grid (per call) or put its
  tokens in tile order (once per forward), from a grid rule and hook points a model family hands them.

The names below are the grammar, layout, pattern and mask API; the attention callables and the hooks are imported
from their units.
"""

from .layout import TileLayout, from_layout, layout_for, pattern_tile, tile_layout, to_layout
from .masks import BlockStats, SparsityTally, block_mask, clear_block_mask_cache, kernel_view_mask
from .patterns import (block_structure, pattern_cells, radial_band, radial_cell_allow, reference_mask,
                       sta_tile_allow, token_allows)
from .spec import (DEFAULT_BLOCK, PAD_MODES, PATTERNS, SparseSpec, SparseSpecError, TokenGrid, parse_grid,
                   parse_spec, split_attention_types)

__all__ = [
    "DEFAULT_BLOCK",
    "PAD_MODES",
    "PATTERNS",
    "SparseSpecError",
    "TokenGrid",
    "parse_grid",
    "SparseSpec",
    "parse_spec",
    "split_attention_types",
    "TileLayout",
    "tile_layout",
    "pattern_tile",
    "layout_for",
    "to_layout",
    "from_layout",
    "token_allows",
    "reference_mask",
    "radial_band",
    "sta_tile_allow",
    "radial_cell_allow",
    "pattern_cells",
    "block_structure",
    "BlockStats",
    "SparsityTally",
    "block_mask",
    "clear_block_mask_cache",
    "kernel_view_mask",
]
