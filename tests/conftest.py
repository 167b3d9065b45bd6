"""Session-wide test setup.

Triton decides at decoration time whether a ``@triton.jit`` function is compiled or interpreted, and Triton's own
standard library (``tl.max``, ``tl.cdiv`` ...) is decorated when ``triton`` is first imported. Some tests import
triton indirectly (torch.compile, torchao) before tests/test_kernels.py turns the interpreter on for the project's
kernels; an interpreted kernel calling a compiled standard-library function then fails ("Cannot call @triton.jit'd
outside of the scope of a kernel"). On a machine without a GPU -- where only the interpreter can run Triton at all --
triton is therefore imported once here with the interpreter on; the variable itself is restored at once, so every
other test sees the environment it expects (the kernels' availability probes read it).
"""

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

def _restore_env(name: str, old) -> None:
    """Put an environment variable back as it was (unset if it was)."""
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker's torch gets its share of the cores (and so do the processes its tests
    start, through OMP_NUM_THREADS). The suite runs more workers than a 2-core machine has cores (many tests wait
    on subprocesses); with torch's default of one OpenMP thread per core in every worker, the threads of a
    parallel region spin for their descheduled peers: measured on 2 cores, four compute-bound test files took 399
    CPU-s that way and 172 with one thread per worker, in the same wall time."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_the_cores()


if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    finally:
        _restore_env("TRITON_INTERPRET", _old)


@contextlib.contextmanager
def triton_interpreter(*module_names: str):
    """Triton's interpreter for the body when there is no GPU; yields the named kernel modules (imported, or
    re-imported, under it: Triton decides compiled vs interpreted when ``@triton.jit`` decorates, i.e. at import).
    The variable is restored afterwards, so other test modules see the environment they expect; the kernels'
    availability probes read it while the body runs. With a GPU nothing changes: the kernels compile."""
    old = os.environ.get("TRITON_INTERPRET")
    interpret = not torch.cuda.is_available()
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = [importlib.import_module(name) for name in module_names]
        if interpret:
            mods = [m if getattr(m, "INTERPRETED", False) else importlib.reload(m) for m in mods]
        yield mods
    finally:
        _restore_env("TRITON_INTERPRET", old)


@pytest.fixture
def checkout_env() -> dict:
    """``os.environ`` with this checkout first on PYTHONPATH, for the scripts a test starts (bench/*.py run as files
    have their own folder as ``sys.path[0]``; torchrun children likewise): they import the vdbench under test, as a
    device run does with ``PYTHONPATH=$PWD``, never another installed copy."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.fixture(scope="session")
def vdbench_cache(tmp_path_factory):
    """One temporary tiny-model cache for the whole session (builds are shared between the tests that use it):
    models built here, in this run, by this machine's arithmetic, never ones a persistent cache kept."""
    return tmp_path_factory.mktemp("vdbench_cache")


@pytest.fixture(scope="module")
def fork_python(tmp_path_factory):
    """A ``python`` for the shell scripts a test runs (``PYTHON=...``) whose every call is a child forked from the test
    process (tests/launch.py ``PythonServer``): the scripts' logic unchanged, without a fresh interpreter's imports
    per call."""
    from tests.launch import PythonServer

    with PythonServer(tmp_path_factory.mktemp("python")) as server:
        yield server.python
