"""One self-contained HTML report (and a CSV) per benchmark run: what each backend cost and what it changed.

    python -m vdbench.report outputs/demo [more run dirs...] [--reference reference] [-o OUT_DIR]

A run dir is a results directory (the per-backend videos, the optional raw ``.npy`` frames that ``--save_frames``
writes, ``timing.json`` and ``records.jsonl``) or a directory holding one as ``results/``. Each render's identity
(its stack -- backend or schedule, speed options, VAE modes, step cache -- and layout: its label) is its record's
(:func:`identities`); a video no record names is identified from its file name and its row's note says so. For each
backend the report gives the warm step (``vdbench.timing``'s one definition: the median of the steps after the
first, with its n, p20–p80 and min–max; the first step apart; each repetition's warm median), the speedup against
``default``, the attention share of the step, the VAE decode time, peak memory, PSNR/SSIM against the reference
render, and the kernels that actually ran (``attention.calls_by_kernel``, so a silent fallback cannot pass for the
kernel that was asked for). Beside the warm step: the render's end-to-end time (the process's start to the video on
disk), its one-time costs (timing.json's ``one_time.total_s``) and the break-even steps against ``default``
(:func:`break_even`: from how many denoising steps a render on the backend beats one on ``default``).

Emulated backends (``run.backend.emulated``) carry no speed: their time, speedup and attention-share cells say
"emulated" (their accuracy stays). Timings from a CPU or from fewer than three warm steps are flagged "not a
speed figure" (a note on the page, the ``speed_figure`` / ``why_not_speed`` columns of summary.csv).

``report.html`` embeds everything (plots as base64 PNG data URIs, inline CSS, no script) so it can be mailed,
attached to a CI run or opened from an artefact store without the files next to it. Missing pieces (no
timing.json, no reference render, a backend whose video is gone) leave a visible note rather than an error:
a report of a half-finished run is still worth reading.

The quality figures prefer the raw frames (codec noise excluded) and fall back to decoded videos; the
``quality_source`` column says which, because x264 noise can hide or fake a difference of a few dB.

This module also holds the figure labels of ``stitch_comparison.py --reference``
(:func:`figure_labels`): speedup of the warm steps from timing.json and PSNR of each decoded video against the
reference's.
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import contextlib
import functools
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from vdbench.helptext import DefaultsHelpFormatter
from vdbench.measure import record as R
from vdbench.video import identity_from_filename, iter_frames, run_of

__all__ = ["resolve_results", "is_grid_name", "collect", "rank_max", "memory_text", "render_records", "records_of", "identities", "refused", "match_label",
           "references", "shown_labels", "resolved", "FROM_FILE_NAME",
           "load_frames", "speed", "summarize", "write_csv", "write_html", "figure_labels", "video_psnr", "main",
           "CSV_COLUMNS", "SPEED_COLUMNS", "EMULATED", "break_even", "break_even_text", "break_even_cell",
           "BREAK_EVEN_NOTE", "one_time_shown", "one_time_cell", "NEGATIVE_ONE_TIME_NOTE"]

#: summary.csv columns, in order. ``warm_step_*``: the median of the steps after the first of every repetition of
#: the last run, pooled, with its n and spread; ``first_step_ms`` the first step alone (median over repetitions);
#: ``rep_warm_min_ms`` / ``rep_warm_max_ms`` the range of the repetitions' own warm medians. ``speed_figure`` is
#: False (and ``why_not_speed`` says why) for CPU timings, emulations and n < 3. ``quality_source`` says whether
#: PSNR/SSIM came from raw frames or from decoded videos; ``kernels`` is ``kernel×calls; ...`` as counted by the
#: patched attention processors; ``work`` the fraction of (query, key) block pairs the self-attention calls
#: computed (1.0 dense; a sparse pattern less; ``attention.fraction_computed`` in timing.json).
#: ``text_encode_s`` / ``image_encode_s`` / ``vae_encode_s``: the stages before the first step (vdbench.stages;
#: empty where the pipeline has none), ``unaccounted_s`` what no stage covers. ``end_to_end_s``: the process's start
#: to the video on disk; ``one_time_s``: the render's one-time costs beyond its steady work (timing.json's
#: ``one_time.total_s``; the load apart, ``load_s``; ``compile_s`` torch.compile's share, inside them);
#: ``steady_s`` a repetition's time less its one-time costs; ``break_even_steps_vs_default`` the denoising steps from
#: which the backend's render beats default's (:func:`break_even`). ``step_energy_j`` (beside the warm step): a warm
#: step's joules over every card (vdbench.power; median over the repetitions), ``power_capped_share`` the share of
#: the warm steps' samples the card (rank 0's) spent power-capped: at the cap a step's time follows its energy.
#: Empty for files written before they existed. ``peak_memory_gib`` / ``peak_reserved_gib``: a repetition's
#: allocated and reserved peaks (the denoising's and the decode's; the largest over the cards of a parallel render),
#: ``memory_stages_gib`` each stage's (load, denoise, decode) as allocated/reserved GiB on rank 0's card.
#: ``psnr_db`` / ``ssim`` / ``lpips`` (AlexNet LPIPS, lower is closer; empty where the optional package or its
#: weights are missing, and a note says which) are against ``reference``: the reference render of the same content
#: (prompt, seed, size and the other settings the frames are of). ``stack`` / ``content``: the render's stack (its label
#: without the identity tag) and the key of what its frames are of: a prompt and seed set's renders of one stack share
#: the first, those compared with each other the second.
CSV_COLUMNS = ["run", "backend", "warm_step_ms", "step_energy_j", "warm_step_n", "warm_step_p20_ms",
               "warm_step_p80_ms", "warm_step_min_ms", "warm_step_max_ms", "first_step_ms", "repetitions",
               "rep_warm_min_ms", "rep_warm_max_ms", "end_to_end_s", "one_time_s", "load_s", "compile_s", "steady_s",
               "break_even_steps_vs_default", "speedup_vs_default", "speed_figure", "why_not_speed", "emulated",
               "attention_share", "vae_decode_s", "text_encode_s", "image_encode_s", "vae_encode_s", "unaccounted_s",
               "peak_memory_gib", "peak_reserved_gib", "memory_stages_gib", "power_capped_share", "psnr_db", "ssim",
               "lpips", "reference", "quality_source", "kernels", "work", "fallback_calls", "stack", "content", "note"]

#: The columns that are a speed (a time of the attention's work or derived from one): "emulated" in their place
#: for an emulated backend, whose numerics are emulated in pure torch and whose time means nothing.
SPEED_COLUMNS = ("warm_step_ms", "warm_step_p20_ms", "warm_step_p80_ms", "warm_step_min_ms", "warm_step_max_ms",
                 "first_step_ms", "rep_warm_min_ms", "rep_warm_max_ms", "end_to_end_s", "one_time_s", "steady_s",
                 "break_even_steps_vs_default", "speedup_vs_default", "attention_share")
EMULATED = "emulated"


# --------------------------------------------------------------------------------------------------------
# Gathering
# --------------------------------------------------------------------------------------------------------


def is_grid_name(path) -> bool:
    """Whether a file is named as a comparison grid (``comparison_grid.mp4``, ``comparison_grid_<k>.mp4``: one per
    content of a set): not a render."""
    stem = Path(path).stem
    return stem == "comparison_grid" or stem.startswith("comparison_grid_")


def resolve_results(path) -> Path:
    """The results directory for ``path``: itself when it holds videos or timing.json, else its ``results/``
    (what ``--benchmark_output_directory`` gets), so both the run dir and its results dir are accepted."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    has_own = (path / "timing.json").exists() or any(not is_grid_name(p) for p in path.glob("*.mp4")) \
        or any(path.glob("*.npy"))
    if not has_own and (path / "results").is_dir():
        return path / "results"
    return path


