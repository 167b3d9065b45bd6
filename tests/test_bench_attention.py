"""The attention kernel bench (vdbench.kernel_bench; bench/bench_attention.py its command line) on CPU: accuracy
figures, the poison check, loading rules, CSV schema."""

import csv
import json
import pickle
from pathlib import Path

import pytest
import torch

from vdbench import backends as B

from vdbench import kernel_bench as ba

ROOT = Path(__file__).resolve().parents[1]


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
    from vdbench.measure.record import read

    recs = read(tmp_path / "records.jsonl")  # the same rows in the record schema, with the command that made them
    assert [r.case for r in recs] == [f"{r['input']}/{r['kernel']}" for r in rows]
    assert all(r.suite == "attention" and r.command and r.config["shape"]["Sq"] == 96 for r in recs)
    by = {(r["input"], r["kernel"]): r for r in rows}
    r = by[("wan2.1-1.3b-480p", "fp8_emu")]
    assert float(r["rel_l2"]) > float(by[("wan2.1-1.3b-480p", "sagev1_emu")]["rel_l2"]) > float(
        by[("wan2.1-1.3b-480p", "sdpa")]["rel_l2"])
    # emulations: accuracy only, never a time, a TFLOP/s or a GB/s
    assert r["time_ms"] == r["tflops"] == r["gbps"] == r["quant_ms"] == ""
    assert r["speed_figure"] == "False" and "emulated backend" in r["why_not_speed"]
    assert "never timed" in r["status"]
    s = by[("wan2.1-1.3b-480p", "sdpa")]
    flops = 4 * 1 * 12 * 96 * 96 * 128
    assert float(s["tflops"]) == pytest.approx(flops / float(s["time_ms"]) / 1e9, rel=1e-6)
    # the median with its spread and n; a CPU timing is not a speed figure
    assert float(s["time_p20_ms"]) <= float(s["time_ms"]) <= float(s["time_p80_ms"])
    assert float(s["time_min_ms"]) <= float(s["time_p20_ms"]) and float(s["time_p80_ms"]) <= float(s["time_max_ms"])
    assert s["time_n"] == "5" and s["timer"] == "host clock" and s["time_n_why"] == ""
    assert s["speed_figure"] == "False" and "CPU timing" in s["why_not_speed"]
    # the first call on its own, beside the warm median; one process, caches as found: not a cold figure
    assert float(s["first_call_ms"]) > 0
    assert float(s["first_call_excess_ms"]) == pytest.approx(float(s["first_call_ms"]) - float(s["time_ms"]))
    assert s["cold"] == "False" and s["caches"] in ("default (not cleared)", "empty", "not empty")
    assert by[("random", "sdpa")]["caches"] == ba.WARM_FROM_EARLIER  # sdpa already ran on the preset input
    assert r["first_call_ms"] == r["cold"] == ""  # an emulation: never timed
    assert by[("random", "sagev1")]["status"].startswith("unavailable")
    assert (tmp_path / "a.json").exists() and (tmp_path / "a.png").exists()


def test_an_output_name_with_dots_keeps_its_name(tmp_path):
    """``-o attn_wan2.1-1.3b-480p.csv``: the JSON and the plot beside it keep the whole name (a dot inside it is not
    a suffix); a name without an ending gets one."""
    assert ba.output_path(tmp_path / "k_wan2.1-1.3b-480p.csv", ".json") == tmp_path / "k_wan2.1-1.3b-480p.json"
    assert ba.output_path(tmp_path / "k_wan2.1-1.3b-480p", ".csv") == tmp_path / "k_wan2.1-1.3b-480p.csv"
    rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "64", "--device", "cpu", "--dtype", "fp32",
                  "--kernel", "sdpa", "--baseline", "sdpa", "-o", str(tmp_path / "k_wan2.1-1.3b.csv")])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.glob("k_*")) == ["k_wan2.1-1.3b.csv", "k_wan2.1-1.3b.json",
                                                            "k_wan2.1-1.3b.png"]


