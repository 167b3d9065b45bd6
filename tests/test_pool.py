"""The GPU pool (vdbench.pool) with stand-in jobs (a few lines of Python each), the prompt and seed sets
(vdbench.sets), and timing.json under many writers at once."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vdbench import sets
from vdbench.pool import TIMED_OUT, Job, Pool, Rendezvous, launcher, parse_gpus

ROOT = Path(__file__).resolve().parents[1]

# a stand-in render: a step line, then sleeps, says what it saw and exits with the code asked for
JOB = ("import os, sys, time; print('[x] step 1/2: 0.1 s, ETA 0:00', flush=True); print('noise', flush=True); "
       "t0 = time.time(); time.sleep(float(sys.argv[1])); "
       "print('seen', os.environ.get('CUDA_VISIBLE_DEVICES'), t0, time.time(), flush=True); sys.exit(int(sys.argv[2]))")


def _job(tmp_path, name, sleep=0.6, code=0, **kw):
    return Job(name, ["-c", JOB, str(sleep), str(code)], tmp_path / f"{name}.log", **kw)


def _seen(job):
    words = job.log.read_text().split("seen ")[1].split()
    return words[0], float(words[1]), float(words[2])


def test_jobs_run_side_by_side_each_on_its_gpus_and_a_failure_loses_only_itself(tmp_path):
    shown = []
    pool = Pool(["0", "1", "2", "3"], show=shown.append)
    jobs = [_job(tmp_path, f"j{i}", code=3 if i == 1 else 0, tag=f"p{i}") for i in range(4)]
    done = {d.job.name: d for d in pool.run(jobs)}
    assert {n: d.code for n, d in done.items()} == {"j0": 0, "j1": 3, "j2": 0, "j3": 0}
    seen = {j.name: _seen(j) for j in jobs}
    assert sorted(g for g, _, _ in seen.values()) == ["0", "1", "2", "3"]  # one GPU each, its own
    assert max(t0 for _, t0, _ in seen.values()) < min(t1 for _, _, t1 in seen.values())  # all four at once
    # the step lines, each with its render's tag, nothing else; the log keeps every line
    assert sorted(shown) == [f"[x p{i}] step 1/2: 0.1 s, ETA 0:00" for i in range(4)]
    assert "noise" in jobs[0].log.read_text()


def test_a_cpu_pool_runs_jobs_at_once_and_stops_one_past_its_deadline(tmp_path):
    pool = Pool([], jobs=2)
    assert pool.describe() == "2 at once (no GPU)"
    jobs = [_job(tmp_path, "a", 0.8), _job(tmp_path, "b", 0.8), _job(tmp_path, "late", 30, timeout_s=0.5)]
    t = time.monotonic()
    done = {d.job.name: d for d in pool.run(jobs)}
    assert time.monotonic() - t < 20
    (_, a0, a1), (_, b0, b1) = _seen(jobs[0]), _seen(jobs[1])
    assert a0 < b1 and b0 < a1  # the two overlapped
    late = done["late"]
    assert late.code == TIMED_OUT and late.timed_out and late.stopped and late.seconds < 15


def test_wider_jobs_take_aligned_groups_and_a_held_gpu_is_left_out():
    pool = Pool(["0", "1", "2", "3"])
    assert pool.describe(2) == "2 at once on GPUs 0,1 | 2,3"
    pool.hold("3")
    assert pool.describe(1) == "3 at once on GPUs 0 | 1 | 2"
    assert pool._take(2) == [0, 1] and pool._take(2) is None  # 2 and 3: 3 held
    pool.release("3")
    assert pool._take(2) == [2, 3]
    assert parse_gpus("all", ["4", "6"]) == ["4", "6"] and parse_gpus("6", ["4", "6"]) == ["6"]
    for bad in ("1", "4,4", ","):
        with pytest.raises(ValueError):
            parse_gpus(bad, ["4", "6"])


def test_each_launch_has_its_own_rendezvous_and_multi_node_options_pass_through():
    one = Rendezvous()
    assert launcher("py", 1, one) == ["py"]
    assert launcher("py", 2, one, 0, 4242) == ["py", "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes",
                                               "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:4242",
                                               "--rdzv-id", "vdbench-4242"]
    two = Rendezvous(nnodes=2, node_rank=1, endpoint="head:29400", rdzv_id="job7")
    two.check()
    # render 3 of the batch: its own port and id on every machine; c10d assigns the machines' ranks itself
    assert launcher("py", 8, two, 3) == ["py", "-m", "torch.distributed.run", "--nproc_per_node=8", "--nnodes", "2",
                                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29403", "--rdzv-id",
                                         "job7-3"]
    static = Rendezvous(nnodes=2, node_rank=1, master_addr="head", master_port=29500)
    assert static.args(2, None) == ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
                                    "--master-addr", "head", "--master-port", "29502"]
    assert launcher("py", 1, two, 0)[:3] == ["py", "-m", "torch.distributed.run"]  # one process a machine: torchrun
    for bad, says in ((Rendezvous(node_rank=1), "add --nnodes"), (Rendezvous(nnodes=2, node_rank=2, endpoint="h:1"),
                                                                  "from 0 to"),
                      (Rendezvous(nnodes=2, endpoint="h"), "HOST:PORT"),
                      (Rendezvous(nnodes=2, endpoint="h:1", master_addr="h"), "not both")):
        with pytest.raises(ValueError, match=says):
            bad.check()
    pool = Pool([], jobs=3)
    assert len({pool._port() for _ in range(20)}) == 20  # never one port twice


_SIGNALLED = r"""
import json, sys
from pathlib import Path
from vdbench.pool import Job, Pool, Stopped
out = Path(sys.argv[1])
code = ("import os, time, pathlib; pathlib.Path(r'%s', str(os.getpid())).write_text('up'); "
        "print('[x] step 1/9: 1 s, ETA 0:09', flush=True); time.sleep(60)") % out
