"""Tile order: the permutation of a call's token sequence into the tiles a sparse pattern works on.

Why tile order: a video DiT attends over the latent token grid (frames, height, width) after patchify, and
a sparse pattern (sliding tile attention, radial attention) is a statement about *grid neighbours*. A kernel
computes blocks of 128 consecutive tokens, so a pattern only pays off when its neighbourhoods are whole blocks
of the sequence. In the raster order diffusers uses (frame-major, then rows, then columns) a 3-D neighbourhood is
scattered over hundreds of short runs, every block is partly masked, and a block-sparse kernel loses to dense
attention (measured on an H200: STA in raster order is slower than FA3). In *tile order* -- tokens grouped by
(t, h, w) tiles, tile-major, raster inside a tile -- a tile of (6, 8, 8) = 384 tokens is exactly 3 blocks and the
pattern becomes block-aligned (STA window (3,3,3) on (6,8,8) tiles: 1.25x FA3 at Wan 1.3B 480p, 3.58x at Wan 14B
720p). Every pattern therefore works on a *layout*: a permutation of the model's token sequence into tile order,
optionally with pad positions so that tiles start on block boundaries.

* :func:`tile_layout` -- the tile-order permutation (:class:`TileLayout`: ``index``, ``inverse``) in three pad
  modes: ``none`` (partial edge tiles, no extra tokens), ``block`` (every tile's slot rounded up to whole blocks,
  the default: at Wan's grids it leaves 3-4x fewer partial blocks than ``none`` for 5-14 % more tokens, see
  :mod:`vdbench.sparse.hooks`) and ``tile`` (every slot a whole tile).
* :func:`layout_for` picks a pattern's layout (STA: its tile; radial: a whole frame per tile, i.e. raster order
  with frames padded to whole blocks); :func:`to_layout` / :func:`from_layout` apply it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Union

import torch

from .spec import DEFAULT_BLOCK, PAD_MODES, SparseSpec, TokenGrid, Triple, parse_spec

__all__ = ["TileLayout", "tiles_of", "tile_layout", "pattern_tile", "layout_for", "to_layout", "from_layout"]


def tiles_of(grid: TokenGrid, tile: Triple) -> Triple:
    """Tiles per axis of ``grid`` cut into ``tile``-sized tiles (edge tiles may be partial)."""
    return tuple(-(-n // t) for n, t in zip(grid.shape, tile))  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class TileLayout:
    """The model's token sequence rearranged into tile order: ``layout[p] = sequence[index[p]]``.

    Video tokens come first, tile-major in tile-raster order (t, then h, then w tiles), each tile's real tokens in
    raster order, then the pads of its slot; text tokens follow the video region, whatever side the model puts
    them (a 226-token text prefix would otherwise shift every tile off the block boundaries). ``index`` holds
    ``grid.seq_len`` at pad positions (``to_layout`` gathers a zero row there); ``inverse[i]`` is the layout
    position of sequence token ``i``. Per position, ``tile_of`` is the tile id (``n_tiles`` for text,
    ``n_tiles + 1`` for a pad) and ``rank`` the token's raster rank inside its tile (-1 for text and pads).

    Pad modes: ``none`` -- slots are the tiles' real token counts (partial edge tiles; same length as the
    sequence); ``block`` -- slots rounded up to whole blocks, so every block lies inside one tile; ``tile`` --
    every slot a whole tile. Pads are placed at the *end* of their slot rather than at their raster position in
    the padded tile, so that at most the last block of a slot holds pad keys (the patterns depend on tile
    coordinates and on the rank, never on where pads sit).
    """

    grid: TokenGrid
    tile: Triple
    pad: str
    block: int
    tiles: Triple
    length: int
    video_length: int
    index: torch.Tensor
    inverse: torch.Tensor
    tile_of: torch.Tensor
    rank: torch.Tensor
    is_identity: bool  # the layout is the model's own order (nothing to permute)
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def n_tiles(self) -> int:
        return self.tiles[0] * self.tiles[1] * self.tiles[2]

    @property
    def pad_tokens(self) -> int:
        return self.length - self.grid.seq_len

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, inverse) on ``device``, copied once per device."""
        key = str(torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = (self.index.to(device), self.inverse.to(device))
        return self._on_device[key]


@lru_cache(maxsize=64)
def tile_layout(grid: TokenGrid, tile: Triple, pad: str = "block", block: int = DEFAULT_BLOCK) -> TileLayout:
    """The tile-order layout of ``grid`` for ``tile`` (cached per arguments; see :class:`TileLayout`)."""
    if pad not in PAD_MODES:
        raise ValueError(f"pad must be one of {PAD_MODES}, got {pad!r}")
    tile = tuple(int(x) for x in tile)  # type: ignore[assignment]
    if len(tile) != 3 or min(tile) < 1:
        raise ValueError(f"tile must be three positive ints, got {tile!r}")
    F_, H_, W_ = grid.shape
    tt, th, tw = tile
    nt, nh, nw = tiles_of(grid, tile)
    n_tiles = nt * nh * nw
    t = torch.arange(F_).view(F_, 1, 1)
    h = torch.arange(H_).view(1, H_, 1)
    w = torch.arange(W_).view(1, 1, W_)
    tile_id = ((t // tt) * (nh * nw) + (h // th) * nw + (w // tw)).flatten()
    local = ((t % tt) * (th * tw) + (h % th) * tw + (w % tw)).flatten()
    order = torch.argsort(tile_id * (tt * th * tw) + local)  # raster video index, in tile order (keys unique)
    counts = torch.bincount(tile_id, minlength=n_tiles)
    quantum = {"none": 1, "block": block, "tile": tt * th * tw}[pad]
    slots = (counts + quantum - 1) // quantum * quantum
    slot_start = torch.cumsum(slots, 0) - slots
    count_start = torch.cumsum(counts, 0) - counts
    sorted_tile = tile_id[order]
    rank_sorted = torch.arange(grid.video_tokens) - count_start[sorted_tile]
    pos = slot_start[sorted_tile] + rank_sorted
    video_length = int(slots.sum())
    length = video_length + grid.text_tokens
    S = grid.seq_len
    index = torch.full((length,), S, dtype=torch.long)
    index[pos] = order + grid.video_start
    index[video_length:] = torch.arange(grid.text_tokens) + (0 if grid.text_first else grid.video_tokens)
    tile_of = torch.full((length,), n_tiles + 1, dtype=torch.long)
    tile_of[pos] = sorted_tile
    tile_of[video_length:] = n_tiles
    rank = torch.full((length,), -1, dtype=torch.long)
    rank[pos] = rank_sorted
    real = index < S
    inverse = torch.empty(S, dtype=torch.long)
    inverse[index[real]] = torch.arange(length)[real]
    return TileLayout(grid=grid, tile=tile, pad=pad, block=block, tiles=(nt, nh, nw), length=length,
                      video_length=video_length, index=index, inverse=inverse, tile_of=tile_of, rank=rank,
                      is_identity=length == S and bool(torch.equal(index, torch.arange(S))))


def pattern_tile(spec: Union[str, SparseSpec], grid: TokenGrid) -> Triple:
    """The tile a pattern's layout uses on ``grid``: STA's ``tile`` option; for radial a whole latent frame."""
    spec = parse_spec(spec)
    if spec.pattern == "sta":
        return spec.tile  # type: ignore[return-value]
    if spec.pattern == "radial":
        return (1, grid.height, grid.width)
    raise ValueError(f"pattern {spec.pattern!r} has no layout (it runs in the model's own order)")


def layout_for(spec: Union[str, SparseSpec], grid: TokenGrid) -> TileLayout:
    """The layout ``spec`` runs in on ``grid`` (what the once-per-forward hook and the attention call share)."""
    spec = parse_spec(spec)
    return tile_layout(grid, pattern_tile(spec, grid), spec.pad, spec.block)


def to_layout(x: torch.Tensor, layout: TileLayout, dim: int) -> torch.Tensor:
    """Gather ``x`` (the sequence along ``dim``) into ``layout`` order; pad positions get zeros."""
    if x.shape[dim] != layout.grid.seq_len:
        raise ValueError(f"to_layout: dim {dim} has {x.shape[dim]} tokens, the grid {layout.grid} has "
                         f"{layout.grid.seq_len}")
    index, _ = layout.on(x.device)
    if layout.pad_tokens:
        zshape = list(x.shape)
        zshape[dim] = 1
        x = torch.cat([x, x.new_zeros(zshape)], dim=dim)
    return x.index_select(dim, index)


def from_layout(x: torch.Tensor, layout: TileLayout, dim: int) -> torch.Tensor:
    """Undo :func:`to_layout`: back to the model's sequence order, pads dropped."""
    if x.shape[dim] != layout.length:
        raise ValueError(f"from_layout: dim {dim} has {x.shape[dim]} positions, the layout has {layout.length}")
    _, inverse = layout.on(x.device)
    return x.index_select(dim, inverse)


# ----------------------------------------------------------------------------------------------------------
