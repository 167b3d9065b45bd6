"""Sparse attention on FlexAttention (issue 21): mask geometry against brute force, layouts, the attention
callables against exact attention, and tile order once per forward against the per-call form on the tiny Wan."""


import pytest
import torch

from vdbench.sparse import (SparseSpec, SparseSpecError, TokenGrid, block_mask, clear_block_mask_cache, from_layout,
                            layout_for, parse_spec, radial_band, reference_mask, split_attention_types, tile_layout,
                            to_layout, token_allows)
from vdbench.sparse.attention import flex_attention_dense, sparse_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


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


def exact(q, k, v, mask=None, scale=None):
    """fp64 softmax attention with an optional boolean mask (True = attend)."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def qkv(grid_len, b=2, h=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, grid_len, d, generator=g, dtype=dtype) for _ in range(3)]


# ----------------------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------------------

def test_parse_spec_defaults_options_and_canonical_round_trip():
    s = parse_spec("sta")
    assert (s.window, s.tile, s.pad, s.block) == ((3, 3, 3), (6, 8, 8), "block", 128)
    s = parse_spec("STA:window=1x3x5,tile=2x4x4")
    assert (s.pattern, s.window, s.tile) == ("sta", (1, 3, 5), (2, 4, 4))
    assert parse_spec("sta:window=1x3x5+tile=2x4x4") == s  # '+' separates options too
    r = parse_spec("radial:decay=0.5,sink=0,pad=none,block=64")
    assert (r.decay, r.sink, r.pad, r.block, r.tile, r.window) == (0.5, 0, "none", 64, None, None)
    assert parse_spec("flex") == SparseSpec("flex") and parse_spec("flex").dense
    for spec in (s, r, parse_spec("flex"), parse_spec("sta:pad=tile")):
        assert parse_spec(spec.canonical()) == spec
    assert s.canonical() == "sta:window=1x3x5+tile=2x4x4+pad=block+block=128"


@pytest.mark.parametrize("text, fragment", [
    ("nope", "unknown sparse pattern 'nope'"),
    ("", "empty sparse pattern"),
    ("sta:", "no options"),
    ("sta:window=3x3", "not TxHxW"),
    ("sta:window=3x3xa", "not TxHxW"),
    ("sta:window=2x3x3", "even size"),
    ("sta:tile=0x8x8", "has a zero"),
    ("sta:foo=1", "unknown option 'foo'"),
    ("radial:tile=1x8x8", "unknown option 'tile'"),
    ("sta:window=3x3x3,window=5x5x5", "given twice"),
    ("sta:window", "not key=value"),
    ("sta:window=3x3x3,,tile=6x8x8", "empty option"),
    ("radial:decay=-1", "decay='-1'"),
    ("radial:decay=nan", "decay='nan'"),
    ("radial:sink=-1", "sink='-1'"),
    ("radial:block=100", "power of two"),
    ("radial:block=8", "power of two"),
    ("sta:pad=zero", "one of none, block, tile"),
    ("flex:window=3x3x3", "takes no options"),
])
def test_parse_spec_errors_say_what_is_wrong(text, fragment):
    with pytest.raises(SparseSpecError) as e:
        parse_spec(text)
    assert fragment in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


def test_spec_built_directly_is_checked_too():
    assert SparseSpec("sta", tile=(2, 4, 4), window=(1, 3, 1)) == parse_spec("sta:window=1x3x1,tile=2x4x4")
    with pytest.raises(SparseSpecError, match="even size"):
        SparseSpec("sta", tile=(2, 4, 4), window=(2, 3, 1))
    with pytest.raises(SparseSpecError, match="needs option 'window'"):
        SparseSpec("sta", tile=(2, 4, 4))
    with pytest.raises(SparseSpecError, match="has no option 'tile'"):
        SparseSpec("radial", tile=(1, 2, 2), decay=1.0, sink=1)
    with pytest.raises(SparseSpecError, match="unknown sparse pattern"):
        SparseSpec("dense")


def test_split_attention_types_keeps_option_lists_whole():
    assert split_attention_types("sdpa,sta:window=3x3x3,tile=6x8x8,fa3") == [
        "sdpa", "sta:window=3x3x3,tile=6x8x8", "fa3"]
    assert split_attention_types("radial:decay=0.5,sink=0,sta,flex") == ["radial:decay=0.5,sink=0", "sta", "flex"]
    assert split_attention_types("sdpa") == ["sdpa"]


# ----------------------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------------------

def test_tile_order_small_example():
    # 1 frame of 2 x 4 tokens, tiles of 1 x 2 x 2: tile 0 = columns 0-1, tile 1 = columns 2-3
    lay = tile_layout(TokenGrid(1, 2, 4), (1, 2, 2), "none", 16)
    assert lay.index.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert lay.inverse.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # pad=block: each tile's slot rounded to 16 positions, real tokens first, pads (index 8) after
    lay = tile_layout(TokenGrid(1, 2, 4), (1, 2, 2), "block", 16)
    assert lay.length == 32 and lay.index.tolist() == [0, 1, 4, 5] + [8] * 12 + [2, 3, 6, 7] + [8] * 12


@pytest.mark.parametrize("grid", [TokenGrid(5, 6, 7), TokenGrid(5, 6, 7, 9, True), TokenGrid(4, 8, 8, 5, False),
                                  TokenGrid(1, 1, 3)])
@pytest.mark.parametrize("tile", [(2, 4, 3), (1, 2, 2), (5, 6, 7), (3, 3, 3)])
@pytest.mark.parametrize("pad", ["none", "block", "tile"])
def test_layout_round_trip_and_tile_structure(grid, tile, pad):
    lay = tile_layout(grid, tile, pad, 16)
    S = grid.seq_len
    real = lay.index < S
    assert sorted(lay.index[real].tolist()) == list(range(S))  # a permutation of the real tokens
    assert lay.pad_tokens == int((~real).sum()) and (pad != "none" or lay.pad_tokens == 0)
    x = torch.randn(2, S, 3)
    y = to_layout(x, lay, 1)
    assert torch.equal(from_layout(y, lay, 1), x)
    assert torch.equal(y[:, ~real], torch.zeros_like(y[:, ~real]))
    # text follows the video region; video positions hold video tokens, in tile-major order
    assert (lay.tile_of[lay.video_length:] == lay.n_tiles).all()
    vid = lay.tile_of[: lay.video_length]
    real_vid = vid[vid < lay.n_tiles]
    assert (real_vid[1:] >= real_vid[:-1]).all()
    for pos in range(lay.video_length):
        src = int(lay.index[pos])
        if src < S:
            t, h, w = grid.decode(src)
            tid = (t // tile[0]) * lay.tiles[1] * lay.tiles[2] + (h // tile[1]) * lay.tiles[2] + w // tile[2]
            assert int(lay.tile_of[pos]) == tid
    # raster order inside a tile (the rank counts up)
    for tid in range(lay.n_tiles):
        src = lay.index[lay.tile_of == tid]
        assert (src[1:] > src[:-1]).all()
        assert lay.rank[lay.tile_of == tid].tolist() == list(range(len(src)))
    if pad == "block":  # every tile starts on a block boundary
        starts = [int((lay.tile_of == tid).nonzero()[0]) for tid in range(lay.n_tiles)]
        assert all(s % 16 == 0 for s in starts)
        assert lay.video_length % 16 == 0


# ----------------------------------------------------------------------------------------------------------
# Geometry against brute force
# ----------------------------------------------------------------------------------------------------------

def test_sta_edge_rule_is_fastvideos():
    # one axis of 5 tiles, window 3: the window centre is clamped to [1, 3], so edge queries see 3 tiles
    g, spec = TokenGrid(1, 1, 5), parse_spec("sta:window=1x1x3,tile=1x1x1")
    seen = {q: [k for k in range(5) if token_allows(g, spec, q, k)] for q in range(5)}
    assert seen == {0: [0, 1, 2], 1: [0, 1, 2], 2: [1, 2, 3], 3: [2, 3, 4], 4: [2, 3, 4]}
    # a window wider than the axis covers it whole
    spec = parse_spec("sta:window=1x1x7,tile=1x1x1")
    assert all(token_allows(g, spec, q, k) for q in range(5) for k in range(5))


def test_radial_band_values():
    # 42 tokens per frame -> P = 64; block 16
    assert radial_band(1, 42, 1.0, 16) == (2, True)    # L = 32 -> 2 blocks
    assert radial_band(3, 42, 1.0, 16) == (1, True)    # L = 16 -> 1 block
    assert radial_band(4, 42, 1.0, 16) == (1, True)    # L = 8 < 16: keep d % 2 == 0
    assert radial_band(5, 42, 1.0, 16) == (1, False)
    assert radial_band(8, 42, 1.0, 16) == (1, True)    # L = 4: keep d % 4 == 0
    assert radial_band(10, 42, 1.0, 16) == (1, False)
    assert radial_band(1, 42, 4.0, 16) == (8, True)    # decay widens the band
    # Wan 1.3B 480p frame, 1560 tokens -> P = 2048, block 128
    assert [radial_band(d, 1560, 1.0, 128)[0] for d in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert radial_band(17, 1560, 1.0, 128) == (1, False) and radial_band(18, 1560, 1.0, 128) == (1, True)
    with pytest.raises(ValueError):
        radial_band(0, 42, 1.0, 16)


GEOMETRY_CASES = [
    # STA: several windows and tiles, uneven grids (5 frames over tiles of 2), every pad mode, text first/last
    (TokenGrid(5, 6, 7), "sta:window=1x3x1,tile=2x4x3,block=16"),
    (TokenGrid(5, 6, 7), "sta:window=3x1x3,tile=2x4x3,block=16,pad=none"),
    (TokenGrid(5, 6, 7), "sta:window=1x1x1,tile=2x2x4,block=16,pad=tile"),
    (TokenGrid(5, 6, 7, 9, True), "sta:window=1x3x3,tile=2x2x2,block=16"),
    (TokenGrid(5, 6, 7, 9, False), "sta:window=3x1x1,tile=3x4x4,block=32,pad=none"),
    (TokenGrid(7, 4, 6, 5, True), "sta:window=3x3x1,tile=2x2x2,block=16,pad=tile"),
    (TokenGrid(6, 8, 4), "sta:window=1x1x1,tile=2x4x2,block=16"),  # even grid: no pads at all
    # radial: frames of 42 and 24 tokens over blocks of 16 (partial last block of a frame), sinks, decays
    (TokenGrid(9, 6, 7), "radial:block=16"),
    (TokenGrid(9, 6, 7), "radial:block=16,sink=0,decay=0.5,pad=none"),
    (TokenGrid(12, 4, 6, 7, True), "radial:block=16,sink=2"),
    (TokenGrid(12, 4, 6, 7, False), "radial:block=16,decay=2,pad=tile"),
]


@pytest.mark.parametrize("grid, text", GEOMETRY_CASES)
def test_block_mask_equals_brute_force(grid, text):
    spec = parse_spec(text)
    ref = reference_mask(grid, spec)  # model order, pair by pair
    assert ref.any(1).all() and not ref.all()  # a real pattern: sparse, no empty row
    clear_block_mask_cache()
    bm, stats, lay = block_mask(spec, grid)
    # 1) what a fused kernel applies (full blocks, partial blocks through mask_mod, the rest skipped) is exactly
    #    the brute-force mask once mapped back to the model's order
    kv = kernel_view_mask(bm)
    assert torch.equal(kv[lay.inverse][:, lay.inverse], ref)
    # pad keys are never attended by real queries
    real = lay.index < grid.seq_len
    assert not kv[real][:, ~real].any()
    # 2) the block lists are tight: computed block pairs = pairs with an allowed (real query, key) token pair,
    #    full = pairs where all are allowed
    B = spec.block
    lay_ref = torch.zeros(lay.length, lay.length, dtype=torch.bool)
    lay_ref[real.nonzero()[:, :1], real.nonzero()[:, 0]] = ref[lay.index[real]][:, lay.index[real]]
    nb = -(-lay.length // B)
    any_, all_ = torch.zeros(nb, nb, dtype=torch.bool), torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        rows = real[i * B:(i + 1) * B]
        for j in range(nb):
            sub = lay_ref[i * B:(i + 1) * B, j * B:(j + 1) * B][rows]
            any_[i, j] = sub.any()
            all_[i, j] = sub.numel() > 0 and bool(sub.all())
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        n = int(bm.full_kv_num_blocks[0, 0, i])
        full[i, bm.full_kv_indices[0, 0, i, :n].long()] = True
    computed = bm.to_dense()[0, 0].bool()
    assert torch.equal(computed, any_)
    assert torch.equal(full, all_)
    assert stats.computed == int(any_.sum()) and stats.full == int(all_.sum()) and stats.total == nb * nb
    assert 0 < stats.fraction < 1


@pytest.mark.parametrize("grid, text", GEOMETRY_CASES[:4] + GEOMETRY_CASES[7:9])
def test_sparse_attention_equals_masked_exact_attention(grid, text):
    ref = reference_mask(grid, text)
    q, k, v = qkv(grid.seq_len)
    out, stats = sparse_attention(q, k, v, grid=grid, spec=text, return_stats=True)
    assert stats.sparse_call
    torch.testing.assert_close(out, exact(q, k, v, ref), atol=1e-12, rtol=1e-10)
    # the same call with the tokens already in the layout (the once-per-forward form)
    lay = layout_for(text, grid)
    ql, kl, vl = (to_layout(t, lay, 2) for t in (q, k, v))
    out_l = sparse_attention(ql, kl, vl, grid=grid, spec=text, already_tile_ordered=True)
    torch.testing.assert_close(from_layout(out_l, lay, 2), out, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("grid, text", [
    (TokenGrid(5, 6, 7), "sta:window=5x3x5,tile=2x4x3,block=16"),  # windows of >= 2 * tiles - 1 cover the grid
    (TokenGrid(5, 6, 7, 9, True), "sta:window=3x1x3,tile=2x6x3,block=16,pad=none"),
    (TokenGrid(4, 8, 8), "sta:window=1x1x1,tile=4x8x8,block=16"),  # one tile
    (TokenGrid(9, 6, 7), "radial:block=16,decay=64,sink=0"),
    (TokenGrid(12, 4, 6, 7, False), "radial:block=16,decay=64,sink=0,pad=none"),
])
def test_full_window_equals_dense(grid, text):
    assert reference_mask(grid, text).all()
    bm, stats, _ = block_mask(text, grid)
    assert stats.partial == int(bm.kv_num_blocks.sum())
    q, k, v = qkv(grid.seq_len, seed=1)
    out = sparse_attention(q, k, v, grid=grid, spec=text)
    torch.testing.assert_close(out, flex_attention_dense(q, k, v), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out, exact(q, k, v), atol=1e-12, rtol=1e-10)


# ----------------------------------------------------------------------------------------------------------
# The callables
# ----------------------------------------------------------------------------------------------------------

def test_flex_dense_equals_exact_and_reference():
    from vdbench.backends import reference_attention

    q, k, v = qkv(77, b=2, h=3, d=16, dtype=torch.float32, seed=2)
    for causal in (False, True):
        out = flex_attention_dense(q, k, v, is_causal=causal)
        assert out.dtype == torch.float32 and out.shape == q.shape
        mask = torch.ones(77, 77, dtype=torch.bool).tril() if causal else None
        torch.testing.assert_close(out.double(), exact(q, k, v, mask), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(out, reference_attention(q, k, v, is_causal=causal), atol=2e-6, rtol=1e-5)
    out = flex_attention_dense(q, k, v, scale=0.3)
    torch.testing.assert_close(out.double(), exact(q, k, v, scale=0.3), atol=2e-6, rtol=1e-5)
    # cross-attention shapes (fewer keys) and grouped-query heads
    k2, v2 = k[:, :1, :20], v[:, :1, :20]
    torch.testing.assert_close(flex_attention_dense(q, k2, v2).double(),
                               exact(q, k2.expand(-1, 3, -1, -1), v2.expand(-1, 3, -1, -1)), atol=2e-6, rtol=1e-5)


def test_no_grid_and_cross_attention_run_dense_and_are_counted_dense():
    grid = TokenGrid(5, 6, 7)
    q, k, v = qkv(grid.seq_len)
    out, stats = sparse_attention(q, k, v, grid=None, spec="sta:tile=2x4x3,block=16", return_stats=True)
    assert not stats.sparse_call and stats.fraction == 1.0
    torch.testing.assert_close(out, exact(q, k, v), atol=1e-12, rtol=1e-10)
    kx, vx = k[:, :, :11], v[:, :, :11]
    out, stats = sparse_attention(q, kx, vx, grid=grid, spec="radial:block=16", return_stats=True)
    assert not stats.sparse_call and stats.computed == stats.total == 14  # ceil(210/16) x ceil(11/16)
    torch.testing.assert_close(out, exact(q, kx, vx), atol=1e-12, rtol=1e-10)


def test_mismatched_grid_and_causal_are_refused():
    grid = TokenGrid(5, 6, 7)
    q, k, v = qkv(grid.seq_len - 1)
    with pytest.raises(ValueError, match="does not match the grid 5x6x7"):
        sparse_attention(q, k, v, grid=grid, spec="sta:tile=2x4x3,block=16")
    q, k, v = qkv(grid.seq_len)
    with pytest.raises(ValueError, match="does not match"):  # raster length given as already tile-ordered
        sparse_attention(q, k, v, grid=grid, spec="sta:tile=2x4x3,block=16", already_tile_ordered=True)
    with pytest.raises(ValueError, match="bidirectional"):
        sparse_attention(q, k, v, grid=grid, spec="sta:tile=2x4x3,block=16", is_causal=True)


def test_block_masks_are_built_once_per_shape():
    clear_block_mask_cache()
    grid = TokenGrid(5, 6, 7)
    a = block_mask("sta:tile=2x4x3,block=16", grid)
    assert block_mask("sta:window=3x3x3,tile=2x4x3,block=16", grid)[0] is a[0]  # same spec, other spelling
    assert block_mask("sta:tile=2x4x3,block=16", TokenGrid(5, 6, 8))[0] is not a[0]
    assert tile_layout(grid, (2, 4, 3), "block", 16) is a[2]


# ----------------------------------------------------------------------------------------------------------
# Tile order once per forward (tiny Wan)
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan():
    from vdbench.pipelines import load_pipeline

    return load_pipeline("tiny", "t2v", "wan").transformer.eval()


def _run_wan(transformer, monkeypatch, attend, timestep=None):
    """One forward of the tiny Wan transformer (latent grid 5 x 6 x 7 after patchify) with every attention call
    routed through ``attend`` (BHSD), by replacing diffusers' dispatcher inside transformer_wan only."""
    import diffusers.models.transformers.transformer_wan as tw

    calls = []

    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        assert attn_mask is None and dropout_p == 0.0
        calls.append((query.shape[1], key.shape[1]))
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return attend(q, k, v, scale=scale, is_causal=is_causal).transpose(1, 2)

    g = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 5, 12, 14, generator=g)
    text = torch.randn(1, 8, 32, generator=g)
    t = torch.tensor([500]) if timestep is None else timestep
    with monkeypatch.context() as m:
        if attend is not None:
            m.setattr(tw, "dispatch_attention_fn", dispatch)
        with torch.no_grad():
            out = transformer(latents, t, text, return_dict=False)[0]
    return out, calls


