"""A results folder's timing.json read per rendered output (:func:`speed`): the latest run of each (never two runs
mixed: :func:`latest_run`), its warm step recomputed from the raw step times with ``vdbench.timing``'s one
definition, and the figures beside it (stages, memory, energy, one-time costs, the kernels that ran)."""

from __future__ import annotations

import statistics
from pathlib import Path

from vdbench.measure import record as R


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _emulated(ident, entry: dict) -> bool:
    """Whether the backend of these timings is an emulation: the entry's own record (``run.backend.emulated``),
    else the registry's entry for the recorded attention spec (older files), else False (a spec the registry
    doesn't know)."""
    recorded = ((entry.get("run") or {}).get("backend") or {}).get("emulated")
    if recorded is not None:
        return bool(recorded)
    return bool(resolved(ident.attention, "emulated"))


def resolved(attention: str, attr: str):
    """``attr`` of the backend or schedule an attention spec names (the registry's answer, for records that did not
    store it); None where the spec doesn't resolve here."""
    from vdbench.backends import BackendUnavailable
    from vdbench.patching.schedule import resolve_attention

    try:
        return getattr(resolve_attention(attention), attr)
    except (BackendUnavailable, ValueError):
        return None


def _device(entry: dict):
    run = entry.get("run") or {}
    return (run.get("resolved") or {}).get("device") or (run.get("system") or {}).get("device")


def entry_identity(entry: dict):
    """The identity of the render a timing entry belongs to: its record's (:func:`vdbench.measure.record.identity`
    of :func:`~vdbench.measure.record.from_render_entry`), never its file name."""
    return R.identity(R.from_render_entry(entry))


def entry_label(entry: dict) -> str:
    """The label of :func:`entry_identity`: the render's stack name, with the layout of a parallel render."""
    return entry_identity(entry).label


def latest_run(entries: list[dict]) -> list[dict]:
    """The repetitions of the last run among one output's timing entries, never two runs mixed: the entries with
    the last entry's ``run_id``; for files written before run ids, the trailing repetitions 0..r that end with the
    last entry and share its settings (a re-run with the same settings starts again at repetition 0)."""
    last = entries[-1]
    if last.get("run_id"):
        return [e for e in entries if e.get("run_id") == last["run_id"]]
    settings = (last.get("run") or {}).get("settings")
    run = [last]
    for e in reversed(entries[:-1]):
        rep = e.get("repetition")
        if rep is None or rep != run[0].get("repetition", 0) - 1 or (e.get("run") or {}).get("settings") != settings:
            break
        run.insert(0, e)
    return run


def _run_count(entries: list[dict]) -> int:
    """How many runs (renders) of one output timing.json holds."""
    ids = {e.get("run_id") for e in entries if e.get("run_id")}
    return len(ids) + sum(1 for e in entries if not e.get("run_id") and e.get("repetition", 0) == 0)


