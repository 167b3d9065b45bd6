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
    """bench/NAME.py or bench/lab/NAME.py, loaded once (registered first: dataclasses resolve string annotations
    through sys.modules)."""
    key = f"_bench_{name}"
    if key not in sys.modules:
        path = ROOT / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path if path.exists() else ROOT / "bench" / "lab" / path.name)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


S = _module("suite")


class _Parsed(Exception):
    pass


def parse_with_tool(tool: str, args: list[str], monkeypatch):
    """``args`` through the tool's own argparse parser, nothing run: main() stops as its parser returns."""
    import argparse

    real = argparse.ArgumentParser.parse_args

    def parse(self, argv=None, namespace=None):
        raise _Parsed(real(self, argv, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse)
        with pytest.raises(_Parsed) as got:
            _module(tool[:-3]).main(args)
    return got.value.args[0]


def check_command(argv: list[str], name: str, monkeypatch):
    """One suite command, checked as far as a CPU can: the tool exists and takes its arguments."""
    if argv[0] == "bash":  # a render script: it parses, and the render it runs is run_wan.py's
        import subprocess

        assert argv[1] in ("render_all_WAN.sh", "render_all_attention.sh") and (ROOT / argv[1]).is_file(), name
        assert subprocess.run(["bash", "-n", str(ROOT / argv[1])]).returncode == 0, name
        if "--" in argv:
            check_command([sys.executable, "run_wan.py", *argv[argv.index("--") + 1:], "--attention_type", "sdpa"],
                          name, monkeypatch)
        return None
    assert argv[0] == sys.executable, name
    if argv[1] == "-c":  # inline Python: it compiles
        compile(argv[2], name, "exec")
        return None
    if argv[1:3] == ["-m", "pytest"]:
        assert all((ROOT / a).is_file() for a in argv[3:] if a.startswith("tests/")), name
        return None
    if argv[1:3] == ["-m", "vdbench.report"]:
        from vdbench import report

        return report.build_parser().parse_args(argv[3:])
    if argv[1:3] == ["-m", "torch.distributed.run"]:
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))  # torchrun's own flags come before it
        argv = [argv[0], *argv[script:]]
    assert (ROOT / argv[1]).is_file(), name
    tool, args = Path(argv[1]).name, argv[2:]
    if tool in ("run_wan.py", "sageattn_cogvideo.py"):
        family = "wan" if tool == "run_wan.py" else "cogvideox"
        if "--list_backends" in args:
            return cli.build_parser(cli.families.get(family)).parse_args(args)
        assert cli.main(family, [*args, "--print_output_path"]) == 0, name
        return None
    if tool == "cold_decode.py":
        from vdbench.vae_bench import cold as mod

        variants = args[args.index("--variants") + 1].split(",")
        assert set(variants) <= set(mod.VARIANTS), name
        return None
    if tool == "bench_vae.py":
        from vdbench.vae_bench import cli as mod

        parsed = mod.build_parser().parse_args(args)
        for c in parsed.configs.split(","):
            mod.parse_config(c)
        return parsed
    if tool == "bench_attention.py":  # the command line of vdbench.kernel_bench
        from vdbench import kernel_bench

        return kernel_bench.build_parser().parse_args(args)
    if tool == "vae_summary.py":
        return _module(tool[:-3]).build_parser().parse_args(args)
    if tool == "suite.py":  # another suite: it exists, takes the --set names it is given, and dry-runs so
        parsed = parse_with_tool(tool, args, monkeypatch)
        spec = S.load(parsed.suite)
        assert set(S._sets(parsed.set)) <= set(spec.get("vars") or {}), name
        S.run_suite(parsed.suite, out=parsed.out, budget_s=parsed.budget_s, sets=S._sets(parsed.set),
                    only=parsed.only, dry_run=True, log=lambda *a: None)
        return parsed
    if tool == "sweep.py":
        from vdbench import sweep

        parsed = sweep.build_parser().parse_args(args)
        for st in parsed.stacks:
            sweep.parse_stack(st)
        return parsed
    if tool == "parallel_overhead.py":
        return _module("parallel_overhead").parse(args)
    if tool == "ulysses_model.py":
        return _module(tool[:-3]).build_parser().parse_args(args)
    if tool == "gpu_kernels.py":  # the command line of vdbench.kernel_tune
        from vdbench import kernel_tune

        return kernel_tune.build_parser().parse_args(args)
    if tool in ("bench_fp8.py", "bench_sage2.py", "compare_outputs.py", "window_mass.py", "patch_overhead.py",
                "parallel_summary.py", "bench_vae_parallel.py", "check_fp8_error.py", "ulysses_micro.py", "trace_gaps.py",
                "gpu_monitor.py", "sync_points.py", "rope_bench.py", "block_bench.py", "vae_conv_shapes.py",
                "vae_decode_shapes.py", "vae_glue_configs.py"):
        return parse_with_tool(tool, args, monkeypatch)
    raise AssertionError(f"{name}: no parser check for {tool}: add one here")


