"""scheduler.prewarm_scheduler: the dry run a render makes of its scheduler during the load (on a GPU it moves
cuSOLVER's first-call load out of Wan's third step). Run here on the CPU: what it drives, and what it leaves alone."""

import torch
from diffusers import UniPCMultistepScheduler

from vdbench.scheduler import prewarm_scheduler


def _wan_scheduler():
    # the config Wan's checkpoints ship (vdbench.families.wan): UniPC in flow-prediction mode
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                   flow_shift=3.0)


def test_the_dry_run_reaches_the_solve_and_leaves_the_render_as_it_was(monkeypatch):
    sched = _wan_scheduler()
    sched.set_timesteps(5)
    before = (sched.timesteps.clone(), sched.step_index, torch.random.get_rng_state())
    solves = []
    real = torch.linalg.solve
    monkeypatch.setattr(torch.linalg, "solve", lambda *a, **k: solves.append(1) or real(*a, **k))
    rec = prewarm_scheduler(sched, 5, torch.device("cpu"), torch.bfloat16)
    assert rec["status"] == "done" and rec["steps"] == 5 and rec["s"] >= 0, rec
    assert solves, "the multistep solver's torch.linalg.solve (its third step on) was not reached"
    # the pipeline's scheduler and the random streams are untouched: the render's frames don't depend on it
    assert torch.equal(sched.timesteps, before[0]) and sched.step_index == before[1]
    assert torch.equal(torch.random.get_rng_state(), before[2])


def test_a_scheduler_it_cant_drive_is_skipped_with_the_reason():
    from diffusers import CogVideoXDPMScheduler

    rec = prewarm_scheduler(CogVideoXDPMScheduler(), 4, torch.device("cpu"), torch.float32)
    assert rec["status"] == "skipped" and rec["why"].startswith("CogVideoXDPMScheduler:"), rec
