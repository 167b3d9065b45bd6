"""StepTimer's host side: the garbage collector's pauses, step by step, in a pipeline call it runs."""

import gc

import pytest

from vdbench.timing import StepTimer


class _Pipe:
    """Three steps; a full collection in the second."""

    def __call__(self, callback_on_step_end, **kwargs):
        for i in range(3):
            if i == 1:
                gc.collect()
            callback_on_step_end(self, i, 0, {})
        return "out"


def test_gc_pauses_land_in_their_step_and_the_callback_leaves_with_the_call():
    before = list(gc.callbacks)
    t = StepTimer("cpu")
    assert t.run_pipe(_Pipe()) == "out"
    h = t.host()
    assert len(h["gc_ms_per_step"]) == 3 and h["gc_ms_per_step"][1] > 0
    assert h["gc_collections"][2] >= 1 and h["gc_ms"] == pytest.approx(sum(h["gc_ms_per_step"]), abs=1e-2)
    assert gc.callbacks == before  # no callback left behind


def test_the_callback_leaves_on_an_error_too():
    before = list(gc.callbacks)

    def boom(callback_on_step_end, **kwargs):
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        StepTimer("cpu").run_pipe(boom)
    assert gc.callbacks == before