def test_once_per_forward_tile_order_equals_raster_and_per_call(wan, monkeypatch):
    from vdbench.families.wan import grid_hooks

    raster, _ = _run_wan(wan, monkeypatch, None)  # diffusers' own attention (sdpa), raster order
    dense = flex_attention_dense

    # dense FlexAttention in raster order equals the model's own attention
    out, _ = _run_wan(wan, monkeypatch, lambda q, k, v, **kw: dense(q, k, v, **kw))
    torch.testing.assert_close(out, raster, atol=1e-5, rtol=1e-4)

    # dense attention in padded tile order, once per forward (an STA window covering the grid): same output
    full = "sta:window=5x3x5,tile=2x4x4,block=16"
    with grid_hooks(wan, full) as hooks:
        seen = []
        out, calls = _run_wan(wan, monkeypatch, lambda q, k, v, **kw: (seen.append(hooks.layout.length),
                                                                       hooks.attend(q, k, v, **kw))[1])
        lay = layout_for(full, TokenGrid(5, 6, 7))
        assert lay.pad_tokens > 0 and set(seen) == {lay.length}  # the blocks saw the padded tile layout
        assert [c[0] for c in calls] == [lay.length] * 4 and [c[1] for c in calls] == [lay.length, 8] * 2
        assert hooks.tally.sparse_calls == 2 and hooks.tally.dense_calls == 2  # self: sparse, cross: dense
        assert hooks.layout is None and hooks.grid is None  # cleared after the forward
    torch.testing.assert_close(out, raster, atol=1e-5, rtol=1e-4)

    # real patterns: once per forward equals the per-call form (and not the dense output)
    for spec in ("sta:window=1x3x1,tile=2x4x4,block=16", "sta:window=3x1x1,tile=2x2x4,block=16,pad=none",
                 "radial:block=16,sink=0,decay=0.5"):
        with grid_hooks(wan, spec) as once:
            a, _ = _run_wan(wan, monkeypatch, once.attend)
        with grid_hooks(wan, spec, once_per_forward=False) as per_call:
            b, calls = _run_wan(wan, monkeypatch, per_call.attend)
            assert [c[0] for c in calls] == [210] * 4  # the model's own order inside the blocks
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert (a - raster).abs().max() > 1e-3
        assert once.tally.as_dict()["block_pairs_computed"] < once.tally.as_dict()["block_pairs_total"]

    # hooks removed: the model is untouched
    assert not wan._forward_hooks and not wan._forward_pre_hooks and not wan.rope._forward_hooks
    assert not wan.blocks[0]._forward_pre_hooks and not wan.blocks[-1]._forward_hooks
    again, _ = _run_wan(wan, monkeypatch, None)
    assert torch.equal(again, raster)


