"""The report's files: summary.csv (:data:`CSV_COLUMNS`, :func:`write_csv`) and the self-contained report.html
(:func:`write_html`: inline CSS, plots and poster frame as data URIs, no script)."""

from __future__ import annotations

import csv
import html
import math
import os
from pathlib import Path

from .cells import EMULATED, one_time_cell, warm_spread_s
from .plots import poster_uri, run_plots


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
                    cells.append(f"<td{num}>{esc(one_time_cell(r.get(key), warm_spread_s(r)))}</td>")
                    continue
                vals = [r.get(k) for k in keys]
                text = "–" if any(v is None for v in vals) else "–".join(_fmt(v, spec) for v in vals)
                num = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
                cells.append(f"<td{' class=n' if num else ''}>{esc(text)}</td>")
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")
        for caption, uri in run_plots(s):
            parts.append(f"<figure><img src='{uri}' alt='{esc(caption)}'><figcaption>{esc(caption)}</figcaption></figure>")
        if s["poster"]:
            try:
                uri = poster_uri(s["poster"])
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
