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


def one_thread() -> None:
    """In a forked child, before any torch work: one intra-op thread. GNU OpenMP's thread pool does not survive a
    fork -- a child entering a parallel region with the parent's pool hangs -- so the children of a test process
    that computed on several threads must not enter one (the ranks of a launch share the cores anyway, as
    torchrun's OMP_NUM_THREADS=1 makes them)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _group_rank(rank: int, worker, port: int, *args) -> None:
    one_thread()
    worker(rank, port, *args)


def group(worker, nprocs: int, *args) -> None:
    """``worker(rank, port, *args)`` on ``nprocs`` ranks forked from this process, a free loopback port for their
    process group; returns when every rank has ended (raises if one failed)."""
    import torch.multiprocessing as mp

    mp.start_processes(_group_rank, args=(worker, free_port(), *args), nprocs=nprocs, join=True,
                       start_method="fork")


def _child(log: str, env: dict, body) -> None:
    """The end of a forked child: its output into ``log``, no torchrun variables but those in ``env``, ``body()``
    run, and the process ends with the code a ``python`` running it would give (a crash: its traceback, 1)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        for k in _DIST_ENV:
            os.environ.pop(k, None)
        os.environ.update(env)
        one_thread()
        code = body() or 0
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


def _rank(family: str, argv: list, rank: int, world: int, port: int, log: str, env: dict) -> None:
    def body():
        if world > 1:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from vdbench import cli

        return cli.main(family, list(argv))

    _child(log, env, body)


def _script(path: str, argv: list, root: str, cwd: str, log: str, env: dict) -> None:
    """A script run as ``python path argv...`` with ``root`` first on the path: the vdbench already imported here is
    dropped when ``root`` holds another one (an older commit's tree), so the script runs that tree's code; torch,
    diffusers and transformers stay imported."""
    def body():
        import runpy

        here = sys.modules.get("vdbench")
        if here is not None and Path(here.__file__).resolve().parents[1] != Path(root).resolve():
            for name in [m for m in sys.modules if m == "vdbench" or m.startswith("vdbench.")]:
                del sys.modules[name]
        sys.path.insert(0, str(root))
        os.chdir(cwd)
        sys.argv = [str(path), *map(str, argv)]
        runpy.run_path(str(path), run_name="__main__")

    _child(log, env, body)


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


# ----- a stand-in for `python` for the shell scripts under test -----

_CLIENT = '''#!{python} -S
# what a test's $PYTHON runs: hands its argv, cwd, environment and standard streams to the test process's fork
# server (tests/launch.py PythonServer), which runs them in a forked child, and exits with the child's code
import json, os, signal, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({sock!r})
msg = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [struct.pack("!I", len(msg)) + msg], [0, 1, 2])
def forward(signum, frame):  # a signal to `python` is the child's: it decides its own exit code
    s.sendall(bytes([signum]))
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
data = b""
while len(data) < 4:
    chunk = s.recv(4 - len(data))
    if not chunk:
        os._exit(1)
    data += chunk
code = struct.unpack("!i", data)[0]
if code < 0:  # the child died of a signal: so does `python`, as an interpreter killed so would
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
'''


def _run_python_argv(argv: list) -> None:
    """Run ``python argv...`` in this (forked) process: ``-c CODE``, ``-m MODULE`` or a script path, with sys.argv
    and sys.path[0] set the way the interpreter sets them."""
    import runpy

    if argv and argv[0] == "-u":  # unbuffered: the child's streams are flushed at exit anyway
        argv = argv[1:]
    if argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


class PythonServer:
    """``python`` for the shell scripts a test runs (``$PYTHON``): each call is a child forked from the test process
    -- torch, diffusers and transformers already imported -- with the caller's argv, working directory, environment
    and standard streams, and the caller exits with the child's code. The scripts' own logic (their loops, their
    exit codes, their logs) runs unchanged; a launch of torchrun still starts its workers as real processes.

        with PythonServer(tmp_path) as server:
            subprocess.run(["bash", "render_all_WAN.sh", ...], env={..., "PYTHON": server.python})
    """

    def __init__(self, folder: Path):
        import tempfile

        # a short path: a Unix socket's path is limited to ~100 bytes, a pytest tmp path may be longer
        self._dir = Path(tempfile.mkdtemp(prefix="vdpy"))
        self.sock_path = str(self._dir / "s")
        self.python = str(Path(folder) / "python")
        Path(self.python).write_text(_CLIENT.format(python=sys.executable, sock=self.sock_path))
        os.chmod(self.python, 0o755)
        self._children: set = set()

    def __enter__(self):
        import threading

        preload()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.sock_path)
        self._server.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        import shutil

        self._server.close()
        for pid in list(self._children):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn) -> None:
        import json
        import selectors
        import struct

        with conn:
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            (n,) = struct.unpack("!I", head)
            body = b""
            while len(body) < n:
                body += conn.recv(n - len(body))
            msg = json.loads(body)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    for i, fd in enumerate(fds):
                        os.dup2(fd, i)
                    os.chdir(msg["cwd"])
                    os.environ.clear()
                    os.environ.update(msg["env"])
                    one_thread()
                    for p in reversed([p for p in msg["env"].get("PYTHONPATH", "").split(os.pathsep) if p]):
                        sys.path.insert(0, p)
                    sys.executable = self.python  # what the child starts as `python` is forked here too
                    sys.stdin = open(0, closefd=False)
                    sys.stdout = open(1, "w", closefd=False, buffering=1)
                    sys.stderr = open(2, "w", closefd=False, buffering=1)
                    _run_python_argv(msg["argv"])
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, int) and e.code is not None:
                        print(e.code, file=sys.stderr)
                except BaseException:  # noqa: BLE001 - a crash: its traceback on the caller's stderr, exit 1
                    import traceback

                    traceback.print_exc()
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            for fd in fds:
                os.close(fd)
            self._children.add(pid)
            sel = selectors.DefaultSelector()
            sel.register(conn, selectors.EVENT_READ)
            caller_gone = False
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if not caller_gone and sel.select(timeout=0.05):
                    got = conn.recv(1)
                    try:  # a signal the caller got goes to its child; a caller gone takes its child with it
                        os.kill(pid, got[0] if got else 9)
                    except OSError:
                        pass
                    if not got:
                        caller_gone = True
                        sel.unregister(conn)
                elif caller_gone:
                    time.sleep(0.05)
            self._children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(struct.pack("!i", code))
            except OSError:
                pass
