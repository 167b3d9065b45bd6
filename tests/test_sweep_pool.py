"""The sweep on the pool: the budget counted over renders side by side, prompt and seed sets, the throughput line,
the Wan 2.2 targets (task from the model, an image-to-video sweep), the offload and fp8x stacks and the memory
estimate behind --max_gpu_mem."""

import argparse
import json
import math
import sys

import pytest

from vdbench import sweep as S
from vdbench.measure.record import Record
from vdbench.sweep import memory as M
from vdbench.sweep import stages


def _cands(*names):
    return [S.Candidate(n, n) for n in names]


def test_the_plan_counts_renders_side_by_side():
    pending = [(c, 100.0, "b") for c in _cands("a", "b", "c", "d")]
    one = S.plan_renders(pending, 250.0)
    assert [p["render"] for p in one] == [True, True, False, False]  # 2 x 120 s fit in 250 s, one after another
    four = S.plan_renders(pending, 250.0, slots=4)
    assert all(p["render"] for p in four)  # four places: each its own 120 s
    three = S.plan_renders(pending, 250.0, slots=3)
    assert [p["render"] for p in three] == [True, True, True, True]  # the fourth after the first: 240 s
    assert [p["render"] for p in S.plan_renders(pending, 230.0, slots=3)] == [True, True, True, False]


def test_on_several_gpus_the_reference_comes_before_the_layouts():
    cands = [S.Candidate("default", "default"), S.Candidate("reference", "reference", is_reference=True),
             S.Candidate("fav3", "fav3"), S.parse_stack("fav3+u2"), S.parse_stack("fav3+compile")]
    assert [c.name for c in S.render_order(cands)] == ["default", "fav3", "fav3+u2", "fav3+compile", "reference"]
    assert [c.name for c in S.render_order(cands, slots=4)] == ["default", "fav3", "fav3+compile", "reference",
                                                                "fav3+u2"]


def test_offload_and_fp8x_stacks_map_to_their_flags():
    c = S.parse_stack("default+offload=expert")
    assert (c.name, c.flags) == ("default+offload=expert", ["--offload", "expert"])
    c = S.parse_stack("fav3+fp8x+offload=group+u2")
    assert c.name == "fav3+offload=group+fp8x+u2" and c.nproc == 2  # the name the render records, options in order
    assert c.flags[:4] == ["--ulysses_fp8_exchange", "on", "--offload", "group"] and not c.exact
    with pytest.raises(ValueError, match="unknown offload 'disk'; valid: model, group, expert"):
        S.parse_stack("sdpa+offload=disk")


def _ns(**kw):
    base = dict(model="tiny", height=64, width=96, num_frames=9, steps=2, seed=42, device="cpu", task=None,
                prompt=None, img_file_path=None, prompts=None, seeds=None, gpus="all", max_gpu_mem=None, family=None)
    return argparse.Namespace(**{**base, **kw})


def test_the_wan22_targets_take_their_task_and_an_image_to_video_sweep_needs_its_image(tmp_path):
    for model, task in (("random:wan2.2-t2v-a14b", "t2v"), ("random:wan2.2-ti2v-5b", "ti2v"),
                        ("tiny:wan2.2-i2v-a14b", "i2v")):
        args = _ns(model=model, img_file_path=str(tmp_path / "x.png") if task == "i2v" else None)
        assert stages.context(args, tmp_path).args.task == task, model
    with pytest.raises(ValueError, match="renders i2v: give the image to animate"):
        stages.context(_ns(model="random:wan2.2-i2v-a14b"), tmp_path)
    ctx = stages.context(_ns(model="tiny", task="ti2v", prompt="a dog"), tmp_path)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na car\n")
    ctx = stages.context(_ns(prompts=str(prompts), seeds="1,2", img_file_path="im.png", task="ti2v"), tmp_path)
    assert [c.tag for c in ctx.sets] == ["p1 seed1", "p1 seed2", "p2 seed1", "p2 seed2"]
    argv = stages.render_args(ctx.args, S.Candidate("sdpa", "sdpa"), tmp_path, [], ctx.sets[3])
    assert argv[argv.index("--seed") + 1] == "2" and argv[argv.index("--prompt") + 1] == "a car"
    assert argv[argv.index("--task") + 1] == "ti2v" and argv[argv.index("--img_file_path") + 1] == "im.png"
    rec = Record(suite="render", case="sdpa", config={"settings": {"prompt": "a car", "seed": 1}})
    assert ctx.content_of(rec) == 2


def _row(stack, gpus, e2e, psnr=45.0, j=None):
    return {"stack": stack, "gpus": gpus, "videos_per_gpu_h": 3600 / (e2e * gpus), "end_to_end_s": e2e,
            "j_per_video": j, "emulated": False, "is_reference": False, "psnr_db": psnr, "speed_figure": True,
            "why_not_speed": None}


