"""bench/lab/check_prepass.py on CPU (Triton's interpreter): the row it writes and its bit-equality verdict.

Why: the check runs on a rented GPU; a bug in it found there costs a call.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.minutes
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_check_writes_each_form_and_finds_them_equal(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "lab" / "check_prepass.py"), "--out", str(tmp_path),
                          "--shapes", "tiny", "--reps", "2", "--burst", "2", "--device", "cpu"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "prepass.json").read_text())["rows"]
    assert [r["layout"] for r in rows] == ["bshd", "bhsd"]
    for row in rows:
        assert row["shape"] == "tiny" and row["same_bits_as_eager"] is True
        assert row["timer"].startswith("host clock")
        for form in ("one_launch_qkv", "per_tensor", "eager"):
            assert row[form]["n"] == 2 and row[form]["call_ms"] > 0 and row[form]["burst"] == 2
            assert row[form]["host_us"] > 0
        # FA3 needs a Hopper GPU: the whole-call rows say why they were not timed, never a figure
        assert row["fav3_fp8"].startswith("not timed: ") and "fav3_fp8_over_kernel" not in row
