"""sweep.py (vdbench.sweep): what runs here, the kernel bench on the model's captured attention inputs, the
candidates rendered beside default and reference, the ranking, the Pareto set and the verdict -- on the tiny model,
on a CPU, within its budget, resumable."""

import argparse
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from vdbench import backends as B
from vdbench import sweep as S
from vdbench.measure.record import read


def test_stacks_parse_and_bad_ones_say_what_is_valid():
    c = S.parse_stack("fav3+compile+fp8gemm+vae=fast")
    assert (c.attention, c.flags) == ("fav3", ["--use_torch_compile", "--use_fp8_gemms", "--vae_decode", "fast"])
    assert c.slug == "fav3_compile_fp8gemm_vae=fast"
    ffn = S.parse_stack("fav3+compile+fp8gemm=ffn+fbc:threshold=0.2")
    assert ffn.flags == ["--use_torch_compile", "--use_fp8_gemms", "ffn", "--cache", "fbc:threshold=0.2"]
    assert ffn.name == "fav3+compile+fp8gemm=ffn+fbc:threshold=0.2"
    assert S.option_words(ffn) == ["compile", "fp8gemm=ffn"]
    with pytest.raises(ValueError, match="unknown fp8gemm scope 'attn'; valid: all, ffn"):
        S.parse_stack("fav3+fp8gemm=attn")
    cached = S.parse_stack("fav3+cache=fbc:threshold=0.05")
    assert cached.flags == ["--cache", "fbc:threshold=0.05"] and cached.attention == "fav3"
    with pytest.raises(ValueError, match="unknown option 'turbo'.*compile"):
        S.parse_stack("fav3+turbo")
    with pytest.raises(ValueError, match="no attention type"):
        S.parse_stack("+compile")


def _avail(name, runs=True, emulated=False, why=None):
    return {"backend": name, "runs": runs, "why_not": why, "emulated": emulated}


def test_candidates_are_the_fast_accurate_runnable_kernels_fastest_first():
    avail = [_avail("default"), _avail("reference"), _avail("sdpa"), _avail("sdpa_math"), _avail("flex"),
             _avail("fav3", runs=False, why="package not installed"), _avail("sagev1_emu", emulated=True),
             _avail("fp8_emu", emulated=True), _avail("sta")]
    rows = [{"input": "self.pt", "kernel": "sdpa", "status": "ok", "time_ms": 9.0, "rel_l2": 1e-3},
            {"input": "cross.pt", "kernel": "sdpa", "status": "ok", "time_ms": 0.4, "rel_l2": 2e-3},
            {"input": "self.pt", "kernel": "sdpa_math", "status": "ok", "time_ms": 8.0, "rel_l2": 1e-3},
            {"input": "cross.pt", "kernel": "sdpa_math", "status": "ok", "time_ms": 0.5, "rel_l2": 1e-3},
            {"input": "self.pt", "kernel": "flex", "status": "ok", "time_ms": 0.5, "rel_l2": 0.5},
            {"input": "self.pt", "kernel": "sta", "status": "unavailable: needs the token grid", "time_ms": "",
             "rel_l2": ""}]
    stack = S.parse_stack("sdpa+compile")
    cands, left = S.plan_candidates(avail, rows, max_candidates=1, max_rel_l2=0.1, stacks=[stack])
    # sdpa is faster on the small (cross-attention) input, sdpa_math on the one that costs: the total decides
    assert [c.name for c in cands] == ["default", "reference", "sdpa_math", "sdpa+compile"]
    why = {x["backend"]: x["why"] for x in left}
    assert why["fav3"] == "can't run here: package not installed"
    assert why["sagev1_emu"].startswith("emulation") and why["flex"].startswith("rel L2 0.5")
    assert why["sdpa"] == "beyond --max_candidates 1" and why["sta"].startswith("kernel bench: unavailable")


