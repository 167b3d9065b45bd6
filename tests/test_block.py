"""A Wan block's norms, modulations and gated residuals as Triton kernels (vdbench.kernels.block; Triton's interpreter
on CPU): diffusers' eager values bit for bit, for a temb per sample and per token, the norms from torch's statistics;
the family's block forward on diffusers' WanTransformerBlock gives diffusers' output bit for bit, under the hooks
diffusers wraps blocks in too, its norms fused only where the first call's check found torch's statistics of the bf16
hidden state equal to those of its fp32 copy; and a tiny render with --fused_block on gives the frames and latents of
--fused_block off, on one process, under Ulysses-2 and under the CFG split (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import triton_interpreter
from tests.test_patching import run, small_cogvideox, small_wan, wan_inputs
from vdbench import families
from vdbench.families import wan as W
from vdbench.patching import AttentionPatch

WAN = families.get("wan")


@pytest.fixture(scope="module")
def kernels():
    with triton_interpreter("vdbench.kernels.block", "vdbench.kernels.attention") as (block, _):
        yield block


def diffusers_chunks(table, temb):
    """The six chunks as diffusers' WanTransformerBlock.forward computes them (``table``: scale_shift_table)."""
    if temb.ndim == 4:
        return [c.squeeze(2) for c in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return list((table + temb.float()).chunk(6, dim=1))


def _inputs(b, s, d, dtype, form, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, d, generator=g) * 4).to(dtype)
    y = (torch.randn(b, s, d, generator=g) * 4).to(dtype)
    table = torch.randn(1, 6, d, generator=g) / d ** 0.5
    lead = {"3d": (b,), "4d": (b, s), "4d_b1": (1, s), "2d": ()}[form]
    temb = torch.randn(*lead, 6, d, generator=g).to(dtype)
    return x, y, table, temb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form,shape", [("3d", (2, 19, 72)), ("4d", (2, 13, 40)), ("4d_b1", (2, 7, 33)),
                                        ("2d", (1, 37, 24))])
def test_each_kernel_gives_diffusers_values_bit_for_bit(kernels, dtype, form, shape):
    x, y, table, temb = _inputs(*shape, dtype, form)
    norm = torch.nn.functional.layer_norm(x.float(), shape[-1:])
    c = diffusers_chunks(table, temb)
    for shift, scale in ((0, 1), (3, 4)):
        want = (norm * (1 + c[scale]) + c[shift]).type_as(x)
        poisoned = torch.full_like(x, float("nan"))
        got = kernels.modulate(norm, table[0], temb, shift, scale, dtype, out=poisoned)
        assert got is poisoned and torch.equal(got, want)
        assert torch.equal(W.modulation(norm, table[0], temb, shift, scale, x), want)  # the family's eager form
    for gate, want, eager in ((2, (x.float() + y * c[2]).type_as(x), W.attention_residual),
                              (5, (x.float() + y.float() * c[5]).type_as(x), W.ffn_residual)):
        got = kernels.gated_residual(x, y, table[0], temb, gate, out=torch.full_like(x, float("nan")))
        assert torch.equal(got, want)
        assert torch.equal(eager(x, y, table[0], temb, gate), want)


def _fp32_layer_norm(d, affine, seed=3):
    """diffusers' FP32LayerNorm (eps 1e-6, Wan's), its weight and bias random where it has them (a trained norm2's)."""
    from diffusers.models.normalization import FP32LayerNorm

    norm = FP32LayerNorm(d, 1e-6, elementwise_affine=affine)
    if affine:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(d, generator=g) * 2)
            norm.bias.copy_(torch.randn(d, generator=g))
    return norm


def _cpu_stats(x, norm):
    """The statistics torch's CPU layer norm computes for ``x``'s fp32 copy, as the kernels take them (one a row)."""
    _, mean, rstd = torch.native_layer_norm(x.float(), x.shape[-1:], norm.weight, norm.bias, norm.eps)
    return mean.reshape(-1), rstd.reshape(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form,shape", [("3d", (2, 19, 72)), ("4d", (2, 13, 40)), ("2d", (1, 37, 33)),
                                        ("3d", (1, 8, 1536))])
def test_the_norm_kernels_give_diffusers_values_bit_for_bit(kernels, dtype, form, shape):
    """norm1 / norm3 and their modulation, norm2 and its cast, from the statistics torch's CPU layer norm computes
    for the fp32 copy (the values it normalizes with): diffusers' FP32LayerNorm and expressions bit for bit."""
    x, _, table, temb = _inputs(*shape, dtype, form)
    c = diffusers_chunks(table, temb)
    plain, affine = _fp32_layer_norm(shape[-1], False), _fp32_layer_norm(shape[-1], True)
    mean, rstd = _cpu_stats(x, plain)
    for shift, scale in ((0, 1), (3, 4)):
        want = (plain(x.float()) * (1 + c[scale]) + c[shift]).type_as(x)
        got = kernels.norm_modulate(x, mean, rstd, table[0], temb, shift, scale, out=torch.full_like(x, float("nan")))
        assert torch.equal(got, want)
        assert torch.equal(W.EagerBlockOps.norm_modulate(x, plain, W.layer_norm_of(plain), table[0], temb, shift,
                                                         scale, W.modulation), want)
    with torch.no_grad():
        want = affine(x.float()).type_as(x)
        got = kernels.norm_affine(x, mean, rstd, affine.weight, affine.bias, out=torch.full_like(x, float("nan")))
    assert torch.equal(got, want) and torch.equal(_cpu_stats(x, affine)[1], rstd)


def test_an_affine_norm_is_one_fused_multiply_add_as_torch_computes_it(kernels):
    """fp32 in and out (no bf16 rounding to hide a last bit): torch's CPU layer norm's ``weight * n + bias`` is one
    fused multiply-add, what the kernel computes by default; the two-rounding form differs."""
    x, *_ = _inputs(2, 16, 1536, torch.float32, "3d")
    norm = _fp32_layer_norm(1536, True)
    mean, rstd = _cpu_stats(x, norm)
    with torch.no_grad():
        want = norm(x)
        assert torch.equal(kernels.norm_affine(x, mean, rstd, norm.weight, norm.bias), want)
        assert not torch.equal(kernels.norm_affine(x, mean, rstd, norm.weight, norm.bias, fma=False), want)


def test_the_norm_kernels_say_what_they_cannot_take(kernels):
    x, _, table, temb = _inputs(1, 8, 16, torch.bfloat16, "3d")
    mean, rstd = torch.zeros(8), torch.ones(8)
    w = torch.ones(16)
    assert kernels.why_not_normed(x, mean, rstd, w, w) is None and kernels.why_not_normed(x, None, None) is None
    assert kernels.why_not_normed(x, mean.bfloat16(), rstd) == "layer norm statistics in torch.bfloat16 (the kernels " \
                                                                 "take fp32)"
    assert "statistics of (4,)" in kernels.why_not_normed(x, mean[:4], rstd)
    assert kernels.why_not_normed(x, mean, rstd, w, None) == "a layer norm without both a weight and a bias"
    assert "(B, S, D), (D,)" in kernels.why_not_normed(x, mean, rstd, w[:8], w)
    with pytest.raises(ValueError, match="norm_affine: layer norm statistics in torch.bfloat16"):
        kernels.norm_affine(x, mean.bfloat16(), rstd, w, w)
    with pytest.raises(ValueError, match="norm_modulate: chunks \\(7, 1\\)"):
        kernels.norm_modulate(x, mean, rstd, table[0], temb, 7, 1)
    # torch's CUDA layer norm vectorizes rows of a multiple of 4 from pointers aligned to 4 elements
    assert kernels.layer_norm_paths(x) == "vectorized/vectorized"
    shifted = torch.cat([x.new_zeros(2), x.flatten()])[2:].view(1, 8, 16)  # contiguous, 4 bytes past an alignment
    assert kernels.layer_norm_paths(shifted) == "rowwise/vectorized"
    assert kernels.layer_norm_paths(shifted[:, ::2]) == "vectorized/vectorized"  # copied first: aligned
    assert kernels.layer_norm_paths(x[..., :15]) == "rowwise/rowwise"
    assert kernels.layer_norm_paths(x, torch.ones(17)[1:], w) == "vectorized/rowwise"
    # what torch's layer norm on a CPU gives for a bf16 input: statistics in bf16 (not its fp32 copy's)
    assert kernels.layer_norm_stats(x, 1e-6)[0].dtype == torch.bfloat16


def test_fp32_and_a_table_in_the_models_dtype(kernels):
    x, y, table, temb = _inputs(1, 9, 48, torch.float32, "3d")
    c = diffusers_chunks(table, temb)
    norm = torch.nn.functional.layer_norm(x, (48,))
    assert torch.equal(kernels.modulate(norm, table[0], temb, 0, 1, torch.float32), norm * (1 + c[1]) + c[0])
    xb, yb, tb = x.bfloat16(), y.bfloat16(), table.bfloat16()  # a table cast with the model: promoted exactly
    cb = diffusers_chunks(tb, temb.bfloat16())
    assert torch.equal(kernels.gated_residual(xb, yb, tb[0], temb.bfloat16(), 2), (xb.float() + yb * cb[2]).type_as(xb))


def test_the_kernels_say_which_calls_they_cannot_serve(kernels):
    x, y, table, temb = _inputs(1, 8, 16, torch.bfloat16, "3d")
    assert kernels.why_not_fused(x, table[0], temb, y) is None
    assert "torch.float64" in kernels.why_not_fused(x.double(), table[0], temb)
    assert "shapes" in kernels.why_not_fused(x, table[0], temb, y[:, :4])
    assert "table (6, 8)" in kernels.why_not_fused(x, table[0, :, :8], temb)
    assert "temb (1, 3, 6, 16)" in kernels.why_not_fused(x, table[0], torch.zeros(1, 3, 6, 16))
    assert kernels.why_not_fused(x.transpose(1, 2).contiguous().transpose(1, 2), table[0], temb) == (
        "channels not contiguous")
    with pytest.raises(ValueError, match="gated_residual: chunks \\(7,\\) of a table of 6"):
        kernels.gated_residual(x, y, table[0], temb, 7)


def _bf16_wan(layers=1):
    """A tiny WanTransformer3DModel with head dim 64 (the project's attention kernels' smallest), cast as
    from_pretrained casts a bf16 Wan (its modulation tables, norms and time embedder kept in fp32)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
                                  out_channels=4, text_dim=24, freq_dim=32, ffn_dim=256, num_layers=layers).eval()
    keep = set(model._keep_in_fp32_modules)
    for name, p in model.named_parameters():
        if not keep & set(name.split(".")):
            p.data = p.data.bfloat16()
    return model


def _bf16_inputs(per_token=False):
    inputs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in wan_inputs().items()}
    if per_token:  # Wan 2.2 TI2V's form: a timestep per token, so a temb (B, S, 6, D)
        inputs["timestep"] = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(2))
    return inputs


@pytest.mark.parametrize("per_token", [False, True])
def test_the_fused_block_forward_gives_diffusers_block_bit_for_bit(kernels, per_token):
    """One block of a bf16 Wan, its temb per sample (Wan 2.1) or per token (Wan 2.2 TI2V)."""
    model, inputs = _bf16_wan(), _bf16_inputs(per_token)
    plain = run(model, inputs)
    with AttentionPatch([("transformer", model)], "sdpa", fused_block=True) as patch:
        fused = run(model, inputs)  # sdpa: torch's own attention, as diffusers' processor calls it
    assert torch.equal(fused, plain)
    # torch's CPU layer norm of a bf16 tensor computes its statistics in bf16: the first call of each norm's form
    # finds them unlike the fp32 copy's, and every norm runs as diffusers' (then the modulation kernel)
    why = "layer norm statistics differ between bfloat16 and fp32 inputs here (torch's of the former in bfloat16)"
    block = patch.stats.as_dict()["block"]
    assert {k: v for k, v in block.items() if k != "norm_checks"} == {
        "modulate": {"fused_calls": 2, "eager_calls": 0}, "residual": {"fused_calls": 2, "eager_calls": 0},
        "norm_modulate": {"fused_calls": 0, "eager_calls": 2}, "norm": {"fused_calls": 0, "eager_calls": 1},
        "eager_why": None, "norm_eager_why": why}
    assert [(c["pass"], c["fused"], c["why"], c["torch_paths"]) for c in block["norm_checks"]] == [
        ("norm_modulate", False, why, "vectorized/vectorized"), ("norm", False, why, "vectorized/vectorized")]
    assert "forward" not in model.blocks[0].__dict__ and torch.equal(run(model, inputs), plain)  # removal restores


def _stats_of_the_fp32_copy(x, eps):
    """torch's statistics of ``x``'s fp32 copy: what torch's CUDA layer norm computes for the bf16 ``x`` itself where
    both calls vectorize (vdbench.kernels.block), standing in for it on a CPU."""
    _, mean, rstd = torch.native_layer_norm(x.float(), x.shape[-1:], None, None, eps)
    return mean.reshape(-1), rstd.reshape(-1)


def _trained_norm2(model):
    for i, block in enumerate(model.blocks):  # a trained cross-attention norm's weight and bias, not 1 and 0
        block.norm2 = _fp32_layer_norm(block.norm2.normalized_shape[0], True, seed=10 + i)
    return model


@pytest.mark.parametrize("per_token", [False, True])
def test_where_the_statistics_agree_the_norms_run_fused_after_one_check_per_form(kernels, monkeypatch, per_token):
    """Two blocks, two forwards: the first call of each norm's form (norm1/norm3 with their modulation; norm2 and
    its cast) runs diffusers' norm and checks the fused one against it on the real data; every later call runs the
    kernel; each forward's output is diffusers' bit for bit."""
    monkeypatch.setattr(kernels, "layer_norm_stats", _stats_of_the_fp32_copy)
    model, inputs = _trained_norm2(_bf16_wan(layers=2)), _bf16_inputs(per_token)
    plain = run(model, inputs)
    with AttentionPatch([("transformer", model)], "sdpa", fused_block=True) as patch:
        assert torch.equal(run(model, inputs), plain) and torch.equal(run(model, inputs), plain)
    block = patch.stats.as_dict()["block"]
    assert block["norm_modulate"] == {"fused_calls": 7, "eager_calls": 1}  # 2 blocks x 2 norms x 2 forwards
    assert block["norm"] == {"fused_calls": 3, "eager_calls": 1}
    assert block["modulate"] == {"fused_calls": 1, "eager_calls": 0}  # the check's, after diffusers' norm
    assert block["norm_eager_why"] is None
    assert [(c["pass"], c["shape"], c["dtype"], c["fused"], c["fma"], c["why"]) for c in block["norm_checks"]] == [
        ("norm_modulate", [1, 48, 128], "bfloat16", True, None, None),
        ("norm", [1, 48, 128], "bfloat16", True, True, None)]  # torch's affine: one fused multiply-add


@pytest.mark.parametrize("fault", ["statistics", "values"])
def test_a_form_whose_check_differs_runs_diffusers_norm_and_says_why(kernels, monkeypatch, fault):
    """Statistics one ulp off (another reduction order), or a normalization that is not torch's: the check refuses
    the form; every call runs diffusers' norm, the output is diffusers'."""
    if fault == "statistics":
        def stats(x, eps):
            mean, rstd = _stats_of_the_fp32_copy(x, eps)
            return mean, torch.nextafter(rstd, torch.full_like(rstd, 2.0))

        monkeypatch.setattr(kernels, "layer_norm_stats", stats)
        why = "layer norm statistics differ between bfloat16 and fp32 inputs here"
    else:
        monkeypatch.setattr(kernels, "layer_norm_stats", _stats_of_the_fp32_copy)
        for name in ("norm_modulate", "norm_affine"):
            fused = getattr(kernels, name)
            monkeypatch.setattr(kernels, name, lambda *a, _f=fused, **k: _f(*a, **k) * 1.0078125)
        why = "the normalized values from torch's statistics differ from torch's layer norm here"
    model, inputs = _trained_norm2(_bf16_wan(layers=2)), _bf16_inputs()
    plain = run(model, inputs)
    with AttentionPatch([("transformer", model)], "sdpa", fused_block=True) as patch:
        assert torch.equal(run(model, inputs), plain)
    block = patch.stats.as_dict()["block"]
    assert block["norm_modulate"] == {"fused_calls": 0, "eager_calls": 4} and block["norm_eager_why"] == why
    assert block["norm"] == {"fused_calls": 0, "eager_calls": 2} and block["modulate"]["fused_calls"] == 4
    assert [(c["pass"], c["fused"], c["why"]) for c in block["norm_checks"]] == [("norm_modulate", False, why),
                                                                               ("norm", False, why)]


def test_with_the_projects_triton_attention_too(kernels):
    """The project's fav2_triton attention kernel (under the interpreter) in both: diffusers' block forward against
    the family's, bit for bit."""
    model, inputs = _bf16_wan(), _bf16_inputs()
    with AttentionPatch([("transformer", model)], "fav2_triton"):
        want = run(model, inputs)
    with AttentionPatch([("transformer", model)], "fav2_triton", fused_block=True) as patch:
        assert torch.equal(run(model, inputs), want)
    assert dict(patch.stats.calls) == {"vdbench.fav2_triton": 2} and patch.stats.block["residual", "fused"] == 2


def test_under_diffusers_hooks_the_blocks_own_forward_is_replaced_and_put_back(kernels):
    from diffusers.hooks import HookRegistry, ModelHook

    seen = []

    class Pre(ModelHook):  # a hook around the call (diffusers' context-parallel split is one)
        def pre_forward(self, module, *args, **kwargs):
            seen.append("pre")
            return args, kwargs

    class Around(ModelHook):  # a hook that replaces the call and calls the block's forward itself (a step cache's)
        def new_forward(self, module, *args, **kwargs):
            seen.append("around")
            return self.fn_ref.original_forward(*args, **kwargs)

    model, inputs = _bf16_wan(), _bf16_inputs()
    block = model.blocks[0]
    with torch.no_grad():
        plain = run(model, inputs)
        registry = HookRegistry.check_if_exists_or_initialize(block)
        registry.register_hook(Pre(), "pre")
        registry.register_hook(Around(), "around")
        wrapped = block.forward
        with AttentionPatch([("transformer", model)], "sdpa", fused_block=True) as patch:
            assert torch.equal(run(model, inputs), plain)
        assert seen == ["around", "pre"] and patch.stats.block["modulate", "fused"] == 2
        assert block.forward is wrapped and torch.equal(run(model, inputs), plain)
        registry.remove_hook("around")
        registry.remove_hook("pre")
    assert block.forward.__func__ is type(block).forward  # diffusers' removal reached the block's own method


def test_the_library_form_counts_and_refuses_a_family_without_a_block_forward(kernels):
    import vdbench

    model, inputs = small_wan(), wan_inputs()
    plain = run(model, inputs)
    with vdbench.use_backend(model, "sdpa", fused_block=True) as patch:
        assert torch.equal(run(model, inputs), plain)
    assert patch.stats.block["residual", "fused"] == 4  # two blocks, two residuals each
    with pytest.raises(ValueError, match="'cogvideox' has no block forward of its own"):
        with vdbench.use_backend(small_cogvideox(), "sdpa", fused_block=True):
            pass


def test_a_call_the_kernels_cannot_serve_runs_the_eager_expressions_counted(kernels):
    """float64 (no attention backend takes it, so the block forward is installed alone): diffusers' values by the
    family's eager expressions, every call counted eager, with why."""
    from types import SimpleNamespace

    from vdbench.patching.blocks import BlockForwards
    from vdbench.patching.calls import PatchStats

    model = small_wan().double()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in wan_inputs().items()}
    plain = run(model, inputs)
    ops = BlockForwards(SimpleNamespace(stats=PatchStats("none")), WAN)
    assert ops.install([("transformer", model)]) == 2
    try:
        assert torch.equal(run(model, inputs), plain)
    finally:
        ops.remove()
    block = ops.patch.stats.as_dict()["block"]
    assert block["modulate"] == {"fused_calls": 0, "eager_calls": 4} == block["residual"]
    assert "torch.float64" in block["eager_why"]


def test_the_choice_auto_on_off(kernels, monkeypatch):
    from vdbench.kernels import fused_block_choice

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_block_choice(None, cpu, WAN) == "a cpu device (the kernel runs on CUDA)"
    assert fused_block_choice(None, cuda, WAN, compiled=True) == (
        "compiled blocks (inductor fuses the block's elementwise passes itself)")
    assert fused_block_choice(False, cuda, WAN) == "off (--fused_block off)"
    assert fused_block_choice(None, cuda, families.get("cogvideox")) == (
        "the model family runs diffusers' own block forward")
    with pytest.raises(ValueError, match="--fused_block on: not here: needs a CUDA/HIP GPU; on CPU only under "
                                         "Triton's interpreter"):
        fused_block_choice(True, cpu, WAN)

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a CPU test (the module imported interpreted): on runs the kernels
    assert fused_block_choice(True, cpu, WAN) is None


def test_the_block_prewarm_compiles_the_render_shapes_on_a_thread(monkeypatch):
    import importlib

    from vdbench.render.prewarm import block_prewarm

    seen = []
    monkeypatch.setattr(importlib.import_module("vdbench.kernels.block"), "prewarm",
                        lambda tokens, dim, dtype, device: seen.append((tokens, dim, dtype)) or 2)
    pw = block_prewarm([(16380, 1536)], torch.device("cuda"), torch.bfloat16)
    pw.wait()
    rec = pw.as_dict()
    assert seen == [(16380, 1536, torch.bfloat16)] and rec["status"] == "done" and rec["compiled"] == 2
    assert rec["forms"] == [[16380, 1536]] and rec["waited_s"] >= 0


def test_the_bench_compares_each_kernel_with_its_eager_form(kernels, tmp_path):
    from vdbench.fused_bench import block as block_bench

    out = tmp_path / "block.json"
    assert block_bench.main(["--shapes", "tiny", "--budget_s", "0.05", "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    passes = ("modulate", "residual", "residual_ffn", "norm_modulate", "norm")
    assert [(r["pass"], r["form"]) for r in d["rows"]] == [(p, f) for p in passes for f in ("eager", "fused")]
    assert [r["bit_identical"] for r in d["rows"]] == [None, True] * 5 and d["speed_figure"] is False
    assert d["rows"][0]["calls_per_step"] == 2 * 2 * 2  # two per block, two blocks, two guidance branches
    # the norms: 20 bytes an element each (the fp32 copy, torch's norm of it, the modulation or the cast) against 8
    assert d["norm_saved_bytes"] == {"tiny": (2 * 2 + 1 * 2) * 2 * (20 - 8) * 48 * 64}
    assert set(d["norm_saved_ms"]) == set(d["per_step_saved_ms"]) == {"tiny"}
    probes = d["probes"]["tiny"]  # a CPU: torch's statistics of a bf16 tensor are bf16, its affine one fma
    assert probes["stats_dtype"] == "bfloat16" and probes["bf16_stats_equal"] is False
    assert probes["norm_from_stats_equal"] and probes["affine_fma"] and not probes["affine_two_roundings"]
    assert probes["paths"] == "vectorized/vectorized" and probes["fused_norm_stats"].startswith("the fp32 copy's")


def test_the_unfused_block_names_its_stack_and_the_fused_default_names_nothing(capsys, tmp_path):
    """``--fused_block off`` renders the same frames more slowly: its stack (and so its output name, its record's
    identity, the sweep's row) says ``eagerblock``; auto and on, the default wherever it runs, add nothing."""
    import run_wan
    from vdbench import cli
    from vdbench import sweep as S
    from vdbench.measure import record as M
    from vdbench.video import identity_from_filename

    assert M.speed_options(fused_block=False) == ("eagerblock",) and M.speed_options(fused_block=True) == ()
    assert M.stack_name("fav3", M.settings_speed_options({"fused_block": False}), layout="u2") == "fav3+eagerblock+u2"
    cand = S.parse_stack("fav3+eagerblock")
    assert cand.name == "fav3+eagerblock" and cand.flags == ["--fused_block", "off"]
    small = ["--model", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps", "2",
             "--attention_type", "sdpa", "--output_dir", str(tmp_path), "--print_output_path"]
    for flags in (["--fused_block", "off"], ["--fused_block", "on"], []):
        assert run_wan.main(small + flags) == 0
    names = [Path(p) for p in capsys.readouterr().out.split()]
    assert [p.name for p in names] == ["wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96_eagerblock.mp4",
                                       *["wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96.mp4"] * 2]
    assert identity_from_filename(names[0]).label == "sdpa+eagerblock"
    rec = M.Record(suite="render", case="sdpa", config={"backend": {"name": "sdpa"},
                                                        "settings": {"attention_type": "sdpa", "fused_block": False}})
    assert M.identity(rec).stack == "sdpa+eagerblock"
    wan = families.get("wan")
    args = cli.build_parser(wan).parse_args(small + ["--fused_block", "off"])
    assert cli.config_from_args(wan, args).fused_block is False


# ----- renders: on against off, one process, Ulysses-2, the CFG split -----

ARGS = ["--model", "tiny", "--task", "ti2v", "--height", "64", "--width", "96", "--num_frames", "9",
        "--num_inference_steps", "2", "--attention_type", "sdpa", "--save_frames", "--save_latents", "--dtype", "bf16"]


@pytest.mark.slow  # four tiny renders, two of them two processes (gloo): ~20 s
def test_a_render_with_the_fused_block_has_the_frames_of_one_without(kernels, tmp_path):
    """Wan 2.2 TI2V's tiny model in bf16: its temb is per token (4-D), so under Ulysses each rank's blocks modulate
    its shard of the sequence with its shard's rows; under the CFG split each rank computes one branch."""
    from tests import launch
    from vdbench.capture import load_latents

    runs = {"off": (["--fused_block", "off"], 1), "on": (["--fused_block", "on"], 1),
            "u2": (["--fused_block", "on", "--ulysses_degree", "2"], 2),
            "cfg2": (["--fused_block", "on", "--use_cfg_parallel"], 2)}
    for name, (flags, n) in runs.items():
        proc = launch.render("wan", [*ARGS, *flags, "--benchmark_output_directory", str(tmp_path / name)],
                             tmp_path / f"{name}.logs", nproc=n, TRITON_INTERPRET="1")
        assert proc.returncode == 0, proc.stderr[-3000:]

    def frames(name):
        return np.load(next((tmp_path / name / "results").glob("*.npy")))

    def latents(name):
        return load_latents(sorted((tmp_path / name / "captures").glob("latents_*rank0_*.pt"))[-1])[0]

    assert frames("off").std() > 1.0
    for name, (_, n) in runs.items():
        assert np.array_equal(frames(name), frames("off")) and torch.equal(latents(name), latents("off")), name
        e = json.loads((tmp_path / name / "results" / "timing.json").read_text())[-1]
        calls = e["attention"]["block"]
        if name == "off":
            off = "off (--fused_block off)"
            assert e["fused_block"] == {"setting": "off", "used": False, "why_not": off,
                                        "norms": {"used": False, "why_not": off, "checks": []}}
            assert calls["modulate"] == {"fused_calls": 0, "eager_calls": 0}
            continue
        norms = e["fused_block"].pop("norms")
        assert e["fused_block"] == {"setting": "on", "used": True, "why_not": None}, name
        # a CPU's layer norm of a bf16 tensor has bf16 statistics: each rank's one check refuses the fused norms
        assert not norms["used"] and norms["why_not"].startswith("layer norm statistics differ between bfloat16")
        assert [c["pass"] for c in norms["checks"]] == ["norm_modulate", "norm"], (name, norms)
        # 2 blocks x 2 steps x the guidance branches this rank computes (both; one under the CFG split)
        want = 2 * 2 * (1 if name == "cfg2" else 2) * 2
        assert calls["modulate"] == {"fused_calls": want, "eager_calls": 0} == calls["residual"], (name, calls)
