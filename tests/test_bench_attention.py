"""bench/bench_attention.py on CPU: accuracy figures, the poison check, loading rules, CSV schema."""

import csv
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch

from vdbench import backends as B

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "bench" / "bench_attention.py")
ba = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ba)


def test_accuracy_figures_against_hand_computed_values():
    ref = torch.tensor([3.0, 4.0])
    out = torch.tensor([3.0, 4.5])
    acc = ba.accuracy(out, ref)
    assert acc["rel_l2"] == pytest.approx(0.5 / 5.0)
    assert acc["max_abs"] == pytest.approx(0.5)
    assert acc["cosine"] == pytest.approx((9 + 18) / (5 * (9 + 20.25) ** 0.5))
    assert acc["frac_beyond_tol"] == pytest.approx(0.5)  # |0.5| > 0.01 + 0.01*4
    assert acc["nan_inf"] == 0
    acc = ba.accuracy(torch.tensor([float("nan"), 4.0]), ref)
    assert acc["nan_inf"] == 1 and acc["frac_beyond_tol"] == pytest.approx(0.5)


def lazy_kernel(q, k, v, *, scale=None, is_causal=False):
    """Writes only the first half of the queries: what an uninitialised-output bug looks like."""
    out = torch.empty_like(q)
    half = q.shape[2] // 2
    out[:, :, :half] = torch.nn.functional.scaled_dot_product_attention(q[:, :, :half], k, v)
    return out


def test_poison_catches_a_lazy_kernel(tmp_path, capsys):
    lazy = B.Backend("lazy", "writes half its output", fn=lazy_kernel, kernel="lazy", no_lse_reason="a test kernel")
    with B.registered(lazy):
        rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "64", "--device", "cpu", "--kernel", "sdpa,lazy",
                      "-metric", "accuracy", "-o", str(tmp_path / "r.csv")])
    assert rc == 1
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    lazy_rows = [r for r in rows if r["kernel"] == "lazy"]
    assert lazy_rows and all(r["status"].startswith("FAIL") for r in lazy_rows)
    assert int(lazy_rows[0]["unwritten"]) == 1 * 30 * 32 * 64  # B*H*(S/2)*D elements never written
    assert all(r["status"] == "ok" for r in rows if r["kernel"] == "sdpa")


def test_preset_run_csv_schema_and_plot(tmp_path):
    rc = ba.main(["--preset", "wan2.1-1.3b-480p", "--max_seq", "96", "--device", "cpu", "--dtype", "fp32",
                  "--kernel", "sdpa,reference,sagev1_emu,fp8_emu,sagev1", "-o", str(tmp_path / "a.csv")])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "a.csv")))
    assert list(rows[0]) == ba.COLUMNS
    assert {r["input"] for r in rows} == {"wan2.1-1.3b-480p", "random"}
    by = {(r["input"], r["kernel"]): r for r in rows}
    r = by[("wan2.1-1.3b-480p", "fp8_emu")]
    assert float(r["rel_l2"]) > float(by[("wan2.1-1.3b-480p", "sagev1_emu")]["rel_l2"]) > float(
        by[("wan2.1-1.3b-480p", "sdpa")]["rel_l2"])
    assert float(r["time_ms"]) > 0 and r["quant_in_time"] == "True" and float(r["quant_ms"]) > 0
    flops = 4 * 1 * 12 * 96 * 96 * 128
    assert float(r["tflops"]) == pytest.approx(flops / float(r["time_ms"]) / 1e9, rel=1e-6)
    assert by[("random", "sagev1")]["status"].startswith("unavailable")
    assert (tmp_path / "a.json").exists() and (tmp_path / "a.png").exists()


def test_bytes_count_one_byte_for_quantized_inputs():
    bf16, pre = B.resolve("sdpa").bytes_moved(1, 1, 10, 10, 8, 2)
    assert bf16 == 4 * 80 * 2 and pre == 0
    fp8, pre = B.resolve("fav3_fp8").bytes_moved(1, 1, 10, 10, 8, 2)
    assert fp8 == 3 * 80 * 1 + 80 * 2 and pre == 3 * 80 * 3
    # the Triton kernels' pre-pass reads K (and fav3_sage's V) twice: a mean / amax, then the quantization
    sage, pre = B.resolve("fav3_sage").bytes_moved(1, 1, 10, 10, 8, 2)
    assert sage == fp8 and pre == 80 * 3 + 2 * 80 * 5


def test_kernels_resolve_by_alias_and_unknown_ones_suggest(tmp_path):
    rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "32", "--device", "cpu", "--kernel", "native",
                  "-metric", "accuracy", "-o", str(tmp_path / "n.csv")])
    assert rc == 0
    assert {r["kernel"] for r in csv.DictReader(open(tmp_path / "n.csv"))} == {"sdpa"}
    with pytest.raises(SystemExit, match="did you mean 'sagev1'"):
        ba.main(["--preset", "cogvideox-2b", "--device", "cpu", "--kernel", "sagev2"])


def test_captures_hostile_and_truncated_are_skipped_with_exit_code(tmp_path, capsys):
    t = torch.randn(1, 2, 16, 8)
    for i in range(3):
        torch.save({"q": t, "k": t, "v": t, "meta": {"layout": "BHSD"}}, tmp_path / f"attn_s_rank0_{i:06d}.pt")
    (tmp_path / "attn_s_rank0_000003.pt").write_bytes((tmp_path / "attn_s_rank0_000000.pt").read_bytes()[:100])
    with open(tmp_path / "attn_s_rank0_000004.pt", "wb") as f:
        pickle.dump({"q": Path("/etc/passwd")}, f)
    rc = ba.main(["--input_dir", str(tmp_path), "--device", "cpu", "--kernel", "sdpa", "--dtype", "fp32",
                  "--max_inputs", "5"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "attn_s_rank0_000003.pt: unreadable" in err and "attn_s_rank0_000004.pt: refused" in err
    assert "2 input file(s) skipped" in err


def test_no_captures_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no capture files"):
        ba.main(["--input_dir", str(tmp_path), "--device", "cpu"])


def test_old_name_bench_cogvideo_still_works(tmp_path, checkout_env):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cogvideo.py"), "--preset", "cogvideox-2b",
                           "--max_seq", "32", "--device", "cpu", "--kernel", "sdpa", "-metric", "accuracy",
                           "-o", str(tmp_path / "c.csv")], capture_output=True, text=True, timeout=300,
                          env=checkout_env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c.csv").exists() and "cogvideox-2b" in proc.stdout
