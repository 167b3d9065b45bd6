"""Wan 2.2 through the stack on a CPU: the tiny A14B (two experts: ``transformer`` the high-noise one, then
``transformer_2``), its I2V, and TI2V-5B (per-token timesteps, ``expand_timesteps``).

* The table: every backend and option with a CPU form renders the tiny A14B and each expert's attention calls are
  counted under the kernel that ran (``attention.calls_by_denoiser``) -- torch sdpa, the exact reference, the
  emulations, FlexAttention's sparse patterns, a schedule switching kernels at the experts' switch, the regional
  compile (dynamo's ``eager`` backend: no inductor code on a CPU), a step cache, and a Triton kernel under
  Triton's interpreter on the head-dim-64 A14B (slow). Step caches at the switch: tests/test_cache.py.
* The parallel layouts over gloo on diffusers' engine against one process (slow): A14B under Ulysses-2, ring-2,
  CFG-2 and CFG-2 x Ulysses-2 (with a step cache that reuses nothing, counted on every rank), TI2V-5B image-to-video
  under Ulysses-2 and CFG-2, I2V-A14B under CFG-2. Bit for bit except ring (its blocks merged through their
  log-sum-exp: fp32 rounding, relative L2 <= 1e-5, frames within 1 level of 255).

The sizes keep 16 tokens a Ulysses rank (A14B 64x64, 5 frames: 2 x 4 x 4 tokens; TI2V 64x128, 9 frames: its VAE's
16x compression, 3 x 2 x 4): at 4 tokens a rank (32x32, 5 frames) the one-process render and the Ulysses ranks
differ in the last bits (relative L2 8e-7, frames within 1 level), because the CPU's BLAS rounds a GEMM of 4 rows
otherwise than the same rows in a GEMM of 8 (measured: the FFN's 128 -> 64 projection, fp32), not because of the
layout. xfuser's engine can't run on a CPU (tests/test_parallel.py says why): its Wan 2.2 paths are untested here.

What only a GPU shows: the Triton kernels compiled (here interpreted), fp8 GEMMs (torchao), the fused RoPE and
block kernels, inductor's code, the expert swap's side stream (``--offload expert``), and every time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vdbench import render as R

from tests import launch
from tests.conftest import triton_interpreter
from tests.test_render import _cfg

A14B = "tiny:wan2.2-t2v-a14b"
TINY = dict(model=A14B, height=32, width=32, num_frames=5, num_inference_steps=4)
# 4 steps at the model's shift 12: timesteps 999, 973, 923 (high-noise expert), 800 (low-noise)
BY_STEP = ["transformer"] * 3 + ["transformer_2"]
slow_triton = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="triton not installed")]

# name -> (settings, the kernel labels each expert's calls ran on: one set for both, or one per expert)
TABLE = {
    "sdpa": (dict(attention_type="sdpa"), {"sdpa[flash]"}),
    "reference": (dict(attention_type="reference"), {"reference"}),
    "sagev1_emu": (dict(attention_type="sagev1_emu"), {"emu.sagev1"}),
    "sagev2_emu": (dict(attention_type="sagev2_emu"), {"emu.sagev2[fp8,sm90,per_thread]"}),
    "fp8_emu": (dict(attention_type="fp8_emu"), {"emu.fp8"}),
    # the sparse patterns on self-attention, the cross-attention dense on FlexAttention
    "sta": (dict(attention_type="sta"), {"flex.sta[window=3x3x3,tile=6x8x8]", "flex.dense"}),
    "radial": (dict(attention_type="radial"), {"flex.radial[decay=1,sink=1]", "flex.dense"}),
    # the high-noise expert's steps on sdpa, the low-noise expert's on the fp8 emulation
    "schedule": (dict(attention_type="sdpa@steps:0-2,fp8_emu"),
                 {"transformer": {"sdpa[flash]"}, "transformer_2": {"emu.fp8"}}),
    "compile": (dict(attention_type="sdpa", compile=True, compile_backend="eager"), {"sdpa[flash]"}),
    "cache": (dict(attention_type="sdpa", cache="fbc:threshold=0.5"), {"sdpa[flash]"}),
}
# a Triton kernel interpreted on the head-dim-64 experts, bf16; 2 steps, the second the low-noise expert's
# (923 < 950); ~15 s of CPU (fav3_sage and fp8_triton route through the same patch: their accuracy in whole
# pipelines is tests/test_kernels_in_pipelines.py's)
TRITON_KERNELS = {"fav2_triton": "vdbench.fav2_triton"}


def _params():
    for name in TABLE:
        yield pytest.param(name, id=name)
    for name in TRITON_KERNELS:
        yield pytest.param(name, id=name, marks=slow_triton)


def _calls_per_step(entry: dict) -> list[int]:
    """The attention calls each step makes: 2 blocks x (self + cross) x 2 guidance calls, less 2 for every block a
    step cache reused (its attention calls skipped)."""
    c = entry["cache"]
    if c is None:
        return [8] * len(entry["step_times"])
    return [8 - 2 * r for r in c["reused_blocks_per_step"]]


@pytest.mark.parametrize("name", _params())
def test_each_backend_and_option_renders_both_experts_and_counts_each_ones_calls(tmp_path, name):
    if name in TRITON_KERNELS:
        settings, labels = dict(attention_type=name, dtype="bf16", vae_dtype="fp32"), {TRITON_KERNELS[name]}
        kw = dict(TINY, model=A14B + "-d64", num_inference_steps=2, boundary_ratio=0.95)
        by_step = ["transformer", "transformer_2"]
    else:
        (settings, labels), kw, by_step = TABLE[name], TINY, BY_STEP
    ctx = triton_interpreter("vdbench.kernels.quant", "vdbench.kernels.attention") if name in TRITON_KERNELS \
        else contextlib.nullcontext()
    cfg = _cfg(tmp_path, **{**kw, **settings})
    lines = []
    with ctx:
        R.render(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    (entry,) = json.loads(cfg.timing_path.read_text())
    assert entry["run"]["resolved"]["schedule"]["denoiser_by_step"] == by_step
    att = entry["attention"]
    assert att["fallback_calls"] == 0
    calls = att["calls_by_denoiser"]
    per_step = _calls_per_step(entry)
    for d in ("transformer", "transformer_2"):
        want = labels.get(d) if isinstance(labels, dict) else labels
        assert set(calls[d]) == want, (d, calls)
        assert sum(calls[d].values()) == sum(n for n, s in zip(per_step, by_step) if s == d), (d, calls)
    assert sum(sum(c.values()) for c in calls.values()) == att["total_calls"]
    if name == "compile":  # each expert's blocks compiled; the low-noise expert's first step made its own graphs
        assert set(entry["run"]["resolved"]["speed_options"]["compile"]["models"]) == {"transformer", "transformer_2"}
        assert entry["compile"]["graphs_per_step"][BY_STEP.index("transformer_2")] > 0
        said = [ln for ln in lines if "torch.compile" in ln]  # said as the expert's first graphs, no recompile
        assert "step 4: transformer_2's first, its own blocks' graphs" in said[0] and len(said) == 1, said
    if name == "cache":
        assert entry["cache"]["denoiser_per_step"] == by_step and sum(entry["cache"]["reused_blocks_per_step"]) > 0


# ----- the parallel layouts over gloo, diffusers' engine, against one process -----

def _image(path: Path, height: int, width: int) -> Path:
    from PIL import Image

    Image.fromarray((np.arange(height * width * 3) % 251).astype(np.uint8).reshape(height, width, 3)).save(path)
    return path


def _latents(out: Path, rank: int = 0) -> torch.Tensor:
    from vdbench.capture import load_latents

    files = sorted((out / "captures").glob(f"latents_*_rank{rank}_*.pt"))
    assert files, f"no latents under {out / 'captures'}"
    return load_latents(files[-1])[0].float()


def _frames(out: Path) -> np.ndarray:
    (path,) = (out / "results").glob("*.npy")
    return np.load(path)


def _entry(out: Path) -> dict:
    return json.loads((out / "results" / "timing.json").read_text())[-1]


DIFFUSERS = ["--parallel_engine", "diffusers"]
UNSKIPPED_FBC = ["--cache", "fbc:threshold=0.001"]  # reuses nothing here: the frames are the uncached render's


@pytest.mark.slow
def test_wan22_models_under_the_parallel_layouts_match_one_process(tmp_path):
    """A14B (both experts: 4 steps, the last the low-noise expert's) under Ulysses-2, ring-2, CFG-2 and CFG-2 x
    Ulysses-2; TI2V-5B's image-to-video (per-token timesteps: the conditioning frame's tokens at 0, split with the
    tokens) under Ulysses-2 and CFG-2; I2V-A14B under CFG-2. Each against its one-process render: the latents on
    every rank and the frames, bit for bit (ring: to fp32 rounding); each rank's attention calls by expert."""
    common = ["--num_inference_steps", "4", "--attention_type", "sdpa", "--save_frames", "--save_latents"]
    models = {
        "a14b": ["--model", A14B, "--height", "64", "--width", "64", "--num_frames", "5"],
        "ti2v": ["--model", "tiny:wan2.2-ti2v-5b", "--task", "ti2v", "--height", "64", "--width", "128",
                 "--num_frames", "9", "--img_file_path", str(_image(tmp_path / "ti2v.png", 64, 128))],
        "i2v": ["--model", "tiny:wan2.2-i2v-a14b", "--task", "i2v", "--height", "64", "--width", "64",
                "--num_frames", "5", "--img_file_path", str(_image(tmp_path / "i2v.png", 64, 64))],
    }
    layouts = {"u2": (["--ulysses_degree", "2"], 2), "r2": (["--ring_degree", "2"], 2),
               "cfg": (["--use_cfg_parallel"], 2), "ucfg": (["--ulysses_degree", "2", "--use_cfg_parallel",
                                                             *UNSKIPPED_FBC], 4)}
    runs = {"a14b": ["u2", "r2", "cfg", "ucfg"], "ti2v": ["u2", "cfg"], "i2v": ["cfg"]}
    for model, names in runs.items():
        one = tmp_path / model / "one"
        proc = launch.render("wan", models[model] + common + ["--benchmark_output_directory", str(one)],
                             one.parent / "one.logs", nproc=1, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ref, ref_frames, ref_entry = _latents(one), _frames(one), _entry(one)
        assert ref_frames.std() > 1.0
        ref_calls = ref_entry["attention"]["calls_by_denoiser"]
        for name in names:
            flags, n = layouts[name]
            out = tmp_path / model / name
            proc = launch.render("wan", models[model] + common + DIFFUSERS + flags
                                 + ["--benchmark_output_directory", str(out)], out.parent / f"{name}.logs", nproc=n,
                                 timeout=300)
            assert proc.returncode == 0, (model, name, proc.stderr[-3000:])
            for r in range(n):
                got = _latents(out, r)
                if name == "r2":
                    assert ((got - ref).norm() / ref.norm()).item() < 1e-5, (model, name, r)
                else:
                    assert torch.equal(got, ref), (model, name, r)
            frames = _frames(out)
            if name == "r2":
                assert np.abs(frames.astype(int) - ref_frames.astype(int)).max() <= 1
            else:
                assert np.array_equal(frames, ref_frames), (model, name)
            entry = _entry(out)
            assert entry["parallel"]["engine"] == "diffusers" and entry["parallel"]["world_size"] == n
            share = 2 if "cfg" in name else 1  # a CFG rank computes one guidance branch
            want = {d: sum(c.values()) // share for d, c in ref_calls.items()}  # half self-, half cross-attention
            for rank in entry["ranks"]:
                mine = rank["attention"]["calls_by_denoiser"]
                if name == "r2":  # each self-attention call: one kernel call per ring hop (2), with its LSE
                    assert mine == {d: {"sdpa[flash][lse]@ring2": n, "sdpa[flash]": n // 2} for d, n in want.items()}
                else:
                    assert {d: sum(c.values()) for d, c in mine.items()} == want, (model, name, mine)
            if name == "ucfg":  # the cache on both experts, one guidance branch counted on each rank
                c = entry["cache"]
                assert c["denoiser_per_step"] == BY_STEP and sum(c["reused_blocks_per_step"]) == 0, c
                assert c["ranks_agree"] is True and all(r["cache"]["forwards_per_step"] == [1] * 4
                                                        for r in entry["ranks"])
        assert set(ref_calls) == ({"transformer"} if model == "ti2v" else {"transformer", "transformer_2"})