@pytest.mark.parametrize("name", sorted(S.suites()))
def test_every_shipped_suite_dry_runs_and_its_commands_parse(name, tmp_path, capsys, monkeypatch):
    spec = S.load(name)
    assert spec.get("description", "").strip(), name
    outcomes = S.run_suite(name, out=tmp_path, budget_s=10_000, sets={}, dry_run=True, log=lambda *a: None)
    assert outcomes and all(o.get("dry") or o.get("skipped") == "not in --only" for o in outcomes)
    assert not (tmp_path / "runs.jsonl").exists()  # a dry run records nothing
    for run in S.expand(spec, {}, tmp_path, sys.executable):
        image = _option(run["args"], "--img_file_path")
        if image and Path(image).is_relative_to(tmp_path) and not Path(image).exists():  # an earlier run's output
            from PIL import Image

            Image.new("RGB", (64, 64)).save(image)
        args = [_calibrated(a, tmp_path) for a in run["args"]]
        check_command(S._limit_filled(args, run["limit_s"]), run["name"], monkeypatch)
    capsys.readouterr()


def _calibrated(arg: str, tmp_path: Path) -> str:
    """A ``mag:mag_ratios=@PATH`` read from an earlier run's timing.json (a MagCache calibration): a stand-in file
    with a calibration where that run has not written one, so the command's own checks still run."""
    head, sep, path = arg.partition("mag_ratios=@")
    if not sep or Path(path.split(",")[0]).exists():
        return arg
    stand_in = tmp_path / "calibration_timing.json"
    stand_in.write_text(json.dumps([{"cache": {"calibration": {"ratios": [[1.0, 0.98, 0.97]]}}}]))
    rest = path.partition(",")
    return f"{head}{sep}{stand_in}{rest[1]}{rest[2]}"


