"""vdbench.render's validate stage: every refusal that needs no weights comes before any weight loads, and a file
this tool did not write is never replaced."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vdbench import backends as B
from vdbench import render as R
from vdbench.video import write_video

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, **kw) -> R.RenderConfig:
    out = tmp_path / "results"
    base = dict(family="wan", task="t2v", model="tiny", prompt="a cat", negative_prompt="", height=64, width=96,
                num_frames=9, num_inference_steps=2, guidance_scale=5.0, seed=0, attention_type="sdpa",
                output_path=out / "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96.mp4", timing_path=out / "timing.json",
                device="cpu")
    base.update(kw)
    return R.RenderConfig(**base)


@pytest.fixture
def no_load(monkeypatch):
    """Any weight load fails the test: what validate refuses must be refused before it."""
    import vdbench.pipelines as P

    def load(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(P, "load_pipeline", load)


def test_a_backend_that_cant_serve_the_models_head_dim_is_refused_before_the_load(tmp_path, no_load):
    narrow = B.Backend(name="hd64_only", description="test", fn=B.resolve("sdpa").fn, kernel="hd64",
                       head_dims=(64,), no_lse_reason="a test entry")
    with B.registered(narrow):
        with pytest.raises(B.BackendUnavailable, match="does not support head dim 32 (?s:.)*head dim 32"):
            R.validate(_cfg(tmp_path, attention_type="hd64_only"))
        with pytest.raises(B.BackendUnavailable, match="head dim 128"):  # random:<name>: the real model's config
            R.validate(_cfg(tmp_path, attention_type="hd64_only", model="random:wan2.1-t2v-1.3b"))
    with pytest.raises(B.BackendUnavailable, match="'sagev1' can't run here: package not installed: sageattention"):
        R.validate(_cfg(tmp_path, attention_type="sagev1"))


@pytest.mark.parametrize("script,flags", [("run_wan.py", ["--model", "tiny"]),
                                          ("sageattn_cogvideo.py", ["--model_path", "tiny"])])
def test_sagev1_on_a_cpu_is_refused_before_loading_with_one_line_and_a_hint(script, flags, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU may run sagev1")
    proc = subprocess.run([sys.executable, str(ROOT / script), *flags, "--attention_type", "sagev1", "--output_dir",
                           str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "Loading pipeline" not in proc.stderr and len(lines) == 2, proc.stderr
    assert lines[0].startswith("error: attention backend 'sagev1' can't run here: package not installed")
    assert "pip install -e '.[sage]'" in lines[0] and "'sagev1_emu' emulates its numerics" in lines[0]
    assert lines[1].startswith("hint: Backends that can run here (cpu, float32, head dim ")


def test_a_file_this_tool_did_not_write_is_never_replaced(tmp_path, no_load):
    cfg = _cfg(tmp_path)
    cfg.output_path.parent.mkdir(parents=True)
    cfg.output_path.write_bytes(b"someone's file")
    with pytest.raises(ValueError, match="exists and is not a video this tool wrote; not replacing it\n.*--overwrite"):
        R.validate(cfg)
    assert R.validate(_cfg(tmp_path, overwrite=True)).cfg.overwrite  # asked for: replaced
    write_video(np.zeros((3, 16, 16, 3), np.uint8), cfg.output_path, fps=8)  # a render of ours: replaced
    R.validate(cfg)
    cfg.output_path.write_bytes(b"an old render")  # named by timing.json (before the tag, or OpenCV's): replaced
    cfg.timing_path.write_text(json.dumps([{"output": str(cfg.output_path)}]))
    R.validate(cfg)


@pytest.mark.parametrize("task", ["i2v", "ti2v"])
def test_a_pipeline_needing_a_missing_package_is_refused_before_the_load(tmp_path, no_load, monkeypatch, task):
    """diffusers' Wan I2V pipeline (also TI2V's image path) calls ftfy without checking it is installed: without
    ftfy vdbench says so before the load, instead of a NameError after it."""
    import importlib.util

    image = tmp_path / "img.png"
    image.write_bytes(b"")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ftfy" else real(n, *a))
    with pytest.raises(ValueError, match=f"task {task} needs the ftfy package .*\\npip install ftfy"):
        R.validate(_cfg(tmp_path, task=task, image=str(image)))
    R.validate(_cfg(tmp_path, task="t2v"))  # WanPipeline checks for ftfy itself: no refusal
    monkeypatch.setattr(importlib.util, "find_spec", real)
    R.validate(_cfg(tmp_path, task=task, image=str(image), model="tiny:wan2.2-ti2v-5b" if task == "ti2v" else "tiny"))


def test_image_refusals_before_the_load(tmp_path, no_load):
    with pytest.raises(ValueError, match="task i2v needs --img_file_path"):
        R.validate(_cfg(tmp_path, task="i2v"))
    with pytest.raises(ValueError, match="conditioning image .*missing.png does not exist"):
        R.validate(_cfg(tmp_path, task="ti2v", image=str(tmp_path / "missing.png")))


def test_one_time_costs_a_stage_reports_are_merged_and_the_render_call_is_timed_end_to_end(tmp_path, monkeypatch):
    """The decode's ``info["one_time"]`` lands in the entry's one_time section under ``vae_decode.`` and in its
    total; a render called as a library counts its end-to-end time from its call, stages + unaccounted = it."""
    from vdbench.render import repetitions

    real = repetitions.decode_latents

    def decode(*a, info=None, **k):
        out = real(*a, info=info, **k)
        info["one_time"] = {"prewarm_s": 0.25, "note": "not a number: left out"}
        return out

    monkeypatch.setattr(repetitions, "decode_latents", decode)
    summary = R.render(_cfg(tmp_path), log=lambda *a, **k: None)
    (entry,) = json.loads(_cfg(tmp_path).timing_path.read_text())
    once = entry["one_time"]
    assert once["vae_decode.prewarm_s"] == 0.25 and "vae_decode.note" not in once
    assert once["first_decode_excess_s"] is None  # one repetition: no warm decode to compare with
    assert once["total_s"] == pytest.approx(once["first_step_excess_s"] + 0.25)
    assert summary["one_time_s"] == once["total_s"] and summary["end_to_end_s"] == entry["end_to_end_s"]
    e2e = entry["end_to_end"]
    assert e2e["since"] == "render call" and e2e["clock"] == "perf_counter" and e2e["repetitions"] == 1
    assert 0 <= e2e["stages"]["startup"] < 5 and e2e["stages"]["load"] == once["load_s"]
    assert sum(v for v in e2e["stages"].values() if v is not None) + e2e["unaccounted"] == pytest.approx(
        entry["end_to_end_s"], abs=1e-9)
    assert 0 <= e2e["unaccounted"] < 1.0, e2e  # small: gaps between the stages (a GC pass on a loaded CPU: 0.3 s)
    # the load's parts: where its time went, each measured, together the load stage within rounding
    parts = entry["run"]["load_parts"]
    assert {"prewarm_start", "imports", "from_pretrained", "to_device", "pipeline_other", "size_checks", "preflight",
            "agree", "speed_options", "header", "sync"} <= set(parts)
    assert min(parts.values()) >= 0 and sum(parts.values()) == pytest.approx(once["load_s"], abs=0.01)
    # the same repetition in the record schema every tool writes, beside timing.json, with its command and identity
    from vdbench.measure import record as M

    (rec,) = M.read(_cfg(tmp_path).timing_path.with_name("records.jsonl"))
    assert rec.suite == "render" and rec.case == "sdpa" and rec.config["backend"]["name"] == "sdpa"
    assert rec.config["settings"]["height"] == 64 and rec.command and rec.data == entry
    steps = [s * 1e3 for s in entry["step_times"]]
    assert rec.figures["step_ms"]["first"] == steps[0] and rec.figures["step_ms"]["samples"] == steps[1:]
    assert rec.figures["end_to_end_s"] == entry["end_to_end_s"] and rec.verdict["speed_figure"] is False


def test_an_encode_reports_across_calls_split_by_repetition_and_warm_up():
    from vdbench.stages import reported_since

    info = {"one_time": {"setup_s": 0.1, "build_s": 0.5}}  # reported when the warm-up calls ended
    set_up = {"setup_s": 0.1}  # reported before them (on entering the encode): the first repetition's
    info["one_time"]["plan_s"] = 0.2  # reported in the first repetition
    mine, warm = reported_since(info, set_up, {"setup_s": 0.1, "build_s": 0.5})
    assert mine == {"setup_s": 0.1, "plan_s": 0.2} and warm == {"build_s": 0.5}
    before = dict(info["one_time"])
    info["one_time"]["plan_s"] = 0.3  # a later repetition reported again
    assert reported_since(info, None, before) == ({"plan_s": 0.3}, {})


def test_a_render_knows_its_model_once(tmp_path, monkeypatch):
    """validate resolves the model once (pipelines.resolve: the family looked up by name, the model string parsed,
    the component configs read) and the stages after take that Model -- the loaded pipeline carries it --, so
    nothing below the render parses the model string again, looks the family up by name or finds it back from a
    pipeline's, transformer's or VAE's class."""
    from vdbench import families
    from vdbench import pipelines as P

    resolved, after = [], []  # the resolve step's calls; what any of the others was called for after it

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*a, **k):
            if resolved:
                after.append(f"{module.__name__}.{name}")
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    for name in ("get", "for_pipeline", "for_transformer", "for_vae"):
        counted(families, name)
    for name in ("parse_model", "get_variant", "random_variant"):
        counted(P, name)
    real_resolve = P.resolve

    def resolve(*a, **k):
        model = real_resolve(*a, **k)
        resolved.append(model)
        return model
    monkeypatch.setattr(P, "resolve", resolve)

    summary = R.render(_cfg(tmp_path), log=lambda *a, **k: None)
    assert summary["calls_by_kernel"] and len(resolved) == 1 and after == [], after
    model = resolved[0]
    assert isinstance(model, P.Model) and model.family is families.get("wan") and model.task == "t2v"
    assert (model.spec.kind, model.spec.variant, model.pipeline_class) == ("tiny", "wan2.1-t2v", "WanPipeline")
    assert model.head_dims == [32] and model.vae[0] == "AutoencoderKLWan" and list(model.denoisers) == ["transformer"]


