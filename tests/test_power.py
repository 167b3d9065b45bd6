"""vdbench.power: per-step joules from the card's energy counter, placed by the step marks' completion (a stand-in
for NVML and for the CUDA events; the real ones are read by the GPU suites)."""

from __future__ import annotations

import types

import pytest

from vdbench import power as PW
from vdbench.timing import StepTimer


class FakeNvml:
    """A card drawing ``watts`` (a function of host time), its energy counter in mJ updated on every read."""

    NVML_CLOCK_SM = 1

    def __init__(self, clock, watts, reasons=lambda t: 0x4, event_reasons=True):
        self.clock, self.watts, self.reasons = clock, watts, reasons
        if not event_reasons:  # an older driver: only the throttle name answers
            self.nvmlDeviceGetCurrentClocksEventReasons = self._missing

    def _missing(self, h):
        raise RuntimeError("NVMLError_FunctionNotFound")

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        t, e, step = 0.0, 0.0, 1e-3  # integrate the power up to now
        while t < self.clock.t:
            e += self.watts(t) * step * 1e3
            t += step
        return e

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1500 if self.reasons(self.clock.t) & PW.POWER_CAP_REASONS else 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self.reasons(self.clock.t)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self.reasons(self.clock.t)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000


class FakeEvent:
    """A step mark completing at GPU time ``at`` (s); the host sees the GPU's time ``lag`` s later."""

    def __init__(self, clock, at, lag=0.0):
        self.clock, self.at, self.lag = clock, at, lag

    def query(self):
        return self.clock.t >= self.at + self.lag

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.at - self.at) * 1e3


def _trace(monkeypatch, watts, reasons=lambda t: 0x4, event_reasons=True):
    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(PW.time, "perf_counter", lambda: clock.t)
    nvml = FakeNvml(clock, watts, reasons, event_reasons)
    return clock, PW.PowerTrace(nvml, handle=None, interval_ms=10)


def _run(clock, trace, events, until, dt=0.01, stalled=()):
    """Sample every ``dt`` until ``until``, except inside the ``stalled`` (start, end) spans: the host thread off."""
    for e in events:
        trace.watch(e)
    while clock.t <= until:
        if not any(a <= clock.t < b for a, b in stalled):
            trace.sample()
        clock.t = round(clock.t + dt, 6)


def test_step_energy_is_the_counter_across_each_step(monkeypatch):
    # 400 W for the first step (0-1 s), 600 W after; power-capped from 1 s on
    clock, trace = _trace(monkeypatch, lambda t: 400.0 if t < 1.0 else 600.0,
                          reasons=lambda t: 0x4 if t >= 1.0 else 0x1)
    ends = [0.05, 1.0, 1.5, 2.0, 2.5]
    events = [FakeEvent(clock, a, lag=0.003) for a in ends]  # each completion seen within one sampling interval
    _run(clock, trace, events, until=2.6)
    rec = trace.steps(events)
    assert rec["source"] == "nvml" and rec["limit_w"] == 700.0
    assert rec["energy_j"][0] == pytest.approx(380.0, rel=0.02)
    for j in rec["energy_j"][1:]:
        assert j == pytest.approx(300.0, rel=0.03)  # 600 W for 0.5 s
    assert rec["power_w"][1] == pytest.approx(600.0, rel=0.03)
    assert rec["warm_energy_j"] == pytest.approx(300.0, rel=0.01)  # over the warm stretch: 900 J / 3 steps
    assert rec["warm_power_w"] == pytest.approx(600.0, rel=0.01)
    assert rec["capped_share"][0] < 0.1 and rec["warm_capped_share"] == 1.0
    assert rec["sm_clock_mhz"][0] == 1980 and rec["warm_sm_clock_mhz"] == 1500
    assert rec["reasons_seen"] == ["idle", "sw_power_cap"]


def test_the_soonest_seen_completion_anchors_the_marks(monkeypatch):
    # one mark seen late (the sampler held off for 0.3 s): the others, seen promptly, place the steps
    clock, trace = _trace(monkeypatch, lambda t: 100.0 if t < 1.6 else 500.0)
    events = [FakeEvent(clock, 0.05, 0.001), FakeEvent(clock, 1.0, 0.001), FakeEvent(clock, 2.0, 0.002)]
    _run(clock, trace, events, until=2.5, stalled=[(0.95, 1.25)])
    rec = trace.steps(events)
    # 100 W for 0.95 s, then 0.6 s at 100 W and 0.4 s at 500 W (anchored at the late mark: 0.35 and 0.65 s)
    assert rec["energy_j"] == [pytest.approx(95.0, rel=0.03), pytest.approx(260.0, rel=0.03)]


