"""The sweep's stage before the renders kept short: the capture render and the kernel bench beside the 1-GPU
renders (``--bench_beside``), bounded by a share of the budget, or skipped where the backends are named
(``--layout_backends fav3``) -- what is rendered, said and counted stays what it was; and the stage needs nothing
of the checkout but the package."""

import json
import os
import sys
from pathlib import Path

import pytest

from vdbench import sweep as S


def _avail(name, runs=True, emulated=False):
    return {"backend": name, "runs": runs, "why_not": None if runs else "needs a CUDA GPU", "emulated": emulated}


def test_layout_backends_are_a_count_or_names():
    avail = [_avail("default"), _avail("reference"), _avail("sdpa"), _avail("fav3", runs=False),
             _avail("sagev1_emu", emulated=True)]
    assert S.parse_layout_backends(["2"], avail) == (2, [])
    n, named = S.parse_layout_backends(["sdpa", "native"], avail)  # an alias: one backend, named once
    assert n == 1 and [(c.name, c.attention, c.flags, c.nproc) for c in named] == [("sdpa", "sdpa", [], 1)]
    for bad, says in ((["2", "sdpa"], "one count or backend names"), (["fav3"], "can't run here: needs a CUDA"),
                      (["sagev1_emu"], "an emulation"), (["default"], "rendered on one GPU anyway"),
                      (["sdpa+compile"], "a stack's options go to --stacks")):
        with pytest.raises(ValueError, match=says):
            S.parse_layout_backends(bad, avail)


def test_the_bench_goes_beside_the_renders_on_a_gpu_they_dont_use():
    four = ["0", "1", "2", "3"]
    assert S.side_device("auto", "cuda", four) == ("cuda", {"CUDA_VISIBLE_DEVICES": "3"})
    assert S.side_device("auto", "cuda:3", four) == ("cuda", {"CUDA_VISIBLE_DEVICES": "2"})  # not the renders' GPU
    assert S.side_device("auto", "cuda", ["4", "6"]) == ("cuda", {"CUDA_VISIBLE_DEVICES": "6"})  # ids as given
    assert S.side_device("off", "cuda", four) is None
    assert S.side_device("auto", "cuda", ["0"]) is None  # one GPU: before the renders, as it always was
    with pytest.raises(ValueError, match="needs a second GPU"):
        S.side_device("on", "cuda", ["0"])
    assert S.side_device("auto", "cpu", []) is None and S.side_device("on", "cpu", []) == ("cpu", {})


def test_without_a_kernel_bench_the_verdict_says_why_nothing_ranks_what_was_not_rendered():
    cov = S.Coverage(["fav3", "fav3+u4"], [], ["fav3", "fav3+u4"], no_bench="skipped: the backends are named")
    assert cov.of(lambda n: "+" in n).provisional() == "no kernel bench to rank them (skipped: the backends are named)"
    text = S.verdict([], device="H200", model="m", tolerance_db=0.5, coverage=cov)
    assert "0 of 2 candidates rendered (2 skipped for the budget): no measured verdict; no kernel bench" in text


def test_named_layout_backends_skip_the_capture_and_bench_and_a_budget_stop_is_no_failure(tmp_path, capsys):
    # a budget too short for anything: default's render is stopped at its end (no failure), the rest passed over;
    # the plan is the named backend on one GPU and in each layout of 2, each verdict saying what it rests on
    out = tmp_path / "sweep"
    assert S.main(["--model", "tiny", "--nproc", "2", "--layout_backends", "sdpa", "--budget_min", "0.005",
                   "--out", str(out)]) == 1  # nothing rendered
    log = capsys.readouterr().out
    assert "no capture render and no kernel bench: the backends are named (--layout_backends sdpa)" in log
    assert "rendering 6: default, sdpa, sdpa+cfg2, sdpa+u2, sdpa+r2, reference" in log
    assert not (out / "captures").exists() and not (out / "kernels").exists()
    meta = json.loads((out / "sweep.json").read_text())
    why = {x["backend"]: x["why"] for x in meta["left_out"]}
    assert why["default"].startswith("budget: stopped when the budget ran out") and "failed" not in str(why)
    one, two = meta["verdict"].split(" | ")
    assert "0 of 1 candidates rendered (1 skipped for the budget): no measured verdict; no kernel bench" in one
    assert "x2 for tiny: 0 of 3 candidates rendered (3 skipped" in two and "no kernel bench to rank them" in two
    assert meta["pre_render"]["kernel_bench"].startswith("skipped: the backends are named")
    progress = json.loads((out / "progress.json").read_text())
    assert progress["spent_s"] == pytest.approx(meta["elapsed_s"], abs=1.0) and progress["runs"] == 1


