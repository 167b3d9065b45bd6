"""Installing backends into real diffusers transformers (Wan: dispatcher; CogVideoX: F.sdpa), counting, removal."""

import pytest
import torch
import torch.nn.functional as F

from vdbench import backends as B
from vdbench.patching.dispatcher import DispatcherAdapter
from vdbench.patching import AttentionPatch, attention_modules


def small_wan(image=False):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    kw = dict(image_dim=24, added_kv_proj_dim=32) if image else {}
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2, **kw).eval()


def wan_inputs(image=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 3, 8, 8, generator=g)  # 3 frames, 8x8 latent -> 3*4*4 = 48 tokens
    ctx = torch.randn(1, 512, 24, generator=g)  # Wan pads the text context to 512 tokens
    kw = {"encoder_hidden_states_image": torch.randn(1, 257, 24, generator=g)} if image else {}
    return dict(hidden_states=x, timestep=torch.tensor([500]), encoder_hidden_states=ctx, **kw)


def small_cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                       time_embed_dim=32, text_embed_dim=24, num_layers=2, sample_width=8,
                                       sample_height=8, sample_frames=5, max_text_seq_length=7).eval()


def cog_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 2, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 7, 24, generator=g), timestep=torch.tensor([500]))


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("builder,inputs,n_modules,calls", [
    (small_wan, wan_inputs, 4, {"self": 2, "cross": 2}),
    (small_cogvideox, cog_inputs, 2, {"joint": 2}),
])
def test_counts_every_call_by_kernel_and_kind(builder, inputs, n_modules, calls):
    model = builder()
    with AttentionPatch([("transformer", model)], "sagev1_emu") as patch:
        run(model, inputs())
    assert patch.n_modules == n_modules
    assert dict(patch.stats.calls) == {"emu.sagev1": sum(calls.values())}
    assert dict(patch.stats.calls_by_kind) == calls


@pytest.mark.parametrize("builder,inputs", [(small_wan, wan_inputs), (small_cogvideox, cog_inputs)])
def test_patched_output_tracks_the_backend_and_removal_restores(builder, inputs):
    model = builder()
    x = inputs()
    base = run(model, x)
    procs = [m.processor for _, m in attention_modules(model)]
    with AttentionPatch([("transformer", model)], "reference"):
        ref = run(model, x)
    with AttentionPatch([("transformer", model)], "fp8_emu"):
        fp8 = run(model, x)
    # removed: the very same processor objects are back and the output is bit-identical to before
    assert [m.processor for _, m in attention_modules(model)] == procs
    assert torch.equal(run(model, x), base)
    assert (ref - base).abs().max() < 1e-4  # fp32 exact vs fp32 sdpa
    assert not torch.equal(fp8, base)  # the backend really ran inside the model


def test_default_is_a_counting_pass_through():
    model = small_wan()
    x = wan_inputs()
    base = run(model, x)
    with AttentionPatch([("transformer", model)], "default") as patch:
        out = run(model, x)
    assert torch.equal(out, base)
    (label, n), = patch.stats.calls.items()
    assert n == 4 and label.startswith("diffusers.native[")


def test_sdpa_counts_name_the_kernel_torch_chose():
    model = small_cogvideox()
    with AttentionPatch([("transformer", model)], "sdpa") as patch:
        run(model, cog_inputs())
    (label, n), = patch.stats.calls.items()
    assert n == 2 and label in {"sdpa[flash]", "sdpa[math]"}


def test_patch_touches_only_the_patched_model():
    """F.scaled_dot_product_attention stays the real one for everything else in the process."""
    a, b = small_cogvideox(), small_cogvideox()
    real = F.scaled_dot_product_attention
    with AttentionPatch([("transformer", a)], "fp8_emu") as patch:
        assert F.scaled_dot_product_attention is real
        base_b = run(b, cog_inputs())
        run(a, cog_inputs())
    assert sum(patch.stats.calls.values()) == 2  # only model a's calls
    assert torch.equal(base_b, run(b, cog_inputs()))


