"""vdbench.vae_bench (bench/bench_vae.py): every config path on a tiny VAE on CPU -- decode and encode, their quality figures against
fp32 --, quality figures on known cases, environment presets composed for a child process, isolation, and a hung
config (a stalled decode or encode) reported while the run goes on."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vdbench.vae_bench import cli as B

ROOT = Path(__file__).resolve().parents[1]

SMALL = ["--model", "tiny", "--frames", "5", "--size", "48*32", "--device", "cpu", "--warmup", "0",
         "--repeats", "1", "--tile_px", "32", "--compile_backend", "eager"]


def test_parse_helpers():
    assert B.parse_size("832*480") == (832, 480) and B.parse_size("64x48") == (64, 48)
    assert B.parse_config("fast@8") == ("fast", "8") and B.parse_config("bf16") == ("bf16", None)
    with pytest.raises(ValueError, match="unknown config"):
        B.parse_config("turbo")
    with pytest.raises(ValueError):
        B.parse_size("832")


def test_child_env_composes_presets():
    base = {"PATH": "/bin", "MIOPEN_FIND_MODE": "NORMAL", "HOME": "/h"}
    env = B.child_env("miopen_fast", base)
    assert env["MIOPEN_FIND_MODE"] == "FAST" and env["PATH"] == "/bin" and env["HOME"] == "/h"
    assert base["MIOPEN_FIND_MODE"] == "NORMAL"  # the parent's mapping is not modified
    env = B.child_env("miopen_immediate", base)
    assert env["MIOPEN_FIND_MODE"] == "FAST" and env["MIOPEN_DEBUG_CONV_IMMED_FALLBACK"] == "1"
    env = B.child_env("miopen_naive_off", base)
    assert {env[f"MIOPEN_DEBUG_CONV_DIRECT_NAIVE_CONV_{d}"] for d in ("FWD", "BWD", "WRW")} == {"0"}
    assert env["MIOPEN_FIND_MODE"] == "NORMAL"  # untouched by a preset that doesn't set it
    assert B.child_env("bf16", base) == {**base, "PYTHONUNBUFFERED": "1"}
    assert "MIOPEN_FIND_MODE" not in os.environ or os.environ["MIOPEN_FIND_MODE"] != "FAST"


def test_quality_known_cases():
    ref = torch.full((3, 16, 16, 3), 0.5)
    q = B.quality(ref.clone(), ref)
    assert q["psnr_min"] == math.inf and q["ssim_min"] == pytest.approx(1.0)
    off = ref.clone()
    off[1] += 0.01  # MSE 1e-4 on frame 1 only -> 40 dB there, inf elsewhere
    q = B.quality(off, ref)
    assert q["psnr_per_frame"][1] == pytest.approx(40.0) and q["psnr_min"] == pytest.approx(40.0)
    assert q["psnr_per_frame"][0] == math.inf and q["psnr_mean"] == pytest.approx(40.0)
    assert q["psnr_all"] == pytest.approx(40.0 + 10 * math.log10(3))
    noisy = (ref + 0.1 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    assert B.quality(noisy, ref)["ssim_min"] < 0.9


def test_exit_code():
    ok = {"status": "ok", "quality_flag": False}
    assert B.exit_code([ok, {"status": "not_applicable"}]) == 0
    assert B.exit_code([ok, {"status": "ok", "quality_flag": True}]) == 2
    assert B.exit_code([ok, {"status": "hung"}, {"status": "ok", "quality_flag": True}]) == 1


# The in-process configs of the two tests below, run once for both (the fp32 reference, bf16 and tiled are common):
# what each test checks is its own configs' rows, which run as they would alone (each config on its own VAE).
EVERY_CONFIG = ["bf16", "bf16_autocast", "tiled", "chunked@2", "channels_last_3d", "cudnn_benchmark", "compile",
                "fast@2", "memory@100", "miopen_fast"]
FAST_VARIANTS = ["bf16", "fast", "fast_nocl@2", "fast+compile", "fast+cudnn_benchmark", "tiled"]


@pytest.fixture(scope="module")
def every_config_run(tmp_path_factory):
    """(exit code, the JSON written, the records beside it, stdout) of one in-process run of every config above,
    the bf16 and fast ones profiled."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("every_config") / "r.json"
    configs = ",".join(dict.fromkeys(EVERY_CONFIG + FAST_VARIANTS))
    text = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(text):
        # miopen_* runs in a child: this checkout's vdbench first on its path
        mp.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        rc = B.main(SMALL + ["--configs", configs, "--profile", "4", "--profile_configs", "bf16,fast*", "-o", str(out)])
    from vdbench.measure.record import read

    return rc, json.loads(out.read_text()), read(out.with_name("records.jsonl")), text.getvalue()


