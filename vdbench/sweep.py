"""Which attention backend for this model, at this size, on this machine: one command that measures and ranks.

    python sweep.py --model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81 --budget_min 15
    python sweep.py --model tiny --budget_min 3                        # on a CPU: the plumbing, no speed figures
    python sweep.py --model tiny --stacks "fav3+compile" "sdpa+vae=fast"   # stacks beside the plain backends

What it does, in order, everything under ``--out`` (default ``outputs/sweep``):

1. **What runs here**: every registered backend with whether it can run on this device, and why not
   (``backends.txt``).
2. **The model's real attention inputs**: one short render with ``--save_inputs`` (one denoising step), then
   ``bench/bench_attention.py`` on those captures for every backend that runs here, ``default`` and the exact
   ``reference`` included: speed with n and spread, accuracy against exact fp64 attention (``kernels/``: its CSV,
   JSON and records). The bench takes at most ``--kernel_max_s`` (15% of the budget) before it stops starting
   captures of shapes it has already benched. Where a second GPU is visible both run on it, beside ``default``'s
   render on the renders' GPU (``--bench_beside``); the candidates and every multi-GPU render wait for them. With
   ``--layout_backends`` naming the backends (``fav3``) neither runs: those are the candidates, each render estimated
   at the slowest render so far, and a verdict short of renders has no kernel-bench ranking to fall back on (it says so).
3. **Renders**: the candidates -- the backends that run here, are not emulations, and stayed within
   ``--max_rel_l2`` of exact attention on the captures, fastest first, at most ``--max_candidates`` -- plus the
   pipeline's own attention (``default``, the speed baseline), the exact ``reference`` (the quality baseline) and
   every ``--stacks`` entry, same prompt, seed and size, each in its own process and folder (``runs/<name>/``).
   The budget buys them in this order: ``default``, the candidates, the stacks, the ``reference`` last. Each render
   starts only when its estimate (x1.2, plus its quality comparison) fits in what is left: default's measured
   render with the step's attention time swapped for that backend's, from the kernel bench on the captures and the
   calls a step makes (:func:`estimate_render_s`; the exact reference is slow because exact fp32 attention is, and
   is predicted so). Where the reference does not fit, the quality columns read against the fastest rendered
   exact-kernel render (:func:`quality_baseline`) and the column titles and the verdict say so. A re-run skips the
   renders already done (their records are read back) and spends what is left of the same budget
   (``progress.json``); ``--stop_after_min`` bounds one run alone (a machine lent for ten minutes at a time).
4. **The ranking** (``sweep.csv``, ``sweep.json``, ``report.html``, ``records.jsonl``): warm ms/step with p20-p80
   and n and beside it the joules per warm step (every card; a GPU's NVML counter), speed-up against ``default``,
   end-to-end seconds, one-time seconds, PSNR / SSIM against the quality baseline (``quality_vs``), peak memory,
   the kernels that ran; the Pareto set on (warm step, PSNR); and the verdict line: the fastest within
   ``--psnr_tolerance_db`` of exact, and the fastest overall. Where fewer candidates were rendered than planned, it
   says how many of how many, speaks of those, and ends with the kernel bench's predicted ranking, marked
   provisional.

A stack is ``<attention type>[+option...]`` (:func:`vdbench.measure.record.split_stack`): ``compile``
(``--use_torch_compile``), ``compile=<backend>[:<mode>]`` (with ``--compile_backend`` / ``--compile_mode``),
``fp8gemm`` (``--use_fp8_gemms``), ``fp8gemm=<scope>`` (``--use_fp8_gemms <scope>``: ``fp8gemm=ffn``, the
feed-forward layers only), ``bf16te`` (``--use_bf16_te_gemms``), ``eagerblock`` (``--fused_block off``: the blocks'
elementwise passes unfused, the baseline of the fused default), ``vae=<mode>`` (``--vae_decode``),
``encode=<mode>`` (``--vae_encode``), a step cache's spec (``--cache``: ``fbc:threshold=0.05``, or
``cache=fbc:threshold=0.05``). Its row is named by the stack's one spelling, the ``stack`` its render records
(``sagev2_fp8:gran=per_warp+compile+fp8gemm+vae=fast``). CPU figures are not
speed figures (said in the verdict and per row); emulations are never ranked on speed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import html
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import backends as B
from . import families
from .helptext import DefaultsHelpFormatter
from .measure.record import Record, Writer, command_line, commit, layout_ranks, layout_tag, now, parse_layout, read
from .report import NEGATIVE_ONE_TIME_NOTE, break_even, break_even_text, load_frames, one_time_cell, pareto_front

__all__ = ["Candidate", "parse_stack", "plan_candidates", "rank", "verdict", "main"]

ROOT = Path(__file__).resolve().parents[1]

#: The speed baseline (the pipeline's own attention) and the quality reference (exact attention) every sweep renders.
BASELINE, REFERENCE = "default", "reference"

#: Why each is in every sweep (the ``why`` column).
BASELINE_WHY, REFERENCE_WHY = "baseline: the pipeline's own attention", "quality reference: exact attention"

#: The kernel bench's share of the budget (``--kernel_max_s``'s default): past it, it starts no further input of a
#: shape already benched. On 4 H200s at Wan 1.3B 480p the unbounded bench (8 captures + a random input, 17 kernels)
#: and the capture took 363 s of a 420 s budget: the renders are what the budget is for.
KERNEL_SHARE = 0.15

#: Stack options -> the render flags they add (the grammar: :func:`vdbench.measure.record.split_stack`).
STACK_OPTIONS = {"compile": ["--use_torch_compile"], "fp8gemm": ["--use_fp8_gemms"], "bf16te": ["--use_bf16_te_gemms"],
                 "eagerblock": ["--fused_block", "off"]}
STACK_VALUES = {"fp8gemm": "--use_fp8_gemms", "vae": "--vae_decode", "encode": "--vae_encode", "cache": "--cache"}

#: What a stack option adds to a render once (its first step or warm-up call), until a render of this sweep measured it
#: (then the most it measured): the first-call costs measured on an H200 at Wan 1.3B 480p, docs/PERFORMANCE.md §3.6
#: (a regional compile: 8-11 s) and §10.3 (the feed-forward fp8 GEMMs' warm-up call, compile included, 14.1 s without
#: inductor's coordinate-descent tuning, the default; every block GEMM in fp8, not measured without it, is given the
#: same prior).
OPTION_ONE_TIME_S = {"compile": 11.0, "fp8gemm": 15.0, "fp8gemm=ffn": 15.0, "bf16te": 0.0, "eagerblock": 0.0}


@dataclass
class Candidate:
    """One render of the sweep: its name (the stack's one spelling: what the render records as its ``stack``), the
    attention type and the extra render flags; ``why``: why it is in the sweep (a role or the kernel bench's
    figure)."""

    name: str
    attention: str
    flags: list = field(default_factory=list)
    why: str = ""
    is_reference: bool = False
    nproc: int = 1  # the processes it renders on (a layout: under torchrun, one GPU each)

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.name)

    @property
    def exact(self) -> bool:
        """Its render computes attention exactly at the model's precision and changes nothing else: a real, dense,
        non-quantized kernel (:attr:`vdbench.backends.Backend.exact`, no sparse pattern) with no option (a compile, a
        step cache or another VAE path moves the frames too) -- what can stand in as the quality baseline where the
        exact ``reference`` was not rendered. The reference itself is not counted: it is the baseline it stands in
        for."""
        if self.flags or self.is_reference or self.nproc > 1:
            return False
        try:
            b = B.resolve(self.attention)
        except (ValueError, B.BackendUnavailable):
            return False
        return b.exact and b.sparse is None


def parse_stack(text: str) -> Candidate:
    """``"fav3+compile+vae=fast"`` -> Candidate(attention="fav3", flags=[...]), named by the stack's one spelling
    (:func:`vdbench.measure.record.stack_name`: the attention's alias resolved, the options in their order, the step
    cache's spec bare and canonical) -- the ``stack`` its render records; ValueError naming the valid options
    otherwise (the attention type itself is checked by the render, before it loads anything)."""
    from .cache import KINDS, parse_cache
    from .cli import canonical_attention
    from .measure.record import speed_options, stack_name, split_stack
    from .speed import FP8_GEMM_SCOPES

    head, opts = split_stack(text, cache_kinds=KINDS)
    flags: list[str] = []
    given: dict = {}
    for key, value in opts:
        given[key] = value
        if key == "layout":
            flags += layout_flags(value)
        elif key == "compile" and value is not None:
            backend, _, mode = value.partition(":")
            flags += ["--use_torch_compile", "--compile_backend", backend] + (["--compile_mode", mode] if mode else [])
        elif value is None:
            flags += STACK_OPTIONS[key]
        else:
            if key == "fp8gemm" and value not in FP8_GEMM_SCOPES:  # refused here, not after the renders before it
                raise ValueError(f"stack {text!r}: unknown fp8gemm scope {value!r}; valid: "
                                 f"{', '.join(FP8_GEMM_SCOPES)}")
            flags += [STACK_VALUES[key], value]
    compile_backend, _, compile_mode = (given.get("compile") or "inductor").partition(":")
    cache = parse_cache(given["cache"]) if "cache" in given else None
    name = stack_name(canonical_attention(head),
                      speed_options("compile" in given, compile_backend, compile_mode or None,
                                    (given["fp8gemm"] or "all") if "fp8gemm" in given else None,
                                    "bf16te" in given, fused_block=False if "eagerblock" in given else None),
                      given.get("vae"), given.get("encode"), cache.name if cache else None, given.get("layout", ""))
    return Candidate(name, head, flags, "asked for (--stacks)", nproc=layout_ranks(given.get("layout", "")))


def layout_flags(tag: str) -> list[str]:
    """The render flags of a layout tag (``u2cfg2`` -> ``--ulysses_degree 2 --use_cfg_parallel``)."""
    u, r, cfg = parse_layout(tag)
    return ((["--ulysses_degree", str(u)] if u > 1 else []) + (["--ring_degree", str(r)] if r > 1 else [])
            + (["--use_cfg_parallel"] if cfg else []))


def layouts_for(nproc: int, guidance: bool = True) -> list[str]:
    """Every layout of ``nproc`` ranks, cheapest exchange first: the CFG split (one gather per step, where the
    pipeline runs classifier-free guidance) with Ulysses then ring under it, then Ulysses alone, Ulysses x ring,
    ring alone. A layout the model can't take (heads not divisible by the Ulysses degree) is refused by its render,
    before the load."""
    if nproc < 2:
        return []
    out = []
    for cfg in ((True, False) if guidance else (False,)):
        if cfg and nproc % 2:
            continue
        seq = nproc // 2 if cfg else nproc
        pairs = [(u, seq // u) for u in range(seq, 0, -1) if seq % u == 0]  # Ulysses first, ring last
        out += [layout_tag(u, r, cfg) for u, r in pairs]
    return [t for t in out if t]


def layout_candidates(cands: list[Candidate], nprocs: list[int], *, fam, device: str, per_layout: int,
                      task: str = "t2v") -> tuple[list[Candidate], list[dict]]:
    """The multi-GPU renders: each layout of each GPU count in ``nprocs`` (:func:`layouts_for`) x the leading
    ``per_layout`` plain candidates (the kernel bench's fastest within the error bound, as planned), each named by
    its stack (``fav3+u2cfg2``); a backend a layout can't serve (ring without a log-sum-exp) is left out with why,
    as a family's refusal of an engine path is. Returned with what was left out."""
    from . import parallel as P

    lead = [c for c in cands if not c.flags and not c.is_reference and c.name != BASELINE][:per_layout]
    out, left_out = [], []
    for n in sorted(set(nprocs)):
        for tag in layouts_for(n, guidance=fam.cli.guidance_scale > 1):
            u, r, cfg = parse_layout(tag)
            for c in lead:
                name = f"{c.name}+{tag}"
                try:
                    P.check_backend_for_path(P.ParallelSpec("auto", u, r, cfg), c.attention, device, fam, task)
                except (B.BackendUnavailable, ValueError) as e:
                    left_out.append({"backend": name, "why": str(e).splitlines()[0]})
                    continue
                out.append(Candidate(name, c.attention, layout_flags(tag), f"{c.name} on {n} GPUs ({tag})",
                                     nproc=n))
    return out, left_out


def parse_layout_backends(values: list[str], avail: list[dict]) -> tuple[int, list[Candidate]]:
    """``--layout_backends``: (how many of the kernel bench's leading backends each layout renders, []) for a count;
    (their number, the named backends as candidates) for names -- each one that runs here, not an emulation, not
    ``default`` or ``reference`` (both rendered anyway, on one GPU) and without options (a stack's options go to
    ``--stacks``); ValueError naming what is wrong otherwise."""
    if len(values) == 1 and values[0].isdigit():
        return int(values[0]), []
    if any(v.isdigit() for v in values):
        raise ValueError(f"--layout_backends takes one count or backend names, not both ({' '.join(values)})")
    runs = {a["backend"]: a for a in avail}
    named = []
    for text in values:
        c = parse_stack(text)
        if c.flags or c.nproc > 1:
            raise ValueError(f"--layout_backends {text}: a plain backend; a stack's options go to --stacks")
        if c.name in (BASELINE, REFERENCE):
            raise ValueError(f"--layout_backends {text}: {c.name} is rendered on one GPU anyway; name the backends "
                             f"to lay out over the GPUs (e.g. fav3)")
        a = runs.get(c.name) or runs.get(B.resolve(c.attention).name)
        if a is None or not a["runs"]:
            raise ValueError(f"--layout_backends {text}: can't run here: {(a or {}).get('why_not', 'not registered')}")
        if a["emulated"]:
            raise ValueError(f"--layout_backends {text}: an emulation (accuracy only, never a speed)")
        if c.name not in {x.name for x in named}:  # an alias and its name: one backend
            named.append(Candidate(c.name, c.name, [], "named (--layout_backends)"))
    return len(named), named


def side_device(mode: str, device: str, visible: list[str]) -> Optional[tuple[str, dict]]:
    """Where the capture render and the kernel bench run beside the 1-GPU renders: (the device they are given, the
    environment that puts them there) or None (before the renders, on their device). On CUDA: the last visible GPU
    that is not the renders' (``visible``: the GPUs' ids as ``CUDA_VISIBLE_DEVICES`` names them), the job seeing it
    alone -- its own GPU, so neither the bench's timings nor the renders' share one; with one GPU, none (``on``
    refuses). On a CPU only when asked (``on``: the plumbing; no CPU figure is a speed figure)."""
    if mode == "off":
        return None
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        free = [g for i, g in enumerate(visible) if i != index]
        if free:
            return "cuda", {"CUDA_VISIBLE_DEVICES": free[-1]}
        if mode == "on":
            raise ValueError(f"--bench_beside on needs a second GPU ({len(visible)} visible): use auto or off")
        return None
    return (device, {}) if mode == "on" else None


def _visible_gpus(device: str) -> list[str]:
    """The GPUs this process sees, by the ids ``CUDA_VISIBLE_DEVICES`` gives them (indices where it is unset)."""
    if not device.startswith("cuda"):
        return []
    import torch

    n = torch.cuda.device_count()
    ids = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return ids[:n] if ids else [str(i) for i in range(n)]


def availability(device) -> list[dict]:
    """Every registered backend and each of its ``variants`` (``fav3_fp8:smooth_v=1``): can it run on ``device``,
    and why not."""
    out = []
    for name in B.names():
        b = B.BACKENDS[name]
        ok, why = b.availability(device)
        for spec in (name, *(B.resolve(f"{name}:{v}").name for v in b.variants)):
            out.append({"backend": spec, "runs": bool(ok), "why_not": None if ok else why,
                        "emulated": b.emulated})
    return out


def plan_candidates(avail: list[dict], bench_rows: list[dict], *, max_candidates: int, max_rel_l2: float,
                    stacks: list[Candidate], baseline: str = BASELINE,
                    reference: str = REFERENCE) -> tuple[list[Candidate], list[dict]]:
    """(the renders, the backends left out with why): the runnable, non-emulated backends (baseline and reference
    aside) within ``max_rel_l2`` on the captures, fastest first, at most ``max_candidates``; then the baseline,
    the reference and the stacks. Fastest: the least total time over the bench's inputs (what a step pays for those
    calls: a self-attention of 32k tokens weighs what it costs, not what a cross-attention call does), an input a
    kernel could not run counted at the slowest kernel's time on it."""
    by: dict[str, list[dict]] = {}
    for r in bench_rows:
        by.setdefault(B.resolve(r["kernel"]).name if r.get("kernel") else "", []).append(r)
    scored, left_out = [], []
    for a in avail:
        name = a["backend"]
        if name in (baseline, reference):
            continue
        if not a["runs"]:
            left_out.append({"backend": name, "why": f"can't run here: {a['why_not']}"})
            continue
        if a["emulated"]:
            left_out.append({"backend": name, "why": "emulation (accuracy only, never a speed)"})
            continue
        rows = [r for r in by.get(name, []) if str(r.get("status", "")).startswith("ok")]
        if not rows:
            why = next((r.get("status") for r in by.get(name, []) if r.get("status")), "no kernel-bench row")
            left_out.append({"backend": name, "why": f"kernel bench: {why}"})
            continue
        errs = [float(r["rel_l2"]) for r in rows if r.get("rel_l2") not in (None, "")]
        err = max(errs) if errs else math.nan
        if not errs or err > max_rel_l2:
            left_out.append({"backend": name, "why": f"rel L2 {err:.3g} vs exact on the captures > {max_rel_l2:g}"})
            continue
        times = {_input_of(r, i): float(r["time_ms"]) for i, r in enumerate(rows) if r.get("time_ms") not in (None, "")}
        scored.append((times, name, err))
    slowest: dict = {}
    for times, _, _ in scored:
        for k, t in times.items():
            slowest[k] = max(t, slowest.get(k, t))
    scored = sorted(((sum(times.get(k, s) for k, s in slowest.items()) if times else math.inf, name, err)
                     for times, name, err in scored), key=lambda x: (x[0], x[1]))
    chosen = [Candidate(n, n, [], f"kernel bench: {t:.3g} ms over its inputs, rel L2 {e:.2g}")
              for t, n, e in scored[:max_candidates]]
    left_out += [{"backend": n, "why": f"beyond --max_candidates {max_candidates}"} for _, n, _ in
                 scored[max_candidates:]]
    return [Candidate(baseline, baseline, [], BASELINE_WHY),
            Candidate(reference, reference, [], REFERENCE_WHY, is_reference=True), *chosen, *stacks], left_out


def _input_of(row: dict, i: int):
    """Which input a kernel-bench row timed (its file, or the synthetic input's name), with its shape."""
    name = row.get("input")
    return (name, row.get("Sq"), row.get("D")) if name not in (None, "") else i


# ----------------------------------------------------------------------------------------------------------
# The budget: what one more render costs, in which order they are bought
# ----------------------------------------------------------------------------------------------------------

#: A render is started when its estimate times this (a slower process start, a busy disk) fits in what is left.
MARGIN = 1.2


def calls_per_step(meta: dict) -> dict[tuple, float]:
    """{(B, H, Sq, Sk, D): attention calls per denoising step} from the capture render's metadata (its
    ``unique_shapes`` counted every call of its steps, not only the captured ones); {} where it holds no BHSD
    shapes."""
    if meta.get("layout", "BHSD") != "BHSD":
        return {}
    steps = max(1, int((meta.get("settings") or {}).get("num_inference_steps") or 1))
    out: dict[tuple, float] = {}
    for u in meta.get("unique_shapes") or []:
        try:
            q, k = (tuple(int(x) for x in re.findall(r"\d+", part)) for part in str(u["shape"]).split("|")[:2])
            calls = float(u["calls"])
        except (KeyError, TypeError, ValueError):
            continue
        if len(q) == 4 and len(k) == 4:
            key = (q[0], q[1], q[2], k[2], q[3])
            out[key] = out.get(key, 0.0) + calls / steps
    return out


def attention_ms_per_step(bench_rows: list[dict], calls: dict[tuple, float]) -> dict[str, float]:
    """{backend: its attention's milliseconds per denoising step}: for each shape the model calls, the median of the
    kernel bench's times on inputs of that shape, times the calls of that shape a step makes (``calls``:
    :func:`calls_per_step`). A backend without a time on every shape is left out: nothing predicts it."""
    from statistics import median

    times: dict[str, dict[tuple, list[float]]] = {}
    for r in bench_rows:
        if not str(r.get("status", "")).startswith("ok") or r.get("time_ms") in (None, "") or not r.get("kernel"):
            continue
        try:
            key = tuple(int(r[c]) for c in ("B", "H", "Sq", "Sk", "D"))
            name = B.resolve(r["kernel"]).name
        except (KeyError, TypeError, ValueError, B.BackendUnavailable):
            continue
        if key in calls:
            times.setdefault(name, {}).setdefault(key, []).append(float(r["time_ms"]))
    return {name: sum(n * median(by[key]) for key, n in calls.items())
            for name, by in times.items() if calls and set(by) == set(calls)}


def option_words(cand: Candidate) -> list[str]:
    """The stack options (:data:`STACK_OPTIONS`) a candidate's flags carry, the fp8 GEMMs by their scope
    (``fp8gemm``, ``fp8gemm=ffn``): each scope's one-time cost is its own."""
    words = [w for w, flags in STACK_OPTIONS.items() if all(f in cand.flags for f in flags)]
    if "fp8gemm" in words:
        at = cand.flags.index(STACK_OPTIONS["fp8gemm"][0]) + 1
        scope = cand.flags[at] if at < len(cand.flags) and not cand.flags[at].startswith("-") else "all"
        words[words.index("fp8gemm")] = "fp8gemm" if scope == "all" else f"fp8gemm={scope}"
    return words


def options_one_time(records: dict) -> dict[str, float]:
    """Per stack option, the most one-time cost a render of this sweep that carried it measured (``records``: by
    the stack's name, which says its options)."""
    seen: dict[str, float] = {}
    for name, rec in records.items():
        one = rec.figures.get("one_time_s")
        if one is None:
            continue
        try:
            words = option_words(parse_stack(name))
        except ValueError:
            continue
        for w in words:
            seen[w] = max(seen.get(w, 0.0), float(one))
    return seen


def estimate_render_s(cand: Candidate, *, default_s: Optional[float], steps: int, attn_ms: dict[str, float],
                      fallback_s: float, baseline: str = BASELINE,
                      one_time_s: Optional[dict[str, float]] = None) -> tuple[float, str]:
    """(seconds, what the figure rests on) of rendering ``cand``, the quality figure aside.

    A render of another attention differs from the ``default`` render (measured: ``default_s``) by its attention's
    time per step against default's (:func:`attention_ms_per_step`, from the kernel bench on the model's own
    captured inputs), over ``steps`` steps: the rest of the render (load, text encoder, the other layers, the VAE)
    is the same work. The exact ``reference`` is predicted the same way -- it is slow because exact fp32 attention
    is (at Wan 1.3B 480p: ~290 ms a call against ~12, 17.8 s a step against 1.2) -- and every other render from
    its own attention, not from the slowest render so far. Without a figure (no default render yet, or no
    kernel-bench time for that attention) the estimate is ``fallback_s``, the slowest render so far, and says so.
    A stack's options are not in the kernel bench: their one-time cost is added, the most a render of this sweep
    measured for one of them (``one_time_s``, :func:`options_one_time`), else :data:`OPTION_ONE_TIME_S`'s."""
    if default_s is None:
        return fallback_s, "no default render yet: the slowest render so far"
    if cand.name == baseline:
        return default_s, "default's own render"
    try:
        name = B.resolve(cand.attention).name
    except (ValueError, B.BackendUnavailable):
        name = None
    a, d = attn_ms.get(name), attn_ms.get(baseline)
    if a is None or d is None:
        return max(default_s, fallback_s), "no kernel-bench time for its attention: the slowest render so far"
    est = default_s + steps * (a - d) / 1e3
    basis = (f"default's {default_s:.0f} s {'+' if a >= d else '-'} {steps} steps x {abs(a - d):.1f} ms of attention "
             f"a step (kernel bench)")
    words = option_words(cand)
    if words:
        seen = one_time_s or {}
        extra, word = max((seen.get(w, OPTION_ONE_TIME_S.get(w, 0.0)), w) for w in words)
        est += extra
        basis += (f" + {extra:.0f} s once for {word} ("
                  f"{'measured on an earlier render here' if word in seen else 'the prior: no render here had it yet'})")
    return est, basis


def render_order(cands: list[Candidate], baseline: str = BASELINE) -> list[Candidate]:
    """The order the budget is spent in: ``default`` first (the speed baseline every speed-up reads on), then the
    candidates as planned (fastest on the kernel bench first, then the stacks), the exact ``reference`` last: with a
    short budget the renders that answer "which is faster" come before the one that only sharpens the quality
    column (:func:`quality_baseline` stands in for it)."""
    return sorted(cands, key=lambda c: 0 if c.name == baseline else 2 if c.is_reference else 1)


def plan_renders(pending: list[tuple[Candidate, float, str]], left_s: float, *,
                 quality_s: float = 0.0) -> list[dict]:
    """Which of the ``pending`` renders (in :func:`render_order`, each with its estimate and basis) fit in
    ``left_s``: walked in order, a render is taken when its estimate x :data:`MARGIN` plus the quality comparison
    it adds (``quality_s``) fits in what those taken before it leave; one that doesn't is passed over and the next
    (cheaper) one still tried. [{"name", "estimate_s", "basis", "render", "why"}] -- the run re-plans after each
    render with what it measured."""
    plan, left = [], left_s
    for cand, est, basis in pending:
        need = est * MARGIN + quality_s
        take = need <= left
        plan.append({"name": cand.name, "estimate_s": est, "basis": basis, "render": take,
                     "why": None if take else f"budget: {left:.0f} s left, its render ~{est:.0f} s ({basis})"})
        if take:
            left -= need
    return plan


def quality_baseline(cands: list[Candidate], warm_ms: dict[str, Optional[float]],
                     baseline: str = BASELINE) -> Optional[str]:
    """The render the PSNR / SSIM column reads against: the exact ``reference`` where it was rendered; else the
    fastest rendered exact-kernel render (:attr:`Candidate.exact`, by warm step), ``default`` only when no other
    is (then no second exact render says how far two exact kernels differ); None where none is. ``warm_ms``: the
    rendered ones' warm step (None where a render gave none)."""
    ref = next((c.name for c in cands if c.is_reference and c.name in warm_ms), None)
    if ref is not None:
        return ref
    exact = [c.name for c in cands if c.exact and c.name in warm_ms]
    others = [n for n in exact if n != baseline]
    pool = others or exact
    return min(pool, key=lambda n: (warm_ms[n] is None, warm_ms[n] or 0.0)) if pool else None


def predicted_ranking(cands: list[Candidate], attn_ms: dict[str, float], default_step_ms: Optional[float],
                      baseline: str = BASELINE) -> tuple[list[tuple[str, float]], str]:
    """The kernel bench's ranking of the plain candidates: ([(name, predicted speed-up over default)], fastest first;
    what the speed-up is of). With default's measured warm step: the step each would take (default's, with its
    attention's time swapped in: :func:`attention_ms_per_step`); without: the attention alone. Stacks are not in it
    (their options are not in the kernel bench)."""
    d = attn_ms.get(baseline)
    got = []
    for c in cands:
        if c.flags or c.is_reference or c.name == baseline:
            continue
        try:
            a = attn_ms.get(B.resolve(c.attention).name)
        except (ValueError, B.BackendUnavailable):
            a = None
        if a is None or not d:
            continue
        if default_step_ms:
            step = default_step_ms - d + a
            got.append((c.name, default_step_ms / step if step > 0 else math.inf))
        elif a > 0:
            got.append((c.name, d / a))
    what = "predicted step vs default's" if default_step_ms else "attention time vs default's attention"
    return sorted(got, key=lambda x: -x[1]), what


@dataclass
class Coverage:
    """What the verdict rests on: the candidates the sweep set out to render (``default`` and the ``reference``
    aside), those rendered, those skipped for the budget and those whose render failed, and the kernel bench's
    ranking (:func:`predicted_ranking`) that stands in, provisionally, for what was not rendered."""

    planned: list[str]
    rendered: list[str]
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    predicted: list[tuple[str, float]] = field(default_factory=list)
    predicted_is: str = "predicted step vs default's"
    no_bench: str = ""  # why there was no kernel bench to predict from ("" where there was one)

    @property
    def complete(self) -> bool:
        return len(self.rendered) >= len(self.planned)

    def text(self) -> str:
        why = [f"{len(self.skipped)} skipped for the budget"] * bool(self.skipped) + \
              [f"{len(self.failed)} failed"] * bool(self.failed)
        return f"{len(self.rendered)} of {len(self.planned)} candidates rendered" + (f" ({', '.join(why)})"
                                                                                     if why else "")

    def of(self, keep) -> "Coverage":
        """The same, for the candidates ``keep(name)`` selects (one GPU count's)."""
        pick = lambda names: [n for n in names if keep(n)]  # noqa: E731
        return Coverage(pick(self.planned), pick(self.rendered), pick(self.skipped), pick(self.failed),
                        [p for p in self.predicted if keep(p[0])], self.predicted_is, self.no_bench)

    def provisional(self) -> str:
        if not self.predicted:
            if self.no_bench:
                return f"no kernel bench to rank them ({self.no_bench})"
            return "the kernel bench predicts none of them (kernels/attention.csv)"
        done = set(self.rendered)
        return (f"provisional ranking from the kernel bench ({self.predicted_is}): " + ", ".join(
            f"{n} {x:.2f}x" + ("" if n in done else " (not rendered)") for n, x in self.predicted))


def _render_cmd(family: str, args, cand: Candidate, out: Path, extra: list[str]) -> list[str]:
    # a layout renders under torchrun (one process per GPU; a free rendezvous port), one process otherwise
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cand.nproc}", "-m",
               "vdbench.cli"] if cand.nproc > 1 else
              [sys.executable, "-c", "import sys; from vdbench.cli import main; sys.exit(main(sys.argv[1], sys.argv[2:]))"])
    return [*launch, family, "--model", args.model, "--height", str(args.height), "--width", str(args.width),
            "--num_frames", str(args.num_frames), "--num_inference_steps", str(args.steps), "--seed",
            str(args.seed), "--device", args.device, "--attention_type", cand.attention,
            "--benchmark_output_directory", str(out), "--save_frames", *cand.flags, *extra]


