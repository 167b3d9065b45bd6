"""Attention schedules (vdbench/patching/schedule.py): the grammar and its one spelling, which backend serves which
(step, block), every backend pair through one patch (quantized too), the tile order switched per forward, counts
per kernel and step, and the refusals -- all before the model loads."""

import dataclasses
import json
import re

import pytest
import torch

from vdbench import backends as B
from vdbench import families, render
from vdbench.patching import AttentionPatch
from vdbench.patching.schedule import (Schedule, ScheduleError, as_schedule, layer_index, parse_schedule,
                                       resolve_attention)
from tests.test_patching import run, small_wan, wan_inputs

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SMALL_STA = "sta:window=1x3x1,tile=2x2x4,block=16"  # small_wan's 3x4x4 grid: tiles of 16 and 8 tokens, padded


# ----- grammar -----

def test_rules_ranges_options_and_the_one_spelling():
    s = parse_schedule("fav3@steps:0-9,sta")
    assert [(r.backend.name, r.steps, r.layers) for r in s.rules] == [("fav3", ((0, 9),), None), ("sta", None, None)]
    assert s.name == "fav3@steps:0-9,sta" and [b.name for b in s.members] == ["fav3", "sta"]
    s = parse_schedule(" native @ steps : 0-4 + 45- @layers:3,sta:tile=6x8x8,window=3x5x5@steps:5-9, fa3")
    assert s.name == "sdpa@steps:0-4+45-@layers:3,sta:window=3x5x5@steps:5-9,fav3"  # aliases and options canonical
    assert parse_schedule(s.name).name == s.name
    assert resolve_attention("sagev1_emu") is B.resolve("sagev1_emu")  # a plain name is a backend
    assert as_schedule("sdpa").is_single and as_schedule("sdpa").name == "sdpa"


MALFORMED = {
    "": "empty attention schedule",
    "fav3@steps:0-9": "the last rule serves every other call",
    "fav3,sta": "only the last rule may be a plain backend",
    "fav3@stp:0,sta": "selector 'stp:0' is not steps:RANGES",
    "fav3@steps:0@steps:1,sta": "steps given twice",
    "fav3@steps:9-3,sta": "ends before it starts",
    "fav3@steps:a,sta": "'a' is not N, N-M or N-",
    "@steps:0,sta": "no backend before '@'",
}


def test_malformed_schedules_say_what_is_wrong():
    for text, fragment in MALFORMED.items():
        with pytest.raises(ScheduleError, match=re.escape(fragment)) as e:
            parse_schedule(text)
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_unknown_backends_and_bad_options_in_a_schedule_are_the_registrys_refusals():
    with pytest.raises(B.BackendUnavailable, match="did you mean 'fav3'"):
        parse_schedule("fav33@steps:0,sta")
    with pytest.raises(B.BackendUnavailable, match="even size"):
        parse_schedule("fav3@steps:0,sta:window=2x3x3")


def test_which_backend_serves_which_step_and_block():
    s = parse_schedule("reference@steps:0-1@layers:0,sdpa@steps:0-1+8-,sagev1_emu@layers:2-3,fp8_emu")
    at = lambda step, layer: s.at(step, layer).name  # noqa: E731
    assert at(0, 0) == "reference" and at(1, 0) == "reference" and at(0, 1) == "sdpa"
    assert at(8, 0) == "sdpa" and at(20, 5) == "sdpa"  # open range
    assert at(4, 2) == "sagev1_emu" and at(4, 3) == "sagev1_emu" and at(4, 4) == "fp8_emu" and at(4, 0) == "fp8_emu"
    assert at(4, None) == "fp8_emu"  # block unknown (under compile): only step rules can match
    assert s.by_layer and s.emulated and s.kernel.split("; ")[0] == B.resolve("reference").kernel
    assert layer_index("blocks.3.attn1") == 3 and layer_index("transformer_blocks.12.attn1") == 12
    assert layer_index("attn") is None