@pytest.mark.slow
def test_the_capture_and_kernel_bench_run_beside_default_and_the_run_resumes(tmp_path, capsys, monkeypatch,
                                                                                fork_python):
    monkeypatch.setattr(sys, "executable", fork_python)  # the renders and the bench forked (tests/launch.py)
    out = tmp_path / "sweep"
    args = ["--model", "tiny", "--steps", "2", "--max_candidates", "1", "--bench_beside", "on", "--budget_min", "10",
            "--out", str(out)]
    assert S.main(args) == 0
    log = capsys.readouterr().out
    assert "capture render and kernel bench (no new input of a benched shape after 90 s) on cpu, beside the " \
        "1-GPU renders" in log
    assert "(on cpu, beside default)" in log
    # beside: default's render ended while the capture + bench still ran (one after the other, it would start
    # only after the bench's log was closed)
    logs = out / "logs"
    assert os.path.getmtime(logs / "default.log") < os.path.getmtime(logs / "kernels.log"), log
    assert log.index("[sweep] default: rendered") < log.index("[sweep] rendering 3: default, ")
    meta = json.loads((out / "sweep.json").read_text())
    # one candidate (--max_candidates 1): the kernel bench's first, whichever kernel that is (CPU timings are noise)
    candidates = {r["stack"] for r in meta["rows"]} - {"default", "reference"}
    assert len(candidates) == 1 and {r["stack"] for r in meta["rows"]} >= {"default", "reference"}
    assert candidates == {meta["coverage"]["predicted"][0][0]} == set(meta["coverage"]["rendered"])
    assert meta["pre_render"]["beside"] == "cpu" and meta["pre_render"]["kernel_bench_s"] > 0
    assert "provisional" not in meta["verdict"] and meta["verdict"].startswith("on this CPU for tiny: ")
    assert S.main(args) == 0  # resumed: nothing again, the bench's figures read back
    log = capsys.readouterr().out
    assert log.count("done earlier (records read back)") == 3 and "kernel bench" not in log.split("rendering")[0]
    again = json.loads((out / "sweep.json").read_text())
    assert again["runs"] == 2 and again["elapsed_s"] > meta["elapsed_s"] and "capture_s" not in again["pre_render"]


# What runs in a Python process that sees only a copy of the package (no checkout on its path, another folder as
# its working directory): the sweep's capture-and-bench stage, its capture render's captures already there, the
# kernel bench run for real by the stage's own runner.
_INSTALLED = r"""
import argparse, json, sys
from pathlib import Path

import vdbench
from vdbench import families
from vdbench.sweep import stages as S

out, site = Path(sys.argv[1]), Path(sys.argv[2])
assert Path(vdbench.__file__).resolve().is_relative_to(site.resolve()), vdbench.__file__
args = argparse.Namespace(model="tiny", height=64, width=96, num_frames=9, steps=4, seed=42, device="cpu",
                          max_captures=8, kernel_budget_s=0.05)
ran = []


def runner(cmd, log, left_s, env=None):
    ran.append(cmd)
    if "vdbench.cli" in " ".join(cmd):  # the capture render: its captures are in place already
        return 0
    return S.run_job(cmd, log, left_s, env)


got = S.capture_and_bench(S.Context(args, out, families.get("wan"), "CPU"),
                          [{"backend": "sdpa", "runs": True, "emulated": False}], device="cpu", env=None,
                          kernel_max_s=0, left=lambda: 240.0, runner=runner)
print(json.dumps({"got": got, "ran": ran, "path": sys.path}))
"""


def test_the_kernel_bench_stage_runs_from_the_package_alone(tmp_path):
    """The sweep needs no file of the checkout (bench/ included): a copy of vdbench/ alone on the path, as
    ``pip install .`` leaves it, runs the stage that captures and benches the kernels."""
    import shutil
    import subprocess

    import torch

    root = Path(__file__).resolve().parents[1]
    site = tmp_path / "site"
    shutil.copytree(root / "vdbench", site / "vdbench", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "sweep"
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
        (out / "captures").mkdir(parents=True, exist_ok=True)
        torch.save({"q": q, "k": k, "v": v, "meta": {"layout": "BHSD"}}, out / "captures" / f"attn_s_rank0_{i:06d}.pt")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", _INSTALLED, str(out), str(site)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.splitlines()[-1])
    assert str(root) not in res["path"] and res["got"]["kernel_bench_s"] > 0, res
    assert "error" not in res["got"] and "warning" not in res["got"], (out / "logs" / "kernels.log").read_text()
    assert [c[1:3] for c in res["ran"]] == [["-c", "import sys; from vdbench.cli import main; "
                                                   "sys.exit(main(sys.argv[1], sys.argv[2:]))"],
                                            ["-m", "vdbench.kernel_bench"]]
    assert not any("bench/" in a or a.endswith(".py") for cmd in res["ran"] for a in cmd), res["ran"]
    rows = json.loads((out / "kernels" / "attention.json").read_text())["rows"]
    assert {(r["input"], r["kernel"], r["status"]) for r in rows} >= {("attn_s_rank0_000000.pt", "sdpa", "ok")}