def _option(argv: list[str], flag: str, default=None):
    """The last value of ``flag`` in ``argv`` (argparse's rule for a repeated store option)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return values[-1] if values else default


def test_the_sparse_suite_runs_in_an_order_that_works(tmp_path, capsys):
    """What a device call relies on rather than run names: the CUDA tests come first and a kernel bench before the
    first render; every backend, schedule and pattern is one the registry takes; a comparison or a window-mass run
    comes after the render or capture it reads."""
    from vdbench import backends as B
    from vdbench.patching.schedule import resolve_attention
    from vdbench.sparse import parse_spec, split_attention_types

    runs = S.expand(S.load("sparse"), {}, tmp_path, sys.executable)
    assert runs[0]["args"][1:3] == ["-m", "pytest"]  # the CUDA tests first
    assert all(r["need_s"] <= r["limit_s"] for r in runs)
    from vdbench import kernel_bench as bench_attention

    rendered: list[tuple[str, str]] = []  # (output folder, canonical attention) of each render so far
    captured: set[str] = set()
    first_kernel_bench = first_render = None
    for i, run in enumerate(runs):
        name, argv = run["name"], run["args"]
        which, args = Path(argv[1]).name, argv[2:]
        if which == "run_wan.py" and "--list_backends" not in args:
            first_render = i if first_render is None else first_render
            attention = _option(args, "--attention_schedule") or _option(args, "--attention_type")
            rendered.append((_option(args, "--benchmark_output_directory"), resolve_attention(attention).name))
            if "--save_inputs" in args:
                captured.add(_option(args, "--input_dir"))
        elif which == "bench_attention.py":
            first_kernel_bench = i if first_kernel_bench is None else first_kernel_bench
            parsed = bench_attention.build_parser().parse_args(args)
            kernels = [B.resolve(k).name for k in split_attention_types(parsed.kernel)]
            assert parsed.baseline is None or B.resolve(parsed.baseline).name in kernels, name
        elif which == "compare_outputs.py":
            ref = _option(args, "--reference")
            folder = str(Path(_option(args, "--reference_dir") or args[0]).parent)
            assert (folder, B.resolve(ref).name) in rendered, f"{name} compares with a render not made before it"
        elif which == "window_mass.py":
            assert args[0] in captured, f"{name} reads captures no earlier run saves"
            assert all(parse_spec(p) for p in [a for j, a in enumerate(args[1:]) if args[j] == "--pattern"]), name
    assert first_kernel_bench is not None and first_render is not None and first_kernel_bench < first_render
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


def test_lists_in_vars_names_limits_optional_and_always_runs(tmp_path, monkeypatch):
    """A 'for' string is a range or words (a var can hold a list; none when empty); vars name vars; a run's name
    spells odd characters _; {limit_s-N} is the run's limit less N; an optional run needs --only to name it; an
    always run is run by every call, --only or not, done or not; the suite's budget_s is the default budget."""
    out = _toy(tmp_path, monkeypatch,
               'budget_s = 77\n' + _case("b_{b}", "print('{b} {W}')", **{"for": {"b": "{BS}"}})
               + _case("none_{s}", "pass", **{"for": {"s": "{EMPTY}"}})
               + _case("lim", "print('{limit_s} {limit_s-7}')", limit_s=30)
               + _case("opt", "print('opt')", optional=True) + _case("sum", "print('sum')", always=True),
               vars_='BS = "x:1 y=2"\nEMPTY = ""\nV = "v"\nW = "w{V}"')
    got = S.run_suite("toy", out=out, budget_s=None, sets={}, log=lambda *a: None)
    assert [(o["name"], o.get("rc"), o.get("skipped")) for o in got] == [
        ("b_x_1", 0, None), ("b_y_2", 0, None), ("lim", 0, None), ("opt", None, "not in --only"), ("sum", 0, None)]
    assert (out / "logs" / "b_x_1.log").read_text().split() == ["x:1", "wv"]
    assert (out / "logs" / "lim.log").read_text().split() == ["30", "23"]
    assert "30 23" in {r.case: r for r in read(out / "runs.jsonl")}["lim"].command  # the record has what ran
    assert "torch" in json.loads((out / "system.json").read_text())  # each call records the system
    again = S.run_suite("toy", out=out, budget_s=None, sets={}, only="opt", log=lambda *a: None)
    assert {o["name"]: o.get("rc") for o in again if "rc" in o} == {"opt": 0, "sum": 0}
    budgets = []
    monkeypatch.setattr(S, "run_suite", lambda name, **kw: budgets.append(kw["budget_s"]) or [])
    S.main(["toy", "--dry_run", "--out", str(out)])
    assert budgets == [None]  # main leaves the default to the suite file