def test_kind_rules_select_calls_by_kind():
    s = parse_schedule("fa3 @ kind: cross ,sta")
    assert s.name == "fav3@kind:cross,sta" and s.rules[0].kinds == ("cross",)
    at = lambda kind, step=0: s.at(step, None, kind).name  # noqa: E731
    assert at("cross") == "fav3" and at("cross+img") == "fav3" and at("cross_img") == "fav3"
    assert at("self") == "sta" and at("joint") == "sta" and at(None) == "sta"  # unknown kind: no kind rule matches
    s = parse_schedule("reference@kind:self+joint@steps:0,sdpa@kind:cross,sta")
    assert s.name == "reference@steps:0@kind:self+joint,sdpa@kind:cross,sta"
    assert s.at(0, None, "joint").name == "reference" and s.at(1, None, "joint").name == "sta"
    assert s.at(1, None, "cross").name == "sdpa" and "on steps:0@kind:self+joint" in s.description
    for bad, says in (("fav3@kind:text,sta", "kind 'text' is not one of self, cross, joint"),
                      ("fav3@kind:cross@kind:self,sta", "kind given twice"),
                      ("fav3@kind,sta", "is not steps:RANGES, layers:RANGES or kind:KINDS")):
        with pytest.raises(ScheduleError, match=re.escape(says)):
            parse_schedule(bad)


# ----- refusals that need no weights -----

def test_check_plan_refusals():
    s = parse_schedule("sdpa@steps:10-19,sta")
    with pytest.raises(ScheduleError, match="steps 10-19 lie beyond the run's 4 denoising steps"):
        s.check_plan(num_steps=4, compiled=False, grid_family="wan")
    s.check_plan(num_steps=11, compiled=False, grid_family="wan")
    with pytest.raises(ScheduleError, match="by layers can't run under --use_torch_compile"):
        parse_schedule("sdpa@layers:0,fav3").check_plan(num_steps=4, compiled=True, grid_family=None)
    with pytest.raises(B.BackendUnavailable, match="'sta' needs the token grid .* this model family does not"):
        as_schedule("sta").check_plan(num_steps=4, compiled=False, grid_family=None)
    from vdbench.parallel import ParallelSpec

    # under diffusers' Ulysses a pattern runs (each rank's attention holds the whole sequence); ring and xfuser refuse
    parse_schedule("fav3@steps:0,radial").check_plan(num_steps=4, compiled=False, grid_family="wan",
                                                    parallel=ParallelSpec("diffusers", ulysses_degree=2))
    for spec, message in ((ParallelSpec("diffusers", 2, 2), "'radial' can't serve ring attention \\(--ring_degree 2\\)"
                                                            ": .*\nuse --ulysses_degree alone"),
                          (ParallelSpec("xfuser", 2), "under --parallel_engine xfuser: xfuser pads the sequence")):
        with pytest.raises(B.BackendUnavailable, match=message) as e:
            parse_schedule("fav3@steps:0,radial").check_plan(num_steps=4, compiled=False, parallel=spec,
                                                            grid_family="wan")
        assert len(str(e.value).splitlines()) == 2
    as_schedule("fav3").check_plan(num_steps=4, compiled=True, parallel=ParallelSpec("diffusers", 1, 2),
                                   grid_family=None)  # nothing to refuse
    with pytest.raises(ScheduleError, match="layers 7 lie beyond the model's blocks"):
        parse_schedule("sdpa@layers:7,fav3").check_layers([0, 1, None])


@pytest.fixture
def no_load(monkeypatch):
    """Any attempt to load a model fails the test: the refusals must come first."""
    import vdbench.pipelines as P

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(P, "load_pipeline", refuse)


