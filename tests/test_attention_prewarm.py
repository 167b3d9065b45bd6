"""The attention prewarm (vdbench.backends.prewarm): a backend's first-call kernels compiled before the first step.

Checked on CPU: that a render starts it for the backends that have one (``Backend.prewarm``) with the call shapes its
real calls have (the family's ``attention_calls`` against a tiny render's calls), that the first attention call
waits for it and the wait is recorded, that a failing prewarm is said in one line and recorded while the render
finishes; that fav3_fp8's prewarm compiles exactly the specializations its real calls launch (under Triton's
interpreter, each launch's arguments specialized by Triton's own function); the worker's command and its failure.
What it saves on a GPU is measured by ``python3 bench/suite.py cold_fp8``.
"""

import json
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch

from vdbench import backends as B
from vdbench import families, parallel, pipelines
from vdbench import render as R
from vdbench.render import prewarm as RP
from vdbench.backends import prewarm as AP
from vdbench.backends.registry import Backend, CallShape, registered
from vdbench.numerics import exact_attention

from tests.conftest import triton_interpreter


def _cfg(tmp_path, **kw) -> R.RenderConfig:
    out = tmp_path / "results"
    base = dict(family="wan", task="t2v", model="tiny", prompt="a cat", negative_prompt="", height=64, width=96,
                num_frames=9, num_inference_steps=2, guidance_scale=5.0, seed=0, attention_type="sdpa",
                output_path=out / "x.mp4", timing_path=out / "timing.json", device="cpu")
    base.update(kw)
    return R.RenderConfig(**base)


def _toy(name, prewarm, seen=None):
    def fn(q, k, v, *, scale=None, is_causal=False):
        if seen is not None:
            seen.append((time.perf_counter(), CallShape(q.shape[0], q.shape[1], q.shape[2], k.shape[1], k.shape[2],
                                                        q.shape[3]), q.dtype))
        return exact_attention(q, k, v, scale=scale, is_causal=is_causal).to(q.dtype)

    return Backend(name, "exact attention with a prewarm (test)", fn=fn, kernel=name, no_lse_reason="test",
                   prewarm=prewarm)


@pytest.mark.slow  # one tiny render: ~18 s on the shared CPU machine, as any tiny render there
def test_a_render_prewarms_its_backends_for_the_calls_it_makes_waits_for_them_and_reports_a_failure(tmp_path,
                                                                                                   monkeypatch):
    """One tiny Wan render on a schedule of two backends with a prewarm, one of which fails: the other is given the
    render's device, dtype and exactly the call shapes the calls then have (self- and cross-attention); the first
    call waits for it (it is held until the calls begin) and the wait is recorded; the failure is one log line and
    the record's, and the render finishes."""
    waiting = threading.Event()
    seen, got = [], {}

    def ok(calls, device, dtype):
        assert waiting.wait(60)  # still running when the first call comes: it must wait for it
        time.sleep(0.3)
        got.update(calls=set(calls), device=device, dtype=dtype, done=time.perf_counter())
        return {"compiled": len(calls)}

    def bad(calls, device, dtype):
        raise RuntimeError("no compiler\nsecond line")

    real = AP.Prewarm.wait

    def wait(self):
        waiting.set()
        return real(self)

    monkeypatch.setattr(AP.Prewarm, "wait", wait)
    lines = []
    with registered(_toy("toy_pw_ok", ok, seen)), registered(_toy("toy_pw_bad", bad, seen)):
        R.render(_cfg(tmp_path, attention_type="toy_pw_ok@steps:0,toy_pw_bad", num_frames=5), log=lines.append)
    first = json.loads((tmp_path / "results" / "timing.json").read_text())[0]
    rec = first["attention_prewarm"]
    assert got["calls"] == {shape for _, shape, _ in seen} and len(got["calls"]) == 2  # self and cross
    assert got["device"] == torch.device("cpu") and got["dtype"] == torch.float32 == seen[0][2]
    assert got["done"] < seen[0][0]  # the first call came after the prewarm ended
    assert rec["status"] == "failed" and rec["backends"] == ["toy_pw_ok", "toy_pw_bad"] and rec["worker"] is False
    assert rec["results"] == {"toy_pw_ok": {"compiled": 2}} and rec["compiled"] == 2
    assert rec["errors"] == {"toy_pw_bad": "RuntimeError: no compiler"}
    assert sorted(map(tuple, rec["calls"])) == sorted(got["calls"])
    assert rec["waited_s"] >= 0.25 and first["one_time"]["attention_prewarm_wait_s"] == rec["waited_s"]
    warned = [ln for ln in lines if "attention prewarm" in ln]
    assert warned == ["warning: [toy_pw_ok@steps:0,toy_pw_bad] attention prewarm failed (toy_pw_bad: RuntimeError: "
                      "no compiler); the first attention calls compile their own kernels"]
    assert (tmp_path / "results" / "x.mp4").is_file() and first["step_times"]