def test_env_if_exists_and_collect(tmp_path, monkeypatch):
    """env_if_exists sets a variable to a file only once that file exists and is not empty (an inherited value is
    dropped otherwise); [collect] copies what exists after each run, so a later run (a summary) reads it."""
    src = tmp_path / "res" / "timing.json"
    code_env = "import os; print(os.environ.get('CFG', 'unset'))"
    write = f"import pathlib; p = pathlib.Path({str(src)!r}); p.parent.mkdir(parents=True, exist_ok=True); p.write_text('[1]')"
    read_back = "import pathlib, sys; print(pathlib.Path(sys.argv[1]).read_text())"
    out = _toy(tmp_path, monkeypatch,
               _case("before", code_env, env_if_exists={"CFG": "{out}/best.json"})
               + _case("makes", f"import pathlib; pathlib.Path({str(tmp_path / 'out' / 'best.json')!r}).write_text('x'); {write}")
               + _case("after", code_env, env_if_exists={"CFG": "{out}/best.json"})
               + '[[case]]\nname = "reads"\nrun = ["{py}", "-c", ' + json.dumps(read_back) + ', "{out}/kept.json"]\n'
               + '[collect]\n"{out}/kept.json" = "{RES}/timing.json"\n"{out}/never.json" = "{RES}/nothere.json"\n',
               vars_=f'RES = "{tmp_path / "res"}"')
    monkeypatch.setenv("CFG", "inherited")
    got = S.run_suite("toy", out=out, budget_s=60, sets={}, log=lambda *a: None)
    assert [o["rc"] for o in got] == [0, 0, 0, 0]
    assert (out / "logs" / "before.log").read_text().strip() == "unset"
    assert (out / "logs" / "after.log").read_text().strip() == str(out / "best.json")
    assert (out / "logs" / "reads.log").read_text().strip() == "[1]"
    assert not (out / "never.json").exists()


def test_tracks_run_side_by_side_wait_deadlines_and_conditions(tmp_path, monkeypatch):
    """Runs of two tracks overlap, runs of one track don't; ``wait`` holds a run until the runs it names have ended;
    ``deadline_s`` cuts a run's limit and skips what can't start before it; ``if_ok`` / ``if_failed`` pick the run
    that follows an earlier one's outcome."""
    stamp = ("import pathlib, sys, time; t0 = time.time(); time.sleep(float(sys.argv[1])); "
             "pathlib.Path(sys.argv[2]).write_text(str(t0) + ' ' + str(time.time()))")

    def timed(name, secs, **kw):
        return (f'[[case]]\nname = "{name}"\nrun = ["{{py}}", "-c", {json.dumps(stamp)}, "{secs}", "{{out}}/{name}.t"]\n'
                + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kw.items()))

    out = _toy(tmp_path, monkeypatch,
               timed("a1", 1.5, track="a") + timed("a2", 0.2, track="a") + timed("b1", 1.5, track="b")
               + timed("after", 0.1, wait=True) + _case("cut", "print('{limit_s}')", deadline_s=60, limit_s=5000)
               + _case("late", "pass", deadline_s=1, need_s=5)
               + _case("fails", "raise SystemExit(1)") + _case("if_ok", "pass", if_ok="fails")
               + _case("if_failed", "pass", if_failed="fails"))
    got = {o["name"]: o for o in S.run_suite("toy", out=out, budget_s=120, sets={}, log=lambda *a: None)}
    span = {n: tuple(map(float, (out / f"{n}.t").read_text().split())) for n in ("a1", "a2", "b1", "after")}
    assert span["b1"][0] < span["a1"][1] and span["a1"][0] < span["b1"][1]  # tracks a and b overlap
    assert span["a2"][0] >= span["a1"][1]  # a track runs in order
    assert span["after"][0] >= max(span["a2"][1], span["b1"][1])  # wait = true: after every earlier run
    assert 50 <= int((out / "logs" / "cut.log").read_text()) <= 60
    assert got["late"]["skipped"].startswith("deadline")
    assert got["if_ok"]["skipped"].startswith("if_ok fails") and got["if_failed"]["rc"] == 0
    # a dry run lists both branches, in the file's order
    lines = []
    S.run_suite("toy", out=tmp_path / "dry", budget_s=120, sets={}, dry_run=True, log=lines.append)
    assert [ln.split("] ")[1].split(" (")[0] for ln in lines] == [
        "a1", "a2", "b1", "after", "cut", "fails", "if_ok", "if_failed"]
    assert "track a" in lines[0] and "if_failed fails" in lines[-1]
    _toy(tmp_path, monkeypatch, _case("x", "pass", if_ok="y") + _case("y", "pass"))
    with pytest.raises(S.SuiteError, match="not an earlier run"):
        S.run_suite("toy", out=out, budget_s=10, sets={}, dry_run=True)


