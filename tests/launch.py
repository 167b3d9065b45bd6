"""Renders for tests in forked children of the test process: the CLI as a launch runs it, without a fresh
interpreter's imports.

A tiny render in a new Python process spends ~80% of its CPU importing torch, diffusers and transformers (~12 of
~15 CPU-s on the 2-core CI machine); a child forked from the test process has them already. Each rank runs
``vdbench.cli.main`` with the environment torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR/PORT, one thread)
and ends with the CLI's exit code, its output in a log file. What only a real launch shows -- torchrun's own
summary, a rank killed by a signal, the end-to-end clock counted from the process start -- stays with the tests
that start ``torchrun`` or ``python`` (tests/test_parallel.py's ``torchrun``).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK")


@dataclass
class Launch:
    """A forked launch: every rank's exit code (-9: still running at the timeout, then killed), its log, the
    launch's wall time."""

    codes: list
    logs: list
    seconds: float

    @property
    def returncode(self) -> int:
        bad = [c for c in self.codes if c != 0]
        return bad[0] if bad else 0

    @property
    def stderr(self) -> str:
        """Every rank's output, rank 0 first (what a test reads for the error lines)."""
        return "".join(f"--- rank {r} ---\n{text}" if len(self.logs) > 1 else text for r, text in enumerate(self.logs))


# what a render imports lazily (diffusers' and transformers' pipeline and model classes, the video writers): made
# once in the test process, so each forked child finds them
_PRELOAD = (("diffusers", ("WanPipeline", "WanImageToVideoPipeline", "CogVideoXPipeline",
                           "CogVideoXImageToVideoPipeline", "AutoencoderKLWan", "AutoencoderKLCogVideoX",
                           "WanTransformer3DModel", "CogVideoXTransformer3DModel", "UniPCMultistepScheduler",
                           "CogVideoXDPMScheduler")),
            ("transformers", ("UMT5EncoderModel", "T5EncoderModel", "AutoTokenizer", "CLIPVisionModel")),
            ("vdbench.cli", ()), ("vdbench.render", ()), ("imageio", ()), ("cv2", ()))
_preloaded = False


def preload() -> None:
    """Import here, once, what every render imports (see ``_PRELOAD``); what is missing is left to the child."""
    global _preloaded
    if _preloaded:
        return
    import importlib

    for module, names in _PRELOAD:
        try:
            mod = importlib.import_module(module)
            for name in names:
                getattr(mod, name, None)
        except Exception:  # noqa: BLE001 - an optional module: the child imports it or says why
            pass
    _preloaded = True


def free_port() -> int:
    """A loopback port free now (test files run side by side on the xdist workers: no fixed port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(family: str, argv: list, rank: int, world: int, port: int, log: str, env: dict) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        for k in _DIST_ENV:
            os.environ.pop(k, None)
        os.environ.update(env)
        os.environ["OMP_NUM_THREADS"] = "1"
        if world > 1:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch

        torch.set_num_threads(1)  # the ranks share the machine's cores, as torchrun's OMP_NUM_THREADS=1 makes them
        from vdbench import cli

        code = cli.main(family, list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a crash: its traceback in the log, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _script(path: str, argv: list, root: str, cwd: str, log: str, env: dict) -> None:
    """A script run as ``python path argv...`` with ``root`` first on the path: the vdbench already imported here is
    dropped when ``root`` holds another one (an older commit's tree), so the script runs that tree's code; torch,
    diffusers and transformers stay imported."""
    import runpy

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        for k in _DIST_ENV:
            os.environ.pop(k, None)
        os.environ.update(env)
        here = sys.modules.get("vdbench")
        if here is not None and Path(here.__file__).resolve().parents[1] != Path(root).resolve():
            for name in [m for m in sys.modules if m == "vdbench" or m.startswith("vdbench.")]:
                del sys.modules[name]
        sys.path.insert(0, str(root))
        os.chdir(cwd)
        sys.argv = [str(path), *map(str, argv)]
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a crash: its traceback in the log, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def script(path: Path, argv: list, log: Path, root: Path, cwd: Path | None = None, timeout: float = 600,
           **env) -> Launch:
    """``python path argv...`` in a forked child (see :func:`_script`), its output in ``log``."""
    preload()
    ctx = multiprocessing.get_context("fork")
    t0 = time.monotonic()
    p = ctx.Process(target=_script, args=(str(path), list(argv), str(root), str(cwd or root), str(log), env))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
    return Launch([p.exitcode], [Path(log).read_text(errors="replace")], time.monotonic() - t0)


def render(family: str, argv: list, log_dir: Path, nproc: int = 1, timeout: float = 240, **env) -> Launch:
    """``nproc`` forked ranks of ``family``'s render CLI with ``argv`` (nproc 1: one process, no process group);
    each rank's output in ``log_dir/rank<r>.log``. Ranks still running after ``timeout`` seconds are killed."""
    preload()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    logs = [str(log_dir / f"rank{r}.log") for r in range(nproc)]
    t0 = time.monotonic()
    procs = [ctx.Process(target=_rank, args=(family, argv, r, nproc, port, logs[r], env)) for r in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, timeout - (time.monotonic() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return Launch([p.exitcode for p in procs], [Path(x).read_text(errors="replace") for x in logs], time.monotonic() - t0)
