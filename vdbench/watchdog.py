"""A timeout around work that can hang (a VAE decode, a render), with all-thread stack dumps.

Why: on ROCm, MIOpen's Find phase can hang forever on 3-D convolutions, and a decode that runs out of memory
under a driver that retries can stall silently. A benchmark or a render must never wait forever: when the
watchdog expires it

1. dumps every thread's stack (``sys._current_frames`` formatted into the report, and ``faulthandler``'s C-level
   dump to stderr, which also works when the interpreter is wedged inside a C call),
2. records the run as *hung* together with the last stage that completed (``Watchdog.stage``),
3. interrupts the main thread — a real signal (SIGUSR2, sent to the main thread with ``pthread_kill``, whose
   handler is installed for the duration) so that blocking calls such as ``sleep`` or a lock wait are woken up
   (``_thread.interrupt_main`` alone only sets a flag that a blocked thread never looks at) — so the caller
   gets :class:`WatchdogTimeout` and can go on with the next config, and
4. if the main thread does not come back within ``grace_s`` (stuck in a C call that never returns to Python),
   ends the process with ``exit_code`` (124, like ``timeout(1)``) — never waits forever.

Usage::

    with Watchdog(timeout_s=60, label="bf16") as wd:
        wd.stage("load")
        ...
        wd.stage("decode")
        ...
    # raises WatchdogTimeout (with .report) if it expired

``timeout_s=None`` (or <= 0) disables the timer but keeps stage tracking, so callers need no second code path.
"""

from __future__ import annotations

import _thread
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Watchdog", "WatchdogTimeout", "HangReport", "dump_all_stacks"]


@dataclass
class HangReport:
    """What the watchdog saw when it expired (plain data, JSON-able via ``as_dict``)."""

    label: str
    timeout_s: float
    elapsed_s: float
    last_completed_stage: Optional[str]
    current_stage: Optional[str]
    stacks: str
    stages: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"status": "hung", "label": self.label, "timeout_s": self.timeout_s, "elapsed_s": self.elapsed_s,
                "last_completed_stage": self.last_completed_stage, "current_stage": self.current_stage,
                "stages": list(self.stages), "stacks": self.stacks}


class _Expired(BaseException):
    """Raised by the signal handler inside the body (BaseException: an ``except Exception`` in the body does
    not swallow it); turned into WatchdogTimeout by ``__exit__``."""


_SIGNAL = getattr(signal, "SIGUSR2", None)


class WatchdogTimeout(TimeoutError):
    """Raised in the main thread when the watchdog expired; ``report`` is the :class:`HangReport`."""

    def __init__(self, report: HangReport):
        super().__init__(f"{report.label or 'work'} hung: no completion within {report.timeout_s:g} s "
                         f"(last completed stage: {report.last_completed_stage or 'none'}; "
                         f"in stage: {report.current_stage or 'none'})")
        self.report = report


def dump_all_stacks() -> str:
    """Every Python thread's current stack, as text (thread name and id first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} (id {ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """Context manager: a daemon timer thread that fires once after ``timeout_s`` seconds (see module doc)."""

    def __init__(self, timeout_s: Optional[float], label: str = "", grace_s: float = 10.0, exit_code: int = 124,
                 stream=None, on_hang=None):
        self.timeout_s = float(timeout_s) if timeout_s and timeout_s > 0 else None
        self.label = label
        self.grace_s = grace_s
        self.exit_code = exit_code
        self.stream = stream  # where the dump goes (default: sys.stderr at fire time)
        self.on_hang = on_hang  # callable(HangReport), e.g. write a partial result file before a hard exit
        self.stages: list[tuple[str, float]] = []  # (completed stage, seconds since start)
        self.current: Optional[str] = None
        self.report: Optional[HangReport] = None
        self._done = threading.Event()
        self._fired = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0
        self._prev_handler = None

    # -- stage tracking ---------------------------------------------------------------------------------------
    def stage(self, name: str) -> None:
        """Mark the current stage as completed and enter ``name``."""
        if self.current is not None:
            self.stages.append((self.current, time.monotonic() - self._t0))
        self.current = name

    @property
    def last_completed(self) -> Optional[str]:
        return self.stages[-1][0] if self.stages else None

    # -- context manager ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Watchdog":
        self._t0 = time.monotonic()
        if self.timeout_s is not None:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("Watchdog must be entered from the main thread (it interrupts the main thread)")
            if _SIGNAL is not None and hasattr(signal, "pthread_kill"):
                self._prev_handler = signal.signal(_SIGNAL, self._on_signal)
            self._thread = threading.Thread(target=self._run, name=f"watchdog[{self.label}]", daemon=True)
            self._thread.start()
        return self

    def _on_signal(self, signum, frame):
        if self._fired.is_set() and not self._done.is_set():
            raise _Expired()

    def __exit__(self, exc_type, exc, tb):
        self._done.set()
        if self._prev_handler is not None:
            signal.signal(_SIGNAL, self._prev_handler)
            self._prev_handler = None
        if self.current is not None and exc_type is None:
            self.stages.append((self.current, time.monotonic() - self._t0))
            self.current = None
        if self._fired.is_set():
            # The interrupt landed as _Expired (or KeyboardInterrupt where no signal could be sent) in the body,
            # or the body finished between firing and delivery (the handler is gone: nothing pending).
            raise WatchdogTimeout(self.report) from None
        return False

    def _run(self):
        if self._done.wait(self.timeout_s):
            return
        self._fired.set()
        stacks = dump_all_stacks()
        self.report = HangReport(self.label, self.timeout_s, time.monotonic() - self._t0, self.last_completed,
                                 self.current, stacks, [s for s, _ in self.stages])
        out = self.stream or sys.stderr
        try:
            print(f"\n[watchdog] {self.label or 'work'} exceeded {self.timeout_s:g} s; last completed stage: "
                  f"{self.last_completed or 'none'}; current stage: {self.current or 'none'}. All threads:",
                  file=out, flush=True)
            print(stacks, file=out, flush=True)
            try:  # C-level dump too: it works even if the Python stacks above are stale
                faulthandler.dump_traceback(file=out, all_threads=True)
            except Exception:  # noqa: BLE001 - stream without a file descriptor (StringIO): Python dump suffices
                pass
        except Exception:  # noqa: BLE001 - never let reporting stop the interrupt below
            pass
        if self.on_hang is not None:
            try:
                self.on_hang(self.report)
            except Exception:  # noqa: BLE001
                pass
        if self._prev_handler is not None:
            signal.pthread_kill(threading.main_thread().ident, _SIGNAL)
        else:
            _thread.interrupt_main()
        if self._done.wait(self.grace_s):
            return
        print(f"[watchdog] main thread did not return within {self.grace_s:g} s of the interrupt "
              f"(stuck in native code); exiting with code {self.exit_code}", file=out, flush=True)
        os._exit(self.exit_code)
