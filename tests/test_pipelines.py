"""Tests for vdbench.pipelines: tiny models (build, cache, round trip, determinism, renders) and loading helpers.

All tiny models go to a per-session temporary cache (VDBENCH_CACHE), never to ~/.cache. Renders use tiny sizes
and 2 steps with CFG on, so the whole file stays well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import inspect
import json
import threading
import time

import numpy as np
import pytest
import torch

from vdbench import pipelines as P
from vdbench import tiny

ALL_VARIANTS = [
    "wan2.1-t2v",
    "wan2.1-i2v",
    "wan2.2-t2v-a14b",
    "wan2.2-i2v-a14b",
    "wan2.2-ti2v-5b",
    "cogvideox-t2v",
    "cogvideox-i2v",
]
PROMPT = "A cat and a dog baking a cake together in a kitchen"


@pytest.fixture(scope="module", autouse=True)
def _use_vdbench_cache(vdbench_cache):
    """Point VDBENCH_CACHE at the session cache while this file's tests run (never ~/.cache/vdbench)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VDBENCH_CACHE", str(vdbench_cache))
    yield
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Run this file's tiny renders on one intra-op thread.

    The test machines have 2 cores shared with other jobs; with a core busy, torch's 2-thread OpenMP kernels
    stall on their barriers and this file took ~60 s instead of ~25 s (measured). One thread is steadier and,
    for models this small, hardly slower. Restored afterwards for the rest of the session.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_PIPES: dict[tuple[str, str], object] = {}


def _pipe(variant: str, task: str | None = None):
    """Load (once per session) the tiny ``variant`` through load_pipeline, i.e. through from_pretrained."""
    v = P.TINY_VARIANTS[variant]
    task = task or v.tasks[0]
    key = (variant, task)
    if key not in _PIPES:
        pipe = P.load_pipeline(f"tiny:{variant}", task=task, family=v.family)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[key] = pipe
    return _PIPES[key]


def _image(height: int = 64, width: int = 96):
    from PIL import Image

    rng = np.random.RandomState(0)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


