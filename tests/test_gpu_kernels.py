"""vdbench.kernel_tune (bench/gpu_kernels.py: the check and sweep runs of the kernels suite) on a CPU: its arguments,
the warm workers' shares, the sweep's variant order and its choice of defaults, the files it writes, and both stages run
end to end over stand-in kernels (torch attention with injected faults, a fake timer), so everything but the
Triton kernels' own numbers is checked here (tests/test_kernels.py checks those under the interpreter)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import types
from pathlib import Path

import pytest
import torch

from vdbench import numerics
import torch.nn.functional as F

from vdbench import kernel_tune as gk

ROOT = Path(__file__).resolve().parents[1]


def _c(bm, bn, tma=0, pv_acc=0, fold=0):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=2, TMA=tma, PV_ACC=pv_acc, FOLD=fold)


# a SWEEP of vdbench.kernels.attention's shape: v1's configs first, then v2 variants (flags), per head dim
SWEEP = {
    128: {"fav3_sage": [_c(128, 128), _c(128, 64), _c(128, 128, 1, 0, 1), _c(128, 128, 1, 1, 1)],
          "fp8_triton": [_c(128, 128), _c(64, 64, 1)],
          "fav2_triton": [_c(128, 64), _c(64, 64)]},
    64: {"fav3_sage": [_c(128, 64)], "fp8_triton": [_c(128, 64)], "fav2_triton": [_c(128, 64), _c(64, 32)]},
}


def test_arguments():
    p = gk.build_parser()
    a = p.parse_args(["sweep", "--out", "o", "--jobs", "0", "--warm_s", "5", "--dry"])
    assert (a.stage, a.out, a.jobs, a.warm_s, a.dry) == ("sweep", "o", 0, 5.0, True)
    assert p.parse_args(["warm", "128:0;128:3;64:1"]).variants == {128: [0, 3], 64: [1]}
    for bad in ([], ["check"], ["warm", "128-0"], ["bench", "--out", "o"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(ValueError, match="HEAD_DIM:INDEX"):
        gk.parse_warm("128:a")


def test_warm_env_defaults(monkeypatch):
    monkeypatch.setenv("SWEEP_JOBS", "3")
    monkeypatch.setenv("SWEEP_WARM_S", "12.5")
    a = gk.build_parser().parse_args(["sweep", "--out", "o"])
    assert (a.jobs, a.warm_s, a.dry) == (3, 12.5, False)


def test_warm_groups_cover_every_variant_once_round_robin():
    groups = gk.warm_groups({128: None, 64: None}, {128: 5, 64: 2}, jobs=3)
    assert groups == ["128:0;128:3;64:1", "128:1;128:4", "128:2;64:0"]
    items = [(d, i) for g in groups for d, idx in gk.parse_warm(g).items() for i in idx]
    assert sorted(items) == sorted([(128, i) for i in range(5)] + [(64, i) for i in range(2)])
    assert gk.warm_groups({64: None}, {64: 2}, jobs=8) == ["64:0", "64:1"]  # no idle workers


def test_sweep_variants_order_and_the_pv_fp16_records():
    v = gk.sweep_variants(SWEEP, 128)
    assert [(n, lab) for n, _, lab, _ in v[:4]] == [("fav3_sage", "fav3_sage")] * 4
    assert [n for n, kw, _, _ in v if not kw] == ["fav3_sage"] * 4 + ["fp8_triton"] * 2 + ["fav2_triton"] * 2
    extra = [(kw, lab, cfg) for _, kw, lab, cfg in v if kw]
    # v1's tiles and the first config with TMA and FOLD, each with pv=fp16, after everything else
    assert extra == [({"pv": "fp16"}, "fav3_sage[pv=fp16]", SWEEP[128]["fav3_sage"][0]),
                     ({"pv": "fp16"}, "fav3_sage[pv=fp16]", SWEEP[128]["fav3_sage"][2])]
    assert all(cfg is not SWEEP[128]["fav3_sage"][0] for _, _, _, cfg in v)  # copies: rows never alias SWEEP
    assert not any(kw for _, kw, _, _ in gk.sweep_variants(SWEEP, 64))


def test_selection_never_buys_speed_with_accuracy():
    s = gk.Selection()
    base = _c(128, 128)
    assert not s.add("k:128", base, {}, "error: OutOfResources", math.nan, math.nan, math.nan)  # no baseline yet
    assert s.add("k:128", base, {}, "ok", 0.010, 2.0, 100.0) and s.base == {"k:128": 0.010}
    assert s.add("k:128", _c(64, 64), {}, "ok", 0.010 * 1.05 + 1e-3, 1.9, 105.0)  # at the bound: eligible
    assert not s.add("k:128", _c(64, 32), {}, "ok", 0.0116, 0.5, 400.0)  # faster but less accurate
    assert not s.add("k:128", _c(128, 64, pv_acc=1), {}, "ok", 0.001, 0.4, 500.0)  # PV_ACC: never a default
    assert not s.add("k:128", base, {"pv": "fp16"}, "ok", 0.001, 0.3, 600.0)  # not the backend call
    assert not s.add("k:128", _c(32, 32), {}, "NaN", 0.001, 0.2, 700.0)
    assert s.add("k:128", _c(128, 32), {}, "ok", 0.005, 2.5, 80.0)  # eligible, slower: not the best
    assert s.best["k:128"] == dict(_c(64, 64), ms=1.9, tflops=105.0, rel_l2_fp64=0.010 * 1.05 + 1e-3)
    assert s.base == {"k:128": 0.010}  # the first ok row stays the baseline


def test_check_ok_thresholds():
    assert gk.check_ok("fav2_triton", 0, 0.009, None) and not gk.check_ok("fav2_triton", 0, 0.011, None)
    assert gk.check_ok("fav3_sage", 0, 0.09, 0.029)
    assert not gk.check_ok("fav3_sage", 0, 0.09, 0.031)  # far from its own emulation
    assert not gk.check_ok("fp8_triton", 1, 0.0, 0.0)  # an element left unwritten (NaN poison)


def test_write_results_is_the_tuned_configs_format(tmp_path):
    rows = [dict(kernel="fav3_sage", D=128, ms=1.5, eligible=True), dict(kernel="fp8_triton", D=128, ms=2.0,
                                                                          eligible=False)]
    best = {"fav3_sage:128": dict(_c(128, 64), ms=1.5, tflops=300.0, rel_l2_fp64=0.02)}
    gk.write_results(tmp_path, rows, best)
    with open(tmp_path / "sweep.csv") as f:
        assert [r["kernel"] for r in csv.DictReader(f)] == ["fav3_sage", "fp8_triton"]
    loaded = json.loads((tmp_path / "best_configs.json").read_text())
    assert loaded == best and set(loaded["fav3_sage:128"]) >= {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}


def _attention(q, k, v, is_causal=False, **_):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal).to(q.dtype)


def _fake_env(tmp_path, bench=None):
    """Stand-ins for vdbench.kernels.attention / the emulations: torch attention, with one fault per kernel kind --
    fp8_triton leaves causal outputs unwritten, the 32-wide fav2 tile 'fails to compile'."""
    launches = {}

    def kernel(name):
        def run(q, k, v, *, is_causal=False, config=None, out=None, pv="fp8"):
            if config is not None and name == "fav2_triton" and config["BLOCK_N"] == 32:
                raise RuntimeError("out of resource: shared memory")
            launches.clear()
            launches.update(tma_qk=bool(config and config.get("TMA")), fold=bool(config and config.get("FOLD")))
            res = _attention(q, k, v, is_causal=is_causal)
            if out is None:
                return res
            if not (name == "fp8_triton" and is_causal):
                out.copy_(res)
            return out
        return run

    A = types.SimpleNamespace(
        SWEEP=SWEEP, KERNELS={n: kernel(n) for n in gk.NAMES}, LAST_LAUNCH=launches,
        config_for=lambda name, d, dev: _c(32, 32),
        prepass=lambda name, cfg: None if name == "fav2_triton" else (lambda q, k, v: q.abs().amax()),
        config_label=lambda cfg: f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}" + (" tma" if cfg.get("TMA") else ""))
    N = types.SimpleNamespace(fav3_sage_emulated=lambda q, k, v, block_m, block_n, **kw: _attention(q, k, v, **kw),
                              fp8_triton_emulated=lambda q, k, v, block_m, block_n, **kw: _attention(q, k, v, **kw),
                              exact_attention=numerics.exact_attention)
    return gk.Env(tmp_path, torch.device("cpu"), gk.DRY_SHAPES, bench or gk.host_bench, A, N)


def test_check_stage_end_to_end(tmp_path, capsys):
    env = _fake_env(tmp_path)
    bad = gk.check(env, dry=True)
    rows = json.loads((tmp_path / "check.json").read_text())
    # per head dim: S 1 and 37 (bf16), S 130 (bf16 plain + causal, fp16): fav3_sage twice (pv=fp16)
    assert len(rows) == 2 * (4 + 4 + 8 + 4)
    failed = [r for r in rows if not r["ok"]]
    assert bad == len(failed) == 2 and all(r["kernel"] == "fp8_triton" and r["causal"] for r in failed)
    assert all(r["nan_inf"] > 0 for r in failed)
    ok = [r for r in rows if r["ok"]]
    assert all(r["rel_l2_fp64"] < 1e-2 for r in ok)
    assert all(r["rel_l2_emu"] is None for r in rows if r["kernel"] == "fav2_triton")
    out = capsys.readouterr().out
    assert out.count("FAIL ") == 2 and f"check: {len(rows) - 2}/{len(rows)} ok" in out


def test_sweep_stage_end_to_end_picks_the_fastest_eligible(tmp_path, capsys, monkeypatch):
    speed = {(128, 64): 1.0, (128, 128): 2.0, (64, 64): 1.5}  # the fake timer: ms by the variant's tile
    cur = {}

    def bench(fn, warmup, rep):
        fn()
        return speed[(cur["cfg"]["BLOCK_M"], cur["cfg"]["BLOCK_N"])]

    measure = gk.measure

    def measure_noting_the_variant(env_, name, kw, cfg, *a):
        cur["cfg"] = cfg
        return measure(env_, name, kw, cfg, *a)

    monkeypatch.setattr(gk, "measure", measure_noting_the_variant)
    best = gk.sweep(_fake_env(tmp_path, bench), dry=True)
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(gk.sweep_variants(SWEEP, 128)) + len(gk.sweep_variants(SWEEP, 64))
    err = [r for r in rows if r["status"].startswith("error")]
    assert [(r["kernel"], r["D"], r["BLOCK_N"], r["eligible"]) for r in err] == [("fav2_triton", "64", "32", "False")]
    assert {r["applied"] for r in rows if r["TMA"] == "1" and r["status"] == "ok"} == {"tma_qk", "tma_qk+fold"}
    assert json.loads((tmp_path / "best_configs.json").read_text()) == best
    # fastest eligible per kernel: the 128x64 tile where the list has one, else what is there
    assert {k: (c["BLOCK_M"], c["BLOCK_N"]) for k, c in best.items()} == {
        "fav3_sage:128": (128, 64), "fp8_triton:128": (64, 64), "fav2_triton:128": (128, 64),
        "fav3_sage:64": (128, 64), "fp8_triton:64": (128, 64), "fav2_triton:64": (128, 64)}
    assert all(c["rel_l2_fp64"] < 1e-2 and c["ms"] == speed[(c["BLOCK_M"], c["BLOCK_N"])] for c in best.values())
    assert "best (copy best_configs.json" in capsys.readouterr().out


def test_main_runs_the_stage_and_returns_its_verdict(tmp_path, monkeypatch):
    monkeypatch.setattr(gk, "make_env", lambda out, dry: _fake_env(tmp_path / "o"))
    assert gk.main(["check", "--out", str(tmp_path / "o"), "--dry"]) == 1  # the fp8_triton causal fault
    assert (tmp_path / "o" / "check.json").exists()


@pytest.mark.minutes
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_both_stages_run_the_real_kernels_under_the_interpreter(tmp_path, capsys):
    """The script's main as the kernels suite runs it, with --dry: the project's kernels under Triton's interpreter
    (in this process: the kernel modules re-imported with the interpreter on, as tests/test_kernels.py does). Every
    check row passes and the sweep writes one row per variant and a winner per kernel and head dim."""
    from tests.conftest import triton_interpreter

    with triton_interpreter("vdbench.kernels.quant", "vdbench.kernels.attention"):
        for stage in ("check", "sweep"):
            assert gk.main([stage, "--out", str(tmp_path), "--dry"]) == 0, capsys.readouterr().out[-3000:]
    assert all(r["ok"] for r in json.loads((tmp_path / "check.json").read_text()))
    best = json.loads((tmp_path / "best_configs.json").read_text())
    assert set(best) == {f"{n}:{d}" for n in gk.NAMES for d in (128, 64)}
    assert not any(c["PV_ACC"] for c in best.values())