def test_once_per_forward_with_per_token_timesteps(wan, monkeypatch):
    """Wan 2.2 ti2v passes one timestep per token: its modulation is permuted with the hidden states."""
    from vdbench.families.wan import grid_hooks

    spec = "sta:window=1x3x1,tile=2x4x4,block=16"
    ts = torch.linspace(0, 999, 210).round().long()[None]  # (batch, tokens), raster order
    with grid_hooks(wan, spec) as once:
        a, _ = _run_wan(wan, monkeypatch, once.attend, timestep=ts)
    with grid_hooks(wan, spec, once_per_forward=False) as per_call:
        b, _ = _run_wan(wan, monkeypatch, per_call.attend, timestep=ts)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_hooks_refuse_other_models():
    from vdbench import families

    wan, cog = families.get("wan"), families.get("cogvideox")
    for once in (True, False):
        with pytest.raises(TypeError, match="WanTransformer3DModel"):
            wan.grid_hooks(torch.nn.Linear(2, 2), "sta", once_per_forward=once)
    with pytest.raises(TypeError, match="CogVideoXTransformer3DModel"):
        cog.grid_hooks(torch.nn.Linear(2, 2), "sta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled FlexAttention kernel needs CUDA")
def test_compiled_kernel_follows_the_block_lists_on_cuda():
    """On a GPU the fused kernel skips empty blocks and runs full ones without mask_mod: its output must still be
    exact masked attention (the CPU tests check the block lists only through kernel_view_mask). The token mask
    here is the vectorized cell form (equal to the brute force on the small grids above), at 128-token blocks."""
    from vdbench.sparse import pattern_cells

    for grid, text in [(TokenGrid(7, 12, 20), "sta:window=3x3x3,tile=2x4x8"),
                       (TokenGrid(7, 12, 20, 40, True), "sta:window=1x3x3,tile=3x4x8,pad=none"),
                       (TokenGrid(9, 12, 20), "radial:sink=1,decay=0.5")]:
        spec = parse_spec(text)
        lay = layout_for(spec, grid)
        cell, allow, _ = pattern_cells(spec, lay)
        mask = allow[cell[:, None], cell[None, :]][lay.inverse][:, lay.inverse].cuda()
        assert not mask.all()
        q, k, v = (t.cuda().float() for t in qkv(grid.seq_len, d=64, seed=4))
        out = sparse_attention(q, k, v, grid=grid, spec=spec)
        torch.testing.assert_close(out.double(), exact(q, k, v, mask), atol=2e-3, rtol=2e-3)
        out = sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), grid=grid, spec=spec)
        torch.testing.assert_close(out.double(), exact(q, k, v, mask), atol=3e-2, rtol=3e-2)