def _records(folder: Path) -> list[Record]:
    """The render records under ``folder``; a video path that no longer exists where the record says (the sweep's
    folder was moved or copied to another machine to resume there) is taken from ``folder`` by its file name."""
    recs = []
    for p in sorted(folder.rglob("records.jsonl")):
        for r in read(p):
            if r.suite != "render":
                continue
            out = r.data.get("output")
            if out and not Path(out).exists():
                moved = sorted(folder.rglob(Path(out).name))
                if moved:
                    r = dataclasses.replace(r, data={**r.data, "output": str(moved[0])})
            recs.append(r)
    return recs


def _video(rec: Record) -> Optional[Path]:
    out = rec.data.get("output")
    return Path(out) if out and Path(out).exists() else None


def _frames(rec: Record) -> Optional[Path]:
    """The frames a render's quality is read from: its raw uint8 frames (``--save_frames``' ``.npy`` beside the
    video) where they are there, else its video; None where neither is.

    Why the raw frames: each video is encoded on its own, so the codec's noise differs between two videos of
    nearly equal frames -- on Wan 1.3B 480p it holds every bf16 backend near 33 dB against the reference whose raw
    frames they match to 43-44 dB, hiding the differences the sweep ranks on."""
    video = _video(rec)
    if video is None:
        return None
    raw = video.with_suffix(".npy")
    return raw if raw.is_file() else video