def test_printed_figures_keep_significant_digits_and_warn_on_cpu(tmp_path, capsys):
    assert ba.sig(0.0086) == "0.0086" and ba.sig(0.033) == "0.033" and ba.sig(356.24) == "356"
    assert ba.sig(8.5642, 4) == "8.564" and ba.sig(1234.5) == "1234" and ba.sig(0.0) == "0"
    rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "16", "--device", "cpu", "--dtype", "fp32",
                  "--kernel", "sdpa"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert {"time_ms", "p20–p80", "time_n", "first_call_ms", "quant_ms", "tflops", "gbps"} <= set(header)
    for line in lines[1:3]:
        cells = dict(zip(header, line.split()))
        assert float(cells["tflops"]) > 0 and float(cells["gbps"]) > 0, line  # tiny rates, never 0.0
        assert cells["time_n"] == "5"
    assert "warning: these times are not speed figures: CPU timing (host clock, shared machine)" in lines


def test_prepass_time_beside_a_quantized_backends_figure(tmp_path, capsys):
    """A non-emulated quantized kernel (here the fp8 numerics registered as if they were a kernel) gets its
    pre-pass timed alone beside its own time, with its share."""
    emu = B.resolve("fp8_emu")
    quant = B.Backend("quant_k", "a quantized test kernel", fn=emu.fn, kernel="quant_k", bench=emu.bench,
                      no_lse_reason="a test kernel")
    with B.registered(quant):
        rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "32", "--device", "cpu", "--dtype", "fp32",
                      "--kernel", "quant_k", "-o", str(tmp_path / "q.csv")])
    assert rc == 0
    row = next(csv.DictReader(open(tmp_path / "q.csv")))
    assert float(row["quant_ms"]) > 0 and float(row["quant_p20_ms"]) <= float(row["quant_p80_ms"])
    assert float(row["quant_share"]) == pytest.approx(float(row["quant_ms"]) / float(row["time_ms"]))
    assert row["quant_in_time"] == "True"
    out = capsys.readouterr().out.splitlines()
    cells = dict(zip(out[0].split(), out[1].split()))
    assert float(cells["quant_ms"]) > 0 and cells["quant_share"].endswith("%")


def test_the_bench_reads_bytes_from_the_entrys_bench_profile(tmp_path):
    """The bytes, bandwidth and quant_in_time columns come from the entry's bench profile; no pre-pass there, no
    pre-pass timed."""
    toy = B.Backend("toy_bytes", "a test kernel with its own bytes model", fn=B.resolve("sdpa").fn,
                    kernel="toy_bytes", no_lse_reason="a test kernel",
                    bench=B.BenchProfile(bytes_model=lambda b, h, sq, sk, d, itemsize: B.BytesMoved(1000, 24)))
    with B.registered(toy):
        rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "32", "--device", "cpu", "--dtype", "fp32",
                      "--kernel", "toy_bytes", "-o", str(tmp_path / "b.csv")])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert rows and all(float(r["bytes"]) == 1024 and r["quant_in_time"] == "True" and not r["quant_ms"]
                        for r in rows)


def test_fp32_captures_cast_to_bf16_say_so(tmp_path, capsys):
    t = torch.randn(1, 2, 16, 8)
    torch.save({"q": t, "k": t, "v": t, "meta": {"layout": "BHSD"}}, tmp_path / "attn_s_rank0_000000.pt")
    rc = ba.main(["--input_dir", str(tmp_path), "--device", "cpu", "--kernel", "sdpa", "-metric", "accuracy",
                  "-o", str(tmp_path / "c.csv")])
    assert rc == 0
    assert "note: captures hold float32 inputs; cast to bfloat16 for the kernels (--dtype bf16)" in \
        capsys.readouterr().err
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert rows[0]["cast_from"] == "float32" and rows[0]["dtype"] == "bfloat16"
    assert rows[-1]["input"] == "random" and rows[-1]["cast_from"] == ""
    rc = ba.main(["--input_dir", str(tmp_path), "--device", "cpu", "--kernel", "sdpa", "-metric", "accuracy",
                  "--dtype", "capture", "-o", str(tmp_path / "k.csv")])
    assert rc == 0 and "cast to" not in capsys.readouterr().err
    assert next(csv.DictReader(open(tmp_path / "k.csv")))["dtype"] == "float32"


