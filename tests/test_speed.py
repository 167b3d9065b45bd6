"""vdbench.speed: regional compile with patched backends, bf16 text encoder, fp8 GEMM refusal."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import run_wan  # noqa: E402
import sageattn_cogvideo  # noqa: E402
from vdbench.patching import AttentionPatch  # noqa: E402
from vdbench.pipelines import load_pipeline  # noqa: E402
from vdbench import tiny  # noqa: E402
from vdbench.speed import (SpeedOptionError, apply_speed_options, compile_blocks, fp8_gemm_targets,  # noqa: E402
                           quantize_fp8_gemms)

SMALL = ["--model", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps", "2"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _i2v_inputs(tr, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = tr.config
    hs = torch.randn(1, c.in_channels, 3, 8, 8, generator=g)
    ehs = torch.randn(1, 512, c.text_dim, generator=g)  # Wan i2v splits image|text by 512 text tokens
    img = torch.randn(1, 5, c.image_dim, generator=g) if c.image_dim else None
    return dict(hidden_states=hs, timestep=torch.tensor([500]), encoder_hidden_states=ehs,
                encoder_hidden_states_image=img, return_dict=False)


@pytest.mark.parametrize("backend", ["sagev1_emu", "default"])
def test_compiled_blocks_match_eager_with_one_graph_and_real_counts(backend):
    """i2v: image and text cross-attention calls keep their labels under compile; no recompile per block."""
    pipe = load_pipeline("tiny", "i2v", "wan")
    tr = pipe.transformer
    inputs = _i2v_inputs(tr)
    with torch.no_grad(), AttentionPatch([("transformer", tr)], backend) as p:
        eager = tr(**inputs)[0]
        eager_counts = p.stats.as_dict()
    compile_blocks([("transformer", tr)], backend="aot_eager")
    with torch.no_grad(), AttentionPatch([("transformer", tr)], backend) as p:
        compiled = tr(**inputs)[0]
        compiled_again = tr(**inputs)[0]
        counts = p.stats.as_dict()
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1, dict(stats)  # the repeated blocks share one graph
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled_again, eager, rtol=1e-5, atol=1e-5)
    # The kernel and its bookkeeping ran at every call of the compiled graph (twice as many calls: 2 forwards).
    assert counts["total_calls"] == 2 * eager_counts["total_calls"] > 0
    assert {k: v // 2 for k, v in counts["calls_by_kind"].items()} == eager_counts["calls_by_kind"]
    assert set(eager_counts["calls_by_kind"]) == {"self", "cross", "cross_img"}
    assert counts["calls_by_kernel"].keys() == eager_counts["calls_by_kernel"].keys()


def test_run_wan_use_torch_compile_matches_eager(tmp_path):
    base = SMALL + ["--attention_type", "sagev1_emu", "--save_frames"]
    assert run_wan.main(base + ["--benchmark_output_directory", str(tmp_path / "eager")]) == 0
    assert run_wan.main(base + ["--benchmark_output_directory", str(tmp_path / "compiled"), "--use_torch_compile",
                                "--compile_backend", "aot_eager"]) == 0
    name = "wan_result_t2v_tiny_9f_2s_attn_sagev1_emu_64x96.npy"
    a = np.load(tmp_path / "eager" / "results" / name)
    # the compiled render is named by its stack: the plain name, then the compile option
    b = np.load(tmp_path / "compiled" / "results" / name.replace(".npy", "_compile=aot_eager.npy"))
    assert a.shape == b.shape and np.abs(a.astype(int) - b.astype(int)).max() <= 1
    entry = json.loads((tmp_path / "compiled" / "results" / "timing.json").read_text())[-1]
    assert entry["run"]["resolved"]["speed_options"]["compile"]["models"]["transformer"]["blocks"] == 2
    assert entry["attention"]["calls_by_kernel"] == {"emu.sagev1": 16}
    # torch.compile's time (its own counters) is a one-time cost of the compiled render, inside its first step
    assert entry["one_time"]["compile_s"] > 0
    assert json.loads((tmp_path / "eager" / "results" / "timing.json").read_text())[-1]["one_time"]["compile_s"] is None


@pytest.mark.slow
def test_compiled_blocks_beside_a_step_cache_compile_once_and_never_again(tmp_path, capsys):
    """--use_torch_compile with FirstBlockCache: diffusers' hooks replace the blocks' ``forward`` after the compile, so
    the cache's decision (Python state changed every step) runs outside the compiled code and no guard reads it. The
    blocks compile in the first step -- one graph shared by every block, the head block's too -- and no later step
    compiles again (a recompile would be a graph in a later step), while the cache reuses blocks. A render
    with --use_fp8_gemms is refused on a CPU (torchao's float8 needs an fp8 GPU): its compile is checked on the GPU
    (bench/suites/stack4.toml, w13_compiled_cache_1gpu)."""
    args = [*SMALL[:-1], "4", "--attention_type", "sdpa", "--seed", "42", "--cache", "fbc:threshold=0.2",
            "--use_torch_compile", "--compile_backend", "aot_eager", "--benchmark_output_directory", str(tmp_path)]
    assert run_wan.main(args) == 0
    entry = json.loads((tmp_path / "results" / "timing.json").read_text())[-1]
    assert entry["compile"] == {"graphs_per_step": [1, 0, 0, 0], "graph_breaks": 0}, entry["compile"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for the 2 blocks, 4 steps
    assert 0 < sum(entry["cache"]["reused_blocks_per_step"]), entry["cache"]  # the cache decided around it
    out = capsys.readouterr()
    assert "torch.compile: graphs made per step [1, 0, 0, 0], graph breaks 0" in out.out + out.err
    assert "compiled again" not in out.out + out.err


def test_cogvideox_compile_each_block(tmp_path):
    args = ["--model_path", "tiny", "--height", "64", "--width", "96", "--num_frames", "9",
            "--num_inference_steps", "2", "--attention_type", "sdpa_math", "--output_dir", str(tmp_path),
            "--compile", "--compile_backend", "aot_eager"]
    assert sageattn_cogvideo.main(args) == 0
    entry = json.loads((tmp_path / "timing.json").read_text())[-1]
    comp = entry["run"]["resolved"]["speed_options"]["compile"]["models"]["transformer"]
    assert comp["how"] == "block forward" and comp["blocks"] >= 1
    assert entry["attention"]["calls_by_kernel"] == {"sdpa_math": entry["attention"]["total_calls"]}
    assert entry["attention"]["total_calls"] > 0


def test_capture_with_compile_is_refused(tmp_path, capsys):
    rc = run_wan.main(SMALL + ["--benchmark_output_directory", str(tmp_path), "--save_inputs",
                               "--use_torch_compile"])
    assert rc == 2
    assert "--save_inputs runs eagerly" in capsys.readouterr().err


def test_fp8_gemms_refused_on_cpu(tmp_path, capsys):
    rc = run_wan.main(SMALL + ["--benchmark_output_directory", str(tmp_path), "--use_fp8_gemms"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--use_fp8_gemms can't run here" in err
    assert not list((tmp_path / "results").glob("*.mp4")) if (tmp_path / "results").exists() else True
    with pytest.raises(SpeedOptionError, match="torchao|GPU"):
        quantize_fp8_gemms([], torch.device("cpu"))
    with pytest.raises(SpeedOptionError, match="torchao|GPU"):
        quantize_fp8_gemms([], torch.device("cpu"), layers="ffn")


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_fp8_gemm_targets_all_is_every_block_linear_and_ffn_only_the_feed_forward_ones(variant):
    """What --use_fp8_gemms quantizes, per scope, on a tiny transformer (randomly initialized: only its modules
    matter): ``all`` every Linear of the blocks whose dims are multiples of 16, ``ffn`` those inside a diffusers
    FeedForward -- a non-empty strict subset, with the attention projections left out."""
    import diffusers
    from diffusers.models.attention import FeedForward

    v = tiny.get_variant(variant)
    model = getattr(diffusers, v.transformer_class)(**v.transformer)
    blocks = next(getattr(model, a) for a in ("blocks", "transformer_blocks") if hasattr(model, a))
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    in_ffn = {id(m) for f in model.modules() if isinstance(f, FeedForward) for m in f.modules()}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    every = fp8_gemm_targets(model, "all")
    assert every == [n for n, m in linears.items()
                     if id(m) in in_blocks and m.in_features % 16 == 0 and m.out_features % 16 == 0]
    assert len(every) < len(linears)  # the embedders and the output projection stay out
    ffn = fp8_gemm_targets(model, "ffn")
    assert ffn and set(ffn) < set(every)
    assert ffn == [n for n in every if id(linears[n]) in in_ffn]
    assert not any(".attn" in n for n in ffn) and any(".attn" in n for n in every)
    with pytest.raises(SpeedOptionError, match="unknown scope"):
        fp8_gemm_targets(model, "attn")


def test_bf16_text_encoder_changes_dtype_and_stays_close():
    pipe = load_pipeline("tiny", "t2v", "wan")
    ref, _ = pipe.encode_prompt("a cat walks on the grass", do_classifier_free_guidance=False)
    done = apply_speed_options(pipe, [("transformer", pipe.transformer)], device=torch.device("cpu"),
                               bf16_te_gemms=True)
    assert done["text_encoder_dtype"] == {"from": "float32", "to": "bfloat16"}
    assert pipe.text_encoder.dtype == torch.bfloat16
    got, _ = pipe.encode_prompt("a cat walks on the grass", do_classifier_free_guidance=False,
                                dtype=torch.float32)
    rel = ((got.float() - ref).norm() / ref.norm()).item()
    assert 0 < rel < 2e-2, rel  # it really ran in bf16 (not bit-equal) and stayed close


def test_unknown_compile_backend_rejected():
    with pytest.raises(SpeedOptionError, match="compile backend"):
        compile_blocks([], backend="tensorrt")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sparse_attention_survives_regional_compile(tmp_path):
    """`sta` (FlexAttention: a block mask built on the first call, vmap inside) under --use_torch_compile: the
    compiled blocks' first call used to fail in AOTAutograd's custom-op aliasing analysis ("Cannot access storage of
    BatchedTensorImpl"); the render runs, with the sparse kernel and the dense cross-attention counted, and the
    output equals the eager render's within bf16 rounding."""
    base = SMALL + ["--attention_schedule", "sdpa@kind:cross,sta", "--save_frames"]
    assert run_wan.main(base + ["--benchmark_output_directory", str(tmp_path / "eager")]) == 0
    assert run_wan.main(base + ["--benchmark_output_directory", str(tmp_path / "compiled"), "--use_torch_compile",
                                "--compile_backend", "aot_eager"]) == 0
    entry = json.loads((tmp_path / "compiled" / "results" / "timing.json").read_text())[-1]
    kernels = entry["attention"]["calls_by_kernel"]
    assert kernels == {"flex.sta[window=3x3x3,tile=6x8x8]": 8, "sdpa[flash]": 8}, kernels  # 2 blocks x 2 steps x 2
    eager = json.loads((tmp_path / "eager" / "results" / "timing.json").read_text())[-1]
    assert kernels == eager["attention"]["calls_by_kernel"]
    speed = entry["run"]["resolved"]["speed_options"]["compile"]
    assert speed["custom_op_aliasing_check"].startswith(("off", "not in this torch"))
    a, b = (np.load(next((tmp_path / d / "results").glob("*.npy"))) for d in ("eager", "compiled"))
    assert a.shape == b.shape and np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_inductor_tuning_is_set_or_read_recorded_and_refused_without_a_compile(tmp_path, capsys, monkeypatch):
    """--inductor_tuning: refused in one line where nothing is compiled by inductor; on/off set inductor's
    coordinate-descent tuning, auto reads it as the process has it and says who set it; the fp8 GEMMs are told to
    leave inductor's settings alone unless on."""
    from torch._inductor import config

    from vdbench import speed

    rc = run_wan.main(SMALL + ["--benchmark_output_directory", str(tmp_path), "--inductor_tuning", "off"])
    assert rc == 2 and "--inductor_tuning off without inductor's compile" in capsys.readouterr().err
    with pytest.raises(SpeedOptionError, match="nothing is tuned"):
        speed.check_speed_options(torch.device("cpu"), compile=True, compile_backend="eager", inductor_tuning="on")
    speed.check_speed_options(torch.device("cpu"), compile=True, inductor_tuning="on")  # accepted

    monkeypatch.setattr(config, "coordinate_descent_tuning", False)
    assert speed._coordinate_descent_tuning("auto") == {"on": False, "set_by": "inductor's default"}
    assert speed._coordinate_descent_tuning("on") == {"on": True, "set_by": "--inductor_tuning"}
    assert config.coordinate_descent_tuning is True
    assert speed._coordinate_descent_tuning("auto") == {"on": True, "set_by": "already on in this process"}

    told = []
    monkeypatch.setattr(speed, "quantize_fp8_gemms",
                        lambda models, device, layers, inductor_settings: told.append((layers, inductor_settings)) or {})
    monkeypatch.setattr(speed, "compile_blocks", lambda models, backend, mode: {"backend": backend})
    for setting in ("auto", "off", "on"):
        done = apply_speed_options(None, [], device=torch.device("cpu"), compile=True, fp8_gemms="ffn",
                                   inductor_tuning=setting)
        # auto reads what the process has: on here, since the test set it on above
        assert done["compile"]["coordinate_descent_tuning"]["on"] is (setting != "off")
    # torchao's recommended inductor settings only with on
    assert told == [("ffn", False), ("ffn", False), ("ffn", True)]
    assert config.coordinate_descent_tuning is True