#: what a quality figure was computed from (the ``quality_from`` column)
RAW, CODEC = "raw frames", "decoded videos (codec noise: PSNR capped near 33 dB at 480p)"


def quality_of(frames_path: Optional[Path], ref, device=None) -> Optional[dict]:
    """{"psnr", "ssim", "from"} of the render whose frames are at ``frames_path`` (:func:`_frames`) against the
    reference's (``ref``: (frames, path)), or None where either is missing or their shapes differ; ``from`` is
    :data:`RAW` only when both sides are raw frames. ``device``: where the SSIM windows run (on the H200 machine's
    CPU they took ~27 s per 480p x 81 render, half as long as the render: time the sweep's budget spends)."""
    if frames_path is None or ref is None:
        return None
    from .measure.quality import frame_quality

    ref_frames, ref_path = ref
    frames, _ = load_frames(frames_path)
    if frames.shape != ref_frames.shape:
        return None
    q = frame_quality(frames, ref_frames, device=device)
    raw = frames_path.suffix == ".npy" and ref_path.suffix == ".npy"
    return {"psnr": q["psnr"], "ssim": q["ssim"], "from": RAW if raw else CODEC}


def _stored_quality(folder: Path) -> Optional[dict]:
    """The quality a render's folder keeps (``quality.json``, written when it was rendered): what ranks it where its
    video is not at hand (a sweep resumed on another machine carries the reference's video only)."""
    try:
        q = json.loads((folder / "quality.json").read_text())
    except (OSError, ValueError):
        return None
    return q if isinstance(q, dict) and "psnr" in q else None