@pytest.mark.minutes
def test_every_config_in_process(every_config_run):
    rc, data, records, text = every_config_run
    rows = {r["config"]: r for r in data["results"]}
    assert list(rows) == ["fp32", *dict.fromkeys(EVERY_CONFIG + FAST_VARIANTS)]
    assert rows["fp32"]["psnr_min"] == math.inf
    recs = {r.case: r for r in records}  # the rows again, in the record schema
    assert list(recs) == list(rows) and recs["bf16"].figures["time_s"]["n"] == len(rows["bf16"]["times_s"])
    assert rows["cudnn_benchmark"]["status"] == "not_applicable"
    assert rows["miopen_fast"]["status"] == "not_applicable" and "ROCm" in rows["miopen_fast"]["reason"]
    for name in ("bf16", "bf16_autocast", "tiled", "chunked@2", "channels_last_3d", "compile", "fast@2", "memory@100"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["time_s_median"] > 0 and r["output_shape"] == [1, 3, 5, 32, 48]
        assert len(r["psnr_per_frame"]) == 5 and r["ssim_min"] is not None
        if name == "memory@100":  # a decode budget: no encode, said so; the decode still ran
            assert r["encode_status"] == "not_applicable" and "encode" in r["encode_reason"]
            continue
        # the encode beside the decode: its latents and round trip against the fp32 ones, both together
        assert r["encode_time_s_median"] > 0 and r["input_shape"] == [1, 3, 5, 32, 48]
        assert r["encode_latent_shape"] == [1, 16, 2, 4, 6] and len(r["roundtrip_psnr_per_frame"]) == 5
        assert r["total_time_s_median"] == pytest.approx(r["encode_time_s_median"] + r["time_s_median"])
    assert rows["fp32"]["latent_rel_l2"] == 0 and rows["fp32"]["roundtrip_psnr_min"] == math.inf
    for name in ("bf16", "bf16_autocast", "chunked@2", "channels_last_3d", "fast@2"):  # bf16 rounding only
        assert 1e-4 < rows[name]["latent_rel_l2"] < 0.05 and rows[name]["roundtrip_psnr_min"] > 35, name
    assert rows["compile"]["latent_rel_l2"] < 0.05 and rows["fast@2"]["encode_info"]["chunk_frames"] == 2
    assert rows["tiled"]["latent_rel_l2"] > 0.1 and rows["tiled"]["encode_quality_flag"]  # 32-px tiles
    # fp32-exact paths vs bf16 paths: known orders of magnitude
    assert rows["bf16"]["psnr_min"] > 30 and rows["bf16"]["dtype"] == "bfloat16"
    assert rows["fast@2"]["psnr_min"] == pytest.approx(rows["bf16"]["psnr_min"], abs=3)
    assert rows["memory@100"]["decode_info"]["path"] == "chunked"
    assert rows["compile"]["graph_breaks"] >= 0
    assert "system:" in text and "torch=" in text and "shapes: latents [1, 16, 2, 4, 6]" in text
    assert "encode: video input [1, 3, 5, 32, 48] -> latents [1, 16, 2, 4, 6]" in text and "encode + decode " in text
    # a 32-px tile on this tiny random VAE loses far more than 40 dB -> flagged, exit code 2 (nothing failed)
    assert rows["tiled"]["quality_flag"] is True and rc == 2


@pytest.mark.minutes
def test_hung_config_reported_and_run_continues(tmp_path, monkeypatch):
    monkeypatch.setenv("VDBENCH_TEST_STALL", "bf16:120")
    out = tmp_path / "r.csv"
    rc = B.main(SMALL + ["--configs", "bf16,chunked@2", "--timeout", "20", "-o", str(out)])
    text = out.read_text()
    assert rc == 1
    lines = {l.split(",")[3]: l for l in text.splitlines()[1:]}  # model, latents, output_shape, config, status
    assert "hung" in lines["bf16"] and "decode first call" in lines["bf16"]  # the first call, timed on its own
    assert lines["chunked@2"].split(",")[4] == "ok"  # the next config ran
    import csv

    rows = {r["config"]: r for r in csv.DictReader(open(out))}
    ok = rows["chunked@2"]  # the CSV's timing columns: the warm median with n and p20–p80, the first call apart
    for prefix in ("", "encode_"):
        assert ok[f"{prefix}time_s_n"] == "1" and float(ok[f"{prefix}first_call_s"]) > 0
        assert float(ok[f"{prefix}first_call_excess_s"]) == pytest.approx(
            float(ok[f"{prefix}first_call_s"]) - float(ok[f"{prefix}time_s_median"]))
        assert ok[f"{prefix}time_s_p20"] == ok[f"{prefix}time_s_p80"] == ok[f"{prefix}time_s_median"]  # n = 1
        assert ok[f"{prefix}speed_figure"] == "False" and "CPU timing" in ok[f"{prefix}why_not_speed"]
    assert ok["cold"] == "False" and ok["caches"] == B.SHARED_CACHES
    assert rows["fp32"]["caches"] in ("default (not cleared)", "empty", "not empty")


@pytest.mark.minutes
def test_isolate_children(tmp_path, checkout_env):
    """--isolate: the reference and each config run in their own process; a child whose decode stalls is
    reported as hung (by its own watchdog, with the last completed stage) and the parent still finishes."""
    out = tmp_path / "r.json"
    env = {**checkout_env, "VDBENCH_TEST_STALL": "fast@2:120"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_vae.py"), *SMALL, "--isolate", "--timeout", "15",
                        "--configs", "fast@2", "-o", str(out)], capture_output=True, text=True, env=env,
                       timeout=200, cwd=ROOT)
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert p.returncode == 1, p.stdout + p.stderr
    assert rows["fp32"]["status"] == "ok" and rows["fp32"]["pid"] != os.getpid()
    assert rows["fast@2"]["status"] == "hung" and rows["fast@2"]["last_completed_stage"] == "prepare config"
    assert rows["fast@2"]["current_stage"] == "decode first call"
    assert "[watchdog] config fast@2 exceeded 15 s" in p.stderr and "in decode" in p.stderr  # stacks dumped


