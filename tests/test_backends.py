"""The backend registry: names and aliases, availability reasons from composable checks, what each entry carries,
registering a backend from one file, and every CPU-runnable backend against exact attention."""

import dataclasses
import importlib.util
import pkgutil
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from vdbench import backends as B
from vdbench import numerics as N
from vdbench.backends import registry

from tests.attention_data import qkv, rel_l2

ROOT = Path(__file__).resolve().parents[1]
EXPECTED_NAMES = ["default", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "reference",
                  "sagev1", "sagev2", "sagev2_fp8", "sagev2_fp16", "sagev2_triton", "fav2", "fav3", "fav3_fp8",
                  "fav3_sage", "fp8_triton", "fav2_triton", "flex", "sta", "radial", "sta_kernel", "sagev1_emu",
                  "sagev2_emu", "fp8_emu"]
QUANTIZED = ("sagev1", "sagev2", "sagev2_fp8", "sagev2_fp16", "sagev2_triton", "fav3_fp8", "fav3_sage", "fp8_triton",
             "sagev1_emu", "sagev2_emu", "fp8_emu")
#: quantized entries whose pre-pass runs inside one package call that offers no way to run it alone
PREPASS_INSIDE = ("sagev1", "sagev2", "sagev2_fp8", "sagev2_fp16", "sagev2_triton", "sagev2_emu")


# ----- names, aliases, unknown names -----

def _known(names):
    """``names`` restricted to EXPECTED_NAMES: what a check pins about the entries it knows, so that an entry added
    by a new module leaves it standing."""
    return [n for n in names if n in EXPECTED_NAMES]


def test_names_are_the_shared_vocabulary():
    # every name the CLIs have taken is still registered, in its place; new entries may sit anywhere among them
    assert _known(B.names()) == EXPECTED_NAMES
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
    with pytest.raises(B.BackendUnavailable, match=r"'sagev3'; did you mean 'sagev2'\? valid: default"):
        B.resolve("sagev3")
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
    monkeypatch.setitem(sys.modules, "sageattention", types.ModuleType("sageattention"))  # a 1.x-like package
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
    got = B.available_names("cpu", torch.float32)
    assert got == [n for n in B.names() if B.availability(n, "cpu", torch.float32)[0]]
    assert _known(got) == ["default", "sdpa", "sdpa_flash", "sdpa_math", "reference", "flex", "sta", "radial",
                           "sagev1_emu", "sagev2_emu", "fp8_emu"]


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
        moved = B.resolve(name).bench.bytes_moved(1, 2, 256, 256, 64, 2)
        assert moved.prepass > 0 and moved.kernel < 4 * 2 * 256 * 64 * 2, name
        assert (B.resolve(name).bench.prepass is None) == (name in PREPASS_INSIDE)  # sageattention's calls: none alone
    assert B.resolve("fav3").bench.bytes_moved(1, 2, 256, 256, 64, 2) == (4 * 2 * 256 * 64 * 2, 0)


def test_an_entry_keeps_its_runtime_bench_and_sparse_parts_apart():
    """The bench profile and the sparse pattern are parts of their own: the runtime record carries none of their
    fields, an entry registered without them gets the default profile (Q, K, V read and O written at the input's
    width, no pre-pass) and no sparse part, and a bind hook replaces a part whole."""
    fields = {f.name for f in dataclasses.fields(B.Backend)}
    assert {"bench", "sparse"} <= fields and not fields & {"bytes_model", "prepass", "grid", "configure"}
    toy = B.Backend("toy_parts", "a dense test kernel", fn=B.resolve("sdpa").fn, kernel="toy_parts",
                    no_lse_reason="a test kernel")
    with B.registered(toy):
        be = B.resolve("toy_parts")
        assert be.bench == B.BenchProfile() and be.bench.prepass is None and be.sparse is None
        assert be.bench.bytes_moved(1, 2, 16, 16, 8, 2) == (4 * 2 * 16 * 8 * 2, 0) and be.exact
    assert not dataclasses.replace(toy, bench=B.BenchProfile(B.traffic((1, 1, 1)))).exact  # asks the profile
    smooth = B.resolve("fp8_emu:smooth_k=1")
    assert smooth.bench.prepass is not B.resolve("fp8_emu").bench.prepass and smooth.sparse is None
    sta = B.resolve("sta")
    assert sta.sparse.configure("window=3x5x5") is B.resolve("sta:window=3x5x5") and sta.bench == B.BenchProfile()


