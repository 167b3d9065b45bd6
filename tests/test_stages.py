"""vdbench.stages: the stage timers hook modules and instance methods without touching the classes, read their
clocks at the end, mark the first denoiser call, and the breakdown adds the stages up with the rest named."""

import contextlib
import time
import types

import pytest
import torch

from vdbench import stages as S


class _Sleeper(torch.nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, x):
        time.sleep(self.s)
        return x


class _VAE:
    def encode(self, x):
        time.sleep(0.01)
        return x * 2


def test_call_timer_on_a_forward():
    m = _Sleeper(0.01)
    t = S.CallTimer(m, "cpu")
    assert t.seconds() is None  # not called: no such stage
    m(torch.ones(1))
    m(torch.ones(1))
    assert len(t.spans) == 2 and 0.02 <= t.seconds() < 1.0
    t.reset()
    assert t.seconds() is None
    t.remove()
    m(torch.ones(1))
    assert t.spans == [] and not m._forward_pre_hooks and not m._forward_hooks


def test_call_timer_on_an_instance_method():
    vae, other = _VAE(), _VAE()
    entered = []

    @contextlib.contextmanager
    def around():
        entered.append(1)
        yield

    t = S.CallTimer(vae, "cpu", method="encode", around=around)
    assert vae.encode(3) == 6 and other.encode(1) == 2  # same result; the other instance is not timed
    assert len(t.spans) == 1 and entered == [1] and t.seconds() >= 0.01
    assert "encode" not in vars(other) and _VAE.encode.__name__ == "encode"
    with pytest.raises(ValueError, match="already replaced"):
        S.CallTimer(vae, "cpu", method="encode")
    t.remove()
    assert "encode" not in vars(vae) and vae.encode(1) == 2 and len(t.spans) == 1


def test_stage_timers_of_a_pipeline():
    """The encoders the pipeline has (text, image, VAE encode) and the first call of any denoiser."""
    pipe = types.SimpleNamespace(text_encoder=_Sleeper(0.0), image_encoder=None, vae=_VAE())
    d1, d2 = _Sleeper(0.0), _Sleeper(0.0)
    st = S.StageTimers(pipe, [d1, d2], "cpu")
    assert set(st.timers) == {"text_encode", "vae_encode"}
    pipe.text_encoder(torch.ones(1))
    pipe.vae.encode(1)
    d2(torch.ones(1))
    first = st.denoise_start
    d1(torch.ones(1))
    assert first is not None and st.denoise_start is first  # the first call only
    assert st.seconds("image_encode") is None and st.seconds("vae_encode") >= 0.01
    st.reset()
    assert st.denoise_start is None and st.seconds("vae_encode") is None
    st.close()
    assert "encode" not in vars(pipe.vae) and not d1._forward_pre_hooks


def test_breakdown_adds_up_and_names_the_rest():
    b = S.breakdown(10.0, {"text_encode": 0.5, "image_encode": None, "vae_encode": 1.0, "denoise": 7.0,
                           "vae_decode": 1.2}, before_denoise=0.2, after_denoise=0.1)
    assert list(b["stages"]) == list(S.STAGES) and b["stages"]["image_encode"] is None
    assert b["unaccounted"] == pytest.approx(0.3) and b["unaccounted_share"] == pytest.approx(0.03)
    assert b["unaccounted_where"] == {"before_denoise": 0.2, "after_denoise": 0.1}
    with pytest.raises(ValueError, match="unknown stage"):
        S.breakdown(1.0, {"decode": 1.0})
    line = S.describe({**b, "total_time": 10.0, "step_times": [3.5, 3.5]})
    assert line == ("stages: text encode 0.500 s, VAE encode 1.000 s, denoising 7.000 s (2 steps), VAE decode "
                    "1.200 s; unaccounted 0.300 s (3.0% of 10.00 s: 0.200 before the denoising, 0.100 after)")


def test_end_to_end_stages_and_unaccounted_add_up_exactly():
    stages = {"startup": 6.1, "load": 9.2, "warmup_calls": None, "text_encode": 0.4, "image_encode": None,
              "vae_encode": None, "denoise": 24.0, "vae_decode": 1.1, "write": 0.3}
    e = S.end_to_end(41.3, stages, in_repetitions=0.05)
    assert list(e["stages"]) == list(S.END_TO_END_STAGES) and e["stages"]["warmup_calls"] is None
    assert sum(v for v in e["stages"].values() if v is not None) + e["unaccounted"] == 41.3  # by construction
    assert e["unaccounted"] == pytest.approx(0.2) and e["unaccounted_share"] == pytest.approx(0.2 / 41.3)
    assert e["unaccounted_where"] == {"in_repetitions": 0.05, "outside": pytest.approx(0.15)}
    assert S.end_to_end(1.0, {"load": 0.5})["unaccounted_where"] == {"in_repetitions": None, "outside": None}
    with pytest.raises(ValueError, match="unknown stage"):
        S.end_to_end(1.0, {"loading": 1.0})