def test_an_older_driver_counts_energy_without_cap_reasons(monkeypatch):
    clock, trace = _trace(monkeypatch, lambda t: 300.0, event_reasons=False)
    events = [FakeEvent(clock, a) for a in (0.05, 0.55, 1.05)]
    _run(clock, trace, events, until=1.1)
    rec = trace.steps(events)
    assert rec["warm_energy_j"] == pytest.approx(150.0, rel=0.03)
    assert rec["capped_share"] == [1.0, 1.0] and rec["reasons_seen"] == ["sw_power_cap"]  # the throttle name


def test_marks_outside_the_trace_have_no_figure(monkeypatch):
    clock, trace = _trace(monkeypatch, lambda t: 300.0)
    events = [FakeEvent(clock, a) for a in (0.05, 0.55, 5.0)]  # the last step ends after the sampling stopped
    _run(clock, trace, events[:2], until=1.0)
    trace.seen[id(events[2])] = (4.99, 5.0)
    rec = trace.steps(events)
    assert rec["energy_j"][0] == pytest.approx(150.0, rel=0.03) and rec["energy_j"][1] is None
    assert rec["power_w"][1] is None and rec["warm_energy_j"] is None


def test_a_counter_that_stops_answering_ends_the_trace_not_the_render(monkeypatch):
    clock, trace = _trace(monkeypatch, lambda t: 300.0)

    def broken(h):
        raise RuntimeError("NVMLError_GpuIsLost")

    trace.nvml.nvmlDeviceGetTotalEnergyConsumption = broken
    trace.start()
    trace.stop()
    assert trace.steps([FakeEvent(clock, 0.0), FakeEvent(clock, 1.0)]) == {
        "source": None, "why": "NVML stopped answering: RuntimeError: NVMLError_GpuIsLost"}


def test_open_trace_says_why_there_is_none():
    assert PW.open_trace("cpu", 10.0) == "not a CUDA device"
    assert PW.open_trace("cpu", 0) == "off (--power_interval_ms 0)"


def test_the_ranks_joules_add_up_to_the_layouts_step():
    a = {"source": "nvml", "energy_j": [500.0, 300.0, 310.0], "warm_energy_j": 305.0}
    b = {"source": "nvml", "energy_j": [480.0, 290.0, None], "warm_energy_j": 295.0}
    out = PW.all_ranks([a, b])
    assert out["energy_j"] == [980.0, 590.0, None] and out["warm_energy_j"] == 600.0 and out["cards"] == 2
    assert PW.all_ranks([a, dict(b, warm_energy_j=None)])["warm_energy_j"] is None
    assert PW.all_ranks([a, {"source": None, "why": "not a CUDA device"}]) == {"source": None,
                                                                              "why": "not a CUDA device"}


def test_a_cpu_step_timer_records_why_it_has_no_joules():
    timer = StepTimer("cpu", power=PW.open_trace("cpu", 10.0))

    def pipe(callback_on_step_end):
        for i in range(2):
            callback_on_step_end(None, i, None, {})
        return "done"

    assert timer.run_pipe(pipe) == "done"
    assert len(timer.step_times()) == 2
    assert timer.power_record() == {"source": None, "why": "not a CUDA device"}


def test_the_sampler_thread_times_marks_as_they_complete():
    import time

    class Now:
        @property
        def t(self):
            return time.perf_counter()

    now = Now()
    nvml = FakeNvml(now, lambda t: 0.0)
    t0 = time.perf_counter()
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: (time.perf_counter() - t0) * 250.0 * 1e3  # 250 W
    trace = PW.PowerTrace(nvml, handle=None, interval_ms=1).start()
    events = [FakeEvent(now, t0 + 0.02 + 0.05 * i) for i in range(4)]
    for e in events:
        trace.watch(e)
    time.sleep(0.2)
    trace.stop()
    rec = trace.steps(events)
    assert len(trace.seen) == 4 and rec["samples"] > 5  # it sampled on its own, again and again
    for j in rec["energy_j"]:
        assert j == pytest.approx(12.5, rel=0.25)  # 250 W x 50 ms


def test_a_renders_record_carries_its_joules_per_warm_step():
    from vdbench.measure.record import from_render_entry

    e = {"attention_type": "fav3", "step_times": [1.5, 1.0, 1.0, 1.0], "run": {"backend": {"name": "fav3"}},
         "power": {"source": "nvml", "energy_j": [900.0, 700.0, 720.0, 710.0], "warm_power_w": 705.0,
                   "warm_capped_share": 1.0}}
    figs = from_render_entry(e).figures
    assert figs["step_energy_j"] == 710.0 and figs["step_power_w"] == 705.0 and figs["step_capped_share"] == 1.0
    e["power_all_ranks"] = {"source": "nvml", "energy_j": [1800.0, 1400.0, 1440.0, 1420.0]}  # every card's
    assert from_render_entry(e).figures["step_energy_j"] == 1420.0
    assert "step_energy_j" not in from_render_entry(dict(e, power={"source": None, "why": "x"},
                                                         power_all_ranks=None)).figures