def test_no_kernel_ran_exits_non_zero_with_the_reason(capsys):
    rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "16", "--device", "cpu", "--kernel", "sagev1,fav3"])
    assert rc == ba.EXIT_NOTHING_RAN != 0
    err = capsys.readouterr().err
    assert "error: no kernel ran (4 rows, none ok)" in err and "sageattention" in err


def test_plot_has_one_legend_entry_per_kernel_and_input_and_no_point_labels():
    rows = []
    for inp in ("attn_wan_rank0_000001.pt", "attn_wan_rank0_000002.pt", "random"):
        for i, k in enumerate(("sdpa", "fav3", "sagev1")):
            r = dict.fromkeys(ba.COLUMNS, "")
            t = 1.0 + i
            r.update(input=inp, kernel=k, B=1, H=2, Sq=64, Sk=64, D=32, time_ms=t, time_p20_ms=0.9 * t,
                     time_p80_ms=1.1 * t, tflops=4 * 2 * 64 * 64 * 32 / t / 1e9, rel_l2=10.0 ** -(i + 2),
                     speed_figure=True, why_not_speed="")
            rows.append(r)
    fig = ba.build_plot(rows)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["sdpa", "fav3", "sagev1", "input: attn_wan_rank0_000001.pt", "input: attn_wan_rank0_000002.pt",
                      "input: random"]
    assert not ax.texts, "no per-point annotations"
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert len(ticks) == len(set(ticks)) >= 3  # labelled, distinct, not crowded
    assert ba.build_plot([dict(rows[0], tflops="")]) is None
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_bytes_count_one_byte_for_quantized_inputs():
    bf16, pre = B.resolve("sdpa").bench.bytes_moved(1, 1, 10, 10, 8, 2)
    assert bf16 == 4 * 80 * 2 and pre == 0
    fp8, pre = B.resolve("fav3_fp8").bench.bytes_moved(1, 1, 10, 10, 8, 2)
    # the fused pre-pass reads each of Q, K, V twice (its per-head amax, then the quantization), writes one byte
    assert fp8 == 3 * 80 * 1 + 80 * 2 and pre == 3 * 80 * (2 * 2 + 1)
    # the Triton kernels' pre-pass reads K (and fav3_sage's V) twice: a mean / amax, then the quantization
    sage, pre = B.resolve("fav3_sage").bench.bytes_moved(1, 1, 10, 10, 8, 2)
    assert sage == fp8 and pre == 80 * 3 + 2 * 80 * 5


def test_kernels_resolve_by_alias_and_unknown_ones_suggest(tmp_path):
    rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "32", "--device", "cpu", "--kernel", "native",
                  "-metric", "accuracy", "-o", str(tmp_path / "n.csv")])
    assert rc == 0
    assert {r["kernel"] for r in csv.DictReader(open(tmp_path / "n.csv"))} == {"sdpa"}
    with pytest.raises(SystemExit, match="did you mean 'sagev2'"):
        ba.main(["--preset", "cogvideox-2b", "--device", "cpu", "--kernel", "sagev3"])


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
    # one whole line each: what is wrong, and that it was not loaded (no torch advice to turn weights_only off)
    assert "attn_s_rank0_000003.pt: not loaded: the file is truncated or corrupt" in err
    assert "attn_s_rank0_000004.pt: refused, not loaded: it holds pickled objects" in err
    assert "weights_only" not in err
    assert "2 input file(s) skipped" in err