@pytest.mark.parametrize("argv, fragment", [
    (["--attention_type", "sta:window=2x3x3"], "even size"),
    (["--attention_type", "sta:window"], "is not key=value"),
    (["--attention_type", "fav3:window=3x3x3"], "'fav3' takes no options"),
    (["--attention_schedule", "sdpa@steps:4-,sta"], "lie beyond the run's 4 denoising steps"),
    (["--attention_schedule", "sdpa@layers:0,sta", "--use_torch_compile"], "by layers can't run under"),
    (["--attention_schedule", "sdpa@steps:0,sta", "--attention_type", "fav3"], "not both"),
    (["--attention_schedule", "sdpa@steps:0-1"], "takes no selector"),
])
def test_refusals_are_one_line_and_come_before_the_model_loads(no_load, tmp_path, capsys, argv, fragment):
    import run_wan

    assert run_wan.main(["--model", "tiny", "--output_dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and len(err.splitlines()) == 1, err


def _cfg(tmp_path, **kw):
    base = dict(family="wan", task="t2v", model="tiny", prompt="p", negative_prompt="", height=64, width=96,
                num_frames=9, num_inference_steps=3, guidance_scale=5.0, seed=0, attention_type="sta",
                output_path=tmp_path / "x.mp4", timing_path=tmp_path / "timing.json")
    base.update(kw)
    return render.RenderConfig(**base)


def test_a_pattern_on_a_family_without_a_grid_and_under_context_parallelism_is_refused(no_load, tmp_path):
    from vdbench.parallel import ParallelSpec
    from vdbench.render.plan import checked_plan

    fam = families.register(dataclasses.replace(families.get("wan"), name="gridless", grid_hooks=None,
                                                tiny_variants=(), random_variants={}))
    try:
        with pytest.raises(B.BackendUnavailable, match="does not provide \\(Family.grid_hooks\\)"):
            render.validate(_cfg(tmp_path, family=fam.name))
        with pytest.raises(B.BackendUnavailable, match="does not provide"):
            render.validate(_cfg(tmp_path, family=fam.name, attention_type="sdpa@steps:0,sta"))
        assert render.validate(_cfg(tmp_path, family=fam.name, attention_type="flex")).backend.name == "flex"
    finally:
        families.unregister(fam.name)

    class Ctx:  # what the checks read of a torchrun context (validate then agrees over the group: not here)
        distributed = True
        device = torch.device("cpu")
        spec = ParallelSpec("diffusers", 1, 2, False)

    with pytest.raises(B.BackendUnavailable, match="'radial' can't serve ring attention"):
        checked_plan(_cfg(tmp_path, attention_type="radial"), Ctx())


# ----- one patch, several backends -----

def _steps(model, patch, n):
    for step in range(n):
        patch.step = step  # what the render's step callback does
        run(model, wan_inputs())


@pytest.mark.parametrize("pair", [("sdpa", "reference"), ("reference", "sagev1_emu"), ("fp8_emu", "sagev1_emu"),
                                  ("sdpa", "flex"), ("reference", SMALL_STA), (SMALL_STA, "sdpa"),
                                  ("radial:block=16,sink=0,decay=0.5", SMALL_STA)])
def test_every_backend_pair_runs_as_one_patch_counted_per_kernel_and_step(pair):
    first, then = (B.resolve(p) for p in pair)
    model = small_wan()
    schedule = f"{first.name}@steps:0,{then.name}"
    with AttentionPatch([("transformer", model)], schedule) as patch:
        _steps(model, patch, 3)
    by_step = {s: dict(c) for s, c in patch.stats.calls_by_step.items()}
    # step 0 on the first backend, steps 1-2 on the other: 2 blocks x (self + cross) per step
    assert set(by_step) == {0, 1, 2} and by_step[1] == by_step[2]
    assert sum(by_step[0].values()) == 4 and sum(by_step[1].values()) == 4
    assert sum(patch.stats.calls.values()) == 12 and patch.stats.backend == schedule
    # each step's output equals the same backend alone
    for step, backend in ((0, first), (1, then)):
        with AttentionPatch([("transformer", model)], backend) as alone:
            ref = run(model, wan_inputs())
        with AttentionPatch([("transformer", model)], schedule) as patch:
            patch.step = step
            out = run(model, wan_inputs())
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        assert dict(patch.stats.calls) == dict(alone.stats.calls)


def test_the_tile_order_follows_the_step_and_layer_schedules_go_per_call():
    model = small_wan()
    seen = []
    obs = lambda info: seen.append((info.step, info.kind, info.query.shape[2]))  # noqa: E731
    with AttentionPatch([("transformer", model)], f"sdpa@steps:0,{SMALL_STA}", observers=[obs]) as patch:
        _steps(model, patch, 2)
    # 48 tokens in the model's order on the dense step; the padded tile order (64) on the sparse one
    assert {s: {n for st, k, n in seen if st == s} for s in (0, 1)} == {0: {48}, 1: {64}}
    seen.clear()
    with AttentionPatch([("transformer", model)], f"sdpa@layers:0,{SMALL_STA}", observers=[obs]) as patch:
        _steps(model, patch, 1)
    assert {n for _, _, n in seen} == {48}  # one forward mixes backends: per-call permutation, model's order
    calls = dict(patch.stats.calls)
    assert calls.pop("flex.sta[window=1x3x1,tile=2x2x4,block=16]") == 1 and calls.pop("flex.dense") == 1
    assert list(calls.values()) == [2] and next(iter(calls)).startswith("sdpa[")  # block 0: self and cross


def test_cross_attention_on_another_backend_beside_a_sparse_pattern():
    """``sdpa@kind:cross,sta``: the self-attention calls run the pattern (tokens in tile order once per forward), the
    cross-attention calls run sdpa on the tile-ordered queries instead of FlexAttention's dense path, with the output
    of the pattern alone."""
    model = small_wan()
    seen = []
    obs = lambda info: seen.append((info.kind, info.query.shape[2]))  # noqa: E731
    schedule = f"sdpa@kind:cross,{SMALL_STA}"
    with AttentionPatch([("transformer", model)], schedule, observers=[obs]) as patch:
        out = run(model, wan_inputs())
    calls = dict(patch.stats.calls)
    assert calls.pop("flex.sta[window=1x3x1,tile=2x2x4,block=16]") == 2 and "flex.dense" not in calls
    assert list(calls.values()) == [2] and next(iter(calls)).startswith("sdpa[")
    assert set(seen) == {("self", 64), ("cross", 64)}  # both see the padded tile order: permuted once per forward
    with AttentionPatch([("transformer", model)], SMALL_STA) as alone:
        ref = run(model, wan_inputs())
    assert dict(alone.stats.calls)["flex.dense"] == 2
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_passthrough_in_a_schedule_runs_the_pipelines_own_attention():
    model = small_wan()
    with AttentionPatch([("transformer", model)], "default@steps:0,sagev1_emu") as patch:
        _steps(model, patch, 2)
    labels = {s: set(c) for s, c in patch.stats.calls_by_step.items()}
    assert all(label.startswith("diffusers.") for label in labels[0]) and labels[1] == {"emu.sagev1"}


def test_a_schedule_member_that_cant_run_is_refused_at_install():
    model = small_wan()
    with pytest.raises(B.BackendUnavailable, match="'fav3' can't run on transformer"):
        AttentionPatch([("transformer", model)], "sdpa@steps:0,fav3").install()
    with pytest.raises(ScheduleError, match="layers 5 lie beyond"):
        AttentionPatch([("transformer", model)], "sdpa@layers:5,reference").install()


# ----- a tiny Wan render with a dense-first schedule -----

def test_tiny_wan_render_with_a_dense_first_schedule(tmp_path):
    import run_wan

    rc = run_wan.main(["--model", "tiny", "--num_frames", "9", "--height", "64", "--width", "96",
                       "--num_inference_steps", "3", "--attention_schedule",
                       "sdpa_math@steps:0,sta:window=1x3x3,tile=2x2x2,block=16", "--warmup_calls", "1",
                       "--output_dir", str(tmp_path)])
    assert rc == 0
    entry = json.loads((tmp_path / "results" / "timing.json").read_text())[-1]
    name = "sdpa_math@steps:0,sta:window=1x3x3+tile=2x2x2+block=16"
    assert entry["attention_type"] == name and entry["attention"]["backend"] == name
    sta = "flex.sta[window=1x3x3,tile=2x2x2,block=16]"
    assert entry["attention"]["calls_by_step"] == {"0": {"sdpa_math": 8}, "1": {sta: 4, "flex.dense": 4},
                                                   "2": {sta: 4, "flex.dense": 4}}
    assert entry["attention"]["calls_by_kernel"] == {"sdpa_math": 8, sta: 8, "flex.dense": 8}
    assert entry["run"]["backend"]["name"] == name and not entry["run"]["backend"]["emulated"]
    assert (tmp_path / "results" / f"wan_result_t2v_tiny_9f_3s_attn_{name}_64x96.mp4").exists()
    from vdbench.report import summarize

    row = next(r for r in summarize(tmp_path)["rows"] if r["backend"] == name)
    assert 0 < row["work"] < 1  # the report's work column: dense step 0 and sparse steps together


def test_a_step_schedule_survives_compile(tmp_path):
    """Under torch.compile the choice is made inside the compiled attention op at every call (by step; the
    tile order goes per call)."""
    import run_wan

    rc = run_wan.main(["--model", "tiny", "--num_frames", "9", "--height", "64", "--width", "96",
                       "--num_inference_steps", "2", "--attention_schedule",
                       "sdpa_math@steps:0,sta:window=1x3x3,tile=2x2x2,block=16", "--use_torch_compile",
                       "--compile_backend", "eager", "--output_dir", str(tmp_path)])
    assert rc == 0
    by_step = json.loads((tmp_path / "results" / "timing.json").read_text())[-1]["attention"]["calls_by_step"]
    assert by_step == {"0": {"sdpa_math": 8},
                       "1": {"flex.sta[window=1x3x3,tile=2x2x2,block=16]": 4, "flex.dense": 4}}
