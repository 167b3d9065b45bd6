"""vdbench.timing's one step-time definition: warm step = median of the steps after the first, with n and the
spread; the first step on its own; CPU timings, emulations and n < 3 are not speed figures."""

import json

import pytest
import torch

from vdbench import timing as T


def test_warm_step_excludes_the_first_step_and_reports_it_alone():
    # the H200 pattern: a first step 1.5-5.6x a warm one; the first-included median would be 1363.4 here
    s = T.step_stats([5.0, 0.9412, 1.3634, 0.9, 1.0], device="cuda:0")
    assert s["first_step"] == 5.0
    assert s["warm_step_n"] == 4
    assert s["warm_step_median"] == pytest.approx((0.9412 + 1.0) / 2)
    assert s["warm_step_min"] == 0.9 and s["warm_step_max"] == 1.3634
    assert s["warm_step_mean"] == pytest.approx((0.9412 + 1.3634 + 0.9 + 1.0) / 4)
    # linear interpolation between order statistics (numpy's default)
    assert s["warm_step_p20"] == pytest.approx(0.9 + 0.6 * (0.9412 - 0.9))
    assert s["warm_step_p80"] == pytest.approx(1.0 + 0.4 * (1.3634 - 1.0))
    assert s["speed_figure"] is True and s["why_not_speed"] is None
    assert set(s) == set(T.STEP_KEYS)
    assert "step_time_median" not in s  # the ambiguous old key is gone from new entries


def test_spread_matches_numpy_percentiles():
    np = pytest.importorskip("numpy")
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    s = T.spread(xs)
    assert s["p20"] == pytest.approx(float(np.percentile(xs, 20)))
    assert s["p80"] == pytest.approx(float(np.percentile(xs, 80)))
    assert s["median"] == pytest.approx(float(np.median(xs))) and s["n"] == 7
    assert T.spread([None])["n"] == 0 and T.spread([])["median"] is None


@pytest.mark.parametrize("device,n,emulated,reason", [
    ("cpu", 10, False, "CPU timing"),
    ("cuda:0", 2, False, "n=2 timed samples (< 3)"),
    ("cuda", 10, True, "emulated backend"),
])
def test_not_a_speed_figure_says_why(device, n, emulated, reason):
    ok, why = T.speed_verdict(device, n, emulated)
    assert ok is False and reason in why


def test_speed_verdict_on_a_gpu_with_enough_samples():
    assert T.speed_verdict("cuda:1", 3) == (True, None)
    assert T.speed_verdict(None, None) == (True, None)  # nothing known: nothing claimed against it


def test_one_step_render_has_no_warm_step():
    s = T.step_stats([2.0], device="cuda")
    assert s["first_step"] == 2.0 and s["warm_step_n"] == 0 and s["warm_step_median"] is None
    assert s["speed_figure"] is False and "n=0" in s["why_not_speed"]
    assert "no warm step" in T.describe_steps(s)


def test_repetitions_pool_warm_steps_and_keep_each_repetitions_median():
    s = T.run_step_stats([[4.0, 1.0, 1.2], [3.0, 1.1, 1.5]], device="cuda")
    assert s["warm_step_n"] == 4 and s["warm_step_median"] == pytest.approx(1.15)
    assert s["first_step"] == pytest.approx(3.5)
    assert s["repetitions"] == 2 and s["rep_warm_medians"] == [pytest.approx(1.1), pytest.approx(1.3)]
    assert (s["rep_warm_min"], s["rep_warm_max"]) == (pytest.approx(1.1), pytest.approx(1.3))
    assert s["speed_figure"] is True


def test_describe_steps_names_the_definition_n_and_spread():
    line = T.describe_steps(T.step_stats([1.3634, 0.95, 0.9412, 0.93], device="cpu"))
    assert line.startswith("warm step 941.2 ms (median of n=3 steps after the first; p20–p80 ")
    assert "min–max 930.0–950.0" in line and line.endswith("first step 1363.4 ms")


