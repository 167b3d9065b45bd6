"""bench/lab/parallel_overhead.py on a CPU: 2 gloo ranks under torchrun, the diffusers pair (bare context parallelism
and vdbench's render of it) side by side in one process group, on the tiny Wan model.

What is checked is the table and the plumbing, not the timing (CPU timings are not speed figures): every side has
its warm step by vdbench.timing's definition with n and spread, the overhead is computed against the bare side, the
vdbench side really ran the parallel path (its timing.json says Ulysses-2 over gloo and counts the kernel per
path), two vdbench renders ran in the one process group the bench made (render leaves a group it did not create up),
and xfuser, which can't run on a CPU, is a row with the reason.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
STEPS, ROUNDS = 3, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory, fork_python):
    if TORCHRUN is None:
        pytest.skip("torchrun not found beside the interpreter")
    out = tmp_path_factory.mktemp("overhead")
    # this checkout first on the path (torchrun's children import the vdbench under test), no torchrun variables
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # torchrun and its workers forked from this process (tests/launch.py PythonServer)
    cmd = [fork_python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "bench" / "lab" / "parallel_overhead.py"), "--model", "tiny", "--height", "64", "--width", "96",
           "--num_frames", "9", "--steps", str(STEPS), "--rounds", str(ROUNDS), "--backend", "sdpa",
           "--engines", "diffusers,xfuser", "--device", "cpu", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "parallel_overhead.json").read_text()), proc.stdout


def test_table_has_both_sides_with_the_warm_step_definition(result):
    _, res, stdout = result
    assert (res["backend"], res["world_size"], res["ring_degree"], res["steps"]) == ("sdpa", 2, 1, STEPS)
    row = next(r for r in res["rows"] if r["engine"] == "diffusers")
    assert row["status"] == "ok" and row["bare_how"] == "diffusers 'native'"  # diffusers' name of the same kernel
    assert set(row["sides"]) == {"bare", "vdbench"}
    for side, st in row["sides"].items():
        assert len(st["step_times"]) == ROUNDS and all(len(reps) == STEPS for reps in st["step_times"]), side
        assert st["warm_step_n"] == ROUNDS * (STEPS - 1) and st["repetitions"] == ROUNDS
        assert st["warm_step_p20"] <= st["warm_step_median"] <= st["warm_step_p80"]
        assert st["warm_step_min"] <= st["warm_step_p20"] and st["warm_step_p80"] <= st["warm_step_max"]
        assert st["speed_figure"] is False and "CPU" in st["why_not_speed"]
        assert st["line"].startswith("warm step ")
    b, v = row["sides"]["bare"]["warm_step_median"], row["sides"]["vdbench"]["warm_step_median"]
    assert row["overhead_pct"] == {"vdbench": pytest.approx((v / b - 1) * 100)}
    assert row["bare_p20_p80_pct"] >= 0 and row["speed_figure"] is False
    header = next(line for line in stdout.splitlines() if line.startswith("engine "))
    assert "warm ms" in header and "vs bare" in header
    assert any(line.startswith("diffusers  vdbench") and "%" in line for line in stdout.splitlines())
    assert "not speed figures: CPU timing" in stdout


def test_vdbench_side_ran_the_parallel_path_in_the_benchs_group(result):
    out, res, _ = result
    timings = sorted((out / "renders" / "diffusers" / "vdbench").glob("round*/results/timing.json"))
    assert len(timings) == ROUNDS  # the second render found the group the first left up
    for path in timings:
        entry = json.loads(path.read_text())[-1]
        assert entry["parallel"]["engine"] == "diffusers" and entry["parallel"]["label"] == "ulysses2"
        assert entry["parallel"]["pg_backend"] == "gloo" and [r["rank"] for r in entry["ranks"]] == [0, 1]
        # self-attention on vdbench's Ulysses (Q, K and V sent beside the projections) with vdbench's kernel,
        # cross-attention local: per rank STEPS x (cond + uncond) x 2 blocks of each, on 2 ranks
        calls = STEPS * 2 * 2 * 2
        assert entry["attention_all_ranks"]["calls_by_kernel"] == {"sdpa[flash]@ulysses2/async": calls,
                                                                   "sdpa[flash]": calls}
    # the table's vdbench step times are the merged (slowest-rank) ones rank 0 wrote
    merged = [json.loads(p.read_text())[-1]["step_times"] for p in timings]
    row = next(r for r in res["rows"] if r["engine"] == "diffusers")
    assert sorted(row["sides"]["vdbench"]["step_times"]) == sorted(merged)


def test_xfuser_on_a_cpu_is_a_row_with_the_reason(result):
    _, res, stdout = result
    row = next(r for r in res["rows"] if r["engine"] == "xfuser")
    assert row["status"].startswith("skipped: ") and "xfuser" in row["status"]
    assert "sides" not in row
    assert any(line.startswith("xfuser     skipped: ") for line in stdout.splitlines())


@pytest.mark.parametrize("only,runs", [(None, {"cudnn_timing": "diffusers,xfuser", "diffusers_profile": "diffusers"}),
                                       ("xfuser_profile|flash_timing",
                                        {"xfuser_profile": "xfuser", "flash_timing": "diffusers,xfuser"})])
def test_the_suite_dry_run_lists_its_bench_runs(tmp_path, only, runs):
    """python3 bench/suite.py parallel_overhead --dry_run (and the second call's --only): each call's torchrun runs of
    the bench at the real model size (none started), within the call's budget."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "suite.py"), "parallel_overhead", "--dry_run",
                           "--out", str(tmp_path / "o"), *(["--only", only] if only else [])],
                          cwd=tmp_path, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    listed = [ln.split("] ")[1].split(" (limit ")[0] for ln in proc.stdout.splitlines() if "(limit " in ln]
    assert listed == list(runs)
    for name, engines in runs.items():
        line = next(ln for ln in proc.stdout.splitlines() if f"] {name} (limit " in ln)
        assert "torch.distributed.run --standalone --nproc_per_node=2" in line and "bench/lab/parallel_overhead.py" in line
        assert "--height 480 --width 832 --num_frames 81" in line and f"--engines {engines} " in line
        assert int(line.split("(limit ")[1].split(" s")[0]) <= 330