def test_a_backends_variants_are_candidates_of_their_own():
    """``fav3_fp8`` keeps FA3 fp8's own numerics; its ``smooth_v=1`` variant is the accurate form: both are listed
    (same availability), both benched, and the variant is rendered where the plain form is out of --max_rel_l2."""
    avail = S.availability("cpu")
    by = {a["backend"]: a for a in avail}
    assert "fav3_fp8:smooth_v=1" in by and by["fav3_fp8:smooth_v=1"]["why_not"] == by["fav3_fp8"]["why_not"]
    assert [a["backend"] for a in avail].index("fav3_fp8:smooth_v=1") == [a["backend"] for a in avail].index(
        "fav3_fp8") + 1
    on_gpu = [dict(a, runs=True, why_not=None) for a in avail if a["backend"].startswith("fav3_fp8")]
    rows = [{"input": "self.pt", "kernel": "fav3_fp8", "status": "ok", "time_ms": 7.4, "rel_l2": 3.1e-1},
            {"input": "self.pt", "kernel": "fav3_fp8:smooth_v=1", "status": "ok", "time_ms": 7.9, "rel_l2": 3.9e-3}]
    cands, left = S.plan_candidates(on_gpu, rows, max_candidates=4, max_rel_l2=0.05, stacks=[])
    assert "fav3_fp8:smooth_v=1" in [c.name for c in cands]
    assert {x["backend"]: x["why"] for x in left}["fav3_fp8"].startswith("rel L2 0.31")
    with pytest.raises(ValueError, match="variants but takes no options"):
        B.Backend("toy_v", "a test kernel", fn=B.resolve("sdpa").fn, kernel="toy_v", variants=("x=1",))


def _row(stack, ms, db, speed=True, emulated=False):
    return {"stack": stack, "warm_ms": ms, "psnr_db": db, "speed_figure": speed, "why_not_speed": None if speed
            else "CPU timing", "emulated": emulated, "is_reference": stack == "reference"}


def test_ranking_pareto_and_verdict():
    rows = S.rank([_row("default", 100.0, 45.0), _row("reference", 400.0, math.inf), _row("fast_ok", 80.0, 44.8),
                   _row("fastest", 50.0, 30.0), _row("slow_good", 90.0, 46.0), _row("emu", 10.0, 50.0, emulated=True)])
    assert [r["stack"] for r in rows] == ["fastest", "fast_ok", "slow_good", "default", "reference", "emu"]
    by = {r["stack"]: r for r in rows}
    assert by["fast_ok"]["speedup"] == pytest.approx(1.25) and by["emu"]["speedup"] is None
    assert by["default"]["break_even"] is None and by["emu"]["break_even"] is None
    # one-time costs against the gain per step: 20 ms saved a step pays 1.05 s more once back from step 53
    once = {"default": 0.5, "compiled": 1.55, "free": 0.5, "slow": 0.5}
    paid = S.rank([_row(name, ms, 45.0) | {"one_time_s": once[name]}
                   for name, ms in (("default", 100.0), ("compiled", 80.0), ("free", 90.0), ("slow", 120.0))])
    assert {r["stack"]: r["break_even"] for r in paid} == {"default": None, "compiled": "from 53 steps",
                                                           "free": "always", "slow": "never"}
    assert {s for s, r in by.items() if r["pareto"]} == {"fastest", "fast_ok", "slow_good", "reference"}
    text = S.verdict(rows, device="H200", model="m", tolerance_db=0.5)
    assert text.startswith("on this H200 for m: fast_ok is fastest within 0.5 dB of exact attention's 45.0 dB")
    assert "; fastest is fastest overall (50 ms/step, 2.00x default, 30.0 dB vs the reference)" in text
    assert "NOT speed" not in text
    cpu = S.verdict(S.rank([_row("default", 10.0, 40.0, speed=False)]), device="CPU", model="m", tolerance_db=0.5)
    assert cpu.endswith("-- NOT speed figures (CPU timing)")


# a Wan 1.3B 480p step as captured on an H200: 60 self-attention calls (32760 tokens) and 60 cross-attention calls
# (512 text tokens); kernel-bench times per call (ms) of the kind that machine gave
SELF, CROSS = (1, 12, 32760, 32760, 128), (1, 12, 32760, 512, 128)
CAPTURE_META = {"layout": "BHSD", "settings": {"num_inference_steps": 1}, "unique_shapes": [
    {"shape": "(1, 12, 32760, 128)|(1, 12, 32760, 128)|torch.bfloat16", "calls": 60},
    {"shape": "(1, 12, 32760, 128)|(1, 12, 512, 128)|torch.bfloat16", "calls": 60}]}
