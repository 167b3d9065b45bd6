"""vdbench.use_backend, the library entry point: the README's example as written, refusals at install, what it
accepts, removal on exit and on error; and the public names of ``import vdbench``."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vdbench
from vdbench.backends import BackendUnavailable, names
from vdbench.patching import AttentionPatch, attention_modules, install_backend
from tests.test_patching import run, small_wan, wan_inputs

ROOT = Path(__file__).resolve().parents[1]


def _readme_example() -> str:
    """The first python block of the README's "As a library" section, verbatim."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## As a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _processors(model):
    return [m.processor for _, m in attention_modules(model)]


def test_readme_example_runs_as_written_and_counts_by_kernel_and_kind(capsys):
    ns = {}
    exec(compile(_readme_example(), "README.md", "exec"), ns)
    patch, pipe = ns["patch"], ns["pipe"]
    assert dict(patch.stats.calls) == {"emu.sagev1": 16}  # 2 steps x 2 (guidance) x 2 blocks x (self + cross)
    assert dict(patch.stats.calls_by_kind) == {"self": 8, "cross": 8}
    assert patch.calls is patch.stats.calls
    assert ns["video"].shape == (9, 64, 96, 3)
    assert not patch.installed
    assert not any(hasattr(p, "_vd_patch") for p in _processors(pipe.transformer))  # no patched copy left
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "Counter({'emu.sagev1': 16})"  # what the README's comment says
    ok, reason = vdbench.list_backends(pipe)["fav3"]
    assert not ok and reason.startswith("transformer (cpu, float32, head dim 32): ")


def test_wan_utils_doc_example_runs_as_written():
    import wan_utils

    example = textwrap.dedent(wan_utils.__doc__.split("\n\n")[1])
    ns = {}
    exec(compile(example, "wan_utils.py", "exec"), ns)
    assert dict(ns["patch"].stats.calls) == {"emu.sagev1": 16}
    assert not ns["patch"].installed
    assert wan_utils.install_backend is install_backend  # the real installer, not the class under another name


@pytest.mark.parametrize("name", ["sdpa_efficient", "fav3"])
def test_unavailable_backend_is_refused_at_install_before_any_call(name):
    model = small_wan()
    procs = _processors(model)
    entered = False
    with pytest.raises(BackendUnavailable) as err:
        with vdbench.use_backend(model, name):
            entered = True
    msg = str(err.value)
    assert not entered and _processors(model) == procs  # refused before the block, the model untouched
    assert "\n" not in msg  # one line
    assert msg.startswith(f"vdbench.use_backend: '{name}' (")
    assert "can't run on transformer (cpu, float32, head dim 16): " in msg
    assert "Try " in msg and "sagev1_emu" in msg  # what does run here is named
    # whatever the entry point: the class refuses too (with the registry's reason), before touching the model
    with pytest.raises(BackendUnavailable, match=f"'{name}' can't run on transformer \\(cpu"):
        AttentionPatch(model, name).install()
    assert _processors(model) == procs


def test_a_transformer_pairs_and_a_pipeline_are_accepted():
    model = small_wan()
    with vdbench.use_backend(model, "sagev1_emu") as patch:
        run(model, wan_inputs())
    assert dict(patch.stats.calls) == {"emu.sagev1": 4} and patch.models == [("transformer", model)]
    with vdbench.use_backend([("transformer_2", model)], "reference") as patch:
        run(model, wan_inputs())
    assert dict(patch.stats.calls) == {"reference": 4} and patch.models[0][0] == "transformer_2"

    from vdbench.pipelines import load_pipeline

    pipe = load_pipeline("tiny:wan2.2-t2v-a14b", "t2v", "wan")
    patch = AttentionPatch(pipe, "sdpa")  # the class takes a pipeline too: both experts
    assert [name for name, _ in patch.models] == ["transformer", "transformer_2"]
    assert patch.models[1][1] is pipe.transformer_2
    for bad in (42, [("transformer",)], ["transformer"]):
        with pytest.raises(TypeError, match="diffusers pipeline, a transformer"):
            AttentionPatch(bad, "sdpa")


def test_removed_on_exit_and_on_error():
    model = small_wan()
    x = wan_inputs()
    base = run(model, x)
    procs = _processors(model)
    with pytest.raises(ZeroDivisionError):
        with vdbench.use_backend(model, "fp8_emu") as patch:
            assert not torch.equal(run(model, x), base)  # the backend really runs inside the block
            1 / 0
    assert not patch.installed and _processors(model) == procs
    assert torch.equal(run(model, x), base)
    assert sum(patch.calls.values()) == 4  # nothing counted after the block


def test_time_attention_and_fallback_options():
    model = small_wan()
    with vdbench.use_backend(model, "reference", time_attention=True) as patch:
        run(model, wan_inputs())
    assert patch.stats.attention_time_s is not None and patch.stats.attention_time_s > 0
    attn = model.blocks[0].attn1
    mask = torch.ones(1, 1, 48, 48, dtype=torch.bool)
    with vdbench.use_backend(attn, "sagev1_emu", "fallback:sdpa") as patch, torch.no_grad():
        attn(torch.randn(1, 48, 32), attention_mask=mask)
    assert patch.stats.fallbacks == 1 and dict(patch.calls) == {"fallback:sdpa": 1}
    with pytest.raises(vdbench.UnsupportedCall, match="on_unsupported='fallback:sdpa'"):
        with vdbench.use_backend(attn, "sagev1_emu"), torch.no_grad():
            attn(torch.randn(1, 48, 32), attention_mask=mask)


def test_install_backend_installs_now_and_a_with_block_removes_it():
    model = small_wan()
    patch = install_backend(model, "sagev1_emu")
    assert patch.installed
    with patch:
        run(model, wan_inputs())
    assert not patch.installed and patch.calls["emu.sagev1"] == 4


def test_list_backends_without_a_model():
    table = vdbench.list_backends(device="cpu", dtype=torch.float32, head_dim=16)
    assert set(table) == set(names())
    assert table["sagev1_emu"] == (True, "ok")
    assert table["sdpa_efficient"][0] is False and "CUDA" in table["sdpa_efficient"][1]


def test_import_vdbench_is_light_and_names_resolve():
    code = ("import sys, vdbench; assert 'torch' not in sys.modules, 'torch imported by import vdbench'; "
            "from vdbench.api import use_backend; assert vdbench.use_backend is use_backend; "
            "print(sorted(n for n in vdbench.__all__))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "use_backend" in out and "list_backends" in out and "BackendUnavailable" in out
    with pytest.raises(AttributeError):
        vdbench.no_such_name
