"""Tests for vdbench.families: each family's rules, discovery, and a new family added as one file, end to end.

The toy family at the bottom is the point of the package: a module dropped into the families package (here from a
temporary directory) is discovered, and then loads, renders, names and labels its videos through the same code as
Wan and CogVideoX, with nothing else edited.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vdbench import backends as B
from vdbench import families, pipelines as P, tiny
from vdbench.video import label_from_filename

WAN = families.get("wan")
COG = families.get("cogvideox")


# --------------------------------------------------------------------------------------------------------------
# Registry and discovery
# --------------------------------------------------------------------------------------------------------------


def test_every_module_of_the_package_is_a_registered_family():
    """Discovery is by module: each module of vdbench/families defines FAMILY and it is registered as it is."""
    modules = {m.name for m in pkgutil.iter_modules(families.__path__)}
    assert {"wan", "cogvideox"} <= modules
    for name in modules:
        family = importlib.import_module(f"vdbench.families.{name}").FAMILY
        assert families.get(family.name) is family
    assert families.names()[:2] == ("wan", "cogvideox")  # listing order (Family.order), not module order


def test_registry_lookups_and_errors():
    with pytest.raises(ValueError, match=r"Unknown model family 'hunyuan'; expected one of wan, cogvideox"):
        families.get("hunyuan")
    assert families.for_pipeline(type("WanImageToVideoPipeline", (), {})()) is WAN
    sub = type("xFuserWanImageToVideoPipeline", (type("WanImageToVideoPipeline", (), {}),), {})
    assert families.for_pipeline(sub()) is WAN  # xfuser's subclasses are their base class's family
    assert families.for_pipeline(type("CogVideoXImageToVideoPipeline", (), {})()) is COG
    with pytest.raises(ValueError, match="no registered model family serves pipeline class FluxPipeline"):
        families.for_pipeline(type("FluxPipeline", (), {})())
    assert families.for_vae(type("AutoencoderKLCogVideoX", (), {})()) is COG
    with pytest.raises(ValueError, match="unsupported VAE class AutoencoderKLHunyuanVideo"):
        families.for_vae(type("AutoencoderKLHunyuanVideo", (), {})())
    with pytest.raises(ValueError, match="already registered"):
        families.register(dataclasses.replace(WAN))
    stray = dataclasses.replace(tiny.TINY_VARIANTS["wan2.1-t2v"], name="stray", family="wan")
    with pytest.raises(ValueError, match="says family 'wan', not 'other'"):
        families.register(dataclasses.replace(WAN, name="other", tiny_variants=(stray,), random_variants={}))
    assert "other" not in families.names() and "stray" not in tiny.TINY_VARIANTS


def test_variants_come_from_the_families_in_listing_order(monkeypatch):
    assert [v.name for v in WAN.tiny_variants + COG.tiny_variants] == list(tiny.TINY_VARIANTS)
    assert all(v.family == "wan" and v.transformer_init is not None for v in WAN.tiny_variants)
    assert list(tiny.RANDOM_VARIANTS) == [*WAN.random_variants, *COG.random_variants]
    for family in (WAN, COG):
        for task in family.tasks:
            default = tiny.TINY_VARIANTS[family.default_tiny[task]]
            assert task in default.tasks and default.pipeline == family.pipeline_class(task)
    # the init hook is hashed with the variant (not part of its JSON spec): another hook, another cache directory
    base = P.tiny_model_dir("wan2.1-t2v")
    cog_init = COG.tiny_variants[0].transformer_init
    hooked = dataclasses.replace(tiny.TINY_VARIANTS["wan2.1-t2v"], transformer_init=cog_init)
    assert hooked.spec() == tiny.TINY_VARIANTS["wan2.1-t2v"].spec()
    monkeypatch.setitem(tiny.TINY_VARIANTS, "wan2.1-t2v", hooked)
    assert P.tiny_model_dir("wan2.1-t2v") != base


# --------------------------------------------------------------------------------------------------------------
# Each family's rules
# --------------------------------------------------------------------------------------------------------------


def test_tasks_classes_and_defaults():
    assert WAN.tasks == ("t2v", "i2v", "ti2v") and COG.tasks == ("t2v", "i2v")
    assert [WAN.pipeline_class(t) for t in WAN.tasks] == ["WanPipeline", "WanImageToVideoPipeline", "WanPipeline"]
    assert COG.pipeline_class("i2v") == "CogVideoXImageToVideoPipeline"
    assert COG.pipeline_class(None) == "CogVideoXPipeline"  # no task: t2v
    with pytest.raises(ValueError, match="Unknown task 'ti2v' for family 'cogvideox'; expected one of t2v, i2v"):
        COG.pipeline_class("ti2v")
    assert (WAN.vae_class, COG.vae_class) == ("AutoencoderKLWan", "AutoencoderKLCogVideoX")
    assert WAN.default_models == {"t2v": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                  "i2v": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                  "ti2v": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}
    assert COG.default_models["t2v"] == "THUDM/CogVideoX-2b"
    assert (WAN.cli.real["num_frames"], WAN.cli.tiny["num_frames"], COG.cli.real["num_frames"]) == (81, 17, 49)
    assert (WAN.cli.results_subdir, COG.cli.results_subdir) == ("results", "")


def test_the_render_clis_take_their_defaults_from_the_family():
    from vdbench import cli

    wan_args = cli.build_parser("wan").parse_args([])
    assert (wan_args.prompt, wan_args.negative_prompt, wan_args.guidance_scale, wan_args.fps,
            wan_args.output_dir) == (WAN.cli.prompt, WAN.cli.negative_prompt, 5.0, 16, "outputs")
    cog_args = cli.build_parser("cogvideox").parse_args([])
    assert (cli._model(COG, cog_args), cog_args.guidance_scale, cog_args.fps, cog_args.output_dir) == (
        "THUDM/CogVideoX-2b", 6.0, 8, "outputs/cogvideox")


def test_output_names_parse_back_to_the_attention_type():
    wan_name = WAN.output_name("t2v", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 81, 30, "sdpa_cudnn", 480, 832)
    assert wan_name == "wan_result_t2v_Wan2.1-T2V-1.3B-Diffusers_81f_30s_attn_sdpa_cudnn_480x832.mp4"
    cog_name = COG.output_name("t2v", "THUDM/CogVideoX-2b", 49, 50, "fav3_fp8", 480, 720)
    assert cog_name == "cogvideox-CogVideoX-2b_fav3_fp8.mp4"
    for family, name in ((WAN, wan_name), (COG, cog_name)):
        stem = Path(name).stem
        other = COG if family is WAN else WAN
        assert family.parse_label(stem) == ("sdpa_cudnn" if family is WAN else "fav3_fp8")
        assert other.parse_label(stem) is None
        assert label_from_filename(name) == family.parse_label(stem)
    assert WAN.parse_label("wan_result_old_attn_sage_64x96") == "sage"  # the loose form (no frames/steps)
    # a torchrun render's name ends with its layout; the fallback label carries it as a run's label does
    for layout in ("u2", "r2", "u2r2", "cfg2", "u2cfg2"):
        wan_par = WAN.output_name("t2v", "tiny", 9, 2, "sdpa_cudnn", 64, 96, layout=layout)
        cog_par = COG.output_name("t2v", "tiny", 9, 2, "fav3_fp8", 64, 96, layout=layout)
        assert wan_par.endswith(f"_64x96_{layout}.mp4") and cog_par == f"cogvideox-tiny_fav3_fp8_{layout}.mp4"
        assert label_from_filename(wan_par) == f"sdpa_cudnn+{layout}"
        assert label_from_filename(cog_par) == f"fav3_fp8+{layout}"
        assert WAN.parse_name(Path(wan_par).stem) == ("sdpa_cudnn", layout)
    assert families.layout_tag(2, 1) == "u2" and families.layout_tag(1, 2) == "r2"
    assert families.layout_tag(2, 2) == "u2r2" and families.layout_tag(1, 1, True) == "cfg2"
    assert families.layout_tag() == "" and WAN.output_name("t2v", "tiny", 9, 2, "sdpa", 64, 96).endswith("_64x96.mp4")
    # names that merely look like a layout stay backends: sdpa_cudnn, reference, fav3_sage
    for t in ("sdpa_cudnn", "reference", "fav3_sage", "sdpa_flash"):
        assert label_from_filename(COG.output_name("t2v", "tiny", 9, 2, t, 64, 96)) == t
    assert label_from_filename("something_else.mp4") == "something_else"
    assert families.model_tag("tiny:wan2.2-t2v-a14b") == "tiny-wan2.2-t2v-a14b"


def test_sizes_flow_shift_and_image_rules():
    assert (WAN.frame_multiple, COG.frame_multiple) == (1, 2)
    assert WAN.frame_rule.format(step=4, temporal=4) == "Wan needs 4k+1 frames (VAE temporal factor 4)"
    assert WAN.image_size_multiple("ti2v", "x") == WAN.image_size_multiple("i2v", "tiny:wan2.2-ti2v-5b") == 32
    assert WAN.image_size_multiple("i2v", "tiny") == 16 and COG.image_size_multiple("i2v", "tiny") is None
    assert (WAN.flow_shift("t2v", 480, 832), WAN.flow_shift("t2v", 720, 1280), WAN.flow_shift("ti2v", 480, 832)) == (
        3.0, 5.0, 5.0)
    assert COG.flow_shift is None  # DDIM: no flow-matching shift to set
    assert not WAN.image_refusals and not COG.image_refusals
    assert WAN.image_tasks == COG.image_tasks == ("i2v",)
    # TI2V takes an image optionally: with one, diffusers' image-to-video pipeline runs the same checkpoint
    assert WAN.pipeline_class("ti2v") == "WanPipeline" and WAN.pipeline_class("ti2v", image=True) == \
        "WanImageToVideoPipeline"
    assert WAN.takes_image("ti2v") and WAN.takes_image("i2v") and not WAN.takes_image("t2v")
    assert COG.pipeline_class("t2v", image=True) == "CogVideoXPipeline" and not COG.takes_image("t2v")
    learned = types.SimpleNamespace(config=types.SimpleNamespace(use_learned_positional_embeddings=True,
                                                                 sample_height=16, sample_width=24))
    assert COG.fixed_size(learned, 8) == (128, 192, "this CogVideoX model has learned positional embeddings")
    learned.config.use_learned_positional_embeddings = False
    assert COG.fixed_size(learned, 8) is None and WAN.fixed_size(learned, 8) is None


def test_latent_preparation_is_the_pipelines():
    from vdbench.vae.fast import prepare_latents

    wan_vae = types.SimpleNamespace(dtype=torch.float32, config=types.SimpleNamespace(
        z_dim=2, latents_mean=[0.5, -1.0], latents_std=[2.0, 4.0]))
    lat = torch.ones(1, 2, 3, 4, 4)
    z = WAN.prepare_latents(wan_vae, lat)
    assert torch.equal(z[0, :, 0, 0, 0], torch.tensor([2.5, 3.0]))  # latents * std + mean
    assert torch.equal(prepare_latents(wan_vae, lat, "wan"), z)  # vdbench.vae.fast delegates to the family
    cog_vae = types.SimpleNamespace(dtype=torch.float32, config=types.SimpleNamespace(scaling_factor=2.0))
    lat = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 2, 2)  # (B, T, C, H, W)
    z = COG.prepare_latents(cog_vae, lat)
    assert z.shape == (1, 3, 2, 2, 2) and torch.equal(z, lat.permute(0, 2, 1, 3, 4) / 2.0)
    assert COG.pipeline_decode and not WAN.pipeline_decode
    pipe = types.SimpleNamespace(vae_scale_factor_temporal=4,
                                 transformer=types.SimpleNamespace(config=types.SimpleNamespace(patch_size_t=2)))
    lat = torch.zeros(1, 14, 16, 2, 2)  # 53 frames -> 14 latent frames: CogVideoX 1.5 pads none ...
    assert COG.trim_latents(pipe, lat, 53).shape[1] == 14
    assert COG.trim_latents(pipe, torch.zeros(1, 14, 16, 2, 2), 49).shape[1] == 13  # ... 49 -> 13: one padding frame
    pipe.transformer.config.patch_size_t = None
    assert COG.trim_latents(pipe, lat, 49) is lat and WAN.trim_latents(pipe, lat, 49) is lat


def test_parallel_support_per_engine():
    assert WAN.parallel_refusal("xfuser", "i2v", 2, True) is None
    assert WAN.parallel_refusal("diffusers", "t2v", 4, False) is None
    for engine in ("xfuser", "diffusers"):  # the CFG split for every Wan task on both engines
        assert all(WAN.parallel_refusal(engine, task, 4, True) is None for task in ("t2v", "ti2v", "i2v"))
    assert COG.parallel_refusal("diffusers", "t2v", 2, True) is None  # the guidance batch halved
    assert "no _cp_plan" in COG.parallel_refusal("diffusers", "t2v", 4, True)
    assert COG.parallel_refusal("xfuser", "t2v", 4, True) is None
    assert COG.parallel_refusal("diffusers", "t2v", 1, False) is None  # one process: nothing to split
    assert "no _cp_plan" in COG.parallel_refusal("diffusers", "t2v", 2, False)
    assert "CogVideoX image-to-video under torchrun" in COG.parallel_refusal("xfuser", "i2v", 2, False)
    assert set(WAN.xfuser) == {"WanPipeline", "WanImageToVideoPipeline"} and set(COG.xfuser) == {"CogVideoXPipeline"}
    assert WAN.xfuser["WanImageToVideoPipeline"].cfg_pipeline.endswith(":xFuserWanImageToVideoPipeline")
    assert WAN.xfuser["WanPipeline"].cfg_pipeline is None
    assert COG.xfuser["CogVideoXPipeline"].pipeline_wrapper.endswith(":xFuserCogVideoXPipeline")


@pytest.fixture
def fake_xfuser(monkeypatch):
    """Stand-ins for the xfuser modules vdbench.parallel imports (xfuser itself needs CUDA GPUs), recording calls:
    the wrappers are the families' (subclasses of the diffusers classes they wrap, as xfuser's are)."""
    import diffusers

    calls = []

    class Args:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def create_config(self):
            return ("engine_config", self.kwargs), None

    class CogWrapper:
        def __init__(self, pipe, engine_config):
            self.pipe, self.engine_config, self.transformer = pipe, engine_config, pipe.transformer

    class WanWrapper(diffusers.WanTransformer3DModel):
        pass

    class WanCfgPipeline(diffusers.WanImageToVideoPipeline):
        pass

    modules = {
        "xfuser": {"xFuserArgs": Args},
        "xfuser.core": {},
        "xfuser.core.distributed": {"init_distributed_environment": lambda **kw: calls.append(("init", kw)),
                                    "initialize_runtime_state": lambda pipe, cfg: calls.append(("runtime", pipe))},
        "xfuser.model_executor": {},
        "xfuser.model_executor.models": {},
        "xfuser.model_executor.models.transformers": {},
        "xfuser.model_executor.models.transformers.transformer_wan": {"xFuserWanTransformer3DWrapper": WanWrapper},
        "xfuser.model_executor.pipelines": {"xFuserCogVideoXPipeline": CogWrapper},
        "xfuser.model_executor.pipelines.pipeline_wan_i2v": {"xFuserWanImageToVideoPipeline": WanCfgPipeline},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(calls=calls, CogWrapper=CogWrapper, WanWrapper=WanWrapper,
                                 WanCfgPipeline=WanCfgPipeline)


def test_xfuser_wiring_follows_the_family(fake_xfuser, tmp_path, monkeypatch):
    from vdbench import parallel

    monkeypatch.setenv("VDBENCH_CACHE", str(tmp_path))

    def ctx(cfg=False):
        return parallel.DistContext(parallel.ParallelSpec("xfuser", 2, 1, cfg), 0, 4 if cfg else 2, 0,
                                    torch.device("cpu"), "gloo")

    # CogVideoX: the pipeline wrapper around the loaded pipeline
    cog = type("CogVideoXPipeline", (), {"transformer": object()})()
    wrapped, models = parallel.apply_engine(ctx(), cog, [("transformer", cog.transformer)], COG)
    assert isinstance(wrapped, fake_xfuser.CogWrapper) and wrapped.pipe is cog
    assert models == [("transformer", cog.transformer)]
    # Wan: the transformer wrapper takes over the loaded transformer's tensors; I2V with CFG: the CFG pipeline
    pipe = P.load_pipeline("tiny", "i2v", "wan")
    old = pipe.transformer
    new_pipe, models = parallel.apply_engine(ctx(cfg=True), pipe, P.transformers_of(pipe), P.model_of(pipe).family)
    assert type(new_pipe) is fake_xfuser.WanCfgPipeline and new_pipe.engine_config[0] == "engine_config"
    assert isinstance(models[0][1], fake_xfuser.WanWrapper) and new_pipe.transformer is models[0][1]
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(old.parameters(), models[0][1].parameters()))
    assert fake_xfuser.calls[-1] == ("runtime", new_pipe)
    # a pipeline class no family wires to xfuser is refused, naming the wired ones
    i2v = type("CogVideoXImageToVideoPipeline", (), {})()
    with pytest.raises(B.BackendUnavailable, match="CogVideoXImageToVideoPipeline is not wired to xfuser in vdbench "
                                                   r"\(WanPipeline, WanImageToVideoPipeline, CogVideoXPipeline are\)"):
        parallel.apply_engine(ctx(), i2v, [], COG)


def test_attention_call_kinds():
    from vdbench.patching.calls import call_kind as _call_kind

    wan_cross = types.SimpleNamespace(is_cross_attention=True)
    cog_attn = types.SimpleNamespace(is_cross_attention=False)
    text = torch.zeros(1)
    assert (WAN.call_kind("dispatcher", wan_cross, None), WAN.call_kind("dispatcher", wan_cross, text)) == (
        "self", "cross")
    assert COG.call_kind("sdpa", cog_attn, None) == COG.call_kind("xfuser", cog_attn, text) == "joint"
    assert COG.call_kind("xfuser", cog_attn, None) == "self"
    # Wan 2.1 I2V: a cross-attention module with the image context's own projections makes two calls
    wan_i2v_cross = types.SimpleNamespace(is_cross_attention=True, add_k_proj=object())
    assert WAN.call_kind("dispatcher", wan_i2v_cross, text) == "cross+img"
    assert WAN.call_kind("dispatcher", wan_i2v_cross, None) == "self"
    # the families agree with patching's default classifier on their own modules
    for mode, ehs in (("dispatcher", None), ("dispatcher", text), ("xfuser", text)):
        assert WAN.call_kind(mode, wan_cross, ehs) == _call_kind(mode, wan_cross, ehs)
    for mode, ehs in (("sdpa", text), ("xfuser", text), ("xfuser", None)):
        assert COG.call_kind(mode, cog_attn, ehs) == _call_kind(mode, cog_attn, ehs)


def test_bench_presets_come_from_the_families():
    presets = families.attention_presets()
    assert presets["wan2.1-1.3b-480p"] == (1, 12, 32760, 32760, 128)
    assert presets["cogvideox-2b"] == (1, 30, 17776, 17776, 64)
    assert set(presets) == set(WAN.attention_presets) | set(COG.attention_presets)


def test_build_vae_one_builder_for_the_family_vaes():
    assert P.vae_names() == ("wan2.1", "wan2.2", "cogvideox")
    a = P.build_vae("wan2.1", tiny=True, seed=3)
    b = P.build_vae("wan2.1", tiny=True, seed=3)
    assert type(a).__name__ == "AutoencoderKLWan" and a.config.base_dim == 4
    assert not any(p.requires_grad for p in a.parameters()) and not a.training
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = P.build_vae("wan2.1", tiny=True, seed=4)
    assert not torch.equal(next(iter(a.state_dict().values())), next(iter(c.state_dict().values())))
    deeper = P.build_vae("wan2.2", tiny=True, dtype=torch.bfloat16, num_res_blocks=2)
    assert deeper.config.num_res_blocks == 2 and deeper.config.z_dim == 48 and deeper.dtype == torch.bfloat16
    real = P.build_vae("cogvideox", device="meta")  # the real checkpoint's config, shapes only
    assert type(real).__name__ == "AutoencoderKLCogVideoX"
    assert list(real.config.block_out_channels) == [128, 256, 256, 512]
    with pytest.raises(ValueError, match="Unknown VAE 'hunyuanvideo'; valid: wan2.1, wan2.2, cogvideox"):
        P.build_vae("hunyuanvideo")


class _ToyProcessor:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, **kwargs):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        return F.scaled_dot_product_attention(hidden_states, context, context)


class _ToyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.processor = _ToyProcessor()
        self.w = torch.nn.Parameter(torch.zeros(1))


class ToyTransformer(torch.nn.Module):
    """A transformer class no shipped family claims: one attention module, called with and without a context."""

    def __init__(self):
        super().__init__()
        self.attn = _ToyAttention()

    def forward(self, x, context):
        return self.attn.processor(self.attn, x) + self.attn.processor(self.attn, x, encoder_hidden_states=context)


class ToyVAE:
    dtype = torch.float32
    use_tiling = False

    def decode(self, z, return_dict=True):
        return (z * 2,)


def test_a_registered_family_is_what_the_generic_code_asks(monkeypatch):
    """Grid hooks, the attention-kind rule and the VAE's latent handling come from the family's record, found by
    class through the registry: a family registered here, in one place, changes what the patch, the decode and the
    band decode do, with no name tested anywhere else."""
    from vdbench.vae import decode as D, parallel as vae_parallel
    from vdbench.patching import AttentionPatch

    hooked = []

    def grid_hooks(transformer, spec, *, once_per_forward=True, active=None):
        hooked.append((type(transformer).__name__, spec.pattern))
        return types.SimpleNamespace(grid=None, layout=None, remove=lambda: hooked.append("removed"))

    toy = dataclasses.replace(
        WAN, name="toyfam", tasks=("t2v",), pipeline_classes={"t2v": "ToyPipeline"}, vae_class="ToyVAE",
        transformer_classes=("ToyTransformer",), default_models={"t2v": "tiny"}, default_tiny={}, tiny_variants=(),
        random_variants={}, attention_presets={}, attention_grids={}, vae_configs={}, xfuser={},
        call_kind=lambda mode, attn, ehs: "self" if ehs is None else "cross+img", grid_hooks=grid_hooks,
        prepare_latents=lambda vae, latents: latents + 1, trim_latents=lambda pipe, latents, n: latents[:, 1:],
        pipeline_decode=False, vae_frame_chunks=False, order=50)
    model, x = ToyTransformer(), torch.randn(1, 2, 8, 16)

    # unknown to the registry: the generic classification, and no token grid
    with AttentionPatch([("transformer", model)], "reference") as patch:
        model(x, x)
    assert dict(patch.stats.calls_by_kind) == {"joint": 2}
    with pytest.raises(B.BackendUnavailable, match="ToyTransformer has no known token grid"):
        AttentionPatch([("transformer", model)], "sta").install()

    families.register(toy)
    try:
        assert families.for_transformer(model) is toy and families.for_vae(ToyVAE()) is toy
        # the attention-kind rule: the family's (its cross+img counts an image-context call, then a text one)
        with AttentionPatch([("transformer", model)], "reference") as patch:
            model(x, x)
        assert dict(patch.stats.calls_by_kind) == {"self": 1, "cross_img": 1}
        # the sparse grid hooks: the family's, installed for the patch and removed with it
        with AttentionPatch([("transformer", model)], "sta"):
            assert hooked == [("ToyTransformer", "sta")]
        assert hooked[-1] == "removed"
        # the latents' way to the VAE: the family's trim and preparation, then the VAE's own decode
        pipe = types.SimpleNamespace(vae=ToyVAE(), video_processor=types.SimpleNamespace(
            postprocess_video=lambda video, output_type: [video]))
        latents = torch.arange(3.0).view(1, 3, 1, 1, 1)
        frames = D.decode_latents(pipe, latents, toy)
        assert torch.equal(frames, (latents[:, 1:] + 1) * 2)
        # the band decode's driving of the decoder: per the family's vae_frame_chunks
        monkeypatch.setattr(vae_parallel, "VAES", ("ToyVAE",))
        with pytest.raises(ValueError, match=r"chunk_frames applies .* \(wan\); toyfam's decodes in its own"):
            vae_parallel.decode_video_parallel(ToyVAE(), torch.zeros(1, 1, 2, 4, 4), chunk_frames=2)
    finally:
        families.unregister("toyfam")
    assert "toyfam" not in families.names()


# --------------------------------------------------------------------------------------------------------------
# A new family = one new module
# --------------------------------------------------------------------------------------------------------------

TOY_MODULE = '''"""A toy family: Wan's tiny text-to-video model under another name, with its own output names."""