pool = Pool([], jobs=2, grace_s=5, show=print)
try:
    pool.run([Job(f"r{i}", ["-c", code], out / f"r{i}.log") for i in range(3)])
except Stopped as e:
    print("stopped", e.signum, flush=True)
    sys.exit(128 + e.signum)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_pool_stops_every_running_job(tmp_path, sig, checkout_env):
    proc = subprocess.Popen([sys.executable, "-c", _SIGNALLED, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=checkout_env)
    for _ in range(2):  # both running jobs have started
        assert proc.stdout.readline().startswith("[x] step 1/9")
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) == 2
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig and f"stopped {int(sig)}" in out
    for pid in pids:  # ended, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (tmp_path / "r2.log").exists()  # the third never started


def _append(path, who, n):
    from vdbench.timing import append_timing

    for i in range(n):
        append_timing(path, [{"writer": who, "i": i, "pad": "x" * 2000}])


def test_timing_json_keeps_every_entry_of_many_writers_at_once(tmp_path):
    path = tmp_path / "timing.json"
    ctx = multiprocessing.get_context("fork")  # the writers need no fresh interpreter
    procs = [ctx.Process(target=_append, args=(path, w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    entries = json.loads(path.read_text())
    assert sorted((e["writer"], e["i"]) for e in entries) == [(w, i) for w in range(4) for i in range(15)]
    assert not list(tmp_path.glob(".timing-*"))  # no temporary file left


def test_prompt_and_seed_sets(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("a cat\na dog on a bike\n")
    assert sets.read_prompts(p) == ["a cat", "a dog on a bike"]
    for text, says in (("", "the file is empty"), ("a\n\nb\n", "line 2 is blank"), ("  \n", "the file is empty")):
        p.write_text(text)
        with pytest.raises(ValueError, match=says):
            sets.read_prompts(p)
    with pytest.raises(ValueError, match="No such file"):
        sets.read_prompts(tmp_path / "missing.txt")
    assert sets.parse_seeds("1,2,3") == [1, 2, 3]
    for bad in ("1,x", "1,1", ""):
        with pytest.raises(ValueError):
            sets.parse_seeds(bad)
    c = sets.contents(["a", "b"], [1, 2])
    assert [(x.prompt, x.seed, x.tag) for x in c] == [("a", 1, "p1 seed1"), ("a", 2, "p1 seed2"),
                                                      ("b", 1, "p2 seed1"), ("b", 2, "p2 seed2")]
    assert c[3].args() == ["--prompt", "b", "--seed", "2"] and sets.contents(None, None)[0].tag == ""
    assert sets.parse_shard("1/3") == (1, 3) and sets.parse_shard(None) == (0, 1)
    for bad in ("3/3", "1", "a/b", "0/0"):
        with pytest.raises(ValueError):
            sets.parse_shard(bad)
    # 3 contents x 2 backends over 2 shards: each shard a share of both backends and of every content
    mine = [(c, b) for c in range(3) for b in range(2) if sets.in_shard(c, b, (1, 2))]
    assert mine == [(0, 1), (1, 0), (2, 1)]
    assert sets.spread([30.0, 32.0, None]) == {"mean": 31.0, "min": 30.0, "max": 32.0, "n": 2}
    assert sets.spread_text(sets.spread([30.0, 32.0])) == "31.0 dB (30.0–32.0, n=2)"
    assert sets.spread_text(sets.spread([float("inf")] * 3)) == "∞ dB (n=3)" and sets.spread([None]) is None