def speed(results: Path) -> dict[str, dict]:
    """Per rendered output (keyed by :func:`entry_label`), from its *latest run* in timing.json
    (:func:`latest_run`: never two runs mixed; ``runs_recorded`` says how many there are, ``run_id`` which one is
    used), recomputed from the raw ``step_times`` with ``vdbench.timing.run_step_stats`` (so files written before
    the warm-step keys existed read the same way):

    ``warm_step_median`` (+ ``_n``, ``_p20``, ``_p80``, ``_min``, ``_max``): the steps after the first of every
    repetition, pooled. The first step pays for lazy initialisation (kernel selection, allocator growth,
    autotuning), which is not what a backend costs per step in a 50-step render; it is ``first_step``.
    ``repetitions``, ``rep_warm_medians``, ``rep_warm_min`` / ``rep_warm_max``: each repetition's warm median.
    ``speed_figure`` / ``why_not_speed``: False and why for a CPU, an emulation or n < 3.
    ``step_times``: the per-step times, median over the repetitions (for the per-step plot).
    ``vae_decode_time``, ``attention_share`` (medians), ``calls_by_kernel``, ``fallback_calls``,
    ``peak_memory_bytes`` (of the last repetition), ``emulated``, ``device`` and ``run`` (its header).
    ``denoise_s`` / ``step_mean``: the denoising (every step) of the median repetition, and it over the steps;
    ``cache``: the step cache's section of the last repetition (None: no cache).
    ``end_to_end_s`` (the process's start to the video on disk), ``one_time_s`` (``one_time.total_s``),
    ``load_s``, ``compile_s`` and ``one_time`` (the section) of the run's first repetition, which carries the
    render's one-time costs; ``steady_s`` the median over the repetitions; None for files written before them.
    For an emulated backend every time of the attention's work (warm and first step, per-step times, attention
    share, end-to-end and one-time) is None: emulations never carry speed.
    """
    from vdbench.timing import load_timing, run_step_stats

    out: dict[str, dict] = {}
    tpath = Path(results) / "timing.json"
    if not tpath.exists():
        return out
    by: dict[str, list] = {}
    for e in load_timing(tpath):
        by.setdefault(entry_label(e), []).append(e)
    for label, entries in by.items():
        last_run = latest_run(entries)
        ident = entry_identity(last_run[-1])
        emulated = _emulated(ident, last_run[-1])
        device = _device(last_run[-1])
        stats = run_step_stats([e.get("step_times") or [] for e in last_run], device, emulated)
        n_steps = max(len(e.get("step_times") or []) for e in last_run)
        per_step = [median((e.get("step_times") or [])[i] for e in last_run if i < len(e.get("step_times") or []))
                    for i in range(n_steps)]
        att = last_run[-1].get("attention") or {}
        first = next((e for e in last_run if e.get("repetition", 0) == 0), last_run[0])
        once = first.get("one_time") or {}
        out[label] = {**stats,
                      "end_to_end_s": first.get("end_to_end_s"), "one_time_s": once.get("total_s"),
                      "load_s": once.get("load_s"), "compile_s": once.get("compile_s"), "one_time": once or None,
                      "steady_s": median(e.get("steady_s") for e in last_run),
                      "step_times": per_step,
                      "vae_decode_time": median(e.get("vae_decode_time") for e in last_run),
                      **{k: median(e.get(k) for e in last_run)
                         for k in ("text_encode_time", "image_encode_time", "vae_encode_time", "unaccounted")},
                      "stages": {k: median((e.get("stages") or {}).get(k) for e in last_run)
                                 for k in (last_run[-1].get("stages") or {})},
                      "attention_share": median(e.get("attention_share") for e in last_run),
                      "calls_by_kernel": att.get("calls_by_kernel") or {},
                      "work": _work(att),
                      "fallback_calls": att.get("fallback_calls"),
                      "peak_memory_bytes": rank_max(last_run[-1], "peak_memory_bytes"),
                      "peak_reserved_bytes": rank_max(last_run[-1], "peak_reserved_bytes"),
                      "memory": last_run[-1].get("memory"),
                      "step_energy_j": median(_step_energy(e) for e in last_run),
                      "power_capped_share": median((e.get("power") or {}).get("warm_capped_share")
                                                    for e in last_run),
                      "emulated": emulated, "device": device, "runs_recorded": _run_count(entries),
                      "run_id": last_run[-1].get("run_id"), "output": last_run[-1].get("output"),
                      "parallel": last_run[-1].get("parallel"), "identity": ident,
                      "cache": last_run[-1].get("cache"),
                      "run": last_run[-1].get("run") or {}}
        if emulated:
            out[label].update({k: None for k in stats if k.startswith(("warm_step_", "first_step", "rep_warm_"))
                               and k != "warm_step_n"}, denoise_s=None, step_mean=None,
                              rep_warm_medians=[], step_times=None, attention_share=None, end_to_end_s=None,
                              step_energy_j=None, power_capped_share=None,
                              one_time_s=None, steady_s=None,
                              stages={k: v for k, v in out[label]["stages"].items() if k != "denoise"})
    return out


def rank_max(entry: dict, key: str):
    """The largest of a figure over the ranks of a parallel render (what each card must hold), the entry's own on
    one process; None where it was not recorded."""
    values = [r.get(key) for r in entry.get("ranks") or []] + [entry.get(key)]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _step_energy(entry: dict):
    """A warm step's joules over every card of one repetition (:func:`vdbench.power.warm_energy` of the per-step
    joules, the ranks' added up on several), or None where none were recorded."""
    from vdbench.power import warm_energy

    rec = entry.get("power_all_ranks") or entry.get("power") or {}
    return warm_energy(rec.get("energy_j") or []) if rec.get("source") else None


def _work(attention: dict):
    """The self-attention work figure of a run (block pairs computed / all; joint attention for CogVideoX);
    None for files written before it was recorded."""
    fractions = attention.get("fraction_computed") or {}
    return fractions.get("self", fractions.get("joint"))
