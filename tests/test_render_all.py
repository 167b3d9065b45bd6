"""render_all_WAN.sh / render_all_attention.sh and the original commands users type, on the tiny models.

The commands of the original scripts' README, as a user types them: the render-all scripts with ``--stitch``,
``--types``, ``--reuse``, ``--nproc``, ``--font-size``, ``--fps``, ``--img-file-path``; the stitcher with
``--input_dir`` and ``--font_size`` alone; ``run_wan.py`` with the original flags (``--task ti2v`` with an image
included). Each render is 64x96, 9 frames, 2 steps (CPU-sized); torchrun runs over gloo.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vdbench.video import MADE_BY_GRID, made_by, probe_video

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps", "2"]
TORCHRUN_OK = shutil.which("torchrun", path=str(Path(sys.executable).parent)) is not None


# the Python the scripts and commands run with: the module's fork server (conftest fork_python), set below
PY = {"python": sys.executable}


@pytest.fixture(autouse=True, scope="module")
def _forked_python(fork_python):
    PY["python"] = fork_python
    yield
    PY["python"] = sys.executable


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHON=PY["python"], OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def _script(name, *args, timeout=600, **env):
    return subprocess.run(["bash", str(ROOT / name), *map(str, args)], capture_output=True, text=True,
                          env=_env(**env), timeout=timeout, cwd=ROOT)


def _image(path: Path) -> Path:
    Image.fromarray((np.arange(64 * 96 * 3) % 251).astype(np.uint8).reshape(64, 96, 3)).save(path)
    return path


def test_the_original_batch_commands(tmp_path):
    """--types, --stitch, --font-size, --fps, --img-file-path (TI2V's image-to-video path), then --reuse; the
    step lines and the comparison table on screen; the stitcher's original command on the results."""
    out, img = tmp_path / "wan", _image(tmp_path / "first_frame.png")
    proc = _script("render_all_WAN.sh", "--model-path", "tiny", "--types", "sdpa,reference", "--output-dir", out,
                   "--stitch", "--font-size", "48", "--fps", "8", "--img-file-path", img, "--", "--task", "ti2v",
                   *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    screen = proc.stdout
    assert re.search(r"^\[sdpa\] step 1/2: [0-9.]+ s, ETA \d+:\d\d$", screen, re.M), screen  # progress on screen
    assert re.search(r"^\[reference\] step 2/2: .*ETA 0:00$", screen, re.M)
    table = screen[screen.index("stack "):].splitlines()
    assert table[0].split()[:2] == ["stack", "layout"] and "PSNR vs reference" in table[0]
    sdpa = next(ln for ln in table if ln.startswith("sdpa "))
    assert "1 process" in sdpa and "1.00×" in sdpa and "sdpa[flash]×" in sdpa and " dB" in sdpa
    assert "end-to-end (s)" in table[0] and "one-time (s)" in table[0] and " baseline " in sdpa
    assert "note: not a speed figure (CPU timing" in screen
    results = out / "results"
    videos = sorted(p.name for p in results.glob("*.mp4"))
    # the image and the frame rate are the renders' identity beside the backend: one id for both, in their names
    assert [re.sub(r"_id-[0-9a-f]{8}\.mp4$", "", v) for v in videos] == [
        "wan_result_ti2v_tiny_9f_2s_attn_reference_64x96", "wan_result_ti2v_tiny_9f_2s_attn_sdpa_64x96"]
    assert len({v[-15:] for v in videos}) == 1
    assert all(probe_video(results / v).fps == 8 for v in videos)  # --fps reached the renderer
    entries = json.loads((results / "timing.json").read_text())
    assert {e["run"]["model"]["pipeline"] for e in entries} == {"WanImageToVideoPipeline"}  # the image was used
    assert all(e["run"]["model"]["expand_timesteps"] for e in entries)  # the TI2V checkpoint's image path
    grid = out / "comparison_grid.mp4"
    assert made_by(grid) == MADE_BY_GRID and probe_video(grid).fps == 8
    again = _script("render_all_WAN.sh", "--model-path", "tiny", "--types", "sdpa,reference", "--output-dir", out,
                    "--reuse", "--stitch", "--fps", "8", "--img-file-path", img, "--", "--task", "ti2v", *SMALL)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[sdpa] reused" in again.stdout and "[reference] reused" in again.stdout
    # the stitcher's original command: input dir and font size alone; re-run, its own grid is no cell
    for _ in range(2):
        st = subprocess.run([PY["python"], str(ROOT / "stitch_comparison.py"), "--input_dir", str(results),
                             "--font_size", "48"], capture_output=True, text=True, env=_env(), timeout=300)
        assert st.returncode == 0, st.stderr
        assert st.stdout.splitlines()[0] == str(results / "comparison_grid.mp4") and len(st.stdout.splitlines()) == 3
    assert "comparison_grid.mp4 left out (the output of this run)" in st.stderr


def test_cogvideox_batch(tmp_path):
    out = tmp_path / "cog"
    proc = _script("render_all_attention.sh", "--model-path", "tiny", "--types", "sdpa,fp8_emu", "--output-dir",
                   out, "--stitch", "--", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # CogVideoX's names carry the model and backend; the size, frames and steps off the tiny default: the id
    assert [re.sub(r"_id-[0-9a-f]{8}", "", p.name) for p in sorted(out.glob("*.mp4"))] == [
        "cogvideox-tiny_fp8_emu.mp4", "cogvideox-tiny_sdpa.mp4", "comparison_grid.mp4"]
    fp8 = next(ln for ln in proc.stdout.splitlines() if ln.startswith("fp8_emu "))
    # no time, end-to-end, one-time, speed-up or break-even for an emulation
    assert fp8.split()[3:8] == ["emulated"] * 5


@pytest.mark.skipif(not TORCHRUN_OK, reason="torchrun not found beside the interpreter")
def test_nproc_launches_each_render_under_torchrun_and_a_failing_rank_fails_that_render_only(tmp_path):
    """--nproc 2: Ulysses over both processes by default (the original's layout), diffusers' engine by auto on a
    CPU, the layout in the file names and the table; rank 1 of the first render killed (SIGKILL, no word of its
    own) fails that render alone, named by the rank that stopped, and the batch goes on to the next."""
    out = tmp_path / "par"
    proc = _script("render_all_WAN.sh", "--nproc", "2", "--model-path", "tiny", "--types", "sagev1_emu,sdpa",
                   "--output-dir", out, "--stitch", "--", *SMALL, VDBENCH_TEST_FAIL="1:step:sagev1_emu",
                   VDBENCH_TEST_FAIL_SIGNAL="9")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    screen = proc.stdout
    assert "under torchrun on 2 processes (--ulysses_degree 2)" in screen
    assert re.search(r"^\[sdpa\+u2\] step 2/2: ", screen, re.M)  # rank 0's progress lines come through torchrun
    failed = next(ln for ln in screen.splitlines() if ln.startswith("[sagev1_emu] FAILED"))
    # the killed rank's signal, the other's "another rank failed", and which rank it was
    assert "(exit 1; ranks exited -9 4): rank 0: stopping because rank 1 stopped without a word" in failed, failed
    assert screen.index("[sagev1_emu] FAILED") < screen.index("[sdpa+u2] step 1/2")  # the batch went on
    sdpa = next(ln for ln in screen.splitlines() if ln.startswith("sdpa+u2 "))
    assert "ulysses2 (diffusers, 2 ranks)" in sdpa and "sdpa[flash]@ulysses2/async×" in sdpa
    assert "sagev1_emu: FAILED (exit 1; ranks exited -9 4)" in screen
    assert sorted(p.name for p in (out / "results").glob("*.mp4")) == [
        "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96_u2.mp4"]
    entry = json.loads((out / "results" / "timing.json").read_text())[-1]
    assert entry["parallel"]["engine"] == "diffusers" and entry["parallel"]["engine_requested"] == "auto"
    assert "not stitching: fewer than two renders succeeded" in screen


def test_nothing_rendered_exits_non_zero_with_what_to_install(tmp_path):
    proc = _script("render_all_WAN.sh", "--model-path", "tiny", "--types", "sagev1", "--output-dir", tmp_path / "x",
                   "--", *SMALL)
    assert proc.returncode == 1
    screen = proc.stdout
    assert "[sagev1] FAILED (exit 2): attention backend 'sagev1' can't run here" in screen
    assert "    hint: Backends that can run here" in screen
    assert "install: pip install -e '.[sage]'; runs anywhere as its emulation: sagev1_emu" in screen
    assert "error: nothing rendered" in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--nproc", "0"], "--nproc needs a positive integer"),
    (["--ulysses-degree", "2"], "add --nproc N"),
    (["--fps"], "--fps needs a value"),
    (["--frobnicate"], "unknown option --frobnicate"),
    (["--img-file-path", "/nonexistent.png"], "no such file"),
    (["--types", "sdpa,nope"], "unknown attention type 'nope'"),
])
def test_bad_options_exit_2_with_one_line(args, message, tmp_path):
    proc = _script("render_all_WAN.sh", "--output-dir", tmp_path / "o", *args)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_run_wan_with_the_original_flags(tmp_path):
    """run_wan.py as the original README ran it (its flag names, an alias backend), and --task ti2v with an image:
    TI2V's image-to-video path (WanImageToVideoPipeline on the TI2V checkpoint), not a refusal after the load."""
    img = _image(tmp_path / "x.png")
    base = [PY["python"], str(ROOT / "run_wan.py"), "--model", "tiny", "--prompt", "A cat walks on the grass",
            "--seed", "42", *SMALL, "--benchmark_output_directory", str(tmp_path / "o")]
    t2v = subprocess.run(base + ["--task", "t2v", "--attention_type", "native"], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert t2v.returncode == 0, t2v.stderr
    ti2v = subprocess.run(base + ["--task", "ti2v", "--img_file_path", str(img), "--attention_type", "sdpa"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert ti2v.returncode == 0, ti2v.stderr
    res = tmp_path / "o" / "results"
    # the prompt (and for ti2v the image) is identity: the ids differ, the readable parts are the backend's
    names = sorted(p.name for p in res.glob("*.mp4"))
    assert [re.sub(r"_id-[0-9a-f]{8}\.mp4$", "", n) for n in names] == [
        "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96", "wan_result_ti2v_tiny_9f_2s_attn_sdpa_64x96"]
    entries = json.loads((res / "timing.json").read_text())
    assert [e["run"]["model"]["pipeline"] for e in entries] == ["WanPipeline", "WanImageToVideoPipeline"]
    assert entries[1]["run"]["resolved"]["flow_shift"] == 5.0  # TI2V's shift