def warm_of(rec: Record) -> tuple[Optional[float], str]:
    """(warm ms/step, which statistic): the median of the steps after the first; with a step cache their mean (its
    steps are of two kinds, computed and reused: the median would be one kind's time, the mean is the render's)."""
    step = rec.figures.get("step_ms") or {}
    stat = "mean" if rec.config.get("cache") else "median"
    return step.get(stat), stat


def row_of(cand: Candidate, rec: Record, ref, stored: Optional[dict] = None, device=None, *,
           quality_vs: str = REFERENCE) -> dict:
    """A candidate's row from its render's record (the last repetition) and its quality against the quality baseline
    (``quality_vs``: the exact reference, or the render standing in for it, :func:`quality_baseline`): ``stored``
    (as kept beside it when it was compared), else from its frames and the baseline's (``ref``: (frames, path),
    :func:`quality_of`; SSIM on ``device``); the baseline's own row is exact by definition (``ref`` holds its
    frames: not read twice)."""
    step = rec.figures.get("step_ms") or {}
    peak = rec.figures.get("peak_memory_bytes")
    warm, warm_is = warm_of(rec)
    video = _video(rec)
    row = {"stack": cand.name, "attention": cand.attention, "gpus": cand.nproc, "why": cand.why,
           "is_reference": cand.is_reference,
           "warm_ms": warm, "warm_is": warm_is,
           "p20_ms": step.get("p20"), "p80_ms": step.get("p80"),
           "n": step.get("n"), "first_step_ms": step.get("first"),
           "end_to_end_s": rec.figures.get("end_to_end_s"), "one_time_s": rec.figures.get("one_time_s"),
           "peak_gib": None if peak is None else peak / 2**30,
           "speed_figure": rec.verdict.get("speed_figure"), "why_not_speed": rec.verdict.get("why_not"),
           "emulated": bool((rec.config.get("backend") or {}).get("emulated")),
           # a warm step's joules over every card (vdbench.power), as a speed: none for an emulation
           "step_energy_j": (None if (rec.config.get("backend") or {}).get("emulated")
                             else rec.figures.get("step_energy_j")),
           "kernels": ", ".join(f"{k}×{v}" for k, v in
                                ((rec.data.get("attention") or {}).get("calls_by_kernel") or {}).items()),
           "psnr_db": None, "ssim": None, "quality_from": None, "quality_vs": quality_vs, "video": str(video or "")}
    if cand.name == quality_vs:
        q = {"psnr": math.inf, "ssim": 1.0, "from": RAW if ref is not None and ref[1].suffix == ".npy" else CODEC} \
            if video is not None and ref is not None else None
    else:
        q = stored or quality_of(_frames(rec), ref, device)
    if q is not None:
        # a quality kept before the raw frames were read says nothing of its source: the videos'
        row["psnr_db"], row["ssim"], row["quality_from"] = q["psnr"], q["ssim"], q.get("from", CODEC)
    return row