@pytest.mark.minutes
def test_cold_runs_each_config_in_a_fresh_process_with_empty_compile_caches(tmp_path, monkeypatch, checkout_env):
    """--cold: the reference and each config in their own process (--isolate), each started with
    TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR set to new empty folders (the child's own reading, at its start),
    removed afterwards; every row with its first call apart from the warm calls, marked cold."""
    from vdbench.timing import CACHE_VARS

    monkeypatch.setenv("PYTHONPATH", checkout_env["PYTHONPATH"])  # the children import this checkout's vdbench
    out = tmp_path / "r.json"
    rc = B.main(SMALL + ["--ops", "decode", "--configs", "bf16", "--repeats", "2", "--cold", "-o", str(out)])
    data = json.loads(out.read_text())
    rows = {r["config"]: r for r in data["results"]}
    assert rc == 0 and list(rows) == ["fp32", "bf16"] and data["args"]["isolate"] is True
    assert len({r["pid"] for r in rows.values()} | {os.getpid()}) == 3  # two fresh processes, not this one
    dirs = [r["cache_dirs"][v] for r in rows.values() for v in CACHE_VARS]
    assert all(dirs) and len(set(dirs)) == 4 and not any(Path(d).exists() for d in dirs)
    for r in rows.values():
        assert r["status"] == "ok" and r["cold"] is True and r["caches"] == "empty"
        assert r["time_s_n"] == 2 and len(r["times_s"]) == 2 and r["first_call_s"] > 0
        assert r["first_call_excess_s"] == pytest.approx(r["first_call_s"] - r["time_s_median"])
        assert r["time_s_p20"] <= r["time_s_median"] <= r["time_s_p80"]
        assert r["speed_figure"] is False and "n=2 timed samples (< 3)" in r["why_not_speed"]


