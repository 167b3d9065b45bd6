"""vdbench.measure.record: one record schema, written as JSON lines and read back -- with the files the tools
wrote before records (timing.json, the attention / VAE / cold-decode benches' JSON, compare_outputs' JSON) read as
records of the same schema, and anything else refused with the path and line."""

import json
import threading
from pathlib import Path

import pytest

from vdbench.measure import record as M

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "docs" / "gpu_results"


def _rec(i=0, **kw):
    return M.Record(suite="attention", case=f"in/k{i}", config={"backend": {"name": f"k{i}"}},
                    figures={"time_ms": M.figure([1.0, 2.0, 3.0], first=9.0)},
                    verdict={"speed_figure": True, "why_not": None}, timer="CUDA events", **kw)


def test_a_figure_keeps_its_samples_spread_and_first_call_apart():
    f = M.figure([3.0, 1.0, 2.0, None], first=10.0)
    assert f["samples"] == [3.0, 1.0, 2.0] and f["n"] == 3 and f["median"] == 2.0 and f["first"] == 10.0
    assert f["min"] == 1.0 and f["max"] == 3.0 and f["unit"] == "ms"


def test_records_round_trip_through_json_lines(tmp_path):
    p = tmp_path / "sub" / "records.jsonl"
    M.Writer(p).write(_rec(0), _rec(1, command="bench x", commit="abc"))
    M.Writer(p).write(_rec(2))
    got = M.read(p)
    assert [r.case for r in got] == ["in/k0", "in/k1", "in/k2"]
    assert got[1] == _rec(1, command="bench x", commit="abc") and got[1].source == f"{p}:2"
    assert got[0].speed_figure is True and got[0].schema == M.SCHEMA and got[0].version == M.VERSION


def test_concurrent_writers_interleave_whole_lines(tmp_path):
    p = tmp_path / "records.jsonl"

    def write(t):
        for i in range(20):
            M.Writer(p).write(_rec(t * 100 + i))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.case for r in M.read(p)) == sorted(f"in/k{t * 100 + i}" for t in range(4) for i in range(20))


def test_bad_files_are_refused_with_the_path_and_line(tmp_path):
    p = tmp_path / "records.jsonl"
    M.Writer(p).write(_rec())
    with open(p, "a") as f:
        f.write("{not json\n")
    with pytest.raises(M.RecordError, match=r"records.jsonl:2: not JSON"):
        M.read(p)
    newer = tmp_path / "newer.jsonl"
    newer.write_text(json.dumps({**_rec().to_json(), "version": M.VERSION + 1}) + "\n")
    with pytest.raises(M.RecordError, match="update vdbench"):
        M.read(newer)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"something": 1}))
    with pytest.raises(M.RecordError, match="no vdbench tool writes this JSON shape"):
        M.read(other)
    (tmp_path / "x.jsonl").write_text(json.dumps({"schema": "else"}) + "\n")
    with pytest.raises(M.RecordError, match="not a vdbench.record"):
        M.read(tmp_path / "x.jsonl")


def test_older_files_read_as_records():
    (r,) = M.read(RAW / "h200" / "2026-11-26_cold" / "f" / "res" / "r480" / "fast" / "1" / "results" / "timing.json")
    assert r.suite == "render" and r.case == "default" and r.config["settings"]["vae_decode"] == "fast"
    assert r.figures["step_ms"]["n"] == 1 and r.figures["step_ms"]["first"] == pytest.approx(1505.198486328125)
    assert r.system["gpu"] == "NVIDIA H200" and r.verdict == {"speed_figure": False, "why_not": r.data["why_not_speed"]}
    att = M.read(RAW / "h200" / "2026-11-26_cold" / "e" / "attn14.json")
    fav3 = next(a for a in att if a.case == "wan2.1-14b-720p/fav3")
    assert fav3.figures["time_ms"]["n"] == 5 and fav3.figures["time_ms"]["first"] == pytest.approx(3456.668701171875)
    assert fav3.config["shape"]["Sq"] == 75600 and fav3.timer == "CUDA events, L2 flushed" and fav3.speed_figure
    sta = next(a for a in att if a.case.endswith("/sta"))
    assert sta.verdict["why_not"].startswith("unavailable")
    cold = M.read(RAW / "h200" / "2026-11-26_cold" / "f" / "cold480.json")
    assert {c.case for c in cold} == {"bf16", "prewarm"} and all(c.figures["decode_s"]["n"] == 2 for c in cold)
    vae = M.read(RAW / "4xh200" / "2026-11-22_x4" / "vae" / "vae_wan21.json")
    assert vae and all(v.suite == "vae" and v.config["model"] for v in vae)
    q = M.read(RAW / "h200" / "2026-11-22_verify_call2" / "wan_quality.json")
    assert q and all(v.suite == "quality" for v in q)


def test_the_fp8_and_sage2_benches_json_read_as_records():
    fp8 = M.read(next(RAW.rglob("fp8_bench.json")))
    assert fp8 and all(r.suite == "fp8" and "/" in r.case for r in fp8)
    timed = [r for r in fp8 if "registry_ms" in r.figures]
    assert timed and all(r.figures["registry_ms"]["n"] for r in timed)
    sage = M.read(next(RAW.rglob("sage2_bench_h200.json")))
    assert sage and all(r.suite == "sage2" for r in sage) and any("time_ms" in r.figures for r in sage)