def rank(rows: list[dict], baseline: str = BASELINE) -> list[dict]:
    """Rows sorted by warm step (emulations and rows without a step last), with the speed-up against
    ``baseline``, the break-even steps against it (:func:`vdbench.report.break_even`: one-time cost against the
    gain per step) and the Pareto mark on (warm step, PSNR vs reference)."""
    base = next((r for r in rows if r["stack"] == baseline and r["warm_ms"]), None)
    for r in rows:
        r["speedup"] = (base["warm_ms"] / r["warm_ms"]) if base and r["warm_ms"] and not r["emulated"] else None
        # from how many steps a render of this stack beats one of the baseline: its one-time cost against its gain
        r["break_even"] = None if base is None or r is base or r["emulated"] or not r["warm_ms"] else break_even_text(
            break_even(r.get("one_time_s"), r["warm_ms"] / 1e3, base.get("one_time_s"), base["warm_ms"] / 1e3))
    def is_base(r):  # the quality baseline's own row: exact by definition
        return r["stack"] == r.get("quality_vs", REFERENCE)

    pts = [(r["warm_ms"], math.inf if r["psnr_db"] is None and is_base(r) else r["psnr_db"],
            r["stack"]) for r in rows if r["warm_ms"] and not r["emulated"] and
           (r["psnr_db"] is not None or is_base(r))]
    front = {label for _, _, label in pareto_front(pts)}
    for r in rows:
        r["pareto"] = r["stack"] in front
    return sorted(rows, key=lambda r: (r["emulated"] or not r["warm_ms"], r["warm_ms"] or math.inf))


def verdict(rows: list[dict], *, device: str, model: str, tolerance_db: float, quality_vs: str = REFERENCE,
            coverage: Optional[Coverage] = None, gpus: Optional[int] = None) -> str:
    """One line: the fastest within ``tolerance_db`` of exact, and the fastest overall with its PSNR against
    ``quality_vs`` (the exact reference, or the exact-kernel render standing in for it: the line says which).
    ``coverage``: what was planned and rendered; where fewer candidates were rendered than planned the line says how
    many of how many, speaks of those rendered only, and ends with the kernel bench's ranking as provisional -- a
    verdict never claims to compare renders that were not made. ``gpus``: the verdict of that GPU count's renders
    alone (``default`` and the quality baseline still read from the whole table)."""
    timed = [r for r in rows if r["warm_ms"] and not r["emulated"] and not r.get("is_reference")
             and (gpus is None or r.get("gpus", 1) == gpus)]
    text = f"on this {device} for {model}: "
    partial = coverage is not None and not coverage.complete
    if partial:
        text += coverage.text() + ": "
    if partial and not coverage.rendered:
        text += "no measured verdict; " + coverage.provisional()
        return text + _not_speed(timed)
    if not timed:
        return text + "no render gave a warm step (see the rows' notes)" + (
            "; " + coverage.provisional() if partial else "")
    exact_db = _exact_db(rows, quality_vs=quality_vs)
    near = [] if exact_db is None else [r for r in timed
                                        if r["psnr_db"] is not None and r["psnr_db"] >= exact_db - tolerance_db]
    best = min(near, key=lambda r: r["warm_ms"]) if near else None
    fastest = min(timed, key=lambda r: r["warm_ms"])
    among = f"of the {len(coverage.rendered)} rendered, " if partial else ""
    if best is not None:
        scale = "identical to exact" if math.isinf(exact_db) else f"exact attention's {exact_db:.1f} dB"
        text += (f"{among}{best['stack']} is fastest within {tolerance_db:g} dB of {scale} ({best['warm_ms']:.4g} "
                 f"ms/step{_x(best)}, {_db(best)})")
    elif all(r["psnr_db"] is None for r in rows):
        text += f"{among}no quality figure (no exact render's frames to compare with)"
    elif exact_db is None:
        text += (f"{among}no render beside {quality_vs} computes exact attention, so 'within {tolerance_db:g} dB "
                 f"of exact' can't be read")
    else:
        text += f"{among}no render reached exact attention's quality"
    if fastest is not best:
        text += (f"; {fastest['stack']} is fastest overall ({fastest['warm_ms']:.4g} ms/step{_x(fastest)}, "
                 f"{_db(fastest)})")
    if quality_vs != REFERENCE:
        text += (f"; quality against {quality_vs}, the fastest exact-kernel render: the exact {REFERENCE} was not "
                 f"rendered")
    if partial:
        text += "; " + coverage.provisional()
    return text + _not_speed(timed)


def _not_speed(timed: list[dict]) -> str:
    if all(r["speed_figure"] for r in timed):
        return ""
    return f" -- NOT speed figures ({next((r['why_not_speed'] for r in timed if not r['speed_figure']), '')})"


def _exact_db(rows, baseline: str = BASELINE, quality_vs: str = REFERENCE) -> Optional[float]:
    """The quality 'within N dB of exact' reads on: the PSNR of the pipeline's own attention against the quality
    baseline (exact math in the model's dtype: what no faster backend needs to beat) -- against the fp32
    ``reference``, or against the exact-kernel render standing in for it (then: how far two exact kernels differ) --
    else the best PSNR of the batch beside the baseline's own; None where the baseline is ``default`` itself (no
    second exact render says how far exact kernels differ)."""
    if quality_vs == baseline:
        return None
    base = next((r["psnr_db"] for r in rows if r["stack"] == baseline and r["psnr_db"] is not None), None)
    if base is not None:
        return base
    got = [r["psnr_db"] for r in rows if r["psnr_db"] is not None and not r.get("is_reference")
           and r["stack"] != quality_vs]
    return max(got) if got else math.inf


def _x(r) -> str:
    return f", {r['speedup']:.2f}x default" if r.get("speedup") else ""


def _db(r) -> str:
    if r["psnr_db"] is None:
        return "PSNR n/a"
    codec = " (decoded videos: codec-capped)" if r.get("quality_from") == CODEC else ""
    vs = r.get("quality_vs", REFERENCE)
    if r["stack"] == vs:
        return "the quality baseline"
    return f"{r['psnr_db']:.1f} dB vs {'the reference' if vs == REFERENCE else vs}{codec}"


