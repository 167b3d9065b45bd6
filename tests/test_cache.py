"""vdbench.cache: diffusers' step caches as a render option -- the kinds and their parameters from diffusers' config
dataclasses, every refusal before a weight loads, the count of computed and reused units per step in timing.json,
the cache in the output name, the record and the label."""

import dataclasses
import json
import logging
from pathlib import Path

import pytest

import run_wan
from vdbench import cache as C
from vdbench import families
from vdbench import render as R
from vdbench.measure import record as M
from vdbench.video import identity_from_filename

from .test_render import _cfg, no_load  # noqa: F401 - the fixture: any weight load fails the test


def test_the_kinds_take_their_parameters_and_defaults_from_diffusers_configs():
    import diffusers.hooks as H

    assert set(C.KINDS) == {"fbc", "mag", "taylor", "pab", "faster", "sea", "textkv"}
    spec = C.parse_cache("fbc")
    assert spec.name == "fbc" and spec.params == {"threshold": H.FirstBlockCacheConfig().threshold}
    spec = C.parse_cache("FBC:threshold=0.1")
    assert spec.name == "fbc:threshold=0.1" and spec.params == {"threshold": 0.1}
    # what the render fills in (the step count, the timestep callback) is no parameter
    assert "num_inference_steps" not in C.KINDS["mag"].parameters()
    assert "current_timestep_callback" not in C.KINDS["pab"].parameters()
    # a sequence joins its items with '+'; the canonical spelling keeps the dataclass's order
    spec = C.parse_cache("pab:spatial_attention_timestep_skip_range=-1+900,spatial_attention_block_skip_range=3")
    assert spec.name == "pab:spatial_attention_block_skip_range=3,spatial_attention_timestep_skip_range=-1+900"
    assert spec.params["spatial_attention_timestep_skip_range"] == (-1, 900)
    assert C.parse_cache(None) is None and C.parse_cache("none") is None


@pytest.mark.parametrize("text,message", [
    ("bogus", "unknown --cache kind 'bogus'\nvalid: none, fbc, mag, taylor, pab, faster, sea, textkv"),
    ("fbc:foo=1", "--cache fbc: unknown parameter 'foo'\nvalid: threshold=0.05"),
    ("fbc:threshold=abc", "--cache fbc: threshold='abc': expected float"),
    ("mag:mag_ratios=1+x", "mag_ratios='1+x': expected floats joined by '+' or none"),
    ("pab:spatial_attention_timestep_skip_range=1", "needs 2 items joined by '+'"),
    ("taylor:use_lite_mode=maybe", "expected boolean (not true or false)"),
])
def test_an_invalid_spec_is_one_line_naming_the_valid_choices(text, message):
    with pytest.raises(ValueError) as e:
        C.parse_cache(text)
    assert message in str(e.value) and len(str(e.value).splitlines()) <= 2


