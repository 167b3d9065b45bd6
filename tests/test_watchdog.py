"""The watchdog: a stalled call is caught within its timeout, with stacks and the last completed stage; a call
that swallows the interrupt (stuck in native code, as a MIOpen Find hang is) still ends the process."""

import io
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vdbench.watchdog import Watchdog, WatchdogTimeout, dump_all_stacks

ROOT = Path(__file__).resolve().parents[1]


def _injected_stall():
    time.sleep(30)


def test_stall_is_caught_within_timeout_with_stage_and_stacks():
    buf = io.StringIO()
    t0 = time.monotonic()
    with pytest.raises(WatchdogTimeout) as ei:
        with Watchdog(0.5, label="decode", stream=buf) as wd:
            wd.stage("load")
            wd.stage("decode")
            _injected_stall()
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0, elapsed  # 0.5 s timeout, not the 30 s stall
    r = ei.value.report
    assert r.last_completed_stage == "load" and r.current_stage == "decode"
    assert "_injected_stall" in r.stacks  # the stalled frame is in the dump
    assert "_injected_stall" in buf.getvalue() and "exceeded 0.5 s" in buf.getvalue()
    assert r.as_dict()["status"] == "hung"


def test_no_timeout_completes_and_records_stages():
    with Watchdog(5.0, label="ok") as wd:
        wd.stage("a")
        wd.stage("b")
    assert [s for s, _ in wd.stages] == ["a", "b"] and wd.report is None
    with Watchdog(None) as wd2:  # disabled timer keeps stage tracking
        wd2.stage("x")
    assert wd2.last_completed == "x"


def test_work_continues_after_a_hang():
    results = []
    for stall in (True, False):
        try:
            with Watchdog(0.3, stream=io.StringIO()):
                if stall:
                    time.sleep(20)
                results.append("done")
        except WatchdogTimeout:
            results.append("hung")
    assert results == ["hung", "done"]


def test_interrupt_swallowed_process_exits_nonzero():
    """Main thread ignores the interrupt (like a C call that never returns): the watchdog exits with 124."""
    code = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, %r)
        from vdbench.watchdog import Watchdog
        with Watchdog(0.5, grace_s=1.0, label="hard") as wd:
            wd.stage("stuck")
            end = time.monotonic() + 30
            while time.monotonic() < end:
                try:
                    time.sleep(0.1)
                except BaseException:  # swallows the watchdog's interrupt, as a never-returning C call would
                    pass
        print("NOT REACHED")
    """ % str(ROOT))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert p.returncode == 124, p.stderr
    assert time.monotonic() - t0 < 15
    assert "NOT REACHED" not in p.stdout
    assert "stuck" in p.stderr and "exiting with code 124" in p.stderr


def test_dump_all_stacks_names_threads():
    assert "MainThread" in dump_all_stacks()
