"""bench/bench_fp8.py on a CPU: the kernel table (registry vs bare calls), the α table, the captured inputs, the
checks and the JSON and markdown it writes -- with the stand-in packages of tests/fake_packages.py and the GPU
pretended, so every code path a device call takes runs here first.

Why: the script runs once on a rented GPU right after a 3-minute SageAttention build; an argument, schema or
bookkeeping bug found there costs the call. The stand-ins compute the emulation of each kernel, so the figures must
come out consistent: the twin reproduces the kernel exactly (emulation ratio 1), every input is left unchanged, the
bare call and the registry call both timed with n samples, the zero-V-channel guard visible, the timings marked as
no speed figures on a CPU.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from vdbench.backends import registry
from vdbench.backends import sage2 as S2

from tests import fake_packages as F

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_fp8", ROOT / "bench" / "bench_fp8.py")
bf = importlib.util.module_from_spec(spec)
sys.modules["bench_fp8"] = bf
spec.loader.exec_module(bf)


@pytest.fixture
def gpu_pretended(tmp_path, monkeypatch):
    """sageattention 2 and FA3 stand-ins installed, and the CUDA checks passing on a CPU (an sm90 device)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn_interface" else real(n, *a))
    F.install_sage2(tmp_path, monkeypatch)
    F.install_fa3(tmp_path, monkeypatch)
    monkeypatch.setattr(registry.Cuda, "__call__", lambda self, device, dtype, head_dim: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(S2, "_PICKED", {})
    yield
    F.forget("sageattention")
    F.forget("fa3_fwd_interface")


def rows(report, key="rows"):
    return {(r["input"], r["backend"]): r for r in report[key]}


def test_dry_run_with_the_stand_ins(tmp_path, gpu_pretended):
    out = tmp_path / "o"
    assert bf.main(["--dry_run", "--out", str(out), "--shapes", "tiny-d128",
                    "--alpha_backends", "sagev2,fav3_fp8,fav3_fp8:smooth_k=1,fp8_emu"]) == 0
    report = json.loads((out / "fp8_bench.json").read_text())
    r = rows(report)
    assert report["sageattention"].startswith("sageattention 2.x (2.x) from ")
    for name in ("sagev2", "sagev2_fp8", "sagev2_fp8:gran=per_warp", "sagev2_fp16", "sagev2_triton"):
        row = r[("tiny-d128", name)]
        assert row["status"] == "ok" and row["inputs_unchanged"] is True and row["nan_inf"] == 0, name
        assert row["rel_l2"] < 0.05 and "lse_max_abs" not in row  # the LSE forms are CUDA-only: not on a CPU
        assert row["emu_vs_kernel_rel_l2"] == 0 and row["emu_ratio"] == pytest.approx(1.0)  # the stand-in IS it
        for key in ("time_registry", "time_bare"):
            t = row[key]
            assert t["n"] == 2 and t["p20"] <= t["median"] <= t["p80"] and t["speed_figure"] is False
            assert "CPU timing" in t["why_not_speed"]
        assert row["registry_over_bare"] > 0
    assert r[("tiny-d128", "sagev2")]["kernel"] == "sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert r[("tiny-d128", "sagev2_fp16:gran=per_warp")]["twin"] == "sagev2_emu:pv=fp16+gran=per_warp"
    fp8 = r[("tiny-d128", "fav3_fp8")]
    assert fp8["status"] == "ok" and fp8["twin"] == "fp8_emu" and fp8["kernel"].endswith("eager-prepass]")
    assert {"time_registry", "time_bare", "time_prepass", "time_torch_prepass_then_kernel"} <= set(fp8)
    assert "time_torch_prepass_then_kernel" not in r[("tiny-d128", "fav3_fp8:smooth_k=1")]
    assert r[("tiny-d128", "sdpa_cudnn")]["status"].startswith(("unavailable", "error"))  # no cuDNN on a CPU
    # the edge checks: the fp8 kernels' zero-V-channel guard, and the pre-pass check says why it did not run
    zero = report["checks"]["zero_v_channel"]
    assert zero["sagev2"] == {"finite": True, "channel_zero": True} == zero["sagev2_fp8:gran=per_warp"]
    assert report["checks"]["fa3_prepass_bit_equal"]["status"].startswith("not run")
    # the α table: every fp8 path on the same inputs, the emulations beside them
    a = rows(report, "alpha")
    labels = ["tiny-d128 alpha=1 k_bias=0", "tiny-d128 alpha=4 k_bias=0", "tiny-d128 alpha=8 k_bias=0",
              "tiny-d128 alpha=8 k_bias=3"]
    assert list(dict.fromkeys(x["input"] for x in report["alpha"])) == labels
    assert a[(labels[3], "fav3_fp8:smooth_k=1")]["rel_l2"] < a[(labels[3], "fav3_fp8")]["rel_l2"]
    assert a[(labels[2], "sagev2")]["rel_l2"] < a[(labels[2], "fp8_emu")]["rel_l2"]
    assert "time_registry" not in a[(labels[0], "sagev2")]  # accuracy only
    md = (out / "fp8_tables.md").read_text()
    assert "| tiny-d128 | sagev2 | sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90 |" in md
    assert "α table (rel L2 vs fp64):" in md and "warning: not speed figures: CPU timing" in md


def test_captured_inputs_are_measured_and_cross_attention_skipped(tmp_path, gpu_pretended):
    caps = tmp_path / "caps"
    caps.mkdir()
    q, k, v = bf.make_inputs((1, 2, 256, 256, 64), "cpu", seed=3)
    torch.save({"q": q, "k": k, "v": v, "meta": {"layout": "BHSD"}}, caps / "attn_fav3_rank0_000000.pt")
    torch.save({"q": q, "k": k[:, :, :77], "v": v[:, :, :77], "meta": {"layout": "BHSD"}},
               caps / "attn_fav3_rank0_000001.pt")
    out = tmp_path / "o"
    assert bf.main(["--dry_run", "--out", str(out), "--shapes", "tiny-d64", "--backends", "sagev2",
                    "--alpha_shape", "none", "--alpha_backends", "sagev2,fav3_fp8,fp8_emu",
                    "--captures", str(caps)]) == 0
    report = json.loads((out / "fp8_bench.json").read_text())
    assert report["alpha"] == []
    got = {(r["input"], r["backend"]): r["status"] for r in report["captured"]}
    assert got == {("captured attn_fav3_rank0_000000.pt", n): "ok" for n in ("sagev2", "fav3_fp8", "fp8_emu")}


def test_nothing_available_exits_4_and_arguments_are_checked(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n in ("flash_attn_interface", "fa3_fwd_interface") else real(n, *a))
    out = tmp_path / "o"
    assert bf.main(["--dry_run", "--out", str(out), "--shapes", "tiny-d64", "--backends", "fav3",
                    "--alpha_shape", "none"]) == bf.EXIT_NOTHING_RAN
    assert json.loads((out / "fp8_bench.json").read_text())["rows"][0]["status"].startswith("unavailable")
    with pytest.raises(SystemExit):
        bf.main(["--dry_run", "--out", str(out), "--shapes", "wan2.1-14b-720p"])  # not a dry-run shape
    with pytest.raises(SystemExit):
        bf.main(["--dry_run", "--out", str(out), "--backends", "sagev2_fp8:gran=per_block"])


def test_deadline_and_samples():
    hs, rs = bf.sample(40, 75600, 8, 1024, "cpu")
    assert hs == [0, 6, 11, 17, 22, 28, 33, 39] and rs.numel() == 1024
    starts = rs.view(-1, 128)[:, 0]
    assert (starts % 128 == 0).all() and starts[-1] == (75600 - 128) // 128 * 128
    assert bf.sample(2, 100, 8, 1024, "cpu")[1].tolist() == list(range(100))
    assert set(bf.BACKENDS) >= {"sagev2", "sagev2_fp8", "sagev2_fp16", "fav3_fp8", "fav3", "sdpa_cudnn"}
