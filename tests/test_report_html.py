"""vdbench.report on a real tiny run: summary.csv figures, a self-contained report.html, rendered in chromium."""

import csv
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import run_wan
from vdbench import report

SMALL = ["--model", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps", "2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep")
    for backend in ("default", "reference", "fp8_emu"):
        assert run_wan.main(SMALL + ["--attention_type", backend, "--save_frames",
                                     "--benchmark_output_directory", str(out)]) == 0
    return out


def test_summary_csv_and_html(run_dir, tmp_path):
    assert report.main([str(run_dir), "-o", str(tmp_path)]) == 0
    rows = {r["backend"]: r for r in csv.DictReader(open(tmp_path / "summary.csv"))}
    assert set(rows) == {"default", "reference", "fp8_emu"}
    assert math.isinf(float(rows["reference"]["psnr_db"]))
    assert 10 < float(rows["fp8_emu"]["psnr_db"]) < 80 and float(rows["default"]["speedup_vs_default"]) == 1.0
    assert rows["fp8_emu"]["quality_source"].startswith("raw frames")
    assert "emu.fp8" in rows["fp8_emu"]["kernels"]
    # the render's wait and what it paid once, beside the warm step; break-even against default
    assert float(rows["default"]["end_to_end_s"]) > float(rows["default"]["load_s"]) > 0
    assert rows["default"]["one_time_s"] != "" and float(rows["default"]["steady_s"]) > 0
    assert rows["default"]["break_even_steps_vs_default"] == "baseline"
    assert rows["reference"]["break_even_steps_vs_default"].startswith(("always", "never", "from ", "up to ", "same"))
    # emulations carry no speed: "emulated" in every speed cell, accuracy kept
    for col in report.SPEED_COLUMNS:
        assert rows["fp8_emu"][col] == "emulated", col
    assert rows["fp8_emu"]["emulated"] == "True" and rows["fp8_emu"]["speed_figure"] == "False"
    # a CPU run of 2 steps: one warm step; flagged, with the reason, never silently a speed figure
    d = rows["default"]
    assert d["warm_step_n"] == "1" and float(d["first_step_ms"]) > 0 and float(d["warm_step_ms"]) > 0
    assert d["speed_figure"] == "False" and "CPU timing" in d["why_not_speed"] and "n=1" in d["why_not_speed"]
    assert "step_time_ms" not in rows["default"]  # the old, ambiguous column name is gone
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 4  # speed-vs-quality, warm step bars, per-step, PSNR (+ poster)
    assert "<table" in page and "fp8_emu" in page
    assert "not a speed figure (CPU timing" in page and "warm step ms (median after the first step)" in page
    heads = re.findall(r"<th>([^<]*)</th>", page)
    warm = heads.index("warm step ms (median after the first step)")
    assert heads[warm + 5:warm + 8] == ["end-to-end (s)", "one-time (s)", "break-even steps vs default"]
    assert "break-even steps against default: the denoising steps a render needs" in page
    emu_row = page[page.index("<tr><td>fp8_emu</td>"):].split("</tr>")[0]
    assert emu_row.count("<td>emulated</td>") >= 5
    assert "http://" not in page and "https://" not in page  # self-contained


def _chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_its_plots_in_headless_chromium(run_dir, tmp_path):
    assert report.main([str(run_dir), "-o", str(tmp_path)]) == 0
    url = (tmp_path / "report.html").resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([_chromium(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-500:]
    assert dom.stdout.count("<img") >= 3
    shot = tmp_path / "shot.png"
    subprocess.run([_chromium(), *flags, f"--screenshot={shot}", "--window-size=1200,2400", url],
                   capture_output=True, timeout=120)
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colours = img.resize((300, 600)).getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200, "the page rendered blank (no plots)"


def test_compare_outputs_cli(run_dir, tmp_path, capsys):
    import importlib.util
    import json

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("compare_outputs", root / "bench" / "compare_outputs.py")
    co = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(co)
    assert co.main([str(run_dir / "results"), "-o", str(tmp_path / "q.json")]) == 0
    rows = {r["backend"]: r for r in json.loads((tmp_path / "q.json").read_text())["rows"]}
    assert rows["reference"]["psnr_db"] == float("inf") and rows["fp8_emu"]["psnr_db"] < 80
    assert rows["fp8_emu"]["emulated"] is True and rows["fp8_emu"]["warm_step_ms"] is None
    assert rows["fp8_emu"]["speedup_vs_default"] is None
    assert rows["default"]["warm_step_n"] == 1 and rows["default"]["speed_figure"] is False
    from vdbench.measure.record import read

    recs = read(tmp_path / "records.jsonl")  # the rows again, as records with the command that made them
    assert {r.case for r in recs} == set(rows) and all(r.suite == "quality" and r.command for r in recs)
    printed = capsys.readouterr().out
    assert "not a speed figure (CPU timing" in printed
    assert [line for line in printed.splitlines() if line.startswith("fp8_emu ")][0].split()[1] == "emulated"
    assert co.main([str(run_dir / "results"), "--reference", "nope"]) == 2
    assert "no render labelled 'nope'" in capsys.readouterr().err
    # A reference file from elsewhere (e.g. the eager render when the directory holds compiled renders).
    ref_file = next((run_dir / "results").glob("*attn_reference_*.npy"))
    assert co.main([str(run_dir / "results"), "--reference", str(ref_file), "-o", str(tmp_path / "f.json")]) == 0
    rows_f = {r["backend"]: r for r in json.loads((tmp_path / "f.json").read_text())["rows"]}
    assert rows_f["reference"]["psnr_db"] == float("inf")
    assert rows_f["fp8_emu"]["psnr_db"] == rows["fp8_emu"]["psnr_db"]
    assert co.main([str(run_dir / "results"), "--reference", str(tmp_path / "missing.npy")]) == 2


def test_grid_labels_carry_warm_step_speedup_and_psnr(run_dir, tmp_path, capsys):
    import stitch_comparison

    out = tmp_path / "grid.mp4"
    assert stitch_comparison.main(["--input_dir", str(run_dir / "results"), "--output", str(out),
                                   "--reference", "reference"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "reference · " in printed and "ref" in printed
    assert "fp8_emu · emulated · " in printed and " dB" in printed
    assert "×" not in printed.split("fp8_emu · ")[1].splitlines()[0]  # no speedup for an emulation
    # the warm step (median of the steps after the first) and its speedup against default, flagged on a CPU
    assert re.search(r"default · [0-9.]+ ms/step 1\.00× \(n=1: not a speed figure\)", printed), printed
    assert re.search(r"warning: default: [0-9.]+ ms/step, speedup 1\.00×, is not a speed figure: CPU timing",
                     captured.err), captured.err
    assert stitch_comparison.main(["--input_dir", str(run_dir / "results"), "--output", str(out),
                                   "--reference", "nope"]) == 2


def test_lpips_absence_is_said_not_hidden(run_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("lpips") is not None:
        pytest.skip("lpips is installed here: the absence note does not apply")
    s = report.summarize(run_dir)
    assert any("LPIPS not computed: the optional 'lpips' package is not installed" in n for n in s["notes"])


def _entry(label, steps, device="cuda:0", emulated=None, settings=None, **extra):
    run = {"settings": settings or {"height": 480}, "resolved": {"device": device}}
    if emulated is not None:
        run["backend"] = {"name": label, "emulated": emulated}
    return {"attention_type": label, "step_times": steps, "run": run, **extra}


def test_speed_reads_old_files_by_the_warm_definition(tmp_path):
    """A timing.json from before the warm-step keys (first-included ``step_time_median``, no ``run.backend``) is
    recomputed from its raw step times; the emulation is recognised from the registry."""
    old = [_entry("default", [3.0, 1.0, 1.2, 1.1], step_time_median=1.15),
           _entry("sdpa", [2.0, 0.5, 0.6, 0.55]),
           _entry("fp8_emu", [9.0, 8.0, 8.0, 8.0])]
    (tmp_path / "timing.json").write_text(json.dumps(old))
    sp = report.speed(tmp_path)
    assert sp["default"]["warm_step_median"] == 1.1 and sp["default"]["first_step"] == 3.0
    assert sp["default"]["speed_figure"] is True and sp["default"]["warm_step_n"] == 3
    assert sp["fp8_emu"]["emulated"] is True and sp["fp8_emu"]["warm_step_median"] is None
    assert sp["fp8_emu"]["step_times"] is None and "emulated backend" in sp["fp8_emu"]["why_not_speed"]
    s = report.summarize(tmp_path)
    rows = {r["backend"]: r for r in s["rows"]}
    assert rows["sdpa"]["speedup_vs_default"] == 2.0 and rows["sdpa"]["speed_figure"] is True
    assert rows["fp8_emu"]["speedup_vs_default"] is None
    assert any(n.startswith("emulated backends carry no speed") and "fp8_emu" in n for n in s["notes"])
    assert not any(n.startswith("not a speed figure") for n in s["notes"])  # GPU, n=3: speed figures


def test_break_even_steps():
    """one_a + n·warm_a = one_b + n·warm_b: a faster step with a larger one-time cost wins from the first whole n
    past the crossing; 'always' / 'never' where one side is ahead at every length."""
    be = report.break_even
    assert be(10.0, 1.0, 2.0, 1.5) == {"verdict": "from", "steps": 17, "n": 16.0}  # 8 s more once, 0.5 s a step
    assert be(10.0, 1.0, 2.0, 1.25) == {"verdict": "from", "steps": 33, "n": 32.0}
    assert be(2.0, 1.0, 10.0, 1.5)["verdict"] == "always" and be(2.0, 1.0, 2.0, 1.5)["verdict"] == "always"
    assert be(10.0, 2.0, 2.0, 1.5) == {"verdict": "never", "steps": None, "n": -16.0}  # slower, pays more once
    assert be(2.0, 1.5, 10.0, 1.0) == {"verdict": "up to", "steps": 15, "n": 16.0}  # slower, pays less once
    assert be(2.0, 1.5, 2.4, 1.0)["verdict"] == "never"  # ahead below one step only
    assert [be(o, 1.0, 2.0, 1.0)["verdict"] for o in (1.0, 3.0, 2.0)] == ["always", "never", "same"]
    assert be(None, 1.0, 2.0, 1.0) is None and be(1.0, 1.0, None, 1.0) is None
    cases = (be(10.0, 1.0, 2.0, 1.5), be(2.0, 1.5, 10.0, 1.0), be(3.0, 1.0, 2.0, 1.5), be(10.0, 2.0, 2.0, 1.5), None)
    assert [report.break_even_text(x) for x in cases] == [
        "from 17 steps", "up to 15 steps", "from 3 steps", "never", None]
    a = {"one_time_s": 10.0, "warm_step_median": 1.0, "warm_step_p20": 0.9, "warm_step_p80": 1.1, "warm_step_n": 9}
    b = {"one_time_s": 2.0, "warm_step_median": 1.5, "warm_step_p20": 1.4, "warm_step_p80": 1.6, "warm_step_n": 49}
    assert report.break_even_cell(a, b) == "from 17 steps (p20–p80: 12–27; n=9 vs 49)"
    assert report.break_even_cell({**a, "warm_step_p80": 1.5}, b) == (
        "from 17 steps (p20–p80: from 12 steps to never; n=9 vs 49)")
    tight = {**a, "warm_step_p20": 1.0, "warm_step_p80": 1.0}
    tight_b = {**b, "warm_step_p20": 1.5, "warm_step_p80": 1.5}
    assert report.break_even_cell(tight, tight_b) == "from 17 steps (n=9 vs 49)"
    assert report.break_even_cell({"warm_step_median": 1.0}, b) is None  # a file without one-time figures


def test_end_to_end_one_time_and_break_even_columns_and_old_files(tmp_path):
    """New entries carry end_to_end_s and one_time on their first repetition; the report reads them from the
    latest run's first repetition; a file written before them gives empty cells, and no break-even note."""
    def timed(label, steps, one_time_s, e2e, **kw):
        return [_entry(label, steps, repetition=0, run_id=label, end_to_end_s=e2e, steady_s=sum(steps),
                       one_time={"load_s": 4.0, "total_s": one_time_s, "compile_s": None}, **kw),
                _entry(label, steps, repetition=1, run_id=label, end_to_end_s=None, one_time={"total_s": 0.0})]

    entries = (timed("default", [2.0, 1.5, 1.5, 1.5], 0.5, 30.0) + timed("fav3", [9.0, 1.0, 1.0, 1.0], 8.5, 34.0)
               + [_entry("sdpa", [2.0, 1.2, 1.2, 1.2])] + timed("fp8_emu", [9.0, 8.0, 8.0, 8.0], 1.0, 90.0))
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    sp = report.speed(tmp_path)
    assert (sp["fav3"]["end_to_end_s"], sp["fav3"]["one_time_s"], sp["fav3"]["load_s"]) == (34.0, 8.5, 4.0)
    assert sp["sdpa"]["end_to_end_s"] is None and sp["sdpa"]["one_time_s"] is None  # an old entry
    assert sp["fp8_emu"]["end_to_end_s"] is None and sp["fp8_emu"]["one_time_s"] is None  # emulated: no speed
    s = report.summarize(tmp_path)
    rows = {r["backend"]: r for r in s["rows"]}
    assert rows["fav3"]["break_even_steps_vs_default"] == "from 17 steps (n=6 vs 6)"
    assert rows["default"]["break_even_steps_vs_default"] == "baseline"
    assert rows["sdpa"]["break_even_steps_vs_default"] is None
    assert any(n.startswith("break-even steps against default: ") for n in s["notes"])
    page = report.write_html([s], tmp_path / "r.html").read_text()
    fav3 = page[page.index("<tr><td>fav3</td>"):].split("</tr>")[0]
    assert "<td class=n>34.00</td><td class=n>8.50</td><td>from 17 steps (n=6 vs 6)</td>" in fav3
    sdpa = page[page.index("<tr><td>sdpa</td>"):].split("</tr>")[0]
    assert "<td>–</td><td>–</td><td>–</td>" in sdpa  # no figure: the report's dash
    report.write_csv([s], tmp_path / "s.csv")
    row = {r["backend"]: r for r in csv.DictReader(open(tmp_path / "s.csv"))}
    assert row["sdpa"]["end_to_end_s"] == "" and float(row["fav3"]["one_time_s"]) == 8.5
    assert row["fp8_emu"]["end_to_end_s"] == row["fp8_emu"]["break_even_steps_vs_default"] == "emulated"
    # a file from before these fields: read and rendered, no break-even note
    old = [_entry("default", [2.0, 1.5, 1.5]), _entry("fav3", [9.0, 1.0, 1.0])]
    (tmp_path / "timing.json").write_text(json.dumps(old))
    s = report.summarize(tmp_path)
    assert all(r["end_to_end_s"] is None and r["one_time_s"] is None for r in s["rows"])
    assert not any("break-even" in n for n in s["notes"])
    assert "<th>end-to-end (s)</th>" in report.write_html([s], tmp_path / "r.html").read_text()


def test_repetitions_give_their_spread_and_error_bars(tmp_path):
    reps = [_entry("default", [3.0, 1.0, 1.2, 1.1], repetition=0), _entry("default", [2.5, 1.3, 1.4, 1.5], repetition=1),
            _entry("sdpa", [2.0, 0.5, 0.6, 0.55], repetition=0), _entry("sdpa", [2.0, 0.5, 0.5, 0.5], repetition=1)]
    (tmp_path / "timing.json").write_text(json.dumps(reps))
    s = report.summarize(tmp_path)
    d = {r["backend"]: r for r in s["rows"]}["default"]
    assert d["repetitions"] == 2 and d["warm_step_n"] == 6
    assert d["rep_warm_medians_ms"] == [pytest.approx(1100.0), pytest.approx(1400.0)]
    assert (d["rep_warm_min_ms"], d["rep_warm_max_ms"]) == (pytest.approx(1100.0), pytest.approx(1400.0))
    assert d["warm_step_p20_ms"] < d["warm_step_ms"] < d["warm_step_p80_ms"]
    out = report.write_html([s], tmp_path / "r.html").read_text()
    assert "their warm medians, min–max ms" in out and "1100.0–1400.0" in out
    assert "<figcaption>Warm step per backend: bar = median of the steps after the first" in out
    assert "error bar = p20–p80" in out
    report.write_csv([s], tmp_path / "s.csv")
    row = next(csv.DictReader(open(tmp_path / "s.csv")))
    assert row["repetitions"] == "2" and float(row["rep_warm_max_ms"]) == pytest.approx(1400.0)



def test_stages_and_encode_times_in_the_summary(tmp_path):
    """An image-conditioned run's encoders and stage breakdown reach summary.csv and the page; an emulated
    backend's denoising time (a speed) does not; an old file without stages gives empty cells."""
    stages = {"text_encode": 0.5, "image_encode": 0.1, "vae_encode": 1.1, "denoise": 30.0, "vae_decode": 1.8}
    entries = [_entry("sdpa", [10.0, 10.0, 10.0], text_encode_time=0.5, image_encode_time=0.1, vae_encode_time=1.1,
                      stages=stages, unaccounted=0.05),
               _entry("fp8_emu", [10.0, 10.0, 10.0], vae_encode_time=1.1, stages=stages, unaccounted=0.05),
               _entry("default", [3.0, 1.0, 1.1])]
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    s = report.summarize(tmp_path)
    rows = {r["backend"]: r for r in s["rows"]}
    assert rows["sdpa"]["vae_encode_s"] == 1.1 and rows["sdpa"]["image_encode_s"] == 0.1
    assert rows["sdpa"]["stages"] == "text 0.50 · image 0.10 · VAE enc 1.10 · denoise 30.00 · VAE dec 1.80 · other 0.05"
    assert "denoise" not in rows["fp8_emu"]["stages"] and rows["default"]["stages"] is None
    report.write_csv([s], tmp_path / "s.csv")
    row = {r["backend"]: r for r in csv.DictReader(open(tmp_path / "s.csv"))}
    assert float(row["sdpa"]["vae_encode_s"]) == 1.1 and row["default"]["vae_encode_s"] == ""
    page = report.write_html([s], tmp_path / "r.html").read_text()
    assert "VAE encode (s)" in page and "VAE enc 1.10 · denoise 30.00" in page


def test_each_backends_joules_per_warm_step_in_the_summary(tmp_path):
    """A render's recorded joules per step (vdbench.power) reach summary.csv and the page: the warm steps' mean
    over every card (a torchrun render's ranks added up), and how much of it the card ran power-capped; an
    emulation carries none, and a file without them gives empty cells and no column."""
    card = {"source": "nvml", "energy_j": [900.0, 700.0, 720.0, 710.0], "warm_capped_share": 1.0}
    two = {"source": "nvml", "energy_j": [950.0, 800.0, 820.0, 810.0]}
    entries = [_entry("sdpa", [1.5, 1.0, 1.0, 1.0], power=card),
               _entry("fav3", [0.9, 0.6, 0.6, 0.6], power=dict(card, warm_capped_share=0.5), power_all_ranks=two),
               _entry("fp8_emu", [9.0, 8.0, 8.0, 8.0], power=card),
               _entry("default", [3.0, 1.2, 1.2, 1.2])]
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    s = report.summarize(tmp_path)
    rows = {r["backend"]: r for r in s["rows"]}
    assert rows["sdpa"]["step_energy_j"] == 710.0 and rows["sdpa"]["power_capped_share"] == 1.0
    assert rows["fav3"]["step_energy_j"] == 810.0 and rows["fav3"]["power_capped_share"] == 0.5  # every card
    assert rows["fp8_emu"]["step_energy_j"] is None and rows["default"]["step_energy_j"] is None
    report.write_csv([s], tmp_path / "s.csv")
    row = {r["backend"]: r for r in csv.DictReader(open(tmp_path / "s.csv"))}
    assert float(row["sdpa"]["step_energy_j"]) == 710.0 and row["default"]["step_energy_j"] == ""
    page = report.write_html([s], tmp_path / "r.html").read_text()
    assert "J per warm step, every card" in page and "710.0" in page
    # beside the warm step: in the CSV, on the page, in the sweep's tables
    assert "(median after the first step)</th><th>J per warm step, every card</th>" in page
    assert report.CSV_COLUMNS.index("step_energy_j") == report.CSV_COLUMNS.index("warm_step_ms") + 1
    from vdbench import sweep

    assert sweep.COLUMNS.index("step_energy_j") == sweep.COLUMNS.index("warm_ms") + 1
    (tmp_path / "timing.json").write_text(json.dumps([_entry("default", [3.0, 1.2, 1.2, 1.2])]))
    assert "J per warm step" not in report.write_html([report.summarize(tmp_path)], tmp_path / "r2.html").read_text()


def test_the_latest_run_of_each_output_never_two_runs_mixed(tmp_path):
    """Re-rendering into the same directory appends; the report reads each output's latest run only (its run id;
    for files written before run ids, the trailing repetitions 0..r) and says how many runs the file holds. A
    Ulysses-2 render of the same backend is another run (its record's layout, its own label)."""
    sdpa = str(tmp_path / "wan_result_t2v_tiny_9f_4s_attn_sdpa_64x96.mp4")
    sdpa_u2 = str(tmp_path / "wan_result_t2v_tiny_9f_4s_attn_sdpa_64x96_u2.mp4")
    entries = [_entry("sdpa", [3.0, 1.0, 1.0, 1.0], run_id="a", output=sdpa, repetition=0),
               _entry("sdpa", [3.0, 1.0, 1.0, 1.0], run_id="a", output=sdpa, repetition=1),
               _entry("sdpa", [3.0, 4.0, 4.0, 4.0], run_id="u", output=sdpa_u2, repetition=0,
                      parallel={"tag": "u2", "label": "ulysses2", "engine": "diffusers", "world_size": 2}),
               _entry("sdpa", [3.0, 2.0, 2.0, 2.0], run_id="b", output=sdpa, repetition=0),
               # an old file's entries: no run id; a re-run with the same settings starts again at repetition 0
               _entry("default", [3.0, 5.0, 5.0, 5.0], repetition=0), _entry("default", [3.0, 5.0, 5.0, 5.0],
                                                                             repetition=1),
               _entry("default", [3.0, 6.0, 6.0, 6.0], repetition=0)]
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    sp = report.speed(tmp_path)
    assert set(sp) == {"sdpa", "sdpa+u2", "default"}
    assert sp["sdpa"]["warm_step_median"] == 2.0 and sp["sdpa"]["repetitions"] == 1  # run b alone
    assert (sp["sdpa"]["runs_recorded"], sp["sdpa"]["run_id"]) == (2, "b")
    assert sp["sdpa+u2"]["warm_step_median"] == 4.0 and sp["sdpa+u2"]["runs_recorded"] == 1
    assert sp["default"]["warm_step_median"] == 6.0 and sp["default"]["runs_recorded"] == 2
    notes = report.summarize(tmp_path)["notes"]
    assert "timing.json holds 2 runs of sdpa: the latest is used (run b)" in notes
    assert "timing.json holds 2 runs of default: the latest is used" in notes
    assert not any("sdpa+u2" in n and "runs of" in n for n in notes)


def test_a_render_appends_its_run_id(run_dir):
    entries = json.loads((run_dir / "results" / "timing.json").read_text())
    ids = {e["attention_type"]: e["run_id"] for e in entries}
    assert all(ids.values()) and len(set(ids.values())) == len(ids)  # one id per render, shared by its repetitions


def test_rows_take_their_identity_from_records_and_say_where_a_file_name_stood_in(tmp_path):
    """A video its record names is that record's run (a schedule, with its '@', is not its first rule's backend);
    a video no record names is identified from its file name, with a note on its row."""
    import numpy as np

    from vdbench.video import write_video

    frames = np.zeros((3, 16, 16, 3), np.uint8)
    sched = tmp_path / "wan_result_t2v_tiny_3f_4s_attn_default@steps:0-1,sdpa_16x16.mp4"
    orphan = tmp_path / "wan_result_t2v_tiny_3f_4s_attn_reference_16x16.mp4"
    for p in (sched, orphan):
        write_video(frames, p, fps=8)
    entries = [_entry("default@steps:0-1,sdpa", [3.0, 1.0, 1.0, 1.0], output=str(sched), run_id="s")]
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    s = report.summarize(tmp_path)
    row = {r["backend"]: r for r in s["rows"]}
    assert set(row) == {"default@steps:0-1,sdpa", "reference"}
    assert row["default@steps:0-1,sdpa"]["note"] is None and row["default@steps:0-1,sdpa"]["warm_step_ms"] == 1000
    assert row["reference"]["note"] == report.FROM_FILE_NAME
    assert "no 'default' backend with a warm step in timing.json: no speedup column" in s["notes"]
