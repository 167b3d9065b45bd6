"""One run dir's summary (:func:`summarize`): a row per render with its speed, cost and quality figures against the
reference render of its own content, the notes on what is missing, and the table over a prompt and seed set
(:func:`set_summary`)."""

from __future__ import annotations

from typing import Optional

from .cells import BREAK_EVEN_NOTE, NEGATIVE_ONE_TIME_NOTE, break_even_cell, memory_text, one_time_shown, warm_spread_s
from .records import FROM_FILE_NAME, load_frames, match_label, references, render_sources, resolve_results
from .timings import median, speed


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


def _speed_row(run_dir, label: str, s: dict, base_key: str, base_s: dict) -> dict:
    """A render's row with its speed, cost and memory cells from its timing figures ``s`` (``{}``: none), the
    speedup against the ``default`` render's (``base_s``); its quality cells left empty."""
    base = base_s.get("warm_step_median")
    st = s.get("warm_step_median")
    ms = lambda key: s[key] * 1e3 if s.get(key) is not None else None  # noqa: E731
    why = s.get("why_not_speed")
    if st and base and label != base_key and not base_s.get("speed_figure", True):
        why = "; ".join(filter(None, [why, "the 'default' baseline is not a speed figure"]))
    return {"run": str(run_dir), "backend": label,
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


def _add_quality(row: dict, source, ref_of: tuple, device, lpips: list) -> None:
    """The quality cells of ``row`` (its frames at ``source``) against the reference ``ref_of`` (label, frames,
    source), or a note on why there are none; ``lpips``: [None] until LPIPS was tried, then [""] where it runs, else
    [why not] (tried once per summary)."""
    ref_label, ref, ref_src = ref_of
    row["reference"] = ref_label
    try:
        frames, src = load_frames(source)
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
            if lpips[0] is None:
                row["lpips"], why = lpips_distance(frames, ref)
                lpips[0] = why or ""
            elif not lpips[0]:
                row["lpips"] = lpips_distance(frames, ref)[0]


def summarize(run_dir, reference: str = "reference", device=None, content: Optional[int] = None) -> dict:
    """Everything the report shows for one run dir: ``rows`` (one per backend, CSV_COLUMNS keys plus
    ``psnr_per_frame`` and ``step_times``), ``notes`` (what is missing and why), ``header`` (the run's system
    and settings), ``poster`` (the video whose first frame illustrates the run, or None) and ``sets`` (renders of
    several contents, a prompt and seed set: one row per stack over the set, :func:`set_summary`; [] otherwise).
    ``content``: the N-th content's renders alone (1-based, in the rows' order)."""
    results = resolve_results(run_dir)
    notes: list[str] = []
    reference_name = reference
    lpips: list = [None]  # None: not tried yet; "": available; else the reason it is not computed
    found = render_sources(results, notes)
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
        row = _speed_row(run_dir, label, s, base_key, base_s)
        ref_of = reference_of(label) if label in sources and runs[label].from_record else None
        if label not in sources:
            row["note"] = "no video or raw frames found (timing only)"
        elif not runs[label].from_record:
            row["note"] = FROM_FILE_NAME
        elif refs and ref_of is None:
            row["note"] = f"no {reference_name!r} render of the same content (prompt, seed, size): no quality figures"
        elif ref_of is not None:
            _add_quality(row, sources[label], ref_of, device, lpips)
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
    if lpips[0]:
        notes.append(lpips[0])
    notes.extend(_speed_notes(rows))
    if any((one_time_shown(r["one_time_s"], warm_spread_s(r)) or 0.0) < 0 for r in rows if not r.get("emulated")):
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
        out.append({"stack": stack, "renders": len(rs), "warm_step_ms": median(r["warm_step_ms"] for r in rs),
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
