"""The end-of-batch comparison (vdbench.batch): one row per render, read with the report's readers."""

import json

import numpy as np
import pytest

from vdbench import batch
from vdbench.video import write_video

SETTINGS = {"height": 16}


def _entry(video, name, steps, device="cuda:0", emulated=False, run_id="r1", parallel=None, kernels=None, rep=0,
           **extra):
    return {"attention_type": name, "output": str(video), "repetition": rep, "run_id": run_id,
            "step_times": steps, "parallel": parallel,
            "attention": {"calls_by_kernel": kernels or {name: 8}, "fallback_calls": 0},
            "run": {"settings": SETTINGS, "resolved": {"device": device},
                    "backend": {"name": name, "emulated": emulated}}, **extra}


@pytest.fixture
def results(tmp_path):
    """Four renders' videos (the reference, one identical to it, two that differ) and their timing entries."""
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    noisy = np.clip(ref.astype(int) + rng.integers(-6, 7, ref.shape), 0, 255).astype(np.uint8)
    videos = {}
    for name, frames in (("sdpa", ref), ("reference", ref), ("sagev1_emu", noisy), ("fp8_emu", noisy)):
        videos[name] = tmp_path / f"wan_result_t2v_tiny_5f_4s_attn_{name}_16x16.mp4"
        write_video(frames, videos[name], fps=8)
    entries = [_entry(videos["sdpa"], "sdpa", [0.9, 0.10, 0.12, 0.11], kernels={"sdpa[flash]": 32}),
               _entry(videos["reference"], "reference", [0.9, 0.20, 0.22, 0.24]),
               _entry(videos["sagev1_emu"], "sagev1_emu", [3.0, 2.0, 2.0, 2.0], emulated=True),
               _entry(videos["fp8_emu"], "fp8_emu", [3.0, 2.0, 2.0, 2.0], emulated=True)]
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    return tmp_path, videos


def test_rows_give_warm_step_speedup_vs_first_exact_psnr_and_kernels(results):
    d, v = results
    rows, notes = batch.rows(d, [v["sagev1_emu"], v["sdpa"], v["reference"]])  # an emulation first: not the base
    by = {r["backend"]: r for r in rows}
    assert [r["backend"] for r in rows] == ["sagev1_emu", "sdpa", "reference"]  # the batch's order
    assert by["sdpa"]["warm"] == "110 (104–116, n=3)"  # vdbench.timing: the steps after the first, p20–p80
    assert by["sdpa"]["speedup"] == "1.00×" and by["reference"]["speedup"] == "0.50×"
    assert by["sagev1_emu"]["warm"] == by["sagev1_emu"]["speedup"] == "emulated"
    assert by["reference"]["psnr"] == "ref" and by["sdpa"]["psnr"] == "∞ dB"
    assert by["sagev1_emu"]["psnr"].endswith(" dB") and float(by["sagev1_emu"]["psnr"].split()[0]) < 50
    assert by["sdpa"]["kernels"] == "sdpa[flash]×32" and by["sdpa"]["layout"] == "1 process"
    assert notes[0] == "speed-up: against sdpa, the batch's first exact backend"
    assert not any("not a speed figure" in n for n in notes)  # GPU timings, n=3


def test_table_says_what_failed_and_what_to_install(results, tmp_path):
    d, v = results
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "sagev1.log").write_text("Loading...\nerror: attention backend 'sagev1' can't run here: package not "
                                     "installed: sageattention\nhint: Backends that can run here: sdpa\n")
    text = batch.table(d, [v["sdpa"]], failed=[("sagev1", "2")], logs=logs)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["stack", "layout", "warm", "ms/step"] and "kernels that ran" in lines[0]
    failure = next(i for i, ln in enumerate(lines) if ln.startswith("sagev1: FAILED (exit 2)"))
    assert "package not installed: sageattention" in lines[failure]
    assert "install: pip install -e '.[sage]'" in lines[failure + 1]  # the registry's install hint ...
    assert "runs anywhere as its emulation: sagev1_emu" in lines[failure + 1]  # ... and its twin
    assert "note: no PSNR column: the batch rendered no 'reference'" in text
    assert batch.table(d, [], failed=[("sagev1", "2")]).splitlines()[0] == "nothing rendered"