def test_default_run_times_at_least_five_warm_calls_on_a_gpu_and_the_cpu_configs_on_a_cpu():
    args = B.build_parser().parse_args(["--device", "cuda"])
    assert B.device_defaults(args) == [] and args.configs == B.DEFAULT_CONFIGS
    assert args.repeats >= 5 and args.warmup >= 1 and not args.cold
    # on a CPU the smoke run checks the plumbing in about a minute: fp32 configs, one timed call, the rest named
    args = B.build_parser().parse_args(["--device", "cpu"])
    left = B.device_defaults(args)
    assert args.configs == B.CPU_DEFAULT_CONFIGS and args.repeats == 1
    assert "bf16" in left and "fast" in left and "fp32" not in left
    args = B.build_parser().parse_args(["--device", "cpu", "--configs", "bf16", "--repeats", "3"])
    assert B.device_defaults(args) == [] and args.configs == "bf16" and args.repeats == 3


def test_composite_configs_parse():
    assert B.parse_config("fast+cudnn_benchmark@2") == ("fast+cudnn_benchmark", "2")
    assert B.split_config("fast+compile+cudnn_benchmark") == ("fast", ("compile", "cudnn_benchmark"))
    assert B.split_config("fast_nocl") == ("fast_nocl", ())
    for bad in ("fast+turbo", "fast+compile+compile", "turbo+compile", "compile+compile"):
        with pytest.raises(ValueError):
            B.parse_config(bad)
    assert B.child_env("miopen_fast+cudnn_benchmark", {})["MIOPEN_FIND_MODE"] == "FAST"
    assert B.profile_wanted("fast@2", "bf16,fast*") and not B.profile_wanted("tiled", "bf16,fast*")
    assert B.profile_wanted("tiled", None)


def test_fast_tail_parses_as_one_stage_or_two():
    """fast@K/S: the tail's latent frames a call; fast@K/S1/S2: the blocks past the last two temporal upsamplings."""
    from vdbench.vae_bench.grammar import parse_tail

    assert parse_tail("1") == 1 and parse_tail("2/1") == (2, 1)
    for bad in ("0", "2/0", "a", "2/1/1", ""):
        with pytest.raises(ValueError, match="fast@K/S"):
            parse_tail(bad)


