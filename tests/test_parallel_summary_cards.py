"""bench/parallel_summary.py against one-GPU renders on each card: an N-GPU step runs at its slowest card's pace."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _entry(steps_s, uuids, parallel=None):
    att = {"calls_by_kernel": {"fa3": 4}}
    e = {"attention_type": "fav3", "step_times": steps_s, "attention": att,
         "run": {"resolved": {"device": "cuda:0"}, "system": {"gpu_uuid": uuids[0] if not parallel else None}}}
    if parallel:
        e["parallel"] = parallel
        e["ranks"] = [{"rank": i, "gpu_uuid": u, "step_times": steps_s, "attention": att} for i, u in enumerate(uuids)]
    return e


def _write(d: Path, e):
    (d / "results").mkdir(parents=True)
    (d / "results" / "timing.json").write_text(json.dumps([e]))


def test_speedup_against_the_slowest_of_its_own_cards(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import parallel_summary as S

    g = tmp_path / "res" / "w13"
    _write(g / "1gpu", _entry([1.5, 1.0, 1.0, 1.0], ["GPU-a"]))            # card a alone
    for card, t in (("a", 1.01), ("b", 1.03), ("c", 1.02), ("d", 1.00)):  # each card, side by side
        _write(g / f"1gpu_g{card}", _entry([1.5, t, t, t], [f"GPU-{card}"]))
    par = {"world_size": 2, "label": "ulysses2", "engine": "diffusers"}
    _write(g / "u2_ab", _entry([0.8, 0.54, 0.54, 0.54], ["GPU-a", "GPU-b"], par))
    _write(g / "u2_cx", _entry([0.8, 0.54, 0.54, 0.54], ["GPU-c", "GPU-x"], par))  # card x has no one-GPU render
    rows = {r["config_dir"]: r for r in S.summarize(tmp_path / "res")}
    ab = rows["u2_ab"]
    assert ab["speedup"] == pytest.approx(1.0 / 0.54)               # against 1gpu: card a alone
    assert ab["gpu_uuids"] == ["GPU-a", "GPU-b"] and ab["by_gpu_warm_ms"] == pytest.approx([1010.0, 1030.0])
    assert ab["speedup_vs_slowest_gpu"] == pytest.approx(1.03 / 0.54)
    assert ab["speedup_vs_mean_gpu"] == pytest.approx(1.02 / 0.54)
    assert "speedup_vs_slowest_gpu" not in rows["u2_cx"]            # not every card measured: no such figure
    assert "speedup_vs_slowest_gpu" not in rows["1gpu_gb"] and rows["1gpu_gb"]["gpu_uuids"] == ["GPU-b"]
    text = S.table(list(rows.values()))
    assert "1.907x vs its slowest card, 1.889x vs their mean" in text and "slowest/fastest 1.0300" in text



def test_the_1gpu_render_stands_for_its_card_without_a_1gpu_folder_of_its_own(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import parallel_summary as S

    g = tmp_path / "res" / "w13"
    _write(g / "1gpu", _entry([1.5, 1.04, 1.04, 1.04], ["GPU-a"]))  # card a: no 1gpu_* render
    _write(g / "1gpu_gb", _entry([1.5, 1.0, 1.0, 1.0], ["GPU-b"]))
    _write(g / "u2_ab", _entry([0.8, 0.52, 0.52, 0.52], ["GPU-a", "GPU-b"],
                               {"world_size": 2, "label": "ulysses2", "engine": "diffusers"}))
    rows = {r["config_dir"]: r for r in S.summarize(tmp_path / "res")}
    assert rows["u2_ab"]["by_gpu_warm_ms"] == pytest.approx([1040.0, 1000.0])
    assert rows["u2_ab"]["speedup_vs_slowest_gpu"] == pytest.approx(1.04 / 0.52)

def test_the_energy_of_a_layouts_step_against_one_gpus(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import parallel_summary as S
    from vdbench.power import all_ranks

    def card(joules, watts):
        return {"source": "nvml", "energy_j": joules, "warm_energy_j": joules[1], "warm_power_w": watts,
                "warm_sm_clock_mhz": 1800, "warm_capped_share": 1.0}

    g = tmp_path / "res" / "w13"
    one = _entry([1.5, 1.0, 1.0], ["GPU-a"])
    one["power"] = card([900.0, 690.0, 690.0], 690.0)
    _write(g / "1gpu", one)
    u2 = _entry([0.8, 0.54, 0.54], ["GPU-a", "GPU-b"], {"world_size": 2, "label": "ulysses2", "engine": "diffusers"})
    for r, j in zip(u2["ranks"], (372.0, 368.0)):
        r["power"] = card([500.0, j, j], 685.0)
    u2["power_all_ranks"] = all_ranks([r["power"] for r in u2["ranks"]])
    _write(g / "u2", u2)
    rows = {r["config_dir"]: r for r in S.summarize(tmp_path / "res")}
    assert rows["1gpu"]["warm_energy_j"] == 690.0 and rows["u2"]["warm_energy_j"] == 740.0
    assert rows["u2"]["energy_vs_1gpu"] == pytest.approx(740.0 / 690.0)
    assert rows["u2"]["warm_power_w_per_card"] == [pytest.approx(372.0 / 0.54, abs=0.1),
                                                   pytest.approx(368.0 / 0.54, abs=0.1)]  # joules / seconds
    assert "w13/fav3/ulysses2 (diffusers) (u2): 740.0 J = 1.072x one GPU's (688.9 W, 1800 MHz, capped 1.0;" in (
        S.table(list(rows.values())))


def test_gpu_uuid_is_none_off_cuda():
    from vdbench.timing import gpu_uuid, system_info

    assert gpu_uuid("cpu") is None and system_info(torch.device("cpu")).get("gpu_uuid") is None


def test_gpu_monitor_summarizes_each_cards_busy_samples():
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_monitor as G

    names = G.FIELDS + ["reasons"]
    lines = ["2026/11/27 10:00:00.000, 0, GPU-a, 100, 1980, 3201, 650.1, 700.00, 60, 0x0000000000000000",
             "2026/11/27 10:00:01.000, 0, GPU-a, 99, 1830, 3201, 699.5, 700.00, 63, 0x0000000000000004",
             "2026/11/27 10:00:00.000, 1, GPU-b, 0, 345, 3201, 80.0, 700.00, 35, 0x0000000000000001",
             "bad line"]
    rows = G.parse(lines, names)
    assert len(rows) == 3 and rows[0]["clocks.sm"] == 1980.0 and rows[0]["index"] == 0
    s = G.summarize(rows, busy_pct=90)
    assert s["GPU-a"]["busy_samples"] == 2 and s["GPU-a"]["sm_clock_mhz_median"] == 1905.0
    assert s["GPU-a"]["sm_clock_mhz_min"] == 1830.0 and s["GPU-a"]["busy_clock_event_reasons"] == ["0x0000000000000004"]
    assert s["GPU-b"]["busy_samples"] == 0 and s["GPU-b"]["sm_clock_mhz_median"] is None  # idle: no busy figure


def test_gpu_monitor_without_nvidia_smi_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_monitor as G

    monkeypatch.setattr(G.shutil, "which", lambda name: None)
    assert G.main(["-o", str(tmp_path / "s.csv")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "nvidia-smi is not on PATH" in err and not (tmp_path / "s.csv").exists()


def test_gpu_monitor_samples_around_a_command_and_returns_its_status(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import subprocess

    import gpu_monitor as G

    line = "2026/11/27 10:00:00.000, 0, GPU-a, 100, 1700, 3201, 690.0, 700.00, 60, 0x0000000000000004"
    monkeypatch.setattr(G.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(G, "_query", lambda fields: subprocess.CompletedProcess([], 0, stdout=line + "\n"))
    out = tmp_path / "s.csv"
    rc = G.main(["-o", str(out), "--interval_s", "0.05", "--", sys.executable, "-c",
                 "import time, sys; time.sleep(0.3); sys.exit(3)"])
    assert rc == 3  # the command's own status
    s = json.loads(out.with_suffix(".json").read_text())
    assert s["cards"]["GPU-a"]["busy_samples"] >= 1 and s["cards"]["GPU-a"]["sm_clock_mhz_median"] == 1700.0
    assert out.read_text().splitlines()[0].startswith("timestamp,index,uuid")
