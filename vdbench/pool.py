"""Renders side by side on a machine's GPUs -- or, on a CPU, N at once: the pool a batch and the sweep run through.

Each job runs on GPUs of its own (``CUDA_VISIBLE_DEVICES`` names them; a job of ``nproc`` K takes K GPUs, the lowest
free aligned group first), under torchrun with a rendezvous port of its own where it takes more than one process
(never two renders on one port), its output in its own log; the lines a render prints about its steps (``[sdpa]
step 3/10: ...``) are shown as they come, with the job's own ``tag`` (the prompt and seed of a set) after the
render's name. Jobs start in the order given as GPUs free up; a job that fails or is stopped loses only itself.
SIGINT or SIGTERM to the process running the pool stops every running job -- its whole process group, the signal
first (a Python render unwinds and removes its temporary files; torchrun passes it on to its workers), SIGKILL after
:data:`GRACE_S` -- and raises :class:`Stopped` to the caller. A job past its deadline is stopped the same way and
ends with :data:`TIMED_OUT`.

Past one machine the jobs are torchrun's multi-node launches (:class:`Rendezvous`: ``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-backend`` or ``--master-addr`` / ``--master-port``, passed through, no
``--standalone``): every node runs the same jobs in the same order, and job ``i`` meets its peers on the endpoint's
port + ``i`` (and rendezvous id ``<id>-<i>``), so renders running at once never share a port on any node.

On a CPU a pool has ``jobs`` places and no GPU; each job's processes get ``cores / jobs`` OpenMP threads unless the
environment sets ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

__all__ = ["STEP_LINE", "GRACE_S", "TIMED_OUT", "Job", "Done", "Rendezvous", "Stopped", "Pool", "visible_gpus",
           "parse_gpus", "free_port", "launcher"]

#: The lines of a render's output shown live: its step lines, its warm-step summary, an emulation's notice.
STEP_LINE = re.compile(r"^\[([^]]+)\] (step [0-9]+/|warm step|no warm step|emulated backend)")

#: Seconds a stopped job has, after the signal, before its process group is killed.
GRACE_S = 10.0

#: A job's code when its deadline stopped it (``timeout``'s).
TIMED_OUT = 124

#: The longest line shown on screen (the log keeps every line whole).
SHOWN_CHARS = 220


class Stopped(Exception):
    """SIGINT or SIGTERM reached the pool: every running job was stopped (``signum``: which signal)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class Job:
    """One render: ``name`` (what the screen and its log file call it), ``program`` (Python's arguments after the
    interpreter -- ``-m module ...`` or ``script.py ...`` -- the pool adds torchrun for ``nproc`` > 1), ``log``
    (its whole output), ``tag`` (shown after the render's own name in its step lines), ``env`` (variables on top),
    ``index`` (its place in the whole batch: its rendezvous port's offset on every node), ``timeout_s`` (stopped
    after it; None: never), ``data`` (the caller's, carried to :class:`Done`)."""

    name: str
    program: list
    log: Path
    nproc: int = 1
    tag: str = ""
    env: dict = field(default_factory=dict)
    index: int = 0
    timeout_s: Optional[float] = None
    data: object = None


