"""What each denoising step cost the card in energy, and whether the card ran at its power cap, read from NVML
(``nvidia-ml-py``, the driver's own counters) while the steps run.

A card held at its power cap runs each step in the time its energy takes at the cap: work moved beside other work
(an exchange overlapped with compute) then buys no time, only less work does. So a render records, per step, the
joules the card spent, its mean power, its median SM clock and the share of the step it spent power-capped; a
multi-GPU render's entry adds the ranks' joules up, the energy of the layout's step.

A sampler thread reads the card's energy counter (mJ; the driver updates it about every 10 ms), its SM clock and
its clock event reasons every ``interval_ms``, and notes when each step's closing CUDA event completes (polled
from the same thread: the render's stream is never waited for). A step's ends are placed on the host's clock by
the GPU's own times between the marks, anchored where every mark's window (after the poll before its completion was
seen, by the poll that saw it) agrees; its energy is the counter's difference across them (linearly interpolated
between samples: about one update, ~10 ms of the card's power, of error at each end). Off CUDA, without NVML, or
with ``interval_ms`` 0 there is no trace: the entry says why (:func:`open_trace`).
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from typing import Optional

import torch

__all__ = ["PowerTrace", "open_trace", "all_ranks", "warm_energy", "INSTALL_HINT", "POWER_CAP_REASONS"]

INSTALL_HINT = "pip install nvidia-ml-py"
#: NVML's clock event reasons that mean the power limit held the clock: the software power cap, the hardware
#: power brake (bits of ``nvmlClocksEventReason``)
POWER_CAP_REASONS = 0x4 | 0x80
_REASON_NAMES = {0x1: "idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}


def _reason_names(mask: int) -> list[str]:
    return [name for bit, name in _REASON_NAMES.items() if mask & bit]


def warm_energy(energy_j: list) -> Optional[float]:
    """A warm step's joules: the mean of the steps after the first -- the counter's difference across the whole warm
    stretch per step, since the steps' figures are differences at shared ends (a step's own figure carries up to one
    counter update of error at each end; the stretch's inner ends cancel). None where a step has no figure."""
    warm = list(energy_j[1:])
    if not warm or any(x is None for x in warm):
        return None
    return round(sum(warm) / len(warm), 3)


