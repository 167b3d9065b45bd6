"""vdbench.report on a real tiny run: summary.csv figures, a self-contained report.html, rendered in chromium."""

import csv
import math
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
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3  # speed-vs-quality, per-step, per-frame PSNR (+ poster)
    assert "<table" in page and "fp8_emu" in page
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
    assert co.main([str(run_dir / "results"), "--reference", "nope"]) == 2
    assert "no render labelled 'nope'" in capsys.readouterr().err
    # A reference file from elsewhere (e.g. the eager render when the directory holds compiled renders).
    ref_file = next((run_dir / "results").glob("*attn_reference_*.npy"))
    assert co.main([str(run_dir / "results"), "--reference", str(ref_file), "-o", str(tmp_path / "f.json")]) == 0
    rows_f = {r["backend"]: r for r in json.loads((tmp_path / "f.json").read_text())["rows"]}
    assert rows_f["reference"]["psnr_db"] == float("inf")
    assert rows_f["fp8_emu"]["psnr_db"] == rows["fp8_emu"]["psnr_db"]
    assert co.main([str(run_dir / "results"), "--reference", str(tmp_path / "missing.npy")]) == 2


def test_grid_labels_carry_speedup_and_psnr(run_dir, tmp_path, capsys):
    import stitch_comparison

    out = tmp_path / "grid.mp4"
    assert stitch_comparison.main(["--input_dir", str(run_dir / "results"), "--output", str(out),
                                   "--reference", "reference"]) == 0
    printed = capsys.readouterr().out
    assert "reference · " in printed and "ref" in printed
    assert "fp8_emu · " in printed and " dB" in printed and "default · 1.00×" in printed
    assert stitch_comparison.main(["--input_dir", str(run_dir / "results"), "--output", str(out),
                                   "--reference", "nope"]) == 2


def test_lpips_absence_is_said_not_hidden(run_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("lpips") is not None:
        pytest.skip("lpips is installed here: the absence note does not apply")
    s = report.summarize(run_dir)
    assert any("LPIPS not computed: the optional 'lpips' package is not installed" in n for n in s["notes"])
