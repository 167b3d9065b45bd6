"""The scheduler's step run ahead of the device (--scheduler_async): the same values, the checks it skips kept."""

import copy

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from vdbench.scheduler import (_ahead_copy_target, prewarm_scheduler, run_scheduler_ahead, run_scheduler_blocking,
                               settle_scheduler)


def _unipc():
    # Wan's scheduler settings: flow prediction, UniPC order 2 (the corrector's linear solve from the third step)
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                   solver_order=2)


def _steps(scheduler, n=6):
    scheduler.set_timesteps(n)
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 3, 4, 4, generator=g)
    for t in scheduler.timesteps:
        noise = torch.randn(sample.shape, generator=g).to(torch.bfloat16)
        sample = scheduler.step(noise, t, sample, return_dict=False)[0]
    return sample


def test_ahead_steps_equal_blocking_steps_and_count_their_solves():
    plain = _steps(_unipc())
    ahead = _unipc()
    record = run_scheduler_ahead(ahead)
    assert record == {"status": "on", "scheduler": "UniPCMultistepScheduler"}
    assert type(ahead).__name__ == "UniPCMultistepScheduler" and isinstance(ahead, UniPCMultistepScheduler)
    assert torch.equal(_steps(ahead), plain)
    made = settle_scheduler(ahead)
    # on a CPU nothing is copied to a device; the corrector solved from its third step on
    assert made["copies"] == 0 and made["solves"] >= 3
    assert settle_scheduler(ahead) == {"copies": 0, "solves": 0}  # reset for the next call
    assert settle_scheduler(_unipc()) is None  # a scheduler that does not run ahead


def test_a_copy_stays_ahead_and_blocking_undoes_it():
    ahead = _unipc()
    run_scheduler_ahead(ahead)
    run_scheduler_ahead(ahead)  # idempotent
    dry = copy.deepcopy(ahead)
    assert type(dry) is type(ahead)
    assert prewarm_scheduler(ahead, 4, "cpu", torch.bfloat16)["status"] == "done"
    run_scheduler_blocking(ahead)
    assert type(ahead) is UniPCMultistepScheduler and settle_scheduler(ahead) is None


class _Singular:
    """A scheduler whose step meets a singular system, as a multistep solver's corrector would."""

    def step(self):
        return torch.linalg.solve(torch.zeros(2, 2), torch.ones(2))


def test_a_failed_solve_raises_after_the_call():
    with pytest.raises(RuntimeError):  # what the blocking step does
        _Singular().step()
    ahead = _Singular()
    run_scheduler_ahead(ahead)
    ahead.step()  # no error here: the check that would wait for the device is skipped
    with pytest.raises(RuntimeError, match="singular system"):
        settle_scheduler(ahead)


@pytest.mark.parametrize("args,kwargs,ok", [
    (("cuda",), {}, True),
    ((torch.device("cuda", 1),), {}, True),
    ((), {"device": "cuda:0"}, True),
    (("cuda", torch.float32), {}, True),  # the same dtype
    (("cuda", torch.float64), {}, False),  # a conversion: left as it is
    (("cuda",), {"non_blocking": True}, False),
    (("cuda", None, False), {}, False),  # positional flags: left as they are
    (("cpu",), {}, False),
    ((torch.float64,), {}, False),
])
def test_which_copies_are_made_ahead(args, kwargs, ok):
    src = torch.tensor(0.5)
    assert (_ahead_copy_target(src, args, kwargs) is not None) is ok
    assert _ahead_copy_target(torch.zeros(5000), ("cuda",), {}) is None  # a sample, not a scalar
