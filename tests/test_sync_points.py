"""bench/lab/sync_points.py: each synchronizing call counted under the call site that made it; a CPU run refused."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("sync_points", ROOT / "bench" / "lab" / "sync_points.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_sync_is_counted_under_its_call_site():
    tool = _tool()
    rec = tool.Recorder(frames=4)
    with warnings.catch_warnings():
        rec.install()

        def step():  # what torch's sync debug mode raises at a synchronizing call, from this frame
            warnings.warn("called a synchronizing CUDA operation", UserWarning)

        for _ in range(3):
            step()
        warnings.warn("an unrelated warning", UserWarning)  # passed on, not counted
        def elsewhere():  # the same site reached from another caller: counted apart
            step()

        elsewhere()
    report = rec.report()
    assert report["total"] == 4
    first, second = report["sites"]
    assert first["count"] == 3 and second["count"] == 1
    assert first["site"] == second["site"] and " step" in first["site"] and "test_sync_points.py" in first["site"]
    assert first["stack"][-1].endswith(" step") and len(first["stack"]) <= 4
    assert second["stack"][-2].endswith(" elsewhere")


def test_site_is_the_innermost_project_frame():
    tool = _tool()
    import traceback

    frames = [traceback.FrameSummary("/x/site-packages/diffusers/pipelines/wan/pipeline_wan.py", 600, "__call__"),
              traceback.FrameSummary("/work/main/vdbench/parallel.py", 660, "_pair"),
              traceback.FrameSummary("/x/site-packages/torch/_tensor.py", 10, "item")]
    assert tool.site_of(frames).endswith("vdbench/parallel.py:660 _pair")


def test_without_cuda_it_says_why_and_runs_nothing(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _tool().main(["-o", str(tmp_path), "--", "run_wan.py", "--help"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_script_is_required():
    with pytest.raises(SystemExit):
        _tool().parse(["-o", "x"])
