"""The figure labels of ``stitch_comparison.py --reference`` (:func:`figure_labels`): each input's warm step and
speedup from timing.json, and the PSNR of its decoded video against its content's reference (:func:`video_psnr`)."""

from __future__ import annotations

import math
from pathlib import Path

from vdbench.video import iter_frames

from .cells import EMULATED
from .records import identities, match_label, references
from .timings import speed


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