@dataclass
class Done:
    """A job that ended: its exit ``code`` (negative: the signal that ended it; :data:`TIMED_OUT` past its
    deadline), the GPUs it ran on, when it started and how long it ran (``seconds``), and whether the pool stopped
    it (``stopped``: its deadline, or a signal to the pool)."""

    job: Job
    code: int
    gpus: tuple
    started: float
    seconds: float
    stopped: bool = False
    timed_out: bool = False


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class Rendezvous:
    """torchrun's rendezvous options, as given (None: not given). Without any, each launch is a one-machine group
    on a loopback port of its own (:meth:`args`)."""

    nnodes: Optional[int] = None
    node_rank: Optional[int] = None
    endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    backend: Optional[str] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    @classmethod
    def of(cls, args) -> "Rendezvous":
        """The options as a command line parsed them (``nnodes``, ``node_rank``, ``endpoint``, ``rdzv_id``,
        ``rdzv_backend``, ``master_addr``, ``master_port``; one it lacks is not given)."""
        get = lambda k: getattr(args, k, None)  # noqa: E731
        return cls(get("nnodes"), get("node_rank"), get("endpoint"), get("rdzv_id"), get("rdzv_backend"),
                   get("master_addr"), get("master_port"))

    @property
    def multi_node(self) -> bool:
        return (self.nnodes or 1) > 1 or bool(self.endpoint or self.master_addr)

    def check(self) -> None:
        """ValueError naming what is wrong with the options given."""
        if not self.multi_node:
            if self.node_rank or self.rdzv_id or self.backend or self.master_port:
                raise ValueError("--node-rank, --rdzv-id, --rdzv-backend and --master-port join several machines: "
                                 "add --nnodes N and --rdzv-endpoint HOST:PORT (or --master-addr)")
            return
        if self.endpoint and self.master_addr:
            raise ValueError("give --rdzv-endpoint (c10d) or --master-addr/--master-port (static), not both")
        if self.node_rank is not None and not 0 <= self.node_rank < (self.nnodes or 1):
            raise ValueError(f"--node-rank {self.node_rank}: from 0 to --nnodes - 1 ({(self.nnodes or 1) - 1})")
        if self.endpoint and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", self.endpoint):
            raise ValueError(f"--rdzv-endpoint {self.endpoint}: HOST:PORT (the port renders count up from)")
        if self.master_addr and self.node_rank is None and (self.nnodes or 1) > 1:
            raise ValueError("--master-addr (torchrun's static rendezvous) needs --node-rank on each machine")

    def args(self, index: int, port: Optional[int]) -> list[str]:
        """torchrun's rendezvous arguments for job ``index``: given options passed through, the endpoint's (or
        master's) port + ``index`` and the id ``<id>-<index>``, so renders side by side never meet on one port;
        without multi-node options, a one-machine group on ``localhost:<port>`` (a port the pool chose)."""
        if not self.multi_node:
            return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                    "--rdzv-id", f"vdbench-{port}"]
        out = ["--nnodes", str(self.nnodes or 1)]
        if self.master_addr:  # static: the machines' ranks are given; c10d assigns them (and ignores a given one)
            base = self.master_port or 29500
            rank = ["--node-rank", str(self.node_rank)] if self.node_rank is not None else []
            return out + rank + ["--rdzv-backend", self.backend or "static", "--master-addr", self.master_addr,
                          "--master-port", str(base + index)]
        host, _, base = self.endpoint.rpartition(":")
        return out + ["--rdzv-backend", self.backend or "c10d", "--rdzv-endpoint", f"{host}:{int(base) + index}",
                      "--rdzv-id", f"{self.rdzv_id or 'vdbench'}-{index}"]


def launcher(python: str, nproc: int, rdzv: Rendezvous, index: int = 0, port: Optional[int] = None) -> list[str]:
    """The launch before a job's program: the interpreter alone for one process on one machine, else torchrun
    (``python -m torch.distributed.run``) with ``nproc`` processes here and the rendezvous of :meth:`Rendezvous.args`."""
    if nproc <= 1 and not rdzv.multi_node:
        return [python]
    return [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *rdzv.args(index, port)]


