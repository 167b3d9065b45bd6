"""The sweep's renders: what a candidate is (a stack's one spelling, its render flags, its GPU count), the stacks'
grammar, the multi-GPU layouts, and the plan -- which backends the kernel bench leaves in the running, and why the
others are left out."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .. import backends as B
from ..measure.record import layout_ranks, layout_tag, parse_layout

#: The speed baseline (the pipeline's own attention) and the quality reference (exact attention) every sweep renders.
BASELINE, REFERENCE = "default", "reference"

#: Why each is in every sweep (the ``why`` column).
BASELINE_WHY, REFERENCE_WHY = "baseline: the pipeline's own attention", "quality reference: exact attention"

#: Stack options -> the render flags they add (the grammar: :func:`vdbench.measure.record.split_stack`).
STACK_OPTIONS = {"compile": ["--use_torch_compile"], "fp8gemm": ["--use_fp8_gemms"], "bf16te": ["--use_bf16_te_gemms"],
                 "fp8x": ["--ulysses_fp8_exchange", "on"], "eagerblock": ["--fused_block", "off"]}
STACK_VALUES = {"fp8gemm": "--use_fp8_gemms", "offload": "--offload", "vae": "--vae_decode", "encode": "--vae_encode",
                "cache": "--cache"}


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
    from ..cache import KINDS, parse_cache
    from ..cli import canonical_attention
    from ..measure.record import speed_options, stack_name, split_stack
    from ..offload import MODES as OFFLOAD_MODES
    from ..speed import FP8_GEMM_SCOPES

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
            if key == "offload" and value not in OFFLOAD_MODES[1:]:
                raise ValueError(f"stack {text!r}: unknown offload {value!r}; valid: {', '.join(OFFLOAD_MODES[1:])}")
            flags += [STACK_VALUES[key], value]
    compile_backend, _, compile_mode = (given.get("compile") or "inductor").partition(":")
    cache = parse_cache(given["cache"]) if "cache" in given else None
    name = stack_name(canonical_attention(head),
                      speed_options("compile" in given, compile_backend, compile_mode or None,
                                    (given["fp8gemm"] or "all") if "fp8gemm" in given else None,
                                    "bf16te" in given, given.get("offload"), "fp8x" in given,
                                    fused_block=False if "eagerblock" in given else None),
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
    from .. import parallel as P

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