def test_merge_one_time_takes_what_a_stage_reports_under_its_prefix():
    section = {"load_s": 2.0}
    info = {"path": "fast", "one_time": {"prewarm_s": 0.25, "plan_s": 1, "label": "x", "flag": True}}
    assert S.merge_one_time(section, "vae_decode", info) is section
    assert section == {"load_s": 2.0, "vae_decode.prewarm_s": 0.25, "vae_decode.plan_s": 1.0}
    S.merge_one_time(section, "vae_encode", {"one_time": {"a_s": 0.1, "b_s": 0.2}}, keys={"b_s"})
    assert section["vae_encode.b_s"] == 0.2 and "vae_encode.a_s" not in section
    assert S.merge_one_time({}, "vae_decode", None) == {} and S.merge_one_time({}, "vae_decode", {}) == {}


def _rep(first, warm, decode, total, one_time=None, warmup_calls=0, pipe=None):
    return {"first_step": first, "warm_step_median": warm, "vae_decode_time": decode, "total_time": total,
            "pipe_time": pipe if pipe is not None else total - decode, "one_time": one_time,
            "run": {"settings": {"warmup_calls": warmup_calls}}}


def test_one_time_adds_each_cost_once():
    # the decode reported its own one-time cost: counted, and the first decode's excess (the same cost, seen
    # between repetitions) is shown but not added again
    reps = [_rep(1.5, 1.0, 2.0, 10.0, {"load_s": 5.0, "warmup_calls_s": None, "compile_s": None,
                                      "vae_decode.prewarm_s": 0.4}),
            _rep(1.1, 1.0, 1.5, 9.0, {"compile_s": None}), _rep(1.1, 1.0, 1.7, 9.0, {})]
    S.one_time(reps)
    first = reps[0]["one_time"]
    assert first["first_step_excess_s"] == pytest.approx(0.5) and first["first_decode_excess_s"] == pytest.approx(0.4)
    assert first["total_s"] == pytest.approx(0.5 + 0.4) and first["load_s"] == 5.0  # load apart, not added
    assert reps[0]["steady_s"] == pytest.approx(10.0 - 0.9)
    assert set(reps[1]["one_time"]) == {"compile_s", "first_step_excess_s", "total_s"}
    assert reps[1]["one_time"]["total_s"] == pytest.approx(0.1) and reps[1]["steady_s"] == pytest.approx(8.9)
    # no reported decode cost: the first decode's excess over the later ones' median is the decode's one-time cost
    reps = [_rep(1.5, 1.0, 2.0, 10.0, {"load_s": 5.0}), _rep(1.1, 1.0, 1.5, 9.0), _rep(1.1, 1.0, 1.7, 9.0)]
    assert S.one_time(reps)[0]["one_time"]["total_s"] == pytest.approx(0.5 + 0.4)


def test_one_time_of_warm_up_calls_and_renders_without_a_warm_step():
    # one warm-up call of 12 s where a steady pipeline call takes 8 - 0.1: 4.1 s paid once; torch.compile's 3 s
    # and the encode's cost reported during the warm-up are inside it (shown, not added)
    (e,) = S.one_time([_rep(1.1, 1.0, 2.0, 10.0, {"load_s": 5.0, "warmup_calls_s": 12.0, "compile_s": 3.0,
                                                  "warmup_calls.vae_encode.build_s": 0.7}, warmup_calls=1)])
    once = e["one_time"]
    assert once["warmup_calls_excess_s"] == pytest.approx(12.0 - (8.0 - 0.1))
    assert once["total_s"] == pytest.approx(0.1 + 4.1) and once["first_decode_excess_s"] is None
    assert e["steady_s"] == pytest.approx(10.0 - 0.1)  # the warm-up's cost was not paid inside the repetition
    (e,) = S.one_time([_rep(2.0, None, 1.0, 3.0, {"load_s": 1.0})])  # one step: no warm step, no excess known
    assert e["one_time"]["first_step_excess_s"] is None and e["one_time"]["total_s"] == 0.0


def test_describe_end_to_end():
    entry = {"end_to_end_s": 41.3, "end_to_end": {"since": "process start", "repetitions": 1, **S.end_to_end(
        41.3, {"startup": 6.1, "load": 9.2, "denoise": 24.0, "vae_decode": 1.1, "write": 0.3})},
        "one_time": {"load_s": 9.2, "first_step_excess_s": 1.9, "compile_s": 1.7, "total_s": 1.9}}
    assert S.describe_end_to_end(entry) == (
        "end-to-end 41.30 s (process start to the video on disk: startup 6.10, load 9.20, denoising 24.00, "
        "VAE decode 1.10, write 0.30, unaccounted 0.60, 1.5%); one-time 1.90 s beyond the steady work (first step "
        "+1.90, compile 1.70 within them), load 9.20 s")
    assert S.describe_end_to_end({"end_to_end_s": None}) is None
