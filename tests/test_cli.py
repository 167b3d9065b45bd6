"""vdbench.cli: one parser for both render CLIs -- the same flags, both spellings, the historical names, the
family's defaults and output layout, aliases named as ours, exit codes."""

import argparse
import dataclasses

import pytest

import run_wan
import sageattn_cogvideo
from vdbench import cli, families, options
from vdbench.render import RenderConfig


def _long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_both_clis_have_the_same_flags_and_every_flag_has_help_with_its_default():
    wan, cog = cli.build_parser("wan"), cli.build_parser("cogvideox")
    assert _long_flags(wan) == _long_flags(cog)
    for a in wan._actions:
        if a.option_strings and a.dest != "help":
            assert a.help, a.option_strings
            if a.default not in (None, False) and not isinstance(a, argparse._StoreTrueAction):
                assert "default" in a.help, (a.option_strings, a.help)
    # the historical names are aliases of one option each, in both spellings
    for names in (("--model", "--model_path", "--model-path"), ("--img_file_path", "--image", "--img-file-path"),
                  ("--benchmark_output_directory", "--output_dir", "--output-dir"),
                  ("--use_torch_compile", "--compile", "--use-torch-compile"),
                  ("--save_inputs", "--save-inputs"), ("--input_dir", "--input-dir"), ("--max_captures",)):
        dests = {next(a.dest for a in wan._actions if n in a.option_strings) for n in names}
        assert len(dests) == 1, names


def test_each_option_is_declared_once_and_fills_one_render_config_field_with_the_configs_default():
    """The options table (vdbench.options) is the one declaration: each option fills its own RenderConfig field (or
    none: the CLI reads it itself), every field is an option's or the CLI's own (paths, model, rank), and the CLI's
    defaults are RenderConfig's, so a library render and a CLI render of the same settings are the same render."""
    fields = {f.name: f for f in dataclasses.fields(RenderConfig)}
    fills = [o.fills for o in options.OPTIONS if o.fills is not None]
    assert len(fills) == len(set(fills)) and set(fills) <= set(fields)
    own = {"family", "model", "output_path", "timing_path", "capture_dir", "traces_root", "rank"}
    assert set(fields) - set(fills) - own == {"extra_pipe_kwargs"}  # a library caller's: no flag
    names = [o.name for o in options.OPTIONS if o.fills is not None]  # an alias (--cpu_offload) sets another's
    assert len(names) == len(set(names))
    fam = families.get("wan")
    args = cli.build_parser(fam).parse_args(["--model", "tiny"])
    cli._fill_defaults(fam, args, "tiny")
    cfg = cli.config_from_args(fam, args)
    differ = [n for n in fills if fields[n].default is not dataclasses.MISSING and getattr(cfg, n) != fields[n].default]
    assert differ == [], differ


def test_a_command_passing_options_on_declares_them_from_the_table():
    """add_options gives another parser (the sweep's) the render's flags, spellings and help, its own defaults."""
    p = argparse.ArgumentParser(add_help=False)
    options.add_options(p, families.get("wan"), names={"device", "use_fp8_gemms"}, device="cpu")
    assert _long_flags(p) == {"--device", "--use_fp8_gemms", "--use-fp8-gemms"}
    assert vars(p.parse_args(["--use-fp8-gemms"])) == {"device": "cpu", "use_fp8_gemms": "all"}


def test_spellings_parse_to_the_same_config(tmp_path):
    fam = families.get("cogvideox")
    a = cli.build_parser(fam).parse_args(["--model_path", "tiny", "--output_dir", str(tmp_path), "--num_frames", "9",
                                          "--vae_tiling", "--compile"])
    b = cli.build_parser(fam).parse_args(["--model-path", "tiny", "--benchmark-output-directory", str(tmp_path),
                                          "--num-frames", "9", "--vae-tiling", "--use_torch_compile"])
    assert vars(a) == vars(b)


def test_each_family_keeps_its_output_layout_and_an_alias_is_named_as_ours(capsys, tmp_path):
    assert run_wan.main(["--model", "tiny", "--attention_type", "_native_math,fa3", "--output_dir", str(tmp_path),
                         "--print_output_path"]) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "results" / "wan_result_t2v_tiny_17f_4s_attn_sdpa_math_128x192.mp4"),
        str(tmp_path / "results" / "wan_result_t2v_tiny_17f_4s_attn_fav3_128x192.mp4")]
    assert sageattn_cogvideo.main(["--model", "tiny", "--attention-type", "native", "--benchmark_output_directory",
                                   str(tmp_path), "--print-output-path"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "cogvideox-tiny_sdpa.mp4")]


def test_family_defaults_fill_what_is_not_given():
    fam = families.get("wan")
    args = cli.build_parser(fam).parse_args(["--model", "tiny"])
    assert args.height is None  # filled by the CLI from the family, not by argparse
    cli._fill_defaults(fam, args, "tiny")
    assert (args.height, args.width, args.num_frames) == (fam.cli.tiny["height"], fam.cli.tiny["width"],
                                                           fam.cli.tiny["num_frames"])
    real = cli.build_parser(fam).parse_args([])
    cli._fill_defaults(fam, real, cli._model(fam, real))
    assert cli._model(fam, real) == fam.default_models["t2v"] and real.num_frames == fam.cli.real["num_frames"]
    assert cli._model(families.get("cogvideox"), cli.build_parser("cogvideox").parse_args(["--task", "i2v"])) == \
        "THUDM/CogVideoX-5b-I2V"


def test_exit_codes_are_in_the_help_and_bad_input_exits_2(capsys):
    with pytest.raises(SystemExit):
        run_wan.main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes: 0 ok, 2 bad input" in out and "124" in out
    assert run_wan.main(["--model", "tiny", "--num_repetitions", "0"]) == cli.EXIT_BAD_INPUT
    assert "--num_repetitions must be >= 1" in capsys.readouterr().err


def test_vae_decode_lists_and_explains_the_modes_of_the_familys_vae():
    """CogVideoX's VAE has no fast decode: its --vae_decode offers and explains default and parallel only."""
    def action(parser, flag):
        return next(a for a in parser._actions if flag in a.option_strings)

    cog, wan = action(cli.build_parser("cogvideox"), "--vae_decode"), action(cli.build_parser("wan"), "--vae_decode")
    assert list(cog.choices) == ["default", "parallel"] and "fast" not in cog.help
    assert list(wan.choices) == ["default", "fast", "parallel"] and "fast:" in wan.help
    assert all(f"{m}:" in cog.help for m in cog.choices) and "(default: default)" in cog.help


def test_an_error_is_one_line_and_a_hint(capsys):
    cli.say(ValueError("what is wrong\nwhat to do\nwhat runs instead"))
    assert capsys.readouterr().err.splitlines() == ["error: what is wrong", "hint: what to do what runs instead"]
    assert [cli.exit_code(e) for e in (ValueError(), cli.B.BackendUnavailable(), cli.B.UnsupportedCall(),
                                       RuntimeError())] == [2, 2, 3, 1]