def test_refusals_come_before_the_load(tmp_path, no_load, monkeypatch):  # noqa: F811
    with pytest.raises(ValueError, match="unknown --cache kind 'x'"):
        R.validate(_cfg(tmp_path, cache="x"))
    with pytest.raises(ValueError, match="the wan pipeline runs the conditional and unconditional passes as two "
                                         "calls\nuse faster:is_guidance_distilled=true"):
        R.validate(_cfg(tmp_path, cache="faster"))
    with pytest.raises(ValueError, match="ends at 1000: FasterCache would skip the first step"):
        R.validate(_cfg(tmp_path, cache="faster:spatial_attention_timestep_skip_range=-1+1000"))
    with pytest.raises(ValueError, match="MagCache needs the model's magnitude ratios"):
        R.validate(_cfg(tmp_path, cache="mag:threshold=0.06"))
    with pytest.raises(ValueError, match="with --use_torch_compile: "):
        R.validate(_cfg(tmp_path, cache="taylor", compile=True))
    with pytest.raises(ValueError, match="SeaCache needs the step index, sigma and step count .*; "
                                         "CogVideoXPipeline passes none"):
        R.validate(_cfg(tmp_path, family="cogvideox", cache="sea", height=128, width=192,
                        output_path=tmp_path / "cogvideox-tiny_sdpa.mp4"))
    # under torchrun every kind runs (one decision for all ranks), but FasterCache's skip of the unconditional half
    # of a guidance batch can't where --use_cfg_parallel puts the halves on two ranks, and neither can PAB's or
    # FasterCache's reuse of a step's conditional call by its unconditional call (Wan's two calls: their state is
    # one per attention module, no cache context). Measured on tiny Wan 2.1 (64x64, 5 frames, 4 steps, PAB over
    # every step): CFG-2's latents 2.1e-2 (relative L2) from one process's, frames up to 27 levels apart
    wan = families.get("wan")
    for kind in ("fbc", "taylor"):
        C.check_cache(C.parse_cache(kind), wan, cfg_split=True)
    for spec in ("pab", "faster:is_guidance_distilled=true"):
        with pytest.raises(ValueError, match="with --use_cfg_parallel: diffusers' .* keeps one state per attention "
                                             "module for every denoiser call, so on one process the wan pipeline's "
                                             "unconditional call of a step reuses its conditional call's output"):
            C.check_cache(C.parse_cache(spec), wan, cfg_split=True)
    cog = families.get("cogvideox")
    C.check_cache(C.parse_cache("pab"), cog, cfg_split=True)  # guidance as one batch: each half its own state
    C.check_cache(C.parse_cache("faster"), cog)
    with pytest.raises(ValueError, match="the CFG split puts the two halves on two ranks\nuse "
                                         "faster:is_guidance_distilled=true"):
        C.check_cache(C.parse_cache("faster"), cog, cfg_split=True)
    # a cache diffusers would apply to no module of this transformer (checked on the meta-built denoiser)
    nothing = C.CacheKind("nothing", "PyramidAttentionBroadcastConfig", "test", needs="-",
                          defaults={"spatial_attention_block_skip_range": 2,
                                    "spatial_attention_block_identifiers": ("no_such_module",)})
    monkeypatch.setitem(C.KINDS, "nothing", nothing)  # without the timestep the pipeline provides: diffusers refuses
    with pytest.raises(ValueError, match="diffusers can't apply it to transformer \\(WanTransformer3DModel\\): "
                                         "The `current_timestep_callback` function must be provided"):
        R.validate(_cfg(tmp_path, cache="nothing"))
    monkeypatch.setitem(C.KINDS, "nothing", dataclasses.replace(nothing, provided=C.KINDS["pab"].provided))
    with pytest.raises(ValueError, match="hooks no module of transformer \\(WanTransformer3DModel\\)"):
        R.validate(_cfg(tmp_path, cache="nothing"))
    # what applies: canonical in the plan; FasterCache on CogVideoX (guidance as one batch)
    plan = R.validate(_cfg(tmp_path, cache="FBC:threshold=0.2"))
    assert plan.cfg.cache == "fbc:threshold=0.2" and plan.cache.kind is C.KINDS["fbc"]
    cog = R.validate(_cfg(tmp_path, family="cogvideox", cache="faster", height=128, width=192,
                          output_path=tmp_path / "cogvideox-tiny_sdpa.mp4"))
    assert cog.cache.name == "faster"