def test_the_vae_prewarm_starts_after_the_load_and_only_an_image_encode_part_before_it(tmp_path, monkeypatch):
    """The prewarm's compile holds the GIL in long stretches: beside the load's Python it slows the load, beside
    the denoising (a thread waiting on the GPU) it costs nothing; only an image's encode, which comes before the
    denoising, has the load alone to hide under."""
    from vdbench import pipelines
    from vdbench.render import prewarm

    events = []
    real_load = pipelines.Model.load

    def load(model, **kw):  # the weights' load
        events.append("load")
        return real_load(model, **kw)

    def start(plan, pipe=None, *, encode_only=False):
        events.append(("prewarm", "encode_only" if encode_only else "all", pipe is not None))
        return None

    monkeypatch.setattr(pipelines.Model, "load", load)
    monkeypatch.setattr(prewarm, "start_vae", start)
    loaded = R.load(R.validate(_cfg(tmp_path)))
    assert events == [("prewarm", "encode_only", False), "load", ("prewarm", "all", True)]
    assert loaded.load_s is not None and loaded.prewarms.vae is None


def test_the_render_configuration_is_read_in_the_render_package_the_rest_get_resolved_objects(tmp_path, monkeypatch):
    """A render resolves its configuration once (validate -> Plan) and hands resolved objects down (the Family, the
    Backend, the decode mode...): no module below reads the raw settings again, only the render's stages do.
    Measured as the walk of a tiny render: which modules read a RenderConfig or Plan attribute, in order."""
    readers = []

    def recording(cls):
        real = cls.__getattribute__

        def get(self, name):
            if not name.startswith("__"):
                mod = sys._getframe(1).f_globals.get("__name__", "")
                if mod.startswith("vdbench") and (not readers or readers[-1] != mod):
                    readers.append(mod)
            return real(self, name)
        monkeypatch.setattr(cls, "__getattribute__", get)

    cfg = _cfg(tmp_path)
    recording(R.RenderConfig)
    recording(R.Plan)
    R.render(cfg, log=lambda *a, **k: None)
    monkeypatch.undo()
    assert readers and all(r.startswith("vdbench.render.") for r in readers), readers
    assert json.loads(cfg.timing_path.read_text())[-1]["attention_type"] == "sdpa"  # the render did run


@pytest.mark.parametrize("compile_", [False, True])
def test_the_prewarm_uses_the_gpu_only_beside_an_uncompiled_denoiser(tmp_path, no_load, monkeypatch, compile_):
    """The prewarm's last part decodes a tiny latent on the GPU from its thread; a compiled denoiser may capture CUDA
    graphs, which another thread's kernels and allocations break, so there it is left out."""
    from dataclasses import replace

    from vdbench.render.prewarm import start_vae
    from vdbench.vae import prewarm as W

    plan = R.validate(_cfg(tmp_path, vae_decode="fast"))
    plan = replace(plan, device=torch.device("cuda"), cfg=replace(plan.cfg, compile=compile_))
    seen = {}
    monkeypatch.setattr(W, "plan", lambda **kw: seen.update(kw) or "a plan")
    monkeypatch.setattr(W, "start_thread", lambda make, p: p)

    class Pipe:
        class vae:
            config = {"z_dim": 16}

    assert start_vae(plan, Pipe()) == "a plan"
    assert seen["first_use"] is (not compile_) and seen["decode_mode"] is plan.decode.mode
