"""bench/bench_fp8.py on a CPU: the kernel table (registry vs bare calls), the α table, the captured inputs, the
checks and the JSON and markdown it writes -- with the stand-in packages of tests/fake_packages.py and the GPU
pretended, so every code path a device call takes runs here first.

Why: the script runs once on a rented GPU right after a 3-minute SageAttention build; an argument, schema or
bookkeeping bug found there costs the call. The stand-ins compute an independent reference of each kernel, so the
figures must come out consistent: the twin reproduces the kernel's error (emulation ratio 1) and stays within
``twin_bound`` of its output, every input is left unchanged, the bare call and the registry call both timed with n
samples, the zero-V-channel guard visible, the timings marked as no speed figures on a CPU.
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
        # the stand-in is the tests' reference of the kernel: the twin has its error (0.2% apart here) and stays
        # within twin_bound of its output (bf16 inputs)
        pv = "fp16" if name.startswith(("sagev2_fp16", "sagev2_triton")) else "fp8"
        assert row["emu_ratio"] == pytest.approx(1.0, abs=0.01)
        assert row["emu_vs_kernel_rel_l2"] < F.twin_bound(pv, torch.bfloat16) * row["rel_l2"]
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


class FakeClock:
    """``time.perf_counter`` for bench_fp8: still until a measured row advances it by ``per_row`` seconds."""

    def __init__(self, per_row: float):
        self.now, self.per_row = 0.0, per_row

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    """Install a fake clock (returned) and a measure() that costs ``per_row`` seconds of it and computes nothing."""
    def install(per_row: float) -> FakeClock:
        clock = FakeClock(per_row)
        monkeypatch.setattr(bf, "time", clock)

        def measure(be, *a, **kw):
            clock.now += clock.per_row
            return {"measured_at": clock.now}

        monkeypatch.setattr(bf, "measure", measure)
        return clock

    return install


def _run_rows(names, deadline_s, t_start=0.0):
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    rows, saves = [], []
    args = type("Args", (), {"deadline_s": deadline_s})()
    ran = bf.run_rows(names, q, q, q, None, args, torch.device("cpu"), 0.0, rows, lambda: saves.append(len(rows)),
                      label="x", t_start=t_start)
    return ran, rows, saves


CPU_NAMES = ["sdpa", "reference", "sdpa_math", "fp8_emu", "sagev1_emu"]  # available on a CPU


def test_a_row_that_would_start_after_the_deadline_is_skipped_and_recorded(fake_clock):
    """The deadline is checked before each row: a row starting in time runs to its end (even past the deadline), every
    later one is recorded as skipped(deadline) without being measured, so the report still lists every row."""
    fake_clock(4.0)  # each measured row takes 4 s
    ran, rows, saves = _run_rows(CPU_NAMES, deadline_s=10.0)  # rows start at 0, 4, 8 (ends at 12), then 12 > 10
    assert [r["backend"] for r in rows] == CPU_NAMES  # every row in the report, in order
    assert [r["status"] for r in rows] == ["ok"] * 3 + ["skipped(deadline)"] * 2 and ran == 3
    assert [r.get("measured_at") for r in rows] == [4.0, 8.0, 12.0, None, None]
    assert all(r["wall_s"] == 4.0 for r in rows[:3]) and all("wall_s" not in r for r in rows[3:])
    assert saves == [1, 2, 3]  # the JSON written after each measured row


def test_no_deadline_and_a_late_start(fake_clock):
    fake_clock(1000.0)
    ran, rows, _ = _run_rows(CPU_NAMES, deadline_s=0.0)  # 0: no deadline however long the rows take
    assert ran == len(CPU_NAMES) and {r["status"] for r in rows} == {"ok"}
    ran, rows, _ = _run_rows(CPU_NAMES, deadline_s=10.0, t_start=-20.0)  # the bench started 20 s before these rows
    assert ran == 0 and {r["status"] for r in rows} == {"skipped(deadline)"}


def test_the_deadline_cuts_the_alpha_table_first(tmp_path, fake_clock):
    """main(): the kernel rows come before the α table, so a deadline that the kernel rows use up skips the α table
    (recorded, every row), the kernel rows are kept, and the report and tables are written (exit 0: something ran)."""
    fake_clock(5.0)
    out = tmp_path / "o"
    assert bf.main(["--dry_run", "--out", str(out), "--shapes", "tiny-d64", "--backends", "reference,fp8_emu",
                    "--alpha_backends", "fp8_emu,sagev1_emu", "--deadline_s", "7"]) == 0
    report = json.loads((out / "fp8_bench.json").read_text())
    assert [(r["backend"], r["status"]) for r in report["rows"]] == [("reference", "ok"), ("fp8_emu", "ok")]
    assert len(report["alpha"]) == len(bf.ALPHAS) * 2 and {r["status"] for r in report["alpha"]} == {
        "skipped(deadline)"}
    assert report["wall_s"] == 10.0 and (out / "fp8_tables.md").exists()


def test_a_deadline_nothing_fits_in_exits_4_with_every_row_recorded(tmp_path):
    out = tmp_path / "o"
    assert bf.main(["--dry_run", "--out", str(out), "--shapes", "tiny-d64", "--backends", "reference,fp8_emu",
                    "--alpha_shape", "none", "--deadline_s", "1e-9"]) == bf.EXIT_NOTHING_RAN
    report = json.loads((out / "fp8_bench.json").read_text())
    assert [(r["backend"], r["status"]) for r in report["rows"]] == [("reference", "skipped(deadline)"),
                                                                     ("fp8_emu", "skipped(deadline)")]


@pytest.mark.parametrize("h, s, heads, rows", [(40, 75600, 8, 1024), (2, 100, 8, 1024), (12, 32760, 8, 1024),
                                               (5, 1000, 0, 10), (3, 129, 8, 1024), (1, 300, 1, 64)])
def test_samples_are_whole_blocks_spread_over_the_input_with_their_minimums(h, s, heads, rows):
    """Heads: min(h, heads) of them but at least one, distinct, from the first head to the last. Rows: whole 128-row
    blocks at multiples of 128 (every SageAttention 2 Q scale group whole), min(s // 128, rows // 128) of them but at
    least one, from the first block to the last whole one; every row when the input has at most 128."""
    hs, rs = bf.sample(h, s, heads, rows, "cpu")
    assert hs == sorted(set(hs)) and len(hs) == max(1, min(h, heads)) and hs[0] == 0
    assert hs[-1] == (h - 1 if len(hs) > 1 else 0) and all(0 <= x < h for x in hs)
    if s <= 128:
        assert rs.tolist() == list(range(s))
        return
    blocks = rs.view(-1, 128)
    starts = blocks[:, 0]
    assert torch.equal(blocks - starts[:, None], torch.arange(128).expand_as(blocks))  # whole blocks
    assert (starts % 128 == 0).all() and (starts.diff() > 0).all() and int(rs.max()) < s
    assert len(starts) == max(1, min(s // 128, rows // 128))
    assert starts[0] == 0 and (len(starts) == 1 or starts[-1] == (s - 128) // 128 * 128)


def test_the_bench_covers_the_issue_backends():
    assert set(bf.BACKENDS) >= {"sagev2", "sagev2_fp8", "sagev2_fp16", "fav3_fp8", "fav3", "sdpa_cudnn"}
