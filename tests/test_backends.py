"""The backend registry: names and aliases, availability reasons from composable checks, what each entry carries,
registering a backend from one file, and every CPU-runnable backend against exact attention."""

import importlib.util
import pkgutil
import re
from pathlib import Path

import pytest
import torch

from vdbench import backends as B
from vdbench import numerics as N
from vdbench.backends import registry

from tests.attention_data import qkv, rel_l2

ROOT = Path(__file__).resolve().parents[1]
EXPECTED_NAMES = ["default", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "reference",
                  "sagev1", "fav2", "fav3", "fav3_fp8", "fav3_sage", "fp8_triton", "fav2_triton", "sagev1_emu",
                  "fp8_emu"]
QUANTIZED = ("sagev1", "fav3_fp8", "fav3_sage", "fp8_triton", "sagev1_emu", "fp8_emu")


# ----- names, aliases, unknown names -----

def test_names_are_the_shared_vocabulary():
    assert B.names() == EXPECTED_NAMES
    with pytest.raises(B.BackendUnavailable, match="unknown attention backend 'nope'; valid: default, sdpa"):
        B.get_backend("nope")


@pytest.mark.parametrize("alias, name", [
    ("native", "sdpa"), ("torch_sdpa", "sdpa"), ("_native_cudnn", "sdpa_cudnn"), ("_native_flash", "sdpa_flash"),
    ("_native_efficient", "sdpa_efficient"), ("_native_math", "sdpa_math"), ("flash", "fav2"),
    ("_flash_3", "fav3"), ("_flash_3_hub", "fav3"), ("fa3", "fav3"), ("sage", "sagev1"), ("sage_attn", "sagev1")])
def test_diffusers_and_sglang_names_resolve_to_ours(alias, name):
    assert B.resolve(alias) is B.resolve(name) and B.aliases()[alias] == name
    assert B.availability(alias, "cpu") == B.availability(name, "cpu")
    assert B.canonical_name(alias) == name and B.canonical_name("nope") == "nope"


def test_aliases_are_listed_and_unknown_names_get_a_suggestion():
    table = B.capability_table("cpu")
    assert "aliases" in table and "_flash_3, _flash_3_hub, fa3 -> fav3" in table
    assert "native, torch_sdpa -> sdpa" in table
    with pytest.raises(B.BackendUnavailable, match=r"'sagev2'; did you mean 'sagev1'\? valid: default"):
        B.resolve("sagev2")
    with pytest.raises(B.BackendUnavailable, match=r"did you mean '_flash_3' \(= 'fav3'\)\?"):
        B.resolve("_flash3")
    assert B.resolve(B.resolve("fav3")) is B.resolve("fav3")  # an entry resolves to itself


# ----- availability: composable checks -----

def test_unavailable_backends_say_why_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, reason = B.availability("sdpa_cudnn", "cpu")
    assert not ok and "CUDA" in reason
    for name in ("fav3_sage", "fp8_triton", "fav2_triton"):  # the project's Triton kernels
        ok, reason = B.availability(name, "cpu")
        assert not ok and ("package not installed: triton" in reason or "TRITON_INTERPRET=1" in reason)
    for name in ("sagev1", "fav2", "fav3", "fav3_fp8"):
        ok, reason = B.availability(name, "cpu")
        assert not ok
        # either the package is missing or (if someone installed it) there is no CUDA here
        assert "package not installed" in reason or "CUDA" in reason


def test_head_dim_and_dtype_reasons(monkeypatch):
    # pretend the package is installed and a Hopper GPU is present: the remaining reasons are dtype/head dim
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert B.availability("fav3", "cuda", torch.bfloat16, 128) == (True, "ok")
    ok, reason = B.availability("fav3", "cuda", torch.float16, 128)
    assert not ok and "float16 unsupported" in reason
    ok, reason = B.availability("sagev1", "cuda", torch.bfloat16, 32)
    assert not ok and "head dim 32" in reason
    # torch's flash kernel: fp32 on a CPU, half only on CUDA (a check of its own, not a name special case)
    assert B.availability("sdpa_flash", "cpu", torch.float32)[0]
    ok, reason = B.availability("sdpa_flash", "cuda", torch.float32)
    assert not ok and "float32 unsupported (supports float16, bfloat16)" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    ok, reason = B.availability("fav3", "cuda", torch.bfloat16, 128)
    assert not ok and "Hopper" in reason