def test_parallel_layouts_and_cpu_timings_are_said(results):
    d, v = results
    entries = json.loads((d / "timing.json").read_text())
    u2 = d / "wan_result_t2v_tiny_5f_4s_attn_sdpa_16x16_u2.mp4"
    u2.write_bytes(v["sdpa"].read_bytes())
    entries.append(_entry(u2, "sdpa", [0.5, 0.3, 0.3, 0.3], device="cpu", parallel={
        "label": "ulysses2", "tag": "u2", "engine": "diffusers", "world_size": 2}))
    (d / "timing.json").write_text(json.dumps(entries))
    rows, notes = batch.rows(d, [v["sdpa"], u2])
    assert [r["backend"] for r in rows] == ["sdpa", "sdpa (u2)"]
    assert rows[1]["layout"] == "ulysses2 (diffusers, 2 ranks)" and rows[1]["speedup"] == "0.37×"
    assert any(n.startswith("not a speed figure (CPU timing") and n.endswith("sdpa (u2)") for n in notes)


def test_command_line(results, capsys):
    d, v = results
    assert batch.main([str(d), "--outputs", str(v["sdpa"]), str(v["reference"]), "--failed", "fav3:2"]) == 0
    out = capsys.readouterr().out
    assert "sdpa " in out and "fav3: FAILED (exit 2)" in out and "install: pip install -e '.[fa3]'" in out


def test_end_to_end_one_time_and_break_even_beside_the_warm_step(results):
    """The render's wait and its one-time costs (its first repetition's) beside warm ms/step, the break-even steps
    against the same baseline as the speed-up; a file written before these fields reads, its cells "—"."""
    d, v = results
    entries = json.loads((d / "timing.json").read_text())
    new = {"sdpa": (40.0, 0.5), "reference": (55.5, 0.25), "sagev1_emu": (90.0, 1.0)}  # end_to_end_s, one_time.total_s
    for e in entries:
        if e["attention_type"] in new:
            e["end_to_end_s"], total = new[e["attention_type"]]
            e["one_time"] = {"load_s": 9.0, "total_s": total}
    (d / "timing.json").write_text(json.dumps(entries))
    rows, notes = batch.rows(d, [v["sdpa"], v["reference"], v["fp8_emu"], v["sagev1_emu"]])
    by = {r["backend"]: r for r in rows}
    assert (by["sdpa"]["end_to_end"], by["sdpa"]["one_time"], by["sdpa"]["break_even"]) == ("40.00", "0.50", "baseline")
    # reference: 0.25 s less once, 0.11 s slower a step (0.22 vs 0.11): ahead for renders up to 2 steps
    assert by["reference"]["break_even"] == "up to 2 steps (p20–p80: 1–2; n=3 vs 3)"
    assert by["fp8_emu"]["end_to_end"] == "emulated" and by["sagev1_emu"]["break_even"] == "emulated"
    assert notes[1].startswith("break-even steps against sdpa: the denoising steps a render needs")
    text = batch.table(d, [v["sdpa"], v["reference"]])
    head = text.splitlines()[0]
    assert head.index("warm ms/step") < head.index("end-to-end (s)") < head.index("one-time (s)") < head.index(
        "speed-up") < head.index("break-even steps") < head.index("kernels that ran")
    # the fixture's own file, written before these fields: "—" where a figure is missing
    entries = [{k: x for k, x in e.items() if k not in ("end_to_end_s", "one_time")} for e in entries]
    (d / "timing.json").write_text(json.dumps(entries))
    rows, notes = batch.rows(d, [v["sdpa"], v["reference"]])
    assert [(r["end_to_end"], r["one_time"], r["break_even"]) for r in rows] == [("—", "—", "baseline"),
                                                                                  ("—", "—", "—")]
    assert not any(n.startswith("break-even") for n in notes)


