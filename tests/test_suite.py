"""bench/suite.py: suites as data, run under one budget, resumable, dry-runnable, every run a record. Every
shipped suite dry-runs on a CPU here and each command it would run parses with its tool's own parser; a toy suite
of short Python commands exercises the runner itself (budget, resume, --only, timeouts, failures, fresh caches)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from vdbench import cli
from vdbench.measure.record import read

ROOT = Path(__file__).resolve().parents[1]


def _module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _module("suite")


@pytest.mark.parametrize("name", sorted(S.suites()))
def test_every_shipped_suite_dry_runs_and_its_commands_parse(name, tmp_path, capsys):
    spec = S.load(name)
    assert spec.get("description", "").strip(), name
    outcomes = S.run_suite(name, out=tmp_path, budget_s=10_000, sets={}, dry_run=True, log=lambda *a: None)
    assert outcomes and all(o.get("dry") for o in outcomes)
    assert not (tmp_path / "runs.jsonl").exists()  # a dry run records nothing
    for run in S.expand(spec, {}, tmp_path, sys.executable):
        argv = run["args"]
        assert argv[0] == sys.executable and (ROOT / argv[1]).is_file(), run["name"]
        tool, args = Path(argv[1]).name, argv[2:]
        if tool == "run_wan.py":
            assert cli.main("wan", [*args, "--print_output_path"]) == 0, run["name"]
        elif tool in ("bench_attention.py",):
            _module(tool[:-3]).build_parser().parse_args(args)
        elif tool == "cold_decode.py":
            mod = _module("cold_decode")
            variants = args[args.index("--variants") + 1].split(",")
            assert set(variants) <= set(mod.VARIANTS), run["name"]
    capsys.readouterr()


def _toy(tmp_path, monkeypatch, cases: str, vars_: str = ""):
    suites = tmp_path / "suites"
    suites.mkdir(exist_ok=True)
    (suites / "toy.toml").write_text(f'description = "a toy"\n[vars]\n{vars_}\n{cases}')
    monkeypatch.setattr(S, "SUITES", suites)
    return tmp_path / "out"


def _case(name, code, **kw):
    def toml(v):
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)
    extra = "".join(f"{k} = {toml(v)}\n" for k, v in kw.items())
    return f'[[case]]\nname = "{name}"\nrun = ["{{py}}", "-c", {json.dumps(code)}]\n{extra}'


def test_runs_are_recorded_resumed_and_cut_by_the_budget(tmp_path, monkeypatch):
    out = _toy(tmp_path, monkeypatch,
               _case("ok_{i}", "print('hello {i}')", **{"for": {"i": "1..{N}"}}) + _case("fails", "raise SystemExit(3)")
               + _case("slow", "import time; time.sleep(30)", limit_s=1) + _case("big", "pass", need_s=10_000),
               vars_="N = 2")
    got = S.run_suite("toy", out=out, budget_s=120, sets={}, log=lambda *a: None)
    by = {o["name"]: o for o in got}
    assert [o["name"] for o in got] == ["ok_1", "ok_2", "fails", "slow", "big"]
    assert by["ok_1"]["rc"] == 0 and by["fails"]["rc"] == 3 and by["slow"]["rc"] == 124
    assert by["big"]["skipped"].startswith("deadline")
    assert (out / "logs" / "ok_2.log").read_text().strip() == "hello 2"
    recs = {r.case: r for r in read(out / "runs.jsonl")}
    assert recs["ok_1"].suite == "toy" and recs["ok_1"].data["rc"] == 0 and recs["ok_1"].figures["wall_s"] >= 0
    assert recs["ok_1"].command.endswith("\"print('hello 1')\"") or "hello 1" in recs["ok_1"].command
    assert recs["big"].data == {"rc": None, "skipped": recs["big"].data["skipped"]}
    # a second call resumes: what ended with rc 0 is skipped, the rest runs again; --set overrides a var
    again = S.run_suite("toy", out=out, budget_s=120, sets={"N": "3"}, only="ok_.*|fails", log=lambda *a: None)
    assert {o["name"]: ("skipped" in o) for o in again} == {"ok_1": True, "ok_2": True, "ok_3": False,
                                                          "fails": False, "slow": True, "big": True}


def test_fresh_caches_get_new_empty_folders_and_the_checkout_leads_pythonpath(tmp_path, monkeypatch):
    code = ("import os, sys, vdbench; d = os.environ['TRITON_CACHE_DIR']; "
            "print(os.path.isdir(d) and not os.listdir(d), os.environ['PYTHONUNBUFFERED'], vdbench.__file__)")
    out = _toy(tmp_path, monkeypatch, _case("cold", code, fresh_caches=True))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    (got,) = S.run_suite("toy", out=out, budget_s=60, sets={}, log=lambda *a: None)
    assert got["rc"] == 0
    empty, unbuffered, where = (out / "logs" / "cold.log").read_text().split()
    assert empty == "True" and unbuffered == "1" and where == str(ROOT / "vdbench" / "__init__.py")


def test_bad_suites_are_refused_with_the_reason(tmp_path, monkeypatch):
    out = _toy(tmp_path, monkeypatch, _case("x_{nope}", "pass"))
    with pytest.raises(S.SuiteError, match="unknown name {nope}"):
        S.run_suite("toy", out=out, budget_s=10, sets={}, dry_run=True)
    _toy(tmp_path, monkeypatch, _case("same", "pass") + _case("same", "pass"))
    with pytest.raises(S.SuiteError, match="two runs named 'same'"):
        S.run_suite("toy", out=out, budget_s=10, sets={}, dry_run=True)
    with pytest.raises(S.SuiteError, match="unknown suite 'nothere'"):
        S.load("nothere")
    assert S.main(["nothere"]) == 2
    with pytest.raises(S.SuiteError, match="NAME=VALUE"):
        S._sets(["oops"])


def test_the_index_lists_every_run_folder(tmp_path, monkeypatch):
    out = _toy(tmp_path, monkeypatch, _case("a", "pass") + _case("b", "raise SystemExit(1)"))
    results = tmp_path / "results"
    S.run_suite("toy", out=results / "toy" / "20261126_cpu", budget_s=60, sets={}, log=lambda *a: None)
    text = (results / "index.md").read_text()
    assert "| toy | [20261126_cpu](toy/20261126_cpu/) | 1 | 0 | 1 |" in text
    assert os.path.exists(out.parent)