def test_constraints_compose_in_order(monkeypatch):
    """The first failing check gives the reason; the call-level capabilities come after the checks."""
    seen = []

    def probe_fn(dev):
        seen.append(dev.type)
        return False, "probe says no"

    toy = B.Backend("toy", "a test entry", fn=N.reference_attention, kernel="toy", dtypes=B.HALF, head_dims=(64,),
                    constraints=(B.requires_package("no_such_module_vdbench", hint="pip install it"),
                                 B.probe(probe_fn), B.cuda(min_arch=(8, 0))), no_lse_reason="a test entry")
    assert toy.install_hint == "pip install it"  # taken from the package check
    assert toy.availability("cpu") == (False, "package not installed: no_such_module_vdbench (pip install it)")
    assert seen == []  # later checks don't run once one fails
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert toy.availability("cpu") == (False, "probe says no") and seen == ["cpu"]
    passing = B.Backend("toy2", "x", fn=N.reference_attention, kernel="toy2", dtypes=B.HALF, head_dims=(64,),
                        constraints=(B.probe(lambda dev: (True, "ok")), B.cuda(min_arch=(8, 0))),
                        no_lse_reason="x")
    assert passing.availability("cpu") == (False, "needs a CUDA GPU (device is cpu)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))
    assert "compute capability >= 8.0, GPU is 7.5" in passing.availability("cuda")[1]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert "float32 unsupported" in passing.availability("cuda", torch.float32)[1]
    assert "head dim 96" in passing.availability("cuda", torch.bfloat16, 96)[1]
    assert passing.availability("cuda", torch.bfloat16, 64) == (True, "ok")


def test_require_names_the_install_hint_and_the_emulation(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(B.BackendUnavailable) as e:
        B.resolve("sagev1").require("cpu", torch.bfloat16, [128])
    msg = str(e.value)
    assert "'sagev1' can't run here" in msg and "pip install -e '.[sage]'" in msg and "'sagev1_emu'" in msg
    with pytest.raises(B.BackendUnavailable, match="'sdpa_flash' can't run here: supports head dims up to 256"):
        B.resolve("sdpa_flash").require("cpu", torch.float32, [64, 512])
    assert B.resolve("reference").require("cpu", torch.float32, [64, 128]) is B.resolve("reference")


def test_cpu_available_set(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # with it (and triton), the Triton kernels join the set
    assert B.available_names("cpu", torch.float32) == ["default", "sdpa", "sdpa_flash", "sdpa_math", "reference",
                                                      "sagev1_emu", "fp8_emu"]


def test_capability_table_lists_every_backend_with_reason():
    table = B.capability_table("cpu")
    for name in EXPECTED_NAMES:
        assert f"\n{name} " in table
    assert "needs a CUDA GPU" in table and "BHSD" in table


# ----- what every entry carries -----

def test_every_entry_is_self_contained():
    entries = list(B.BACKENDS.values())
    twins = {b.twin for b in entries if b.twin}
    for b in entries:
        assert (b.lse is None) != (not b.no_lse_reason), f"{b.name}: an LSE form or the reason it has none"
        if any(isinstance(c, registry.RequiresPackage) for c in b.constraints):
            assert b.install_hint, f"{b.name} needs a package: it says how to install it"
        if b.twin:
            assert B.resolve(b.twin).emulated and not b.emulated
        if b.emulated:
            assert b.name in twins, f"{b.name} emulates a kernel: that kernel names it as its twin"
        assert b.layout in ("BHSD", "BSHD") and callable(b.fn) and b.kernel
    assert [b.name for b in entries if b.passthrough] == ["default"]
    for name in QUANTIZED:
        moved = B.resolve(name).bytes_moved(1, 2, 256, 256, 64, 2)
        assert moved.prepass > 0 and moved.kernel < 4 * 2 * 256 * 64 * 2, name
        assert (B.resolve(name).prepass is None) == (name == "sagev1")  # sageattn() exposes no pre-pass alone
    assert B.resolve("fav3").bytes_moved(1, 2, 256, 256, 64, 2) == (4 * 2 * 256 * 64 * 2, 0)


@pytest.mark.parametrize("name", ["fav3_fp8", "sagev1_emu", "fp8_emu"])
def test_torch_prepasses_quantize_what_the_call_quantizes(name):
    q, k, v = qkv(s=130, d=64, dtype=torch.bfloat16)
    out = B.resolve(name).prepass(q, k, v, 0.3)
    assert len(out) == (2 if name == "sagev1_emu" else 3)
    if name != "sagev1_emu":
        x8, _, fa3_descale = out[0]
        assert x8.dtype == torch.float8_e4m3fn and fa3_descale.shape == (1, 2)
    else:  # Q pre-scaled by the softmax scale·log2 e, as the emulation quantizes it
        ref = N.quantize_int8_per_block(q, N.SAGE_BLKQ, pre_scale=0.3 * N.LOG2E)
        torch.testing.assert_close(out[0][1], ref[1])


def test_lse_forms_and_reasons():
    assert B.resolve("sdpa").lse_form("cpu").label == "sdpa[flash][lse]"
    with pytest.raises(B.BackendUnavailable, match="returns the log-sum-exp only on cuda"):
        B.resolve("sdpa_cudnn").lse_form("cpu")
    with pytest.raises(B.BackendUnavailable, match="math kernel returns the attention weights"):
        B.resolve("sdpa_math").lse_form("cpu")
    assert [n for n, b in B.BACKENDS.items() if b.has_lse("cpu")] == ["sdpa", "sdpa_flash", "reference"]


def test_call_labels_name_what_ran():
    q, k, v = qkv(s=32, d=32)
    assert re.fullmatch(r"sdpa\[(flash|math|efficient|cudnn)\]", B.resolve("sdpa").call_label(q, k, v))
    assert B.resolve("default").call_label(q, k, v) == B.resolve("sdpa").call_label(q, k, v)
    assert B.resolve("sagev1_emu").call_label(q, k, v) == "emu.sagev1"


# ----- registering -----

def test_adding_a_backend_is_one_register_call_in_one_file(tmp_path):
    """A module with an ORDER and one register() call is all a new kernel needs: listed in its place,
    resolvable by name and alias, in the table; taken out again afterwards."""
    src = tmp_path / "toy_kernel.py"
    src.write_text(
        "from vdbench import numerics\n"
        "from vdbench.backends import Backend, register\n"
        "ORDER = 25\n"
        "register(Backend('toy', 'a toy kernel: exact attention', fn=numerics.reference_attention, kernel='toy.fn',\n"
        "                 aliases=('toy_attn',), no_lse_reason='the toy kernel keeps no log-sum-exp'))\n")
    spec = importlib.util.spec_from_file_location("toy_kernel", src)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        names = B.names()
        assert names.index("fav3_fp8") < names.index("toy") < names.index("fav3_sage")  # ORDER 25: 20 < 25 < 30
        assert B.resolve("toy_attn").name == "toy" and "toy_attn -> toy" in B.capability_table("cpu")
        assert B.availability("toy", "cpu", torch.float32, 64) == (True, "ok")
    finally:
        B.unregister("toy")
    assert "toy" not in B.names() and "toy_attn" not in B.aliases()


def test_register_refuses_clashes_and_entries_without_an_lse_answer():
    def toy(name, **kw):
        return B.Backend(name, "x", fn=N.reference_attention, kernel=name, **kw)

    with pytest.raises(ValueError, match="already taken: sdpa"):
        B.register(toy("sdpa", no_lse_reason="x"))
    with pytest.raises(ValueError, match="already taken: native"):
        B.register(toy("toy", aliases=("native",), no_lse_reason="x"))
    with pytest.raises(ValueError, match="neither a log-sum-exp form"):
        B.register(toy("toy"))
    with B.registered(toy("toy", no_lse_reason="x")):
        assert B.names()[-1] == "toy"
    assert "toy" not in B.names()


def test_every_module_of_the_package_registers_in_its_order():
    import importlib

    orders = []
    for info in pkgutil.iter_modules(B.__path__):
        if info.name != "registry":
            orders.append(importlib.import_module(f"vdbench.backends.{info.name}").ORDER)
    assert len(orders) == len(set(orders)) == 5


def test_no_caller_keys_on_a_backend_name():
    """Callers ask the entry (passthrough, lse_form, call_label, bytes_moved, prepass): outside vdbench/backends no
    source compares a backend name to a literal or tests it against a tuple of names. ("default" is left out of
    the tuple test: the VAE's decode modes use the same word.)"""
    names = "|".join(EXPECTED_NAMES)
    pats = [re.compile(r"\.name\s*[!=]=\s*['\"](%s)['\"]" % names), re.compile(r"attention_type\s*[!=]=\s*['\"]"),
            re.compile(r"\bin\s*[(\[{]\s*['\"](%s)['\"]" % "|".join(EXPECTED_NAMES[1:]))]
    files = [p for p in (ROOT / "vdbench").rglob("*.py") if "backends" not in p.parts] + \
        list((ROOT / "bench").glob("*.py"))
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if any(r.search(line) for r in pats)]
    assert not hits, "\n".join(hits)


# ----- the callables -----

def test_reference_matches_fp64_exactly_enough():
    q, k, v = qkv(s=173, sk=91)  # odd, different lengths
    ref = B.exact_attention(q, k, v)
    out = B.get_backend("reference")(q, k, v)
    assert out.dtype == torch.float32
    assert rel_l2(out, ref) < 1e-6


# expected error of each CPU-runnable backend vs fp64, on bf16 inputs with K bias (float32 compute for emus)
CPU_BOUNDS = {"sdpa": 1e-2, "sdpa_flash": 1e-2, "sdpa_math": 1e-2, "reference": 1e-2, "default": 1e-2,
              "sagev1_emu": 3e-2, "fp8_emu": 1.5e-1}


@pytest.mark.parametrize("name", sorted(CPU_BOUNDS))
def test_cpu_backends_against_fp64(name):
    q, k, v = qkv(s=257, dtype=torch.bfloat16)  # not a block multiple
    ref = B.exact_attention(q, k, v)
    out = B.get_backend(name)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = rel_l2(out, ref)
    assert err < CPU_BOUNDS[name], f"{name}: rel L2 {err:.3e}"


def test_check_call_refuses_what_backend_cannot_serve():
    q, k, v = qkv(s=16, d=32)
    sage = B.get_backend("sagev1_emu")
    with pytest.raises(B.UnsupportedCall, match="attention mask"):
        sage.check_call(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(B.UnsupportedCall, match="dropout"):
        sage.check_call(q, k, v, dropout_p=0.1)
    with pytest.raises(B.UnsupportedCall, match="backend 'sagev1' does not support head dim 32"):
        B.get_backend("sagev1").check_call(q, k, v)
    with pytest.raises(B.UnsupportedCall, match="float32"):
        B.get_backend("fav3").check_call(q, k, v)
    B.get_backend("sdpa").check_call(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))


def test_sdpa_kernel_choice_names_a_kernel():
    q, k, v = qkv(s=32, d=32)
    assert B.sdpa_kernel_choice(q, k, v) in {"flash", "math", "efficient", "cudnn"}


def test_forced_sdpa_kernel_raises_instead_of_falling_back():
    q, k, v = qkv(s=32, d=32)

    def switches():
        cuda = torch.backends.cuda
        return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
                cuda.cudnn_sdp_enabled())

    before = switches()
    with pytest.raises(RuntimeError):
        B.get_backend("sdpa_efficient")(q, k, v)  # no memory-efficient kernel on CPU
    assert switches() == before  # torch's switches restored after a refused call too


def test_forced_sdpa_flips_the_switches_sdpa_kernel_flips():
    """The forced kernels flip torch's switches directly (cheaper per call than the context manager) and compute
    exactly what ``sdpa_kernel([backend])`` does, the switches as they were afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv(s=32, d=32)
    for name, member in (("sdpa_math", SDPBackend.MATH), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([member]):
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3)
        torch.backends.cuda.enable_math_sdp(False)  # a caller's own setting is kept around the call
        try:
            assert torch.equal(B.get_backend(name)(q, k, v, scale=0.3), want)
            assert not torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        finally:
            torch.backends.cuda.enable_math_sdp(True)