@pytest.mark.parametrize("name", ["fav3_fp8", "fav3_fp8:smooth_k=1", "sagev1_emu", "fp8_emu", "fp8_emu:smooth_k=1"])
def test_torch_prepasses_quantize_what_the_call_quantizes(name):
    q, k, v = qkv(s=130, d=64, dtype=torch.bfloat16)
    out = B.resolve(name).bench.prepass(q, k, v, 0.3)
    if name != "sagev1_emu":  # FA3's operands, the eager pre-pass on a CPU (the Triton one is bit-equal)
        ref = N.fp8_bh_inputs(q, k, v, smooth_k=name.endswith("smooth_k=1"))
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(out[:6], ref[:6]))
        assert out.q8.dtype == torch.float8_e4m3fn and out.q_descale.shape == (1, 2)
        assert (out.k_mean is not None) == name.endswith("smooth_k=1")
    else:  # Q pre-scaled by the softmax scale·log2 e, as the emulation quantizes it
        ref = N.quantize_int8_per_block(q, N.SAGE_BLKQ, pre_scale=0.3 * N.LOG2E)
        torch.testing.assert_close(out[0][1], ref[1])


def test_lse_forms_and_reasons():
    assert B.resolve("sdpa").lse_form("cpu").label == "sdpa[flash][lse]"
    with pytest.raises(B.BackendUnavailable, match="returns the log-sum-exp only on cuda"):
        B.resolve("sdpa_cudnn").lse_form("cpu")
    with pytest.raises(B.BackendUnavailable, match="math kernel returns the attention weights"):
        B.resolve("sdpa_math").lse_form("cpu")
    assert _known(n for n, b in B.BACKENDS.items() if b.has_lse("cpu")) == ["sdpa", "sdpa_flash", "reference",
                                                                           "sagev2_emu"]


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


def _entry_modules() -> list[str]:
    return [info.name for info in pkgutil.iter_modules(B.__path__) if info.name not in B.SUPPORT_MODULES]


def test_every_module_of_the_package_registers_its_entries_in_its_order(monkeypatch):
    """Each entry module the package discovers, run once more against an empty registry, registers at least one entry,
    every one placed by the module's own ORDER (distinct across modules); each of them is in the real registry under
    the same name, place and kernel, and together the modules account for every registered entry. Whatever a new
    module adds, these hold or say which module breaks them."""
    modules = _entry_modules()
    assert modules, "the package discovers no entry module"
    orders = {m: importlib.import_module(f"vdbench.backends.{m}").ORDER for m in modules}
    assert all(isinstance(o, int) for o in orders.values()), orders
    assert len(set(orders.values())) == len(orders), f"two modules share an ORDER: {orders}"
    real, real_place = dict(registry.BACKENDS), dict(registry._PLACE)
    seen: dict[str, str] = {}
    for m in modules:
        for attr in ("BACKENDS", "_ALIASES", "_PLACE", "_BOUND"):
            monkeypatch.setattr(registry, attr, {})
        spec = importlib.util.find_spec(f"vdbench.backends.{m}")
        fresh = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, fresh)  # dataclasses look their module up there
        spec.loader.exec_module(fresh)
        got = dict(registry.BACKENDS)
        assert got, f"module {m} registers no entry"
        for name, entry in got.items():
            assert registry._PLACE[name][0] == orders[m], f"{name} from {m} is not placed by the module's ORDER"
            assert name in real and real_place[name][0] == orders[m], f"{name} from {m} is not in the registry"
            assert entry.kernel == real[name].kernel and entry.aliases == real[name].aliases, name
            assert name not in seen, f"{name} registered by both {seen.get(name)} and {m}"
            seen[name] = m
    assert set(seen) == set(real), f"registered by no module of the package: {sorted(set(real) - set(seen))}"