COLUMNS = ["stack", "gpus", "warm_ms", "step_energy_j", "warm_is", "p20_ms", "p80_ms", "n", "speedup",
           "first_step_ms", "end_to_end_s", "one_time_s", "break_even", "psnr_db", "ssim", "quality_from", "quality_vs",
           "peak_gib", "pareto", "speed_figure", "why_not_speed", "emulated", "kernels", "why", "attention", "video"]
#: The report's table: the CSV's columns up to the kernels that ran.
HTML_COLUMNS = COLUMNS[:COLUMNS.index("kernels") + 1]


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def _shown(row: dict, col: str) -> str:
    """A table cell: the one-time cost as :func:`vdbench.report.one_time_shown` shows it (a negative within the
    warm steps' noise is 0.00; the CSV keeps the measured value), every other column as :func:`_cell`."""
    if col == "one_time_s":
        lo, hi = row.get("p20_ms"), row.get("p80_ms")
        return one_time_cell(row.get(col), (hi - lo) / 1e3 if lo is not None and hi is not None else None, "—")
    return _cell(row.get(col))


def _negative_one_time(rows) -> bool:
    return any(_shown(r, "one_time_s").endswith("*") for r in rows)


def _notes_html(rows) -> str:
    return f"<p>{html.escape(NEGATIVE_ONE_TIME_NOTE)}</p>" if _negative_one_time(rows) else ""


def _header(col: str, quality_vs: str) -> str:
    """A column's title: the quality columns name what they are against where it is not the exact reference."""
    return f"{col} vs {quality_vs}" if col in ("psnr_db", "ssim") and quality_vs != REFERENCE else col


def write_outputs(out: Path, rows: list[dict], meta: dict) -> None:
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "sweep.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    vs = meta.get("quality_vs") or REFERENCE
    head = "".join(f"<th>{html.escape(_header(c, vs))}</th>" for c in HTML_COLUMNS)
    body = "".join("<tr" + (' class="pareto"' if r["pareto"] else "") + ">" +
                   "".join(f"<td>{html.escape(_shown(r, c))}</td>" for c in HTML_COLUMNS) + "</tr>" for r in rows)
    left = "".join(f"<li>{html.escape(x['backend'])}: {html.escape(x['why'])}</li>" for x in meta["left_out"])
    (out / "report.html").write_text(
        "<!doctype html><meta charset=utf-8><title>vdbench sweep</title><style>body{font:14px sans-serif}"
        "td,th{border:1px solid #ccc;padding:2px 6px}table{border-collapse:collapse}.pareto{background:#e8f5e9}"
        f"</style><h1>Which backend: {html.escape(meta['model'])}</h1><p><b>{html.escape(meta['verdict'])}</b></p>"
        f"<p>{html.escape(meta['device'])}; {meta['height']}x{meta['width']}, {meta['num_frames']} frames, "
        f"{meta['steps']} steps; warm = median of the steps after the first (p20-p80, n), their mean for a stack with a "
        f"step cache (its steps are of two kinds: warm_is says which); green rows: the Pareto "
        f"set on (warm step, PSNR vs {html.escape(vs)}). Command: <code>{html.escape(meta['command'])}</code>; commit "
        f"{html.escape(str(meta['commit']))}.</p><table><tr>{head}</tr>{body}</table>{_notes_html(rows)}"
        f"<h2>Not rendered</h2><ul>{left}</ul><p>Kernel bench on the captures: kernels/attention.csv</p>")


