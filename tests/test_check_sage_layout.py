"""bench/lab/check_sage_layout.py on CPU with a stand-in sageattention: the row it writes, and that it tells a good
build (both layouts equal, close to exact attention) from one whose NHD path is wrong.

Why: the check exists to run right after a 3-minute build on a rented GPU; a bug in it found there costs a call.
"""

import importlib.util
import json
import sys
from pathlib import Path

from tests import fake_packages as F

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_sage_layout", ROOT / "bench" / "lab" / "check_sage_layout.py")
cs = importlib.util.module_from_spec(spec)
sys.modules["check_sage_layout"] = cs
spec.loader.exec_module(cs)


def _rows(tmp_path, monkeypatch, core):
    F.install_sage2(tmp_path / "pkg", monkeypatch, core=core)
    try:
        assert cs.main(["--out", str(tmp_path / "o"), "--shapes", "tiny,tiny-cross", "--reps", "2",
                        "--device", "cpu"]) == 0
    finally:
        F.forget("sageattention")
    data = json.loads((tmp_path / "o" / "sage_layout.json").read_text())
    return {r["shape"]: r for r in data["rows"]}


def test_a_good_build_gives_the_same_output_in_both_layouts(tmp_path, monkeypatch):
    rows = _rows(tmp_path, monkeypatch, F.SAGE2_CORE)
    for r in rows.values():
        assert "error" not in r, r
        assert r["picked_layout"] == "NHD" and r["nhd_equals_hnd"] and not r["nan_nhd"]
        assert r["rel_l2_nhd"] < 0.1 and r["rel_l2_nhd"] == r["rel_l2_hnd_contiguous"]
        assert r["n"] == 2 and r["timer"].startswith("host clock") and r["ms_nhd"] > 0
    assert rows["tiny-cross"]["S_kv"] == 128


def test_a_wrong_nhd_path_shows_as_uncorrelated_layouts(tmp_path, monkeypatch):
    broken = F.SAGE2_CORE.replace('        nhd = tensor_layout == "NHD"', "        nhd = False")
    assert broken != F.SAGE2_CORE
    r = _rows(tmp_path, monkeypatch, broken)["tiny"]
    assert not r["nhd_equals_hnd"] and r["rel_l2_nhd"] > 0.5 and r["rel_l2_hnd_views"] < 0.1