def test_no_prewarm_without_the_capability_and_off_or_skipped_is_recorded(tmp_path, monkeypatch):
    """A backend without a prewarm starts nothing and records nothing; ``--attention_prewarm off``, torchrun and a
    family that gives no call shapes are recorded with the reason, a family rule that fails on the configs as a
    failure (the render says it in one line); no weight is loaded for any of it."""
    monkeypatch.setattr(pipelines.Model, "load", lambda *a, **k: pytest.fail("weights were loaded"))
    assert RP.start_attention(R.validate(_cfg(tmp_path))) == RP.AttentionStart(None, None)
    with registered(_toy("toy_pw", lambda calls, device, dtype: {})):
        off = RP.start_attention(R.validate(_cfg(tmp_path, attention_type="toy_pw", attention_prewarm=False)))
        assert off == RP.AttentionStart(None, {"status": "off", "backends": ["toy_pw"],
                                               "why": "--attention_prewarm off"})
        plan = R.validate(_cfg(tmp_path, attention_type="toy_pw"))
        shapeless = replace(plan, model=replace(plan.model, family=replace(plan.family, attention_calls=None)))
        start = RP.start_attention(shapeless)
        assert start.prewarm is None and start.record["status"] == "skipped"
        assert "Family.attention_calls" in start.record["why"] and not start.after_load
        torchrun = parallel.DistContext(parallel.ParallelSpec("diffusers", 2), 0, 2, 0, plan.device, "gloo")
        start = RP.start_attention(replace(plan, dctx=torchrun))
        assert start.prewarm is None and start.record["status"] == "skipped" and "torchrun" in start.record["why"]
        # configs the load reads (a hub id it downloads): skipped now, started again at the load's end
        unread = replace(plan, model=replace(plan.model, denoisers={}, vae=None))
        start = RP.start_attention(unread)
        assert start.prewarm is None and start.record["status"] == "skipped" and start.after_load

        def unreadable(*a):
            raise KeyError("num_attention_heads")

        broken = replace(plan, model=replace(plan.model, family=replace(plan.family, attention_calls=unreadable)))
        start = RP.start_attention(broken)
        assert start.prewarm is None and start.record == {"status": "failed", "backends": ["toy_pw"],
                                                          "error": "the call shapes: KeyError: 'num_attention_heads'"}


def test_the_call_shapes_of_the_real_models_are_the_bench_presets():
    """Wan 2.1 1.3B at 480p x 81 and CogVideoX-2b at 720x480 x 49, from their configs alone: the self-attention
    lengths of the attention bench's presets (which are the captured calls'), the Wan text's 512 tokens, CogVideoX's
    guidance batch of 2."""
    wan = pipelines.resolve("random:wan2.1-t2v-1.3b", "t2v", "wan")
    b, h, s, _, d = families.attention_presets()["wan2.1-1.3b-480p"]
    assert families.get("wan").attention_calls(wan.denoisers["transformer"][1], wan.vae[1], 480, 832, 81, 5.0,
                                               {}) == ((b, h, s, h, s, d), (b, h, s, h, 512, d))
    cog = pipelines.resolve("random:cogvideox-2b", "t2v", "cogvideox")
    _, h, s, _, d = families.attention_presets()["cogvideox-2b"]
    assert families.get("cogvideox").attention_calls(cog.denoisers["transformer"][1], cog.vae[1], 480, 720, 49, 6.0,
                                                     {}) == ((2, h, s, h, s, d),)


