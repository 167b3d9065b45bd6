#!/usr/bin/env python3
"""Run a benchmark suite: cases described as data (``bench/suites/<name>.toml``), under one time budget,
resumable, dry-runnable, every run recorded.

    python3 bench/suite.py --list                                   # the suites and what each measures
    python3 bench/suite.py cold --dry_run                           # what it would run, in order (no GPU needed)
    python3 bench/suite.py cold --budget_s 540 --set N=3            # on the GPU machine: one device call
    python3 bench/suite.py cold --only 'r720_.*'                    # a later call: what the first one left

A suite file holds ``description``, ``budget_s`` (its default budget; 540 s unless set), ``[vars]`` (defaults; ``--set NAME=VALUE`` overrides, strings or numbers; a var may name an earlier one) and
``[[case]]`` entries: ``name``, ``run`` (the command: a list of arguments or one string split like a shell line;
``{NAME}`` takes a var, ``{py}`` the Python, ``{out}`` the results folder, ``{model.wan13}`` etc. the model
arguments of :data:`MODELS`), ``need_s`` (not started with fewer seconds left), ``limit_s`` (its own time limit,
cut to what is left; ``{limit_s}`` or ``{limit_s-N}`` in the command is that limit, or N seconds less, filled in
when the run starts: a bench's own deadline), ``fresh_caches`` (Triton / inductor caches pointed at new empty
folders: a cold start), ``env`` (extra variables), ``env_if_exists`` (``{VAR = "{out}/file"}``: VAR is the path
if that file exists and is not empty when the run starts, else unset: one run reading what an earlier one wrote),
``optional`` (run only when ``--only`` names it: a part for another call or machine), ``always`` (run by every
call, never skipped as done nor by ``--only``: a summary of what the calls so far wrote), and ``for``
(``{mode = ["default", "fast"], rep = "1..{N}"}``: one case per combination, the first key outermost; a later key
varies fastest, so runs of two modes interleave and drift falls on both; a string is a range ``A..B`` or words
split at spaces, so a var can hold a list: ``b = "{BACKENDS}"``, none when empty). A run's name keeps letters,
digits, ``_ . -`` and spells every other character ``_`` (it names the log). ``[collect]`` (``{"{out}/t.json" =
"{RES}/results/timing.json"}``) copies each source that exists to its destination after every run: what the
results folder keeps of renders written elsewhere, there for the runs after it.

Side by side (several GPUs of one machine): ``track`` names the lane a run goes in; the runs of one track run in
order, the tracks at once (e.g. one per GPU, each run with ``env = {CUDA_VISIBLE_DEVICES = "2"}``); runs without a
track are track ``main``. ``wait = true`` starts a run only once every earlier run has ended, ``wait =
["g0", "g1"]`` once the earlier runs of those tracks have. ``deadline_s`` (seconds after the call's start) ends a
run's window before the budget does: its limit is cut to it and ``need_s`` counts from it (a phase of a call).
``if_ok = "case"`` / ``if_failed = "case"`` run it only after that earlier run of this call ended with rc 0 / not 0
(a run done in an earlier call counts as ok; a dry run lists both).

Each call writes ``OUT/system.json`` (vdbench.timing.system_info: the GPU, the versions). Each run's log goes
to ``OUT/logs/<case>.log`` and its outcome to ``OUT/runs.jsonl`` as a
:mod:`vdbench.measure.record` (suite, case, the command, rc, wall seconds, skipped and why); a re-run skips the
cases already done with rc 0 (``--force`` runs them again). ``OUT`` defaults to
``results/<suite>/<UTC date>_<device>``; ``results/index.md`` lists every run folder (regenerated each time).
The environment is the device scripts': unbuffered Python, NVLink multicast off for NCCL and symmetric memory, 8
OpenMP threads unless set, Python's bytecode cached in one writable folder (``PYTHONPYCACHEPREFIX`` unless set), this
checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import threading
from pathlib import Path

try:
    import tomllib  # Python 3.11+

    from vdbench.measure.record import Record, Writer, commit, now, read
    from vdbench.timing import fresh_cache_env, system_info
except ModuleNotFoundError as e:  # a Python outside the project's environment: say which, not a traceback
    sys.exit(f"error: bench/suite.py runs in the project's environment ({e}"
             f"{', Python 3.11+' if e.name == 'tomllib' else ''}): source .venv/bin/activate (make setup creates it)")

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "bench" / "suites"

#: Model arguments the suites share (random weights at the real architectures and sizes).
MODELS = {
    "wan13": "--model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81",
    "wan14": "--model random:wan2.1-t2v-14b --height 720 --width 1280 --num_frames 81",
    "cog2b": "--model_path random:cogvideox-2b --height 480 --width 720 --num_frames 49",
}


DEFAULT_BUDGET_S = 540.0  #: a suite's budget unless its file (``budget_s``) or --budget_s says otherwise


class SuiteError(ValueError):
    """A suite file or a --set / --only that can't be run as written (the message says where)."""