PER_CALL = {"default": (11.5, 0.30), "reference": (287.0, 4.6), "fav3": (9.1, 0.20), "sdpa": (11.5, 0.30),
            "fav3_fp8:smooth_v=1": (7.6, 0.25), "fp8_triton": (10.1, 0.37), "fav3_sage": (10.6, 0.38),
            "fav2_triton": (13.1, 0.40), "sdpa_flash": (18.3, 0.5), "flex": (15.2, 0.4), "sagev1": (15.5, 0.4)}


def _bench_rows():
    rows = []
    for kernel, (t_self, t_cross) in PER_CALL.items():
        for i, (shape, t) in enumerate(((SELF, t_self), (SELF, t_self * 1.02), (CROSS, t_cross))):
            rows.append({"input": f"attn_{i}.pt", "kernel": kernel, "status": "ok", "time_ms": t, "rel_l2": 4e-3,
                         **dict(zip(("B", "H", "Sq", "Sk", "D"), shape))})
    rows.append({"input": "attn_2.pt", "kernel": "sta", "status": "unavailable: needs the token grid",
                 "time_ms": "", **dict(zip(("B", "H", "Sq", "Sk", "D"), CROSS))})
    return rows


def test_a_renders_time_is_predicted_from_its_attention_on_the_kernel_bench():
    calls = S.calls_per_step(CAPTURE_META)
    assert calls == {SELF: 60.0, CROSS: 60.0}
    attn = S.attention_ms_per_step(_bench_rows(), calls)
    # per shape the median of the inputs of that shape, times the calls a step makes; sta has no time on every shape
    assert attn["fav3"] == pytest.approx(60 * 9.1 * 1.01 + 60 * 0.2) and "sta" not in attn
    est = {n: S.estimate_render_s(S.Candidate(n, n, is_reference=n == "reference"), default_s=27.0, steps=4,
                                  attn_ms=attn, fallback_s=30.0) for n in ("default", "fav3", "reference")}
    assert est["default"] == (27.0, "default's own render")
    assert est["fav3"][0] == pytest.approx(27.0 - 4 * (attn["default"] - attn["fav3"]) / 1e3)  # ~26.4 s
    # the exact reference is slow because exact fp32 attention is: ~17 s more a step, not "the slowest render x1.2"
    assert 85 < est["reference"][0] < 100 and "kernel bench" in est["reference"][1]
    # a stack's options add their one-time cost: the prior until a render here measured it, then the most measured
    compiled, basis = S.estimate_render_s(S.parse_stack("fav3+compile"), default_s=27.0, steps=4, attn_ms=attn,
                                          fallback_s=30.0)
    assert compiled == pytest.approx(est["fav3"][0] + S.OPTION_ONE_TIME_S["compile"]) and "the prior" in basis
    fp8gemm = S.parse_stack("fav3+compile+fp8gemm")
    assert S.estimate_render_s(fp8gemm, default_s=27.0, steps=4, attn_ms=attn, fallback_s=30.0)[0] == \
        pytest.approx(est["fav3"][0] + S.OPTION_ONE_TIME_S["fp8gemm"])
    ffn, basis = S.estimate_render_s(S.parse_stack("fav3+fp8gemm=ffn"), default_s=27.0, steps=4, attn_ms=attn,
                                     fallback_s=30.0)
    assert ffn == pytest.approx(est["fav3"][0] + S.OPTION_ONE_TIME_S["fp8gemm"]) and "once for fp8gemm=ffn" in basis
    rec = types.SimpleNamespace(figures={"one_time_s": 8.2})
    seen = S.options_one_time({"fav3+compile": rec, "fav3": types.SimpleNamespace(figures={"one_time_s": 0.2})})
    assert seen == {"compile": 8.2}
    compiled, basis = S.estimate_render_s(S.parse_stack("sdpa+compile"), default_s=27.0, steps=4, attn_ms=attn,
                                          fallback_s=30.0, one_time_s=seen)
    assert compiled == pytest.approx(27.0 - 4 * (attn["default"] - attn["sdpa"]) / 1e3 + 8.2)
    assert "measured on an earlier render here" in basis
    # nothing to predict from: the slowest render so far, and the basis says so
    assert S.estimate_render_s(S.Candidate("sta", "sta"), default_s=27.0, steps=4, attn_ms=attn,
                               fallback_s=90.0) == (90.0, "no kernel-bench time for its attention: the slowest render "
                                                          "so far")
    assert S.estimate_render_s(S.Candidate("fav3", "fav3"), default_s=None, steps=4, attn_ms=attn,
                               fallback_s=12.0)[0] == 12.0
    ranking, what = S.predicted_ranking([S.Candidate(n, n) for n in ("fav3", "fav3_fp8:smooth_v=1", "sdpa")] +
                                        [S.parse_stack("fav3+compile")], attn, 1221.5)
    assert [n for n, _ in ranking] == ["fav3_fp8:smooth_v=1", "fav3", "sdpa"]
    assert what.startswith("predicted step")
    # default's measured step with fav3's attention in place of default's
    assert dict(ranking)["fav3"] == pytest.approx(1221.5 / (1221.5 - attn["default"] + attn["fav3"]))


