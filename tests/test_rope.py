"""Wan's RoPE in one Triton kernel (vdbench.kernels.rope; Triton's interpreter on CPU): diffusers' eager values bit for
bit, into any strided destination; and a Wan transformer whose self-attention runs it (--fused_rope) gives the
unpatched transformer's output bit for bit, its RoPE calls counted."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import triton_interpreter
from tests.test_patching import run, small_wan, wan_inputs
from vdbench.fused_bench.rope import diffusers_rope  # diffusers' expressions as written, the bench's reference
from vdbench.patching import AttentionPatch


def _freqs(s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, s, 1, d // 2, generator=g, dtype=torch.float64) * 60
    return (angles.cos().repeat_interleave(2, -1).float(), angles.sin().repeat_interleave(2, -1).float())


@pytest.fixture(scope="module")
def rope():
    with triton_interpreter("vdbench.kernels.rope") as (mod,):
        yield mod


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_gives_diffusers_values_bit_for_bit(rope, dtype):
    b, s, h, d = 1, 41, 4, 16
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(b, s, h * d, generator=g) * 4).to(dtype).unflatten(2, (h, d))  # a view, as the processor has
    cos, sin = _freqs(s, d)
    want = diffusers_rope(x, cos, sin)
    assert torch.equal(rope.rope_pairs(x, cos, sin), want)
    # into the Ulysses exchange's send layout: (P, B, S, h, D) written through its (B, S, P, h, D) view
    p = 2
    buf = torch.empty(p, b, s, h // p, d, dtype=dtype)
    rope.rope_pairs(x.unflatten(2, (p, h // p)), cos.unsqueeze(2), sin.unsqueeze(2), out=buf.permute(1, 2, 0, 3, 4))
    assert torch.equal(buf.permute(1, 2, 0, 3, 4).reshape(b, s, h, d), want)


def test_the_kernel_says_which_calls_it_cannot_serve(rope):
    x = torch.randn(1, 8, 2, 16)
    cos, sin = _freqs(8, 16)
    assert rope.why_not_fused(x, cos, sin) is None
    assert "float64" in rope.why_not_fused(x, cos.double(), sin.double())
    assert "dtype" in rope.why_not_fused(x, cos, sin, out=torch.empty(1, 8, 2, 16, dtype=torch.bfloat16))
    assert "strides" in rope.why_not_fused(x.transpose(-1, -2).contiguous().transpose(-1, -2), cos, sin)
    assert "frequencies of shape" in rope.why_not_fused(x, cos[:, :4], sin[:, :4])
    with pytest.raises(ValueError, match="rope_pairs: frequencies in torch.float64"):
        rope.rope_pairs(x, cos.double(), sin.double())


def test_a_wan_transformer_with_the_fused_rope_is_bit_identical(rope):
    model = small_wan()
    inputs = wan_inputs()
    plain = run(model, inputs)
    with AttentionPatch([("transformer", model)], "sdpa", fused_rope=True) as patch:
        fused = run(model, inputs)
    assert torch.equal(fused, plain)
    assert patch.stats.as_dict()["rope"] == {"fused_calls": 4, "eager_calls": 0, "eager_why": None}  # Q, K x 2
    assert dict(patch.stats.calls_by_kind) == {"self": 2, "cross": 2}
    with AttentionPatch([("transformer", model)], "sdpa") as patch:  # off: diffusers' processor, nothing counted
        assert torch.equal(run(model, inputs), plain)
    assert patch.stats.as_dict()["rope"]["fused_calls"] == 0
    import vdbench

    with vdbench.use_backend(model, "sdpa", fused_rope=True) as patch:  # the library's form
        assert torch.equal(run(model, inputs), plain)
    assert patch.stats.rope["fused"] == 4


def test_the_choice_auto_on_off(monkeypatch):
    from vdbench import families
    from vdbench.kernels import fused_rope_choice

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # on a CPU, on runs only under Triton's interpreter

    wan = families.get("wan")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_rope_choice(None, cpu, wan) == "a cpu device (the kernel runs on CUDA)"
    assert fused_rope_choice(None, cuda, wan, compiled=True) == "compiled blocks (inductor fuses the RoPE itself)"
    assert fused_rope_choice(False, cuda, wan) == "off (--fused_rope off)"
    with pytest.raises(ValueError, match="--fused_rope on: not here: needs a CUDA/HIP GPU; on CPU only under Triton's"):
        fused_rope_choice(True, cpu, wan)
    assert fused_rope_choice(None, cuda, families.get("cogvideox")) == "the model family runs diffusers' own processor"


def test_the_bench_compares_both_forms_and_checks_the_bits(rope, tmp_path):
    import json

    from vdbench.fused_bench import rope as rope_bench

    out = tmp_path / "rope.json"
    assert rope_bench.main(["--shapes", "tiny", "--budget_s", "0.05", "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["form"] for r in d["rows"]] == ["eager", "fused", "rank_eager_u2", "rank_fused_u2"]
    assert all(r["bit_identical"] is not False for r in d["rows"]) and d["speed_figure"] is False
    assert d["rows"][0]["calls_per_step"] == 8  # Q and K, two guidance branches, two layers


def test_the_first_fused_call_waits_for_the_prewarm_once(rope):
    model, inputs = small_wan(), wan_inputs()
    ready = []
    with AttentionPatch([("transformer", model)], "sdpa", fused_rope=True,
                        rope_ready=lambda: ready.append(1)) as patch:
        run(model, inputs)
    assert ready == [1] and patch.stats.rope["fused"] == 4


def test_the_rope_prewarm_thread_records_what_it_did(monkeypatch):
    from vdbench.backends.registry import CallShape
    from vdbench.render.prewarm import rope_prewarm

    seen = []
    monkeypatch.setattr(rope_kernel_module(), "prewarm",
                        lambda seq, heads, d, dtype, device, ulysses: seen.append((seq, heads, d, ulysses)) or 1)
    calls = [CallShape(1, 12, 32760, 12, 32760, 128)]
    pw = rope_prewarm(calls, torch.device("cuda"), torch.bfloat16, 2)
    pw.wait()
    rec = pw.as_dict()
    assert seen == [(32760, 12, 128, 2)] and rec["status"] == "done" and rec["compiled"] == 1
    assert rec["waited_s"] >= 0 and rec["ulysses"] == 2

    def broken(*a):
        raise RuntimeError("no driver\nmore")

    monkeypatch.setattr(rope_kernel_module(), "prewarm", broken)
    pw = rope_prewarm(calls, torch.device("cuda"), torch.bfloat16, 1)
    pw.wait()
    assert pw.as_dict()["status"] == "failed" and pw.as_dict()["error"].startswith("RuntimeError: no driver")


def rope_kernel_module():
    import importlib

    return importlib.import_module("vdbench.kernels.rope")


def test_a_cpu_render_records_why_its_rope_and_block_are_not_fused(tmp_path):
    import json

    from tests.test_attention_prewarm import _cfg
    from vdbench import render as R

    R.render(_cfg(tmp_path, num_frames=5), log=lambda *a: None)
    first = json.loads((tmp_path / "results" / "timing.json").read_text())[0]
    assert first["fused_rope"] == {"setting": "auto", "used": False,
                                   "why_not": "a cpu device (the kernel runs on CUDA)"}
    assert first["attention"]["rope"] == {"fused_calls": 0, "eager_calls": 0, "eager_why": None}
    # and its block passes (--fused_block auto): the same reason, nothing installed, nothing counted
    cpu = "a cpu device (the kernel runs on CUDA)"
    assert first["fused_block"] == {"setting": "auto", "used": False, "why_not": cpu,
                                    "norms": {"used": False, "why_not": cpu, "checks": []}}
    assert first["attention"]["block"]["modulate"] == {"fused_calls": 0, "eager_calls": 0}
    assert first["attention"]["block"]["norm"] == {"fused_calls": 0, "eager_calls": 0}