class PowerTrace:
    """The samples of one pipeline call's card: :meth:`start`, :meth:`watch` each step mark as it is made,
    :meth:`stop`, then :meth:`steps` for the per-step figures. ``nvml``: the ``pynvml`` module (a stand-in in
    tests); ``handle``: the card's."""

    def __init__(self, nvml, handle, interval_ms: float):
        self.nvml, self.handle, self.interval_s = nvml, handle, interval_ms / 1e3
        self.samples: list[tuple[float, float, int, int]] = []  # (host s, energy mJ, SM MHz, reasons mask)
        # id(event) -> (the host time of the poll before, the host time its completion was first seen)
        self.seen: dict[int, tuple[float, float]] = {}
        self._pending: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None
        try:
            self.limit_w: Optional[float] = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
        except Exception:  # noqa: BLE001 - a card that hides its limit still counts energy
            self.limit_w = None
        self._reasons_fn = None
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            try:  # the newer name first; older drivers know only the second
                getattr(nvml, name)(handle)
            except Exception:  # noqa: BLE001 - NVMLError_FunctionNotFound, or a binding without it
                continue
            self._reasons_fn = getattr(nvml, name)
            break

    def _reasons(self) -> int:
        return int(self._reasons_fn(self.handle)) if self._reasons_fn is not None else 0

    def sample(self) -> None:
        """One reading of the card, and the completion of every watched mark done by now."""
        nvml, h = self.nvml, self.handle
        energy = float(nvml.nvmlDeviceGetTotalEnergyConsumption(h))
        clock = int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
        reasons = self._reasons()
        now = time.perf_counter()
        before = self.samples[-1][0] if self.samples else float("-inf")
        self.samples.append((now, energy, clock, reasons))
        with self._lock:
            while self._pending and self._pending[0].query():  # marks complete in the order they were recorded
                self.seen[id(self._pending.pop(0))] = (before, now)

    def _sampled(self) -> bool:
        try:
            self.sample()
        except Exception as e:  # noqa: BLE001 - a counter that stops answering ends the trace, not the render
            self.error = f"{type(e).__name__}: {e}"
            return False
        return True

    def _done(self) -> bool:
        with self._lock:
            return self._stop.is_set() and not self._pending

    def _run(self) -> None:
        # after stop() the thread samples on until the last watched mark has completed: the render's host never
        # waits for the GPU on its account, and every step ends inside the trace
        while self._sampled() and not self._done():
            time.sleep(self.interval_s)

    def start(self) -> "PowerTrace":
        self._sampled()  # a reading before any mark made after this call: every step starts inside the trace
        self._thread = threading.Thread(target=self._run, name="vdbench-power", daemon=True)
        self._thread.start()
        return self

    def watch(self, event) -> None:
        """Note when ``event`` (a recorded CUDA event, a step's mark) completes."""
        with self._lock:
            self._pending.append(event)

    def stop(self) -> None:
        """No marks after this: the thread stops once every watched one has completed (it does not wait here)."""
        self._stop.set()

    def _joined(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _energy_at(self, t: float, times: list) -> Optional[float]:
        """The counter at host time ``t``, interpolated between the samples (``times``: theirs, in order)."""
        if not times or not times[0] <= t <= times[-1]:
            return None  # outside the trace: no figure rather than an extrapolated one
        i = bisect.bisect_left(times, t)
        if times[i] == t:
            return self.samples[i][1]
        (t0, e0, _, _), (t1, e1, _, _) = self.samples[i - 1], self.samples[i]
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def steps(self, events: list) -> dict:
        """Per step between consecutive ``events`` (the step marks, recorded CUDA events, the first the first
        step's start): ``energy_j``, ``power_w``, ``sm_clock_mhz`` (median of its samples), ``capped_share`` (its
        samples' share with a power-cap reason), then the warm steps' (after the first): their energy and power
        over the whole warm stretch (the counter's difference from the second mark to the last, per step: a step's
        own figure carries up to one counter update of error at each end, which the stretch's inner ends cancel),
        the medians of their clocks and capped shares."""
        self._joined()  # the marks have completed by now (their times were read): the thread ends at once
        if self.error is not None:
            return {"source": None, "why": f"NVML stopped answering: {self.error}"}
        first = events[0]
        at = [first.elapsed_time(e) / 1e3 for e in events]  # the GPU's seconds since the first mark
        seen = [(self.seen[id(e)], a) for e, a in zip(events, at) if id(e) in self.seen]
        if not seen or len(self.samples) < 2:
            return {"source": None, "why": "no step mark was seen completing while the card was sampled"}
        # each mark completed after the poll before it was seen and by the poll that saw it: the host time of the
        # GPU's zero lies in every mark's window, so in their intersection; its middle is the estimate
        lo = max(b - a for (b, _), a in seen)
        hi = min(n - a for (_, n), a in seen)
        zero = (max(lo, hi - self.interval_s) + hi) / 2
        ends = [zero + a for a in at]
        times = [s[0] for s in self.samples]
        energy, power, clock, capped, reasons = [], [], [], [], 0
        for t0, t1 in zip(ends, ends[1:]):
            e0, e1 = self._energy_at(t0, times), self._energy_at(t1, times)
            j = (e1 - e0) / 1e3 if e0 is not None and e1 is not None else None
            inside = self.samples[bisect.bisect_left(times, t0):bisect.bisect_right(times, t1)]
            energy.append(None if j is None else round(j, 3))
            power.append(None if j is None else round(j / (t1 - t0), 1))
            clock.append(statistics.median(s[2] for s in inside) if inside else None)
            capped.append(round(sum(1 for s in inside if s[3] & POWER_CAP_REASONS) / len(inside), 3)
                          if inside and self._reasons_fn is not None else None)
            for s in inside:
                reasons |= s[3]

        def warm(xs):
            xs = [x for x in xs[1:] if x is not None]
            return statistics.median(xs) if xs else None

        warm_j = warm_energy(energy)
        warm_w = None if warm_j is None else round(warm_j * (len(ends) - 2) / (ends[-1] - ends[1]), 1)
        return {"source": "nvml", "interval_ms": self.interval_s * 1e3, "limit_w": self.limit_w,
                "samples": len(self.samples), "energy_j": energy, "power_w": power, "sm_clock_mhz": clock,
                "capped_share": capped, "warm_energy_j": warm_j, "warm_power_w": warm_w,
                "warm_sm_clock_mhz": warm(clock), "warm_capped_share": warm(capped),
                "reasons_seen": _reason_names(reasons)}


def open_trace(device, interval_ms: float, uuid: Optional[str] = None):
    """A :class:`PowerTrace` of ``device``'s card (found by its UUID, whatever ``CUDA_VISIBLE_DEVICES``
    renumbered), or a str saying why there is none."""
    if interval_ms <= 0:
        return "off (--power_interval_ms 0)"
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if uuid is None:
        return "the card's UUID is unknown"
    try:
        import pynvml
    except ImportError:
        return f"NVML's Python binding is not installed ({INSTALL_HINT})"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception as e:  # noqa: BLE001 - NVMLError_*: a MIG slice, an old card, no driver library
        return f"NVML can't read this card's energy ({type(e).__name__}: {e})"
    return PowerTrace(pynvml, handle, interval_ms)


def all_ranks(records: list) -> dict:
    """The cards of a multi-GPU render together (each rank's :meth:`PowerTrace.steps` record): ``energy_j`` per step
    (the ranks' joules added up: the energy of the layout's step) and ``warm_energy_j``, the ranks' warm figures
    added up, or why there is none (the first rank without a figure)."""
    for r in records:
        if not r or r.get("source") is None:
            return {"source": None, "why": (r or {}).get("why", "a rank recorded nothing")}
    per_step = [None if any(r["energy_j"][i] is None for r in records) else round(sum(r["energy_j"][i]
                                                                                    for r in records), 3)
                for i in range(min(len(r["energy_j"]) for r in records))]
    warm = [r.get("warm_energy_j") for r in records]
    return {"source": "nvml", "cards": len(records), "energy_j": per_step,
            "warm_energy_j": None if None in warm else round(sum(warm), 3)}