def load_frames(path: Path):
    """(frames, source) of a render: the raw uint8 ``.npy`` when given one, else the decoded video."""
    path = Path(path)
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False), "raw frames (.npy)"
    return np.stack(list(iter_frames(path))), "decoded video"


#: The note of a video no record names: its identity is the documented fallback, read from its file name.
FROM_FILE_NAME = "identity from the file name (no record names this video)"


def render_records(folder) -> list:
    """The render records of a results folder, oldest first: ``records.jsonl``, after the ``timing.json`` entries
    (read as records by :func:`vdbench.measure.record.read`) of renders records.jsonl does not hold -- folders
    written before records; [] when neither is there or readable."""
    folder = Path(folder)

    def read(path):
        try:
            return [r for r in R.read(path) if r.suite == "render"] if path.is_file() else []
        except (R.RecordError, OSError):
            return []

    recs = read(folder / "records.jsonl")
    key = lambda r: (r.data.get("run_id"), r.data.get("output"), r.data.get("repetition"))  # noqa: E731
    held = {key(r) for r in recs}
    return [r for r in read(folder / "timing.json") if key(r) not in held] + recs


def _names_video(output, video: Path, folder: Path) -> bool:
    """Whether a record's ``output`` path is ``video``: the same file, the same absolute path, or the same name in
    the records' own folder (a results folder moved, or read from a directory other than the render's)."""
    if not output:
        return False
    out = Path(output)
    if os.path.abspath(out) == os.path.abspath(video):
        return True
    with contextlib.suppress(OSError):
        if out.exists() and video.exists() and os.path.samefile(out, video):
            return True
    return out.name == video.name and video.parent.resolve() == folder.resolve()


def records_of(videos, results=None) -> list:
    """Each video's render record, or None: the latest record of its folder (and of ``results``, where given:
    :func:`render_records`) whose ``data["output"]`` is the video's path (:func:`_names_video`), else the record of
    the run id the video's comment carries (a video renamed on disk: :func:`vdbench.video.run_of`)."""
    cache: dict[Path, list] = {}

    def recs(folder: Path):
        if folder not in cache:
            cache[folder] = render_records(folder)
        return cache[folder]

    out = []
    for v in videos:
        video = Path(v)
        folders = list(dict.fromkeys([video.parent] + ([Path(results)] if results is not None else [])))
        found = next((r for f in folders for r in reversed(recs(f)) if _names_video(r.data.get("output"), video, f)),
                     None)
        if found is None and any(recs(f) for f in folders):
            run = run_of(video)
            found = next((r for f in folders for r in reversed(recs(f)) if run and r.data.get("run_id") == run), None)
        out.append(found)
    return out


def identities(videos, results=None) -> list:
    """Each video's :class:`vdbench.measure.record.Identity`, from its record (:func:`records_of`). A video no record
    names falls back to its file name (:func:`vdbench.video.identity_from_filename`, ``source == "file name"``): the
    one place a name is parsed."""
    return [R.identity(r) if r is not None else identity_from_filename(v)
            for v, r in zip(videos, records_of(videos, results))]


@functools.lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    from vdbench.identity import file_sha256

    return file_sha256(path)


def refused(videos, results=None) -> dict[str, str]:
    """The videos whose bytes are not those their record vouches for (``output_sha256``, and ``frames_sha256`` for
    the raw frames beside it): video path -> the one line that says so. Such a file was replaced after its render
    (another render, a copy, an edit): its record's figures are not its own, so the readers leave it out."""
    out = {}
    for v, rec in zip(videos, records_of(videos, results)):
        data = rec.data if rec is not None else {}
        for path, key in ((Path(v), "output_sha256"), (Path(v).with_suffix(".npy"), "frames_sha256")):
            want = data.get(key)
            if not want or not path.is_file():
                continue
            st = path.stat()
            got = _sha256(str(path), st.st_size, st.st_mtime_ns)
            if got != want:
                out[str(v)] = (f"refused {path.name}: its bytes (sha256 {got[:12]}) are not the ones its render "
                               f"recorded ({want[:12]}, run {data.get('run_id')}); re-render it or move it away")
                break
    return out


def _sources(results: Path, notes: Optional[list] = None) -> dict:
    """label -> (best available frame source, the render's identity): raw .npy preferred over the mp4, both named
    by the mp4's record. The stitched grid is not a render and is left out, and so is a render whose files are not
    those its record vouches for (:func:`refused`; its line goes to ``notes``)."""
    found: dict = {}
    paths = [p for p in sorted(Path(results).glob("*.mp4")) + sorted(Path(results).glob("*.npy"))
             if not is_grid_name(p)]
    videos = [p.with_suffix(".mp4") for p in paths]
    bad = refused(list(dict.fromkeys(videos)), results)
    for p, video, ident in zip(paths, videos, identities(videos, results)):
        if str(video) in bad:
            continue
        if p.suffix == ".npy" or ident.label not in found:
            found[ident.label] = (p, ident)
    if notes is not None:
        notes.extend(bad.values())
    return found


def collect(results: Path) -> dict[str, Path]:
    """label (the render's identity: :func:`identities`) -> best available frame source (raw .npy preferred over
    the mp4). The stitched grid is not a render and is left out."""
    return {label: p for label, (p, _) in _sources(results).items()}