def suites() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SUITES.glob("*.toml"))}


def load(name: str) -> dict:
    path = suites().get(name)
    if path is None:
        raise SuiteError(f"unknown suite {name!r}; known: {', '.join(suites()) or 'none'}")
    with open(path, "rb") as f:
        try:
            spec = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise SuiteError(f"{path}: {e}") from None
    if not spec.get("case"):
        raise SuiteError(f"{path}: no [[case]]")
    return spec


_LIMIT = re.compile(r"\{limit_s(?:-(\d+))?\}")


class _Vars(dict):
    def __missing__(self, key):
        if _LIMIT.fullmatch("{" + key + "}"):  # filled when the run starts: the limit it gets
            return "{" + key + "}"
        raise SuiteError(f"unknown name {{{key}}} (vars: {', '.join(sorted(self))})")


def _fmt(text: str, vars_: dict) -> str:
    try:
        return text.format_map(vars_)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise SuiteError(f"can't fill {text!r}: {e}") from None


def _values(v, vars_: dict) -> list:
    if isinstance(v, list):
        return [_fmt(str(x), vars_) for x in v]
    text = _fmt(str(v), vars_)
    m = re.fullmatch(r"\s*(\d+)\.\.(\d+)\s*", text)
    if m:
        return [str(i) for i in range(int(m.group(1)), int(m.group(2)) + 1)]
    return text.split()


def _name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _limit_filled(args: list[str], limit: float) -> list[str]:
    return [_LIMIT.sub(lambda m: str(int(limit) - int(m.group(1) or 0)), a) for a in args]


class _Models:
    def __getattr__(self, name):
        try:
            return MODELS[name]
        except KeyError:
            raise AttributeError(name) from None


def _base_vars(spec: dict, sets: dict, out: Path, py: str) -> _Vars:
    """The vars, ``--set`` over the file's, each filled in (a var may name another)."""
    vars_ = _Vars({k: str(v) for k, v in (spec.get("vars") or {}).items()})
    vars_.update({k: str(v) for k, v in sets.items()})
    vars_.update(py=py, out=str(out), model=_Models())
    for _ in range(8):
        filled = {k: _fmt(v, vars_) for k, v in vars_.items() if isinstance(v, str)}
        if all(filled[k] == vars_[k] for k in filled):
            return vars_
        vars_.update(filled)
    raise SuiteError("vars that name each other in a loop: " + ", ".join(k for k in filled if "{" in filled[k]))


