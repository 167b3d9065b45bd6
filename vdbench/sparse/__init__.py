"""Sparse video attention: the STA and radial patterns over a call's token grid, on FlexAttention.

One unit per concern, each importing only the ones above it in this list (and nothing else of vdbench, so the
backend registry can import the package):

* :mod:`~vdbench.sparse.spec` -- the grammar: :class:`TokenGrid` / :func:`parse_grid`, :data:`PATTERNS`,
  :class:`SparseSpec` / :func:`parse_spec`, :func:`split_attention_types`.
* :mod:`~vdbench.sparse.layout` -- tile order: :class:`TileLayout`, :func:`tile_layout`, :func:`layout_for`,
  :func:`to_layout` / :func:`from_layout` (and why a pattern needs tile order to pay off).
* :mod:`~vdbench.sparse.patterns` -- the pattern definitions (STA, radial) per token pair, per cell and per block.
* :mod:`~vdbench.sparse.masks` -- the FlexAttention ``BlockMask`` of a (spec, grid, device) and its cache,
  :class:`BlockStats` / :class:`SparsityTally` (what every patched attention call reports).
* :mod:`~vdbench.sparse.attention` -- the FlexAttention callables: ``flex`` (dense) and a pattern's attention.
* :mod:`~vdbench.sparse.hooks` -- the transformer hooks that give each forward its grid (per call) or put its
  tokens in tile order (once per forward), from a grid rule and hook points a model family hands them.

The names below are the grammar, layout, pattern and mask API; the attention callables and the hooks are imported
from their units.
"""

from . import layout as _layout, masks as _masks, patterns as _patterns, spec as _spec
from .layout import *  # noqa: F401,F403 - each unit's __all__ is the package's API
from .masks import *  # noqa: F401,F403
from .patterns import *  # noqa: F401,F403
from .spec import *  # noqa: F401,F403

__all__ = [*_spec.__all__, *_layout.__all__, *_patterns.__all__, *_masks.__all__]
