"""A render's identity decides its files: renders that differ in a frame-changing setting never share one, each
record vouches for its own bytes, readers refuse a file that no longer matches, quality is compared within one
content; each Wan model runs on its own schedule."""

import csv
import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest

import run_wan
import sageattn_cogvideo
import stitch_comparison
from vdbench import cli, families, identity, pipelines
from vdbench import render as R
from vdbench import report

SMALL = ["--model", "tiny", "--height", "32", "--width", "32", "--num_frames", "5", "--num_inference_steps", "2",
         "--save_frames"]


def _entries(results: Path) -> list:
    return json.loads((results / "timing.json").read_text())


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """Four renders into one folder: sdpa and the exact reference, each with seed 1 and seed 2."""
    out = tmp_path_factory.mktemp("seeds")
    for seed in ("1", "2"):
        for backend in ("sdpa", "reference"):
            assert run_wan.main(SMALL + ["--seed", seed, "--attention_type", backend,
                                         "--benchmark_output_directory", str(out)]) == 0
    return out / "results"


def test_renders_that_differ_only_by_seed_keep_a_video_each_and_vouch_for_its_bytes(seeds):
    entries = _entries(seeds)
    outputs = [Path(e["output"]) for e in entries]
    assert len(set(outputs)) == 4 and all(p.is_file() for p in outputs)
    assert [p.name for p in outputs[:2]] == ["wan_result_t2v_tiny_5f_2s_attn_sdpa_32x32_seed1.mp4",
                                             "wan_result_t2v_tiny_5f_2s_attn_reference_32x32_seed1.mp4"]
    for e, p in zip(entries, outputs):
        assert e["output_sha256"] == identity.file_sha256(p)
        assert e["frames_sha256"] == identity.file_sha256(p.with_suffix(".npy"))
        assert e["identity"]["seed"] == e["run"]["settings"]["seed"] and e["identity"]["id"] is None
    # one content per seed, whatever computed it
    contents = [e["identity"]["content"] for e in entries]
    assert contents[0] == contents[1] != contents[2] == contents[3]