def _plan(left_s, quality_s=1.5):
    """The H200 case: default rendered in 19 s, eight candidates, then the exact reference."""
    attn = S.attention_ms_per_step(_bench_rows(), S.calls_per_step(CAPTURE_META))
    names = ["fav3_fp8:smooth_v=1", "fav3", "fp8_triton", "fav3_sage", "sdpa", "fav2_triton", "flex", "sagev1"]
    cands = S.render_order([S.Candidate("reference", "reference", is_reference=True),
                            S.Candidate("default", "default"), *(S.Candidate(n, n) for n in names)])
    assert [c.name for c in cands] == ["default", *names, "reference"]  # candidates before the reference
    pending = [(c, *S.estimate_render_s(c, default_s=19.0, steps=4, attn_ms=attn, fallback_s=19.0))
               for c in cands[1:]]
    return {p["name"]: p for p in S.plan_renders(pending, left_s, quality_s=quality_s)}


def test_a_short_budget_buys_the_candidates_first():
    assert all(p["render"] for p in _plan(600.0).values())  # plenty: every candidate and the reference
    # the user's H200 sweep had 206 s after the capture and the kernel bench, 187 s after default's 19 s: it skipped
    # all eight candidates for the reference's 87 s x 1.2; now the candidates come first and the reference waits
    short = _plan(187.0)
    assert [n for n, p in short.items() if p["render"]] == [n for n in short if n != "reference"][:7]
    assert short["reference"]["why"].startswith("budget: ") and "kernel bench" in short["reference"]["why"]
    assert not short["sagev1"]["render"]
    tight = _plan(30.0)  # very short: one candidate, no reference
    assert [n for n, p in tight.items() if p["render"]] == ["fav3_fp8:smooth_v=1"]
    assert not any(p["render"] for p in _plan(10.0).values())


def test_without_the_reference_quality_reads_against_the_fastest_exact_kernel():
    cands = [S.Candidate("default", "default"), S.Candidate("reference", "reference", is_reference=True),
             S.Candidate("fav3_fp8", "fav3_fp8"), S.Candidate("sta", "sta"), S.Candidate("sdpa", "sdpa"),
             S.Candidate("fav3", "fav3"), S.parse_stack("fav3+compile")]
    warm = {"default": 1221.0, "fav3_fp8": 900.0, "sta": 700.0, "sdpa": 1210.0, "fav3": 1095.0,
            "fav3+compile": 880.0}
    assert S.quality_baseline(cands, {**warm, "reference": 17761.0}) == "reference"
    # quantized (fav3_fp8), sparse (sta) and a compiled stack are not exact: fav3 is the fastest exact render
    assert S.quality_baseline(cands, warm) == "fav3"
    assert S.quality_baseline(cands, {"default": 1221.0, "fav3_fp8": 900.0}) == "default"
    assert S.quality_baseline(cands, {"fav3_fp8": 900.0}) is None


