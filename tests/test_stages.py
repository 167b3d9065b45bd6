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
    st.remove()
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