def test_a_negative_one_time_within_the_timing_noise_prints_as_zero(results):
    """The first step minus the warm median, a few ms under zero on a CPU: 0.00, not -0.00 / -0.01; one negative by
    more than the warm steps' spread is kept, marked, and the note under the table says what it means."""
    d, v = results
    entries = json.loads((d / "timing.json").read_text())

    def table_with(totals):
        for e in entries:
            if e["attention_type"] in totals:
                e["end_to_end_s"], e["one_time"] = 30.0, {"load_s": 9.0, "total_s": totals[e["attention_type"]]}
        (d / "timing.json").write_text(json.dumps(entries))
        rows, notes = batch.rows(d, [v["sdpa"], v["reference"]])
        return {r["backend"]: r["one_time"] for r in rows}, notes

    # sdpa: under the column's resolution; reference: 20 ms under, inside its warm steps' 24 ms p20-p80 spread
    cells, notes = table_with({"sdpa": -0.003, "reference": -0.02})
    assert cells == {"sdpa": "0.00", "reference": "0.00"} and not any("marked *" in n for n in notes)
    cells, notes = table_with({"sdpa": 0.004, "reference": -0.5})
    assert cells == {"sdpa": "0.00", "reference": "-0.50*"}
    assert any(n.startswith("one-time cost marked *: negative by more than the warm steps'") for n in notes)
    assert "-0.50*" in batch.table(d, [v["sdpa"], v["reference"]])


SCHEDULE = "sdpa@steps:0-1,sagev1"  # '@' selects steps here: the run is a schedule, not sdpa on a layout


def test_a_schedule_is_identified_from_its_record_not_its_first_rule(results):
    """A schedule's video, named with its spec (``@`` and ``,`` in the file name), is that schedule: never the
    backend of its first rule, so never the exact baseline sdpa is."""
    d, v = results
    entries = json.loads((d / "timing.json").read_text())
    sched = d / f"wan_result_t2v_tiny_5f_4s_attn_{SCHEDULE}_16x16.mp4"
    sched.write_bytes(v["sdpa"].read_bytes())
    entries.append(_entry(sched, SCHEDULE, [0.9, 0.05, 0.05, 0.05]))
    (d / "timing.json").write_text(json.dumps(entries))
    rows, notes = batch.rows(d, [sched, v["sdpa"]])
    assert [r["backend"] for r in rows] == [SCHEDULE, "sdpa"]
    assert notes[0] == "speed-up: against sdpa, the batch's first exact backend"  # the schedule's sagev1 isn't exact
    assert rows[0]["speedup"] == "2.20×" and rows[1]["speedup"] == "1.00×"
    assert all(r["note"] == "" for r in rows) and "note" not in batch.table(d, [sched, v["sdpa"]]).splitlines()[0]
    # a record that says the run is exact is taken at its word (the registry is asked only where it doesn't say)
    entries[-1]["run"]["backend"]["exact"] = True
    (d / "timing.json").write_text(json.dumps(entries))
    assert batch.rows(d, [sched, v["sdpa"]])[1][0] == f"speed-up: against {SCHEDULE}, the batch's first exact backend"