def test_two_transformers_both_patched_and_counted_separately():
    t1, t2 = small_wan(), small_wan()
    seen = []
    with AttentionPatch([("transformer", t1), ("transformer_2", t2)], "sagev1_emu",
                        observers=[lambda info: seen.append(info.model)]) as patch:
        run(t1, wan_inputs())
        run(t2, wan_inputs())
    assert patch.stats.calls["emu.sagev1"] == 8
    assert seen.count("transformer") == 4 and seen.count("transformer_2") == 4


def test_i2v_image_cross_attention_is_labelled():
    model = small_wan(image=True)
    kinds = []
    with AttentionPatch([("transformer", model)], "reference",
                        observers=[lambda info: kinds.append((info.layer, info.kind, info.key.shape[2]))]):
        run(model, wan_inputs(image=True))
    cross = [k for k in kinds if k[1] != "self"]
    assert [k[1] for k in cross] == ["cross_img", "cross", "cross_img", "cross"]
    assert [k[2] for k in cross] == [257, 512, 257, 512]  # image context, then text context


def test_observer_sees_bhsd_tensors_and_call_metadata():
    model = small_wan()
    infos = []
    with AttentionPatch([("transformer", model)], "sdpa_math", observers=[infos.append]) as patch:
        patch.step = 7
        run(model, wan_inputs())
    first = infos[0]
    assert first.layer == "blocks.0.attn1" and first.kind == "self" and first.step == 7 and first.index == 0
    assert first.query.shape == (1, 2, 48, 16) and first.output.shape == (1, 2, 48, 16)
    assert first.args == {"scale": None, "is_causal": False, "dropout_p": 0.0, "has_mask": False}
    assert [i.index for i in infos] == [0, 1, 2, 3]


def test_unsupported_call_is_refused_with_location():
    model = small_wan()
    attn = model.blocks[0].attn1
    h = torch.randn(1, 48, 32)
    mask = torch.ones(1, 1, 48, 48, dtype=torch.bool)
    with AttentionPatch([("transformer", model)], "sagev1_emu"):
        with pytest.raises(B.UnsupportedCall, match=r"attention mask.*blocks\.0\.attn1 \(self-attention\).*fallback:sdpa"):
            attn(h, attention_mask=mask)


def test_explicit_fallback_is_counted():
    model = small_wan()
    attn = model.blocks[0].attn1
    h = torch.randn(1, 48, 32)
    mask = torch.ones(1, 1, 48, 48, dtype=torch.bool)
    with AttentionPatch([("transformer", model)], "sagev1_emu", on_unsupported="fallback:sdpa") as patch:
        with torch.no_grad():
            attn(h, attention_mask=mask)
    assert patch.stats.fallbacks == 1 and patch.stats.calls == {"fallback:sdpa": 1}


def test_time_attention_on_cpu():
    model = small_wan()
    with AttentionPatch([("transformer", model)], "reference", time_attention=True) as patch:
        run(model, wan_inputs())
    t = patch.finish_timing()
    assert t is not None and t > 0 and patch.stats.as_dict()["attention_time_s"] == t


def test_ring_path_resolves_the_lse_form_once_per_patch(monkeypatch):
    """The log-sum-exp form is looked up once (the first ring call), not on every attention call; a backend
    without one is refused at the call with its reason."""
    looked_up = []
    lse_form = B.Backend.lse_form
    monkeypatch.setattr(B.Backend, "lse_form", lambda self, device=None: looked_up.append(device) or
                        lse_form(self, device))
    patch = AttentionPatch([("transformer", small_cogvideox())], "sdpa")
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))  # BSHD, as diffusers' context-parallel templates pass
    for _ in range(3):
        out, lse = DispatcherAdapter(patch).cp_forward_op(None, q, k, v, return_lse=True)
    assert len(looked_up) == 1 and out.shape == q.shape and lse.shape == (1, 8, 2)
    assert dict(patch.stats.calls) == {"sdpa[flash][lse]": 3}
    with pytest.raises(B.UnsupportedCall, match="ring attention needs the log-sum-exp: torch's math kernel"):
        DispatcherAdapter(AttentionPatch([("transformer", small_cogvideox())], "sdpa_math")).cp_forward_op(
            None, q, k, v, return_lse=True)