def test_the_cli_refuses_an_invalid_spec_with_one_line_and_a_hint(tmp_path, capsys, no_load):  # noqa: F811
    assert run_wan.main(["--model", "tiny", "--cache", "fbc:treshold=0.1", "--output_dir", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --cache fbc: unknown parameter 'treshold'", "hint: valid: threshold=0.05"]


def test_the_cache_is_in_the_output_name_and_the_label(tmp_path, capsys):
    assert run_wan.main(["--model", "tiny", "--attention_type", "sdpa", "--cache", "fbc:threshold=0.1",
                         "--output_dir", str(tmp_path), "--print_output_path"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.name == "wan_result_t2v_tiny_17f_4s_attn_sdpa_128x192_cache-fbc-threshold=0.1.mp4"
    ident = identity_from_filename(path)
    assert (ident.attention, ident.cache, ident.label) == ("sdpa", "fbc:threshold=0.1", "sdpa+fbc:threshold=0.1")
    # before the layout tag, which ends every name; several parameters; the other family
    wan, cog = families.get("wan"), families.get("cogvideox")
    stem = "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96_cache-mag-threshold=0.1-mag_ratios=1.0+0.9_u2"
    assert wan.parse_name(stem) == ("sdpa", "u2")
    assert wan.label(stem) == "sdpa+mag:threshold=0.1,mag_ratios=1.0+0.9+u2"
    assert cog.label("cogvideox-tiny_fav3_fp8_cache-pab") == "fav3_fp8+pab"
    assert M.cache_tag("mag:threshold=0.1,mag_ratios=1.0+0.9") == "cache-mag-threshold=0.1-mag_ratios=1.0+0.9"


# permissive settings (each reuses something on the tiny model's 4 steps), and one strict
APPLIES = ["fbc:threshold=0.5", "mag:threshold=0.5,mag_ratios=1.0", "taylor:disable_cache_before_step=1",
           "pab:spatial_attention_timestep_skip_range=-1+1000",
           "faster:spatial_attention_timestep_skip_range=-1+990,is_guidance_distilled=true", "sea:threshold=10"]


@pytest.mark.parametrize("spec", APPLIES + ["fbc:threshold=0"])
def test_a_tiny_render_with_each_cache_counts_what_it_computed_and_reused(tmp_path, spec):
    steps = 4
    cfg = _cfg(tmp_path, cache=spec, num_inference_steps=steps)
    R.render(cfg, log=lambda *a, **k: None)
    (entry,) = json.loads(cfg.timing_path.read_text())
    c = entry["cache"]
    name = C.parse_cache(spec).name
    assert c["kind"] == spec.split(":")[0] and c["spec"] == name and c["units"] > 0
    assert entry["run"]["settings"]["cache"] == name and entry["run"]["resolved"]["speed_options"]["cache"]["spec"] == name
    computed, reused = c["computed_blocks_per_step"], c["reused_blocks_per_step"]
    assert len(computed) == len(reused) == len(c["forwards_per_step"]) == steps
    # every call of every unit is either computed or reused (guidance: two denoiser calls per step)
    assert all(a + b == c["units"] * f for a, b, f in zip(computed, reused, c["forwards_per_step"]))
    assert c["forwards_per_step"] == [2] * steps
    assert c["skipped_share"] == pytest.approx(sum(reused) / (sum(computed) + sum(reused)))
    if spec == "fbc:threshold=0":
        assert sum(reused) == 0 and computed[0] == c["units"] * 2
    else:
        assert sum(reused) > 0, c
    # step times told honestly: the warm median beside the denoising total and the mean step
    assert entry["denoise_s"] == pytest.approx(sum(entry["step_times"]))
    assert entry["step_mean"] == pytest.approx(entry["denoise_s"] / steps)
    # the record carries the cache as part of the run's stack, and the label shows it
    (rec,) = M.read(cfg.timing_path.with_name("records.jsonl"))
    assert rec.config["cache"] == name and rec.figures["cache_skipped_share"] == c["skipped_share"]
    assert M.identity(rec).stack == entry["stack"] == f"sdpa+{name}"


COG_APPLIES = [s for s in APPLIES if not s.startswith("sea")]  # SeaCache: refused on CogVideoX (see above)
SCHEDULE = "sdpa@steps:0-1,sta"  # dense first steps, then the sliding tile: the tokens change order between forwards


@pytest.mark.parametrize("family, spec, schedule",
                         [("cogvideox", s, None) for s in COG_APPLIES] + [("cogvideox", s, SCHEDULE) for s in COG_APPLIES]
                         + [("wan", s, SCHEDULE) for s in APPLIES if not s.startswith("fbc")])
def test_each_cache_on_both_families_alone_and_beside_a_sparse_schedule(tmp_path, family, spec, schedule):
    """Every cache diffusers applies to the family, in a tiny render of it, alone and with a schedule that switches
    to a sparse pattern (FirstBlockCache beside a schedule on Wan: the test above): it reuses something, every
    unit's call is counted once, and the stack names both."""
    steps = 4
    if schedule and spec.startswith("mag"):  # permissive MagCache skips every later step whole: sta would never run
        spec += ",max_skip_steps=1"
    kw = dict(family="cogvideox", height=128, width=192, output_path=tmp_path / "cogvideox-tiny_sdpa.mp4") \
        if family == "cogvideox" else {}
    cfg = _cfg(tmp_path, cache=spec, num_inference_steps=steps, **kw,
               **({"attention_type": schedule} if schedule else {}))
    R.render(cfg, log=lambda *a, **k: None)
    (entry,) = json.loads(cfg.timing_path.read_text())
    c = entry["cache"]
    per_step = 1 if family == "cogvideox" else 2  # CogVideoX's guidance is one batch, Wan's two denoiser calls
    assert c["forwards_per_step"] == [per_step] * steps
    assert all(a + b == c["units"] * f for a, b, f in zip(c["computed_blocks_per_step"], c["reused_blocks_per_step"],
                                                         c["forwards_per_step"]))
    assert sum(c["reused_blocks_per_step"]) > 0, c
    name = C.parse_cache(spec).name
    assert entry["stack"] == f"{schedule or 'sdpa'}+{name}"
    if schedule:
        kernels = entry["attention"]["calls_by_kernel"]
        assert any("sta" in k or "flex" in k for k in kernels) and any(k.startswith("sdpa") for k in kernels), kernels


def test_a_render_without_a_cache_records_none_and_the_label_is_unchanged():
    e = {"attention_type": "sdpa", "step_times": [1.0, 0.5], "cache": None, "run": {"settings": {"cache": None}}}
    rec = M.from_render_entry(e)
    assert rec.config["cache"] is None and M.identity(rec).label == "sdpa"
    assert dataclasses.replace(M.identity(rec), cache="fbc").label == "sdpa+fbc"


def test_both_experts_of_wan_2_2_get_the_cache(tmp_path):
    """Wan 2.2 A14B denoises with two transformers (high-noise, then low-noise): the cache is on each, and each
    step's calls go through the blocks of the one that ran."""
    cfg = _cfg(tmp_path, model="tiny:wan2.2-t2v-a14b", cache="fbc:threshold=0.5", num_inference_steps=4)
    R.render(cfg, log=lambda *a, **k: None)
    (entry,) = json.loads(cfg.timing_path.read_text())
    c = entry["cache"]
    assert c["units_per_denoiser"] == {"transformer": 2, "transformer_2": 2} and c["units"] == 4
    assert all(a + b == 2 * f for a, b, f in zip(c["computed_blocks_per_step"], c["reused_blocks_per_step"],
                                                 c["forwards_per_step"]))
    assert sum(c["reused_blocks_per_step"]) > 0


def test_a_cache_beside_a_sparse_schedule_keeps_the_tokens_in_the_models_order(tmp_path):
    """A schedule whose late steps run sta puts the tokens in its (padded) tile order for those forwards; a cache
    compares and reuses block outputs across steps, so with a cache the tile order is applied per attention call
    instead (on an H200 diffusers' FirstBlockCache failed at the switch: 37376 vs 32760 tokens)."""
    cfg = _cfg(tmp_path, attention_type="sdpa@steps:0-1,sta", cache="fbc:threshold=0.5", num_inference_steps=5)
    R.render(cfg, log=lambda *a, **k: None)
    (entry,) = json.loads(cfg.timing_path.read_text())
    kernels = entry["attention"]["calls_by_kernel"]
    assert any(k.startswith("sdpa") for k in kernels) and any("sta" in k or "flex" in k for k in kernels), kernels
    assert sum(entry["cache"]["reused_blocks_per_step"]) > 0 and entry["stack"] == "sdpa@steps:0-1,sta+fbc:threshold=0.5"


def test_text_kv_cache_is_listed_and_refused_before_the_load_with_the_reason(tmp_path, no_load):  # noqa: F811
    """diffusers' TextKVCacheConfig hooks only NucleusMoE image blocks: on these families it would cache nothing."""
    assert "textkv (" in C.CACHE_HELP and "refused for Wan and CogVideoX" in C.CACHE_HELP
    with pytest.raises(ValueError) as e:
        R.validate(_cfg(tmp_path, cache="textkv"))
    first, hint = str(e.value).splitlines()
    assert first.startswith("--cache textkv: diffusers' TextKVCacheConfig applies only to NucleusMoE image "
                            "transformer blocks") and "Wan's cross-attention (attn2) projects the text K/V" in first
    assert hint.startswith("use another kind")
    with pytest.raises(ValueError, match="applies only to NucleusMoE.*cogvideox model's text tokens pass through "
                                         "every block"):
        R.validate(_cfg(tmp_path, family="cogvideox", cache="textkv", height=128, width=192,
                        output_path=tmp_path / "cogvideox-tiny_sdpa.mp4"))


@pytest.fixture
def mag_logger():
    """diffusers' MagCache logger, its level and handlers checked unchanged after the test."""
    logger = logging.getLogger(C.MAG_LOGGER)
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    assert logger.level == level and logger.handlers == handlers


def test_a_calibration_is_read_from_diffusers_log_messages_and_a_malformed_one_ignored(mag_logger):
    counter = C.CacheCounter(C.parse_cache("mag:calibrate=true,max_skip_steps=2"))
    with counter.listening():
        assert mag_logger.isEnabledFor(logging.INFO)
        mag_logger.info("MagCache: Applying Head Hook to blocks.0")  # another message of the logger: not one
        mag_logger.info("MagCache Calibration Results: [1.0, 0.987654321, 1.01]")
        mag_logger.info("MagCache Calibration Results: [1.0, __import__('os')]")  # never evaluated
        mag_logger.info("MagCache Calibration Results: %s", [1.0, 0.5])
        mag_logger.info("MagCache Calibration Results: {\"a\": 1}")
        mag_logger.info("MagCache Calibration Results: [1.0, NaN]")
    cal = counter.summary()["calibration"]
    assert cal["ratios"] == [[1.0, 0.9877, 1.01], [1.0, 0.5]]
    assert cal["by_denoiser"] == {"transformer": cal["ratios"]}  # no denoiser called: the first's
    # the first list (the conditional pass), the other parameters given kept, calibrate dropped
    assert cal["use"] == "mag:max_skip_steps=2,mag_ratios=1.0+0.9877+1.01"
    assert C.parse_cache(cal["use"]).params["mag_ratios"] == [1.0, 0.9877, 1.01]
    assert [why.split(":")[0] for why in cal["ignored"]] == ["not JSON (Expecting value)", "no bracketed list",
                                                              "not JSON (NaN is not a finite number)"]
    counter.reset()  # a new pipeline call: its own calibration
    assert counter.summary()["calibration"] == {"ratios": [], "by_denoiser": {}, "use": None, "ignored": []}
    # the handler leaves and the level comes back when the render fails too (mag_logger checks)
    with pytest.raises(RuntimeError), counter.listening():
        raise RuntimeError("the render failed")
    # another cache: no handler, no calibration
    other = C.CacheCounter(C.parse_cache("mag:mag_ratios=1.0"))
    with other.listening():
        assert mag_logger.handlers == []
    assert other.summary()["calibration"] is None


def test_a_tiny_calibrating_render_records_the_ratios_of_both_passes_and_the_next_spec_reads_them(
        tmp_path, capsys, mag_logger):
    steps = 4
    cfg = _cfg(tmp_path, cache="mag:calibrate=true", num_inference_steps=steps)
    R.render(cfg)
    (entry,) = json.loads(cfg.timing_path.read_text())
    c = entry["cache"]
    assert sum(c["reused_blocks_per_step"]) == 0  # calibrating: every block computed
    cond, uncond = c["calibration"]["ratios"]  # Wan's two cache contexts, "cond" first
    assert len(cond) == len(uncond) == steps and cond[0] == 1.0
    assert all(r == round(r, 4) for r in cond + uncond)
    use = c["calibration"]["use"]
    assert use == "mag:mag_ratios=" + "+".join(str(r) for r in cond)
    out = capsys.readouterr().out
    assert f"cache calibrated ({steps} steps, 2 cache contexts; the first, the conditional pass's, kept): next " \
           f"time --cache {use}\nhint: or --cache mag:mag_ratios=@{cfg.timing_path}" in out
    # the file read back: the numbers recorded, named by their digest (no path in the name)
    spec = C.parse_cache(f"mag:threshold=0.1,mag_ratios=@{cfg.timing_path}")
    assert spec.params["mag_ratios"] == cond and spec.as_dict()["params"]["mag_ratios"] == "+".join(map(str, cond))
    assert spec.name.startswith("mag:threshold=0.1,mag_ratios=@") and len(spec.name.rsplit("@")[1]) == 8
    assert spec.name == C.parse_cache(f"mag:mag_ratios=@{cfg.timing_path},threshold=0.1").name
    assert C.parse_cache(f"mag:mag_ratios=@{cfg.timing_path},mag_ratios=1.0").name == "mag:mag_ratios=1.0"
    # another render (its own file: the calibrating render's is not replaced by it)
    plan = R.validate(_cfg(tmp_path, cache=f"mag:mag_ratios=@{cfg.timing_path}",
                           output_path=cfg.output_path.with_name("calibrated.mp4")))
    assert plan.cache.params["mag_ratios"] == cond and plan.cfg.cache == plan.cache.name


@pytest.mark.parametrize("contents,message", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ("[]", "no entry with a MagCache calibration"),
    (json.dumps([{"cache": {"kind": "fbc", "calibration": None}}]), "no entry with a MagCache calibration"),
    (json.dumps({"cache": {"calibration": {"ratios": []}}}), "its calibration holds no ratios"),
    (json.dumps([{"cache": {"calibration": {"ratios": "rm -rf /"}}}]),
     "its cache.calibration.ratios is not a list (a str)"),
    (json.dumps([{"cache": {"calibration": {"ratios": [{"a": 1}]}}}]),
     "its cache.calibration.ratios[0] is not a non-empty list of numbers (a dict)"),
    (json.dumps([{"cache": {"calibration": {"ratios": [[1.0, "0.9"]]}}}]),
     "its cache.calibration.ratios[0] is not a list of numbers (holds '0.9')"),
    (json.dumps([{"cache": {"calibration": {"ratios": [[1.0, True]]}}}]), "not a list of numbers (holds True)"),
    ('[{"cache": {"calibration": {"ratios": [[1.0, Infinity]]}}}]', "not JSON (Infinity is not a finite number)"),
    ("42", "no entry with a MagCache calibration"),
])
def test_ratios_from_a_file_that_cant_give_them_are_one_line_and_a_hint(tmp_path, contents, message):
    path = tmp_path / "timing.json"
    if contents is not None:
        path.write_text(contents)
    with pytest.raises(ValueError) as e:
        C.parse_cache(f"mag:mag_ratios=@{path}")
    first, hint = str(e.value).splitlines()
    assert first.startswith(f"--cache mag: mag_ratios=@{path}: ") and message in first, first
    assert hint


def test_ratios_from_a_file_take_the_last_calibration_and_are_refused_before_the_load(tmp_path, no_load):  # noqa: F811
    path = tmp_path / "timing.json"
    path.write_text(json.dumps([{"cache": {"calibration": {"ratios": [[1.0, 0.9]]}}}, {"cache": None},
                                {"cache": {"calibration": {"ratios": [[1.0, 0.8], [1.0, 0.7]]}}}, {"cache": {}}]))
    assert C.parse_cache(f"mag:mag_ratios=@{path}").params["mag_ratios"] == [1.0, 0.8]
    with pytest.raises(ValueError, match="mag_ratios=@.*missing.json: no such file\ngive the timing.json of a "
                                         "render with --cache mag:calibrate=true"):
        R.validate(_cfg(tmp_path, cache=f"mag:mag_ratios=@{tmp_path / 'missing.json'}"))


# ----- Wan 2.2's two experts: each denoiser's hooks hold their own state, and each expert starts afresh -----

A14B = dict(model="tiny:wan2.2-t2v-a14b", height=32, width=32, num_frames=5, num_inference_steps=6)
# 6 steps at the model's shift 12: timesteps 999, 983, 960, 923 (high-noise expert), 857, 707 (low-noise)
SWITCH = 4
# each permissive enough to reuse in the step before the switch; the FasterCache range holds the high-noise
# expert's later steps and not the low-noise expert's first (one that does is refused: the test below)
EXPERT_CACHES = ["fbc:threshold=0.5", "mag:threshold=0.5,mag_ratios=1.0,mag_ratios_2=1.0",
                 "taylor:cache_interval=2,disable_cache_before_step=1",
                 "pab:spatial_attention_timestep_skip_range=-1+1000",
                 "faster:spatial_attention_timestep_skip_range=900+990,is_guidance_distilled=true",
                 "sea:threshold=10,max_consecutive_cached=0"]


@pytest.mark.parametrize("spec", EXPERT_CACHES)
def test_each_expert_computes_its_first_step_whole_after_the_other_reused(tmp_path, spec):
    """diffusers' hooks keep each denoiser's state apart (per cache context for fbc, mag, taylor, sea; per attention
    module for pab, faster), so no residual or output of the high-noise expert reaches a step of the low-noise one:
    the step right before the switch reuses, the switch's step computes every unit of the expert that takes over.
    PAB keeps one state per attention module across the cache contexts: Wan's unconditional call of a step reuses
    the conditional call's output of that step (what diffusers' PAB does with a pipeline of two calls a step), its
    first call of each expert computed."""
    cfg = _cfg(tmp_path, cache=spec, **A14B)
    R.render(cfg, log=lambda *a, **k: None)
    (entry,) = json.loads(cfg.timing_path.read_text())
    c, schedule = entry["cache"], entry["run"]["resolved"]["schedule"]
    by_step = ["transformer"] * SWITCH + ["transformer_2"] * 2
    assert schedule["denoiser_by_step"] == c["denoiser_per_step"] == by_step, (schedule, c)
    assert schedule["timesteps"] == [999.0, 983.0, 960.0, 923.0, 857.0, 707.0]
    computed, reused, forwards = c["computed_blocks_per_step"], c["reused_blocks_per_step"], c["forwards_per_step"]
    assert forwards == [2] * 6
    units = c["units_per_denoiser"]
    assert units["transformer"] == units["transformer_2"] > 0
    assert reused[SWITCH - 1] > 0, c  # the high-noise expert reused in its last step
    for first, name in ((0, "transformer"), (SWITCH, "transformer_2")):
        if spec.startswith("pab"):  # the conditional call computed whole, the unconditional one reused its output
            assert computed[first] == reused[first] == units[name], (name, c)
        else:
            assert computed[first] == units[name] * forwards[first] and reused[first] == 0, (name, c)
    # every call of the running expert's units counted once, computed or reused
    assert all(a + b == units[d] * f for a, b, f, d in zip(computed, reused, forwards, by_step))
    # the attention calls of each expert, by kernel: 2 blocks x (self + cross) x 2 calls a step (pab and faster
    # skip some calls of the attention modules they hook)
    calls = entry["attention"]["calls_by_denoiser"]
    assert set(calls) == {"transformer", "transformer_2"} and all(sum(v.values()) > 0 for v in calls.values())
    if not spec.startswith(("pab", "faster", "taylor")):
        full = {d: 8 * sum(1 for s in range(6) if by_step[s] == d and reused[s] == 0) for d in calls}
        assert all(sum(calls[d].values()) >= full[d] for d in calls), (calls, c)


def test_a_cache_that_would_skip_an_experts_first_call_is_refused(tmp_path, no_load):  # noqa: F811
    """FasterCache skips a first call inside its timestep range (its cache empty: diffusers fails): refused after
    the load, before any step, where the range holds the low-noise expert's first timestep; TaylorSeer predicting a
    denoiser's first call (no warm-up, no compute interval there) is refused before the load."""
    with pytest.raises(ValueError, match="disable_cache_before_step=0 with cache_interval=5: TaylorSeer would "
                                         "predict each denoiser's first call.*\ngive disable_cache_before_step=1"):
        R.validate(_cfg(tmp_path, cache="taylor:disable_cache_before_step=0"))
    R.validate(_cfg(tmp_path, cache="taylor:disable_cache_before_step=0,cache_interval=1"))  # computes every call


def test_a_faster_cache_range_holding_the_low_noise_experts_first_timestep_is_refused(tmp_path, capsys):
    spec = "faster:spatial_attention_timestep_skip_range=-1+990,is_guidance_distilled=true"
    argv = ["--model", A14B["model"], "--height", "32", "--width", "32", "--num_frames", "5",
            "--num_inference_steps", "6", "--attention_type", "sdpa", "--cache", spec,
            "--benchmark_output_directory", str(tmp_path)]
    assert run_wan.main(argv) == 2
    first, hint = capsys.readouterr().err.strip().splitlines()[-2:]
    assert first == (f"error: --cache {spec}: spatial_attention_timestep_skip_range -1..990 holds transformer_2's "
                     "first timestep (857): FasterCache would skip that denoiser's first call, before anything is "
                     "cached (diffusers fails there)")
    assert hint == "hint: end it at or below 857, e.g. spatial_attention_timestep_skip_range=-1+857"
    assert not list(tmp_path.rglob("*.mp4"))


def test_magcache_calibrates_each_expert_over_its_own_steps_and_each_runs_with_its_own_ratios(
        tmp_path, capsys, mag_logger):
    """Each expert's MagCache counts its own steps (the high-noise expert 4 of the 6, the low-noise one 2), so each
    logs its calibration at its own last step: per expert, per cache context. The next render's spec names each
    expert's conditional list, and each denoiser's config gets its own ratios and step count."""
    cfg = _cfg(tmp_path, cache="mag:calibrate=true", **A14B)
    R.render(cfg)
    (entry,) = json.loads(cfg.timing_path.read_text())
    cal = entry["cache"]["calibration"]
    high, low = cal["by_denoiser"]["transformer"], cal["by_denoiser"]["transformer_2"]
    assert [len(r) for r in high] == [SWITCH, SWITCH] and [len(r) for r in low] == [2, 2]  # cond, uncond each
    assert cal["ratios"] == high + low and high[0][0] == low[0][0] == 1.0  # each expert's first step: no before
    assert high[0] != high[1] and high[0][1:] != low[0][1:]
    assert cal["use"] == ("mag:mag_ratios=" + "+".join(map(str, high[0])) + ",mag_ratios_2="
                          + "+".join(map(str, low[0])))
    out = capsys.readouterr().out
    assert (f"cache calibrated per expert (transformer 4 steps, transformer_2 2 steps; 2 cache contexts each; the "
            f"first, the conditional pass's, kept): next time --cache {cal['use']}\nhint: or --cache "
            f"mag:mag_ratios=@{cfg.timing_path},mag_ratios_2=@{cfg.timing_path}") in out
    spec = C.parse_cache(f"mag:mag_ratios=@{cfg.timing_path},mag_ratios_2=@{cfg.timing_path}")
    assert spec.params["mag_ratios"] == high[0] and spec.params["mag_ratios_2"] == low[0]
    assert spec.for_denoiser("transformer_2")["mag_ratios"] == low[0]
    # each denoiser's config: its own ratios and step count (diffusers' hook on its first block holds it)
    import torch
    from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK

    from vdbench.pipelines import load_pipeline, transformers_of

    pipe = load_pipeline(A14B["model"], "t2v", "wan", dtype=torch.float32, device="cpu")
    counter = C.apply_cache(spec, pipe, transformers_of(pipe), steps=6, family=families.get("wan"))
    for model, ratios, steps in ((pipe.transformer, high[0], SWITCH), (pipe.transformer_2, low[0], 2)):
        config = model.blocks[0]._diffusers_hook.get_hook(_MAG_CACHE_LEADER_BLOCK_HOOK).config
        assert config.num_inference_steps == steps and config.mag_ratios.tolist() == pytest.approx(ratios)
    counter.remove()


def test_each_experts_own_value_is_refused_where_it_cant_apply(tmp_path, no_load):  # noqa: F811
    with pytest.raises(ValueError, match="this model has two experts, each with its own mag_ratios; mag_ratios is "
                                         "given, mag_ratios_2 not\ngive mag_ratios \\(transformer's, the high-noise"):
        R.validate(_cfg(tmp_path, cache="mag:mag_ratios=1.0", model=A14B["model"]))
    with pytest.raises(ValueError, match="mag_ratios_2 is the second expert's .*; this model has one denoiser\n"
                                         "drop mag_ratios_2"):
        R.validate(_cfg(tmp_path, cache="mag:mag_ratios=1.0,mag_ratios_2=1.0"))
    # a calibration of one denoiser holds no second expert's ratios
    path = tmp_path / "timing.json"
    path.write_text(json.dumps([{"cache": {"calibration": {"ratios": [[1.0, 0.9]]}}}]))
    with pytest.raises(ValueError, match="mag_ratios_2=@.*: its calibration holds no ratios of transformer_2"):
        C.parse_cache(f"mag:mag_ratios=@{path},mag_ratios_2=@{path}")
    plan = R.validate(_cfg(tmp_path, cache="mag:mag_ratios=1.0+0.9,mag_ratios_2=0.8", model=A14B["model"],
                           output_path=tmp_path / "a14b" / "x.mp4"))
    assert plan.cache.name == "mag:mag_ratios=1.0+0.9,mag_ratios_2=0.8"