def test_past_max_s_only_inputs_of_a_new_shape_are_benched(tmp_path, capsys):
    # --max_s 1e-9: past it from the first input on; each shape (self, cross) still benched once, the rest listed
    for i, sk in enumerate((16, 4, 16, 4)):
        q, kv = torch.randn(1, 2, 16, 8), torch.randn(1, 2, sk, 8)
        torch.save({"q": q, "k": kv, "v": kv, "meta": {"layout": "BHSD"}}, tmp_path / f"attn_s_rank0_{i:06d}.pt")
    out = tmp_path / "m.csv"
    assert ba.main(["--input_dir", str(tmp_path), "--device", "cpu", "--kernel", "sdpa", "--dtype", "fp32",
                    "-metric", "accuracy", "--max_s", "1e-9", "-o", str(out)]) == 0
    assert [r["input"] for r in csv.DictReader(open(out))] == ["attn_s_rank0_000000.pt", "attn_s_rank0_000001.pt"]
    late = ["attn_s_rank0_000002.pt", "attn_s_rank0_000003.pt", "random"]
    assert json.loads(out.with_suffix(".json").read_text())["not_benched"] == late
    assert "3 input(s) not benched, past --max_s" in capsys.readouterr().err


def test_no_captures_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no capture files"):
        ba.main(["--input_dir", str(tmp_path), "--device", "cpu"])


def test_the_bench_script_is_its_command_line(tmp_path, checkout_env):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_attention.py"), "--preset", "cogvideox-2b",
                           "--max_seq", "32", "--device", "cpu", "--kernel", "sdpa", "-metric", "accuracy",
                           "-o", str(tmp_path / "c.csv")], capture_output=True, text=True, timeout=300,
                          env=checkout_env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c.csv").exists() and "cogvideox-2b" in proc.stdout


def test_sparse_patterns_take_a_grid_and_report_work_and_effective_rates(tmp_path, capsys):
    """A 96-token input on the grid 3x4x8: the patterns' work, the dense-equivalent and computed TFLOP/s, the
    speed-up column; a pattern covering the grid equals dense attention; no matching grid: unavailable, said why."""
    small, full = "sta:window=1x3x3,tile=2x2x4,block=16", "sta:window=3x3x3,tile=2x2x4,block=16"
    rc = ba.main(["--preset", "wan2.1-1.3b-480p", "--max_seq", "96", "--device", "cpu", "--dtype", "fp32",
                  "--kernel", f"sdpa,{small},{full},flex", "--grid", "3x4x8", "--baseline", "sdpa",
                  "-o", str(tmp_path / "s.csv")])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    by = {(r["input"], r["kernel"]): r for r in rows}
    s = by[("wan2.1-1.3b-480p", "sta:window=1x3x3+tile=2x2x4+block=16")]
    assert s["grid"] == "3x4x8" and 0 < float(s["work"]) < 1 and float(s["work_vs_dense"]) < 1
    assert float(s["tflops_computed"]) == pytest.approx(float(s["tflops"]) * float(s["work_vs_dense"]))
    assert float(s["rel_l2"]) > 0.1  # the approximation error of a small window, against dense attention
    f = by[("wan2.1-1.3b-480p", "sta:tile=2x2x4+block=16")]  # window 3x3x3: the default, not in the name
    assert float(f["work"]) == 1.0 and float(f["rel_l2"]) < 1e-5  # a window covering the grid is dense
    assert by[("wan2.1-1.3b-480p", "sdpa")]["speedup_vs_baseline"] == "1.0"
    assert float(s["speedup_vs_baseline"]) == pytest.approx(
        float(by[("wan2.1-1.3b-480p", "sdpa")]["time_ms"]) / float(s["time_ms"]))
    assert by[("wan2.1-1.3b-480p", "flex")]["work"] == ""  # dense FlexAttention needs no grid
    assert "tflops is dense-equivalent" in capsys.readouterr().out
    rc = ba.main(["--preset", "wan2.1-1.3b-480p", "--max_seq", "64", "--device", "cpu", "--dtype", "fp32",
                  "--kernel", "sta,sdpa", "--grid", "3x4x8", "-metric", "accuracy", "-o", str(tmp_path / "n.csv")])
    rows = list(csv.DictReader(open(tmp_path / "n.csv")))
    assert rc == 0 and all("needs the token grid of a 64-token self-attention input (--grid FxHxW; given: 3x4x8)"
                           in r["status"] for r in rows if r["kernel"] == "sta")
    with pytest.raises(SystemExit):
        ba.build_parser().parse_args(["--preset", "cogvideox-2b", "--grid", "3x4"])
    assert ba.parse_grid("13x30x45+226").text_tokens == 226 and str(ba.parse_grid("21x30x52")) == "21x30x52"