def match_label(name: str, runs) -> str | None:
    """The label among ``runs`` (label -> :class:`~vdbench.measure.record.Identity`) that ``name`` means: itself,
    else the first run whose attention is ``name`` (so ``reference`` finds ``reference+u2`` in a batch rendered
    under torchrun); None if none."""
    if name in runs:
        return name
    return next((label for label, ident in runs.items() if ident.attention == name), None)


def shown_labels(idents) -> tuple[list[str], Optional[str]]:
    """The labels to show for renders of these identities, and the identity tag they all share (None where they
    don't): a tag common to every render (a batch's one prompt, image or frame rate) is said once, not on each."""
    tags = {i.tag for i in idents}
    if len(tags) == 1 and next(iter(tags)):
        return [i.stack for i in idents], next(iter(tags))
    return [i.label for i in idents], None


def references(name: str, runs) -> dict:
    """content -> the label of the reference render of that content, among ``runs`` (label ->
    :class:`~vdbench.measure.record.Identity`): the run labelled ``name``, else the first whose attention is
    ``name`` (so ``reference`` finds ``reference+u2``), one per content (:attr:`Identity.content`: renders of the
    same prompt, seed and size are compared with each other; records without it share one content, None)."""
    out: dict = {}
    for label, ident in runs.items():
        if label == name:
            out[ident.content] = label
    for label, ident in runs.items():
        if ident.attention == name:
            out.setdefault(ident.content, label)
    return out