def _log(msg: str) -> None:
    print(msg, flush=True)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    budget = args.budget_min * 60.0
    # the budget is the whole sweep's, across re-runs that resume it: what earlier runs spent is kept in progress.json
    progress_path = out / "progress.json"
    try:
        progress = json.loads(progress_path.read_text())
    except (OSError, ValueError):
        progress = {}
    spent_before, runs_before = float(progress.get("spent_s", 0.0)), int(progress.get("runs", 0))
    stop_after = args.stop_after_min * 60.0 if args.stop_after_min else math.inf

    def left() -> float:
        now = time.monotonic() - t0
        return min(budget - spent_before - now, stop_after - now)

    def save_progress(**extra) -> None:
        progress.update(spent_s=spent_before + time.monotonic() - t0, runs=runs_before + 1, **extra)
        progress_path.write_text(json.dumps(progress))
    fam = families.get(args.family or _family_of(args.model))
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    args.device = device
    dev_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    stacks = [parse_stack(s) for s in args.stacks or []]

    t = time.monotonic()
    avail = availability(device)
    probe_s = time.monotonic() - t
    (out / "backends.txt").write_text("".join(
        f"{a['backend']:22s} {'runs' if a['runs'] else 'no: ' + str(a['why_not'])}\n" for a in avail))
    n_run = sum(a["runs"] for a in avail)
    _log(f"[sweep] {n_run} of {len(avail)} backends run on {dev_name} ({out / 'backends.txt'}; probed in "
         f"{probe_s:.1f} s)")
    per_layout, named = parse_layout_backends(args.layout_backends, avail)

    # 2. capture the model's attention inputs with one short render, then bench every runnable kernel on them --
    # on a GPU the renders don't use where there is one (the 1-GPU renders go on meanwhile), else before them
    caps, kdir = out / "captures", out / "kernels"
    bench_rows: list[dict] = []
    pre: dict = {"probe_s": probe_s}  # what the stage before the renders cost (the log, progress.json, sweep.json)
    kernel_max_s = args.kernel_max_s if args.kernel_max_s is not None else KERNEL_SHARE * budget

    def capture_and_bench(dev: str, env: Optional[dict]) -> dict:
        got: dict = {}
        cap = Candidate("capture", BASELINE)
        cmd = _render_cmd(fam.name, argparse.Namespace(**{**vars(args), "steps": 1, "device": dev}), cap,
                          out / "capture_run", ["--save_inputs", "--input_dir", str(caps), "--max_captures",
                                                str(args.max_captures), "--overwrite"])
        t = time.monotonic()
        rc = _run(cmd, out / "logs" / "capture.log", left(), env)
        got["capture_s"] = time.monotonic() - t  # a lower bound of a render's time: the first render's budget check
        if rc != 0:
            got["error"] = f"the capture render failed (rc {rc}); see {out / 'logs' / 'capture.log'}"
            return got
        kdir.mkdir(exist_ok=True)
        # what can be a candidate (emulations carry accuracy only), and default and the exact reference: their
        # times on the same inputs are what predicts each render's time (estimate_render_s)
        runnable = [a["backend"] for a in avail if a["runs"] and not a["emulated"]]
        runnable.sort(key=lambda n: 0 if n == BASELINE else 2 if n == REFERENCE else 1)
        grid = ["--grid", fam.size_grid(args.height, args.width, args.num_frames)] if fam.size_grid else []
        cmd = [sys.executable, str(ROOT / "bench" / "bench_attention.py"), "--input_dir", str(caps), "--kernel",
               ",".join(runnable), "--device", dev, "--budget_s", str(args.kernel_budget_s), "--max_s",
               str(kernel_max_s), *grid, "-o", str(kdir / "attention.csv")]
        t = time.monotonic()
        rc = _run(cmd, out / "logs" / "kernels.log", left(), env)
        got["kernel_bench_s"] = time.monotonic() - t
        if rc not in (0, 3):  # 3: some kernels skipped (their rows say why)
            got["warning"] = f"the kernel bench ended with rc {rc}; see {out / 'logs' / 'kernels.log'}"
        return got

    side, side_got, early = None, {}, []
    if named:
        pre["kernel_bench"] = f"skipped: the backends are named (--layout_backends {' '.join(c.name for c in named)})"
        _log(f"[sweep] no capture render and no kernel bench: the backends are named (--layout_backends "
             f"{' '.join(c.name for c in named)}); each render is estimated at the slowest render so far")
    elif not (kdir / "attention.json").exists():
        beside = side_device(args.bench_beside, device, _visible_gpus(device))
        if beside is None:
            side_got = capture_and_bench(device, None)
        else:
            import threading

            where = f"GPU {beside[1]['CUDA_VISIBLE_DEVICES']}" if beside[1] else beside[0]
            pre["beside"] = where
            _log(f"[sweep] capture render and kernel bench (no new input of a benched shape after {kernel_max_s:.0f} s) on {where}, "
                 f"beside the 1-GPU renders; the candidates and every multi-GPU render wait for them")

            def side_job():
                try:
                    side_got.update(capture_and_bench(*beside))
                except Exception as e:  # noqa: BLE001 -- said on join, in one line, as a failed capture is
                    side_got["error"] = f"the capture / kernel bench failed: {type(e).__name__}: {e}"

            side = threading.Thread(target=side_job, name="sweep-kernel-bench", daemon=True)
            side.start()
            early = [Candidate(BASELINE, BASELINE, [], BASELINE_WHY)]  # what needs no kernel-bench figure

    # 3. the renders: default first, then the candidates, the exact reference last; each started only when its
    # estimate fits in what is left, and none again that an earlier run finished
    slowest, records = float(progress.get("slowest_s", 0.0)), {}
    render_s = dict(progress.get("render_s") or {})  # each render's measured seconds, across the runs
    quality_s = progress.get("quality_s")  # one quality comparison's seconds (measured on default's frames)
    quality_device = device if device.startswith("cuda") else None
    skipped, failed, left_out = [], [], []
    attn: dict[str, float] = {}

    def read_back(cands: list[Candidate]) -> None:
        for c in cands:
            folder = out / "runs" / c.slug
            done = _records(folder) if folder.exists() and c.name not in records else []
            if done and (_video(done[-1]) is not None or (not c.is_reference and _stored_quality(folder))):
                records[c.name] = done[-1]

    tried: set = set()  # the renders this run has started or passed over: each once

    def render(c: Candidate) -> None:
        nonlocal slowest, quality_s
        if c.name in tried:
            return
        tried.add(c.name)
        if c.name in records:
            _log(f"[sweep] {c.name}: done earlier (records read back)")
            return
        folder = out / "runs" / c.slug
        est, basis = estimate_render_s(c, default_s=_default_s(render_s, records), steps=args.steps, attn_ms=attn,
                                       fallback_s=slowest, one_time_s=options_one_time(records))
        take = plan_renders([(c, est, basis)], left(), quality_s=float(quality_s or 0.0))[0]
        if not take["render"]:
            skipped.append(c.name)
            left_out.append({"backend": c.name, "why": take["why"]})
            _log(f"[sweep] {c.name}: skipped, {take['why']}")
            return
        t = time.monotonic()
        rc = _run(_render_cmd(fam.name, args, c, folder, ["--overwrite"]), out / "logs" / f"{c.slug}.log", left())
        recs = _records(folder)
        took = time.monotonic() - t
        slowest = max(slowest, took)
        if rc == TIMED_OUT:  # stopped by the budget's end (its estimate fell short): skipped for the budget
            save_progress(slowest_s=slowest)
            skipped.append(c.name)
            why = f"budget: stopped when the budget ran out, {took:.0f} s into its render (estimated {est:.0f} s)"
            left_out.append({"backend": c.name, "why": why})
            _log(f"[sweep] {c.name}: {why}")
            return
        if rc != 0 or not recs:
            save_progress(slowest_s=slowest)
            failed.append(c.name)
            left_out.append({"backend": c.name, "why": f"render failed (rc {rc}): {_first_error(out, c)}"})
            _log(f"[sweep] {c.name}: failed (rc {rc}); see {out / 'logs' / (c.slug + '.log')}")
            return
        records[c.name], render_s[c.name] = recs[-1], took
        _log(f"[sweep] {c.name}: rendered in {took:.0f} s (estimated {est:.0f} s)")
        if c.name == BASELINE and quality_s is None and _frames(recs[-1]) is not None:
            # what each render's quality figure will cost at the end: one comparison, timed on default's own frames
            t = time.monotonic()
            path = _frames(recs[-1])
            quality_of(path, (load_frames(path)[0], path), quality_device)
            quality_s = time.monotonic() - t
        save_progress(slowest_s=slowest, render_s=render_s, quality_s=quality_s)

    read_back(early)
    for c in early:  # beside the capture and the kernel bench, on the renders' own GPU
        render(c)
    if side is not None:
        side.join()
    for key in ("capture_s", "kernel_bench_s"):
        if key in side_got:
            pre[key] = side_got[key]
    slowest = max(slowest, side_got.get("capture_s", 0.0))
    save_progress(slowest_s=slowest, pre_render=pre)
    if "error" in side_got:
        _log(f"[sweep] error: {side_got['error']}")
        return 1
    if "warning" in side_got:
        _log(f"[sweep] warning: {side_got['warning']}")
    if (kdir / "attention.json").exists():
        bench = json.loads((kdir / "attention.json").read_text())
        bench_rows = bench["rows"]
        if bench.get("not_benched") and "kernel_bench_s" in side_got:
            _log(f"[sweep] kernel bench: {len(bench['not_benched'])} input(s) of shapes already benched left out "
                 f"past its {bench.get('max_s', kernel_max_s):.0f} s (--kernel_max_s)")
    if "kernel_bench_s" in side_got:
        _log(f"[sweep] before the renders: probe {probe_s:.1f} s, capture render {side_got['capture_s']:.0f} s, "
             f"kernel bench {side_got['kernel_bench_s']:.0f} s" + (f" (on {pre['beside']}, beside "
                                                                 f"{', '.join(c.name for c in early)})"
                                                                 if "beside" in pre else ""))
    if named:
        cands = [Candidate(BASELINE, BASELINE, [], BASELINE_WHY),
                 Candidate(REFERENCE, REFERENCE, [], REFERENCE_WHY, is_reference=True), *named, *stacks]
    else:
        cands, planned_out = plan_candidates(avail, bench_rows, max_candidates=args.max_candidates,
                                             max_rel_l2=args.max_rel_l2, stacks=stacks)
        left_out += planned_out
    if any(n > 1 for n in args.nproc):  # the layouts of each GPU count x the leading backends
        multi, multi_left = layout_candidates(cands, args.nproc, fam=fam, device=device, per_layout=per_layout)
        cands, left_out = cands + multi, left_out + multi_left
    try:
        calls = calls_per_step(json.loads((caps / "metadata_default_rank0.json").read_text()))
    except (OSError, ValueError):
        calls = {}
    attn.update(attention_ms_per_step(bench_rows, calls))  # what predicts each render's time
    order = render_order(cands)
    _log(f"[sweep] rendering {len(order)}: {', '.join(c.name for c in order)} ({left():.0f} s of budget left)")

    read_back(order)

    def log_plan(after: list[Candidate]) -> None:
        took = _default_s(render_s, records)
        _log_plan(plan_renders([(x, *estimate_render_s(x, default_s=took, steps=args.steps, attn_ms=attn,
                                                        fallback_s=slowest,
                                                        one_time_s=options_one_time(records)))
                                for x in after if x.name not in records], left(),
                               quality_s=float(quality_s or 0.0)), left())

    if any(c.name == BASELINE and c.name in render_s for c in early):
        log_plan(order)  # default rendered beside the kernel bench: what its time says of the rest
    for i, c in enumerate(order):
        fresh = c.name not in records
        render(c)
        if c.name == BASELINE and fresh and c.name in records:
            log_plan(order[i + 1:])


    # 4. the quality of each render against the exact reference, or the exact-kernel render standing in for it
    warm = {n: warm_of(r)[0] for n, r in records.items()}
    base = quality_baseline(cands, warm)
    base_frames = None
    if base is not None and _frames(records[base]) is not None:
        base_frames = (load_frames(_frames(records[base]))[0], _frames(records[base]))
    if base is not None and base != REFERENCE:
        _log(f"[sweep] quality read against {base}, the fastest exact-kernel render: the exact {REFERENCE} was "
             f"not rendered")
    rows = []
    for c in cands:
        if c.name not in records:
            continue
        folder = out / "runs" / c.slug
        stored = _stored_quality(folder)
        if stored is not None and stored.get("vs", REFERENCE) != base:
            stored = None  # against another baseline (the reference was rendered since): read again from the frames
        row = row_of(c, records[c.name], base_frames, stored, quality_device, quality_vs=base or REFERENCE)
        if stored is None and c.name != base and row["psnr_db"] is not None:
            # kept beside the render: ranks it on a resume that has only the baseline's frames
            (folder / "quality.json").write_text(json.dumps({"psnr": row["psnr_db"], "ssim": row["ssim"],
                                                             "from": row["quality_from"], "vs": base}))
        rows.append(row)
    rows = rank(rows)
    planned = [c.name for c in cands if c.name != BASELINE and not c.is_reference]
    predicted, predicted_is = predicted_ranking(cands, attn, warm.get(BASELINE))
    coverage = Coverage(planned, [n for n in planned if n in records], [n for n in skipped if n in planned],
                        [n for n in failed if n in planned], predicted, predicted_is,
                        "" if bench_rows else pre.get("kernel_bench", ""))
    counts = sorted({c.nproc for c in cands})
    if counts == [1]:
        text = verdict(rows, device=dev_name, model=args.model, tolerance_db=args.psnr_tolerance_db,
                       quality_vs=base or REFERENCE, coverage=coverage)
    else:  # one verdict per GPU count, each over that count's renders (quality against the same baseline)
        gpus_of = {c.name: c.nproc for c in cands}
        text = " | ".join(verdict(rows, device=f"{dev_name} x{n}" if n > 1 else dev_name, model=args.model,
                                  tolerance_db=args.psnr_tolerance_db, quality_vs=base or REFERENCE,
                                  coverage=coverage.of(lambda name, n=n: gpus_of.get(name, 1) == n), gpus=n)
                          for n in counts)
    meta = {"model": args.model, "family": fam.name, "device": dev_name, "height": args.height, "width": args.width,
            "num_frames": args.num_frames, "steps": args.steps, "verdict": text, "left_out": left_out,
            "command": command_line(), "commit": commit(), "budget_min": args.budget_min,
            "elapsed_s": spent_before + time.monotonic() - t0, "runs": runs_before + 1,
            "quality_vs": base or REFERENCE, "coverage": dataclasses.asdict(coverage), "pre_render": pre}
    save_progress()
    write_outputs(out, rows, meta)
    Writer(out / "records.jsonl").write(*(Record(
        suite="sweep", case=r["stack"], config={"model": args.model, "size": [args.height, args.width],
                                                "num_frames": args.num_frames, "steps": args.steps,
                                                "attention": r["attention"], "stack": r["stack"]},
        figures={k: r[k] for k in ("warm_ms", "p20_ms", "p80_ms", "n", "speedup", "end_to_end_s", "one_time_s",
                                   "psnr_db", "ssim", "peak_gib")},
        verdict={"speed_figure": r["speed_figure"], "why_not": r["why_not_speed"]}, command=meta["command"],
        commit=meta["commit"], created=now(), data=r) for r in rows))
    _print_table(rows, base or REFERENCE)
    _log(f"[sweep] {text}")
    runs = f" over {meta['runs']} runs" if meta["runs"] > 1 else ""
    _log(f"[sweep] {out / 'report.html'}, {out / 'sweep.csv'} ({meta['elapsed_s']:.0f} s of "
         f"{budget:.0f} s budget{runs})")
    return 0 if rows else 1


