"""Token-grid geometry of sparse video attention: tile order, the STA and radial patterns, FlexAttention BlockMasks.

Why this module exists: a video DiT attends over the latent token grid (frames, height, width) after patchify, and
a sparse pattern (sliding tile attention, radial attention) is a statement about *grid neighbours*. A kernel
computes blocks of 128 consecutive tokens, so a pattern only pays off when its neighbourhoods are whole blocks
of the sequence. In the raster order diffusers uses (frame-major, then rows, then columns) a 3-D neighbourhood is
scattered over hundreds of short runs, every block is partly masked, and a block-sparse kernel loses to dense
attention (measured on an H200: STA in raster order is slower than FA3). In *tile order* -- tokens grouped by
(t, h, w) tiles, tile-major, raster inside a tile -- a tile of (6, 8, 8) = 384 tokens is exactly 3 blocks and the
pattern becomes block-aligned (STA window (3,3,3) on (6,8,8) tiles: 1.25x FA3 at Wan 1.3B 480p, 3.58x at Wan 14B
720p). Everything below therefore works on a *layout*: a permutation of the model's token sequence into tile order,
optionally with pad positions so that tiles start on block boundaries.

What is here (nothing of vdbench is imported, so the backend registry can import it):

* :class:`TokenGrid` -- the token grid of one attention call: latent (frames, height, width) after patchify, plus
  the text tokens of joint attention (CogVideoX puts 226 text tokens *first*; Wan's self-attention has none).
* :class:`SparseSpec` / :func:`parse_spec` -- a pattern and its options, parsed from ``sta:window=3x3x3,tile=6x8x8``
  (``+`` separates options too, for command lines that split lists on commas; :func:`split_attention_types`
  splits such a list without cutting an option list apart).
* :func:`tile_layout` -- the tile-order permutation (:class:`TileLayout`: ``index``, ``inverse``) in three pad
  modes: ``none`` (partial edge tiles, no extra tokens), ``block`` (every tile's slot rounded up to whole blocks,
  the default: at Wan's grids it leaves 3-4x fewer partial blocks than ``none`` for 5-14 % more tokens, see
  :mod:`vdbench.sparse.hooks`) and ``tile`` (every slot a whole tile); :func:`layout_for` picks a pattern's
  layout (STA: its tile; radial: a whole frame per tile, i.e. raster order with frames padded to whole blocks);
  :func:`to_layout` / :func:`from_layout` apply it.
* the patterns at three granularities: :func:`token_allows` (one token pair, plain Python, the literal definition
  the brute-force tests use), :func:`pattern_cells` (the cells a pattern distinguishes -- STA: tiles, radial:
  blocks of a frame -- and their allow matrix, vectorized), :func:`block_structure` (which (query block, key
  block) pairs are full / partial / empty).
* :func:`block_mask` -- the ``torch.nn.attention.flex_attention.BlockMask`` of a (spec, grid, device), built once
  and cached, with its :class:`BlockStats` (block pairs computed out of all; the sparsity figure).
* :func:`kernel_view_mask` -- the dense boolean mask a fused FlexAttention kernel applies for a BlockMask (full
  blocks unmasked, partial blocks through ``mask_mod``, the rest skipped), to check a BlockMask exactly on a CPU.

Pattern definitions:

* ``sta`` -- Sliding Tile Attention (Zhang et al., "Fast Video Generation with Sliding Tile Attention",
  arXiv:2502.04507; hao-ai-lab/FastVideo). Followed: the edge rule of FastVideo's FlexAttention reference mask
  (``csrc/sliding_tile_attention/test/flex_sta_ref.py``, ``generate_sta_mask``) and of its H100 kernel
  (``st_attn_h100.cu``): per axis, half = window // 2, the window centre is the query tile clamped to
  [half, n - 1 - half] (so a query tile near an edge still sees a full window where the grid allows), and key
  tile b is attended iff |centre - b| <= half on all three axes. Windows are counted in tiles and must be odd
  (an even window w would behave as w + 1 under that rule, so it is refused rather than silently widened).
  Text: image queries attend every text key, text queries attend every key (as FastVideo's text_length handling).
* ``radial`` -- Radial Attention (Li et al., "Radial Attention: O(n log n) Sparse Attention with Energy Decay for
  Long Video Generation", arXiv:2506.19852; mit-han-lab/radial-attention, ``radial_attn/attn_mask.py``). There the
  mask is defined in raster order per frame pair (i, j), d = |i - j|: key frame 0 is an attention sink (always
  attended); d = 0 attends the whole frame; for d >= 1 a query attends the keys of frame j within a band of the
  flattened frame, |p_q - p_k| <= max(decay_length, block) with decay_length = 2**bit_length(tokens_per_frame) /
  2**bit_length(d) * decay_factor (``get_window_width``: halving per doubling of d, never narrower than one
  128-token block); when 2**bit_length(tokens_per_frame) / 2**bit_length(d) is below a block, only frame pairs
  with d % (block / that) == 0 are kept (``get_diagonal_split_mask``: temporal subsampling). The token mask is
  then shrunk to blocks by a density heuristic (``shrinkMaskStrict``), so its block form only approximates it.
  The form here is block-aligned *by construction* instead: every latent frame is one tile (1, H, W), so tile
  order is raster order with each frame padded to whole blocks (``pad=block``), and the band is counted in whole
  blocks of the frame: with P = 2**bit_length(H * W) and L(d) = P * decay / 2**bit_length(d) tokens, query block i
  of frame f_q attends key block j of frame f_k iff f_k < sink, or d = 0, or (|i - j| <= max(1, floor(L(d) / B))
  and kept), where kept = (L(d) >= B or d % floor(B / L(d)) == 0), B the block size and i, j the blocks of the
  within-frame raster index (p // B). Deviations: ``decay`` enters the subsampling test too (the original leaves
  it out), so that a large decay makes the pattern dense; the original's per-model cases at d = 1 (Wan: half a
  frame, HunyuanVideo: the whole frame) are not copied -- the formula gives L(1) = P / 2 * decay for every model;
  ``sink`` generalizes the single sink frame to the first ``sink`` frames (default 1, as the original). Text as for
  STA.

Pad tokens (``pad`` modes ``block``/``tile``) are never attended as keys. A pad *query* row is don't-care (its
output is dropped when the layout is undone): its ``mask_mod`` row allows every real key (so an unfused
FlexAttention never meets an all-masked row), and query blocks made only of pads get no key blocks at all.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional, Union

import torch

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

DEFAULT_BLOCK = 128
PAD_MODES = ("none", "block", "tile")

Triple = tuple[int, int, int]


class SparseSpecError(ValueError):
    """A sparse pattern spec that can't be used: unknown pattern or option, malformed or out-of-range value."""