def test_bad_options_and_double_install():
    model = small_wan()
    with pytest.raises(ValueError, match="on_unsupported"):
        AttentionPatch([("transformer", model)], "sdpa", on_unsupported="ignore")
    with pytest.raises(B.BackendUnavailable, match="unknown attention backend 'nope'"):
        AttentionPatch([("transformer", model)], "nope")
    p = AttentionPatch([("transformer", model)], "sdpa")
    with p:
        with pytest.raises(RuntimeError, match="already installed"):
            p.install()
    with pytest.raises(RuntimeError, match="no attention processors"):
        AttentionPatch([("mlp", torch.nn.Linear(2, 2))], "sdpa").install()


def test_call_kind_joint_self_cross():
    """CogVideoX hands its text as encoder_hidden_states but attends jointly (its Attention says
    is_cross_attention=False); under xfuser that decides the path (joint -> USP, cross -> local)."""
    from types import SimpleNamespace

    from vdbench.patching.calls import call_kind

    ehs = torch.zeros(1)
    assert call_kind("sdpa", SimpleNamespace(), ehs) == "joint"  # stock CogVideoX processor
    assert call_kind("xfuser", SimpleNamespace(is_cross_attention=False), ehs) == "joint"  # xfuser's CogVideoX
    assert call_kind("xfuser", SimpleNamespace(is_cross_attention=True), ehs) == "cross"  # Wan attn2
    assert call_kind("dispatcher", SimpleNamespace(is_cross_attention=False), None) == "self"  # Wan attn1
    assert call_kind("dispatcher", SimpleNamespace(), ehs) == "cross"  # unknown: cross when given a context
    from vdbench.pipelines import load_pipeline

    pipe = load_pipeline("tiny:cogvideox-t2v", "t2v", "cogvideox", dtype=torch.float32, device="cpu")
    attn = pipe.transformer.transformer_blocks[0].attn1
    assert attn.is_cross_attention is False  # what the rule reads, on the real class


def test_each_processor_is_served_by_the_adapter_of_its_route():
    """The route is read from the processor's code: dispatcher (Wan), F.sdpa (CogVideoX), xfuser's registry."""
    from vdbench.patching.core import adapter_for

    class XfuserShaped:  # xFuserWanAttnProcessor calls self.attention_function (USP, xfuser's registry)
        def __call__(self, attn, hidden_states):
            return self.attention_function(hidden_states)

    class Unknown:
        def __call__(self, attn, hidden_states):
            return hidden_states

    wan = small_wan().blocks[0].attn1.processor
    cog = small_cogvideox().transformer_blocks[0].attn1.processor
    assert [adapter_for(p).mode for p in (wan, cog, XfuserShaped())] == ["dispatcher", "sdpa", "xfuser"]
    with pytest.raises(TypeError, match="don't know how attention processor Unknown calls attention"):
        adapter_for(Unknown())


def test_targets_read_device_dtype_and_head_dim_from_the_model():
    """Where availability is checked at install: accelerate's offload hook names the execution device (the weights
    wait on the CPU), diffusers' dtype skips the fp32-kept modules, the head dim is the config's."""
    from types import SimpleNamespace

    from vdbench.patching.targets import target_of

    model = small_wan().to(torch.bfloat16)
    model.condition_embedder.time_embedder.float()  # one of Wan's _keep_in_fp32_modules, as from_pretrained does
    t = target_of("transformer", model)
    assert (t.device, t.dtype, t.head_dim) == (torch.device("cpu"), torch.bfloat16, 16)
    assert str(t) == "transformer (cpu, bfloat16, head dim 16)"
    model._hf_hook = SimpleNamespace(execution_device=torch.device("cuda", 0))  # enable_model_cpu_offload's hook
    assert target_of("transformer", model).device == torch.device("cuda", 0)
    bare = target_of("mlp", torch.nn.Linear(2, 2))
    assert (bare.device, bare.dtype, bare.head_dim) == (torch.device("cpu"), torch.float32, None)
