"""A render's stack -- attention, speed options, VAE modes, step cache -- as one name: built from the resolved
configuration, recorded in timing.json, the summary line, the output name, the record's label (batch table, report,
grid), read back by the sweep's grammar; invalid combinations refused before any weight loads."""

import json
from pathlib import Path

import pytest

import run_wan
from vdbench import batch, cli, families
from vdbench import render as R
from vdbench import sweep as S
from vdbench.measure import record as M
from vdbench.report import identities
from vdbench.video import identity_from_filename

from .test_render import _cfg, no_load  # noqa: F401 - the fixture: any weight load fails the test

SMALL = ["--model", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps", "2"]


def test_the_stack_name_orders_the_options_and_a_plain_stack_is_its_attention():
    speed = M.speed_options(compile=True, fp8_gemms=True)
    assert M.stack_name("sagev2_fp8:gran=per_warp", speed, "fast", "default", "mag:threshold=0.1") == \
        "sagev2_fp8:gran=per_warp+compile+fp8gemm+vae=fast+mag:threshold=0.1"
    assert M.stack_name("sdpa", (), "default", "default", None) == "sdpa"
    assert M.speed_options(True, "aot_eager", "max-autotune") == ("compile=aot_eager",)  # only inductor takes a mode
    assert M.speed_options(True, "inductor", "max-autotune", bf16_te_gemms=True) == \
        ("compile=inductor:max-autotune", "bf16te")
    assert M.stack_name("sdpa", M.speed_options(True, "inductor", None, False, True), "fast", "default", "fbc") == \
        "sdpa+compile+bf16te+vae=fast+fbc"
    # the fp8 GEMMs' scope: every block Linear is the bare word, the feed-forward ones a value; a record written
    # before the scope existed (True) reads as all of them
    assert M.speed_options(fp8_gemms="all") == M.speed_options(fp8_gemms=True) == ("fp8gemm",)
    assert M.speed_options(compile=True, fp8_gemms="ffn") == ("compile", "fp8gemm=ffn")
    assert M.speed_options(fp8_gemms=None) == M.speed_options(fp8_gemms=False) == ()
    assert M.stack_name("sdpa", M.speed_options(True, "inductor", None, "ffn", True), "fast", None, "fbc") == \
        "sdpa+compile+fp8gemm=ffn+bf16te+vae=fast+fbc"


@pytest.mark.parametrize("text,name", [
    ("fav3+compile+fp8gemm+vae=fast", "fav3+compile+fp8gemm+vae=fast"),
    ("fav3+fbc:threshold=0.2+fp8gemm=ffn+compile", "fav3+compile+fp8gemm=ffn+fbc:threshold=0.2"),
    ("fav3+fp8gemm=all", "fav3+fp8gemm"),  # the default scope is the bare word
    ("fav3+vae=fast+compile", "fav3+compile+vae=fast"),  # one order
    ("fav3+cache=fbc:threshold=0.05", "fav3+fbc:threshold=0.05"),  # the cache's spec written bare
    ("sdpa+compile=aot_eager+mag:threshold=0.1,mag_ratios=1.0+0.9", "sdpa+compile=aot_eager+mag:threshold=0.1,"
                                                                       "mag_ratios=1.0+0.9"),
    ("sdpa_math@steps:0-1+3-,sta+bf16te", "sdpa_math@steps:0-1+3-,sta+bf16te"),  # a selector's own '+'
    ("sdpa@kind:self+cross,sta+encode=fast", "sdpa@kind:self+cross,sta+encode=fast"),
])
def test_a_sweep_stack_is_named_as_its_render_records_it(text, name):
    cand = S.parse_stack(text)
    assert cand.name == name
    assert S.parse_stack(name).name == name  # the recorded name reads back as itself
    assert M.split_stack(name, cache_kinds=("fbc", "mag"))[0] == cand.attention


def test_a_sweep_stack_gives_the_render_flags():
    c = S.parse_stack("sdpa+compile=inductor:max-autotune+bf16te+mag:threshold=0.1,mag_ratios=1.0+0.9")
    assert c.flags == ["--use_torch_compile", "--compile_backend", "inductor", "--compile_mode", "max-autotune",
                       "--use_bf16_te_gemms", "--cache", "mag:threshold=0.1,mag_ratios=1.0+0.9"]
    with pytest.raises(ValueError, match="unknown option 'compil'"):
        S.parse_stack("sdpa+compil")


def test_the_options_tag_reads_back_and_a_plain_name_has_none():
    tag = M.options_tag(("compile=inductor:max-autotune-no-cudagraphs", "fp8gemm"), "fast", "default")
    assert tag == "compile=inductor-max-autotune-no-cudagraphs-fp8gemm-vae=fast"
    assert M.options_from_tag(tag) == (("compile=inductor:max-autotune-no-cudagraphs", "fp8gemm"), "fast", None)
    assert M.options_tag((), "default", "default") == ""
    wan, cog = families.get("wan"), families.get("cogvideox")
    stem = "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96_compile=aot_eager-vae=fast_cache-fbc_u2"
    assert wan.parse_name(stem) == ("sdpa", "u2") and wan.label(stem) == "sdpa+compile=aot_eager+vae=fast+fbc+u2"
    assert cog.label("cogvideox-tiny_fav3_fp8_compile-fp8gemm") == "fav3_fp8+compile+fp8gemm"
    assert wan.label("wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96") == "sdpa"


def test_the_fp8_gemm_scope_round_trips_through_flag_name_tag_and_record(tmp_path, capsys):
    """``--use_fp8_gemms ffn``: the output name's tag, the name read back, the record's identity -- one stack
    name, ``fp8gemm=ffn``; the bare flag stays ``fp8gemm``."""
    tag = M.options_tag(("compile", "fp8gemm=ffn"), "fast", "default")
    assert tag == "compile-fp8gemm=ffn-vae=fast"
    assert M.options_from_tag(tag) == (("compile", "fp8gemm=ffn"), "fast", None)
    assert families.get("cogvideox").label("cogvideox-tiny_fav3_fp8_fp8gemm=ffn") == "fav3_fp8+fp8gemm=ffn"
    out = str(tmp_path)
    for flags in (["--use_fp8_gemms", "ffn"], ["--use_fp8_gemms"], ["--use_fp8_gemms", "all"]):
        assert run_wan.main(SMALL + ["--attention_type", "sdpa", "--output_dir", out, "--use_torch_compile", *flags,
                                     "--cache", "fbc:threshold=0.2", "--print_output_path"]) == 0
    names = [Path(p) for p in capsys.readouterr().out.split()]
    assert [p.name for p in names] == [
        "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96_compile-fp8gemm=ffn_cache-fbc-threshold=0.2.mp4",
        *["wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96_compile-fp8gemm_cache-fbc-threshold=0.2.mp4"] * 2]
    assert [identity_from_filename(p).label for p in names[:2]] == [
        "sdpa+compile+fp8gemm=ffn+fbc:threshold=0.2", "sdpa+compile+fp8gemm+fbc:threshold=0.2"]
    wan = families.get("wan")
    scopes = [cli.config_from_args(wan, cli.build_parser(wan).parse_args(SMALL + ["--output_dir", out, *f])).fp8_gemms
              for f in (["--use_fp8_gemms", "ffn"], ["--use_fp8_gemms"], [])]
    assert scopes == ["ffn", "all", None]  # the render's setting is the scope
    rec = M.Record(suite="render", case="sdpa", config={"backend": {"name": "sdpa"}, "settings": {
        "attention_type": "sdpa", "compile": True, "compile_backend": "inductor", "fp8_gemms": "ffn"}})
    assert M.identity(rec).stack == "sdpa+compile+fp8gemm=ffn"
    old = M.Record(suite="render", case="sdpa", config={"backend": {"name": "sdpa"}, "settings": {
        "attention_type": "sdpa", "fp8_gemms": True}})
    assert M.identity(old).stack == "sdpa+fp8gemm"


def test_a_stacked_render_records_its_stack_everywhere(tmp_path, capsys):
    """One tiny render (compile through the eager backend, the fast VAE decode): the name in timing.json, the record,
    the summary line, the output name, the batch table's and the grid's label; a plain render beside it keeps its
    name and its label is its attention."""
    out = str(tmp_path)
    assert run_wan.main(SMALL + ["--attention_type", "sdpa", "--output_dir", out]) == 0
    assert run_wan.main(SMALL + ["--attention_type", "sdpa", "--output_dir", out, "--use_torch_compile",
                                 "--compile_backend", "eager", "--vae_decode", "fast"]) == 0
    stack = "sdpa+compile=eager+vae=fast"
    assert f"[{stack}] warm step" in capsys.readouterr().out
    results = tmp_path / "results"
    plain = results / "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96.mp4"
    stacked = results / "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96_compile=eager-vae=fast.mp4"
    assert plain.is_file() and stacked.is_file()
    entries = json.loads((results / "timing.json").read_text())
    assert [e["stack"] for e in entries] == ["sdpa", stack]
    recs = M.read(results / "records.jsonl")
    assert [r.config["stack"] for r in recs] == ["sdpa", stack]
    assert [M.identity(r).stack for r in recs] == ["sdpa", stack]
    assert [i.label for i in identities([plain, stacked])] == ["sdpa", stack]  # the stitched grid's labels
    assert identity_from_filename(stacked).label == stack  # the fallback reads the same name
    rows, _ = batch.rows(results, [plain, stacked])
    assert [r["backend"] for r in rows] == ["sdpa", stack]
    assert batch.table(results, [plain, stacked]).splitlines()[0].startswith("stack ")


@pytest.mark.parametrize("kw,message", [
    (dict(fp8_gemms=True), "--use_fp8_gemms can't run here: "),
    (dict(fp8_gemms="ffn"), "--use_fp8_gemms can't run here: "),
    (dict(fp8_gemms="attn"), "--use_fp8_gemms attn: unknown scope"),
    (dict(compile_mode="max-autotune"), "--compile_mode max-autotune without --use_torch_compile"),
    (dict(compile_backend="eager"), "--compile_backend eager without --use_torch_compile"),
    (dict(compile=True, compile_backend="eager", compile_mode="max-autotune"), "only inductor takes a mode"),
    (dict(compile=True, cache="pab"), "with --use_torch_compile: its hooks sit on the attention modules"),
])
def test_a_combination_that_cant_take_effect_is_refused_before_the_load(tmp_path, no_load, kw, message):  # noqa: F811
    with pytest.raises(Exception, match=message) as e:
        R.validate(_cfg(tmp_path, **kw))
    assert len(str(e.value).splitlines()) == 2  # the fact, then the hint


def test_the_cli_says_the_refusal_in_one_line_and_a_hint(tmp_path, capsys, no_load):  # noqa: F811
    assert run_wan.main(SMALL + ["--output_dir", str(tmp_path), "--compile_mode", "max-autotune"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "error: --compile_mode max-autotune without --use_torch_compile: nothing is compiled"
    assert lines[1].startswith("hint: add --use_torch_compile")
    assert not (Path(tmp_path) / "results" / "timing.json").exists()
