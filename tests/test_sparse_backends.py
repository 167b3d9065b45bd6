"""The sparse backends of the registry (vdbench/backends/sparse.py): names with options, labels, the grid they
need (per-model state through the patching core), dense where no grid applies, the packaged STA kernel's
availability and grid refusals, and a tiny Wan render with ``sta`` counted per kernel, kind and step."""

import json
import sys

import pytest
import torch

from vdbench import backends as B
from vdbench.backends import sparse as S
from vdbench.patching import AttentionPatch
from vdbench.sparse import TokenGrid, layout_for, parse_spec, reference_mask, to_layout
from tests.test_patching import cog_inputs, run, small_cogvideox, small_wan, wan_inputs
from tests.test_sparse import exact, qkv

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SMALL_STA = "sta:window=1x3x1,tile=1x2x2,block=16"  # on small_wan's 3x4x4 grid: 3x2x2 tiles of 4 tokens


# ----- names, options, labels -----

def test_names_with_options_resolve_to_one_entry_per_option_set():
    sta = B.resolve("sta")
    assert sta.sparse is not None and sta.sparse.spec == parse_spec("sta")
    assert sta.kernel == "flex.sta[window=3x3x3,tile=6x8x8]"
    assert B.resolve("sta:window=3x3x3,tile=6x8x8") is sta  # the defaults: the base entry (one render, one name)
    a = B.resolve("sta:window=3x5x5,tile=6x8x8")
    assert a.name == "sta:window=3x5x5" and B.resolve("sta:tile=6x8x8+window=3x5x5") is a and B.resolve(a.name) is a
    assert B.canonical_name("sta:window=3x5x5,tile=6x8x8") == "sta:window=3x5x5"
    r = B.resolve("radial:decay=0.5,pad=none")
    assert r.name == "radial:decay=0.5+pad=none" and r.kernel == "flex.radial[decay=0.5,sink=1,pad=none]"
    assert parse_spec(r.name) == r.sparse.spec  # a configured name parses back to its spec
    assert B.resolve("flex").sparse is None and B.resolve("flex").kernel == S.DENSE_LABEL


@pytest.mark.parametrize("text, fragment", [
    ("sta:window=2x3x3", "even size"),
    ("sta:nope=1", "unknown option 'nope'"),
    ("radial:window=3x3x3", "unknown option 'window'"),
    ("fav3:window=3x3x3", "'fav3' takes no options"),
    ("flex:window=3x3x3", "'flex' takes no options"),
    ("sta_kernel:tile=6x4x4", "window= is its only option"),
    ("stta:window=3x3x3", "did you mean 'sta'"),
])
def test_bad_option_strings_are_refused_in_one_line(text, fragment):
    with pytest.raises(B.BackendUnavailable) as e:
        B.resolve(text)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert B.canonical_name(text) == text  # unresolvable: left as typed, the render refuses it with the reason


def test_sparse_entries_are_listed_with_what_they_need():
    table = B.capability_table("cpu", torch.float32)
    for name in ("flex", "sta", "radial"):
        assert B.availability(name, "cpu", torch.float32) == (True, "ok")
    assert "needs the token grid" in table
    assert not B.resolve("sta").supports_causal and B.resolve("flex").supports_causal


def test_a_causal_call_is_refused_by_the_patterns():
    q, k, v = qkv(48)
    with pytest.raises(B.UnsupportedCall, match="does not support causal attention"):
        B.resolve("sta").check_call(q, k, v, is_causal=True)  # what the patch asks before every call
    with pytest.raises(ValueError, match="bidirectional"):
        B.resolve(SMALL_STA).sparse.attend(q, k, v, grid=TokenGrid(3, 4, 4), is_causal=True)
    B.resolve("flex").check_call(q.float(), k.float(), v.float(), is_causal=True)  # dense FlexAttention serves them


def test_a_grid_backend_called_bare_refuses_instead_of_running_dense():
    q, k, v = qkv(48)
    with pytest.raises(B.UnsupportedCall, match="needs the token grid"):
        B.resolve("sta")(q, k, v)