def expand(spec: dict, sets: dict, out: Path, py: str) -> list[dict]:
    """The suite's runs in order: every case, one per combination of its ``for`` values, commands filled in."""
    vars_ = _base_vars(spec, sets, out, py)
    runs, seen = [], set()
    for case in spec["case"]:
        missing = {"name", "run"} - set(case)
        if missing:
            raise SuiteError(f"a case lacks {', '.join(sorted(missing))}: {case}")
        loops = case.get("for") or {}
        keys = list(loops)
        for combo in itertools.product(*(_values(loops[k], vars_) for k in keys)):
            v = _Vars({**vars_, **dict(zip(keys, combo))})
            name = _name(_fmt(case["name"], v))
            if name in seen:
                raise SuiteError(f"two runs named {name!r}")
            seen.add(name)
            cmd = case["run"]
            args = [_fmt(str(a), v) for a in cmd] if isinstance(cmd, list) else shlex.split(_fmt(cmd, v))
            runs.append({"name": name, "args": args, "need_s": float(case.get("need_s", 0)),
                         "limit_s": float(case.get("limit_s", 600)), "fresh_caches": bool(case.get("fresh_caches")),
                         "env": {k: _fmt(str(x), v) for k, x in (case.get("env") or {}).items()},
                         "env_if_exists": {k: _fmt(str(x), v) for k, x in (case.get("env_if_exists") or {}).items()},
                         "optional": bool(case.get("optional")), "always": bool(case.get("always")),
                         "track": _fmt(str(case.get("track", "main")), v), "wait": case.get("wait", False),
                         "deadline_s": float(case["deadline_s"]) if "deadline_s" in case else None,
                         "if_ok": _fmt(str(case["if_ok"]), v) if "if_ok" in case else None,
                         "if_failed": _fmt(str(case["if_failed"]), v) if "if_failed" in case else None})
    names = {r["name"]: i for i, r in enumerate(runs)}
    for i, r in enumerate(runs):
        for key in ("if_ok", "if_failed"):
            if r[key] is not None and names.get(r[key], i) >= i:
                raise SuiteError(f"{r['name']}: {key} names {r[key]!r}, not an earlier run")
    return runs


def dependencies(runs: list[dict]) -> list[set[int]]:
    """For each run, the earlier runs it waits for: the one before it in its track, what its ``wait`` names, the run
    its ``if_ok`` / ``if_failed`` reads."""
    names = {r["name"]: i for i, r in enumerate(runs)}
    deps, last = [], {}
    for i, r in enumerate(runs):
        d = {last[r["track"]]} if r["track"] in last else set()
        w = r["wait"]
        if w is True:
            d |= set(range(i))
        elif w not in (False, None):
            tracks = {w} if isinstance(w, str) else set(w)
            d |= {j for j in range(i) if runs[j]["track"] in tracks}
        d |= {names[r[k]] for k in ("if_ok", "if_failed") if r[k] is not None}
        deps.append(d)
        last[r["track"]] = i
    return deps


def collect_pairs(spec: dict, sets: dict, out: Path, py: str) -> list[tuple[str, str]]:
    """The suite's ``[collect]`` table filled in: (source, destination) pairs."""
    vars_ = _base_vars(spec, sets, out, py)
    return [(_fmt(str(src), vars_), _fmt(str(dst), vars_)) for dst, src in (spec.get("collect") or {}).items()]


def collect(pairs) -> list[str]:
    """Copy each source that exists to its destination; the destinations written."""
    done = []
    for src, dst in pairs:
        if Path(src).is_file():
            Path(dst).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            done.append(dst)
    return done


def environment(base=None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env.setdefault("OMP_NUM_THREADS", "8")
    # Python's bytecode written, where it can be: on an image whose site-packages hold none (the project's GPU
    # machine), every process compiled ~2,300 modules again (10-17 s of a render's startup and load, varying by
    # seconds between processes) -- a cost a pip install, which compiles at install time, never leaves to a run
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "vdbench_pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in paths if p != str(ROOT)]])
    return env


def done_runs(out: Path) -> set[str]:
    """The runs a previous call finished with rc 0 (skipped by a resumed call)."""
    path = out / "runs.jsonl"
    if not path.exists():
        return set()
    return {r.case for r in read(path) if r.data.get("rc") == 0}


def _why_not(run: dict, only, done: set, left: float):
    """Why ``run`` is not started on this call (None: it is): not asked for (an optional run is asked for by name),
    finished by an earlier call, or past its deadline. Runs marked ``always`` never come here."""
    chosen = bool(only) and re.fullmatch(only, run["name"]) is not None
    if (only or run["optional"]) and not chosen:
        return "not in --only"
    if run["name"] in done:
        return "done in an earlier call"
    if left < run["need_s"]:
        return f"deadline: {left:.0f} s left, needs {run['need_s']:.0f}"
    return None


def _device() -> str:
    try:
        import torch

    except ImportError:
        return "cpu"
    if torch.cuda.is_available():
        return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(0)).strip("-").lower()
    return "cpu"


