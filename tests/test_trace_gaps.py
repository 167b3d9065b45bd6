"""bench/trace_gaps.py: the timeline arithmetic on a hand-made trace whose answers are known."""

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("trace_gaps", Path(__file__).resolve().parents[1] / "bench/trace_gaps.py")
tg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tg)


def k(name, ts, dur, tid=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_busy_idle_and_exposed_communication(tmp_path):
    events = [
        k("sm90_xmma_gemm_bf16", 0, 100),                    # 0-100 compute
        k("ncclDevKernel_SendRecv", 50, 100, tid=9),         # 50-150: 50 hidden by the GEMM, 50 exposed
        k("flash_fwd_kernel", 200, 300),                     # idle 150-200 (50 us gap)
        k("vectorized_elementwise_kernel", 510, 10),         # idle 500-510 (10 us: under the gap threshold)
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host ops are not GPU time
    ]
    r = tg.analyse(events, min_gap_us=20)
    assert r["span_ms"] == pytest.approx(0.520)
    assert r["busy_ms"] == pytest.approx(0.460)
    assert r["idle_ms"] == pytest.approx(0.060)
    assert r["comm_ms"] == pytest.approx(0.100)
    assert r["comm_exposed_ms"] == pytest.approx(0.050)
    assert r["gaps"]["count"] == 1 and r["gaps"]["sum_ms"] == pytest.approx(0.050)
    gap = r["gaps"]["largest"][0]
    assert gap["after"].startswith("ncclDevKernel") and gap["before"] == "flash_fwd_kernel"
    assert r["categories_ms"]["attention"] == pytest.approx(0.3)

    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "gaps.json"
    assert tg.main([str(path), "-o", str(out)]) == 0
    assert json.loads(out.read_text())[str(path)]["busy_ms"] == pytest.approx(0.460)


def test_a_cpu_only_trace_says_so():
    assert "no GPU kernels" in tg.analyse([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])["error"]


def test_gaps_the_host_caused_are_told_from_gaps_waiting_on_another_stream():
    def launch(corr, ts, dur=5, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur, "tid": tid,
                "args": {"correlation": corr}}

    def kern(name, ts, dur, corr):
        return {**k(name, ts, dur), "args": {"correlation": corr}}

    events = [
        kern("gemm", 0, 100, 1), launch(1, -10),
        # gap 100-200: the next kernel was launched at 190, after a synchronize the host sat in
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": -50, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 95, "dur": 90, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 96, "dur": 85, "tid": 1},
        kern("flash_fwd_kernel", 200, 100, 2), launch(2, 190),
        # gap 300-400: launched at 50, long before: it waited on something else (another stream, a peer)
        kern("vectorized_elementwise_kernel", 400, 10, 3), launch(3, 50),
    ]
    r = tg.analyse(events, min_gap_us=20)
    assert r["gaps"]["count"] == 2 and r["gaps"]["host_bound_ms"] == pytest.approx(0.100)
    host_gap, wait_gap = sorted(r["gaps"]["largest"], key=lambda g: g["at_ms"])
    assert host_gap["launched_us"] == 90 and host_gap["host"][0] == {"op": "aten::item", "us": 85.0}
    assert host_gap["host_ops_us"] == 90.0  # aten::item in the gap (85 us, its sync nested in it) + the launch (5)
    assert wait_gap["launched_us"] == -250 and wait_gap["host"] == []  # nothing but the profiler's step mark
    # a trace without the host side says nothing of it
    assert tg.analyse([k("gemm", 0, 10), k("gemm", 100, 10)])["gaps"]["host_bound_ms"] is None


def test_per_step_gives_each_kernel_to_the_step_that_launched_it(tmp_path):
    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 1,
                "args": {"correlation": corr}}

    def kern(name, ts, dur, corr):
        return {**k(name, ts, dur), "args": {"correlation": corr}}

    mark = lambda n, ts, dur: {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts,  # noqa: E731
                               "dur": dur, "tid": 1}
    events = [mark(1, 0, 100), mark(2, 100, 100),
              launch(1, 10), kern("gemm", 20, 50, 1),
              launch(2, 90), kern("flash_fwd_kernel", 95, 80, 2),     # launched in step 1, runs into step 2's time
              launch(3, 150), kern("gemm", 200, 40, 3),               # step 2 (its kernel after a 25 us gap)
              kern("ncclDevKernel_AllToAll", 240, 30, 99)]            # no launch event: by its own start, step 2
    parts = dict(tg.split_steps(events))
    assert list(parts) == ["ProfilerStep#1", "ProfilerStep#2"]
    s1, s2 = (tg.analyse(parts[n], min_gap_us=20) for n in parts)
    assert s1["kernels"] == 2 and s1["span_ms"] == pytest.approx(0.155) and s1["idle_ms"] == pytest.approx(0.025)
    assert s2["kernels"] == 2 and s2["comm_exposed_ms"] == pytest.approx(0.030)
    assert tg.split_steps([k("gemm", 0, 5)]) == []  # no marks: nothing to split by
    path = tmp_path / "rank0_step2.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "g.json"
    assert tg.main([str(path), "--per_step", "-o", str(out)]) == 0
    assert sorted(json.loads(out.read_text())) == [f"{path}#ProfilerStep#1", f"{path}#ProfilerStep#2"]
