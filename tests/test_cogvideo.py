"""sageattn_cogvideo.py and render_all_attention.sh on the tiny CogVideoX (F.sdpa patched in that model only)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sageattn_cogvideo
from vdbench.video import probe_video

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model_path", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps", "2"]


def test_tiny_cogvideox_renders_with_cpu_backends(tmp_path):
    for backend in ("sdpa", "sagev1_emu", "fp8_emu", "reference"):
        assert sageattn_cogvideo.main(SMALL + ["--attention_type", backend, "--output_dir", str(tmp_path)]) == 0
        written = Path(json.loads((tmp_path / "timing.json").read_text())[-1]["output"])
        # CogVideoX's names carry the model and backend only: a size, frame count or step count other than the
        # tiny model's default goes into the name's identity id
        assert written.parent == tmp_path and written.name.startswith(f"cogvideox-tiny_{backend}_id-")
        info = probe_video(written)
        assert (info.width, info.height, info.n_frames) == (96, 64, 9)
    entries = json.loads((tmp_path / "timing.json").read_text())
    assert [e["attention_type"] for e in entries] == ["sdpa", "sagev1_emu", "fp8_emu", "reference"]
    for e in entries:  # the run_wan.py schema
        assert {"pipe_time", "vae_decode_time", "step_times", "attention", "run"} <= set(e)
        # 2 layers x 2 steps, joint text+video attention (CogVideoX batches the two CFG passes in one call)
        assert e["attention"]["calls_by_kind"] == {"joint": 4}
    assert entries[1]["attention"]["calls_by_kernel"] == {"emu.sagev1": 4}


def test_captures_use_the_shared_format(tmp_path):
    from vdbench.capture import list_captures, load_capture

    assert sageattn_cogvideo.main(SMALL + ["--attention_type", "sdpa", "--output_dir", str(tmp_path),
                                           "--save_inputs", "--max_captures", "2"]) == 0
    files = list_captures(tmp_path / "captures")
    assert len(files) == 2
    q, k, v, meta = load_capture(files[0])
    assert meta["kind"] == "joint" and q.shape[1] == 2 and q.shape[-1] == 32


def test_unavailable_backend_is_refused(tmp_path, capsys):
    assert sageattn_cogvideo.main(SMALL + ["--attention_type", "fav3", "--device", "cpu",
                                           "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'fav3' can't run here" in err and "sagev1_emu" in err
    assert not list(tmp_path.glob("*.mp4"))


def test_render_all_attention_stitches_and_fails_fast_on_unknown(tmp_path, fork_python):
    env = dict(os.environ, PYTHON=fork_python)  # each Python call of the script forked from this process
    script = str(ROOT / "render_all_attention.sh")
    bad = subprocess.run(["bash", script, "--output-dir", str(tmp_path), "--types", "sdpa,nope"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "unknown attention type 'nope'" in bad.stderr and "fp8_emu" in bad.stderr
    ok = subprocess.run(["bash", script, "--output-dir", str(tmp_path), "--types", "sdpa,fp8_emu", "--stitch",
                         "--report", "--", *SMALL[2:]], capture_output=True, text=True, env=env, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "2 succeeded (sdpa fp8_emu)" in ok.stdout
    assert probe_video(tmp_path / "comparison_grid.mp4").n_frames == 9
    assert (tmp_path / "report.html").exists() and (tmp_path / "summary.csv").exists()


def test_memory_options(tmp_path, capsys):
    assert sageattn_cogvideo.main(SMALL + ["--attention_type", "sdpa", "--output_dir", str(tmp_path),
                                           "--vae_tiling", "--vae_slicing"]) == 0
    assert sageattn_cogvideo.main(SMALL + ["--attention_type", "sdpa", "--output_dir", str(tmp_path),
                                           "--cpu_offload", "--device", "cpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_i2v_records_the_vae_encode_of_the_image(tmp_path, capsys):
    """CogVideoX I2V encodes the image with its VAE (no image encoder): timed, and the stages add up; the fast
    encode is Wan's only and refused before the load."""
    from PIL import Image

    img = tmp_path / "in.png"
    Image.new("RGB", (192, 128), (200, 30, 30)).save(img)
    base = ["--model_path", "tiny", "--height", "128", "--width", "192", "--num_frames", "9", "--num_inference_steps",
            "2", "--task", "i2v", "--img_file_path", str(img), "--attention_type", "sdpa", "--output_dir",
                    str(tmp_path)]
    assert sageattn_cogvideo.main(base) == 0
    e = json.loads((tmp_path / "timing.json").read_text())[-1]
    assert e["vae_encode_time"] > 0 and e["image_encode_time"] is None and e["vae_encode"]["mode"] == "default"
    assert sum(v for v in e["stages"].values() if v) + e["unaccounted"] == pytest.approx(e["total_time"])
    assert sageattn_cogvideo.main(base + ["--vae_encode", "fast"]) != 0
    assert "implemented for AutoencoderKLWan only, not AutoencoderKLCogVideoX" in capsys.readouterr().err