def visible_gpus() -> list[str]:
    """The GPUs this process sees, by the ids ``CUDA_VISIBLE_DEVICES`` gives them (indices where it is unset); []
    without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    ids = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return ids[:n] if ids else [str(i) for i in range(n)]


def parse_gpus(text: Optional[str], visible: list[str]) -> list[str]:
    """``--gpus``: ``all`` (or None) = ``visible``; else comma-separated ids (``0,2,3``), each a visible one (by
    the id ``CUDA_VISIBLE_DEVICES`` gives it); ValueError naming what is wrong."""
    if text in (None, "", "all"):
        return list(visible)
    ids = [x.strip() for x in text.split(",") if x.strip()]
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"--gpus {text}: a comma-separated list of GPU ids, each once, or all")
    missing = [g for g in ids if g not in visible]
    if missing:
        raise ValueError(f"--gpus {text}: GPU {', '.join(missing)} not visible here "
                         f"(visible: {', '.join(visible) or 'none'})")
    return ids


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux /proc; [] elsewhere): torchrun starts its workers in sessions of their
    own, which a signal to the launcher's process group does not reach."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class _Running:
    def __init__(self, job: Job, proc: subprocess.Popen, places: list, gpus: tuple, reader: threading.Thread):
        self.job, self.proc, self.places, self.gpus, self.reader = job, proc, places, gpus, reader
        started = self.started = time.monotonic()
        self.stopped = self.timed_out = False
        self.deadline = started + job.timeout_s if job.timeout_s is not None else None


class Pool:
    """Jobs side by side on ``gpus`` (ids as ``CUDA_VISIBLE_DEVICES`` names them), or on ``jobs`` places with no
    GPU (a CPU: ``gpus`` empty). ``python``: the interpreter the jobs start with; ``rdzv``: torchrun's rendezvous
    options; ``env``: the environment the jobs start from (default: this process's); ``show``: where the step
    lines go (None: nowhere), ``STEP_LINE`` selecting them. ``python`` None: ``sys.executable`` when a job starts."""

    def __init__(self, gpus: list[str], jobs: Optional[int] = None, *, python: Optional[str] = None,
                 rdzv: Optional[Rendezvous] = None, env: Optional[dict] = None,
                 show: Optional[Callable[[str], None]] = None, grace_s: float = GRACE_S):
        self.gpus = list(gpus)
        self.places = len(self.gpus) if self.gpus else max(1, int(jobs or 1))
        self.limit = max(1, int(jobs)) if jobs else self.places
        self.python, self.rdzv, self.env, self.show, self.grace_s = python, rdzv or Rendezvous(), env, show, grace_s
        self._free = list(range(self.places))
        self._held: set[int] = set()
        self._running: dict[int, _Running] = {}
        self._ended: "queue.Queue[int]" = queue.Queue()
        self._ports: set[int] = set()
        self._print = threading.Lock()

    # --- places ---------------------------------------------------------------------------------------------

    @property
    def running(self) -> list[Job]:
        return [r.job for r in self._running.values()]

    def width(self, nproc: int) -> int:
        """The places a job of ``nproc`` processes takes: its GPUs, or one place on a CPU."""
        return max(1, nproc) if self.gpus else 1

    def fits(self, nproc: int) -> bool:
        """Whether the pool can ever run a job of ``nproc`` processes."""
        return self.width(nproc) <= self.places

    def can_start(self, nproc: int = 1) -> bool:
        return len(self._running) < self.limit and self._take(self.width(nproc), dry=True) is not None

    def _take(self, k: int, dry: bool = False) -> Optional[list[int]]:
        free = sorted(p for p in self._free if p not in self._held)
        if len(free) < k:
            return None
        aligned = [free[i:i + k] for i in range(len(free) - k + 1)
                   if free[i] % k == 0 and free[i:i + k] == list(range(free[i], free[i] + k))]
        got = aligned[0] if aligned else free[:k]
        if not dry:
            self._free = [p for p in self._free if p not in got]
        return got

    def available(self) -> int:
        """The places not held (:meth:`hold`): how many one-GPU jobs can run at once now at most."""
        return min(self.limit, self.places - len(self._held))

    def hold(self, gpu: str) -> None:
        """Keep ``gpu`` from the jobs (a job beside them runs there) until :meth:`release`."""
        self._held.add(self.gpus.index(gpu))

    def release(self, gpu: str) -> None:
        self._held.discard(self.gpus.index(gpu))

    def _port(self) -> int:
        while True:
            p = free_port()
            if p not in self._ports:
                self._ports.add(p)
                return p

    def describe(self, nproc: int = 1) -> str:
        """``4 at once on GPUs 0 | 1 | 2 | 3`` / ``2 at once (a CPU)``."""
        k = self.width(nproc)
        n = min(self.limit, (self.places - len(self._held)) // k)
        if not self.gpus:
            return f"{n} at once (no GPU)"
        groups = [",".join(self.gpus[i:i + k]) for i in range(0, n * k, k)]
        return f"{n} at once on GPUs {' | '.join(groups)}"

    # --- jobs -----------------------------------------------------------------------------------------------

    def start(self, job: Job) -> tuple:
        """Start ``job`` on the first free places that take it (:meth:`can_start` first); the GPUs it got."""
        places = self._take(self.width(job.nproc))
        if places is None:
            raise RuntimeError(f"no free place for {job.name}")
        gpus = tuple(self.gpus[p] for p in places) if self.gpus else ()
        env = dict(os.environ if self.env is None else self.env)
        env.update(job.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        elif self.places > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.places))
        port = self._port() if job.nproc > 1 and not self.rdzv.multi_node else None
        cmd = launcher(self.python or sys.executable, job.nproc, self.rdzv, job.index, port) + list(job.program)
        job.log.parent.mkdir(parents=True, exist_ok=True)
        log = open(job.log, "wb")
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        except OSError:
            log.close()
            self._free += places
            raise
        key = proc.pid
        reader = threading.Thread(target=self._read, args=(key, proc, log, job), daemon=True,
                                  name=f"pool-{job.name}")
        self._running[key] = _Running(job, proc, places, gpus, reader)
        reader.start()
        return gpus

    def _read(self, key: int, proc: subprocess.Popen, log, job: Job) -> None:
        """The job's output into its log, its step lines to the screen, until its process has ended and its output
        is drained: not until every copy of the pipe is closed -- a process it forked may hold one on."""
        fd = proc.stdout.fileno()
        rest = b""
        try:
            while True:
                if select.select([fd], [], [], 0.2)[0]:
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    log.write(chunk)
                    log.flush()
                    *lines, rest = (rest + chunk).split(b"\n")
                    for raw in lines:
                        self._show(raw, job)
                elif proc.poll() is not None:
                    break
            if rest:
                self._show(rest, job)
        finally:
            proc.wait()
            proc.stdout.close()
            log.close()
            self._ended.put(key)

    def _show(self, raw: bytes, job: Job) -> None:
        if self.show is None:
            return
        line = raw.decode(errors="replace").rstrip("\r")
        m = STEP_LINE.match(line)
        if m:
            if job.tag:
                line = f"[{m.group(1)} {job.tag}]" + line[m.end(1) + 1:]
            with self._print:
                self.show(line[:SHOWN_CHARS])

    def wait(self, timeout: Optional[float] = None) -> Optional[Done]:
        """The next job to end (None: none ended within ``timeout``; none running). Jobs past their deadline are
        stopped meanwhile."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._running:
            step = 0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))
            try:
                key = self._ended.get(timeout=step)
            except queue.Empty:
                now = time.monotonic()
                late = [r for r in self._running.values() if r.deadline is not None and now > r.deadline
                        and not r.stopped]
                for r in late:
                    r.timed_out = True
                    self._stop([r], signal.SIGTERM)
                if end is not None and now >= end:
                    return None
                continue
            r = self._running.pop(key)
            r.reader.join()
            self._free += r.places
            code = TIMED_OUT if r.timed_out else r.proc.returncode
            return Done(r.job, code, r.gpus, r.started, time.monotonic() - r.started, r.stopped, r.timed_out)
        return None

    def _stop(self, runs: list[_Running], sig: int) -> None:
        """``sig`` to each run's process group and its processes elsewhere (torchrun's workers), SIGKILL to what is
        left after the grace period (not waited for here: :meth:`wait` collects them)."""
        targets = []
        for r in runs:
            r.stopped = True
            pids = _descendants(r.proc.pid)
            targets.append((r, pids))
            for send in (lambda: os.killpg(r.proc.pid, sig), *(lambda p=p: os.kill(p, sig) for p in pids)):
                with contextlib.suppress(OSError):  # it has ended already
                    send()

        def kill_later():
            deadline = time.monotonic() + self.grace_s
            for r, pids in targets:
                with contextlib.suppress(subprocess.TimeoutExpired):  # past the grace: killed below
                    r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                for send in (lambda: os.killpg(r.proc.pid, signal.SIGKILL),
                             *(lambda p=p: os.kill(p, signal.SIGKILL) for p in pids)):
                    with contextlib.suppress(OSError):  # it has ended already
                        send()

        threading.Thread(target=kill_later, daemon=True, name="pool-kill").start()

    def stop_all(self, sig: int = signal.SIGTERM) -> list[Done]:
        """Stop every running job and wait for each to end (at most the grace period, then killed); a further
        SIGINT or SIGTERM meanwhile changes nothing (the jobs are being stopped)."""
        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            self._stop([r for r in self._running.values() if not r.stopped], sig)
            done = []
            while self._running:
                d = self.wait()
                if d is not None:
                    done.append(d)
            return done
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def run(self, jobs: list[Job], on_start: Optional[Callable[[Job, tuple], None]] = None,
            on_done: Optional[Callable[[Done], None]] = None) -> list[Done]:
        """Every job, in order, as places free up; each ended one to ``on_done`` as it ends. On SIGINT or SIGTERM
        every running job is stopped (``on_done`` hears of each) and :class:`Stopped` is raised."""
        out: list[Done] = []
        todo = list(jobs)
        with self.signals():
            try:
                while todo or self._running:
                    while todo and self.can_start(todo[0].nproc):
                        job = todo.pop(0)
                        gpus = self.start(job)
                        if on_start is not None:
                            on_start(job, gpus)
                    d = self.wait()
                    if d is not None:
                        out.append(d)
                        if on_done is not None:
                            on_done(d)
            except Stopped as e:
                for d in self.stop_all(e.signum):
                    out.append(d)
                    if on_done is not None:
                        on_done(d)
                raise
        return out

    def signals(self):
        """A context in which SIGINT and SIGTERM raise :class:`Stopped` (main thread only; elsewhere nothing
        changes)."""
        pool = self

        class _Signals:
            def __enter__(self):
                self.old = {}
                if threading.current_thread() is threading.main_thread():
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        self.old[sig] = signal.signal(sig, pool._on_signal)
                return self

            def __exit__(self, *exc):
                for sig, handler in self.old.items():
                    signal.signal(sig, handler)
                return False

        return _Signals()

    def _on_signal(self, signum, frame):
        raise Stopped(signum)