def test_every_registered_entry_resolves_by_its_name_and_aliases():
    """What ``register`` promises for each entry: resolvable by its name and each alias to the entry itself, listed
    in ``names()`` ordered by its module's place, unbound, and in the capability table."""
    table = B.capability_table("cpu")
    places = [registry._PLACE[n] for n in B.names()]
    assert places == sorted(places)
    for name, entry in B.BACKENDS.items():
        assert entry.name == name and B.resolve(name) is entry and entry.bound == ()
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+", name) and f"\n{name} " in table
        for alias in entry.aliases:
            assert B.resolve(alias) is entry and B.aliases()[alias] == name


def test_no_caller_keys_on_a_backend_name():
    """Callers ask the entry (passthrough, lse_form, call_label, bench, sparse): outside vdbench/backends no
    source compares a backend name to a literal or tests it against a tuple of names. ("default" is left out of
    the tuple test: the VAE's decode modes use the same word.)"""
    every = [re.escape(n) for n in B.names()]  # entries added later are covered too
    names = "|".join(every)
    pats = [re.compile(r"\.name\s*[!=]=\s*['\"](%s)['\"]" % names), re.compile(r"attention_type\s*[!=]=\s*['\"]"),
            re.compile(r"\bin\s*[(\[{]\s*['\"](%s)['\"]" % "|".join(n for n in every if n != "default"))]
    files = [p for p in (ROOT / "vdbench").rglob("*.py") if "backends" not in p.parts] + \
        list((ROOT / "bench").rglob("*.py"))
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


# ----- options: name:key=value -----

def _triple(text: str):
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"tile={text!r} is not TxHxW positive ints")
    return tuple(int(p) for p in parts)


def _toy_with_options():
    """An entry shaped like a sparse pattern's: a parsed option (a tile triple) beside a choice, and a bind hook that
    refuses one combination."""
    def bind(base, opts):
        if opts["mode"] == "odd" and opts["tile"][0] % 2 == 0:
            raise ValueError("mode=odd needs an odd first tile size")
        return B.Backend(base.name, base.description, fn=N.reference_attention,
                         kernel=f"toy[{opts['mode']},{'x'.join(map(str, opts['tile']))}]", no_lse_reason="toy",
                         twin=None)

    return B.Backend("toyopt", "a toy with options", fn=N.reference_attention, kernel="toy[plain,6x8x8]",
                     no_lse_reason="toy", bind=bind,
                     options=(B.Option("mode", "plain", ("plain", "odd"), help="a choice"),
                              B.Option("tile", (6, 8, 8), parse=_triple, spell=lambda t: "x".join(map(str, t)),
                                       help="TxHxW latent tokens")))


def test_options_bind_an_entry_named_by_its_canonical_spelling():
    with B.registered(_toy_with_options()):
        base = B.resolve("toyopt")
        assert B.resolve("toyopt:mode=plain,tile=6x8x8") is base  # every value a default: the entry itself
        a = B.resolve("toyopt:tile=1x3x5,mode=odd")
        assert a.name == "toyopt:mode=odd+tile=1x3x5" and a.kernel == "toy[odd,1x3x5]"  # declared order, '+'
        assert a.bound == (("mode", "odd"), ("tile", (1, 3, 5))) and a.option_values == {"mode": "odd",
                                                                                         "tile": (1, 3, 5)}
        assert B.resolve("toyopt:mode=odd+tile=1x3x5") is a and B.resolve(a.name) is a  # made once, round trip
        assert B.resolve("toyopt:tile=2x2x2").name == "toyopt:tile=2x2x2" and a.base_name == "toyopt"
        assert B.canonical_name("toyopt:tile=6x8x8") == "toyopt" and B.canonical_name("toyopt:tile=0") == \
            "toyopt:tile=0"  # refused options come back as given: resolve refuses them
        assert B.availability("toyopt:mode=odd+tile=1x3x5", "cpu", torch.float32, 64) == (True, "ok")
        table = B.capability_table("cpu")
        assert "toyopt: mode=plain|odd (default plain): a choice; tile=TxHxW latent tokens (default 6x8x8)" in table
    assert "toyopt" not in B.names()
    with pytest.raises(B.BackendUnavailable, match="unknown attention backend 'toyopt'"):
        B.resolve("toyopt:mode=odd")  # unregistering drops its bound entries too


