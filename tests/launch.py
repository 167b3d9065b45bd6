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
    """A forked launch: every rank's exit code (None: still running at the timeout, then killed), its log, the
    launch's wall time."""

    codes: list
    logs: list
    seconds: float

    @property
    def returncode(self) -> int:
        bad = [c for c in self.codes if c != 0]
        return 0 if not bad else (bad[0] if bad[0] is not None else -9)

    @property
    def stderr(self) -> str:
        """Every rank's output, rank 0 first (what a test reads for the error lines)."""
        return "".join(f"--- rank {r} ---\n{text}" if len(self.logs) > 1 else text for r, text in enumerate(self.logs))


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


def render(family: str, argv: list, log_dir: Path, nproc: int = 1, timeout: float = 240, **env) -> Launch:
    """``nproc`` forked ranks of ``family``'s render CLI with ``argv`` (nproc 1: one process, no process group);
    each rank's output in ``log_dir/rank<r>.log``. Ranks still running after ``timeout`` seconds are killed."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    logs = [str(log_dir / f"rank{r}.log") for r in range(nproc)]
    t0 = time.monotonic()
    procs = [ctx.Process(target=_rank, args=(family, argv, r, nproc, port, logs[r], env), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, timeout - (time.monotonic() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode if p.exitcode is not None else None for p in procs]
    return Launch(codes, [Path(x).read_text(errors="replace") for x in logs], time.monotonic() - t0)