def _cov(rendered, planned=("fav3_fp8:smooth_v=1", "fav3", "sdpa", "fav3+compile")):
    planned = list(planned)
    return S.Coverage(planned, list(rendered), [n for n in planned if n not in rendered], [],
                      [("fav3_fp8:smooth_v=1", 1.25), ("fav3", 1.12), ("sdpa", 1.0)], "predicted step vs default's")


def test_a_verdict_never_claims_more_renders_than_it_has():
    def rows(vs, **extra):
        return S.rank([_row(n, ms, db) | {"quality_vs": vs} for n, ms, db in (
            ("default", 1221.0, 45.0), ("fav3", 1095.0, math.inf if vs == "fav3" else 45.4),
            ("sdpa", 1210.0, 45.0), *extra.get("more", ()))])

    full = S.verdict(rows("reference"), device="H200", model="m", tolerance_db=0.5,
                     coverage=_cov(["fav3", "sdpa", "fav3_fp8:smooth_v=1", "fav3+compile"]))
    assert "provisional" not in full and "candidates rendered" not in full and "fav3 is fastest within" in full
    part = S.verdict(rows("reference"), device="H200", model="m", tolerance_db=0.5, coverage=_cov(["fav3", "sdpa"]))
    assert part.startswith("on this H200 for m: 2 of 4 candidates rendered (2 skipped for the budget): of the 2 "
                           "rendered, fav3 is fastest within 0.5 dB")
    assert part.endswith("provisional ranking from the kernel bench (predicted step vs default's): "
                         "fav3_fp8:smooth_v=1 1.25x (not rendered), fav3 1.12x, sdpa 1.00x")
    none = S.verdict(S.rank([_row("default", 1221.0, None)]), device="H200", model="m", tolerance_db=0.5,
                     coverage=_cov([]))
    assert none.startswith("on this H200 for m: 0 of 4 candidates rendered (4 skipped for the budget): no measured "
                           "verdict; provisional ranking from the kernel bench")
    # the reference skipped: quality against fav3, and the line says so; default's 45 dB vs fav3 sets the level
    sub = S.verdict(rows("fav3"), device="H200", model="m", tolerance_db=0.5, quality_vs="fav3")
    assert "fav3 is fastest within 0.5 dB of exact attention's 45.0 dB" in sub
    assert "quality against fav3, the fastest exact-kernel render: the exact reference was not rendered" in sub
    alone = S.verdict(S.rank([_row("default", 1221.0, math.inf) | {"quality_vs": "default"},
                              _row("fav3_fp8", 900.0, 38.0) | {"quality_vs": "default"}]),
                      device="H200", model="m", tolerance_db=0.5, quality_vs="default")
    assert "no render beside default computes exact attention" in alone
    assert "fav3_fp8 is fastest overall (900 ms/step, 1.36x default, 38.0 dB vs default)" in alone


