"""Every flag of every command line says what it does and what it is when not given (vdbench.helptext), and help
texts name no code constants."""

import argparse
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from vdbench.helptext import DefaultsHelpFormatter

ROOT = Path(__file__).resolve().parents[1]
# the benches and the lab's tools with a command line (their own parser, or the package's one they run)
BENCH = sorted(str(p.relative_to(ROOT)) for p in [*(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("lab/*.py")]
               if "argparse" in p.read_text() or "import main" in p.read_text())
COMMANDS = [["run_wan.py"], ["sageattn_cogvideo.py"], ["sweep.py"], ["stitch_comparison.py"], ["-m", "vdbench.report"],
            ["-m", "vdbench.batch"], ["-m", "vdbench.sweep"], ["-m", "vdbench.kernel_bench"], ["render_all_WAN.sh"],
            ["render_all_attention.sh"]]
COMMANDS += [[b] for b in BENCH]


def _options(text: str) -> list[tuple[str, str]]:
    """(flags, help) of each option listed by ``--help`` (positional arguments and -h left out)."""
    out, cur, section = [], None, ""
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section, cur = line, None
            continue
        m = re.match(r"^  (-\S.*)$", line)
        if m and "positional" not in section:
            parts = re.split(r"\s{2,}", m.group(1), maxsplit=1)
            cur = [parts[0], parts[1] if len(parts) > 1 else ""]
            out.append(cur)
        elif cur is not None and line.startswith("      "):
            cur[1] += " " + line.strip()
        elif not line.strip():
            cur = None
    return [(f, h.strip()) for f, h in out if not f.startswith("-h")]


# Each Python command's ``--help`` as ``python <script>`` / ``python -m <module>`` runs it (``runpy``: the script's
# folder first on sys.path, ``__main__`` its own module), all of them in one child process: one torch import for
# every command instead of one per command; each command's exit status, stdout and stderr come back apart.
_HELP_ALL = r"""
import contextlib, io, json, runpy, sys
out = {}
for command in json.loads(sys.argv[1]):
    stdout, stderr, path0 = io.StringIO(), io.StringIO(), sys.path[0]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            sys.argv = [command[-1], "--help"]
            if command[0] == "-m":
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = str(__import__("pathlib").Path(command[0]).resolve().parent)
                runpy.run_path(command[0], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        rc, _ = 1, stderr.write(f"{type(e).__name__}: {e}")
    finally:
        sys.path[0] = path0
    out[" ".join(command)] = [rc, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_texts() -> dict:
    """``" ".join(command)`` -> (exit status, stdout, stderr) of ``command --help``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable)
    python = [c for c in COMMANDS if not c[0].endswith(".sh")]
    proc = subprocess.run([sys.executable, "-c", _HELP_ALL, json.dumps(python)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    for c in COMMANDS:
        if c[0].endswith(".sh"):
            p = subprocess.run(["bash", str(ROOT / c[0]), "--help"], capture_output=True, text=True, env=env,
                               timeout=120, cwd=ROOT)
            got[" ".join(c)] = [p.returncode, p.stdout, p.stderr]
    return got


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[-1])
def test_every_flag_has_help_that_shows_its_default(command, help_texts):
    returncode, stdout, stderr = help_texts[" ".join(command)]
    proc = types.SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr)
    assert proc.returncode == 0, proc.stderr
    options = _options(proc.stdout)
    assert options or re.search(r"^  \{\w+(,\w+)*\}$", proc.stdout, re.M), proc.stdout  # flags, or subcommands
    for flags, help_ in options:
        assert help_, f"{command}: {flags} has no help"
        assert re.search(r"default|required", help_, re.I), f"{command}: {flags} does not show its default: {help_}"
    # no code constant or module path in place of words
    helps = " ".join(h for _, h in options)
    assert not re.search(r"\bvdbench\.\w+\.\w+|\b[A-Z0-9]+_[A-Z0-9]+_[A-Z0-9_]+\b", helps), (command, helps)


def test_the_formatter_shows_defaults_once():
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=3, help="samples")
    p.add_argument("--flag", action="store_true", help="a switch")
    p.add_argument("--name", default=None, help="a name")
    p.add_argument("--said", default=1, help="already says it (default: one)")
    text = " ".join(p.format_help().split())
    assert "samples (default: 3)" in text and "a switch (default: off)" in text and "a name (default: none)" in text
    assert "already says it (default: one)" in text and text.count("default") == 4