@pytest.mark.parametrize("text, fragment", [
    ("toyopt:mode=even", "mode='even' is not one of plain|odd"),
    ("toyopt:tile=3x3", "tile='3x3' is not TxHxW positive ints"),
    ("toyopt:size=3", "unknown option 'size'; options: mode=plain|odd"),
    ("toyopt:mode", "option 'mode' is not key=value"),
    ("toyopt:", "empty option in 'toyopt:'"),
    ("toyopt:mode=odd,,tile=1x1x1", "empty option"),
    ("toyopt:mode=odd,mode=plain", "option 'mode' given twice"),
    ("toyopt:mode=odd+tile=2x1x1", "mode=odd needs an odd first tile size"),
    ("fav3:window=3", "attention backend 'fav3' takes no options"),
    ("nosuch:mode=odd", "unknown attention backend 'nosuch'"),
])
def test_option_errors_name_the_entry_the_option_and_what_is_accepted(text, fragment):
    with B.registered(_toy_with_options()):
        with pytest.raises(B.BackendUnavailable) as e:
            B.resolve(text)
        assert fragment in str(e.value) and "\n" not in str(e.value)


def test_option_declarations_are_checked():
    with pytest.raises(ValueError, match="declares options but no bind hook"):
        B.Backend("x", "x", fn=N.reference_attention, kernel="x", no_lse_reason="x",
                  options=(B.Option("a", "1", ("1", "2")),))
    with pytest.raises(ValueError, match="default '3' is not one of"):
        B.Option("a", "3", ("1", "2"))
    with pytest.raises(ValueError, match="needs choices or a parse function"):
        B.Option("a", 3)
    with pytest.raises(ValueError, match="letters, digits"):
        B.register(B.Backend("bad:name", "x", fn=N.reference_attention, kernel="x", no_lse_reason="x"))


def test_the_registered_entries_options():
    """The kernels' granularity and smoothing options, their twins bound the same way, and the labels naming them."""
    warp = B.resolve("sagev2_fp8:gran=per_warp")
    assert warp.name == "sagev2_fp8:gran=per_warp" and warp.kernel.endswith("[gran=per_warp]")
    assert warp.twin == "sagev2_emu:gran=per_warp" and B.resolve(warp.twin).emulated
    assert B.resolve("sagev2_fp16:gran=per_warp").twin == "sagev2_emu:pv=fp16+gran=per_warp"
    assert B.resolve("sagev2_fp8:gran=per_thread") is B.resolve("sagev2_fp8")
    smooth = B.resolve("fav3_fp8:smooth_k=1")
    assert smooth.kernel == "fa3.flash_attn_func[e4m3,smooth_k]" and smooth.twin == "fp8_emu:smooth_k=1"
    assert smooth.bench.bytes_moved(1, 2, 256, 256, 64, 2).prepass > B.resolve("fav3_fp8").bench.bytes_moved(
        1, 2, 256, 256, 64, 2).prepass  # K read once more, for its mean
    for name in EXPECTED_NAMES:
        b = B.resolve(name)
        for o in b.options:  # every declared value binds (or is refused by name), every twin of a binding resolves
            for value in o.choices:
                try:
                    bound = B.resolve(f"{name}:{o.key}={value}")
                except B.BackendUnavailable as e:
                    assert name in str(e)
                    continue
                if bound.twin:
                    assert B.resolve(bound.twin).emulated