def _render(pipe, seed: int = 0, height: int = 64, width: int = 96, num_frames: int = 9, steps: int = 2, **kw):
    if type(pipe).__name__.endswith("ImageToVideoPipeline"):
        kw.setdefault("image", _image(height, width))
    out = pipe(
        prompt=PROMPT,
        negative_prompt="blurry, low quality",
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=5.0,
        output_type="np",
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    return np.asarray(out.frames[0])


def _assert_non_degenerate(frames: np.ndarray, num_frames: int, height: int, width: int):
    assert frames.shape == (num_frames, height, width, 3)
    assert np.isfinite(frames).all()
    assert frames.std() > 0.02, "video is (nearly) constant"
    # Content must vary within each frame, not only between frames.
    assert float(frames.reshape(num_frames, -1, 3).std(axis=1).min()) > 0.01


def _state_dicts(pipe) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: module.state_dict()
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for comp in a:
        assert a[comp].keys() == b[comp].keys(), comp
        for key in a[comp]:
            assert torch.equal(a[comp][key], b[comp][key]), f"{comp}.{key} differs"


# --------------------------------------------------------------------------------------------------------------
# Variants, names, resolution
# --------------------------------------------------------------------------------------------------------------


# head dim 64: the project's Triton kernels run in these (tests/test_kernels_in_pipelines.py renders them)
D64_VARIANTS = {"wan2.1-t2v-d64": "wan2.1-t2v", "wan2.2-t2v-a14b-d64": "wan2.2-t2v-a14b",
                "cogvideox-t2v-d64": "cogvideox-t2v"}


def test_variant_table():
    assert list(P.TINY_VARIANTS) == (ALL_VARIANTS[:5] + ["wan2.1-t2v-d64", "wan2.2-t2v-a14b-d64"] + ALL_VARIANTS[5:]
                                     + ["cogvideox-t2v-d64"])
    for name, v in P.TINY_VARIANTS.items():
        assert v.name == name
        json.dumps(v.spec())  # plain JSON
    a14b = P.TINY_VARIANTS["wan2.2-t2v-a14b"]
    assert a14b.pipeline_kwargs == {"boundary_ratio": 0.875} and a14b.transformer_2 is not None
    i2v_a14b = P.TINY_VARIANTS["wan2.2-i2v-a14b"]
    assert i2v_a14b.pipeline_kwargs == {"boundary_ratio": 0.9} and i2v_a14b.image_encoder is None
    assert P.TINY_VARIANTS["wan2.2-ti2v-5b"].pipeline_kwargs == {"expand_timesteps": True}
    for v in P.TINY_VARIANTS.values():
        if v.family == "wan" and v.name not in D64_VARIANTS:
            assert v.transformer["attention_head_dim"] == 32
    for name, base in D64_VARIANTS.items():
        # the same architecture as the head-dim-32 variant (its wiring, VAE, scheduler), 2 heads of 64, own seed
        v, b = P.TINY_VARIANTS[name], P.TINY_VARIANTS[base]
        assert (v.transformer["attention_head_dim"], v.transformer["num_attention_heads"]) == (64, 2)
        assert dict(v.transformer, attention_head_dim=32) == b.transformer
        assert v.transformer_2 is b.transformer_2 is None or dict(v.transformer_2, attention_head_dim=32) == b.transformer_2
        assert (v.pipeline, v.vae, v.scheduler, v.tasks, v.mirrors) == (b.pipeline, b.vae, b.scheduler, b.tasks,
                                                                          b.mirrors)
        assert v.seed != b.seed
    # Wan's rope splits the head dim into t/h/w parts of even size (h = w = 2 * (d // 6)): 24/20/20 at 64
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rope = WanRotaryPosEmbed(64, (1, 2, 2), 1024)
    assert (rope.t_dim, rope.h_dim, rope.w_dim) == (24, 20, 20)


@pytest.mark.parametrize(
    "model,task,family,variant",
    [
        ("tiny", None, "wan", "wan2.1-t2v"),
        ("tiny", "t2v", "wan", "wan2.1-t2v"),
        ("tiny", "i2v", "wan", "wan2.1-i2v"),
        ("tiny", "ti2v", "wan", "wan2.2-ti2v-5b"),
        ("tiny", "t2v", "cogvideox", "cogvideox-t2v"),
        ("tiny", "i2v", "cogvideox", "cogvideox-i2v"),
        ("tiny:wan2.2-t2v-a14b", "t2v", "wan", "wan2.2-t2v-a14b"),
    ],
)
def test_resolve_tiny(model, task, family, variant, vdbench_cache):
    path = P.resolve_model(model, task, family)
    assert path == str(P.tiny_model_dir(variant))
    assert path.startswith(str(vdbench_cache / "tiny" / f"{variant}-"))
    index = json.loads((P.tiny_model_dir(variant) / "model_index.json").read_text())
    assert index["_class_name"] == P.TINY_VARIANTS[variant].pipeline
    assert P.resolve_model(model, task, family) == path  # cached: same dir, no rebuild


def test_resolve_passthrough():
    assert P.resolve_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "t2v") == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert P.resolve_model("/data/models/wan", "i2v") == "/data/models/wan"
    assert P.resolve_model("THUDM/CogVideoX-2b", "t2v", "cogvideox") == "THUDM/CogVideoX-2b"


def test_resolve_errors():
    with pytest.raises(ValueError, match="Unknown tiny model variant 'nope'.*wan2.1-t2v.*cogvideox-i2v"):
        P.resolve_model("tiny:nope")
    with pytest.raises(ValueError, match="Unknown task 'ti2v' for family 'cogvideox'"):
        P.resolve_model("tiny", "ti2v", "cogvideox")
    with pytest.raises(ValueError, match="Unknown model family"):
        P.resolve_model("tiny", "t2v", "hunyuan")
    with pytest.raises(ValueError, match="supports task"):
        P.load_pipeline("tiny:wan2.1-t2v", task="i2v")
    with pytest.raises(ValueError, match="is a cogvideox model"):
        P.load_pipeline("tiny:cogvideox-t2v", task="t2v", family="wan")