def write_index(results: Path) -> Path:
    """``results/index.md``: every run folder (suite, date, device), its runs and how they ended."""
    lines = ["# Benchmark results", "", "Generated by bench/suite.py: one folder per suite, UTC date and device; "
             "`runs.jsonl` in each holds every run's command, rc and wall seconds.", "",
             "| suite | folder | runs ok | skipped | failed | commit |", "| --- | --- | --- | --- | --- | --- |"]
    for runs in sorted(results.glob("*/*/runs.jsonl")):
        try:
            recs = read(runs)
        except ValueError:
            continue
        last = {r.case: r for r in recs}.values()
        ok = sum(r.data.get("rc") == 0 for r in last)
        skipped = sum(r.data.get("rc") is None for r in last)
        commits = sorted({r.commit for r in last if r.commit})
        lines.append(f"| {runs.parent.parent.name} | [{runs.parent.name}]({runs.parent.parent.name}/{runs.parent.name}/)"
                     f" | {ok} | {skipped} | {len(last) - ok - skipped} | {', '.join(commits) or '-'} |")
    path = results / "index.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_suite(name: str, *, out: Path, budget_s: float | None, sets: dict, only: str | None = None, dry_run: bool = False,
              force: bool = False, py: str = sys.executable, log=print, clock=time.monotonic) -> list[dict]:
    spec = load(name)
    if budget_s is None:
        budget_s = float(spec.get("budget_s", DEFAULT_BUDGET_S))
    runs = expand(spec, sets, out, py)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    writer = Writer(out / "runs.jsonl")
    done = set() if force else done_runs(out)
    pairs = collect_pairs(spec, sets, out, py)
    if not dry_run:
        _write_system(out / "system.json")
    start = clock()
    env = environment()
    outcomes: list = [None] * len(runs)
    lock = threading.Lock()

    def step(i: int) -> dict:
        run = runs[i]
        rec = Record(suite=name, case=run["name"], config={"args": run["args"], "fresh_caches": run["fresh_caches"],
                                                           "env": run["env"]},
                     command=shlex.join(run["args"]), commit=commit(), created=now())
        end = budget_s if run["deadline_s"] is None else min(budget_s, run["deadline_s"])
        left = end - (clock() - start)
        why = None if run["always"] else _why_not(run, only, done, left)
        for key, want_ok in (("if_ok", True), ("if_failed", False)):
            other = run[key]
            if why or other is None or dry_run:
                continue
            got = outcomes[[r["name"] for r in runs].index(other)] or {}
            ok = got.get("rc") == 0 or other in done
            if ok != want_ok:
                why = f"{key} {other}: {'it ended ok' if ok else 'it did not end ok'}"
        if why:
            if why != "not in --only":
                rec.data = {"rc": None, "skipped": why}
                if not dry_run:
                    with lock:
                        writer.write(rec)
            return {"name": run["name"], "skipped": why}
        limit = max(1.0, min(run["limit_s"], left))
        run = {**run, "args": _limit_filled(run["args"], limit)}
        rec.config["args"], rec.command = run["args"], shlex.join(run["args"])
        if dry_run:
            cond = "".join(f", {k} {run[k]}" for k in ("if_ok", "if_failed") if run[k])
            log(f"[{clock() - start:5.0f}s] {run['name']} (limit {limit:.0f} s"
                f"{', fresh caches' if run['fresh_caches'] else ''}{', track ' + run['track'] if run['track'] != 'main' else ''}"
                f"{cond}): {shlex.join(run['args'])}")
            return {"name": run["name"], "dry": True, "limit_s": limit}
        t0 = clock()
        rc = _run(run, env, limit, out / "logs" / f"{run['name']}.log")
        wall = clock() - t0
        rec.data = {"rc": rc, "wall_s": wall, "limit_s": limit}
        rec.figures = {"wall_s": wall}
        with lock:
            writer.write(rec)
            log(f"[{clock() - start:5.0f}s] {run['name']} rc={rc} ({wall:.0f} s)")
            collect(pairs)
        return {"name": run["name"], "rc": rc, "wall_s": wall}

    deps = dependencies(runs)
    if dry_run or all(r["track"] == "main" and not r["wait"] for r in runs):
        for i in range(len(runs)):  # one after another (a dry run too: each run's dependencies come before it)
            outcomes[i] = step(i)
    else:
        ended = [threading.Event() for _ in runs]

        def lane(i: int) -> None:
            for d in deps[i]:
                ended[d].wait()
            try:
                outcomes[i] = step(i)
            except BaseException as e:  # noqa: BLE001 - recorded; the runs waiting on it go on
                outcomes[i] = {"name": runs[i]["name"], "rc": 1, "error": repr(e)}
            finally:
                ended[i].set()

        threads = [threading.Thread(target=lane, args=(i,), daemon=True) for i in range(len(runs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if not dry_run and out.parent.parent.name == "results":
        write_index(out.parent.parent)
    return outcomes


def _write_system(path: Path) -> None:
    import json

    try:
        import torch

        info = system_info("cuda" if torch.cuda.is_available() else "cpu")
    except Exception as e:  # noqa: BLE001 - a record, never fatal
        info = {"error": f"{type(e).__name__}: {e}"}
    path.write_text(json.dumps(info, indent=1) + "\n")


def _run(run: dict, env: dict, limit: float, log_path: Path) -> int:
    import contextlib

    cm = fresh_cache_env(env) if run["fresh_caches"] else contextlib.nullcontext(env)
    extra = {k: p for k, p in run.get("env_if_exists", {}).items() if os.path.isfile(p) and os.path.getsize(p)}
    with cm as e, open(log_path, "w") as logf:
        e = {k: v for k, v in e.items() if k not in run.get("env_if_exists", {})}
        try:
            p = subprocess.run(run["args"], cwd=ROOT, env={**e, **run["env"], **extra}, stdout=logf, stderr=subprocess.STDOUT,
                               timeout=limit)
            return p.returncode
        except subprocess.TimeoutExpired:
            logf.write(f"\n[suite] timed out after {limit:.0f} s\n")
            return 124
        except OSError as err:
            logf.write(f"\n[suite] could not start: {err}\n")
            return 127


def _sets(items) -> dict:
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k.isidentifier():
            raise SuiteError(f"--set takes NAME=VALUE, not {item!r}")
        out[k] = v
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="?", help="the suite (bench/suites/<suite>.toml)")
    p.add_argument("--list", action="store_true", help="list the suites and exit (default: off)")
    p.add_argument("--dry_run", action="store_true", help="print what would run, in order; run nothing (default: off)")
    p.add_argument("--budget_s", type=float, default=None,
                   help="seconds for the whole suite (default: the suite's budget_s, else 540)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE", help="override a suite var (repeatable; default: the suite's [vars])")
    p.add_argument("--only", default=None, help="run only the cases whose name matches this regex in full (default: every case)")
    p.add_argument("--force", action="store_true", help="run cases an earlier call finished (default: skip them)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: results/<suite>/<UTC date>_<device>)")
    args = p.parse_args(argv)
    try:
        if args.list or not args.suite:
            for n, path in suites().items():
                print(f"{n:12s} {load(n).get('description', '').strip().splitlines()[0]}")
            return 0
        out = args.out or ROOT / "results" / args.suite / f"{dt.datetime.now(dt.timezone.utc):%Y%m%d}_{_device()}"
        outcomes = run_suite(args.suite, out=out, budget_s=args.budget_s, sets=_sets(args.set), only=args.only,
                             dry_run=args.dry_run, force=args.force)
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = [o["name"] for o in outcomes if o.get("rc") not in (None, 0)]
    if not args.dry_run:
        print(f"results: {out} ({len(outcomes)} runs, {len(failed)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