def test_flex_equals_exact_attention():
    q, k, v = qkv(50, d=16)
    torch.testing.assert_close(B.resolve("flex")(q, k, v).double(), exact(q, k, v), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("spec", [SMALL_STA, "radial:block=16,sink=0,decay=0.5", "sta:window=1x1x1,tile=1x2x2,block=16,pad=tile"])
def test_grid_use_attend_runs_the_pattern_and_counts_cross_attention_dense(spec):
    entry = B.resolve(spec)
    grid = TokenGrid(3, 4, 4)
    q, k, v = qkv(grid.seq_len)
    out, label, stats = entry.sparse.attend(q, k, v, grid=grid)
    assert label == entry.kernel and stats.sparse_call and stats.fraction < 1
    torch.testing.assert_close(out, exact(q, k, v, reference_mask(grid, spec)), atol=1e-9, rtol=1e-9)
    # tokens already in the pattern's tile order (once per forward): the same output, in that order
    lay = layout_for(spec, grid)
    ql, kl, vl = (to_layout(t, lay, 2) for t in (q, k, v))
    out_l, _, _ = entry.sparse.attend(ql, kl, vl, grid=grid, tile_ordered=True)
    real = lay.index < grid.seq_len  # pad rows are don't-care
    torch.testing.assert_close(out_l[:, :, real], to_layout(out, lay, 2)[:, :, real], atol=1e-9, rtol=1e-9)
    # no grid (cross-attention): dense on the same mechanism, counted as such
    out_x, label_x, stats_x = entry.sparse.attend(q, k[:, :, :7], v[:, :, :7], grid=None)
    assert label_x == S.DENSE_LABEL and not stats_x.sparse_call and stats_x.fraction == 1.0
    torch.testing.assert_close(out_x, exact(q, k[:, :, :7], v[:, :, :7]), atol=1e-9, rtol=1e-9)


def test_pattern_labels_and_entry_names():
    assert S.pattern_label(parse_spec("sta:window=3x5x5,pad=none")) == "flex.sta[window=3x5x5,tile=6x8x8,pad=none]"
    assert S.entry_name(parse_spec("sta:tile=6x8x8,window=3x3x3")) == "sta"
    assert S.entry_name(parse_spec("radial:sink=0,block=64")) == "radial:sink=0+block=64"


# ----- through the patching core: the grid hooks, the tile order, the counts -----

def test_the_patch_routes_grid_backends_through_the_models_hooks():
    model = small_wan()
    x = wan_inputs()
    base = run(model, x)
    seen = []
    with AttentionPatch([("transformer", model)], "sta:window=1x3x1,tile=2x2x4,block=16",
                        observers=[lambda info: seen.append((info.kind, info.args.get("tile_order")))]):
        run(model, x)
    assert seen[0] == ("self", "sta:window=1x3x1+tile=2x2x4+pad=block+block=16")  # captures say their token order
    assert seen[1] == ("cross", "sta:window=1x3x1+tile=2x2x4+pad=block+block=16")
    with AttentionPatch([("transformer", model)], "flex") as patch:
        torch.testing.assert_close(run(model, x), base, atol=1e-5, rtol=1e-4)  # flex equals the model's sdpa
    assert dict(patch.stats.calls) == {"flex.dense": 4}
    outs = {}
    for once in (True, False):
        with AttentionPatch([("transformer", model)], SMALL_STA, tile_order_once=once) as patch:
            outs[once] = run(model, x)
            assert model._forward_pre_hooks  # the grid hooks are on while the patch is
        assert dict(patch.stats.calls) == {"flex.sta[window=1x3x1,tile=1x2x2,block=16]": 2, "flex.dense": 2}
        assert dict(patch.stats.calls_by_kind) == {"self": 2, "cross": 2}
        frac = patch.stats.fraction_computed()
        assert frac["cross"] == 1.0 and 0 < frac["self"] < 1
        assert not model._forward_pre_hooks and not model.blocks[0]._forward_pre_hooks  # removed with the patch
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-4)  # once per forward == per call
    assert (outs[True] - base).abs().max() > 1e-4  # and the pattern did change the output


def test_cogvideox_joint_attention_keeps_text_attended():
    model = small_cogvideox()
    x = cog_inputs()
    spec = "sta:window=1x1x1,tile=1x2x2,block=16"
    with AttentionPatch([("transformer", model)], spec) as patch:
        out = run(model, x)
    assert dict(patch.stats.calls) == {"flex.sta[window=1x1x1,tile=1x2x2,block=16]": 2}
    assert dict(patch.stats.calls_by_kind) == {"joint": 2}
    with AttentionPatch([("transformer", model)], "sta:window=3x3x3,tile=1x2x2,block=16"):
        full = run(model, x)  # a window covering the 2x4x4 grid: dense, text or not
    torch.testing.assert_close(full, run(model, x), atol=1e-5, rtol=1e-4)
    assert (out - full).abs().max() > 1e-4


def test_a_model_without_a_grid_is_refused_at_install():
    class Proc:
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, **kw):
            return torch.nn.functional.scaled_dot_product_attention(hidden_states, hidden_states, hidden_states)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.processor = Proc()
            self.w = torch.nn.Parameter(torch.zeros(1))

    with pytest.raises(B.BackendUnavailable, match="can't run on transformer: Attn has no known token grid"):
        AttentionPatch([("transformer", Attn())], "sta").install()


# ----- the packaged STA kernel -----

