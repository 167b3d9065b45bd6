"""bench/lab/bench_stitch.py runs both sides on tiny clips and reports the schema docs/PERFORMANCE.md quotes."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_stitch_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_stitch", ROOT / "bench" / "lab" / "bench_stitch.py")
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    assert bs.main(["--frames", "5", "--size", "96x64", "--repeats", "1", "-o", str(tmp_path / "s.json")]) == 0
    out = json.loads((tmp_path / "s.json").read_text())
    assert out["inputs"] == 6 and out["grid"] == "2x3"
    for side in ("vdbench stitch_grid (labelled)", "ffmpeg xstack (no labels)"):
        r = out["results"][side]
        assert r["wall_median_s"] > 0 and r["cpu_median_s"] > 0 and len(r["wall_s"]) == 1
    assert out["results"]["ffmpeg xstack (no labels)"]["ratio_to_xstack"] == 1.0
