"""bench/bench_sage2.py on CPU: argument handling, the row sampling, and the JSON it writes.

Why: the script is meant to run once on a rented GPU right after a 3-minute build; an argument or schema bug found
there costs a whole device call. So its logic is exercised here at tiny shapes: without sageattention (emulation
only, the kernels listed as unavailable) and with a fake ``sageattention`` package whose functions compute the
tests' independent reference of each kernel -- against which the emulation on the sampled rows must come out with
the full run's error (emu_ratio 1: the sampled rows are emulated with the full run's quantization groups) and within
``twin_bound`` of the kernel's error, with its dispatch recorded by name, a missing function refused by name, and
an input-mutating function caught and its damage undone for the variants after it.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests import fake_packages as F

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_sage2", ROOT / "bench" / "bench_sage2.py")
bs = importlib.util.module_from_spec(spec)
sys.modules["bench_sage2"] = bs  # dataclasses resolve the module's string annotations through sys.modules
spec.loader.exec_module(bs)

# the shared stand-in (each function the reference of its kernel), with two functions wrapped: the fp16 CUDA one
# smooths K in place as sageattention 1.x did (the bench must catch it and undo the damage), the Triton one records
# the inputs it saw (proving the later variants got fresh inputs); sageattn_qk_int8_pv_fp8_cuda is left out of the
# package (a variant the installed version lacks)
FAKE_CORE = F.SAGE2_CORE + '''

_fp16_cuda, _fp16_triton = sageattn_qk_int8_pv_fp16_cuda, sageattn_qk_int8_pv_fp16_triton


def sageattn_qk_int8_pv_fp16_cuda(q, k, v, **kwargs):
    k -= k.mean(dim=2, keepdim=True)  # what sageattention 1.x did: smoothing K in place
    return _fp16_cuda(q, k, v, **kwargs)


SEEN = []  # input checksums of every call of the Triton stand-in: the test checks they are the fresh inputs


def sageattn_qk_int8_pv_fp16_triton(q, k, v, **kwargs):
    SEEN.append(tuple(t.double().sum().item() for t in (q, k, v)))
    return _fp16_triton(q, k, v, **kwargs)
'''


@pytest.fixture
def fake_sage(tmp_path, monkeypatch):
    F.install_sage2(tmp_path, monkeypatch, core=FAKE_CORE, omit=("sageattn_qk_int8_pv_fp8_cuda",))
    yield
    F.forget("sageattention")


def rows_by_name(report, shape):
    entry = next(e for e in report["shapes"] if e["name"] == shape)
    return entry, {r["name"]: r for r in entry["variants"]}


def test_dry_run_without_sageattention_reports_emulation_only(tmp_path, monkeypatch):
    monkeypatch.setattr(bs, "load_sage", lambda: (None, None, "ModuleNotFoundError: No module named 'sageattention'"))
    report = bs.main(["--dry_run", "--out", str(tmp_path), "--variants", "sagev2,fp8_sm90_per_warp,fp16_triton"])
    saved = json.loads((tmp_path / "sage2_bench.json").read_text())
    assert saved["shapes"] == json.loads(json.dumps(report["shapes"]))
    assert saved["sageattention"] == {"available": False, "version": None, "path": None,
                                      "error": "ModuleNotFoundError: No module named 'sageattention'"}
    assert [e["name"] for e in saved["shapes"]] == list(bs.DRY_SHAPES)
    for entry in saved["shapes"]:
        assert entry["dispatch"] is None and entry["bf16_output_rel_l2"] > 0
        assert [r["name"] for r in entry["variants"]] == ["sagev2", "fp8_sm90_per_warp", "fp16_triton"]
        for r in entry["variants"]:
            assert r["status"] == "unavailable: ModuleNotFoundError: No module named 'sageattention'"
            assert r["emu_status"] == "ok" and 0.005 < r["rel_l2_emu"] < 0.05
            assert r["lse_emu"]["max_abs"] < 0.2 and r["emu_s"] > 0
            assert "time" not in r and "rel_l2" not in r
    first = saved["shapes"][0]["variants"]
    assert all(r["edge"]["zero_v_channel"]["emulation_finite"] is (r["emulation"]["pv"] == "fp16") for r in first)
    for r in first:
        for case in bs.EDGE_CASES:
            lim = 0.05 if r["emulation"]["pv"] == "fp8" else 0.02
            assert 0.003 < r["edge"][case]["rel_l2_emu"] < lim and "rel_l2" not in r["edge"][case]
    assert all("edge" not in r for r in saved["shapes"][1]["variants"])


def test_dry_run_with_a_fake_sageattention(tmp_path, fake_sage):
    report = bs.main(["--dry_run", "--out", str(tmp_path), "--shapes", "tiny-d128", "--rows", "256"])
    assert report["sageattention"]["available"] and report["sageattention"]["path"].endswith("__init__.py")
    entry, rows = rows_by_name(report, "tiny-d128")
    assert entry["dispatch_name"] == "sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert entry["dispatch"]["kwargs"]["pv_accum_dtype"] == "fp32+fp32"
    assert rows["sagev2"]["emulation"] == {"pv": "fp8", "arch": "sm90", "pv_accum": "fp32+fp32"}
    for name in ("sagev2", "fp8_sm90_per_thread", "fp8_sm90_per_warp"):
        r = rows[name]
        assert r["status"] == "ok" and r["inputs_unchanged"] is True and r["nan_inf"] == 0
        # the emulation on the sampled rows has the full run's error (the two agree to 0.2% here; emulating the
        # rows with other Q groups than the full run's would not), and is the reference's output within the bound
        assert r["emu_ratio"] == pytest.approx(1.0, abs=0.01) and r["emu_within_10pct"]
        assert r["emu_vs_kernel_rel_l2"] < F.twin_bound("fp8", torch.bfloat16) * r["rel_l2"]
        # both add core.py's bf16 q·mean(K) to the LSE: what is left (1e-3 of 2e-2) is INT8 roundings that differ
        assert r["lse_emu_vs_kernel_max_abs"] < 0.1 * r["lse"]["max_abs"]
        # the FP22 accumulator moves the output by ~1e-4, far below the reference's distance: which accumulator
        # is closer cannot be told here (the GPU run tells it), only that the FP22 model runs and stays as close
        assert r["emu_fp22_status"] == "ok" and r["emu_fp22_ratio"] == pytest.approx(1.0, abs=0.05)
        assert r["emu_vs_kernel_rel_l2_fp22"] < F.twin_bound("fp8", torch.bfloat16) * r["rel_l2"]
        assert r["time"]["n"] == 2 and r["time"]["p20_ms"] <= r["time"]["median_ms"] <= r["time"]["p80_ms"]
        assert r["tflops"] > 0 and r["lse"]["max_abs"] < 0.2
    for name in ("fp16_cuda_per_thread_fp32", "fp16_cuda_per_warp_fp32", "fp16_cuda_per_thread_fp16+fp32"):
        assert rows[name]["status"] == "ok" and rows[name]["inputs_unchanged"] is False
        assert "emu_fp22_status" not in rows[name]  # the FP22 question is the fp8 MMA's only
    for name in ("fp8_sm89_per_thread_fp32+fp16", "fp8_sm89_per_thread_fp32"):
        assert rows[name]["status"] == "refused: the installed sageattention has no sageattn_qk_int8_pv_fp8_cuda"
        assert rows[name]["emu_status"] == "ok"  # the emulation still reports what the kernel would do
    # the mutating fp16 variants ran before fp16_triton: every call it got saw the fresh inputs again
    assert rows["fp16_triton"]["status"] == "ok" and rows["fp16_triton"]["inputs_unchanged"] is True
    triton = rows["fp16_triton"]
    assert triton["emu_vs_kernel_rel_l2"] < F.twin_bound("fp16", torch.bfloat16) * triton["rel_l2"]
    fresh = tuple(t.double().sum().item()
                  for t in bs.make_inputs(2, 300, 128, device="cpu", dtype=torch.bfloat16, k_bias=2.0, seed=0))
    seen = sys.modules["sageattention.core"].SEEN
    assert len(seen) == 2 + 1 + 2 + 3  # two checked calls, 1 warm-up + 2 timed, then the three edge checks
    assert all(s == fresh for s in seen[:5]) and all(s != fresh for s in seen[5:])
    edge = rows["fp8_sm90_per_thread"]["edge"]
    assert edge["zero_v_channel"] == {"emulation_finite": False, "kernel_finite": False}
    for case in bs.EDGE_CASES:  # causal with an odd length, a padded head dim: the same error, the same output
        assert edge[case]["rel_l2_emu"] == pytest.approx(edge[case]["rel_l2"], rel=0.02)
        assert edge[case]["emu_vs_kernel_rel_l2"] < F.twin_bound("fp8", torch.bfloat16) * edge[case]["rel_l2"]


def test_sampled_rows_are_128_aligned_blocks():
    rows = bs.sample_rows(32760, 1024)
    assert rows.numel() == 1024 and rows[0] == 0 and rows.max() < 32760
    starts = rows.view(-1, 128)[:, 0]
    assert (starts % 128 == 0).all() and torch.equal(rows.view(-1, 128) - starts[:, None], torch.arange(128).expand(8, 128))
    assert starts[-1] == (32760 - 128) // 128 * 128  # the last block reaches the end of the sequence
    assert torch.equal(bs.sample_rows(100, 1024), torch.arange(100))
    assert bs.sample_heads(40, 8) == [0, 6, 11, 17, 22, 28, 33, 39]
    assert bs.sample_heads(2, 8) == [0, 1]


def test_time_calls_and_argument_errors(tmp_path):
    calls = []
    t = bs.time_calls(lambda: calls.append(1), "cpu", warmup=2, reps=5)
    assert len(calls) == 7 and t["n"] == 5 and t["p20_ms"] <= t["median_ms"] <= t["p80_ms"]
    with pytest.raises(SystemExit):
        bs.main(["--dry_run", "--out", str(tmp_path), "--shapes", "wan2.1-14b-720p"])  # not a dry-run shape
    with pytest.raises(SystemExit):
        bs.main(["--dry_run", "--out", str(tmp_path), "--variants", "sagev3"])


def test_real_shapes_and_flops():
    assert bs.SHAPES == {"wan2.1-1.3b-480p": (12, 32760, 128), "wan2.1-14b-720p": (40, 75600, 128),
                         "cogvideox-2b": (30, 17776, 64)}
    emulated = {json.dumps(v.emu, sort_keys=True) for v in bs.VARIANTS if v.emu}
    assert len(emulated) == len(bs.VARIANTS) - 1  # every explicit variant has its own emulation


def test_deadline_skips_what_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(bs, "load_sage", lambda: (None, None, "no"))
    report = bs.main(["--dry_run", "--out", str(tmp_path), "--shapes", "tiny-d64", "--deadline_s", "1e-9"])
    assert {r["status"] for r in report["shapes"][0]["variants"]} == {"skipped(deadline)"}


def test_sageattention_1x_is_refused_for_every_variant(tmp_path, fake_sage, monkeypatch):
    real_load = bs.load_sage
    monkeypatch.setattr(bs, "load_sage", lambda: (real_load()[0], "1.0.6", None))
    report = bs.main(["--dry_run", "--out", str(tmp_path), "--shapes", "tiny-d64", "--variants", "sagev2,fp16_triton"])
    assert report["sageattention"]["available"] is False
    for r in report["shapes"][0]["variants"]:
        assert r["status"] == "unavailable: sageattention 1.0.6 is 1.x; the sagev2 variants need >= 2.0"
        assert r["emu_status"] == "ok"