@pytest.fixture
def packages(tmp_path, monkeypatch):
    """A broken st_attn (its extension built for another torch) and a working fastvideo_kernel stand-in that
    returns v, so the test sees which token order the kernel got and what it was asked."""
    (tmp_path / "st_attn").mkdir()
    (tmp_path / "st_attn" / "__init__.py").write_text(
        "raise ImportError('st_attn_cuda.so: undefined symbol: _ZN3c1019c10_cuda_check_implementation')\n")
    (tmp_path / "fastvideo_kernel").mkdir()
    (tmp_path / "fastvideo_kernel" / "__init__.py").write_text(
        "calls = []\n"
        "def sliding_tile_attention(q, k, v, window_size, text_length, has_text=True, dit_seq_shape='30x48x80'):\n"
        "    calls.append((tuple(q.shape), window_size, text_length, has_text, dit_seq_shape))\n"
        "    return v.clone()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    S._sta_module.cache_clear()
    yield tmp_path
    for name in ("st_attn", "fastvideo_kernel"):
        sys.modules.pop(name, None)
    S._sta_module.cache_clear()


def test_sta_kernel_says_what_the_import_said(packages, monkeypatch):
    (packages / "fastvideo_kernel" / "__init__.py").write_text("raise OSError('undefined symbol: ncclCommQueryProperties')\n")
    ok, why = S._sta_kernel_probe(torch.device("cuda"))
    assert not ok
    assert "st_attn: import failed: ImportError: st_attn_cuda.so: undefined symbol" in why
    assert "fastvideo_kernel: import failed: OSError: undefined symbol: ncclCommQueryProperties" in why


def test_sta_kernel_runs_only_its_grids_in_tile_order(packages):
    ok, why = S._sta_kernel_probe(torch.device("cuda"))
    assert ok, why
    entry = B.resolve("sta_kernel:window=1x3x3")
    assert entry.name == "sta_kernel:window=1x3x3" and entry.sparse.spec.pad == "none"
    q, k, v = qkv(TokenGrid(3, 4, 4).seq_len)
    with pytest.raises(B.UnsupportedCall, match="not 3x4x4; use 'sta'"):
        entry.sparse.attend(q, k, v, grid=TokenGrid(3, 4, 4))
    grid = TokenGrid(18, 48, 80)  # Wan 69x768x1280, one of the package's grids
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, grid.seq_len, 4, generator=g) for _ in range(3))
    out, label, stats = entry.sparse.attend(q, k, v, grid=grid)
    import fastvideo_kernel

    assert fastvideo_kernel.calls == [((1, 2, grid.seq_len, 4), [(1, 3, 3)] * 2, 0, False, "18x48x80")]
    torch.testing.assert_close(out, v)  # v went in in tile order and came back in the model's order
    assert label == "fastvideo_kernel.sliding_tile_attention[window=1x3x3]" and 0 < stats.fraction < 1
    _, label_x, _ = entry.sparse.attend(q[:, :, :64], k[:, :, :9], v[:, :, :9], grid=None)
    assert label_x == S.DENSE_LABEL  # cross-attention: the kernel has no dense mode, FlexAttention runs it


def test_sta_kernel_unavailable_here_names_the_missing_package(monkeypatch):
    S._sta_module.cache_clear()
    ok, why = B.availability("sta_kernel", "cpu")
    assert not ok and ("package not installed: st_attn or fastvideo_kernel" in why or "CUDA" in why)


# ----- a tiny Wan render with sta -----

def test_tiny_wan_render_with_sta_counts_per_kernel_kind_and_step(tmp_path):
    import run_wan

    rc = run_wan.main(["--model", "tiny", "--num_frames", "9", "--height", "64", "--width", "96",
                       "--num_inference_steps", "3", "--attention_type", "sta:window=1x3x3,tile=2x2x2,block=16",
                       "--output_dir", str(tmp_path)])
    assert rc == 0
    entry = json.loads((tmp_path / "results" / "timing.json").read_text())[-1]
    assert entry["attention_type"] == "sta:window=1x3x3+tile=2x2x2+block=16"
    att = entry["attention"]
    label = "flex.sta[window=1x3x3,tile=2x2x2,block=16]"
    # 3 steps x 2 (guidance) x 2 blocks: self-attention sparse, cross-attention dense on the same mechanism
    assert att["calls_by_kernel"] == {label: 12, "flex.dense": 12}
    assert att["calls_by_step"] == {str(s): {label: 4, "flex.dense": 4} for s in range(3)}
    assert att["block_pairs"][label]["self"]["sparse_calls"] == 12 and att["fraction_computed"]["cross"] == 1.0
    assert 0 < att["fraction_computed"]["self"] < 1
    assert (tmp_path / "results" / f"wan_result_t2v_tiny_9f_3s_attn_{entry['attention_type']}_64x96.mp4").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packaged STA kernel and compiled FlexAttention need CUDA")
def test_sta_kernel_matches_flexattention_on_cuda():
    """Where the packaged kernel imports (not as shipped against torch 2.11/2.13: the skip says what its import
    said), its output on one of its grids equals the FlexAttention form of the same mask within bf16 rounding."""
    S._sta_module.cache_clear()
    ok, why = S._sta_kernel_probe(torch.device("cuda"))
    if not ok:
        pytest.skip(f"sta_kernel unavailable: {why}")
    grid = TokenGrid(18, 48, 80)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, grid.seq_len, 128, generator=g).cuda().bfloat16() for _ in range(3))
    kernel, _, _ = B.resolve("sta_kernel").sparse.attend(q, k, v, grid=grid)
    flex, _, _ = B.resolve("sta:pad=none").sparse.attend(q, k, v, grid=grid)
    err = ((kernel.float() - flex.float()).norm() / flex.float().norm()).item()
    assert err < 2e-2, err