@pytest.mark.minutes
def test_fast_variants_compile_and_profile(every_config_run):
    from vdbench.vae.fast import FAST_EAGER_CHUNK

    rc, data, _, _ = every_config_run
    rows = {r["config"]: r for r in data["results"]}
    assert data["args"]["profile"] == 4 and data["args"]["profile_configs"] == "bf16,fast*"
    assert rc == 2  # only the tiny 32-px tiles are flagged
    # no chunk given: the row says what the decode ran (on a CPU, the eager glue's one latent frame a call)
    assert rows["fast"]["decode_info"]["glue"].startswith("eager") and rows["fast"]["channels_last"] is True
    assert rows["fast"]["chunk_frames"] == FAST_EAGER_CHUNK and rows["fast"]["tail_frames"] == [1, 1]
    assert rows["fast_nocl@2"]["chunk_frames"] == 2 and rows["fast_nocl@2"]["channels_last"] is False
    assert rows["fast+cudnn_benchmark"]["status"] == "not_applicable"  # CPU
    comp = rows["fast+compile"]
    assert comp["status"] == "ok" and comp["graph_breaks"] == 0 and comp["compile_backend"] == "eager"
    assert comp["decode_info"]["compile_backend"] == "eager"
    for name in ("fast", "fast_nocl@2", "fast+compile"):  # the same arithmetic as bf16 up to bf16 rounding
        assert rows[name]["psnr_min"] == pytest.approx(rows["bf16"]["psnr_min"], abs=3), name
    for name in ("bf16", "fast", "fast_nocl@2", "fast+compile"):
        prof = rows[name]["profile"]
        assert prof["time_kind"] == "self CPU time" and 1 <= len(prof["kernels"]) <= 4
        k = prof["kernels"][0]
        assert set(k) == {"name", "calls", "total_ms", "pct"} and k["calls"] >= 1 and 0 < k["pct"] <= 100
        assert prof["kernels"] == sorted(prof["kernels"], key=lambda e: -e["total_ms"])
    assert "profile" not in rows["tiled"] and "profile" not in rows["fp32"]