def test_append_timing_keeps_the_new_keys(tmp_path):
    path = tmp_path / "timing.json"
    T.append_timing(path, [{"attention_type": "sdpa", "step_times": [2.0, 1.0, 1.0, 1.0],
                            **T.step_stats([2.0, 1.0, 1.0, 1.0], "cuda")}])
    (e,) = json.loads(path.read_text())
    assert e["warm_step_median"] == 1.0 and e["first_step"] == 2.0 and e["speed_figure"] is True


def test_warm_steps_script_recomputes_recorded_runs(tmp_path, capsys):
    """bench/warm_steps.py: the numbers docs/PERFORMANCE.md was corrected with, from both raw formats."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("warm_steps", Path(__file__).resolve().parents[1] / "bench" /
                                                  "warm_steps.py")
    ws = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ws)
    (tmp_path / "timing.json").write_text(json.dumps([{"attention_type": "fav3", "step_times": [1.5519, 1.0889, 1.1167]}]))
    (tmp_path / "ps.json").write_text(json.dumps([
        {"group": "w", "backend": "fav3", "config": "1 GPU", "gpus": 1, "step_times_ms": [1739.1, 1110.4, 1187.8]},
        {"group": "w", "backend": "fav3", "config": "u4", "gpus": 4, "step_times_ms": [2442.7, 355.1, 390.5]}]))
    assert ws.main([str(tmp_path / "timing.json"), str(tmp_path / "ps.json"), "-o", str(tmp_path / "o.json")]) == 0
    rows = json.loads((tmp_path / "o.json").read_text())
    assert rows[0]["first_included_median_ms"] == pytest.approx(1116.7)
    assert rows[0]["warm_step_ms"] == pytest.approx(1102.8) and rows[0]["warm_step_n"] == 2
    one, four = rows[1], rows[2]
    assert one["warm_step_ms"] == pytest.approx(1149.1) and "speedup_vs_1gpu" not in one
    assert four["speedup_vs_1gpu"] == pytest.approx(1149.1 / 372.8)
    assert four["efficiency"] == pytest.approx(four["speedup_vs_1gpu"] / 4)
    assert "3.08x" in capsys.readouterr().out


def test_call_ms_times_one_call_on_the_host_clock_off_a_gpu():
    import time

    calls = []
    ms = T.call_ms(lambda: (calls.append(1), time.sleep(0.02)), "cpu")
    assert calls == [1] and 15 < ms < 2000


def test_process_start_and_the_start_a_render_counts_from(monkeypatch):
    import vdbench

    t, clock = T.process_start()
    if clock != "vdbench_import":  # Linux: the kernel's record, before this interpreter imported vdbench
        assert clock in ("proc_starttime", "proc_starttime+btime") and t < vdbench.IMPORTED_AT
    monkeypatch.setattr(T, "_PROCESS_START_USED", False)
    first, second = T.wall_start(from_process=True), T.wall_start(from_process=True)
    assert first.since in ("process start", "vdbench import") and first.clock == clock
    assert second.as_dict() == {"since": "render call", "clock": "perf_counter"} and second.t > first.t
    assert T.wall_start(from_process=False).since == "render call"

    def unreadable(*a, **k):
        raise OSError("no /proc here")

    monkeypatch.setattr(T, "open", unreadable, raising=False)  # no /proc: the import of vdbench is the start
    assert T.process_start() == (vdbench.IMPORTED_AT, "vdbench_import")
    monkeypatch.setattr(T, "_PROCESS_START_USED", False)
    assert T.wall_start(from_process=True).as_dict() == {"since": "vdbench import", "clock": "vdbench_import"}


def test_compile_seconds_reads_torch_compiles_time():
    from vdbench.timing import compile_seconds

    before = compile_seconds()
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="aot_eager")
    fn(torch.randn(8))
    assert compile_seconds() - before > 0
