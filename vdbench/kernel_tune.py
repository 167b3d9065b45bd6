"""The project's Triton attention kernels (vdbench/kernels) on a GPU: the check and sweep stages of the kernels
suite (bench/suites/kernels.toml); ``bench/gpu_kernels.py`` is its command line.

    python bench/gpu_kernels.py check --out DIR    # kernels vs their torch emulations and fp64 -> DIR/check.json
    python bench/gpu_kernels.py sweep --out DIR    # the tile sweep -> DIR/sweep.csv, DIR/best_configs.json
    python bench/gpu_kernels.py warm '128:0;64:2'  # compile some sweep variants (the sweep's parallel workers)

``check``: every kernel at small odd shapes (S 1, 37, 130, 1000, 4096; D 64 and 128; bf16, fp16 at S 130;
causal at S 130) with the configs the backends use (vdbench/kernels CONFIGS + tuned_configs.json), into outputs
poisoned with NaN; a row is ok when nothing non-finite is left, the rel L2 vs fp64 is below 1e-2 (fav2_triton) or
1e-1 (the quantized kernels) and within 3e-2 of the kernel's torch emulation. Exit 1 if a row is not ok.

``sweep``: ``vdbench.kernels.attention.SWEEP`` per kernel at Wan 1.3B (D128) and CogVideoX-2b (D64), v1's configs
first, then the v2 variants (and fav3_sage pv=fp16 at D128, for the record: never picked); all compiled first by
``--jobs`` worker processes (at most ``--warm_s`` seconds), then timed one by one (the backend call, quantization
pre-pass included) with rel L2 vs fp64 on 2 heads x 4096 queries of the same output. A config that fails to compile
or launch is a row with status "error: ...". The best per kernel is the fastest *eligible* row (:class:`Selection`:
within 5% + 1e-3 of the v1 baseline's rel L2, never PV_ACC); sweep.csv and best_configs.json are rewritten after
every row, so a run cut by its time limit keeps what it measured. To make the winners the backends' defaults:
``cp DIR/best_configs.json vdbench/kernels/tuned_configs.json`` (then the check stage again).

``--dry``: on the CPU at tiny shapes under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before the
kernels are imported, i.e. in the environment), the host clock instead of the GPU timer (``gpu_bench``: the median
of at least 5 warm calls, CUDA events, L2 written over between calls): the stages' logic, not their numbers.
Needs vdbench importable (installed, or ``PYTHONPATH=$PWD`` from the repo root).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import backends as B
from . import kernels as KP
from .helptext import DefaultsHelpFormatter
from .kernel_bench import child_env
from .measure import quality as Q

#: The kernels of vdbench.kernels.attention (its CONFIGS and SWEEP), as the kernels' registry lists them.
NAMES = KP.names(module="vdbench.kernels.attention")
#: The sweep's shapes (B, H, S, D) per head dim: Wan 2.1 1.3B at 480p (D128), CogVideoX-2b (D64); tiny with --dry.
SHAPES = {128: (1, 12, 32760, 128), 64: (1, 30, 17776, 64)}
DRY_SHAPES = {128: (1, 2, 100, 128), 64: (1, 2, 70, 64)}
#: A sweep row is eligible when its rel L2 is at most the v1 baseline's x ELIGIBLE_FACTOR + ELIGIBLE_SLACK.
ELIGIBLE_FACTOR, ELIGIBLE_SLACK = 1.05, 1e-3


@dataclass
class Env:
    """Where a stage runs: output folder, device, the shapes, the timer (``bench(fn, warmup, rep)`` -> median ms)
    and the kernel modules (``A``: vdbench.kernels.attention, ``N``: vdbench.numerics, the emulations) -- passed in, so
    the stages' logic runs on a CPU with stand-ins."""

    out: Path
    dev: torch.device
    shapes: dict
    bench: Callable[[Callable, int, int], float]
    A: Any
    N: Any

    def sync(self) -> None:
        """Wait for the device (a host clock or an output read must see the kernel finished)."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize()


def host_bench(fn, warmup: int, rep: int) -> float:
    """--dry's timer: one call on the host clock (ms); the interpreter's times mean nothing beyond "it ran"."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def gpu_bench(fn, warmup: float, rep: float) -> float:
    """The sweep's GPU timer (ms): the median of ``vdbench.timing.sample_ms``'s warm calls -- ``warmup`` ms of
    warm-up, then max(5, ``rep`` / a call) calls timed with CUDA events, L2 written over between them -- so a slow
    variant gets 5 samples too (do_bench times ``rep`` / a call calls: one or two of a slow variant)."""
    from .timing import sample_ms, spread

    return spread(sample_ms(fn, "cuda", warmup_ms=warmup, rep_ms=rep, first_call=False).samples)["median"]