def test_fused_glue_config_is_refused_with_the_reason_where_it_cant_run(tmp_path, monkeypatch):
    """+fused requires the Triton glue kernels (tests/test_vae_glue.py checks their numbers); on a CPU without
    Triton's interpreter the row says why it didn't run -- never a silent eager fallback; other bases: not
    applicable. The default (auto) glue records which glue ran."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert B.split_config("fast+fused") == ("fast", ("fused",))
    out = tmp_path / "r.json"
    B.main(SMALL + ["--configs", "fast+fused,bf16+fused,fast+fused+compile,fast+fused+eager_glue,fast,"
                    "fast+eager_glue", "-o", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["fast+fused"]["status"] == "error" and "interpreter" in rows["fast+fused"]["reason"]
    for name in ("bf16+fused", "fast+fused+compile", "fast+fused+eager_glue"):
        assert rows[name]["status"] == "not_applicable", name
    # fast as --vae_decode fast runs it (auto): here on a CPU the eager glue, recorded with why; +eager_glue: asked
    assert rows["fast"]["decode_info"]["glue"].startswith("eager (Triton glue not used: the VAE is on cpu")
    assert rows["fast+eager_glue"]["decode_info"]["glue"] == "eager (asked for)"
    assert rows["fast"]["status"] == rows["fast+eager_glue"]["status"] == "ok"


def test_stalled_encode_caught_like_a_stalled_decode(tmp_path, monkeypatch, capfd):
    """An encode that never returns: the watchdog reports the config hung in its encode (stacks dumped), the run
    goes on with the next config."""
    monkeypatch.setenv("VDBENCH_TEST_STALL", "encode:bf16:120")
    out = tmp_path / "r.json"
    rc = B.main(SMALL + ["--configs", "bf16,fast@2", "--ops", "encode", "--timeout", "8", "-o", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert rc == 1
    assert rows["bf16"]["status"] == "hung" and rows["bf16"]["current_stage"] == "encode first call"
    assert rows["bf16"]["last_completed_stage"] == "prepare config"
    assert rows["fast@2"]["status"] == "ok" and rows["fast@2"]["encode_time_s_median"] > 0
    assert "time_s_median" not in rows["fast@2"]  # --ops encode: no decode timed
    err = capfd.readouterr().err
    assert "[watchdog] config bf16 exceeded 8 s" in err and "in encode" in err  # the stacks, dumped


@pytest.mark.parametrize("model", ["tiny-wan2.2", "tiny-cogvideox"])
def test_encode_configs_on_the_other_tiny_vaes(tmp_path, model):
    """Wan 2.2 (patchified 12-channel input, residual down blocks) and CogVideoX: the encode configs that apply,
    with quality figures against the fp32 encode; the Wan-only ones are not applicable on CogVideoX, with why."""
    out = tmp_path / "r.json"
    B.main(["--model", model, "--frames", "9", "--size", "64*32", "--device", "cpu", "--warmup", "0", "--repeats",
            "1", "--ops", "encode", "--input", "i2v", "--configs", "bf16,fast,chunked@2,bf16_autocast", "-o", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["fp32"]["status"] == "ok" and rows["fp32"]["input_shape"] == [1, 3, 9, 32, 64]
    for name in ("bf16", "bf16_autocast", *(("fast", "chunked@2") if model == "tiny-wan2.2" else ())):
        r = rows[name]
        assert r["status"] == "ok" and r["encode_time_s_median"] > 0, r
        assert 1e-4 < r["latent_rel_l2"] < 0.05 and r["roundtrip_psnr_min"] > 30, (name, r["latent_rel_l2"])
    if model == "tiny-cogvideox":
        assert rows["fast"]["status"] == "not_applicable" and "AutoencoderKLWan only" in rows["fast"]["reason"]
        assert rows["chunked@2"]["status"] == "not_applicable"
    else:
        assert rows["fast"]["encode_info"]["path"] == "chunked"
        assert rows["fast"]["encode_latent_shape"] == rows["fp32"]["encode_latent_shape"] == [1, 48, 3, 2, 4]


def test_encode_inputs_and_ops():
    from vdbench.pipelines import build_vae

    vae = build_vae("wan2.1", tiny=True)
    v = B.make_video(vae, "wan", 9, 48, 32, 0, "video")
    assert v.shape == (1, 3, 9, 32, 48) and v.abs().max() <= 1 and torch.equal(v, B.make_video(vae, "wan", 9, 48, 32,
                                                                                             0, "video"))
    assert not torch.equal(v[:, :, 0], v[:, :, 1])  # it moves
    i2v = B.make_video(vae, "wan", 9, 48, 32, 0, "i2v")
    assert torch.equal(i2v[:, :, 0], v[:, :, 0]) and not i2v[:, :, 1:].any()  # the image, then zero frames
    with pytest.raises(ValueError, match="spatial factor"):
        B.make_video(vae, "wan", 9, 50, 32, 0, "video")
    assert B.parse_ops("encode,decode") == ("decode", "encode") and B.parse_ops("encode") == ("encode",)
    with pytest.raises(ValueError, match="--ops"):
        B.parse_ops("decode,turbo")


def test_tiny_is_spelled_as_every_tool_spells_it_and_never_looked_up(monkeypatch):
    """``--model tiny`` / ``tiny:<vae>`` (the render CLIs' spelling; ``tiny-<vae>`` still read) build the tiny VAE;
    a name that is neither one of ours nor a path nor a possible hub id is refused at once, nothing looked up."""
    import diffusers

    assert B.tiny_name("tiny") == (True, "wan2.1") and B.tiny_name("tiny:wan2.2") == (True, "wan2.2")
    assert B.tiny_name("tiny-cogvideox") == (True, "cogvideox") and B.tiny_name("wan2.1") == (False, "wan2.1")
    vae = B.build_vae("tiny", "cpu")
    assert type(vae).__name__ == "AutoencoderKLWan" and vae.config.base_dim == 4  # the tiny config
    assert type(B.build_vae("tiny:cogvideox", "cpu")).__name__ == "AutoencoderKLCogVideoX"

    def no_lookup(*a, **k):
        raise AssertionError("a hub lookup was attempted")

    monkeypatch.setattr(diffusers.AutoencoderKLWan, "load_config", classmethod(no_lookup))
    for name in ("tiny:nope", "tinyy", "not a model"):
        with pytest.raises(ValueError, match="not one of wan2.1, .* tiny or tiny:<one of those>"):
            B.build_vae(name, "cpu")