@pytest.mark.slow
def test_a_tiny_sweep_on_a_cpu_ranks_within_its_budget_and_resumes(tmp_path, capsys, monkeypatch, fork_python):
    # the sweep's renders and kernel bench start `sys.executable`: here each is forked from this process
    # (tests/launch.py PythonServer), the sweep's own logic unchanged
    monkeypatch.setattr(sys, "executable", fork_python)
    out = tmp_path / "sweep"
    args = ["--model", "tiny", "--budget_min", "10", "--max_candidates", "1", "--out", str(out)]
    assert S.main(args) == 0
    meta = json.loads((out / "sweep.json").read_text())
    rows = {r["stack"]: r for r in meta["rows"]}
    assert {"default", "reference"} <= set(rows)
    planned = set(rows) | {x["backend"] for x in meta["left_out"] if x["why"].startswith(("budget", "render failed"))}
    assert len(planned) == 3  # default, reference and the fastest accurate kernel: rendered, or said why not
    assert all(not x["why"].startswith("render failed") for x in meta["left_out"]), meta["left_out"]
    assert rows["reference"]["psnr_db"] == math.inf and rows["default"]["psnr_db"] > 20
    # read from the raw frames each render saved, not from two separately encoded videos
    assert {r["quality_from"] for r in rows.values()} == {S.RAW} and "codec" not in meta["verdict"]
    assert all(r["n"] == 3 and r["speed_figure"] is False for r in rows.values())  # 4 steps; a CPU's host clock
    assert meta["verdict"].startswith("on this CPU for tiny: ") and "NOT speed figures" in meta["verdict"]
    assert meta["elapsed_s"] < 600  # the budget: no render started that its estimate says won't fit
    assert rows["reference"]["quality_vs"] == "reference" and "provisional" not in meta["verdict"]
    recs = read(out / "records.jsonl")
    assert {r.case for r in recs} == set(rows) and all(r.suite == "sweep" for r in recs)
    assert "<b>on this CPU for tiny" in (out / "report.html").read_text()
    assert (out / "kernels" / "attention.csv").exists() and (out / "backends.txt").read_text().count("\n") > 5
    capsys.readouterr()
    assert S.main(args) == 0  # resumed: nothing rendered again
    log = capsys.readouterr().out
    assert log.count("done earlier (records read back)") == len(rows) and "[sweep] default: rendered" not in log
    again = json.loads((out / "sweep.json").read_text())
    assert again["runs"] == 2 and again["elapsed_s"] >= meta["elapsed_s"]  # one budget across the runs
    progress = json.loads((out / "progress.json").read_text())
    (out / "progress.json").write_text(json.dumps({**progress, "spent_s": 599.9}))  # earlier runs spent nearly all
    assert S.main([*args, "--stacks", "sdpa+vae=fast"]) == 0
    late = json.loads((out / "sweep.json").read_text())
    assert [x["why"].split(":")[0] for x in late["left_out"] if x["backend"] == "sdpa+vae=fast"] == ["budget"]
    assert S.main([*args, "--budget_min", "60", "--stop_after_min", "0.01", "--stacks", "sdpa+vae=fast"]) == 0
    assert "sdpa+vae=fast: skipped" in capsys.readouterr().out  # this run's own bound, the budget aside

    # short: the reference not rendered (its folder put aside) and no budget left for it -- the candidates rank
    # against the fastest exact-kernel render, and the verdict and the column say so
    (out / "runs" / "reference").rename(tmp_path / "reference_aside")
    assert S.main(args) == 0
    short = json.loads((out / "sweep.json").read_text())
    base = short["quality_vs"]
    assert base in rows and base != "reference" and "reference" not in {r["stack"] for r in short["rows"]}
    assert f"quality against {base}, the fastest exact-kernel render: the exact reference was not rendered" in \
        short["verdict"]
    assert [x["why"].split(":")[0] for x in short["left_out"] if x["backend"] == "reference"] == ["budget"], short["left_out"]
    assert {r["stack"]: r["psnr_db"] for r in short["rows"]}[base] == math.inf
    assert f"psnr_db vs {base}" in (out / "report.html").read_text()
    # very short: the candidate's render gone too -- no measured verdict, the kernel bench's ranking provisional
    cand = next(n for n in rows if n not in ("default", "reference"))
    (out / "runs" / S.parse_stack(cand).slug).rename(tmp_path / "cand_aside")
    assert S.main(args) == 0
    assert "for tiny: 0 of 1 candidates rendered (1 skipped for the budget): no measured verdict; provisional " \
           "ranking from the kernel bench" in json.loads((out / "sweep.json").read_text())["verdict"]
    # both back (as a resume with budget would have rendered them): against the reference again, the qualities
    # kept against the stand-in read again from the frames
    (tmp_path / "reference_aside").rename(out / "runs" / "reference")
    (tmp_path / "cand_aside").rename(out / "runs" / S.parse_stack(cand).slug)
    assert S.main(args) == 0
    back = json.loads((out / "sweep.json").read_text())
    assert back["quality_vs"] == "reference" and {r["stack"]: r["psnr_db"] for r in back["rows"]} == {
        k: r["psnr_db"] for k, r in rows.items()}
    moved = tmp_path / "elsewhere"  # carried to another machine (a device call that resumes): found by name there
    out.rename(moved)
    for video in (moved / "runs").rglob("*.mp4"):  # with the reference's video alone: the others' quality was kept
        if not video.is_relative_to(moved / "runs" / "reference"):
            video.unlink()
    capsys.readouterr()
    assert S.main([*args[:-1], str(moved), "--budget_min", "60"]) == 0
    assert capsys.readouterr().out.count("done earlier (records read back)") == len(rows)
    assert {r["stack"]: r["psnr_db"] for r in json.loads((moved / "sweep.json").read_text())["rows"]} == {
        k: r["psnr_db"] for k, r in rows.items()}
    assert S.main(["--model", "tiny", "--stacks", "sdpa+turbo", "--out", str(moved)]) == 2