def _median(values):
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
        per_step = [_median((e.get("step_times") or [])[i] for e in last_run if i < len(e.get("step_times") or []))
                    for i in range(n_steps)]
        att = last_run[-1].get("attention") or {}
        first = next((e for e in last_run if e.get("repetition", 0) == 0), last_run[0])
        once = first.get("one_time") or {}
        out[label] = {**stats,
                      "end_to_end_s": first.get("end_to_end_s"), "one_time_s": once.get("total_s"),
                      "load_s": once.get("load_s"), "compile_s": once.get("compile_s"), "one_time": once or None,
                      "steady_s": _median(e.get("steady_s") for e in last_run),
                      "step_times": per_step,
                      "vae_decode_time": _median(e.get("vae_decode_time") for e in last_run),
                      **{k: _median(e.get(k) for e in last_run)
                         for k in ("text_encode_time", "image_encode_time", "vae_encode_time", "unaccounted")},
                      "stages": {k: _median((e.get("stages") or {}).get(k) for e in last_run)
                                 for k in (last_run[-1].get("stages") or {})},
                      "attention_share": _median(e.get("attention_share") for e in last_run),
                      "calls_by_kernel": att.get("calls_by_kernel") or {},
                      "work": _work(att),
                      "fallback_calls": att.get("fallback_calls"),
                      "peak_memory_bytes": rank_max(last_run[-1], "peak_memory_bytes"),
                      "peak_reserved_bytes": rank_max(last_run[-1], "peak_reserved_bytes"),
                      "memory": last_run[-1].get("memory"),
                      "step_energy_j": _median(_step_energy(e) for e in last_run),
                      "power_capped_share": _median((e.get("power") or {}).get("warm_capped_share")
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


def memory_text(s: dict) -> Optional[str]:
    """``load 28.1/30.2, denoise 40.3/42.0, decode 12.0/13.5`` GiB (allocated/reserved peaks of each stage, rank 0's
    card), None where not recorded."""
    mem = s.get("memory") or {}
    parts = [f"{k} {v['allocated_peak'] / 2**30:.1f}/{v['reserved_peak'] / 2**30:.1f}" for k, v in mem.items() if v]
    return ", ".join(parts) or None


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


def _stages_text(s: dict):
    """``text 0.03 · image 0.00 · VAE enc 0.06 · denoise 0.01 · VAE dec 0.11 · other 0.01`` (medians, seconds; the
    stages a run's pipeline has), or None for a run recorded before the stages were."""
    short = {"text_encode": "text", "image_encode": "image", "vae_encode": "VAE enc", "denoise": "denoise",
             "vae_decode": "VAE dec"}
    parts = [f"{short.get(k, k)} {v:.2f}" for k, v in (s.get("stages") or {}).items() if v is not None]
    if not parts:
        return None
    rest = s.get("unaccounted")
    return " · ".join(parts + ([f"other {rest:.2f}"] if rest is not None else []))


def break_even(one_a, warm_a, one_b, warm_b) -> dict | None:
    """When a render on backend *a* costs less than one on baseline *b*: solve ``one_a + n·warm_a = one_b + n·warm_b``
    for the number of denoising steps ``n`` (one-time costs and warm steps in the same unit). None when a figure is
    missing. ``verdict``: ``"always"`` (a is ahead at every length: not slower per step and no more one-time
    cost), ``"never"`` (not faster per step and no less one-time cost, or ahead only below one step), ``"from"``
    (a is faster per step but pays more once: it wins from ``steps`` = the first whole n past the crossing),
    ``"up to"`` (a is slower per step but pays less once: it wins for renders of at most ``steps``), ``"same"``
    (identical figures); ``n`` the crossing itself (None where there is none)."""
    if any(v is None for v in (one_a, warm_a, one_b, warm_b)):
        return None
    more_once, saved_per_step = one_a - one_b, warm_b - warm_a  # a pays more_once more, saves saved_per_step a step
    if saved_per_step == 0:
        verdict = "always" if more_once < 0 else ("never" if more_once > 0 else "same")
        return {"verdict": verdict, "steps": None, "n": None}
    n = more_once / saved_per_step
    if saved_per_step > 0:
        if more_once <= 0:
            return {"verdict": "always", "steps": None, "n": n}
        return {"verdict": "from", "steps": math.floor(n) + 1, "n": n}
    if more_once >= 0:
        return {"verdict": "never", "steps": None, "n": n}
    steps = math.ceil(n) - 1  # a wins while n·saved > more_once, i.e. below the crossing
    if steps < 1:
        return {"verdict": "never", "steps": None, "n": n}
    return {"verdict": "up to", "steps": steps, "n": n}


def break_even_text(be: dict | None) -> str | None:
    """``always``, ``never``, ``same``, ``from 38 steps``, ``up to 12 steps``; None for None."""
    if be is None:
        return None
    if be["steps"] is None:
        return be["verdict"]
    return f"{be['verdict']} {be['steps']} step" + ("s" if be["steps"] != 1 else "")


def break_even_cell(s: dict, base: dict) -> str | None:
    """The break-even cell of a backend's :func:`speed` figures ``s`` against the baseline's ``base``: the verdict
    from the warm medians and the one-time totals, and, where the warm steps' p20–p80 spread changes it, the range
    from the backend at its best (its p20 against the baseline's p80) to its worst, with each side's n kept:
    ``from 38 steps (p20–p80: 25–70; n=3 vs 3)``, ``from 38 steps (p20–p80: from 25 steps to never; n=3 vs 3)``.
    None where a figure is missing."""
    def at(mine, theirs):
        return break_even(s.get("one_time_s"), s.get(mine), base.get("one_time_s"), base.get(theirs))

    main = break_even_text(at("warm_step_median", "warm_step_median"))
    if main is None:
        return None
    best, worst = at("warm_step_p20", "warm_step_p80"), at("warm_step_p80", "warm_step_p20")
    n = f"n={s.get('warm_step_n')} vs {base.get('warm_step_n')}"
    if best is None or worst is None or break_even_text(best) == break_even_text(worst) == main:
        return f"{main} ({n})"
    if best["verdict"] == worst["verdict"] and best["steps"] is not None and worst["steps"] is not None:
        lo, hi = sorted((best["steps"], worst["steps"]))
        spread = f"{lo}–{hi}"
    else:
        spread = f"{break_even_text(best)} to {break_even_text(worst)}"
    return f"{main} (p20–p80: {spread}; {n})"


#: The one-time column's print resolution (s): it shows hundredths, and a magnitude under half of one is 0.00 there.
ONE_TIME_RESOLUTION_S = 0.005

#: Said under a table where a one-time cost stays negative (its cell marked ``*``).
NEGATIVE_ONE_TIME_NOTE = ("one-time cost marked *: negative by more than the warm steps' p20–p80 spread (the first "
                          "step came in faster than the warm median): a timing disturbance worth a look (a shared or "
                          "throttling machine), not a saving")


def one_time_shown(v: Optional[float], spread_s: Optional[float] = None) -> Optional[float]:
    """The one-time cost (s) a table shows: ``v``, or 0.0 where it is negative by no more than the noise of the
    subtraction it comes from -- the column's resolution, or the warm steps' p20–p80 spread ``spread_s`` where
    wider (its main term is the first step minus the warm median: one sample against that spread). A first step
    does the warm steps' work and more, so a negative within that noise is the noise; one beyond it is kept, for the
    table to mark (:data:`NEGATIVE_ONE_TIME_NOTE`). A positive figure is shown as it is. The files (summary.csv,
    timing.json) keep the measured value."""
    if v is None:
        return None
    if abs(v) < ONE_TIME_RESOLUTION_S or (v < 0 and -v <= max(ONE_TIME_RESOLUTION_S, spread_s or 0.0)):
        return 0.0
    return v


def one_time_cell(v: Optional[float], spread_s: Optional[float] = None, missing: str = "–") -> str:
    """A table cell of :func:`one_time_shown`: hundredths of a second, ``*`` on a negative kept."""
    shown = one_time_shown(v, spread_s)
    return missing if shown is None else f"{shown:.2f}" + ("*" if shown < 0 else "")


#: What the break-even figures are, said under the table that shows them.
BREAK_EVEN_NOTE = ("break-even steps against {base}: the denoising steps a render needs before the backend's total "
                   "(one-time costs + steps × warm step) is below {base}'s, from the measured warm steps (median, "
                   "with the p20–p80 range where it changes the answer, and each side's n) and one-time totals "
                   "(the first step's excess over a warm step, the warm-up calls', the decode's; the load not "
                   "counted); 'always' / 'never': ahead / behind at every length")


def summarize(run_dir, reference: str = "reference", device=None, content: Optional[int] = None) -> dict:
    """Everything the report shows for one run dir: ``rows`` (one per backend, CSV_COLUMNS keys plus
    ``psnr_per_frame`` and ``step_times``), ``notes`` (what is missing and why), ``header`` (the run's system
    and settings), ``poster`` (the video whose first frame illustrates the run, or None) and ``sets`` (renders of
    several contents, a prompt and seed set: one row per stack over the set, :func:`set_summary`; [] otherwise).
    ``content``: the N-th content's renders alone (1-based, in the rows' order)."""
    results = resolve_results(run_dir)
    notes: list[str] = []
    reference_name = reference
    lpips_note = None  # None: not tried yet; "": available; else the reason it is not computed
    found = _sources(results, notes)
    sources = {label: p for label, (p, _) in found.items()}
    sp = speed(results)
    runs = {**{label: ident for label, (_, ident) in found.items()}, **{k: v["identity"] for k, v in sp.items()}}
    if not sp:
        notes.append(f"no timing.json in {results}: no speed figures")
    if not sources:
        notes.append(f"no rendered video or raw frames in {results}: no quality figures")
    for lab, s in sp.items():
        if (s.get("runs_recorded") or 1) > 1:
            notes.append(f"timing.json holds {s['runs_recorded']} runs of {lab}: the latest is used"
                         + (f" (run {s['run_id']})" if s.get("run_id") else ""))
    refs = references(reference, {k: runs[k] for k in sources})
    loaded: dict = {}  # reference label -> (frames, source) or None where unreadable

    def reference_of(label):
        """(reference label, frames, source) of the render ``label``'s content, or None."""
        key = refs.get(runs[label].content)
        if key is not None and key not in loaded:
            try:
                loaded[key] = load_frames(sources[key])
            except (OSError, ValueError) as exc:
                loaded[key] = None
                notes.append(f"reference render {sources[key].name} is unreadable ({exc}): no quality figures "
                             "against it")
        return (key, *loaded[key]) if key is not None and loaded[key] is not None else None

    if refs:
        reference = next(iter(refs.values()))
    elif sources:
        notes.append(f"no reference render labelled {reference!r} in {results} (found: {', '.join(sources)}): "
                     "no quality figures (render one with --attention_type reference)")
    base_key = match_label("default", {k: runs[k] for k in sp}) or "default"
    base_s = sp.get(base_key) or {}
    base = base_s.get("warm_step_median")
    if sp and base is None:
        notes.append("no 'default' backend with a warm step in timing.json: no speedup column")
    if any(break_even_cell(s, base_s) for k, s in sp.items() if k != base_key and not s.get("emulated")):
        notes.append(BREAK_EVEN_NOTE.format(base=base_key))
    rows = []
    for label in list(dict.fromkeys(list(sp) + list(sources))):
        s = sp.get(label, {})
        st = s.get("warm_step_median")
        ms = lambda key: s[key] * 1e3 if s.get(key) is not None else None  # noqa: E731
        why = s.get("why_not_speed")
        if st and base and label != base_key and not base_s.get("speed_figure", True):
            why = "; ".join(filter(None, [why, "the 'default' baseline is not a speed figure"]))
        row = {"run": str(run_dir), "backend": label,
               "warm_step_ms": ms("warm_step_median"), "warm_step_n": s.get("warm_step_n"),
               "warm_step_p20_ms": ms("warm_step_p20"), "warm_step_p80_ms": ms("warm_step_p80"),
               "warm_step_min_ms": ms("warm_step_min"), "warm_step_max_ms": ms("warm_step_max"),
               "first_step_ms": ms("first_step"), "repetitions": s.get("repetitions"),
               "rep_warm_min_ms": ms("rep_warm_min"), "rep_warm_max_ms": ms("rep_warm_max"),
               "rep_warm_medians_ms": [m * 1e3 for m in s.get("rep_warm_medians") or []],
               "end_to_end_s": s.get("end_to_end_s"), "one_time_s": s.get("one_time_s"), "load_s": s.get("load_s"),
               "compile_s": s.get("compile_s"), "steady_s": s.get("steady_s"),
               "break_even_steps_vs_default": (("baseline" if label == base_key else break_even_cell(s, base_s))
                                               if s else None),
               "speedup_vs_default": (base / st) if (base and st) else None,
               "speed_figure": (not why) if s else None, "why_not_speed": why,
               "emulated": s.get("emulated"),
               "attention_share": s.get("attention_share"), "vae_decode_s": s.get("vae_decode_time"),
               "text_encode_s": s.get("text_encode_time"), "image_encode_s": s.get("image_encode_time"),
               "vae_encode_s": s.get("vae_encode_time"), "unaccounted_s": s.get("unaccounted"),
               "stages": _stages_text(s),
               "peak_memory_gib": s["peak_memory_bytes"] / 2**30 if s.get("peak_memory_bytes") else None,
               "peak_reserved_gib": s["peak_reserved_bytes"] / 2**30 if s.get("peak_reserved_bytes") else None,
               "memory_stages_gib": memory_text(s),
               "step_energy_j": s.get("step_energy_j"), "power_capped_share": s.get("power_capped_share"),
               "psnr_db": None, "ssim": None, "lpips": None, "quality_source": None, "reference": None,
               "kernels": "; ".join(f"{k}×{n}" for k, n in s.get("calls_by_kernel", {}).items()) or None,
               "work": s.get("work"), "fallback_calls": s.get("fallback_calls"), "note": None,
               "psnr_per_frame": None, "step_times": s.get("step_times")}
        ref_of = reference_of(label) if label in sources and runs[label].from_record else None
        if label not in sources:
            row["note"] = "no video or raw frames found (timing only)"
        elif not runs[label].from_record:
            row["note"] = FROM_FILE_NAME
        elif refs and ref_of is None:
            row["note"] = f"no {reference_name!r} render of the same content (prompt, seed, size): no quality figures"
        elif ref_of is not None:
            ref_label, ref, ref_src = ref_of
            row["reference"] = ref_label
            try:
                frames, src = load_frames(sources[label])
            except (OSError, ValueError) as exc:
                row["note"] = "; ".join(filter(None, [row["note"], f"unreadable: {exc}"]))
            else:
                if frames.shape != ref.shape:
                    row["note"] = "; ".join(filter(None, [row["note"], f"shape {frames.shape} differs from the "
                                                                       f"reference {ref.shape}"]))
                else:
                    from vdbench.measure.quality import frame_quality, lpips_distance

                    q = frame_quality(frames, ref, device=device)
                    row.update(psnr_db=q["psnr"], ssim=q["ssim"], psnr_per_frame=q["psnr_per_frame"],
                               quality_source=src if src == ref_src else f"{src} vs {ref_src}")
                    if lpips_note is None:
                        row["lpips"], lpips_note = lpips_distance(frames, ref)
                        lpips_note = lpips_note or ""
                    elif not lpips_note:
                        row["lpips"] = lpips_distance(frames, ref)[0]
        row["stack"], row["content"] = (runs[label].stack, runs[label].content) if label in runs else (label, None)
        row["_settings"] = ((s.get("run") or {}).get("settings") or {})
        rows.append(row)
    order = list(dict.fromkeys(r["content"] for r in rows))
    if content is not None:
        if not 1 <= content <= len(order):
            raise ValueError(f"--content {content}: {results} holds renders of {len(order)} content(s)")
        rows = [r for r in rows if r["content"] == order[content - 1]]
        from vdbench.sets import describe

        notes.insert(0, f"content {content} of {len(order)}: {describe(rows[0]['_settings'])}")
    if lpips_note:
        notes.append(lpips_note)
    notes.extend(_speed_notes(rows))
    if any((one_time_shown(r["one_time_s"], _spread_s(r)) or 0.0) < 0 for r in rows if not r.get("emulated")):
        notes.append(NEGATIVE_ONE_TIME_NOTE)
    header = next((s["run"] for s in sp.values() if s.get("run")), {})
    grid = next((p for p in (results / "comparison_grid.mp4", results.parent / "comparison_grid.mp4") if p.exists()),
                None)
    videos = {label: p.with_suffix(".mp4") for label, (p, _) in found.items() if p.with_suffix(".mp4").is_file()}
    poster = grid or videos.get(reference) or next(iter(videos.values()), None)
    return {"run": str(run_dir), "results": str(results), "reference": reference, "reference_name": reference_name,
            "rows": rows, "notes": notes,
            "sets": set_summary(rows) if content is None and len(order) > 1 else [], "header": header, "poster": str(poster) if poster else None,
            "poster_kind": "comparison grid" if grid else (f"{reference} render" if poster and poster == videos.get(reference)
                                                            else "first render")}


def set_summary(rows: list[dict]) -> list[dict]:
    """One row per stack over a prompt and seed set's renders (:func:`summarize`'s rows): how many, the median of
    their warm steps, and their PSNR / SSIM against the reference render of each one's own content as the mean with
    min-max and n (:func:`vdbench.sets.spread`; the reference's own renders left out)."""
    from vdbench.sets import spread

    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["stack"], []).append(r)
    out = []
    for stack, rs in by.items():
        compared = [r for r in rs if r.get("reference") and r["reference"] != r["backend"]]
        out.append({"stack": stack, "renders": len(rs), "warm_step_ms": _median(r["warm_step_ms"] for r in rs),
                    "emulated": any(r.get("emulated") for r in rs),
                    "psnr": spread(r["psnr_db"] for r in compared), "ssim": spread(r["ssim"] for r in compared)})
    return out


def _speed_notes(rows: list[dict]) -> list[str]:
    """The warning lines for the rows whose times are not speed figures, grouped by reason (one line per
    reason, naming the backends), and the emulated ones, whose speed cells say "emulated"."""
    by_why: dict[str, list[str]] = {}
    for r in rows:
        if r.get("speed_figure") is False and not r.get("emulated"):
            by_why.setdefault(r["why_not_speed"], []).append(r["backend"])
    out = [f"not a speed figure ({why}): {', '.join(names)}" for why, names in by_why.items()]
    emu = [r["backend"] for r in rows if r.get("emulated")]
    if emu:
        out.append(f"emulated backends carry no speed (their time cells say 'emulated'; accuracy stays): "
                   f"{', '.join(emu)}")
    return out


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return v


def write_csv(summaries: list[dict], path) -> Path:
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for s in summaries:
            for r in s["rows"]:
                w.writerow({k: EMULATED if (r.get("emulated") and k in SPEED_COLUMNS) else _csv_value(r.get(k))
                            for k in CSV_COLUMNS})
    return path


def _png_uri(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The (time, psnr, label) points that no other point beats on both axes (faster *and* at least as
    accurate), sorted by time: the backends worth considering at each speed."""
    front, best = [], -math.inf
    for t, q, label in sorted(points, key=lambda p: (p[0], -p[1])):
        if q > best:
            front.append((t, q, label))
            best = q
    return front


def _plots(summary: dict) -> list[tuple[str, str]]:
    """(caption, data URI) for each plot this run's data supports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    rows = summary["rows"]
    not_speed = any(r.get("speed_figure") is False and r.get("warm_step_ms") is not None for r in rows)
    flag = " (NOT a speed figure: see the notes)" if not_speed else ""
    timed = [r for r in rows if r.get("warm_step_ms") is not None]
    pts = [(r["warm_step_ms"], r["psnr_db"], r["backend"]) for r in timed if r["psnr_db"] is not None]
    if pts:
        finite = [q for _, q, _ in pts if math.isfinite(q)]
        cap = (max(finite) + 5.0) if finite else 60.0  # an identical render has infinite PSNR: draw it on top
        pts = [(t, q if math.isfinite(q) else cap, lab) for t, q, lab in pts]
        by = {r["backend"]: r for r in timed}
        err = [[t - by[lab]["warm_step_p20_ms"] for t, _, lab in pts], [by[lab]["warm_step_p80_ms"] - t for t, _, lab in pts]]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], xerr=err, fmt="o", ms=7, color="tab:blue", capsize=3,
                    zorder=3, label="warm step: median, p20–p80")
        for t, q, lab in pts:
            work = by[lab].get("work")
            ax.annotate(f"{lab} (n={by[lab]['warm_step_n']}" + (f", work {work:.2f})" if work is not None and work < 1
                                                                 else ")"), (t, q), textcoords="offset points",
                        xytext=(5, 5), fontsize=9)
        front = pareto_front(pts)
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:red", zorder=2,
                label="Pareto front (faster and at least as accurate)")
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=120, facecolors="none", edgecolors="tab:red")
        if not finite or any(q == cap for _, q, _ in pts):
            ax.axhline(cap, color="grey", lw=0.5)
            ax.text(ax.get_xlim()[0], cap, " identical to reference (PSNR inf)", va="bottom", fontsize=8)
        ax.set_xlabel("warm step (ms): median of the steps after the first")
        ax.set_ylabel(f"PSNR vs {summary['reference']} (dB)")
        ax.set_title("speed vs quality" + flag)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        out.append(("Speed vs quality: lower left is fast, up is accurate; the dashed line is the Pareto front; "
                    "horizontal bars span p20–p80 of the warm steps; 'work' is the fraction of self-attention block "
                    "pairs a sparse pattern computed. Emulated backends carry no speed and are not drawn.",
                    _png_uri(fig)))
    if timed:
        fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(timed)))
        ys = list(range(len(timed)))
        med = [r["warm_step_ms"] for r in timed]
        ax.barh(ys, med, color=["tab:gray" if r.get("speed_figure") is False else "tab:blue" for r in timed],
                xerr=[[m - r["warm_step_p20_ms"] for m, r in zip(med, timed)],
                      [r["warm_step_p80_ms"] - m for m, r in zip(med, timed)]], capsize=4, alpha=0.8)
        ax.plot([r["warm_step_min_ms"] for r in timed], ys, "|", color="k", ms=10, label="min / max")
        ax.plot([r["warm_step_max_ms"] for r in timed], ys, "|", color="k", ms=10)
        reps = [(m, y) for r, y in zip(timed, ys) if (r.get("repetitions") or 0) > 1 for m in r["rep_warm_medians_ms"]]
        if reps:
            ax.plot([m for m, _ in reps], [y for _, y in reps], "o", color="tab:orange", ms=4,
                    label="each repetition's warm median")
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{r['backend']} (n={r['warm_step_n']})" for r in timed], fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("warm step (ms): median of the steps after the first; error bar p20–p80")
        ax.set_title("time per warm step" + flag)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
        out.append(("Warm step per backend: bar = median of the steps after the first (all repetitions pooled), "
                    "error bar = p20–p80, ticks = min and max, dots = each repetition's warm median; grey bars are "
                    "not speed figures (CPU, or fewer than 3 warm steps).", _png_uri(fig)))
    steps = [(r["backend"], r["step_times"]) for r in rows if r.get("step_times")]
    if steps:
        fig, ax = plt.subplots(figsize=(7, 4))
        for lab, st in steps:
            ax.plot(range(1, len(st) + 1), [t * 1e3 for t in st], marker="o", label=lab)
        ax.set_xlabel("denoising step")
        ax.set_ylabel("time (ms)")
        ax.set_title("time per step (median over the repetitions of the last run)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out.append(("Per-step time: the first step includes one-off initialisation (reported apart as the first "
                    "step); emulated backends are not drawn.", _png_uri(fig)))
    frames = [(r["backend"], r["psnr_per_frame"]) for r in rows
              if r.get("psnr_per_frame") and all(math.isfinite(v) for v in r["psnr_per_frame"])]
    if frames:
        fig, ax = plt.subplots(figsize=(7, 4))
        for lab, pf in frames:
            ax.plot(range(len(pf)), pf, marker=".", label=lab)
        ax.set_xlabel("frame")
        ax.set_ylabel("PSNR (dB)")
        ax.set_title(f"per-frame PSNR vs {summary['reference']}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out.append(("Per-frame PSNR: a downward drift means the error grows over time.", _png_uri(fig)))
    return out


def _poster_uri(video) -> str | None:
    from PIL import Image

    gen = iter_frames(video)
    try:
        frame = next(gen)
    finally:
        gen.close()
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _spread_s(row: dict) -> Optional[float]:
    """A summary row's warm-step p20–p80 spread in seconds, None where either end is missing."""
    lo, hi = row.get("warm_step_p20_ms"), row.get("warm_step_p80_ms")
    return (hi - lo) / 1e3 if lo is not None and hi is not None else None


def _fmt(v, spec: str) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec) if spec else str(v)


