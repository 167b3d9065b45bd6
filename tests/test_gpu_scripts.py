"""bench/gpu_*.sh on a CPU: every device script parses and takes its plumbing from bench/gpu_lib.sh (one environment
line, one set of model arguments, one budgeted runner, one packing), sourcing the library runs nothing that needs a
GPU, the runner keeps its budget and its record, and the multi-GPU scripts' dry runs (DRY_RUN=1) list their runs and
pack -- what a device call would do, without the device. The one-GPU campaigns are suites: tests/test_suite.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "bench" / "gpu_lib.sh"
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("gpu_*.sh") if p != LIB)


def bash(script: str, tmp_path, timeout=120, **env) -> subprocess.CompletedProcess:
    """Run a bash snippet from ``tmp_path`` (not the repo root: the library must find the root itself)."""
    e = dict(os.environ, PY=sys.executable, **{k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=timeout)


def test_every_device_script_parses_and_sources_the_library():
    # the multi-GPU campaigns; the one-GPU ones are suites (bench/suites/*.toml, tests/test_suite.py)
    # (gpu_vae.sh and gpu_kernels.sh stay while gpu_x4*.sh / gpu_x8.sh call them; one GPU: suites vae, kernels)
    assert {p.name for p in SCRIPTS} >= {"gpu_parallel.sh", "gpu_vae_parallel.sh", "gpu_x4.sh", "gpu_x4b.sh",
                                         "gpu_x8.sh", "gpu_vae.sh", "gpu_kernels.sh"}
    for p in [*SCRIPTS, LIB]:
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, (p.name, r.stderr)
    for p in SCRIPTS:
        text = p.read_text()
        assert 'source "$(dirname "$0")/gpu_lib.sh"' in text, p.name
        # the plumbing lives in the library only: no script sets the environment line, calls nvidia-smi, builds the
        # model arguments, or runs python3 / sys.path-dependent code by another name than $PY
        assert "NCCL_NVLS_ENABLE" not in text and "PYTHONPATH=" not in text.split("set -uo pipefail")[-1], p.name
        assert "nvidia-smi" not in text and "random:wan2.1-t2v" not in text, p.name
        assert not re.search(r"^[^#]*\bpython3\b", text, re.M), p.name
        assert "<<'PYEOF'" not in text, p.name  # a script's Python lives in a bench/*.py tool


def test_sourcing_sets_the_environment_and_runs_nothing_else(tmp_path):
    r = bash(f'OUT=o; source {LIB}; echo "$PWD|$OUT|$PYTHONPATH|$NCCL_NVLS_ENABLE|$TORCH_SYMM_MEM_DISABLE_MULTICAST|'
             '$PYTHONUNBUFFERED|$OMP_NUM_THREADS|$CALL"; echo "${W13[*]}"; echo "${WAN14[*]}"; ls ' + str(tmp_path),
             tmp_path, PYTHONPATH="/elsewhere")
    assert r.returncode == 0, r.stderr
    first, w13, wan14, *listing = r.stdout.splitlines()
    cwd, out, pypath, nvls, mc, unbuf, omp, call = first.split("|")
    # the repo root as the working directory, OUT made absolute where the caller meant it
    assert cwd == str(ROOT) and out == str(tmp_path / "o") and listing == ["o"]
    assert pypath == f"{ROOT}:/elsewhere" and (nvls, mc, unbuf, omp, call) == ("0", "1", "1", "8", "-")
    assert w13.startswith("--model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81 "
                          "--num_inference_steps 3") and "--save_latents" in w13
    assert wan14 == "--model random:wan2.1-t2v-14b --height 720 --width 1280 --num_frames 81"
    r = bash(f'OUT={tmp_path}/o2 W={tmp_path}/w RES={tmp_path}/res; source {LIB}; ls {tmp_path}', tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["o", "o2"]  # no runs.tsv, logs or GPU record unless asked


def _runs(w: Path) -> list[list[str]]:
    return [line.split("\t") for line in (w / "runs.tsv").read_text().splitlines()]


def test_the_budgeted_runner_on_cpu(tmp_path):
    """r runs a command under its own limit (cut to the deadline), records rc and wall, skips what can't finish;
    its child gets the model arrays and the wan / cog functions."""
    w = tmp_path / "w"
    script = f'''OUT={tmp_path}/o W={w} RES={tmp_path}/res CALL=7 LIMIT_S=40; source {LIB}; runs_init
r ok 5 20 eval 'echo "[ok] fine"; echo "${{W13[1]}} $(declare -F wan)"'
r fails 5 20 bash -c 'echo "error: nope"; exit 3'
r slow 5 1 sleep 10
r late 1000 20 echo never
GRACE_S=30 r graced 6 20 echo never
ONLY='ok|fine_.*' r not_chosen 5 20 echo never
ONLY='ok|fine_.*' r fine_1 5 20 echo '[fine_1] chosen'
DRY_RUN=1 r dry 5 100 wan w13 1gpu sdpa 0 1'''
    r = bash(script, tmp_path)
    assert r.returncode == 0, r.stderr
    rows = _runs(w)
    assert rows[0] == ["call", "run", "rc", "wall_s"]
    got = {row[1]: row[2] for row in rows[1:]}
    assert got == {"ok": "0", "fails": "3", "slow": "124", "late": "skip(deadline)", "graced": "skip(deadline)",
                   "not_chosen": "skip(only)", "fine_1": "0", "dry": "dry"}
    assert all(row[0] == "7" for row in rows[1:])
    assert (w / "logs" / "ok.log").read_text() == "[ok] fine\nrandom:wan2.1-t2v-1.3b wan\n"
    lines = r.stdout.splitlines()
    assert re.fullmatch(r"\[\d+s\] ok rc=0: \[ok\] fine", lines[0])
    assert re.fullmatch(r"\[\d+s\] fails rc=3: error: nope", lines[1])
    assert re.fullmatch(r"\[\d+s\] dry \(limit \d+s\): wan w13 1gpu sdpa 0 1", lines[-1])
    assert not (w / "logs" / "late.log").exists() and not (w / "logs" / "not_chosen.log").exists()


@pytest.mark.slow
def test_a_tiny_render_through_the_runner_and_pack(tmp_path):
    """One real render on the CPU through r and wan (the tiny Wan model as W13_ARGS), then pack: the table script
    reads it and the archives hold the run's log and timing."""
    w, res, out = tmp_path / "w", tmp_path / "res", tmp_path / "o"
    script = f'''OUT={out} W={w} RES={res} CALL=1 LIMIT_S=300; source {LIB}; runs_init
r w13_1gpu_sdpa 5 240 wan w13 1gpu sdpa "" 1 --device cpu
pack'''
    r = bash(script, tmp_path, timeout=300,
             W13_ARGS="--model tiny --height 32 --width 48 --num_frames 5 --num_inference_steps 1 --time_attention")
    assert r.returncode == 0, r.stderr
    assert _runs(w)[1][:3] == ["1", "w13_1gpu_sdpa", "0"], (w / "logs" / "w13_1gpu_sdpa.log").read_text()[-2000:]
    assert (res / "w13" / "1gpu" / "sdpa" / "results" / "timing.json").exists()
    with tarfile.open(out / "results_1.tgz") as t:
        assert {"./runs.tsv", "./logs/w13_1gpu_sdpa.log", "./summary_parallel.txt"} <= set(t.getnames())
    with tarfile.open(out / "timing_1.tgz") as t:
        assert t.getnames() == ["./w13/1gpu/sdpa/results/timing.json"]
    assert (out / "summary_1.txt").read_text().startswith("call\trun\trc\twall_s\n1\tw13_1gpu_sdpa\t0\t")


@pytest.mark.parametrize("script,runs", [("gpu_x8.sh", 15), ("gpu_x4b.sh", 15)])
def test_multi_gpu_scripts_dry_run(tmp_path, script, runs):
    """CALL=2 of the 8- and 4-GPU scripts with DRY_RUN=1: every run listed (none started), the GPU record written,
    the results packed -- the whole script's plumbing on a CPU."""
    w, out = tmp_path / "w", tmp_path / "o"
    r = subprocess.run(["bash", str(ROOT / "bench" / script)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PY=sys.executable, DRY_RUN="1", CALL="2", OUT=str(out),
                                             W=str(w), RES=str(tmp_path / "res")))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = _runs(w)[1:]
    assert len(rows) == runs and {row[2] for row in rows} == {"dry"}, rows
    assert any("vae_parallel" in row[1] for row in rows)
    assert '"torch"' in (w / "gpu_2.txt").read_text()  # vdbench.timing.system_info's record
    assert (out / "results_2.tgz").exists() and (out / "summary_2.txt").exists()
    assert "call 2 done" in r.stdout