def test_a_cached_stack_is_ranked_by_its_mean_warm_step():
    """A step cache makes steps of two kinds (computed, reused): the median would rank the reused steps' time alone."""
    from vdbench.measure.record import from_render_entry

    steps = [0.5, 0.100, 0.020, 0.020]  # the first, then one computed and two reused steps
    plain = from_render_entry({"attention_type": "sdpa", "step_times": steps})
    cached = from_render_entry({"attention_type": "sdpa", "step_times": steps,
                                "cache": {"spec": "fbc:threshold=0.5", "skipped_share": 0.5}})
    row = S.row_of(S.parse_stack("sdpa+cache=fbc:threshold=0.5"), cached, None)
    assert row["warm_is"] == "mean" and row["warm_ms"] == pytest.approx(140.0 / 3)
    assert S.row_of(S.parse_stack("sdpa"), plain, None)["warm_ms"] == pytest.approx(20.0)


def test_quality_is_raw_only_when_both_sides_are_raw_frames(tmp_path):
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    near = np.clip(ref.astype(int) + rng.integers(-2, 3, ref.shape), 0, 255).astype(np.uint8)
    np.save(tmp_path / "ref.npy", ref)
    np.save(tmp_path / "near.npy", near)
    q = S.quality_of(tmp_path / "near.npy", (ref, tmp_path / "ref.npy"))
    assert q["from"] == S.RAW and 40 < q["psnr"] < 60
    # the reference read from its video: the codec's noise is on one side, and the figure says so
    assert S.quality_of(tmp_path / "near.npy", (ref, tmp_path / "ref.mp4"))["from"] == S.CODEC
    assert S.quality_of(tmp_path / "near.npy", (ref[:1], tmp_path / "ref.npy")) is None  # shapes differ


