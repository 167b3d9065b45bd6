"""The renders of a results folder as the report reads them: the folder itself (:func:`resolve_results`), each
render's frame source (raw ``.npy`` over the mp4: :func:`render_sources`), its record and identity
(:func:`records_of`, :func:`identities`: the record naming the video, its file name only where none does), the files
whose bytes are not those their record vouches for (:func:`refused`), and which render is each content's reference
(:func:`references`, :func:`match_label`)."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Optional

import numpy as np

from vdbench.measure import record as R
from vdbench.video import identity_from_filename, iter_frames, run_of


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


def render_sources(results: Path, notes: Optional[list] = None) -> dict:
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
    return {label: p for label, (p, _) in render_sources(results).items()}


def match_label(name: str, runs) -> str | None:
    """The label among ``runs`` (label -> :class:`~vdbench.measure.record.Identity`) that ``name`` means: itself,
    else the first run whose stack is ``name`` (``fav3+u2`` finds ``fav3+u2 [id-337af5e3]``, its settings' tag
    aside), else the first whose attention is ``name`` (so ``reference`` finds ``reference+u2`` in a batch rendered
    under torchrun); None if none."""
    return next(_named(name, runs), None)


def _named(name: str, runs):
    """The labels among ``runs`` that ``name`` means, best first: itself, the runs whose stack is ``name``, the runs
    whose attention is ``name`` (:func:`match_label`, :func:`references`)."""
    yield from (label for label in runs if label == name)
    yield from (label for label, ident in runs.items() if ident.stack == name)
    yield from (label for label, ident in runs.items() if ident.attention == name)


def shown_labels(idents) -> tuple[list[str], Optional[str]]:
    """The labels to show for renders of these identities, and the identity tag they all share (None where they
    don't): a tag common to every render (a batch's one prompt, image or frame rate) is said once, not on each."""
    tags = {i.tag for i in idents}
    if len(tags) == 1 and next(iter(tags)):
        return [i.stack for i in idents], next(iter(tags))
    return [i.label for i in idents], None


def references(name: str, runs) -> dict:
    """content -> the label of the reference render of that content, among ``runs`` (label ->
    :class:`~vdbench.measure.record.Identity`): the run labelled ``name``, else the first whose stack is ``name``
    (its settings' tag aside), else the first whose attention is ``name`` (so ``reference`` finds
    ``reference+u2``), one per content (:attr:`Identity.content`: renders of the
    same prompt, seed and size are compared with each other; records without it share one content, None)."""
    out: dict = {}
    for label in _named(name, runs):
        out.setdefault(runs[label].content, label)
    return out
