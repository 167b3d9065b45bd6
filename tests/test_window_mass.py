"""bench/lab/window_mass.py on CPU: the in-window softmax mass against hand-checkable cases (uniform attention puts
exactly the key share inside, a window covering the grid everything), and end to end on tiny Wan captures."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from vdbench.sparse import TokenGrid

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("window_mass", ROOT / "bench" / "lab" / "window_mass.py")
wm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wm)

GRID = TokenGrid(3, 4, 6)


def test_uniform_attention_puts_the_key_share_inside_and_a_covering_window_everything():
    q = torch.zeros(2, GRID.seq_len, 8)  # every score 0: uniform softmax rows
    k = torch.randn(2, GRID.seq_len, 8)
    cells, allow = wm.token_cells("sta:window=1x1x1,tile=1x2x2,block=16", GRID)
    queries = torch.arange(GRID.seq_len)
    mass, share = wm.window_mass(q, k, cells, allow, queries, scale=1.0, chunk=7)
    torch.testing.assert_close(mass, share)
    assert mass.shape == (2, GRID.seq_len) and 0 < share.mean() < 0.5
    cells, allow = wm.token_cells("sta:window=3x3x3,tile=1x2x2,block=16", GRID)
    mass, share = wm.window_mass(torch.randn(2, GRID.seq_len, 8), k, cells, allow, queries, scale=1.0)
    torch.testing.assert_close(mass, torch.ones_like(mass))
    torch.testing.assert_close(share, torch.ones_like(share))


def test_local_attention_puts_more_than_the_key_share_inside():
    # keys equal to their queries, large scale: each query attends (almost only) to itself -- inside any window
    x = torch.randn(1, GRID.seq_len, 16)
    cells, allow = wm.token_cells("sta:window=1x1x1,tile=1x2x2,block=16", GRID)
    mass, share = wm.window_mass(x, x, cells, allow, torch.arange(GRID.seq_len), scale=10.0)
    assert mass.mean() > 0.95 and share.mean() < 0.2


def test_tiny_wan_captures_end_to_end(tmp_path, capsys):
    import run_wan

    assert run_wan.main(["--model", "tiny", "--num_frames", "9", "--height", "64", "--width", "96",
                         "--num_inference_steps", "1", "--attention_type", "sdpa", "--save_inputs",
                         "--max_captures", "3", "--output_dir", str(tmp_path)]) == 0
    # a capture of a sparse run holds its tokens in the pattern's tile order: said, and left out
    first = torch.load(tmp_path / "captures" / "attn_sdpa_rank0_000000.pt", weights_only=True)
    first["meta"]["args"]["tile_order"] = "sta:window=1x3x3+tile=1x2x2+pad=block+block=16"
    torch.save(first, tmp_path / "captures" / "attn_sdpa_rank0_000009.pt")
    out = tmp_path / "mass.json"
    rc = wm.main([str(tmp_path / "captures"), "--grid", "3x4x6", "--pattern", "sta:window=1x3x3,tile=1x2x2,block=16",
                  "--pattern", "radial:block=16", "--max_queries", "40", "-o", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    # captures 0 and 2 are self-attention of blocks 0 and 1 (2 heads each); capture 1 is cross-attention: skipped
    assert {r["file"] for r in rows} == {"attn_sdpa_rank0_000000.pt", "attn_sdpa_rank0_000002.pt"}
    assert len(rows) == 2 * 2 * 2 and all(r["queries"] == 40 for r in rows)
    assert all(0 <= r["mass_p10"] <= r["mass_median"] <= 1 and 0 < r["key_share"] <= 1 for r in rows)
    assert len(data["skipped"]) == 2 and "cross attention" in data["skipped"][0]
    assert "tile order of sta:window=1x3x3" in data["skipped"][1]
    printed = capsys.readouterr().out
    assert "mass inside" in printed and "key share" in printed
    assert wm.main([str(tmp_path / "captures"), "--grid", "3x4x7"]) == 4  # no capture on that grid
    with pytest.raises(ValueError, match="even size"):
        wm.main([str(tmp_path / "captures"), "--grid", "3x4x6", "--pattern", "sta:window=2x2x2"])
