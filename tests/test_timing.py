"""vdbench.timing's one step-time definition: warm step = median of the steps after the first, with n and the
spread; the first step on its own; CPU timings, emulations and n < 3 are not speed figures."""

import json
from pathlib import Path

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
    """bench/lab/warm_steps.py: the numbers docs/PERFORMANCE.md was corrected with, from both raw formats."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("warm_steps", Path(__file__).resolve().parents[1] / "bench" /
                                                  "lab" / "warm_steps.py")
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


class FakeClock:
    """``time_call`` for :func:`vdbench.timing.sample_ms`: each call of ``fn`` "takes" the next of ``times`` ms (the
    last one repeated), so the sample count and the budget are checked without waiting."""

    def __init__(self, *times):
        self.times, self.calls = list(times), 0

    def __call__(self, fn):
        fn()
        t = self.times[min(self.calls, len(self.times) - 1)]
        self.calls += 1
        return t


@pytest.mark.parametrize("call_ms", [175.0, 3000.0])  # FlashAttention-3 at Wan 14B 720p; an exact kernel there
def test_sample_count_reaches_the_minimum_for_a_slow_kernel(call_ms):
    """do_bench's rep=100 ms gave one or two samples of such a call; the adaptive count gives 5, the first call
    timed on its own and never among them."""
    ran = []
    clock = FakeClock(9000.0, call_ms)  # the first call pays a compile
    got = T.sample_ms(lambda: ran.append(1), "cuda", rep_ms=100, warmup_ms=25, budget_s=60, time_call=clock)
    assert got.n == T.TARGET_SAMPLES == 5 and got.why_fewer is None
    assert got.first_ms == 9000.0 and got.samples == [call_ms] * 5 and got.estimate_ms == call_ms
    assert len(ran) == clock.calls == 1 + got.warmup_calls + got.n  # first call, one warm-up call, the samples
    st = got.stats()
    assert st["median"] == call_ms and st["first_excess_ms"] == 9000.0 - call_ms and st["p20"] == st["p80"]


def test_short_calls_get_rep_ms_worth_of_samples():
    got = T.sample_ms(lambda: None, "cuda", rep_ms=100, warmup_ms=25, time_call=FakeClock(50.0, 2.0))
    assert got.warmup_calls == 13 and got.n == 50 and got.why_fewer is None  # 25 ms of warm-up, 100 ms timed
    assert T.sample_ms(lambda: None, "cuda", rep_ms=100, max_samples=20, time_call=FakeClock(0.01)).n == 20


def test_a_call_longer_than_the_budget_gets_one_sample_and_says_why():
    clock = FakeClock(2000.0)
    got = T.sample_ms(lambda: None, "cuda", budget_s=1.0, time_call=clock)
    assert got.n == 1 and clock.calls == 2  # the first call, then the warm-up call: no further call
    assert "more than the 1 s budget" in got.why_fewer and "1 sample" in got.why_fewer
    ok, why = T.speed_verdict("cuda", got.n)
    assert not ok and "n=1" in why


def test_the_budget_caps_the_count_and_stops_calls_slower_than_estimated():
    got = T.sample_ms(lambda: None, "cuda", budget_s=10.0, time_call=FakeClock(3000.0))
    assert got.n == 3 and "3 calls of ~3 s fit in the 10 s budget" in got.why_fewer
    # the warm-up said 100 ms, the calls then take 400: the third would pass the 1 s budget
    got = T.sample_ms(lambda: None, "cuda", budget_s=1.0, time_call=FakeClock(100.0, 100.0, 400.0))
    assert got.samples == [400.0, 400.0] and got.planned == 5 and "fewer than 5" in got.why_fewer


def test_sample_ms_on_the_host_clock_with_a_sleeping_call():
    import time

    got = T.sample_ms(lambda: time.sleep(0.01), "cpu", rep_ms=0, warmup_ms=0)
    assert got.n == 5 and got.warmup_calls == 1 and all(5 < t < 2000 for t in got.samples)
    assert 5 < got.first_ms < 2000 and T.first_call_ms(lambda: None, "cpu") >= 0


def test_fresh_cache_env_gives_new_empty_folders_and_removes_them(monkeypatch, tmp_path):
    for var in T.CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert T.cache_state()["caches"] == "default (not cleared)"
    with T.fresh_cache_env({"KEEP": "1"}) as env, T.fresh_cache_env() as other:
        dirs = [env[v] for v in T.CACHE_VARS]
        assert env["KEEP"] == "1" and all(Path(d).is_dir() and not any(Path(d).iterdir()) for d in dirs)
        assert set(dirs).isdisjoint(other[v] for v in T.CACHE_VARS)  # new folders each time
        assert T.cache_state(env) == {"caches": "empty", "cache_dirs": dict(zip(T.CACHE_VARS, dirs))}
        (Path(dirs[0]) / "kernel.cubin").write_bytes(b"x")
        assert T.cache_state(env)["caches"] == "not empty"
    assert not any(Path(d).exists() for d in dirs)


def test_gpu_samples_write_over_l2_before_each_warm_call(monkeypatch):
    """On a GPU (mocked): the first call after a synchronize, then every warm call (warm-up and samples) after the
    flush buffer is written over, outside the timed span -- what do_bench does between its calls."""
    log = []

    class Buf:
        def zero_(self):
            log.append("flush")

    monkeypatch.setattr(T.torch, "empty", lambda *a, **k: (log.append(("alloc", k.get("device"))), Buf())[1])
    monkeypatch.setattr(T.torch.cuda, "synchronize", lambda *a: log.append("sync"))
    monkeypatch.setattr(T, "call_ms", lambda fn, device: (fn(), log.append("call"), 175.0)[2])
    got = T.sample_ms(lambda: None, "cuda", rep_ms=100, warmup_ms=25)
    assert got.n == 5 and got.first_ms == 175.0 and got.warmup_calls == 1
    assert log == ["sync", "call", ("alloc", "cuda")] + ["flush", "call"] * 6


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


def test_fixed_interleaved_and_burst_timers_count_their_calls():
    """The benches' other timers live beside sample_ms: a fixed count after warm-up, several callables taking turns,
    a burst timed as one; each calls exactly as often as it says."""
    from vdbench import timing as T

    n = {"a": 0, "b": 0}

    def a():
        n["a"] += 1

    def b():
        n["b"] += 1

    xs = T.fixed_ms(a, "cpu", reps=4, warmup=2)
    assert len(xs) == 4 and n["a"] == 6 and all(x >= 0 for x in xs)
    got = T.interleaved_ms({"a": a, "b": b}, "cpu", reps=3, warmup=1)
    assert set(got) == {"a", "b"} and all(len(v) == 3 for v in got.values()) and n == {"a": 10, "b": 4}
    assert T.burst_ms(b, "cpu", 5) >= 0 and n["b"] == 9


def test_laps_add_up_with_a_callee_timing_into_the_same_parts(monkeypatch):
    """A lap is the time since the previous one less what a callee billed to the same parts meanwhile: every second
    counted once; without parts nothing is timed."""
    import vdbench.timing as T

    import types

    clock = iter([0.0, 1.0, 1.5, 3.5, 4.0, 6.0, 7.0])
    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))  # this module's clock
    parts: dict = {}
    outer = T.Laps(parts)  # t = 0
    outer.lap("a")  # 1.0
    inner = T.Laps(parts)  # 1.5: a callee's own laps into the same dict
    assert inner.lap("b", "value") == "value"  # 3.5: b = 2.0
    outer.lap("rest")  # 4.0: 3.0 since a, less b's 2.0
    outer.lap("a")  # 6.0: a second lap of a adds to it
    assert parts == {"a": 3.0, "b": 2.0, "rest": 1.0} and sum(parts.values()) == 6.0
    assert T.Laps(None).lap("x", 7) == 7  # nothing asked, nothing measured