def test_the_report_and_the_grid_compare_each_render_with_the_reference_of_its_own_seed(seeds, tmp_path):
    rows = {r["backend"]: r for r in report.summarize(seeds)["rows"]}
    assert set(rows) == {"sdpa [seed1]", "reference [seed1]", "sdpa [seed2]", "reference [seed2]"}
    for seed in ("1", "2"):
        assert rows[f"sdpa [seed{seed}]"]["reference"] == f"reference [seed{seed}]"
        assert rows[f"reference [seed{seed}]"]["psnr_db"] == float("inf")
        assert rows[f"sdpa [seed{seed}]"]["psnr_db"] > 20  # the same content: close, not another seed's frames
    inputs = [e["output"] for e in _entries(seeds)]
    labels = report.figure_labels(inputs, [i.label for i in report.identities(inputs)], "reference", seeds)
    assert [lab.split(" · ")[0] for lab in labels] == ["sdpa [seed1]", "reference [seed1]", "sdpa [seed2]",
                                                       "reference [seed2]"]
    assert labels[1].endswith(" · ref") and labels[3].endswith(" · ref")
    assert labels[0].endswith(" dB") and labels[2].endswith(" dB")
    # the report's table says the LPIPS, or why it has none (the optional package or its weights)
    report.write_csv([report.summarize(seeds)], tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv") as f:
        assert "lpips" in next(csv.reader(f))
    notes = report.summarize(seeds)["notes"]
    lpips_rows = [r.get("lpips") for r in rows.values()]
    assert any(n.startswith("LPIPS not computed: ") for n in notes) or all(v is not None for v in lpips_rows)


def test_a_file_replaced_after_its_render_is_refused_by_the_report_and_the_stitcher(seeds, tmp_path, capsys):
    folder = tmp_path / "results"
    shutil.copytree(seeds, folder)
    entries = _entries(folder)
    names = [Path(e["output"]).name for e in entries]
    for e in entries:  # the folder moved: its records name their files in their own folder
        assert report.refused([folder / Path(e["output"]).name], folder) == {}
    # seed 2's sdpa video copied over seed 1's: seed 1's record no longer vouches for the file under its name
    shutil.copy(folder / names[2], folder / names[0])
    (folder / names[0]).with_suffix(".npy").unlink()
    bad = report.refused([folder / n for n in names], folder)
    assert list(bad) == [str(folder / names[0])] and bad[str(folder / names[0])].startswith(f"refused {names[0]}: ")
    summary = report.summarize(folder)
    assert any(n.startswith(f"refused {names[0]}") for n in summary["notes"])
    assert summary["rows"][0]["psnr_db"] is None  # its timing stays, with no quality figure from a wrong file
    assert stitch_comparison.main(["--input_dir", str(folder), "--output", str(tmp_path / "grid.mp4")]) == 0
    err = capsys.readouterr().err
    assert f"refused {names[0]}: its bytes (sha256 " in err


def test_a_render_never_replaces_another_renders_file(seeds):
    """A library caller who names the output path itself: a path whose latest entry is another render is refused
    (and says in what it differs), unless --overwrite."""
    first = _entries(seeds)[0]
    cfg = R.RenderConfig(**{**first["run"]["settings"], "output_path": Path(first["output"]),
                            "timing_path": seeds / "timing.json"})
    R.validate(cfg)  # the same render: may replace its own file
    with pytest.raises(ValueError, match=r"holds another render's video \(it differs in seed\); not replacing"):
        R.validate(replace(cfg, seed=2))
    with pytest.raises(ValueError, match=r"differs in prompt\)"):
        R.validate(replace(cfg, prompt="another prompt"))
    R.validate(replace(cfg, seed=2, overwrite=True))


def _path(*extra, family="wan", base=SMALL):
    fam = families.get(family)
    args = cli.build_parser(fam).parse_args([*base, *extra])
    model = cli._model(fam, args)
    cli._fill_defaults(fam, args, model)
    return cli.output_path(fam, args, model, args.attention_type)


def test_every_setting_that_changes_the_frames_changes_the_file_name(tmp_path):
    image = tmp_path / "a.png"
    other = tmp_path / "b.png"
    from PIL import Image

    Image.new("RGB", (32, 32), (10, 20, 30)).save(image)
    Image.new("RGB", (32, 32), (10, 20, 31)).save(other)
    variants = [(), ("--seed", "1"), ("--prompt", "a dog"), ("--negative_prompt", "x"), ("--guidance_scale", "3"),
                ("--flow_shift", "7"), ("--cpu_offload",), ("--ulysses_fp8_exchange", "on"),
                ("--dtype", "bfloat16"), ("--fps", "8"), ("--fused_rope", "off"), ("--vae_tiling",),
                ("--task", "i2v", "--img_file_path", str(image)), ("--task", "i2v", "--img_file_path", str(other))]
    names = [_path(*v).name for v in variants]
    assert len(set(names)) == len(names), names
    assert names[0] == "wan_result_t2v_tiny_5f_2s_attn_default_32x32.mp4"  # all at their defaults: the plain name
    assert names[1] == "wan_result_t2v_tiny_5f_2s_attn_default_32x32_seed1.mp4"
    assert names[6] == "wan_result_t2v_tiny_5f_2s_attn_default_32x32_offload=model.mp4"  # in the stack, readable
    # the same settings, the same name; the instruments and the repetitions are not the render's identity
    assert _path("--prompt", "a dog") == _path("--prompt", "a dog")
    assert _path("--time_attention", "--num_repetitions", "3", "--power_interval_ms", "0").name == names[0]
    # a picture saved again is the same image; another picture at the same path is another render
    again = tmp_path / "a_again.png"
    Image.open(image).save(again, compress_level=9)
    assert _path("--task", "i2v", "--img_file_path", str(again)) == _path("--task", "i2v", "--img_file_path",
                                                                          str(image)).with_name(names[-2])
    # the two experts' settings (Wan 2.2 A14B)
    a14b = ["--model", "tiny:wan2.2-t2v-a14b", *SMALL[2:]]
    assert len({_path(*v, base=a14b) for v in [(), ("--boundary_ratio", "0.5"), ("--guidance_scale_2", "2")]}) == 3
    # CogVideoX's names carry only the model and backend: a size off the tiny default goes into the id
    cog = ["--model_path", "tiny"]
    assert _path(family="cogvideox", base=cog).name == "cogvideox-tiny_default.mp4"
    assert _path("--height", "64", family="cogvideox", base=cog).name.startswith("cogvideox-tiny_default_id-")
    # a name read back: the readable parts and the tags, for a video no record names
    ident = report.identities([tmp_path / _path("--seed", "7", "--prompt", "p", "--cpu_offload").name])[0]
    assert ident.source == "file name" and ident.attention == "default" and ident.speed == ("offload=model",)
    assert ident.tag.startswith("seed7 id-") and ident.label.startswith("default+offload=model [seed7 id-")


@pytest.mark.parametrize("model,task,size,shift,boundary", [
    ("tiny:wan2.2-t2v-a14b", "t2v", (480, 832), 12.0, 0.875),
    ("random:wan2.2-t2v-a14b", "t2v", (720, 1280), 12.0, 0.875),
    ("random:wan2.2-i2v-a14b", "i2v", (480, 832), 5.0, 0.9),
    ("tiny:wan2.2-i2v-a14b", "i2v", (480, 832), 5.0, 0.9),
    ("random:wan2.2-ti2v-5b", "t2v", (704, 1280), 5.0, None),
    ("tiny:wan2.2-ti2v-5b", "ti2v", (704, 1280), 5.0, None),
    ("random:wan2.1-t2v-1.3b", "t2v", (480, 832), 3.0, None),
    ("random:wan2.1-t2v-14b", "t2v", (480, 832), 3.0, None),
    ("random:wan2.1-t2v-14b", "t2v", (720, 1280), 5.0, None),
])
def test_each_wan_model_runs_on_its_own_schedule_by_default(model, task, size, shift, boundary):
    """Wan 2.2: the shift its scheduler config ships (read without a weight); Wan 2.1: its model card's size
    rule."""
    m = pipelines.resolve(model, task, "wan")
    assert m.shipped["boundary_ratio"] == boundary
    assert m.family.flow_shift(task, *size, m.shipped) == shift


def test_a_two_expert_render_records_its_schedule_and_takes_the_experts_settings(tmp_path, capsys):
    a14b = ["--model", "tiny:wan2.2-t2v-a14b", *SMALL[2:], "--attention_type", "sdpa",
            "--benchmark_output_directory", str(tmp_path)]
    assert run_wan.main(a14b) == 0
    assert run_wan.main(a14b + ["--boundary_ratio", "0.99", "--guidance_scale_2", "2.5"]) == 0
    plain, given = (e["run"]["resolved"]["schedule"] for e in _entries(tmp_path / "results"))
    assert plain == {"flow_shift": 12.0, "flow_shift_from": "the family's default for the model",
                     "boundary_ratio": 0.875, "boundary_from": "the model's config", "guidance_scale": 5.0,
                     "guidance_scale_2": 5.0, "timesteps": [999.0, 923.0],
                     "denoiser_by_step": ["transformer", "transformer"]}  # 2 steps: both above 875
    assert given["boundary_ratio"] == 0.99 and given["boundary_from"] == "--boundary_ratio"
    assert given["denoiser_by_step"] == ["transformer", "transformer_2"]  # 923 < 990: the low-noise expert
    assert given["guidance_scale_2"] == 2.5
    # one denoiser: the experts' flags refused before the load, with the reason
    rc = run_wan.main(SMALL + ["--boundary_ratio", "0.5", "--benchmark_output_directory", str(tmp_path / "x")])
    assert rc == cli.EXIT_BAD_INPUT and "has one denoiser" in capsys.readouterr().err
    rc = sageattn_cogvideo.main(["--model_path", "tiny", "--flow_shift", "3", "--output_dir", str(tmp_path / "c")])
    assert rc == cli.EXIT_BAD_INPUT and "have no flow shift" in capsys.readouterr().err


def test_a_wan21_render_records_the_size_rules_shift(tmp_path):
    assert run_wan.main(SMALL + ["--attention_type", "sdpa", "--benchmark_output_directory", str(tmp_path)]) == 0
    schedule = _entries(tmp_path / "results")[-1]["run"]["resolved"]["schedule"]
    assert schedule["flow_shift"] == 3.0 and schedule["boundary_ratio"] is None
    assert len(schedule["timesteps"]) == 2 and schedule["denoiser_by_step"] is None  # one denoiser
    assert schedule["guidance_scale_2"] is None


def test_the_identity_reads_the_settings_as_data_and_names_what_is_not_identity():
    """Every RenderConfig field is identity unless listed as not: a new field is safe by default."""
    fields = set(asdict(R.RenderConfig(family="wan", task="t2v", model="tiny", prompt="p", negative_prompt="",
                                       height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=5.0,
                                       seed=42, attention_type="sdpa", output_path=Path("x.mp4"),
                                       timing_path=Path("t.json"))))
    assert identity.NOT_IDENTITY <= fields and identity.IN_NAME <= fields
    assert {"prompt", "guidance_scale_2", "boundary_ratio", "flow_shift", "ulysses_fp8_exchange",
            "offload"} <= fields - identity.NOT_IDENTITY