def test_a_parallel_schedule_is_identified_from_records_jsonl(results):
    """records.jsonl is the record source where it is there: the layout is the record's (its ``parallel``
    section), the VAE modes too, whatever the file is called; timing.json still gives the figures."""
    from vdbench.measure.record import Writer, from_render_entry

    d, v = results
    entries = json.loads((d / "timing.json").read_text())
    par = d / "my_clip.mp4"  # a name no family parses
    par.write_bytes(v["sdpa"].read_bytes())
    e = _entry(par, SCHEDULE, [0.9, 0.3, 0.3, 0.3], run_id="p", vae_decode={"mode": "fast"},
               parallel={"label": "ulysses2", "tag": "u2", "engine": "xfuser", "world_size": 2})
    entries.append(e)
    (d / "timing.json").write_text(json.dumps(entries))
    Writer(d / "records.jsonl").write(*(from_render_entry(x) for x in entries))
    rows, _ = batch.rows(d, [v["sdpa"], par])
    assert rows[1]["backend"] == f"{SCHEDULE}+vae=fast (u2)"
    assert rows[1]["layout"] == "ulysses2 (xfuser, 2 ranks)" and rows[1]["warm"].startswith("300 ")
    assert rows[1]["note"] == ""


def test_a_renamed_video_keeps_its_identity(results):
    """A render's video carries its run id (the container comment): renamed on disk, away from the path its record
    names, it is still found by its record -- not identified by its new name."""
    from vdbench.video import render_comment, write_video

    d, v = results
    entries = json.loads((d / "timing.json").read_text())
    old = d / "wan_result_t2v_tiny_5f_4s_attn_sdpa_16x16_u2.mp4"
    entries.append(_entry(old, "sdpa", [0.9, 0.2, 0.2, 0.2], run_id="run-u2",
                          parallel={"label": "ulysses2", "tag": "u2", "engine": "diffusers", "world_size": 2}))
    (d / "timing.json").write_text(json.dumps(entries))
    renamed = d / "wan_result_t2v_tiny_5f_4s_attn_fav3_16x16.mp4"  # a name that says another backend
    write_video(np.zeros((5, 16, 16, 3), np.uint8), renamed, fps=8, made_by=render_comment("run-u2"))
    rows, _ = batch.rows(d, [v["sdpa"], renamed])
    assert rows[1]["backend"] == "sdpa (u2)" and rows[1]["warm"].startswith("200 ") and rows[1]["note"] == ""


def test_a_folder_without_records_falls_back_to_the_file_names_and_says_so(results):
    d, v = results
    (d / "timing.json").unlink()
    rows, _ = batch.rows(d, [v["sdpa"], v["reference"]])
    assert [r["backend"] for r in rows] == ["sdpa", "reference"]
    assert all(r["note"] == "identity from the file name (no record names this video)" for r in rows)
    head, first = batch.table(d, [v["sdpa"], v["reference"]]).splitlines()[:2]
    assert head.endswith("note") and first.endswith("identity from the file name (no record names this video)")


def test_a_cached_run_is_labelled_with_its_cache_and_its_speedup_is_the_denoisings(tmp_path):
    """A step cache's steps are computed or reused: the warm median is one kind's, so the batch's speed-up of a
    cached run is the denoising time's (every step), and its label names the cache."""
    frames = np.zeros((5, 16, 16, 3), np.uint8)
    plain = tmp_path / "wan_result_t2v_tiny_5f_4s_attn_sdpa_16x16.mp4"
    cached = tmp_path / "wan_result_t2v_tiny_5f_4s_attn_sdpa_16x16_cache-fbc.mp4"
    for v in (plain, cached):
        write_video(frames, v, fps=8)
    cache = {"kind": "fbc", "spec": "fbc", "computed_blocks_per_step": [4, 2, 4, 2],
             "reused_blocks_per_step": [0, 2, 0, 2], "skipped_share": 0.25}
    entries = [_entry(plain, "sdpa", [0.5, 0.2, 0.2, 0.2]),
               _entry(cached, "sdpa", [0.5, 0.1, 0.2, 0.1], run_id="r2", cache=cache)]
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    rows, notes = batch.rows(tmp_path, [plain, cached])
    assert [r["backend"] for r in rows] == ["sdpa", "sdpa+fbc"]
    assert rows[1]["speedup"] == f"{1.1 / 0.9:.2f}× (denoising)" and rows[0]["speedup"] == "1.00×"
    assert any("its speed-up is the denoising time's" in n for n in notes)