import dataclasses
import re

from vdbench.families import model_tag, wan

VARIANT = dataclasses.replace(wan.TINY_VARIANTS[0], name="toy-t2v", family="toy")


def output_name(task, model, num_frames, steps, attention_type, height, width):
    return f"toy-{model_tag(model)}-{height}x{width}_{attention_type}.mp4"


def parse_label(stem):
    m = re.match(r"^toy-[^_]+_(?P<type>.+)$", stem)
    return m.group("type") if m else None


FAMILY = dataclasses.replace(
    wan.FAMILY, name="toy", tasks=("t2v",), pipeline_classes={"t2v": "WanPipeline"}, default_models={"t2v": "tiny"},
    default_tiny={"t2v": "toy-t2v"}, tiny_variants=(VARIANT,), random_variants={}, attention_presets={},
    vae_configs={}, output_name=output_name, parse_label=parse_label, order=50)
'''


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The toy module, written into a directory added to the families package's path, discovered, removed after."""
    monkeypatch.setenv("VDBENCH_CACHE", str(tmp_path / "cache"))
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "toy.py").write_text(TOY_MODULE)
    families.__path__.append(str(plugin_dir))
    try:
        assert families.discover() == ("toy",)
        yield families.get("toy")
    finally:
        families.__path__.remove(str(plugin_dir))
        families.unregister("toy")
        sys.modules.pop("vdbench.families.toy", None)
        if hasattr(families, "toy"):
            delattr(families, "toy")


def _render(family, tmp_path):
    """A 64x96, 9-frame, 2-step tiny render of ``family`` through vdbench.render (one torch thread: steadier on
    the shared CPUs); returns the summary and the video's path."""
    from vdbench.render import RenderConfig, render

    fam = families.get(family)
    out = tmp_path / family / fam.cli.results_subdir
    name = fam.output_name("t2v", "tiny", 9, 2, "sdpa", 64, 96)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = render(RenderConfig(family=family, task="t2v", model="tiny", prompt="a cat", negative_prompt="",
                                      height=64, width=96, num_frames=9, num_inference_steps=2, guidance_scale=5.0,
                                      seed=42, attention_type="sdpa", output_path=out / name,
                                      timing_path=out / "timing.json", device="cpu", save_frames=True),
                         log=lambda *a, **k: None)
    finally:
        torch.set_num_threads(before)
    return summary, out / name


def test_a_family_module_is_discovered_and_runs_end_to_end(toy_family, tmp_path):
    assert "toy" in families.names() and "toy-t2v" in tiny.TINY_VARIANTS
    # loading goes through the family: its default tiny variant, built into its own cache directory
    path = P.resolve_model("tiny", "t2v", "toy")
    assert Path(path).name.startswith("toy-t2v-") and path == str(P.tiny_model_dir("toy-t2v"))
    pipe = P.load_pipeline("tiny", "t2v", "toy")
    assert type(pipe).__name__ == "WanPipeline"
    with pytest.raises(ValueError, match="'wan2.1-t2v' is a wan model, but family 'toy' was requested"):
        P.load_pipeline("tiny:wan2.1-t2v", "t2v", "toy")
    with pytest.raises(ValueError, match="Unknown task 'i2v' for family 'toy'"):
        P.load_pipeline("tiny", "i2v", "toy")
    P.check_video_size(pipe, 64, 96, 9, family="toy")

    # rendering: the toy's names, and the same frames as Wan's tiny model (same weights, same code path)
    toy_summary, toy_out = _render("toy", tmp_path)
    assert toy_out.name == "toy-tiny-64x96_sdpa.mp4" and toy_out.is_file()
    assert toy_summary["calls_by_kernel"] and toy_summary["fallback_calls"] == 0
    assert label_from_filename(toy_out) == "sdpa"
    _, wan_out = _render("wan", tmp_path)
    assert wan_out.parent.name == "results"
    np.testing.assert_array_equal(np.load(toy_out.with_suffix(".npy")), np.load(wan_out.with_suffix(".npy")))


def test_unregistering_a_family_removes_its_variants(toy_family):
    assert families.get("toy") is toy_family
    families.unregister("toy")
    assert "toy" not in families.names() and "toy-t2v" not in tiny.TINY_VARIANTS
    with pytest.raises(ValueError, match="Unknown model family 'toy'"):
        P.resolve_model("tiny", "t2v", "toy")


def test_every_attention_preset_grid_matches_its_sequence_length():
    """bench_attention's presets carry their token grid (the sparse patterns need it): each one's length is the
    preset's, and every video preset has one."""
    from vdbench import families
    from vdbench.sparse import parse_grid

    presets, grids = families.attention_presets(), families.attention_grids()
    assert set(grids) == set(presets)
    for name, grid in grids.items():
        assert parse_grid(grid).seq_len == presets[name][2] == presets[name][3], name


def test_a_renders_token_grid_follows_from_its_size():
    """``size_grid`` (what the sweep hands the kernel bench for the sparse patterns) agrees with the presets' grids
    at the presets' sizes."""
    from vdbench import families

    wan, cog = families.get("wan"), families.get("cogvideox")
    grids = families.attention_grids()
    assert wan.size_grid(480, 832, 81) == grids["wan2.1-1.3b-480p"]
    assert wan.size_grid(720, 1280, 81) == grids["wan2.1-14b-720p"]
    assert cog.size_grid(480, 720, 49) == grids["cogvideox-2b"]
