"""The batch scripts on the pool (vdbench.render_all): renders side by side (--jobs on a CPU), prompt and seed sets
split over shards and collected, a render killed mid-batch, SIGTERM to the batch, and one render over two "machines"
(two torchrun launches on localhost, gloo, one process each) against one process. Renders are the tiniest
(32x32, 5 frames, 2 steps); each Python the scripts start is forked from the test process (tests/launch.py)."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import launch
from tests.test_render_all import PY, _env, _forked_python  # noqa: F401 - the module's forked python

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--height", "32", "--width", "32", "--num_frames", "5", "--num_inference_steps", "2"]
TORCHRUN_OK = shutil.which("torchrun", path=str(Path(sys.executable).parent)) is not None


def _batch(*args, timeout=600, **env):
    return subprocess.run(["bash", str(ROOT / "render_all_WAN.sh"), *map(str, args)], capture_output=True, text=True,
                          env=_env(**env), timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_a_prompt_and_seed_set_split_over_two_shards_side_by_side_then_collected(tmp_path):
    """2 prompts x 2 seeds x (sdpa, reference), shard 0/2 then 1/2, each two renders at once (--jobs 2): every
    (prompt, seed) keeps its own video and record; --collect gives the table of the whole set (PSNR over the set
    with its n), one grid per content and the report's set table."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("A cat walks on the grass\nA red car at night\n")
    out = tmp_path / "set"
    common = ["--model-path", "tiny", "--types", "sdpa,reference", "--output-dir", out, "--prompts", prompts,
              "--seeds", "1,2"]
    for shard in ("0/2", "1/2"):
        proc = _batch(*common, "--jobs", "2", "--shard", shard, "--", *TINY)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        screen = proc.stdout
        assert f"shard {shard}: 4 of 8 renders (2 backend(s) x 4 prompt/seed pairs), 2 at once (no GPU)" in screen
        first, second = re.findall(r"^\[(.+?)\] rendering \(log", screen, re.M)[:2]
        # the second render started before the first one ended (its summary line is its last)
        assert screen.index(f"[{second}] rendering") < screen.index(f"[{first}] warm step"), screen
        assert re.search(r"^\[(sdpa|reference) p[12] seed[12]\] step 2/2: ", screen, re.M)
    results = out / "results"
    videos = sorted(results.glob("*.mp4"))
    assert len(videos) == 8
    for t in ("sdpa", "reference"):  # four each, one per (prompt, seed): the seed in the name, the prompt in the id
        mine = [v.name for v in videos if f"_attn_{t}_" in v.name]
        assert len(mine) == 4 and len({re.search(r"(_seed\d+_id-\w+)\.mp4", n).group(1) for n in mine}) == 4
    entries = json.loads((results / "timing.json").read_text())
    assert len({e["identity"]["content"] for e in entries}) == 4 and len({e["output"] for e in entries}) == 8
    assert {(e["run"]["settings"]["prompt"], e["run"]["settings"]["seed"]) for e in entries} == {
        (p, s) for p in ("A cat walks on the grass", "A red car at night") for s in (1, 2)}
    proc = _batch(*common, "--collect", "--stitch", "--report", "--", *TINY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    screen = proc.stdout
    assert "collected 8 of 8 renders" in screen
    sdpa = next(ln for ln in screen.splitlines() if ln.startswith("sdpa "))
    assert re.search(r"\b4\b.*(∞ dB \(n=4\)|[0-9.]+ dB \([0-9.]+–[0-9.]+, n=4\))", sdpa), sdpa
    assert "note: 4 contents (prompt, seed)" in screen and '4: seed 2, "A red car at night"' in screen
    assert sorted(p.name for p in out.glob("comparison_grid_*.mp4")) == [f"comparison_grid_{k}.mp4" for k in (1, 2, 3, 4)]
    html = (out / "report.html").read_text()
    assert "Over the prompt and seed set (4 contents" in html
    one = subprocess.run([PY["python"], "-m", "vdbench.batch", str(results), "--content", "2"], capture_output=True,
                         text=True, env=_env(), timeout=300)
    grid = subprocess.run([PY["python"], str(ROOT / "stitch_comparison.py"), "--input_dir", str(results), "--content",
                           "3", "--output", str(tmp_path / "c3.mp4")], capture_output=True, text=True, env=_env(),
                          timeout=300)
    assert grid.returncode == 0 and "note: content 3 of 4: seed " in grid.stderr and len(grid.stdout.splitlines()) == 3
    rep = subprocess.run([PY["python"], "-m", "vdbench.report", str(results), "--content", "1", "-o",
                          str(tmp_path / "rep1")], capture_output=True, text=True, env=_env(), timeout=300)
    assert rep.returncode == 0 and len((tmp_path / "rep1" / "summary.csv").read_text().splitlines()) == 3
    # the folder's videos in name order: one content's two renders, one row each
    assert one.returncode == 0 and re.match(r'content 2 of 4: seed [12], "A (cat|red)', one.stdout), one.stdout
    assert [ln.split()[0] for ln in one.stdout.splitlines()[2:4]] in (["sdpa", "reference"], ["reference", "sdpa"])


@pytest.mark.skipif(not TORCHRUN_OK, reason="torchrun not found beside the interpreter")
def test_a_render_killed_mid_batch_loses_only_itself(tmp_path):
    """Two torchrun renders side by side (--nproc 2 --jobs 2: each its own rendezvous port), rank 1 of sagev1_emu's
    killed by SIGKILL at its step (no word of its own): sdpa's is rendered and tabled, sagev1_emu's is reported
    failed with its ranks' exit codes and leaves no file."""
    out = tmp_path / "kill"
    proc = _batch("--model-path", "tiny", "--types", "sagev1_emu,sdpa", "--output-dir", out, "--nproc", "2", "--jobs",
                  "2", "--", *TINY, VDBENCH_TEST_FAIL="1:step:sagev1_emu", VDBENCH_TEST_FAIL_SIGNAL="9")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    screen = proc.stdout
    assert "2 renders, 2 at once (no GPU)" in screen
    assert re.search(r"^\[sagev1_emu\] FAILED \(exit 1; ranks exited -9 4\)", screen, re.M), screen
    assert "1 succeeded (sdpa), 1 failed (sagev1_emu)" in screen and re.search(r"^sdpa\+u2 ", screen, re.M)
    assert [p.name for p in (out / "results").iterdir() if "sagev1" in p.name] == []
    assert len(list((out / "results").glob("*_attn_sdpa_*_u2.mp4"))) == 1


def test_sigterm_stops_every_running_render_and_leaves_nothing_half_written(tmp_path):
    out = tmp_path / "stop"
    proc = subprocess.Popen(["bash", str(ROOT / "render_all_WAN.sh"), "--model-path", "tiny", "--types",
                             "sdpa,reference,sdpa_math", "--output-dir", str(out), "--jobs", "2", "--", *TINY[:-1],
                             "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    seen = set()
    t0 = time.monotonic()
    while len(seen) < 2 and time.monotonic() - t0 < 300:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        m = re.match(r"^\[(\w+)\] step 2/400", line)
        if m:
            seen.add(m.group(1))
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, rest + err
    assert "stopped by SIGTERM: every running render ended" in rest
    assert re.search(r"0 succeeded \(none\), 2 failed \(\w+ \w+\), 1 not rendered \(sdpa_math\)", rest), rest
    assert "FAILED (exit stopped)" in rest
    # no video, no raw frames, no temporary file: what a render writes is renamed into place only when whole
    left = sorted(p.name for p in (out / "results").iterdir()) if (out / "results").exists() else []
    assert [n for n in left if not n.endswith(".lock")] in ([], ["timing.json"], ["records.jsonl", "timing.json"])


@pytest.mark.skipif(not TORCHRUN_OK, reason="torchrun not found beside the interpreter")
def test_one_render_over_two_machines_equals_one_process(tmp_path):
    """Two batches, one per "machine" (node rank 0 and 1 on localhost), each launching torchrun with --nnodes 2 and
    one process: the render's two ranks meet on the c10d rendezvous (gloo), Ulysses over both, and its frames are
    the one-process render's bit for bit."""
    one = tmp_path / "one"
    single = launch.render("wan", ["--model", "tiny", *TINY, "--attention_type", "sdpa", "--save_frames",
                                   "--benchmark_output_directory", str(one)], tmp_path / "one.logs")
    assert single.returncode == 0, single.stderr[-3000:]
    out, port = tmp_path / "two", launch.free_port()
    nodes = [subprocess.Popen(["bash", str(ROOT / "render_all_WAN.sh"), "--model-path", "tiny", "--types", "sdpa",
                               "--output-dir", str(out), "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint",
                               f"localhost:{port}", "--", *TINY, "--save_frames"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT) for r in (0, 1)]
    screens = [p.communicate(timeout=400)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(screens)
    assert "under torchrun on 2 machines x 1 processes (--ulysses_degree 2)" in screens[0]
    assert sorted(p.name for p in (out / "logs").glob("*.log")) == ["sdpa.node0.log", "sdpa.node1.log"]
    frames = [np.load(p) for p in (out / "results").glob("*.npy")]
    ref = np.load(next((one / "results").glob("*.npy")))
    assert len(frames) == 1 and ref.std() > 1.0 and np.array_equal(frames[0], ref)
    entry = json.loads((out / "results" / "timing.json").read_text())[-1]
    assert entry["parallel"]["world_size"] == 2 and entry["parallel"]["tag"] == "u2"


@pytest.mark.parametrize("args,message", [
    (["--prompts", "EMPTY"], "the file is empty"),
    (["--prompts", "BLANK"], "line 2 is blank"),
    (["--seeds", "1,x"], "comma-separated integers"),
    (["--shard", "2/2"], "I from 0 to N-1"),
    (["--node-rank", "1"], "add --nnodes N"),
    (["--reuse", "--nnodes", "2", "--rdzv-endpoint", "h:29400"], "--reuse with several machines"),
    (["--prompts", "BLANK", "--", "--prompt", "x"], "not both"),
    (["--gpus", "0,1"], "--gpus 0,1"),  # no GPU here: "no GPU visible"; with GPUs: 0,1 not all visible, or it runs
])
def test_bad_set_shard_and_rendezvous_options_exit_2_with_one_line(args, message, tmp_path):
    (tmp_path / "EMPTY").write_text("")
    (tmp_path / "BLANK").write_text("a\n\nb\n")
    args = [str(tmp_path / a) if a in ("EMPTY", "BLANK") else a for a in args]
    if args[0] == "--gpus":
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("GPUs 0 and 1 are visible: --gpus 0,1 is valid here")
    proc = _batch("--output-dir", tmp_path / "o", *args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr
