"""FlashAttention-4 (``fav4``), FlashInfer prefill (``flashinfer``) and NATTEN (``natten``) on a CPU, with stand-in
packages (tests/fake_packages.py) that have each package's API and layout and compute exact float64 attention with
torch's own sdpa: what each wrapper hands its package (layout, arguments), that the result is exact attention (a
transposed axis would not be), the LSE forms' base and layout, the call counted under the kernel label through the
patching core, the install hint when the package is absent, and what each entry refuses.

Why stand-ins: none of the three runs on a CPU (FA4 and FlashInfer compile CUDA kernels, natten builds CUDA
extensions from source); the conversions around them are ours and are checked here.
"""

import dataclasses
import importlib.util
import math
import sys

import pytest
import torch

from vdbench import backends as B
from vdbench.backends import registry
from vdbench.patching import AttentionPatch
from vdbench.sparse import TokenGrid

from tests import fake_packages as F
from tests.attention_data import qkv, rel_l2
from tests.test_patching import cog_inputs, run, small_cogvideox, small_wan, wan_inputs

PACKAGES = {"fav4": "flash_attn", "flashinfer": "flashinfer", "natten": "natten"}
HINTS = {"fav4": "pip install flash-attn-4 --pre", "flashinfer": "pip install flashinfer-python flashinfer-cubin",
         "natten": "pip install natten"}


@pytest.fixture
def fa4(tmp_path, monkeypatch):
    F.install_fa4(tmp_path, monkeypatch)
    import flash_attn.cute.interface as mod

    yield mod
    F.forget("flash_attn")


@pytest.fixture
def flashinfer(tmp_path, monkeypatch):
    F.install_flashinfer(tmp_path, monkeypatch)
    import flashinfer as mod

    yield mod
    F.forget("flashinfer")


@pytest.fixture
def natten(tmp_path, monkeypatch):
    F.install_natten(tmp_path, monkeypatch)
    import natten as mod

    yield mod
    F.forget("natten")


def _exact(q, k, v, scale=None, is_causal=False):
    return F.exact64(q, k, v, scale=scale, is_causal=is_causal)


def _on_cpu(name):
    """The entry with its device, dtype and head-dim checks lifted: the CPU and the tiny fp32 models can't meet them,
    and what is tested here is the wrapper and the patching core's routing, not the checks."""
    return dataclasses.replace(B.resolve(name), constraints=(), dtypes=B.ANY_FLOAT, head_dims=None, max_head_dim=None)


# ----- absent package: the reason and the install hint -----

def _hide(monkeypatch, top: str):
    """The package ``top`` absent from this test's view, whether or not it is installed (the GPU machine may carry
    the real one)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.split(".")[0] == top else real(n, *a))


@pytest.mark.parametrize("name", list(PACKAGES))
def test_an_absent_package_is_refused_with_its_install_hint(name, monkeypatch):
    _hide(monkeypatch, PACKAGES[name].split(".")[0])
    assert importlib.util.find_spec(PACKAGES[name]) is None
    ok, reason = B.availability(name, "cpu", torch.bfloat16, 64)
    assert not ok and "package not installed" in reason and HINTS[name] in reason
    with pytest.raises(B.BackendUnavailable, match=f"'{name}' can't run here: package not installed"):
        B.resolve(name).require("cpu", torch.bfloat16, [64])
    assert HINTS[name] in B.resolve(name).install_hint


def test_fa4_is_found_without_importing_the_flash_attn_package(tmp_path, monkeypatch):
    """FA4's flash_attn.cute shares flash_attn with FA2, whose __init__ loads FA2's extension: the availability check
    finds the subpackage without importing its parent (which here fails, as FA2 without its extension does)."""
    with monkeypatch.context() as m:
        _hide(m, "flash_attn")
        assert not registry._findable("flash_attn.cute")  # absent parent: no ModuleNotFoundError, just not found
    F.install_fa4(tmp_path, monkeypatch, with_fa2=True)
    try:
        assert registry._findable("flash_attn.cute") and not registry._findable("flash_attn.nope")
        assert "flash_attn" not in sys.modules
        ok, reason = B.availability("fav4", "cpu", torch.bfloat16, 128)
        assert not ok and "CUDA" in reason  # past the package check: the next reason is the device
    finally:
        F.forget("flash_attn")


# ----- FlashAttention-4 -----

@pytest.mark.parametrize("causal", [False, True])
def test_fa4_hands_bshd_views_and_returns_exact_attention(fa4, causal):
    q, k, v = qkv(b=2, h=3, s=70, d=64, dtype=torch.bfloat16, seed=1)
    out = B.resolve("fav4")(q, k, v, scale=0.1, is_causal=causal)
    assert fa4.CALLS[-1] == dict(shapes=[(2, 70, 3, 64)] * 3, softmax_scale=0.1, causal=causal, return_lse=False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_l2(out, _exact(q, k, v, 0.1, causal)[0]) < 1e-2  # bf16 output rounding only


def test_fa4_lse_form_is_the_kernels_natural_log(fa4):
    q, k, v = qkv(b=1, h=2, s=50, sk=90, d=64, dtype=torch.bfloat16, seed=2)
    form = B.resolve("fav4").lse_form("cuda")
    assert form.call_label(q) == "fa4.flash_attn_func[lse]"
    out, lse = form.fn(q, k, v)
    ref, lref = _exact(q, k, v)
    assert fa4.CALLS[-1]["return_lse"] and lse.shape == (1, 2, 50) and lse.dtype == torch.float32
    assert (lse.double() - lref).abs().max() < 1e-4 and rel_l2(out, ref) < 1e-2


def test_fa4_head_dims_follow_the_gpu_architecture(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from vdbench.backends import flash4

    for cap, dim, ok in [((9, 0), 192, True), ((9, 0), 256, True), ((10, 0), 192, False), ((10, 0), 256, True),
                         ((10, 0), 128, True), ((9, 0), 100, False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None, cap=cap: cap)
        monkeypatch.setattr(flash4, "_CAPS", {})
        got, reason = B.availability("fav4", "cuda", torch.bfloat16, dim)
        assert got == ok, (cap, dim, reason)
        if not ok:
            assert f"head dim {dim} on sm_{cap[0]}x" in reason
    ok, reason = B.availability("fav4", "cuda", torch.float32, 128)
    assert not ok and "float32 unsupported" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    ok, reason = B.availability("fav4", "cuda", torch.bfloat16, 128)
    assert not ok and "compute capability >= 9.0" in reason


# ----- FlashInfer -----

def test_flashinfer_takes_the_packages_kernel_choice_as_an_option(flashinfer):
    q, k, v = qkv(b=1, h=2, s=40, d=64, dtype=torch.bfloat16, seed=4)
    plain, fa2 = B.resolve("flashinfer"), B.resolve("flashinfer:backend=fa2")
    torch.testing.assert_close(fa2(q, k, v), plain(q, k, v))
    assert flashinfer.CALLS[-1]["backend"] == "auto" and flashinfer.CALLS[-2]["backend"] == "fa2"
    assert fa2.kernel == "flashinfer.single_prefill_with_kv_cache[fa2]" and plain.kernel.endswith("_cache")
    fa2.lse.fn(q, k, v)
    assert flashinfer.CALLS[-1]["backend"] == "fa2" and flashinfer.CALLS[-1]["return_lse"]
    with pytest.raises(B.BackendUnavailable, match="'cudnn' is not one of auto|fa2|fa3"):
        B.resolve("flashinfer:backend=cudnn")


def test_flashinfer_runs_one_request_per_batch_element_in_contiguous_nhd(flashinfer):
    """One call per batch element, q, k, v as contiguous (tokens, heads, D): views of the pipelines' BSHD memory (no
    copy), copies of contiguous BHSD. On an H200 the package's FA3-style kernel crashed on a strided q with HND k/v."""
    q, k, v = qkv(b=2, h=3, s=40, sk=72, d=64, dtype=torch.float16, seed=3)
    out = B.resolve("flashinfer")(q, k, v, scale=0.2)
    calls = flashinfer.CALLS[-2:]
    assert [{key: c[key] for key in ("shapes", "kv_layout", "causal", "sm_scale", "return_lse", "backend",
                                     "contiguous")} for c in calls] == [
        dict(shapes=[(40, 3, 64), (72, 3, 64), (72, 3, 64)], kv_layout="NHD", causal=False, sm_scale=0.2,
             return_lse=False, backend="auto", contiguous=[True] * 3)] * 2
    assert out.shape == q.shape and rel_l2(out, _exact(q, k, v, 0.2)[0]) < 2e-3
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # what diffusers' processors pass
    torch.testing.assert_close(B.resolve("flashinfer")(*bshd, scale=0.2), out)
    assert flashinfer.CALLS[-1]["ptrs"] == [t[1].transpose(0, 1).data_ptr() for t in bshd]  # views: no copy


def test_flashinfer_lse_form_turns_base_2_into_natural_log(flashinfer):
    q, k, v = qkv(b=2, h=2, s=48, d=128, dtype=torch.bfloat16, seed=4)
    out, lse = B.resolve("flashinfer").lse_form("cuda").fn(q, k, v, is_causal=True)
    ref, lref = _exact(q, k, v, is_causal=True)
    assert lse.shape == (2, 2, 48) and lse.dtype == torch.float32
    assert (lse.double() - lref).abs().max() < 1e-4 and rel_l2(out, ref) < 1e-2
    raw = flashinfer.single_prefill_with_kv_cache(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                  causal=True, return_lse=True)[1]
    assert (raw.t().double() * math.log(2.0) - lref[0]).abs().max() < 1e-4  # the package's own LSE is base 2


def test_flashinfer_refuses_what_it_is_not_built_for():
    entry = B.resolve("flashinfer")
    q, k, v = qkv(s=16, d=96, dtype=torch.bfloat16)
    with pytest.raises(B.UnsupportedCall, match="head dim 96"):
        entry.check_call(q, k, v)
    q, k, v = qkv(s=16, d=64, dtype=torch.float32)
    with pytest.raises(B.UnsupportedCall, match="dtype torch.float32"):
        entry.check_call(q, k, v)
    with pytest.raises(B.UnsupportedCall, match="attention mask"):
        entry.check_call(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))


# ----- NATTEN -----

def _na_reference(q, k, v, grid, ks, scale=None):
    """Neighborhood attention written from its definition in the model's order, independent of both the wrapper
    and the stand-in's reshapes: per axis the window of ks tokens around the query, shifted inside the grid."""
    coords = [grid.decode(i) for i in range(grid.seq_len)]
    allowed = torch.ones(grid.seq_len, grid.seq_len, dtype=torch.bool)
    for i, ci in enumerate(coords):
        for j, cj in enumerate(coords):
            if ci is None or cj is None:
                continue  # text: attended by and attending every token
            for a in range(3):
                start = min(max(ci[a] - ks[a] // 2, 0), grid.shape[a] - ks[a])
                if not start <= cj[a] < start + ks[a]:
                    allowed[i, j] = False
    return F.exact64(q, k, v, scale=scale, mask=allowed)[0]


@pytest.mark.parametrize("grid", [TokenGrid(3, 4, 5), TokenGrid(2, 3, 4, text_tokens=5, text_first=True),
                                  TokenGrid(2, 3, 4, text_tokens=3, text_first=False)])
def test_natten_attends_the_window_on_the_grid_in_the_models_order(natten, grid):
    entry = B.resolve("natten:window=3x3x3")
    assert entry.name == "natten:window=3x3x3" and entry.kernel == "natten.na3d[window=3x3x3]"
    q, k, v = qkv(b=2, h=2, s=grid.seq_len, d=32, dtype=torch.bfloat16, seed=5)
    out, label, stats = entry.sparse.attend(q, k, v, grid=grid, scale=0.3)
    ks = tuple(min(3, n) for n in grid.shape)
    call = [c for c in natten.CALLS if c["fn"] == "na3d"][-1]
    assert call["shape"] == (2, *grid.shape, 2, 32) and call["kernel_size"] == ks and call["scale"] == 0.3
    assert call["additional"] == ((2, grid.text_tokens, 2, 32) if grid.text_tokens else None)
    assert label == "natten.na3d[window=3x3x3]" and stats.sparse_call and 0 < stats.fraction < 1
    ref = _na_reference(q, k, v, grid, ks, scale=0.3)
    assert out.shape == q.shape and rel_l2(out, ref) < 1e-2
    assert rel_l2(out, F.exact64(q, k, v, scale=0.3)[0]) > 0.05  # the window did restrict attention


def test_natten_cross_attention_and_bare_calls(natten):
    entry = B.resolve("natten")
    q, k, v = qkv(b=1, h=2, s=24, sk=40, d=32, dtype=torch.bfloat16, seed=6)
    out, label, stats = entry.sparse.attend(q, k, v, grid=TokenGrid(2, 3, 4))
    assert label == "natten.attention" and not stats.sparse_call and rel_l2(out, _exact(q, k, v)[0]) < 1e-2
    with pytest.raises(B.UnsupportedCall, match="needs the token grid"):
        entry(q, k, v)
    q, k, v = qkv(b=1, h=2, s=12, d=32, dtype=torch.bfloat16)
    with pytest.raises(B.UnsupportedCall, match="at least 2 latent tokens along every axis"):
        entry.sparse.attend(q, k, v, grid=TokenGrid(1, 3, 4))
    with pytest.raises(B.UnsupportedCall, match="bidirectional"):
        entry.sparse.attend(q, k, v, grid=TokenGrid(1, 3, 4), is_causal=True)


@pytest.mark.parametrize("text, fragment", [("natten:window=2x3x3", "odd and >= 3"),
                                            ("natten:window=1x3x3", "odd and >= 3"),
                                            ("natten:window=3x3", "is not TxHxW"),
                                            ("natten:tile=6x8x8", "unknown option 'tile'")])
def test_natten_window_grammar(text, fragment):
    with pytest.raises(B.BackendUnavailable) as e:
        B.resolve(text)
    assert fragment in str(e.value)
    assert B.resolve("natten:window=17x23x23") is B.resolve("natten")  # the default: the entry itself
    assert B.resolve("natten").head_dims == (32, 64, 128, 256) and not B.resolve("natten").supports_causal


# ----- through the patching core: counted under each kernel's label -----

@pytest.mark.parametrize("name, label", [("fav4", "fa4.flash_attn_func"),
                                         ("flashinfer", "flashinfer.single_prefill_with_kv_cache")])
def test_dense_entries_are_counted_under_their_kernel_label(name, label, request):
    request.getfixturevalue({"fav4": "fa4", "flashinfer": "flashinfer"}[name])
    model = small_wan()
    x = wan_inputs()
    base = run(model, x)
    with AttentionPatch([("transformer", model)], _on_cpu(name)) as patch:
        out = run(model, x)
    assert dict(patch.stats.calls) == {label: 4} and dict(patch.stats.calls_by_kind) == {"self": 2, "cross": 2}
    torch.testing.assert_close(out, base, atol=1e-4, rtol=1e-3)  # exact attention, whatever the layouts


def test_natten_is_counted_per_kernel_through_the_grid_hooks(natten):
    model = small_wan()  # 3x4x4 latent grid
    x = wan_inputs()
    with AttentionPatch([("transformer", model)], _on_cpu("natten:window=3x3x3")) as patch:
        run(model, x)
    assert dict(patch.stats.calls) == {"natten.na3d[window=3x3x3]": 2, "natten.attention": 2}
    assert [c["shape"] for c in natten.CALLS if c["fn"] == "na3d"] == [(1, 3, 4, 4, 2, 16)] * 2
    cog = small_cogvideox()  # joint attention: 7 text tokens first, a 2x4x4 grid
    with AttentionPatch([("transformer", cog)], _on_cpu("natten:window=3x3x3")) as patch:
        run(cog, cog_inputs())
    assert dict(patch.stats.calls) == {"natten.na3d[window=3x3x3]": 2}
    assert [c["additional"] for c in natten.CALLS if c["fn"] == "na3d"][-1] == (1, 7, 2, 16)


def test_the_attention_bench_runs_natten_on_its_grid_in_the_models_order(natten):
    """The attention bench's grid path (vdbench.kernel_bench): a grid backend with no tile order of ours is called
    (and timed) on the inputs as they are, with the grid given by --grid."""
    from vdbench import kernel_bench as bench

    grid = TokenGrid(3, 4, 5)
    q, k, v = qkv(b=1, h=2, s=grid.seq_len, d=32, dtype=torch.bfloat16, seed=7)
    row = {}
    acc, timed, inputs = bench._grid_kernel(row, _on_cpu("natten:window=3x3x3"), q, k, v, {grid.seq_len: grid}, None)
    assert row == {"grid": str(grid)} and all(a is b for a, b in zip(inputs, (q, k, v)))
    ref = _na_reference(q, k, v, grid, (3, 3, 3))
    assert rel_l2(acc(q, k, v), ref) < 1e-2 and torch.equal(timed(*inputs), acc(q, k, v))