# ----------------------------------------------------------------------------------------------------------
# The token grid of a call
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenGrid:
    """The token sequence of one self-attention call: a latent (frames, height, width) grid after patchify, in
    raster order (frame-major, then rows, then columns, as diffusers' Wan and CogVideoX flatten it), plus
    ``text_tokens`` of joint attention placed before the video tokens (``text_first``, CogVideoX) or after them.
    """

    frames: int
    height: int
    width: int
    text_tokens: int = 0
    text_first: bool = True

    def __post_init__(self):
        for name in ("frames", "height", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TokenGrid.{name} must be a positive int, got {v!r}")
        if not isinstance(self.text_tokens, int) or self.text_tokens < 0:
            raise ValueError(f"TokenGrid.text_tokens must be an int >= 0, got {self.text_tokens!r}")

    @property
    def shape(self) -> Triple:
        return (self.frames, self.height, self.width)

    @property
    def video_tokens(self) -> int:
        return self.frames * self.height * self.width

    @property
    def seq_len(self) -> int:
        return self.video_tokens + self.text_tokens

    @property
    def video_start(self) -> int:
        """Index of the first video token in the model's sequence."""
        return self.text_tokens if self.text_first else 0

    def decode(self, index: int) -> Optional[Triple]:
        """(t, h, w) of sequence position ``index``, or None for a text token."""
        v = index - self.video_start
        if not 0 <= v < self.video_tokens:
            if not 0 <= index < self.seq_len:
                raise IndexError(f"position {index} outside a sequence of {self.seq_len} tokens")
            return None
        hw = self.height * self.width
        return (v // hw, (v % hw) // self.width, v % self.width)

    def __str__(self) -> str:
        text = (f" + {self.text_tokens} text ({'first' if self.text_first else 'last'})"
                if self.text_tokens else "")
        return f"{self.frames}x{self.height}x{self.width}{text}"


def parse_grid(text: str) -> TokenGrid:
    """``"21x30x52"`` -> TokenGrid(21, 30, 52) (latent frames x height x width after patchify); ``"13x30x45+226"``:
    226 text tokens first (CogVideoX's joint attention). What the benches' ``--grid`` takes."""
    shape, _, text_tokens = str(text).partition("+")
    parts = shape.lower().split("x")
    if len(parts) != 3 or not all(x.strip().isdigit() for x in parts) or (text_tokens and not text_tokens.isdigit()):
        raise ValueError(f"grid {text!r} is not FxHxW (latent frames x height x width after patchify), optionally "
                         "+T text tokens")
    f, h, w = (int(x) for x in parts)
    return TokenGrid(f, h, w, int(text_tokens) if text_tokens else 0, True)


# ----------------------------------------------------------------------------------------------------------
# Specs and their parsing
# ----------------------------------------------------------------------------------------------------------

#: Options of each pattern with their defaults (``flex`` is the dense baseline on the same mechanism).
PATTERNS: dict[str, dict[str, object]] = {
    "flex": {},
    "sta": {"window": (3, 3, 3), "tile": (6, 8, 8), "pad": "block", "block": DEFAULT_BLOCK},
    "radial": {"decay": 1.0, "sink": 1, "pad": "block", "block": DEFAULT_BLOCK},
}

_OPTION_HELP = {
    "window": "TxHxW tiles, odd positive ints (the window is centred on the query tile)",
    "tile": "TxHxW latent tokens, positive ints",
    "decay": "a positive number (band = 2**bit_length(H*W) * decay / 2**bit_length(frame distance) tokens)",
    "sink": "an int >= 0 (leading latent frames every query attends)",
    "pad": f"one of {', '.join(PAD_MODES)}",
    "block": "a power of two >= 16 (FlexAttention block size)",
}


@dataclass(frozen=True)
class SparseSpec:
    """A pattern and its options; hashable, so it keys the layout and block-mask caches."""

    pattern: str
    tile: Optional[Triple] = None
    window: Optional[Triple] = None
    decay: Optional[float] = None
    sink: Optional[int] = None
    pad: str = "block"
    block: int = DEFAULT_BLOCK

    def __post_init__(self):
        # A spec built directly (not through parse_spec) is checked by the same rules, via its own spelling.
        if self.pattern not in PATTERNS:
            raise SparseSpecError(f"unknown sparse pattern {self.pattern!r}; known: {', '.join(PATTERNS)}")
        known = PATTERNS[self.pattern]
        for key in ("tile", "window", "decay", "sink"):
            if key not in known and getattr(self, key) is not None:
                raise SparseSpecError(f"{self.pattern} has no option {key!r}")
            if key in known and getattr(self, key) is None:
                raise SparseSpecError(f"{self.pattern} needs option {key!r} ({_OPTION_HELP[key]})")
        for key in known:
            v = getattr(self, key)
            _parse_value(key, "x".join(map(str, v)) if isinstance(v, tuple) else str(v), self.pattern)

    @property
    def dense(self) -> bool:
        return self.pattern == "flex"

    def options(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in PATTERNS[self.pattern]}

    def canonical(self) -> str:
        """One spelling per spec (every option, fixed order, ``+``-separated): labels, cache keys, file names."""
        if not PATTERNS[self.pattern]:
            return self.pattern
        parts = []
        for k, v in self.options().items():
            parts.append(f"{k}={'x'.join(map(str, v)) if isinstance(v, tuple) else _fmt_number(v)}")
        return f"{self.pattern}:{'+'.join(parts)}"

    def __str__(self) -> str:
        return self.canonical()


def _fmt_number(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _parse_triple(key: str, value: str, pattern: str) -> Triple:
    parts = value.lower().split("x")
    if len(parts) != 3 or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise SparseSpecError(f"{pattern}: {key}={value!r} is not {_OPTION_HELP[key]}")
    t = tuple(int(p) for p in parts)
    if min(t) < 1:
        raise SparseSpecError(f"{pattern}: {key}={value!r} has a zero; {key} is {_OPTION_HELP[key]}")
    if key == "window" and any(w % 2 == 0 for w in t):
        raise SparseSpecError(
            f"{pattern}: window={value!r} has an even size; STA windows are centred on the query tile, so they "
            "span an odd number of tiles (FastVideo's rule, half = window // 2, would make an even window w "
            "cover w + 1 tiles)")
    return t  # type: ignore[return-value]


def _parse_value(key: str, value: str, pattern: str):
    if key in ("window", "tile"):
        return _parse_triple(key, value, pattern)
    if key == "decay":
        try:
            x = float(value)
        except ValueError:
            raise SparseSpecError(f"{pattern}: decay={value!r} is not {_OPTION_HELP[key]}") from None
        if not math.isfinite(x) or x <= 0:
            raise SparseSpecError(f"{pattern}: decay={value!r} is not {_OPTION_HELP[key]}")
        return x
    if key in ("sink", "block"):
        if not re.fullmatch(r"\d+", value):
            raise SparseSpecError(f"{pattern}: {key}={value!r} is not {_OPTION_HELP[key]}")
        x = int(value)
        if key == "block" and (x < 16 or x & (x - 1)):
            raise SparseSpecError(f"{pattern}: block={value!r} is not {_OPTION_HELP[key]}")
        return x
    if key == "pad":
        if value not in PAD_MODES:
            raise SparseSpecError(f"{pattern}: pad={value!r} is not {_OPTION_HELP[key]}")
        return value
    raise AssertionError(key)


def parse_spec(text: Union[str, SparseSpec]) -> SparseSpec:
    """``"sta:window=3x3x3,tile=6x8x8"`` -> :class:`SparseSpec` (options not given take their defaults).

    Options are ``key=value`` separated by ``,`` or ``+``; every error names the pattern, the option and what
    is accepted, so a command line fails before any model is loaded.
    """
    if isinstance(text, SparseSpec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise SparseSpecError(f"empty sparse pattern spec {text!r}; known patterns: {', '.join(PATTERNS)}")
    name, sep, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name not in PATTERNS:
        raise SparseSpecError(f"unknown sparse pattern {name!r}; known: {', '.join(PATTERNS)}")
    known = PATTERNS[name]
    values = dict(known)
    seen: set[str] = set()
    items = [s.strip() for s in re.split(r"[,+]", rest)] if sep else []
    if sep and not rest.strip():
        raise SparseSpecError(f"{name}: ':' but no options (write {name!r} alone for the defaults)")
    for item in items:
        if not item:
            raise SparseSpecError(f"{name}: empty option in {text!r}")
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not value:
            raise SparseSpecError(f"{name}: option {item!r} is not key=value")
        if not known:
            raise SparseSpecError(f"{name} takes no options (got {item!r})")
        if key not in known:
            raise SparseSpecError(f"{name}: unknown option {key!r}; options: "
                                  + "; ".join(f"{k} ({_OPTION_HELP[k]})" for k in known))
        if key in seen:
            raise SparseSpecError(f"{name}: option {key!r} given twice")
        seen.add(key)
        values[key] = _parse_value(key, value, name)
    return SparseSpec(pattern=name, **values)  # type: ignore[arg-type]


def split_attention_types(text: str) -> list[str]:
    """Split a comma-separated list of backend names without cutting a pattern's options apart.

    ``"sdpa,sta:window=3x3x3,tile=6x8x8,fa3"`` -> ``["sdpa", "sta:window=3x3x3,tile=6x8x8", "fa3"]``: a piece
    that is ``key=value`` (an ``=`` with no ``:`` before it) continues the previous name's options, since no
    backend name contains ``=``.
    """
    out: list[str] = []
    for piece in text.split(","):
        head = piece.split("=", 1)[0]
        if out and "=" in piece and ":" not in head and ":" in out[-1]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return [p.strip() for p in out if p.strip()]


# ----------------------------------------------------------------------------------------------------------
# Tile order
# ----------------------------------------------------------------------------------------------------------

def _tiles_of(grid: TokenGrid, tile: Triple) -> Triple:
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
    nt, nh, nw = _tiles_of(grid, tile)
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
# The patterns: token pairs (the literal definition), cells (vectorized), blocks
# ----------------------------------------------------------------------------------------------------------

def radial_band(d: int, frame_tokens: int, decay: float, block: int) -> tuple[int, bool]:
    """Radial pattern at frame distance ``d >= 1``: (reach in blocks, kept).

    L(d) = 2**bit_length(frame_tokens) * decay / 2**bit_length(d) tokens (radial attention's decay_length, halving
    per doubling of d); reach = max(1, floor(L / block)); below one block only distances with
    d % floor(block / L) == 0 are kept (its temporal subsampling). See the module docstring.
    """
    if d < 1:
        raise ValueError(f"radial_band is for frame distances >= 1, got {d}")
    length = float(2 ** frame_tokens.bit_length()) * decay / float(2 ** d.bit_length())
    if length >= block:
        return max(1, math.floor(length / block)), True
    return 1, d % max(1, math.floor(block / length)) == 0


def _sta_axis(q: int, k: int, n: int, window: int) -> bool:
    half = window // 2
    centre = min(max(q, half), n - 1 - half)  # FastVideo: centre clamped to [half, n - 1 - half]
    return abs(centre - k) <= half


def token_allows(grid: TokenGrid, spec: Union[str, SparseSpec], q: int, k: int) -> bool:
    """Does query position ``q`` attend key position ``k`` (positions of the model's sequence order)?

    The literal definition, one pair at a time in plain Python, for the brute-force tests: text rows and columns
    are always attended (joint attention); video pairs follow the pattern on their grid coordinates.
    """
    spec = parse_spec(spec)
    pq, pk = grid.decode(q), grid.decode(k)
    if pq is None or pk is None or spec.dense:
        return True
    if spec.pattern == "sta":
        tiles = _tiles_of(grid, spec.tile)
        return all(_sta_axis(a // s, b // s, n, win)
                   for a, b, s, n, win in zip(pq, pk, spec.tile, tiles, spec.window))
    if spec.pattern == "radial":
        if pk[0] < spec.sink:
            return True
        d = abs(pq[0] - pk[0])
        if d == 0:
            return True
        reach, kept = radial_band(d, grid.height * grid.width, spec.decay, spec.block)
        i = (pq[1] * grid.width + pq[2]) // spec.block
        j = (pk[1] * grid.width + pk[2]) // spec.block
        return kept and abs(i - j) <= reach
    raise ValueError(f"unknown pattern {spec.pattern!r}")


def reference_mask(grid: TokenGrid, spec: Union[str, SparseSpec]) -> torch.Tensor:
    """Dense (seq_len, seq_len) boolean mask of ``spec`` in the model's sequence order, pair by pair in Python.

    O(seq_len**2) Python calls: for the brute-force tests on small grids only.
    """
    spec = parse_spec(spec)
    S = grid.seq_len
    return torch.tensor([[token_allows(grid, spec, q, k) for k in range(S)] for q in range(S)], dtype=torch.bool)


def sta_tile_allow(window: Triple, tiles: Triple) -> torch.Tensor:
    """(n_tiles, n_tiles) boolean: query tile (row) attends key tile (column) under STA, tiles in tile-raster
    order (the vectorized form of :func:`token_allows`)."""
    nt, nh, nw = tiles
    ids = torch.arange(nt * nh * nw)
    c = torch.stack([ids // (nh * nw), (ids // nw) % nh, ids % nw], dim=1)
    ok = torch.ones(len(ids), len(ids), dtype=torch.bool)
    for axis, (n, win) in enumerate(zip(tiles, window)):
        half = win // 2
        centre = c[:, axis].clamp(min=half).clamp(max=n - 1 - half)  # = min(max(q, half), n - 1 - half)
        ok &= (centre[:, None] - c[None, :, axis]).abs() <= half
    return ok


def radial_cell_allow(spec: SparseSpec, grid: TokenGrid) -> torch.Tensor:
    """(frames * blocks_per_frame)**2 boolean over (frame, block of the frame) cells, frame-major."""
    tpf = grid.height * grid.width
    nbf = -(-tpf // spec.block)
    cell = torch.arange(grid.frames * nbf)
    f, i = cell // nbf, cell % nbf
    d = (f[:, None] - f[None, :]).abs()
    table = [(nbf, True)] + [radial_band(x, tpf, spec.decay, spec.block) for x in range(1, grid.frames)]
    reach = torch.tensor([r for r, _ in table])[d]
    kept = torch.tensor([k for _, k in table])[d]
    return (f[None, :] < spec.sink) | (d == 0) | (kept & ((i[:, None] - i[None, :]).abs() <= reach))


def pattern_cells(spec: SparseSpec, layout: TileLayout) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cell per layout position, cell x cell allow matrix, pad cell).

    A cell is the smallest unit the pattern distinguishes: a tile for STA, a (frame, block of the frame) for
    radial; the text tokens form one cell and the pads another. Text rows and columns are attended by and
    attend every real token; the pad column is never attended; the pad row (don't-care) allows every real key,
    so no row of an unfused evaluation is all-masked.
    """
    video = layout.tile_of < layout.n_tiles
    if spec.pattern == "sta":
        inner = sta_tile_allow(spec.window, layout.tiles)  # type: ignore[arg-type]
        cell_video = layout.tile_of
    elif spec.pattern == "radial":
        if layout.tile != (1, layout.grid.height, layout.grid.width):
            raise ValueError(f"radial runs on whole-frame tiles, the layout has tile {layout.tile}")
        nbf = -(-(layout.grid.height * layout.grid.width) // spec.block)
        inner = radial_cell_allow(spec, layout.grid)
        cell_video = layout.tile_of * nbf + layout.rank.clamp(min=0) // spec.block
    else:
        raise ValueError(f"pattern {spec.pattern!r} has no cells")
    n = inner.shape[0]
    text_cell, pad_cell = n, n + 1
    cell = torch.where(video, cell_video, torch.where(layout.tile_of == layout.n_tiles, text_cell, pad_cell))
    m = torch.zeros(n + 2, n + 2, dtype=torch.bool)
    m[:n, :n] = inner
    m[text_cell, : n + 1] = True
    m[: n + 1, text_cell] = True
    m[pad_cell, : n + 1] = True
    return cell, m, pad_cell


def block_structure(cell: torch.Tensor, allow: torch.Tensor, pad_cell: int,
                    block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, partial): (n_blocks, n_blocks) booleans over (query block, key block) pairs of a layout.

    A pair is full when every (real query, key) token pair in it is allowed, partial when some are, empty
    otherwise. Pad queries are left out (don't-care), so a block of pads only computes nothing. Because the token
    pattern depends on cells only, counting allowed (query cell, key cell) pairs per block pair -- one matrix
    product over the cell incidence, exact in float64 -- decides it without touching token pairs.
    """
    L, C = cell.shape[0], allow.shape[0]
    nb = -(-L // block)
    inc = torch.zeros(nb, C, dtype=torch.float64)
    inc[torch.arange(L) // block, cell] = 1.0
    inc_q = inc.clone()
    inc_q[:, pad_cell] = 0.0
    counts = inc_q @ allow.to(torch.float64) @ inc.T
    need = inc_q.sum(1)[:, None] * inc.sum(1)[None, :]
    any_ = counts > 0
    full = any_ & (counts == need)
    return full, any_ & ~full

# ----------------------------------------------------------------------------------------------------------
# BlockMasks and their accounting
# ----------------------------------------------------------------------------------------------------------

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


def kernel_view_mask(bm) -> torch.Tensor:
    """The (Q_LEN, KV_LEN) boolean mask a fused FlexAttention kernel applies for BlockMask ``bm``.

    Full blocks are unmasked, partial blocks go through ``mask_mod``, other blocks are skipped. (Unfused, eager
    FlexAttention -- the CPU path -- evaluates ``mask_mod`` everywhere and ignores the block lists, so checking the
    block lists needs this view.)
    """
    q_len, kv_len = bm.seq_lengths
    bq, bk = bm.BLOCK_SIZE
    nbq, nbk = -(-q_len // bq), -(-kv_len // bk)

    def blocks(num, idx) -> torch.Tensor:
        out = torch.zeros(nbq, nbk, dtype=torch.bool, device=idx.device)
        rows = torch.arange(idx.shape[-1], device=idx.device)[None, :] < num[0, 0][:, None].long()
        r, c = rows.nonzero(as_tuple=True)
        out[r, idx[0, 0][r, c].long()] = True
        return out

    def expand(m: torch.Tensor) -> torch.Tensor:
        return m.repeat_interleave(bq, 0)[:q_len].repeat_interleave(bk, 1)[:, :kv_len]

    part = blocks(bm.kv_num_blocks, bm.kv_indices)
    qi = torch.arange(q_len, device=part.device)[:, None]
    ki = torch.arange(kv_len, device=part.device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=part.device)
    dense = expand(part) & bm.mask_mod(zero, zero, qi, ki).to(torch.bool)
    if bm.full_kv_num_blocks is not None:
        dense |= expand(blocks(bm.full_kv_num_blocks, bm.full_kv_indices))
    return dense