def test_the_throughput_line_weighs_one_render_per_gpu_against_the_best_layout():
    rows = [_row("default", 1, 90.0, j=9000.0), _row("fav3", 1, 60.0, 45.1, 6000.0), _row("fav3_fp8", 1, 50.0, 30.0),
            _row("fav3+u4", 4, 20.0, 45.0, 7000.0), _row("fav3+u2cfg2", 4, 18.0, 45.0)]
    text = S.throughput_text(rows, 4, tolerance_db=0.5)
    # fav3_fp8 is faster but 15 dB off exact: the one-GPU pick is fav3
    assert text.startswith("throughput on 4 GPUs: 4 one-GPU renders side by side, fav3: 60 videos/GPU-h, 240 an "
                           "hour on 4, a video every 60 s on each GPU, 6e+03 J/video; the best 4-GPU layout, "
                           "fav3+u2cfg2: 50 videos/GPU-h, 200 an hour on 4, a video every 18 s")
    assert "3600 / (end-to-end s x its GPUs)" in text and "NOT speed" not in text


def _default_record(load, denoise, decode):
    mem = {k: {"allocated_peak": v - 2**30, "reserved_peak": v} for k, v in
           (("load", load), ("denoise", denoise), ("decode", decode))}
    return Record(suite="render", case="default", config={}, data={"memory": mem, "run": {"model": {
        "transformers": {"transformer": {"dtype": "bfloat16"}, "transformer_2": {"dtype": "bfloat16"}}}}})


def test_a_candidates_peak_is_estimated_from_defaults_and_an_offload_stack_recommended(tmp_path):
    w = M.weights("random:wan2.2-t2v-a14b", "t2v", "wan")  # two 14.3B experts, 40 blocks each (meta device)
    assert [round(p / 1e9, 1) for p in w["denoisers"]] == [14.3, 14.3] and w["blocks"] == [40, 40]
    expert = w["denoisers"][0] * 2
    gib = M.GIB
    # before default is rendered: the denoisers' weights alone, a lower bound
    est, basis = M.estimate_peak(S.Candidate("fav3", "fav3"), None, w)
    assert est == 2 * expert and basis.startswith("lower bound")
    base = M.measured(_default_record(70 * gib, 78 * gib, 72 * gib))
    assert M.estimate_peak(S.Candidate("fav3", "fav3"), base, w)[0] == 78 * gib
    est, basis = M.estimate_peak(S.parse_stack("default+offload=expert"), base, w)
    assert est == pytest.approx(78 * gib - expert + expert / 40) and "one expert" in basis
    grp, _ = M.estimate_peak(S.parse_stack("default+offload=group"), base, w)
    assert grp == pytest.approx(max(8 * gib, 2 * gib + 70 * gib - 2 * expert) + 2 * expert / 40)
    model, _ = M.estimate_peak(S.parse_stack("default+offload=model"), base, w)
    assert model == pytest.approx(max(8 * gib + expert, 72 * gib - 2 * expert))
    # what an H200 measured (reserved, A14B 720p: resident load / denoise / decode 54.9 / 66.5 / 70.4 GiB; under the
    # model offload the largest, denoising, 38.4): the estimate within 1 GiB of it, not the resident decode's 70.4
    measured = M.measured(_default_record(54.9 * gib, 66.5 * gib, 70.4 * gib))
    est, _ = M.estimate_peak(S.parse_stack("default+offload=model"), measured, w)
    assert abs(est - 38.4 * gib) < 1 * gib, est / gib
    # 60 GiB: expert offload (~52 GiB) fits; 40 GiB: the block-wise group offload
    assert M.offload_advice(S.Candidate("default", "default"), base, w, 60 * gib).startswith(
        "nothing fits in 60 GiB resident: try --stacks default+offload=expert (estimated 52.")
    assert "default+offload=group" in M.offload_advice(S.Candidate("default", "default"), base, w, 40 * gib)
    assert M.measured(Record(suite="render", case="x", data={"memory": {"load": None}})) is None  # a CPU's
    # nothing measured (default did not fit): the offload stacks' lower bounds still say what to try
    assert M.offload_advice(S.Candidate("default", "default"), None, w, 40 * gib).startswith(
        "nothing fits in 40 GiB resident: try --stacks default+offload=expert (estimated at least 27.3 GiB)")


@pytest.mark.slow
def test_a_cpu_sweep_renders_side_by_side_over_a_seed_set(tmp_path, capsys, monkeypatch, fork_python):
    monkeypatch.setattr(sys, "executable", fork_python)  # the renders forked (tests/launch.py)
    out = tmp_path / "sweep"
    assert S.main(["--model", "tiny", "--budget_min", "10", "--max_candidates", "0", "--steps", "2", "--height", "32",
                   "--width", "32", "--num_frames", "5", "--jobs", "2", "--seeds", "1,2", "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert "[sweep] renders 2 at once (no GPU), each candidate on 2 prompt/seed pairs" in log
    assert "[sweep] default seed2: rendered in" in log and "[sweep] reference seed1: rendered in" in log
    meta = json.loads((out / "sweep.json").read_text())
    rows = {r["stack"]: r for r in meta["rows"]}
    assert rows["default"]["psnr_n"] == 2 and rows["reference"]["psnr_db"] == math.inf
    assert meta["throughput"].startswith("throughput on 1 GPU: one render, ") and "NOT speed figures" in \
        meta["throughput"]
    assert len(list((out / "runs" / "default" / "results").glob("*.npy"))) == 2