# ----- fav3_fp8's prewarm: the specializations its real calls launch -----

@pytest.fixture(scope="module")
def P():
    pytest.importorskip("triton")
    with triton_interpreter("vdbench.kernels.quant", "vdbench.kernels.fa3_prepass") as (_, fa3_prepass):
        yield fa3_prepass


def _recorder(monkeypatch, P):
    """Record, per launch of a pre-pass kernel, what Triton's JIT keys its compiled variant on -- each argument
    specialized by Triton's own function (dtype and 16-byte alignment of a pointer, an int's 1 / divisible-by-16
    class), the constexprs and warps -- for real launches (run under the interpreter) and compile-only ones."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    launched, warmed = set(), set()

    class Compiled:
        def _init_handles(self):
            pass

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def key(self, args, kw):
            return (self.name, tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args),
                    tuple(sorted(kw.items())))

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.add(self.key(args, kw))
                return self.fn[grid](*args, **kw)
            return launch

        def warmup(self, *args, grid, **kw):
            warmed.add(self.key(args, kw))
            return Compiled()

    for name in ("_reduce_kernel", "_quant_kernel", "_qkv_amax_kernel", "_qkv_quant_kernel"):
        monkeypatch.setattr(P, name, Recorder(name, getattr(P, name)))
    return launched, warmed


@pytest.mark.parametrize("spelling", ["fav3_fp8", "fav3_fp8:smooth_v=1", "fav3_fp8:smooth_k=1+rotate=hadamard"])
def test_the_fp8_prewarm_compiles_the_specializations_the_real_calls_launch(P, monkeypatch, spelling):
    """fav3_fp8's prewarm on meta tensors of a render's call shapes (self-attention, cross-attention to 16 text
    tokens, a batch of 2 and a batch of 1 -- Triton specializes an int equal to 1) compiles, kernel by kernel, the
    variants the real pre-pass then launches on real tensors of those shapes in the pipelines' layout (BHSD views of
    BSHD memory): the JIT's first call finds each one compiled."""
    from vdbench.backends import flash

    monkeypatch.setattr(flash, "_triton_prepass", lambda device: True)  # the Triton path, here interpreted
    monkeypatch.setattr(flash, "_fa3_module", lambda: None)
    launched, warmed = _recorder(monkeypatch, P)
    entry = B.resolve(spelling)
    calls = (CallShape(1, 2, 70, 2, 70, 64), CallShape(1, 2, 70, 2, 16, 64), CallShape(2, 2, 37, 2, 37, 64))
    rec = entry.prewarm(calls, torch.device("cpu"), torch.bfloat16)
    options = {k: entry.fn.keywords[k] for k in ("smooth_k", "rotate", "smooth_v")} if entry.bound else {}
    g = torch.Generator().manual_seed(0)
    for c in calls:
        q, k, v = ((torch.randn(c.batch, s, h, c.head_dim, generator=g) + 1).to(torch.bfloat16).transpose(1, 2)
                   for h, s in ((c.heads, c.seq), (c.heads_kv, c.seq_kv), (c.heads_kv, c.seq_kv)))
        flash._fp8_inputs(q, k, v, **options)
    assert launched and warmed == launched
    assert rec["compiled"] == rec["loaded"] and rec["compiled"] >= len(launched)


def test_the_fp8_prewarm_compiles_nothing_where_the_eager_pre_pass_runs():
    rec = B.resolve("fav3_fp8:smooth_v=1").prewarm((CallShape(1, 2, 8, 2, 8, 64),), torch.device("cpu"),
                                                   torch.bfloat16)
    assert rec == {"compiled": 0, "note": "the eager pre-pass runs here: nothing to compile"}


# ----- the worker -----

