"""The sparse patterns, STA and radial, at three granularities.

* :func:`token_allows` -- one token pair, plain Python: the literal definition the brute-force tests use
  (:func:`reference_mask` evaluates it on every pair).
* :func:`pattern_cells` -- the cells a pattern distinguishes (STA: tiles, radial: blocks of a frame) and their
  allow matrix, vectorized (:func:`sta_tile_allow`, :func:`radial_cell_allow`).
* :func:`block_structure` -- which (query block, key block) pairs of a layout are full / partial / empty.

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
from typing import Union

import torch

from .layout import TileLayout, tiles_of
from .spec import SparseSpec, TokenGrid, Triple, parse_spec

__all__ = ["radial_band", "token_allows", "reference_mask", "sta_tile_allow", "radial_cell_allow", "pattern_cells",
           "block_structure"]


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
        tiles = tiles_of(grid, spec.tile)
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

