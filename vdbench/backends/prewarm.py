"""A render's attention prewarm: what the backend's first calls would compile (a JIT's kernels), done before them.

Why: a JIT-compiled kernel compiles its specializations at its first launch, inside the first denoising step. On an
empty Triton cache ``fav3_fp8``'s pre-pass compiled four kernels there at Wan 1.3B 480p (a first step of 4.18 s
against 1.01 s warm, H200). The render knows before its load what the calls will be -- the backend, the dtype, and
the call shapes its family derives from the model's configs (``Family.attention_calls``) -- so it starts
:class:`Prewarm` as the load begins, for every entry with a ``prewarm`` capability (``Backend.prewarm``; an entry
without one is left alone), and the first attention call waits for it (:meth:`Prewarm.wait`: only where it has not
finished; the wait is recorded).

How, on a GPU: a worker process (``python -m vdbench.backends.prewarm``) runs each entry's ``prewarm`` -- its
kernels compiled on meta tensors of the render's shapes through Triton's own JIT (compile-only: the same
specialization key, no launch), into Triton's on-disk cache -- on cores the load does not use and without holding
the render's GIL (a compile beside the load's Python slows the load by about its own length: docs/PERFORMANCE.md
§9.2). Then a thread of the render runs the same ``prewarm`` in-process: each kernel found in the on-disk cache,
put in the JIT's in-memory cache under the key its first call computes, its module loaded and launcher built -- so
the first real call launches at once. On a CPU (Triton's interpreter: no compile, no cache) only the thread runs.
A failure is recorded (``status`` "failed" with the one-line error) and never raised: the first calls then compile
their own kernels, as without a prewarm, and the render says so.

Every render after a machine's first finds its kernels in Triton's on-disk cache already, where the worker would
only pay its own start (a Python with torch and a CUDA context: about 3 s on an H200 host, all of it in the first
step of a render whose load is shorter). So a worker that succeeded leaves a marker in that cache, keyed by what
its kernels depend on (the entries, the calls, the dtype, the device, torch's and Triton's versions, the source of
vdbench's backends and kernels); a later prewarm that finds its marker skips the worker and runs the in-process
part at once (``worker_skipped`` says why). The marker only chooses where the kernels are looked up: a kernel
missing from the cache after all is compiled by that in-process part, correct either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch

from .registry import Backend, CallShape, resolve

log = logging.getLogger(__name__)

__all__ = ["Prewarm", "start", "main"]

#: The most seconds the render's first call waits for the worker (a hung compile must not hang the render).
WORKER_TIMEOUT_S = 120.0


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Prewarm:
    """The prewarm of ``entries`` (entries with a ``prewarm``) for ``calls`` on ``device`` in ``dtype``, running on a
    daemon thread from construction (``worker``: first through a worker process; by default on a CUDA device).
    :meth:`wait` joins it and returns its record; it never raises into the render."""

    def __init__(self, entries: Sequence[Backend], calls: Sequence[CallShape], device, dtype: torch.dtype, *,
                 worker: Optional[bool] = None):
        self.entries = [e for e in entries if e.prewarm is not None]
        self.calls = tuple(dict.fromkeys(CallShape(*c) for c in calls))
        self.device, self.dtype = torch.device(device), dtype
        self.worker = self.device.type == "cuda" if worker is None else worker
        self.record: dict = {"status": "running", "backends": [e.name for e in self.entries],
                             "calls": [list(c) for c in self.calls], "dtype": _dtype_name(dtype), "jobs": {}}
        self.marker = _marker(self) if self.worker else None
        if self.marker is not None and self.marker.is_file():
            self.worker = False
            self.record["worker_skipped"] = f"these kernels were compiled into this Triton cache before ({self.marker})"
        self.record["worker"] = self.worker
        self._proc: Optional[subprocess.Popen] = None
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="vdbench-attention-prewarm", daemon=True)
        self._thread.start()

    # ----- the thread -----

    def _run(self) -> None:
        rec = self.record
        try:
            if self.worker:
                t = time.perf_counter()
                self._start_worker()
                # meanwhile what the entries import here (no call: nothing compiled), paid by the first call otherwise
                for entry in self.entries:
                    entry.prewarm((), self.device, self.dtype)
                rec["jobs"]["imports_s"] = time.perf_counter() - t
                rec["worker_result"] = self._finish_worker()
                rec["jobs"]["worker_s"] = time.perf_counter() - t
            t = time.perf_counter()
            results, errors = {}, {}
            for entry in self.entries:
                try:
                    results[entry.name] = entry.prewarm(self.calls, self.device, self.dtype)
                except Exception as e:  # recorded per entry; the others still run
                    errors[entry.name] = _one_line(e)
                    log.warning("attention prewarm of %s failed:\n%s", entry.name, traceback.format_exc())
            rec["jobs"]["in_process_s"] = time.perf_counter() - t
            rec["results"] = results
            rec["compiled"] = sum(int((r or {}).get("compiled") or 0) for r in results.values())
            if errors:
                rec["status"], rec["errors"] = "failed", errors
                rec["error"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
            else:
                rec["status"] = "done"
                if self.worker and self.marker is not None:
                    _write_marker(self.marker, rec)
        except Exception as e:  # recorded, never raised: the first calls compile their own kernels instead
            self.close()
            rec["status"], rec["error"] = "failed", _one_line(e)
            log.warning("attention prewarm failed:\n%s", traceback.format_exc())
        finally:
            rec["seconds"] = time.perf_counter() - self._t0

    def _start_worker(self) -> None:
        """The entries' prewarm started in a worker process (compiling into Triton's on-disk cache)."""
        root = str(Path(__file__).resolve().parents[2])  # this vdbench's checkout, first on the worker's path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
                   OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen(self.worker_command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env)

    def _finish_worker(self) -> dict:
        """The worker's record once it ends, or RuntimeError with its last error line."""
        try:
            out, err = self._proc.communicate(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            raise RuntimeError(f"the prewarm worker ran past {WORKER_TIMEOUT_S:.0f} s") from None
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if self._proc.returncode != 0 or not lines:
            last = [ln for ln in err.strip().splitlines() if ln.strip()]
            raise RuntimeError(f"the prewarm worker exited {self._proc.returncode}: "
                               f"{last[-1].strip() if last else 'no output'}")
        return json.loads(lines[-1])

    def worker_command(self) -> list[str]:
        """The worker's command line: :func:`main` with the entries' names, the device, the dtype and the calls."""
        return [sys.executable, "-m", "vdbench.backends.prewarm", "--device", str(self.device), "--dtype",
                _dtype_name(self.dtype), "--calls", json.dumps([list(c) for c in self.calls]),
                *[a for e in self.entries for a in ("--backend", e.name)]]

    # ----- the render's side -----

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> dict:
        """Join the thread; the record: ``status`` (done / failed), ``seconds`` (the prewarm's wall time),
        ``waited_s`` (how long this call blocked), ``compiled`` (kernels the entries' prewarm handled in this
        process), ``results`` per entry, ``jobs`` (seconds per part), ``error`` where it failed."""
        t = time.perf_counter()
        self._thread.join()
        return {**self.record, "waited_s": time.perf_counter() - t}

    def close(self) -> None:
        """Stop the worker if it still runs (a render that ended before its first attention call)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()


def _triton_cache_dir() -> Optional[Path]:
    """Triton's on-disk cache (its knob, its environment variable, its default), None where Triton is absent."""
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(triton, "knobs", None)
    found = getattr(getattr(knobs, "cache", None), "dir", None) or os.environ.get("TRITON_CACHE_DIR")
    return Path(found) if found else Path.home() / ".triton" / "cache"


def _marker(prewarm: "Prewarm") -> Optional[Path]:
    """The marker a successful worker leaves for ``prewarm``'s kernels (see the module's doc), None where it can't
    be keyed (no Triton, no CUDA device to name)."""
    cache = _triton_cache_dir()
    if cache is None or not torch.cuda.is_available():
        return None
    import triton

    sources = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for f in sorted([*root.joinpath("backends").glob("*.py"), *root.joinpath("kernels").glob("*.py")]):
        sources.update(f.name.encode() + f.read_bytes())
    index = prewarm.device.index if prewarm.device.index is not None else torch.cuda.current_device()
    key = json.dumps([sorted(e.name for e in prewarm.entries), [list(c) for c in prewarm.calls],
                      _dtype_name(prewarm.dtype), torch.cuda.get_device_name(index),
                      list(torch.cuda.get_device_capability(index)), torch.__version__, triton.__version__,
                      sources.hexdigest()])
    return cache / "vdbench-prewarm" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _write_marker(path: Path, record: dict) -> None:
    """The marker written whole or not at all (a concurrent render reads either none or a complete one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({k: record[k] for k in ("backends", "calls", "dtype")}))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: every render then starts its worker, as without markers
        log.warning("the attention prewarm could not leave its marker in %s: %s", path.parent, e)


def start(entries: Sequence[Backend], calls: Sequence[CallShape], device, dtype: torch.dtype, *,
          worker: Optional[bool] = None) -> Optional[Prewarm]:
    """:class:`Prewarm` of the entries that have a ``prewarm`` for ``calls``; None when none has one or there is no
    call to compile for."""
    if not calls or not any(e.prewarm is not None for e in entries):
        return None
    return Prewarm(entries, calls, device, dtype, worker=worker)


def main(argv=None) -> int:
    """The worker: each ``--backend``'s ``prewarm`` for ``--calls`` on ``--device``; prints its record as one JSON
    line (exit 1 and the error on stderr when one fails)."""
    p = argparse.ArgumentParser(description="compile attention backends' first-call kernels ahead (a render's "
                                            "prewarm worker)")
    p.add_argument("--backend", action="append", required=True, help="a backend name, options allowed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", required=True, help="JSON list of [batch, heads, seq, heads_kv, seq_kv, head_dim]")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    calls = tuple(CallShape(*map(int, c)) for c in json.loads(args.calls))
    dtype = getattr(torch, args.dtype)
    results = {}
    for name in args.backend:
        entry = resolve(name)
        if entry.prewarm is None:
            print(f"error: backend {entry.name!r} has no prewarm", file=sys.stderr)
            return 1
        results[entry.name] = entry.prewarm(calls, torch.device(args.device), dtype)
    print(json.dumps({"results": results, "seconds": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