def make_env(out, dry: bool) -> Env:
    """The real kernel modules on the GPU (:func:`gpu_bench` medians), or on the CPU with --dry."""
    from . import numerics
    from .kernels import attention

    if dry:
        return Env(Path(out), torch.device("cpu"), DRY_SHAPES, host_bench, attention, numerics)
    return Env(Path(out), torch.device("cuda"), SHAPES, gpu_bench, attention, numerics)


def rel(x, r) -> float:
    """Relative L2 of ``x`` vs ``r`` where they lie (the shared definition; outputs stay on the GPU)."""
    return Q.rel_l2(x, r, keep_device=True)


def inputs(env: Env, b, h, s, d, seed=0, k_bias=3.0, dtype=torch.bfloat16):
    """Seeded Q, K, V with a per-channel K bias (what the K smoothing of the quantized kernels is for)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g) + k_bias * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    return [t.to(env.dev, dtype) for t in (q, k, v)]


def emu(env: Env, name, q, k, v, cfg, **kw):
    """The kernel's torch emulation with the same tiles (None for fav2_triton: plain attention, fp64 is its
    reference)."""
    if name == "fav3_sage":
        return env.N.fav3_sage_emulated(q, k, v, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], **kw)
    if name == "fp8_triton":
        return env.N.fp8_triton_emulated(q, k, v, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], **kw)
    return None


def check_ok(name: str, nan_inf: int, rel_l2_fp64: float, rel_l2_emu) -> bool:
    """A check row passes: every output element written and finite, close to fp64 (1e-2 for plain bf16/fp16
    attention, 1e-1 for the quantized kernels) and, where there is an emulation, within 3e-2 of it (the kernel
    computes what its emulation says it does)."""
    ok = nan_inf == 0 and rel_l2_fp64 < (1e-2 if name == "fav2_triton" else 1e-1)
    if rel_l2_emu is not None:
        ok = ok and rel_l2_emu < 3e-2
    return ok


def check_cases(dry: bool):
    """(D, S, dtype, batch, heads, causal options) of the check stage, in order."""
    for d in (64, 128):
        for s in ((1, 37, 130) if dry else (1, 37, 130, 1000, 4096)):
            for dtype in (torch.bfloat16, torch.float16):
                if dtype == torch.float16 and s != 130:
                    continue
                causal = (False, True) if (s == 130 and dtype == torch.bfloat16) else (False,)
                yield d, s, dtype, 1 if dry or s >= 1000 else 2, 2 if s < 4096 else 12, causal


def check(env: Env, dry: bool = False) -> int:
    """The check stage (module doc); writes check.json, prints the failures and the S=4096 rows; returns the
    number of rows not ok."""
    rows, bad = [], 0
    for name in NAMES:
        print(name, B.availability(name, env.dev), flush=True)
    for d, s, dtype, b, h, causals in check_cases(dry):
        q, k, v = inputs(env, b, h, s, d, seed=s + d, dtype=dtype)
        ref = env.N.exact_attention(q, k, v)
        for name in NAMES:
            for kw in ({}, {"pv": "fp16"}) if name == "fav3_sage" else ({},):
                for causal in causals:
                    cfg = env.A.config_for(name, d, env.dev)
                    out = torch.full_like(q, float("nan"))
                    env.A.KERNELS[name](q, k, v, out=out, is_causal=causal, **kw)
                    env.sync()
                    nan = Q.nan_inf(out)
                    r = env.N.exact_attention(q, k, v, is_causal=True) if causal else ref
                    e = emu(env, name, q, k, v, cfg, is_causal=causal, **kw)
                    row = dict(kernel=name + ("[pv=fp16]" if kw else ""), D=d, S=s, dtype=str(dtype)[6:],
                               causal=causal, rel_l2_fp64=rel(out, r), rel_l2_emu=rel(out, e) if e is not None else None,
                               emu_rel_l2_fp64=rel(e, r) if e is not None else None, nan_inf=nan)
                    row["ok"] = check_ok(name, nan, row["rel_l2_fp64"], row["rel_l2_emu"])
                    bad += not row["ok"]
                    rows.append(row)
    (env.out / "check.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        if not r["ok"] or (r["S"] == 4096 and not r["causal"]):
            print(("FAIL " if not r["ok"] else "") + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in r.items()), flush=True)
    print(f"check: {len(rows) - bad}/{len(rows)} ok", flush=True)
    return bad


def sweep_variants(sweep: dict, d: int) -> list:
    """[(kernel, kwargs, label, cfg)] in sweep order: ``sweep[d]`` per kernel (vdbench.kernels.attention.SWEEP,
    v1's configs first), then at D128 fav3_sage pv=fp16 with v1's tiles and the first all-flags v2 config (the
    pv=fp16 call uses fav3_sage's config)."""
    out = [(n, {}, n, dict(c)) for n in NAMES for c in sweep[d][n]]
    if d == 128:
        v2 = next(c for c in sweep[d]["fav3_sage"] if c.get("TMA") and c.get("FOLD"))
        for c in (sweep[d]["fav3_sage"][0], v2):
            out.append(("fav3_sage", {"pv": "fp16"}, "fav3_sage[pv=fp16]", dict(c)))
    return out


def parse_warm(arg: str) -> dict[int, list[int]]:
    """``'128:0;128:3;64:1'`` (a warm worker's share: head dim : index into :func:`sweep_variants`) ->
    {128: [0, 3], 64: [1]}."""
    by_d: dict[int, list[int]] = {}
    for item in arg.split(";"):
        d, _, i = item.partition(":")
        if not (d.strip().isdigit() and i.strip().isdigit()):
            raise ValueError(f"warm: {item!r} is not HEAD_DIM:INDEX")
        by_d.setdefault(int(d), []).append(int(i))
    return by_d


def warm_groups(shapes: dict, counts: dict[int, int], jobs: int) -> list[str]:
    """The ``warm`` arguments of ``jobs`` workers: every (head dim, variant) once, round-robin so each worker gets
    a mix (TMA and pointer variants, both head dims); workers with nothing to do are left out."""
    work = [(d, i) for d in shapes for i in range(counts[d])]
    return [";".join(f"{d}:{i}" for d, i in work[j::jobs]) for j in range(jobs) if work[j::jobs]]


def inputs_fast(env: Env, b, h, s, d):
    """Unseeded inputs of :func:`inputs`' shapes, strides and alignment: what a compiled variant depends on."""
    return [torch.randn(b, h, s, d, device=env.dev, dtype=torch.bfloat16) for _ in range(3)]


def warm(env: Env, d: int, idx) -> None:
    """Compile the given sweep variants at the real shape (fills Triton's on-disk cache); failures are printed,
    the timed sweep reports them as rows."""
    b, h, s, _ = env.shapes[d]
    q, k, v = inputs_fast(env, b, h, s, d)
    vs = sweep_variants(env.A.SWEEP, d)
    for i in idx:
        name, kw, label, cfg = vs[i]
        t0 = time.time()
        try:
            env.A.KERNELS[name](q, k, v, config=cfg, **kw)
            pre = env.A.prepass(name, cfg)
            if pre and not kw:
                pre(q, k, v)
            env.sync()
            print(f"  warm {label} D{d} {env.A.config_label(cfg)} {time.time() - t0:.1f}s", flush=True)
        except Exception as ex:  # noqa: BLE001 - the timed loop reports it as a row
            print(f"  warm {label} D{d} {env.A.config_label(cfg)} failed: {type(ex).__name__}: {str(ex)[:120]}",
                  flush=True)


def prewarm(env: Env, jobs: int, limit: float) -> None:
    """Compile every variant in ``jobs`` worker processes first (Triton compiles on one CPU core each): the
    timed loop then loads them from the cache. Best effort: whatever isn't compiled within ``limit`` seconds
    compiles in the loop."""
    t0 = time.time()
    counts = {d: len(sweep_variants(env.A.SWEEP, d)) for d in env.shapes}
    procs = [subprocess.Popen([sys.executable, "-m", "vdbench.kernel_tune", "warm", arg], env=child_env())
             for arg in warm_groups(env.shapes, counts, jobs)]
    for p in procs:
        try:
            p.wait(timeout=max(1.0, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            print("  warm worker killed at the time limit", flush=True)
    print(f"prewarm: {sum(counts.values())} variants in {len(procs)} workers, {time.time() - t0:.1f}s", flush=True)


class Selection:
    """The sweep's pick of a default config per kernel and head dim (``"kernel:D"``). The first config measured
    ok for a key (v1's, first in SWEEP) sets the accuracy baseline; a row is eligible only if it ran ok, is a
    plain backend call (no extra kwargs such as pv=fp16), does not accumulate P.V in fp8 (PV_ACC: on the H200
    it matched v1 on random inputs but rendered the Wan 1.3B pipeline at 24.7 dB vs FA3, v1 41.9 dB -- fp8
    tensor-core accumulation keeps too few bits over 256 KV tiles; docs/PERFORMANCE.md) and its rel L2 vs fp64
    is within ELIGIBLE_FACTOR x baseline + ELIGIBLE_SLACK. So no speed is bought with accuracy. The best is the
    fastest eligible row."""

    def __init__(self):
        self.base: dict[str, float] = {}
        self.best: dict[str, dict] = {}

    def add(self, key: str, cfg: dict, kw: dict, status: str, err: float, ms: float, tflops: float) -> bool:
        """Record one measured row; returns whether it was eligible."""
        if not kw and key not in self.base and status == "ok":
            self.base[key] = err
        eligible = (status == "ok" and not kw and not cfg.get("PV_ACC", 0)
                    and err <= self.base.get(key, float("inf")) * ELIGIBLE_FACTOR + ELIGIBLE_SLACK)
        if eligible and (key not in self.best or ms < self.best[key]["ms"]):
            self.best[key] = dict(cfg, ms=ms, tflops=tflops, rel_l2_fp64=err)
        return eligible


def write_results(out: Path, rows: list[dict], best: dict) -> None:
    """sweep.csv (every row so far) and best_configs.json (the format of vdbench/kernels/tuned_configs.json)."""
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "best_configs.json").write_text(json.dumps(best, indent=1))


def measure(env: Env, name, kw, cfg, q, k, v, ref_small, nq):
    """One sweep variant: (ms, quantization pre-pass ms or None, rel L2, status, applied flags); a variant that
    does not compile or launch (shared memory, registers) is a row with its error, never the end of the sweep."""
    fn = lambda: env.A.KERNELS[name](q, k, v, config=cfg, **kw)  # noqa: E731
    try:
        out = fn()
        env.sync()
        applied = "+".join(f for f in ("tma_qk", "tma_v", "pv_acc", "fold") if env.A.LAST_LAUNCH.get(f)) or "-"
        err = rel(out[:, :2, :nq], ref_small)
        status = "ok" if torch.isfinite(out).all() else "NaN"
        del out
        ms = env.bench(fn, 25, 100)
        pre = env.A.prepass(name, cfg)
        qms = env.bench(lambda: pre(q, k, v), 5, 20) if pre and not kw else None
        return ms, qms, err, status, applied
    except Exception as ex:  # noqa: BLE001
        return float("nan"), None, float("nan"), f"error: {type(ex).__name__}: {str(ex)[:80]}", "?"


def sweep(env: Env, jobs: int = 8, warm_s: float = 50.0, dry: bool = False) -> dict:
    """The sweep stage (module doc): rows to sweep.csv, the winners to best_configs.json after every row;
    returns the winners."""
    if not dry and jobs:
        prewarm(env, jobs, warm_s)
    rows, pick = [], Selection()
    for d, (b, h, s, _) in env.shapes.items():
        q, k, v = inputs(env, b, h, s, d)
        flops = 4 * b * h * s * s * d
        nq = min(4096, s)
        ref_small = env.N.exact_attention(q[:, :2, :nq], k[:, :2], v[:, :2])
        for name, kw, label, cfg in sweep_variants(env.A.SWEEP, d):
            t0 = time.time()
            ms, qms, err, status, applied = measure(env, name, kw, cfg, q, k, v, ref_small, nq)
            tflops = flops / ms / 1e9 if ms == ms else float("nan")
            eligible = pick.add(f"{name}:{d}", cfg, kw, status, err, ms, tflops)
            row = dict(kernel=label, D=d, H=h, S=s, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], TMA=cfg.get("TMA", 0),
                       PV_ACC=cfg.get("PV_ACC", 0), FOLD=cfg.get("FOLD", 0), applied=applied, ms=ms, quant_ms=qms,
                       tflops=tflops, rel_l2_fp64=err, status=status, eligible=eligible,
                       wall_s=round(time.time() - t0, 1))
            rows.append(row)
            print(f"{label:20s} D{d} {env.A.config_label(cfg):24s} {ms:8.3f} ms  {row['tflops']:6.1f} TFLOP/s  "
                  f"quant {qms if qms is None else round(qms, 3)} ms  relL2 {err:.2e}  {status}  [{applied}]"
                  f"{'' if eligible or kw else '  (not eligible)'}  ({row['wall_s']}s)", flush=True)
            write_results(env.out, rows, pick.best)
        del q, k, v
        if env.dev.type == "cuda":
            torch.cuda.empty_cache()
    print("best (copy best_configs.json to vdbench/kernels/tuned_configs.json to make these the defaults):", flush=True)
    for key, c in pick.best.items():
        print(f"  {key:16s} {env.A.config_label(c):24s} {c['tflops']:.0f} TFLOP/s  relL2 {c['rel_l2_fp64']:.2e}",
              flush=True)
    return pick.best


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    for stage in ("check", "sweep"):
        sp = sub.add_parser(stage, help=f"the {stage} stage (see above)", formatter_class=DefaultsHelpFormatter)
        sp.add_argument("--out", required=True, help="folder for the results (created)")
        sp.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton's interpreter: the logic only")
        if stage == "sweep":
            sp.add_argument("--jobs", type=int, default=int(os.environ.get("SWEEP_JOBS", "8")),
                            help="parallel compile workers before the timed loop (0: none; env SWEEP_JOBS)")
            sp.add_argument("--warm_s", type=float, default=float(os.environ.get("SWEEP_WARM_S", "50")),
                            help="time limit of the parallel compile (s; env SWEEP_WARM_S)")
    sp = sub.add_parser("warm", help="compile sweep variants HEAD_DIM:INDEX;... (prewarm's workers)")
    sp.add_argument("variants", type=parse_warm)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.stage == "warm":
        env = make_env(".", dry=False)
        for d, idx in a.variants.items():
            warm(env, d, idx)
        return 0
    Path(a.out).mkdir(parents=True, exist_ok=True)
    env = make_env(a.out, a.dry)
    if a.stage == "check":
        return 1 if check(env, dry=a.dry) else 0
    sweep(env, jobs=a.jobs, warm_s=a.warm_s, dry=a.dry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