def test_cache_dir_hash_follows_spec(monkeypatch):
    import dataclasses

    base = P.tiny_model_dir("wan2.1-t2v")
    assert base.name.startswith("wan2.1-t2v-") and len(base.name) == len("wan2.1-t2v-") + 10
    assert P.tiny_model_dir("wan2.1-t2v") == base  # stable
    changed = dataclasses.replace(P.TINY_VARIANTS["wan2.1-t2v"], seed=99)
    monkeypatch.setitem(P.TINY_VARIANTS, "wan2.1-t2v", changed)
    assert P.tiny_model_dir("wan2.1-t2v") != base


@pytest.mark.parametrize("what", ["cpu_capability", "torch"])
def test_cache_dir_hash_follows_the_machine_and_torch(monkeypatch, what):
    """A cache shared between machines is never read as another CPU's (AVX2 vs AVX-512) or torch's build."""
    import torch

    base = P.tiny_model_dir("wan2.1-t2v")
    if what == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    else:
        other = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert P.tiny_model_dir("wan2.1-t2v") != base


# --------------------------------------------------------------------------------------------------------------
# Build / save / load
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_save_load_round_trip(variant, tmp_path):
    import diffusers
    from transformers import AutoTokenizer

    v = P.TINY_VARIANTS[variant]
    parts: dict = {}
    built = tiny.build_pipeline(v, timings=parts)
    # where a build's time goes: the imports, then each component the variant has, then the pipeline's assembly
    expected = {"imports", "tokenizer", "text_encoder", "vae", "transformer", "assemble"}
    assert expected <= set(parts) and min(parts.values()) >= 0
    assert ("transformer_2" in parts) == ("transformer_2" in inspect.signature(type(built).__init__).parameters)
    path = P.build_tiny(variant, tmp_path / variant)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary build dir left behind"
    loaded = getattr(diffusers, v.pipeline).from_pretrained(path, dtype=torch.float32)
    assert type(loaded).__name__ == v.pipeline
    _assert_same_state(_state_dicts(built), _state_dicts(loaded))

    # Tokenizer: AutoTokenizer and the pipeline both load it; T5 conventions; any prompt tokenizes.
    tok = AutoTokenizer.from_pretrained(path / "tokenizer")
    assert type(tok).__name__ == type(loaded.tokenizer).__name__ == "T5Tokenizer"
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.unk_token) == ("<pad>", 0, "</s>", "<unk>")
    assert len(tok) == loaded.text_encoder.config.vocab_size
    for prompt in [PROMPT, "Ünïcödé 日本語 emoji 🐱 and unknownwordzzz!", ""]:
        ids = tok(prompt).input_ids
        assert ids == built.tokenizer(prompt).input_ids == loaded.tokenizer(prompt).input_ids
        assert ids[-1] == tok.eos_token_id and max(ids) < len(tok)
    known = tok("A cat and a dog").input_ids
    assert tok.unk_token_id not in known and len(known) == 6  # whole words + </s>
    assert tok.model_max_length == v.tokenizer_max_length

    index = json.loads((path / "model_index.json").read_text())
    if v.image_processor is not None:
        assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    for name, module in P.transformers_of(loaded):
        assert dict(module.config)["num_layers"] == getattr(v, name)["num_layers"]


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-t2v-a14b", "cogvideox-i2v"])
def test_build_is_deterministic(variant, tmp_path):
    from safetensors.torch import load_file

    a = P.build_tiny(variant, tmp_path / "a")
    b = P.build_tiny(variant, tmp_path / "b")
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        if rel.suffix == ".safetensors":
            sa, sb = load_file(a / rel), load_file(b / rel)
            assert sa.keys() == sb.keys()
            assert all(torch.equal(sa[k], sb[k]) for k in sa), rel
        else:
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_build_refuses_to_overwrite(tmp_path):
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(OSError):
        P.build_tiny("wan2.1-t2v", target)
    assert (target / "keep.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["occupied"]


def test_concurrent_resolve_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VDBENCH_CACHE", str(tmp_path))
    calls = []
    real_build = tiny.build_tiny

    def counting_build(variant, path):
        calls.append(variant)
        time.sleep(0.3)  # widen the race window
        return real_build(variant, path)

    monkeypatch.setattr(tiny, "build_tiny", counting_build)  # what ensure_tiny calls
    results, errors = [], []

    def worker():
        try:
            results.append(P.resolve_model("tiny:wan2.2-ti2v-5b"))
        except Exception as exc:  # pragma: no cover - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and calls == ["wan2.2-ti2v-5b"]
    left = [p.name for p in (tmp_path / "tiny").iterdir() if not p.name.endswith(".lock")]
    assert left == [P.tiny_model_dir("wan2.2-ti2v-5b").name]  # no temporary build dirs left behind


def test_incomplete_cache_dir_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("VDBENCH_CACHE", str(tmp_path))
    path = P.tiny_model_dir("wan2.1-t2v")
    path.mkdir(parents=True)
    (path / "model_index.json").write_text("{}")  # looks like a model, but no completion marker
    assert P.resolve_model("tiny") == str(path)
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == "WanPipeline"


# --------------------------------------------------------------------------------------------------------------
# Loading real models: offline errors
# --------------------------------------------------------------------------------------------------------------


def test_offline_hub_id_fails_fast(tmp_path, monkeypatch):
    import diffusers  # noqa: F401  (import cost is not part of the failure time)
    from diffusers import WanPipeline  # noqa: F401

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    model = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    start = time.monotonic()
    with pytest.raises(P.ModelLoadError) as info:
        P.load_pipeline(model, "t2v", "wan")
    assert time.monotonic() - start < 5.0
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert model in msg and "offline" in msg
    assert f"huggingface-cli download {model} --local-dir DIR" in msg
    assert "--model DIR" in msg and "--model_path DIR" in msg and "--model tiny" in msg
    assert str(tmp_path / "hf_home" / "hub") in msg  # the cache that was searched, resolved at call time


def test_offline_hub_id_from_hf_cache(tmp_path, monkeypatch):
    """A hub id that *is* in the (call-time) HF cache loads offline, through the same hub code path."""
    import shutil

    hf_home = tmp_path / "hf_home"
    repo = hf_home / "hub" / "models--vdbench-test--tiny-wan"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(P.resolve_model("tiny", "t2v"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    pipe = P.load_pipeline("vdbench-test/tiny-wan", "t2v")
    assert type(pipe).__name__ == "WanPipeline"
    _assert_same_state(_state_dicts(pipe), _state_dicts(_pipe("wan2.1-t2v")))


def test_local_path_errors(tmp_path):
    with pytest.raises(P.ModelLoadError, match="does not exist"):
        P.load_pipeline(str(tmp_path / "missing"))
    with pytest.raises(P.ModelLoadError, match="no model_index.json"):
        P.load_pipeline(str(tmp_path))


def test_load_local_dir_and_vae_dtype():
    path = P.resolve_model("tiny", "t2v")
    pipe = P.load_pipeline(path, "t2v", dtype=torch.bfloat16, vae_dtype=torch.float32)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------------
# Helpers over a loaded pipeline
# --------------------------------------------------------------------------------------------------------------


def test_check_video_size():
    wan = _pipe("wan2.1-t2v")
    P.check_video_size(wan, 480, 832, 81)
    P.check_video_size(wan, 128, 192, 17)
    with pytest.raises(ValueError, match=r"height 130 .* multiple of 16.*128 or 144"):
        P.check_video_size(wan, 130, 192, 17)
    with pytest.raises(ValueError, match=r"width 200 .*192 or 208"):
        P.check_video_size(wan, 128, 200, 17)
    with pytest.raises(ValueError, match=r"num_frames 16 .*4k\+1.*13 or 17"):
        P.check_video_size(wan, 128, 192, 16)

    ti2v = _pipe("wan2.2-ti2v-5b")
    P.check_video_size(ti2v, 704, 1280, 121)
    with pytest.raises(ValueError, match=r"multiple of 32 .*128 or 160"):
        P.check_video_size(ti2v, 144, 192, 17)

    cog = _pipe("cogvideox-t2v")
    P.check_video_size(cog, 480, 720, 49)
    with pytest.raises(ValueError, match=r"num_frames 13 .*8k\+1.*9 or 17"):
        P.check_video_size(cog, 480, 720, 13)

    cog_i2v = _pipe("cogvideox-i2v")
    P.check_video_size(cog_i2v, 128, 192, 17)
    with pytest.raises(ValueError, match=r"learned positional embeddings .*128x192"):
        P.check_video_size(cog_i2v, 64, 96, 17)


def test_model_summary_and_transformers_of():
    a14b = _pipe("wan2.2-t2v-a14b")
    assert [name for name, _ in P.transformers_of(a14b)] == ["transformer", "transformer_2"]
    s = json.loads(json.dumps(P.model_summary(a14b)))
    assert s["pipeline"] == "WanPipeline" and s["boundary_ratio"] == 0.875
    t = s["transformers"]["transformer_2"]
    assert (t["class"], t["num_layers"], t["num_attention_heads"], t["attention_head_dim"], t["patch_size"]) == (
        "WanTransformer3DModel", 2, 2, 32, [1, 2, 2]
    )
    assert s["vae"]["class"] == "AutoencoderKLWan" and s["vae"]["z_dim"] == 16
    assert s["text_encoder"]["class"] == "UMT5EncoderModel"

    ti2v = P.model_summary(_pipe("wan2.2-ti2v-5b"))
    assert ti2v["expand_timesteps"] is True and ti2v["vae"]["z_dim"] == 48
    assert ti2v["vae"]["scale_factor_spatial"] == 16 and list(ti2v["transformers"]) == ["transformer"]

    cog = json.loads(json.dumps(P.model_summary(_pipe("cogvideox-t2v"))))
    assert cog["pipeline"] == "CogVideoXPipeline" and cog["text_encoder"]["class"] == "T5EncoderModel"
    assert cog["vae"]["class"] == "AutoencoderKLCogVideoX" and cog["vae"]["latent_channels"] == 16
    assert cog["transformers"]["transformer"]["patch_size"] == 2


# --------------------------------------------------------------------------------------------------------------
# Renders
# --------------------------------------------------------------------------------------------------------------


def test_render_is_deterministic():
    pipe = _pipe("wan2.1-t2v")
    a = _render(pipe, seed=0)
    b = _render(pipe, seed=0)
    c = _render(pipe, seed=1)
    _assert_non_degenerate(a, 9, 64, 96)
    assert np.array_equal(a, b)
    assert np.abs(a - c).mean() > 0.01


def _count_calls(monkeypatch, module, attr):
    calls = []
    real = getattr(module, attr)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, counting)
    return calls


def _count_forwards(pipe):
    counts = {}
    handles = []
    for name, module in P.transformers_of(pipe):
        counts[name] = 0

        def hook(mod, args, name=name):
            counts[name] += 1

        handles.append(module.register_forward_pre_hook(hook))
    return counts, handles


@pytest.mark.parametrize(
    "variant,task,attn_per_block,steps",
    [
        ("wan2.1-t2v", "t2v", 2, 2),  # self + text cross attention
        ("wan2.1-i2v", "i2v", 3, 2),  # self + image cross attention (added k/v) + text cross attention
        ("wan2.2-t2v-a14b", "t2v", 2, 4),
        ("wan2.2-i2v-a14b", "i2v", 2, 2),
        ("wan2.2-ti2v-5b", "ti2v", 2, 2),
        ("wan2.2-ti2v-5b", "i2v", 2, 2),
    ],
)
def test_wan_render(variant, task, attn_per_block, steps, monkeypatch):
    import diffusers.models.transformers.transformer_wan as transformer_wan

    pipe = _pipe(variant, task)
    attn_calls = _count_calls(monkeypatch, transformer_wan, "dispatch_attention_fn")
    counts, handles = _count_forwards(pipe)
    try:
        frames = _render(pipe, steps=steps)
    finally:
        for h in handles:
            h.remove()
    _assert_non_degenerate(frames, 9, 64, 96)
    # steps x (cond + uncond) forwards in total. Wan 2.2 A14B switches to its low-noise expert below its boundary
    # (T2V: t < 875 at its shipped shift 12.0, from the third of 4 steps; I2V: t < 900 at shift 5.0, the second of
    # 2), so both experts must have been called.
    assert sum(counts.values()) == 2 * steps and all(n > 0 for n in counts.values()), counts
    layers = P.TINY_VARIANTS[variant].transformer["num_layers"]
    assert len(attn_calls) == 2 * steps * layers * attn_per_block


@pytest.mark.parametrize("variant,height,width", [("cogvideox-t2v", 64, 96), ("cogvideox-i2v", 128, 192)])
def test_cogvideox_render(variant, height, width, monkeypatch):
    pipe = _pipe(variant)
    inside = []
    handles = [
        pipe.transformer.register_forward_pre_hook(lambda *a: inside.append(True)),
        pipe.transformer.register_forward_hook(lambda *a: inside.clear()),
    ]
    sdpa_calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        if inside:
            sdpa_calls.append(1)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    try:
        frames = _render(pipe, height=height, width=width, num_frames=9)
    finally:
        for h in handles:
            h.remove()
    _assert_non_degenerate(frames, 9, height, width)
    # CogVideoX batches cond/uncond: one joint text+video attention per block and step.
    assert len(sdpa_calls) == 2 * P.TINY_VARIANTS[variant].transformer["num_layers"]


def test_random_real_shape_variants_have_the_real_sizes():
    """``--model random:<name>`` (GPU performance work): real shapes, built on the meta device here (no memory)."""
    from vdbench.pipelines import RANDOM_VARIANTS, build_random

    expected = {"wan2.1-t2v-1.3b": (1.3e9, 1.5e9, 12, 128), "wan2.1-t2v-14b": (13.5e9, 14.5e9, 40, 128),
                "wan2.2-ti2v-5b": (4.5e9, 5.5e9, 24, 128), "cogvideox-2b": (1.5e9, 2.0e9, 30, 64)}
    assert set(expected) <= set(RANDOM_VARIANTS)
    for name, (lo, hi, heads, head_dim) in expected.items():
        pipe = build_random(name, dtype=torch.bfloat16, device="meta")
        tr = pipe.transformer
        n = sum(p.numel() for p in tr.parameters())
        assert lo < n < hi, f"{name}: {n / 1e9:.2f}B parameters"
        assert (tr.config.num_attention_heads, tr.config.attention_head_dim) == (heads, head_dim)
        # what from_pretrained(dtype=bf16) keeps in float32 stays float32, the rest is bf16
        keep = set(getattr(tr, "_keep_in_fp32_modules", None) or [])
        for pname, p in tr.named_parameters():
            assert p.dtype == (torch.float32 if keep & set(pname.split(".")) else torch.bfloat16), pname
    with pytest.raises(ValueError, match="Valid: wan2.1-t2v-1.3b"):
        build_random("nope", device="meta")


def test_random_wan21_i2v_14b_has_the_real_480p_i2v_shapes():
    """``random:wan2.1-i2v-14b`` (the I2V render of the VAE-encode issue): Wan2.1-I2V-14B-480P's transformer (36
    input channels, CLIP image context 1280 wide, added k/v at the inner dim, 40 layers x 40 heads: 16.4B
    parameters) and a CLIP vision encoder at the real ViT-H/14 width with 2 layers."""
    from vdbench.pipelines import build_random

    pipe = build_random("wan2.1-i2v-14b", dtype=torch.bfloat16, device="meta")
    c = pipe.transformer.config
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    assert (c.in_channels, c.image_dim, c.added_kv_proj_dim, c.num_layers, c.num_attention_heads) == \
        (36, 1280, 5120, 40, 40)
    assert 16.0e9 < sum(p.numel() for p in pipe.transformer.parameters()) < 16.8e9
    ie = pipe.image_encoder.config
    assert (ie.hidden_size, ie.intermediate_size, ie.num_attention_heads, ie.num_hidden_layers) == (1280, 5120, 16, 2)
    assert pipe.vae.config.base_dim == 96 and pipe.text_encoder.config.d_model == 4096


def test_a_name_that_cannot_be_a_hub_id_is_refused_without_a_lookup(monkeypatch):
    """``tiny-wan2.1`` (another tool's old spelling) or any bare name is neither a local path nor a hub id
    (``org/name``): refused at once with the tiny spellings, no from_pretrained, no network retries."""
    import diffusers

    def no_lookup(*a, **k):
        raise AssertionError("a hub lookup was attempted")

    monkeypatch.setattr(diffusers.WanPipeline, "from_pretrained", classmethod(no_lookup))
    for name in ("tiny-wan2.1", "wan2.1", "Wan AI/x"):
        with pytest.raises(P.ModelLoadError) as info:
            P.load_pipeline(name, "t2v", "wan")
        first, hint = str(info.value).split("\n", 1)
        assert f"Model {name!r} is not a local directory and can't be a hub id" in first
        assert "nothing was downloaded" in first and "`tiny` or `tiny:<variant>`" in hint
    assert P.hub_id_problem("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") is None


def test_head_dims_read_from_configs_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)

    def head_dims(model, task="t2v", family="wan"):
        return P.resolve(model, task, family).head_dims

    assert head_dims("tiny", "t2v", "wan") == [32]
    assert head_dims("tiny:wan2.2-t2v-a14b", "t2v", "wan") == [32, 32]  # both experts
    assert head_dims("tiny", "t2v", "cogvideox") == [P.TINY_VARIANTS["cogvideox-t2v"].transformer[
        "attention_head_dim"]]
    assert head_dims("random:wan2.1-t2v-14b") == [128]
    assert head_dims(str(P.resolve_model("tiny", "t2v"))) == [32]  # a local directory's config.json
    assert head_dims("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") is None  # not cached: unknown, nothing fetched
    assert head_dims(str(tmp_path / "missing")) is None and head_dims("tiny:nope") is None


def test_the_vae_config_is_read_without_loading_a_weight(tmp_path):
    """What the render's prewarm builds its scratch VAE from before the pipeline loads (:attr:`Model.vae`)."""

    def vae(model):
        return P.resolve(model).vae

    cls, cfg = vae("random:wan2.1-t2v-1.3b")
    assert cls == "AutoencoderKLWan" and cfg["base_dim"] == 96  # the real checkpoint's architecture
    assert vae("tiny")[0] == "AutoencoderKLWan"
    assert P.resolve("random:cogvideox-2b", family="cogvideox").vae[0] == "AutoencoderKLCogVideoX"
    d = tmp_path / "model"
    (d / "vae").mkdir(parents=True)
    (d / "vae" / "config.json").write_text('{"_class_name": "AutoencoderKLWan", "z_dim": 16}')
    assert vae(str(d)) == ("AutoencoderKLWan", {"_class_name": "AutoencoderKLWan", "z_dim": 16})
    assert vae(str(tmp_path / "missing")) is None  # nothing to read: the render starts it after the load
    assert vae("random:no-such-variant") is None
