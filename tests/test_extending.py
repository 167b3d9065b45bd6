"""A new backend, own Triton kernel, family and suite each come from one file, as docs/ARCHITECTURE.md says: each
toy below is written to a file of its own, loaded the way a plugin would be, and then served by the existing tools
with no other file touched (the attention bench runs the backend and the Triton kernel's derived backend, the render
CLI takes the family, the suite runner dry-runs the suite)."""

import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vdbench import backends as B
from vdbench import cli, families, kernels

from tests.conftest import triton_interpreter

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(tmp_path, name, text) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_a_backend_from_one_file_is_benched_like_any_other(tmp_path, capsys):
    f = _write(tmp_path, "toy_backend.py", '''
        import torch.nn.functional as F
        from vdbench.backends import Backend, register

        ORDER = 99

        def attend(q, k, v, *, scale=None, is_causal=False):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal)

        register(Backend(name="toy_attn", description="a toy: torch's sdpa under another name", fn=attend,
                         kernel="toy.sdpa", no_lse_reason="a toy"))
    ''')
    _load(f)
    try:
        assert B.resolve("toy_attn").kernel == "toy.sdpa" and "toy_attn" in B.names()
        from vdbench import kernel_bench as ba

        out = tmp_path / "k.csv"
        assert ba.main(["--preset", "wan2.1-1.3b-480p", "--max_seq", "64", "--device", "cpu", "--dtype", "fp32",
                        "--kernel", "toy_attn", "-metric", "accuracy", "-o", str(out)]) == 0
        import csv

        rows = list(csv.DictReader(open(out)))
        assert rows and all(r["status"] == "ok" and float(r["rel_l2"]) < 1e-5 for r in rows)
    finally:
        B.unregister("toy_attn")
    capsys.readouterr()


TOY_TRITON = '''
    import os

    import torch
    import triton
    import triton.language as tl

    from vdbench import kernels

    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


    @triton.jit
    def _toy_fwd(Q, K, V, Out, sq, sk, sm_scale, BLOCK: tl.constexpr, D: tl.constexpr):
        # one program per (batch, head), every key in one tile: the whole softmax row at once
        bh = tl.program_id(0)
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, D)
        q = tl.load(Q + bh * sq * D + rows[:, None] * D + cols[None, :], mask=rows[:, None] < sq, other=0.0)
        k = tl.load(K + bh * sk * D + rows[:, None] * D + cols[None, :], mask=rows[:, None] < sk, other=0.0)
        v = tl.load(V + bh * sk * D + rows[:, None] * D + cols[None, :], mask=rows[:, None] < sk, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(rows[None, :] < sk, s, float("-inf"))
        p = tl.exp(s - tl.max(s, 1)[:, None])
        o = tl.dot(p / tl.sum(p, 1)[:, None], v)
        tl.store(Out + bh * sq * D + rows[:, None] * D + cols[None, :], o, mask=rows[:, None] < sq)


    def toy_triton(q, k, v, *, scale=None, is_causal=False):
        b, h, sq, d = q.shape
        sk = k.shape[2]
        q, k, v = (t.float().contiguous() for t in (q, k, v))
        out = torch.empty_like(q)
        block = max(16, triton.next_power_of_2(max(sq, sk)))
        _toy_fwd[(b * h,)](q, k, v, out, sq, sk, d ** -0.5 if scale is None else scale, BLOCK=block, D=d)
        return out


    def aot_specs(d=128, causal=False, config=None):
        return {"toy_triton": (_toy_fwd, {"Q": "*fp32", "K": "*fp32", "V": "*fp32", "Out": "*fp32",
                                          "sm_scale": "fp32"}, dict(BLOCK=64, D=d), dict(num_warps=4))}


    kernels.register(kernels.Kernel("toy_triton", __name__, (8, 0), "a toy: one-tile attention in Triton",
                                    dtypes=(torch.float32,), head_dims=(64,)))
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_an_own_triton_kernel_from_one_file_is_a_backend_benched_like_any_other(tmp_path, monkeypatch, capsys):
    """A Triton kernel's module registering itself in ``vdbench.kernels.KERNELS`` gets its backend entry, its probe and
    its place in the ahead-of-time check from that one line (run here under Triton's interpreter on the CPU)."""
    if torch.cuda.is_available():
        pytest.skip("CPU-interpreter check")
    _write(tmp_path, "toy_triton_kernel.py", TOY_TRITON)
    monkeypatch.syspath_prepend(str(tmp_path))
    with triton_interpreter():
        importlib.import_module("toy_triton_kernel")
        try:
            be = B.resolve("toy_triton")
            assert be.kernel == "vdbench.toy_triton" and "toy_triton" in B.names() and be.bench.prepass is None
            assert kernels.probe("toy_triton", "cpu")[0]
            assert B.availability("toy_triton", "cpu", torch.float32, 64)[0]
            from vdbench.kernels import aot

            with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):  # its aot_specs are reached, not compiled
                aot.specs(only=["toy_triton"])
            from vdbench import kernel_bench as ba

            monkeypatch.setitem(ba.PRESETS, "tiny-d64", (1, 2, 40, 40, 64))
            out = tmp_path / "k.csv"
            assert ba.main(["--preset", "tiny-d64", "--device", "cpu", "--dtype", "fp32", "--kernel", "toy_triton",
                            "--metric", "accuracy", "-o", str(out)]) == 0
            import csv

            rows = list(csv.DictReader(open(out)))
            assert rows and all(r["status"] == "ok" and float(r["rel_l2"]) < 1e-5 for r in rows), rows
        finally:
            kernels.unregister("toy_triton")
            sys.modules.pop("toy_triton_kernel", None)
    assert "toy_triton" not in B.names() and "toy_triton" not in kernels.KERNELS
    capsys.readouterr()


def test_a_family_from_one_file_is_rendered_by_the_shared_cli(tmp_path, capsys):
    f = _write(tmp_path, "toyfam.py", '''
        import dataclasses
        from vdbench.families.wan import FAMILY as WAN

        # Wan's pipeline and rules under a new name; its own tiny / random variants would be listed here
        FAMILY = dataclasses.replace(WAN, name="toyfam", order=90, tiny_variants=(), random_variants={},
                                     default_tiny={}, attention_presets={}, attention_grids={}, vae_configs={},
                                     transformer_classes=(), xfuser={})
    ''')
    fam = _load(f).FAMILY
    families.register(fam)
    try:
        assert families.get("toyfam") is fam
        assert cli.main("toyfam", ["--model", "org/toy-video", "--output_dir", str(tmp_path / "o"),
                                   "--print_output_path"]) == 0
        assert str(tmp_path / "o") in capsys.readouterr().out
    finally:
        families.unregister("toyfam")


def test_a_suite_from_one_file_dry_runs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("suite", ROOT / "bench" / "suite.py")
    S = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(S)
    suites = tmp_path / "suites"
    suites.mkdir()
    _write(suites, "toy.toml", '''
        description = "a toy suite"
        [vars]
        N = 2
        [[case]]
        name = "hello_{i}"
        for = {i = "1..{N}"}
        run = ["{py}", "-c", "print({i})"]
    ''')
    monkeypatch.setattr(S, "SUITES", suites)
    got = S.run_suite("toy", out=tmp_path / "out", budget_s=60, sets={}, dry_run=True, log=lambda *a: None)
    assert [o["name"] for o in got] == ["hello_1", "hello_2"] and all(o["dry"] for o in got)