def _default_s(render_s: dict, records: dict) -> Optional[float]:
    """Default's render time: as measured by a run of this sweep, else its record's end to end (process start to
    the video on disk); None before it is rendered."""
    if BASELINE in render_s:
        return float(render_s[BASELINE])
    rec = records.get(BASELINE)
    e2e = rec.figures.get("end_to_end_s") if rec is not None else None
    return float(e2e) if e2e else None


def _log_plan(plan: list[dict], left_s: float) -> None:
    if not plan:
        return
    est = ", ".join(f"{p['name']} ~{p['estimate_s']:.0f} s" for p in plan)
    out = [p["name"] for p in plan if not p["render"]]
    _log(f"[sweep] plan for the {left_s:.0f} s left: {est}" + (
        f"; beyond the budget as estimated: {', '.join(out)}" if out else "; all fit"))


def _print_table(rows, quality_vs: str = REFERENCE):
    cols = ["stack", "gpus", "warm_ms", "step_energy_j", "n", "speedup", "one_time_s", "break_even", "psnr_db",
            "pareto"]
    print("  ".join(f"{_header(c, quality_vs):>12s}" for c in cols))
    for r in rows:
        print("  ".join(f"{_shown(r, c):>12s}" for c in cols))
    if _negative_one_time(rows):
        print(f"note: {NEGATIVE_ONE_TIME_NOTE}")


def _first_error(out: Path, c: Candidate) -> str:
    try:
        lines = (out / "logs" / f"{c.slug}.log").read_text().splitlines()
    except OSError:
        return "no log"
    return next((ln for ln in lines if ln.startswith("error")), lines[-1] if lines else "empty log")[:200]


#: :func:`_run`'s status for a command stopped at the end of the budget.
TIMED_OUT = 124


def _run(cmd: list[str], log: Path, left_s: float, env: Optional[dict] = None) -> int:
    """Run ``cmd`` (its output to ``log``) for at most ``left_s``; ``env``: variables set on top of this process's
    (the GPU a job beside the renders sees)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(1.0, left_s),
                                  env={**os.environ, **env} if env else None).returncode
        except subprocess.TimeoutExpired:
            f.write("\n[sweep] stopped: out of budget\n")
            return TIMED_OUT


def _family_of(model: str) -> str:
    return "cogvideox" if "cogvideo" in model.lower() else "wan"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sweep.py", description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="tiny", help="hub id, local path, random:<arch>, tiny or tiny:<variant>")
    p.add_argument("--family", default=None, choices=families.names(),
                   help="the model family (default: from the model name: cogvideox when it says so, else wan)")
    p.add_argument("--height", type=int, default=64, help="video height in pixels")
    p.add_argument("--width", type=int, default=96, help="video width in pixels")
    p.add_argument("--num_frames", type=int, default=9, help="video frames")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per render (warm n = steps - 1)")
    p.add_argument("--seed", type=int, default=42, help="one seed for every render: same noise, comparable videos")
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--budget_min", type=float, default=15.0,
                   help="minutes for the whole sweep, re-runs that resume it included (progress.json keeps the count)")
    p.add_argument("--stop_after_min", type=float, default=None,
                   help="minutes for this run alone: it starts no render it can't finish within them, writes what "
                        "it has, and a re-run resumes (default: none, only --budget_min)")
    p.add_argument("--max_candidates", type=int, default=8, help="backends rendered beside default and reference")
    p.add_argument("--max_rel_l2", type=float, default=0.1,
                   help="leave out backends further than this from exact attention on the captures")
    p.add_argument("--psnr_tolerance_db", type=float, default=0.5, help="'within N dB of exact' in the verdict")
    p.add_argument("--stacks", nargs="*", default=[], metavar="STACK",
                   help="extra renders: <attention type>[+compile|+compile=<backend>[:<mode>]][+fp8gemm|+fp8gemm=ffn]"
                        "[+bf16te][+eagerblock]"
                        "[+vae=<mode>][+encode=<mode>][+<cache spec>|+cache=<spec>], the name a render records "
                        "as its stack")
    p.add_argument("--nproc", type=int, nargs="+", default=[1], metavar="N",
                   help="GPU counts to rank layouts for: each layout N allows (the CFG split, Ulysses, ring and "
                        "their products) x the --layout_backends leading backends, each render under torchrun, with "
                        "a verdict per count (e.g. --nproc 2 4)")
    p.add_argument("--layout_backends", nargs="+", default=["2"], metavar="N_OR_BACKEND",
                   help="backends rendered in each multi-GPU layout: a count (the kernel bench's fastest within "
                        "--max_rel_l2), or their names (e.g. fav3): then those are the candidates, on one GPU and in "
                        "each layout, and neither the capture render nor the kernel bench runs")
    p.add_argument("--bench_beside", choices=("auto", "on", "off"), default="auto",
                   help="the capture render and the kernel bench on a GPU the 1-GPU renders don't use, beside them "
                        "(the candidates and the multi-GPU renders wait for them): auto where a second GPU is "
                        "visible; on: also on a CPU (the plumbing); off: before the renders")
    p.add_argument("--max_captures", type=int, default=8, help="attention calls captured for the kernel bench")
    p.add_argument("--kernel_budget_s", type=float, default=10.0, help="seconds of timed calls per kernel and input")
    p.add_argument("--kernel_max_s", type=float, default=None,
                   help="seconds of kernel benching after which no further capture of a shape already benched is "
                        f"started (default: {KERNEL_SHARE * 100:.0f}%% of --budget_min; 0: no bound)")
    p.add_argument("--out", default="outputs/sweep", help="where everything goes (a re-run resumes there)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if any(n < 1 for n in args.nproc):
            raise ValueError("--nproc takes GPU counts of 1 or more")
        need = max(args.nproc + [parse_stack(s).nproc for s in args.stacks or []])
        if need > 1 and args.device != "cpu":
            import torch

            have = torch.cuda.device_count()
            if torch.cuda.is_available() and have < need:
                raise ValueError(f"renders on {need} GPUs asked for (--nproc / a stack's layout), {have} visible")
        return run(args)
    except (ValueError, B.BackendUnavailable) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
