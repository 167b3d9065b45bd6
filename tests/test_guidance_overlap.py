"""--guidance_overlap: the two guidance branches on two host threads taking turns (vdbench.parallel.Baton,
interleaved). The end-to-end render over gloo (frames identical to one process) is in tests/test_parallel.py."""

import threading
import time

import pytest
import torch

from vdbench import families
from vdbench import parallel as P

WAN, COG = families.get("wan"), families.get("cogvideox")


def _branch(name, log, layers=2, fail_at=None):
    """A denoiser call as the Ulysses processor phases it: per layer projections (P), attention (F), the rest (R),
    with a turn at the processor's entry, after Q/K/V are sent and after the output's exchange starts."""
    def run():
        log.append((name, "pre"))
        for i in range(layers):
            P.turn()
            log.append((name, f"P{i}"))
            if fail_at == f"P{i}":
                raise RuntimeError(f"{name} failed")
            P.turn()
            log.append((name, f"F{i}"))
            P.turn()
            log.append((name, f"R{i}"))
        log.append((name, "post"))
        return name
    return run


def test_branches_alternate_offset_by_one_phase_so_each_exchange_has_the_others_gemms_beside_it():
    log = []
    a, b, passes = P.interleaved(_branch("A", log), _branch("B", log), "cpu")
    assert (a, b) == ("A", "B")
    # the host order is the stream's order: A's attention, B's projections, A's rest, B's attention, ...
    assert log == [("A", "pre"), ("A", "P0"), ("A", "F0"), ("B", "pre"), ("B", "P0"), ("A", "R0"), ("B", "F0"),
                   ("A", "P1"), ("B", "R0"), ("A", "F1"), ("B", "P1"), ("A", "R1"), ("A", "post"), ("B", "F1"),
                   ("B", "R1"), ("B", "post")]
    assert passes == 8
    # the same order every time: it follows from the code, never from thread timing
    again = []
    P.interleaved(_branch("A", again), _branch("B", again), "cpu")
    assert again == log


def test_a_failing_branch_stops_both_and_its_error_reaches_the_caller():
    for failing in ("A", "B"):
        log = []
        first = _branch("A", log, fail_at="P1" if failing == "A" else None)
        second = _branch("B", log, fail_at="P0" if failing == "B" else None)
        with pytest.raises(RuntimeError, match=f"{failing} failed"):
            P.interleaved(first, second, "cpu")
        assert ("A", "post") not in log and ("B", "post") not in log, log  # the other branch stopped too
        assert sum(t.name == "vdbench-guidance-branch" for t in threading.enumerate()) <= 1  # one, kept
    assert P.turn() is None  # outside a pair a turn is nothing


def test_the_helper_thread_runs_with_the_callers_grad_mode():
    seen = {}

    def second():
        seen["grad"], seen["inference"] = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    with torch.inference_mode():
        P.interleaved(lambda: None, second, "cpu")
    assert seen == {"grad": False, "inference": True}
    with torch.no_grad():
        P.interleaved(lambda: None, second, "cpu")
    assert seen == {"grad": False, "inference": False}


def test_guidance_overlap_applies_only_where_its_turns_and_two_calls_are():
    u2 = P.ParallelSpec("diffusers", 2, 1)
    ok = dict(guidance_scale=5.0, cache=False, compiled=False, sparse=False)
    assert P.guidance_overlap_refusal(u2, WAN, **ok) is None
    assert P.guidance_overlap_refusal(P.ParallelSpec("auto", 2, 1), WAN, **ok) is None
    for spec in (P.ParallelSpec("diffusers", 2, 1, use_cfg_parallel=True), P.ParallelSpec("diffusers", 2, 2),
                 P.ParallelSpec("diffusers", 2, 1, async_exchange=False), P.ParallelSpec("xfuser", 2, 1),
                 P.ParallelSpec("diffusers", 2, 1, head_chunks=2)):
        assert "interleaves Ulysses exchanges" in P.guidance_overlap_refusal(spec, WAN, **ok), spec
    assert "one batch" in P.guidance_overlap_refusal(u2, COG, **ok)
    assert "one branch per step" in P.guidance_overlap_refusal(u2, WAN, **{**ok, "guidance_scale": 1.0})
    for key, word in (("cache", "step cache"), ("compiled", "compile"), ("sparse", "sparse"),
                      ("sharded", "--offload shard")):
        assert word in P.guidance_overlap_refusal(u2, WAN, **{**ok, key: True})
    with pytest.raises(ValueError, match="--guidance_overlap on interleaves"):
        P.ParallelSpec("diffusers", 2, 1, use_cfg_parallel=True, guidance_overlap=True).validate()


def test_settling_records_why_it_is_off_and_refuses_on_where_it_cant_apply():
    class Ctx:
        distributed = True
        spec = P.ParallelSpec("diffusers", 2, 1)

    ctx = Ctx()
    P.settle_guidance_overlap(ctx, None)
    assert ctx.spec.guidance_overlap is P.GUIDANCE_OVERLAP_AUTO
    ctx.spec = P.ParallelSpec("diffusers", 2, 1)
    P.settle_guidance_overlap(ctx, "not with a step cache")
    assert ctx.spec.guidance_overlap is False and ctx.spec.guidance_overlap_reason == "not with a step cache"
    ctx.spec = P.ParallelSpec("diffusers", 2, 1, guidance_overlap=True)
    with pytest.raises(ValueError, match="--guidance_overlap on: not with a step cache"):
        P.settle_guidance_overlap(ctx, "not with a step cache")
    ctx.spec = P.ParallelSpec("diffusers", 2, 1, guidance_overlap=False)
    P.settle_guidance_overlap(ctx, None)
    assert ctx.spec.guidance_overlap is False and ctx.spec.guidance_overlap_reason == "--guidance_overlap off"
    one = P.OneProcess(torch.device("cpu"))
    P.settle_guidance_overlap(one, "anything")  # one process: nothing to settle
    assert one.spec == P.ParallelSpec()


def test_a_forked_process_gets_its_own_helper_thread():
    """fork copies the calling thread only: a child forked after the helper started (the tests' fork server, a
    launcher forking its workers) must not hand its second branch to a thread it does not have."""
    import os

    P.interleaved(lambda: None, lambda: None, "cpu")  # the helper runs in this process
    pid = os.fork()
    if pid == 0:  # the child: a pair must complete (the parent's wait below times out otherwise)
        try:
            log = []
            P.interleaved(_branch("A", log), _branch("B", log), "cpu")
            os._exit(0 if ("B", "post") in log else 3)
        except BaseException:
            os._exit(4)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's interleaved pair hung: its helper thread was the parent's")