@pytest.mark.parametrize("name,runs", [("x8_8gpu", 17), ("x4b_4gpu", 17), ("x8", 28), ("x4b", 30)])
def test_the_multi_gpu_campaigns_dry_run(name, runs, tmp_path):
    """The 4- and 8-GPU campaigns on a CPU: every run listed (none started), each torchrun over as many ranks as the
    degrees it asks for and on GPUs of its own while another track runs; the table last."""
    import re

    lines = []
    got = S.run_suite(name, out=tmp_path, budget_s=None, sets={}, dry_run=True, log=lines.append)
    assert len([o for o in got if o.get("dry")]) == runs and not (tmp_path / "runs.jsonl").exists()
    runs_ = [r for r in S.expand(S.load(name), {}, tmp_path, sys.executable) if not r["optional"]]
    assert runs_[-1]["name"] == "summary" and runs_[-1]["always"] and runs_[0]["name"] == "topology"
    for r in runs_:
        a = " ".join(r["args"])
        m = re.search(r"--nproc_per_node=(\d+)", a)
        if m and "run_wan.py" in a:
            u, g = (int(x.group(1)) if x else 1 for x in (re.search(r"--ulysses_degree (\d+)", a),
                                                          re.search(r"--ring_degree (\d+)", a)))
            assert u * g == int(m.group(1)), r["name"]
        gpus = r["env"].get("CUDA_VISIBLE_DEVICES")
        if m and gpus:
            assert len(gpus.split(",")) == int(m.group(1)), r["name"]
    by_track: dict = {}
    deps = S.dependencies(runs_)
    for i, r in enumerate(runs_):  # runs that may overlap (neither waits for the other) use different GPUs
        for j in range(i):
            if r["env"].get("CUDA_VISIBLE_DEVICES") and runs_[j]["env"].get("CUDA_VISIBLE_DEVICES"):
                if not _waits(deps, i, j):
                    mine = set(r["env"]["CUDA_VISIBLE_DEVICES"].split(","))
                    assert not mine & set(runs_[j]["env"]["CUDA_VISIBLE_DEVICES"].split(",")), (r["name"], runs_[j]["name"])
        by_track.setdefault(r["track"], []).append(r["name"])
    assert any("vae" in n for names in by_track.values() for n in names)


def _waits(deps, i, j) -> bool:
    """Whether run i starts only after run j ended (through any chain of dependencies)."""
    todo, seen = list(deps[i]), set()
    while todo:
        k = todo.pop()
        if k == j:
            return True
        if k not in seen:
            seen.add(k)
            todo.extend(deps[k])
    return False


def _env_without_the_checkout():
    """This Python's environment with nothing on PYTHONPATH: a script run by path finds vdbench as installed and
    its sibling bench modules from its own folder, as a user's ``python3 bench/suite.py`` does."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.parametrize("argv", [["bench/suite.py", "--list"], ["bench/bench_vae.py", "--help"],
                                  ["bench/lab/check_fp8_error.py", "--help"]])
def test_bench_scripts_run_by_path_with_no_path_edits(argv):
    import subprocess

    p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env_without_the_checkout(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() and "Traceback" not in p.stderr, p.stderr


def test_suite_outside_the_environment_says_so_in_one_line():
    """A Python without the project's packages (-S: no site-packages, so no vdbench): one line and the hint."""
    import re
    import subprocess

    p = subprocess.run([sys.executable, "-S", "bench/suite.py", "--list"], cwd=ROOT, env=_env_without_the_checkout(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == "" and len(p.stderr.splitlines()) == 1
    assert re.fullmatch(r"error: bench/suite\.py runs in the project's environment \(No module named "
                        r"'(vdbench|tomllib)'.*\): source \.venv/bin/activate \(make setup creates it\)\n", p.stderr)