def test_default_timing_takes_at_least_five_samples_and_a_budget_says_why_fewer(tmp_path, capsys):
    """The defaults ask for 5 warm samples per row whatever a call takes (within --budget_s); a call longer than the
    whole budget gets one, and the row says why -- in time_n_why and in why_not_speed."""
    args = ba.build_parser().parse_args(["--preset", "cogvideox-2b"])
    assert args.min_samples >= 5 and args.budget_s >= 5 * 12  # 5 samples of a 12 s call fit
    rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "32", "--device", "cpu", "--dtype", "fp32",
                  "--kernel", "sdpa", "-metric", "time", "--budget_s", "1e-9", "-o", str(tmp_path / "b.csv")])
    assert rc == 0
    row = next(csv.DictReader(open(tmp_path / "b.csv")))
    assert row["time_n"] == "1" and "more than the 1e-09 s budget" in row["time_n_why"]
    assert "n=1 timed samples (< 3): one call takes" in row["why_not_speed"]
    assert f"note: sdpa on cogvideox-2b: n=1: {row['time_n_why']}" in capsys.readouterr().out


def test_cold_runs_each_kernel_in_a_fresh_process_with_empty_compile_caches(tmp_path, capsys):
    """--cold: one process per kernel (not this one), each started with TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR
    set to new empty folders (its own state, read at its start), removed afterwards; the rows merged in input order,
    marked cold, the first call of the first input on empty caches."""
    import os

    from vdbench.timing import CACHE_VARS

    rc = ba.main(["--preset", "cogvideox-2b", "--max_seq", "16", "--device", "cpu", "--dtype", "fp32",
                  "--kernel", "sdpa,reference", "--cold", "-o", str(tmp_path / "c.csv")])
    assert rc == 0
    procs = json.loads((tmp_path / "c.json").read_text())["cold"]["processes"]
    assert [p["kernel"] for p in procs] == ["sdpa", "reference"]
    pids = {p["pid"] for p in procs}
    assert len(pids) == 2 and os.getpid() not in pids
    dirs = [p["cache_dirs"][v] for p in procs for v in CACHE_VARS]
    assert all(dirs) and len(set(dirs)) == 4 and not any(Path(d).exists() for d in dirs)
    assert all(p["caches"] == "empty" and p["exit_code"] == 0 for p in procs)
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert list(rows[0]) == ba.COLUMNS
    assert [(r["input"], r["kernel"]) for r in rows] == [("cogvideox-2b", "sdpa"), ("cogvideox-2b", "reference"),
                                                         ("random", "sdpa"), ("random", "reference")]
    assert all(r["cold"] == "True" and float(r["first_call_ms"]) > 0 and r["first_call_excess_ms"] for r in rows)
    assert [r["caches"] for r in rows] == ["empty", "empty", ba.WARM_FROM_EARLIER, ba.WARM_FROM_EARLIER]
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("input "))
    assert "first_call_ms" in header.split()
    assert "--cold: each kernel in a fresh process" in out