def test_layouts_of_each_gpu_count_cheapest_exchange_first():
    assert S.layouts_for(1) == []
    assert S.layouts_for(2) == ["cfg2", "u2", "r2"]
    assert S.layouts_for(4) == ["u2cfg2", "r2cfg2", "u4", "u2r2", "r4"]
    assert S.layouts_for(3, guidance=True) == ["u3", "r3"]  # no CFG split over an odd count
    assert S.layouts_for(4, guidance=False) == ["u4", "u2r2", "r4"]
    # a stack names its layout last; the sweep renders it under torchrun on that many processes
    c = S.parse_stack("fav3+fbc:threshold=0.2+u2cfg2")
    assert c.name == "fav3+fbc:threshold=0.2+u2cfg2" and c.nproc == 4 and not c.exact
    assert c.flags[-3:] == ["--ulysses_degree", "2", "--use_cfg_parallel"]
    cmd = S.render_cmd("wan", argparse.Namespace(model="tiny", height=64, width=96, num_frames=9, steps=2, seed=1,
                                                  device="cpu"), c, Path("o"), [])
    # its own rendezvous port, chosen by the pool and given to no other render of the sweep
    assert cmd[1:9] == ["-m", "torch.distributed.run", "--nproc_per_node=4", "--nnodes", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint"] and cmd[9].startswith("localhost:")
    assert cmd[12:15] == ["-m", "vdbench.cli", "wan"] and "--use_cfg_parallel" in cmd
    assert S.parse_stack("sdpa").nproc == 1


def test_layout_candidates_cross_the_leading_backends_and_leave_out_what_a_path_refuses():
    from vdbench import families

    cands = [S.Candidate("default", "default"), S.Candidate("reference", "reference", is_reference=True),
             S.Candidate("sdpa", "sdpa"), S.Candidate("sagev1_emu", "sagev1_emu"), S.Candidate("fav3", "fav3"),
             S.Candidate("sdpa+vae=fast", "sdpa", ["--vae_decode", "fast"])]
    got, left = S.layout_candidates(cands, [2], fam=families.get("wan"), device="cpu", per_layout=2)
    assert [c.name for c in got] == ["sdpa+cfg2", "sagev1_emu+cfg2", "sdpa+u2", "sagev1_emu+u2", "sdpa+r2"]
    assert all(c.nproc == 2 for c in got) and got[0].flags == ["--use_cfg_parallel"]
    # ring merges blocks with the log-sum-exp: a backend without one is left out with the reason
    assert [x["backend"] for x in left] == ["sagev1_emu+r2"] and "log-sum-exp" in left[0]["why"]


def test_one_verdict_per_gpu_count():
    rows = S.rank([_row("default", 100.0, 45.0), _row("reference", 400.0, math.inf), _row("fav3", 90.0, 45.0),
                   _row("fav3+cfg2", 46.0, 45.0) | {"gpus": 2}, _row("fav3+u2", 52.0, 45.0) | {"gpus": 2}])
    by = {r["stack"]: r for r in rows}
    assert by["fav3+cfg2"]["speedup"] == pytest.approx(100 / 46)  # against one GPU's default
    one = S.verdict(rows, device="H200", model="m", tolerance_db=0.5, gpus=1)
    two = S.verdict(rows, device="H200 x2", model="m", tolerance_db=0.5, gpus=2)
    assert one.startswith("on this H200 for m: fav3 is fastest within 0.5 dB")
    assert two.startswith("on this H200 x2 for m: fav3+cfg2 is fastest within 0.5 dB") and "fav3+u2" not in two
    cov = S.Coverage(["fav3", "fav3+cfg2", "fav3+u2"], ["fav3", "fav3+cfg2"], ["fav3+u2"])
    part = cov.of(lambda n: n.endswith(("cfg2", "u2")))
    assert part.planned == ["fav3+cfg2", "fav3+u2"] and part.text() == "1 of 2 candidates rendered (1 skipped for " \
        "the budget)"


@pytest.mark.slow
def test_a_sweep_renders_a_layout_under_torchrun_and_ranks_it_per_gpu_count(tmp_path, monkeypatch, fork_python):
    """A stack with a layout (``sdpa+cfg2``) is rendered under torchrun (gloo on a CPU) and ranked in its own GPU
    count's verdict; the CFG split of an exact kernel gives the one-process frames (PSNR inf vs sdpa's own)."""
    monkeypatch.setattr(sys, "executable", fork_python)  # torchrun and its workers forked too (tests/launch.py)
    out = tmp_path / "sweep"
    assert S.main(["--model", "tiny", "--budget_min", "10", "--max_candidates", "0", "--steps", "2",
                   "--stacks", "sdpa", "sdpa+cfg2", "--out", str(out)]) == 0
    meta = json.loads((out / "sweep.json").read_text())
    rows = {r["stack"]: r for r in meta["rows"]}
    assert rows["sdpa+cfg2"]["gpus"] == 2 and rows["sdpa"]["gpus"] == 1, meta["left_out"]
    assert rows["sdpa+cfg2"]["psnr_db"] == rows["sdpa"]["psnr_db"]  # the same frames against the reference
    rec = read(next((out / "runs").glob("sdpa_cfg2*")) / "results" / "records.jsonl")[-1]
    assert rec.config["stack"] == "sdpa+cfg2" and rec.data["parallel"]["world_size"] == 2
    assert " | on this CPU x2 for tiny: " in meta["verdict"] and "sdpa+cfg2" in meta["verdict"].split(" | ")[1]