def test_the_worker_runs_each_named_entry_and_prints_its_record(capsys):
    assert AP.main(["--backend", "fav3_fp8:smooth_v=1", "--device", "cpu", "--calls", "[[1, 2, 8, 2, 8, 64]]"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["results"] == {"fav3_fp8:smooth_v=1": {"compiled": 0,
                                                      "note": "the eager pre-pass runs here: nothing to compile"}}
    prewarm = AP.Prewarm.__new__(AP.Prewarm)  # the command a render's worker runs, without starting one
    prewarm.entries, prewarm.device, prewarm.dtype = [B.resolve("fav3_fp8:smooth_v=1")], torch.device("cuda:1"), \
        torch.bfloat16
    prewarm.calls = (CallShape(1, 12, 32760, 12, 512, 128),)
    cmd = prewarm.worker_command()
    assert cmd[1:] == ["-m", "vdbench.backends.prewarm", "--device", "cuda:1", "--dtype", "bfloat16", "--calls",
                       "[[1, 12, 32760, 12, 512, 128]]", "--backend", "fav3_fp8:smooth_v=1"]


def test_a_failing_worker_is_recorded_in_one_line_and_nothing_runs_after_it(monkeypatch):
    """The worker's last error line is the record's error; the entry's in-process part does not run after it."""
    ran = []
    monkeypatch.setattr(AP.Prewarm, "worker_command",
                        lambda self: [sys.executable, "-c",
                                      "import sys; print('Traceback ...', file=sys.stderr); "
                                      "sys.exit('error: CUDA driver too old')"])
    with registered(_toy("toy_pw_w", lambda calls, device, dtype: ran.append(calls) or {})) as entry:
        rec = AP.start([entry], [CallShape(1, 2, 8, 2, 8, 64)], "cpu", torch.float32, worker=True).wait()
    assert rec["status"] == "failed" and rec["error"] == "RuntimeError: the prewarm worker exited 1: error: CUDA " \
                                                         "driver too old"
    assert ran == [()]  # beside the worker, the entry's imports alone; nothing in-process after its failure
    assert rec["waited_s"] >= 0 and rec["seconds"] >= 0


def test_a_worker_that_succeeded_leaves_a_marker_and_the_next_prewarm_skips_its_worker(monkeypatch, tmp_path):
    """Kernels compiled into the on-disk cache before: the next prewarm of the same key runs in-process at once."""
    marker = tmp_path / "vdbench-prewarm" / "key"
    monkeypatch.setattr(AP, "_marker", lambda prewarm: marker)
    monkeypatch.setattr(AP.Prewarm, "worker_command",
                        lambda self: [sys.executable, "-c", "print('{\"results\": {}, \"seconds\": 0.0}')"])
    ran = []
    with registered(_toy("toy_pw_m", lambda calls, device, dtype: ran.append(calls) or {"compiled": len(calls)})) \
            as entry:
        first = AP.start([entry], [CallShape(1, 2, 8, 2, 8, 64)], "cpu", torch.float32, worker=True).wait()
        assert first["status"] == "done" and first["worker"] is True and "worker_skipped" not in first
        assert marker.is_file() and json.loads(marker.read_text())["backends"] == ["toy_pw_m"]
        ran.clear()
        second = AP.start([entry], [CallShape(1, 2, 8, 2, 8, 64)], "cpu", torch.float32, worker=True).wait()
    assert second["status"] == "done" and second["worker"] is False and "worker_result" not in second
    assert str(marker) in second["worker_skipped"] and second["compiled"] == 1
    assert ran == [(CallShape(1, 2, 8, 2, 8, 64),)]  # the in-process part alone, no import-only pass


def test_a_failed_worker_leaves_no_marker(monkeypatch, tmp_path):
    marker = tmp_path / "m"
    monkeypatch.setattr(AP, "_marker", lambda prewarm: marker)
    monkeypatch.setattr(AP.Prewarm, "worker_command", lambda self: [sys.executable, "-c", "import sys; sys.exit(3)"])
    with registered(_toy("toy_pw_f", lambda calls, device, dtype: {})) as entry:
        rec = AP.start([entry], [CallShape(1, 2, 8, 2, 8, 64)], "cpu", torch.float32, worker=True).wait()
    assert rec["status"] == "failed" and not marker.exists()
