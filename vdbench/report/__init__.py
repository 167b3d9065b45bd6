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

The package also holds the figure labels of ``stitch_comparison.py --reference``
(:func:`figure_labels`): speedup of the warm steps from timing.json and PSNR of each decoded video against the
reference's.
"""

from .cells import (BREAK_EVEN_NOTE, EMULATED, NEGATIVE_ONE_TIME_NOTE, ONE_TIME_RESOLUTION_S, break_even,
                    break_even_cell, break_even_text, memory_text, one_time_cell, one_time_shown)
from .cli import build_parser, main
from .labels import figure_labels, video_psnr
from .plots import pareto_front
from .records import (FROM_FILE_NAME, collect, identities, is_grid_name, load_frames, match_label, records_of,
                      references, refused, render_records, resolve_results, shown_labels)
from .summary import set_summary, summarize
from .timings import entry_identity, entry_label, latest_run, rank_max, resolved, speed
from .write import CSV_COLUMNS, SPEED_COLUMNS, write_csv, write_html

__all__ = ["resolve_results", "is_grid_name", "collect", "rank_max", "memory_text", "render_records", "records_of",
           "identities", "refused", "match_label", "references", "shown_labels", "resolved", "FROM_FILE_NAME",
           "load_frames", "speed", "summarize", "write_csv", "write_html", "figure_labels", "video_psnr", "main",
           "CSV_COLUMNS", "SPEED_COLUMNS", "EMULATED", "break_even", "break_even_text", "break_even_cell",
           "BREAK_EVEN_NOTE", "one_time_shown", "one_time_cell", "NEGATIVE_ONE_TIME_NOTE"]