_CSS = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1150px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}th,td{border:1px solid #bbb;padding:3px 7px}
th{background:#eee}td.n{text-align:right}.note{background:#fff4d6;border-left:4px solid #e0a800;padding:6px 10px;
margin:6px 0}figure{margin:12px 0}figcaption{font-size:12px;color:#555}img{max-width:100%;border:1px solid #ddd}
code{background:#f3f3f3;padding:1px 3px}"""


def _header_line(h: dict) -> str:
    sysinfo, settings = h.get("system") or {}, h.get("settings") or {}
    device = sysinfo.get("gpu") or sysinfo.get("device") or "unknown device"
    bits = [f"device: {device}", f"torch {sysinfo.get('torch', '?')}", f"diffusers {sysinfo.get('diffusers', '?')}"]
    if sysinfo.get("cuda"):
        bits.append(f"CUDA {sysinfo['cuda']}")
    for k in ("model", "height", "width", "num_frames", "num_inference_steps"):
        if settings.get(k) is not None:
            bits.append(f"{k}={settings[k]}")
    return " · ".join(bits)


def _sets_html(s: dict) -> str:
    """The table of a prompt and seed set: one row per stack, its quality over the set."""
    from vdbench.sets import spread_text

    esc = html.escape
    contents = len({r["content"] for r in s["rows"]})
    head = ["stack", "renders", "warm step ms (median of the renders)",
            f"PSNR vs {s.get('reference_name', 'reference')} over the set: mean (min–max, n)",
            "SSIM: mean (min–max, n)"]
    body = []
    for r in s["sets"]:
        warm = EMULATED if r["emulated"] else ("–" if r["warm_step_ms"] is None else f"{r['warm_step_ms']:.1f}")
        cells = [r["stack"], str(r["renders"]), warm, spread_text(r["psnr"]),
                 "–" if r["ssim"] is None else spread_text(r["ssim"], "", ".4f")]
        body.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    return (f"<h3>Over the prompt and seed set ({contents} contents; each render against the reference render of its "
            f"own content)</h3><table class='summary'><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head)
            + "</tr>" + "".join(body) + "</table><h3>Each render</h3>")


def write_html(summaries: list[dict], path) -> Path:
    """The report page: per run, its header, notes, the summary table, the plots and the poster frame."""
    esc = html.escape
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>vdbench report</title>",
             f"<style>{_CSS}</style></head><body>"]
    first = next((s["header"] for s in summaries if s["header"]), {})
    parts.append(f"<h1>vdbench report</h1><p class='sub'>{esc(_header_line(first))}</p>")
    for s in summaries:
        parts.append(f"<h2>{esc(s['run'])}</h2>")
        if s["header"] and s["header"] is not first:
            parts.append(f"<p>{esc(_header_line(s['header']))}</p>")
        for n in s["notes"]:
            parts.append(f"<div class='note'>{esc(n)}</div>")
        if s.get("sets"):
            parts.append(_sets_html(s))
        has_q = any(r["psnr_db"] is not None for r in s["rows"])
        multi = any((r.get("repetitions") or 0) > 1 for r in s["rows"])
        energy = any(r.get("step_energy_j") is not None for r in s["rows"])
        cols = [("backend", "backend", ""), ("warm step ms (median after the first step)", "warm_step_ms", ".1f")]
        cols += [("J per warm step, every card", "step_energy_j", ".1f")] if energy else []
        cols += [("n", "warm_step_n", ""), ("p20–p80 ms", ("warm_step_p20_ms", "warm_step_p80_ms"), ".1f"),
                ("min–max ms", ("warm_step_min_ms", "warm_step_max_ms"), ".1f"),
                ("first step ms", "first_step_ms", ".1f"),
                ("end-to-end (s)", "end_to_end_s", ".2f"), ("one-time (s)", "one_time_s", ".2f"),
                ("break-even steps vs default", "break_even_steps_vs_default", "")]
        if multi:
            cols += [("repetitions", "repetitions", ""),
                     ("their warm medians, min–max ms", ("rep_warm_min_ms", "rep_warm_max_ms"), ".1f")]
        cols += [("speedup vs default", "speedup_vs_default", ".2f"), ("speed figure", "speed_figure", ""),
                 ("attention share", "attention_share", ".1%"),
                 ("VAE decode (s)", "vae_decode_s", ".2f"), ("VAE encode (s)", "vae_encode_s", ".2f"),
                 ("stages (s), what no stage covers", "stages", ""),
                 ("peak GiB allocated / reserved (every card's largest)", ("peak_memory_gib", "peak_reserved_gib"),
                  ".2f")]
        if any(r.get("memory_stages_gib") for r in s["rows"]):
            cols += [("GiB per stage, allocated/reserved", "memory_stages_gib", "")]
        if energy:
            cols += [("power-capped share", "power_capped_share", ".0%")]
        if has_q:
            cols += [(f"PSNR vs {s['reference']} (dB)", "psnr_db", ".2f"), ("SSIM", "ssim", ".4f"),
                     ("LPIPS (lower is closer)", "lpips", ".4f"), ("quality from", "quality_source", "")]
            if len({r.get("reference") for r in s["rows"] if r.get("reference")}) > 1:
                cols += [("against", "reference", "")]
        cols += [("kernels that ran", "kernels", ""), ("work (self-attn block pairs computed)", "work", ".2f"),
                 ("fallback calls", "fallback_calls", ""), ("note", "note", "")]
        parts.append("<table class='summary'><tr>" + "".join(f"<th>{esc(c[0])}</th>" for c in cols) + "</tr>")
        for r in s["rows"]:
            cells = []
            for _, key, spec in cols:
                keys = key if isinstance(key, tuple) else (key,)
                if r.get("emulated") and any(k in SPEED_COLUMNS for k in keys):
                    cells.append(f"<td>{EMULATED}</td>")
                    continue
                if key == "speed_figure":
                    v = r.get(key)
                    text = "–" if v is None else ("yes" if v else f"no: {r.get('why_not_speed')}")
                    cells.append(f"<td>{esc(text)}</td>")
                    continue
                if key == "one_time_s":  # a negative within the timing noise shows as 0.00 (one_time_shown)
                    num = " class=n" if r.get(key) is not None else ""
                    cells.append(f"<td{num}>{esc(one_time_cell(r.get(key), _spread_s(r)))}</td>")
                    continue
                vals = [r.get(k) for k in keys]
                text = "–" if any(v is None for v in vals) else "–".join(_fmt(v, spec) for v in vals)
                num = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
                cells.append(f"<td{' class=n' if num else ''}>{esc(text)}</td>")
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")
        for caption, uri in _plots(s):
            parts.append(f"<figure><img src='{uri}' alt='{esc(caption)}'><figcaption>{esc(caption)}</figcaption></figure>")
        if s["poster"]:
            try:
                uri = _poster_uri(s["poster"])
            except (OSError, ValueError) as exc:
                parts.append(f"<div class='note'>poster frame unavailable: {esc(str(exc))}</div>")
            else:
                cap = f"first frame of the {s['poster_kind']} ({os.path.basename(s['poster'])})"
                parts.append(f"<figure><img src='{uri}' alt='poster'><figcaption>{esc(cap)}</figcaption></figure>")
        else:
            parts.append("<div class='note'>no video to take a poster frame from</div>")
    parts.append("</body></html>")
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------------
# Figure labels for stitch_comparison.py --reference
# --------------------------------------------------------------------------------------------------------


def video_psnr(video, ref_video) -> float | None:
    """PSNR (dB, over all frames) of two decoded videos, streamed frame by frame so two 81-frame 480p clips
    never sit in memory at once; None when their sizes or frame counts differ (not comparable)."""
    from vdbench.measure.quality import stream_psnr

    a_gen, b_gen = iter_frames(video), iter_frames(ref_video)
    try:
        return stream_psnr(a_gen, b_gen)
    finally:
        a_gen.close()
        b_gen.close()


def figure_labels(inputs, labels, reference: str, timing_dir=None, warnings: list | None = None) -> list[str]:
    """``label · 812 ms/step 1.05× (n=…) · PSNR dB`` for each input: the warm step (``vdbench.timing``'s
    definition: median of the steps after the first) and its speedup from ``timing_dir/timing.json`` (against
    ``default`` when it was rendered, else against the first input), PSNR of each decoded video against the
    reference input's decoded video.
    Each input's figures are its render's, found through its record (:func:`identities`: the record naming the
    video's path, in its folder or ``timing_dir``). ``reference`` names an input by its label, by its run's label
    or by its run's attention spec (``reference`` finds ``reference+u2``). Parts that cannot be computed
    (no timing entry, another size) are left out of that label. The speedup carries the n of the backend's warm
    steps; an emulated backend gets "emulated" instead of a speedup; a speedup from timings that are not speed
    figures (a CPU, n < 3) says so in the label, and the reason is appended to ``warnings`` when a list is given
    (the caller prints it)."""
    ids = identities(inputs, timing_dir)
    keys = [i.label for i in ids]
    runs = dict(zip(keys, ids))
    if reference in labels:
        ref_idx = {ids[list(labels).index(reference)].content: list(labels).index(reference)}
    else:  # one reference per content: a cell is compared with the reference render of its own prompt and seed
        ref_idx = {content: keys.index(key) for content, key in references(reference, runs).items()}
    if not ref_idx:
        raise ValueError(f"--reference {reference!r} is none of the inputs ({', '.join(labels)})")
    sp = speed(Path(timing_dir)) if timing_dir is not None else {}
    step = {k: (sp.get(k) or {}).get("warm_step_median") for k in keys}
    default_key = match_label("default", runs)
    base_key = default_key if default_key and (sp.get(default_key) or {}).get("warm_step_median") else keys[0]
    base = step.get(base_key) or (sp.get(base_key) or {}).get("warm_step_median")
    base_why = (sp.get(base_key) or {}).get("why_not_speed")
    out = []
    for i, (path, label, key) in enumerate(zip(inputs, labels, keys)):
        parts = [label]
        s = sp.get(key) or {}
        if s.get("emulated"):
            parts.append(EMULATED)
        elif step.get(key):
            ms = step[key] * 1e3
            text = f"{ms:.3g} ms/step" if ms < 100 else f"{ms:.0f} ms/step"
            x = base / step[key] if base else None
            if x is not None:
                text += f" {x:.2f}×" if x < 10 else f" {x:.1f}×"
            why = "; ".join(dict.fromkeys(w for w in (s.get("why_not_speed"), base_why if x else None) if w))
            text += f" (n={s.get('warm_step_n')}" + (": not a speed figure)" if why else ")")
            if why and warnings is not None:
                warnings.append(f"{label}: {ms:.3g} ms/step" + (f", speedup {x:.2f}×," if x is not None else "")
                                + f" is not a speed figure: {why}")
            parts.append(text)
        mine = ref_idx.get(ids[i].content)
        if i == mine:
            parts.append("ref")
        elif mine is not None:
            q = video_psnr(path, inputs[mine])
            if q is not None:
                parts.append("∞ dB" if math.isinf(q) else f"{q:.1f} dB")
        out.append(" · ".join(parts))
    return out


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vdbench.report", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="results directory (or a directory holding results/)")
    p.add_argument("--reference", default="reference", help="label of the reference render (default: reference)")
    p.add_argument("-o", "--output_dir", type=Path, default=None,
                   help="where report.html and summary.csv go (default: the first RUN_DIR)")
    p.add_argument("--device", default=None, help="run the SSIM windows here (e.g. cuda): much faster on 480p")
    p.add_argument("--content", type=int, default=None, metavar="N",
                   help="of renders of several contents (a prompt and seed set), report the N-th content's alone "
                        "(default: every render, and each stack's quality over the set)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summaries = [summarize(d, args.reference, device=args.device, content=args.content) for d in args.run_dirs]
    except (FileNotFoundError, ValueError) as exc:
        print(f"vdbench.report: error: {exc}", file=sys.stderr)
        return 2
    out = args.output_dir or args.run_dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    print(write_csv(summaries, out / "summary.csv"))
    print(write_html(summaries, out / "report.html"))
    for s in summaries:
        for n in s["notes"]:
            print(f"note: {s['run']}: {n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
