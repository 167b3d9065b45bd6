"""The labelled comparison grid: several backends' videos stitched into one (``stitch_comparison.py``), written
under :mod:`vdbench.video`'s rules (a temporary name moved onto the target after the frame count was read back;
frames streamed). Labels use the DejaVuSans font that matplotlib ships."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .video import (DEFAULT_CRF, MADE_BY_GRID, VideoError, VideoInfo, label_from_filename, probe_result, probe_video,
                    remove_quietly, temp_path_next_to)

__all__ = ["find_font", "grid_shape", "stitch_grid", "LABEL_MAX_LINES"]

#: Opacity of the dark band behind a cell label: opaque enough for white text to stay readable on a white
#: frame, transparent enough that the video content under it stays visible.
LABEL_BAND_OPACITY = 0.65

#: Labels are wrapped onto up to this many lines, then shrunk down to MIN_FONT_SIZE (then ellipsised) before they
#: would overflow their cell.
LABEL_MAX_LINES = 3
MIN_FONT_SIZE = 8


@functools.lru_cache(maxsize=32)
def find_font(size: int):
    """DejaVuSans at ``size`` pixels as a PIL FreeType font.

    The font file comes from matplotlib's data directory (a project dependency), so labels render the same
    on every machine without system fonts or ImageMagick. There is deliberately no fallback to PIL's bitmap
    font: it ignores ``size`` and would silently produce unreadable labels.
    """
    size = int(size)
    if size < 1:
        raise ValueError(f"font size must be positive, got {size}")
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is a declared dependency
        raise FileNotFoundError("labels need the DejaVuSans font that ships with matplotlib, "
                                "but matplotlib is not installed (pip install matplotlib)") from exc
    font_path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    if not font_path.is_file():
        raise FileNotFoundError(f"DejaVuSans.ttf not found at {font_path}; the matplotlib install looks incomplete")
    return ImageFont.truetype(str(font_path), size)


class _LabelBand:
    """A label as a precomputed blend for the top rows of a cell: white text on a dark semi-opaque band.

    The text is rasterised once with PIL (anti-aliased coverage ``m``); per frame the band rows become
    ``frame * (1 - opacity) * (1 - m) + 255 * m``, one multiply-add on a few dozen rows, which is much
    cheaper than alpha-compositing a full-cell RGBA overlay for every frame.
    """

    def __init__(self, text: str, width: int, font_size: int, opacity: float = LABEL_BAND_OPACITY):
        size = max(int(font_size), 1)
        font, lines = self._fit(text, width, size)
        ascent, descent = font.getmetrics()
        pad = max(2, font.size // 4)
        line_h = ascent + descent
        self.height = line_h * len(lines) + 2 * pad
        mask = Image.new("L", (width, self.height), 0)
        draw = ImageDraw.Draw(mask)
        for i, line in enumerate(lines):
            draw.text((pad, pad + i * line_h), line, font=font, fill=255)
        m = np.asarray(mask, dtype=np.float32)[:, :, None] / 255.0
        self.keep = (1.0 - opacity) * (1.0 - m)
        self.add = 255.0 * m + 0.5  # +0.5: round on the uint8 cast
        self.text = "\n".join(lines)

    @staticmethod
    def _wrap(text: str, font, room: float) -> list[str]:
        """Greedy word wrap at spaces to ``room`` pixels (a word wider than the room gets a line of its own)."""
        lines: list[str] = []
        for word in text.split(" "):
            if lines and font.getlength(lines[-1] + " " + word) <= room:
                lines[-1] += " " + word
            else:
                lines.append(word)
        return lines

    @staticmethod
    def _fit(text: str, width: int, size: int, max_lines: int = LABEL_MAX_LINES):
        """The font and lines of a label at ``size``: one line if it fits, else wrapped at spaces onto up to
        ``max_lines`` lines, the last one ellipsised if the text still overflows (the grid picks a size at which
        none does: :func:`_label_size`)."""
        font = find_font(size)
        room = width - 2 * max(2, size // 4)
        lines = _LabelBand._wrap(text, font, room)[:max_lines]
        last = lines[-1]
        if font.getlength(last) > room or " ".join(lines) != " ".join(text.split(" ")):
            while last and font.getlength(last + "\u2026") > room:
                last = last[:-1]
            lines[-1] = last + "\u2026" if last else ""
        return font, lines

    @staticmethod
    def fits(text: str, width: int, size: int, max_lines: int = LABEL_MAX_LINES) -> bool:
        """Whether ``text`` fits ``width`` at ``size`` on up to ``max_lines`` wrapped lines."""
        font = find_font(size)
        room = width - 2 * max(2, size // 4)
        lines = _LabelBand._wrap(text, font, room)
        return len(lines) <= max_lines and all(font.getlength(x) <= room for x in lines)

    def apply(self, canvas: np.ndarray) -> None:
        """Blend the band into ``canvas`` (H, W, 3 uint8) in place."""
        h = min(self.height, canvas.shape[0])
        band = canvas[:h].astype(np.float32)
        band *= self.keep[:h]
        band += self.add[:h]
        canvas[:h] = band.astype(np.uint8)


def _label_size(labels, width: int, font_size: int) -> int:
    """One font size for every label of a grid: the largest up to ``font_size`` at which each label fits its cell
    (wrapped at spaces onto up to LABEL_MAX_LINES lines: a label carrying figures, ``sdpa · 705 ms/step … ·
    58.4 dB``, keeps them all on a narrow cell), never below MIN_FONT_SIZE (then the overflow is ellipsised)."""
    size = max(int(font_size), 1)
    while size > MIN_FONT_SIZE and not all(_LabelBand.fits(t, width, size) for t in labels if t):
        size -= 1
    return size


# --------------------------------------------------------------------------------------------------------
# Comparison grid
# --------------------------------------------------------------------------------------------------------


def grid_shape(n: int, layout: tuple[int, int] | None = None) -> tuple[int, int]:
    """(rows, cols) for ``n`` cells: ``layout`` if given (it must hold ``n``), else as square as possible
    with the extra cells on the right (cols = ceil(sqrt(n)), rows = ceil(n / cols))."""
    if layout is None:
        cols = math.ceil(math.sqrt(n))
        return math.ceil(n / cols), cols
    try:
        rows, cols = (int(v) for v in layout)
    except (TypeError, ValueError):
        raise ValueError(f"layout must be (rows, cols), got {layout!r}") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"layout {rows}x{cols}: rows and cols must be at least 1")
    if rows * cols < n:
        raise ValueError(f"layout {rows}x{cols} has {rows * cols} cells, too few for {n} videos")
    return rows, cols


def _even_up(v: int) -> int:
    return v + (v % 2)


def _fit_size(w: int, h: int, cell_w: int, cell_h: int) -> tuple[int, int]:
    """The largest size with w:h's aspect ratio that fits the cell (at least 1x1)."""
    scale = min(cell_w / w, cell_h / h)
    return max(1, min(cell_w, round(w * scale))), max(1, min(cell_h, round(h * scale)))


def stitch_grid(
    inputs: Sequence,
    output,
    labels: Sequence[str] | None = None,
    fps: float | None = None,
    font_size: int = 24,
    layout: tuple[int, int] | None = None,
    cell_size: tuple[int, int] | None = None,
    *,
    crf: int = DEFAULT_CRF,
    preset: str = "veryfast",
    threads: int | None = None,
) -> str:
    """Stitch videos into one labelled grid video at ``output`` and return ``output`` (as a string).

    One cell per input, in order, row-major; labels (default: :func:`label_from_filename`) are drawn as
    white text on a dark semi-opaque band at the top of each cell. The grid is ``layout=(rows, cols)`` or as
    square as possible; leftover cells are black. Each video is scaled by ffmpeg while decoding to fit
    ``cell_size=(width, height)`` (default: the largest input's size) keeping its aspect ratio, and
    letterboxed in black; sizes are rounded up to even for yuv420p. Shorter videos hold their last frame
    until the longest one ends; the output runs at ``fps`` (default: the first input's frame rate).

    Built on moviepy: ``VideoFileClip`` readers (scaling inside ffmpeg), one ``VideoClip`` for the grid and
    ``write_videofile`` (libx264, ``preset``, ``crf``, ``threads``, no audio). It streams: one decoded frame
    per input is alive at a time. All inputs are probed before anything is written, so a bad file fails
    fast with a :class:`VideoError` naming it. The encode goes to a temporary name next to ``output`` that
    is renamed onto it only when complete and its frame count checked.
    """
    # moviepy is imported here, not at module level: its import takes over a second, and the benchmark
    # runs that only write and probe videos should not pay for it.
    from moviepy import VideoFileClip

    inputs = [os.fspath(p) for p in inputs]
    output = os.fspath(output)
    if not inputs:
        raise ValueError("no input videos to stitch")
    if len(inputs) == 1:
        raise ValueError(f"need at least two videos to compare, got only {inputs[0]}")
    if labels is None:
        labels = [label_from_filename(p) for p in inputs]
    else:
        labels = [str(x) for x in labels]
        if len(labels) != len(inputs):
            raise ValueError(f"{len(labels)} labels given for {len(inputs)} videos")
    out_abs = os.path.abspath(output)
    for p in inputs:
        if os.path.abspath(p) == out_abs:
            raise ValueError(f"output {output} is also one of the inputs")
    rows, cols = grid_shape(len(inputs), layout)
    if fps is not None and fps <= 0:
        raise ValueError(f"fps must be positive, got {fps!r}")
    if font_size < 1:
        raise ValueError(f"font_size must be positive, got {font_size!r}")

    infos = [probe_video(p) for p in inputs]

    if cell_size is None:
        largest = max(infos, key=lambda i: (i.width * i.height, i.width))
        cell_w, cell_h = largest.width, largest.height
    else:
        cell_w, cell_h = (int(v) for v in cell_size)
        if cell_w < 2 or cell_h < 2:
            raise ValueError(f"cell_size must be at least 2x2, got {cell_size!r}")
    cell_w, cell_h = _even_up(cell_w), _even_up(cell_h)

    out_fps = float(fps) if fps is not None else infos[0].fps
    total = max(i.duration for i in infos)
    n_out = max(1, math.ceil(total * out_fps - 1e-6))
    # moviepy writes int(duration * fps) frames at t = k / fps; half a frame of slack keeps float error from
    # dropping the last one, and every cell lasts that long so that none stops playing early.
    clip_duration = (n_out + 0.5) / out_fps

    sources, cells = [], []
    tmp = None
    try:
        label_size = _label_size(labels, cell_w, font_size)
        for info, label in zip(infos, labels):
            scaled = _fit_size(info.width, info.height, cell_w, cell_h)
            src = VideoFileClip(
                info.path,
                audio=False,
                target_resolution=scaled if scaled != (info.width, info.height) else None,
                resize_algorithm="bicubic",
            )
            sources.append(src)
            cells.append(_Cell(src, info, label, (cell_w, cell_h), scaled, label_size, clip_duration))
        grid = _grid_clip(cells, rows, cols, (cell_w, cell_h), clip_duration)

        tmp = temp_path_next_to(output)
        grid.write_videofile(
            tmp,
            fps=out_fps,
            codec="libx264",
            audio=False,
            preset=preset,
            threads=threads or os.cpu_count(),
            ffmpeg_params=["-crf", str(int(crf)), "-metadata", f"comment={MADE_BY_GRID}"],
            logger=None,
        )
        written = probe_result(tmp, output)
        if written.n_frames != n_out:
            raise VideoError(output, f"encoder wrote {written.n_frames} frames, expected {n_out}")
        os.replace(tmp, output)
        tmp = None
    finally:
        if tmp is not None:
            remove_quietly(tmp)
        for src in sources:
            src.close()
    return output


class _Cell:
    """One input's place in the grid: its moviepy clip held on its last frame past its end, where it sits
    inside the cell (letterbox offsets) and its label band."""

    def __init__(self, src, info: VideoInfo, label: str, cell: tuple[int, int], scaled: tuple[int, int],
                 font_size: int, duration: float):
        cell_w, cell_h = cell
        self.scaled = scaled
        self.offset = ((cell_w - scaled[0]) // 2, (cell_h - scaled[1]) // 2)
        self.band = _LabelBand(label, cell_w, font_size) if label else None
        # Clamp to the last frame's own timestamp (from the exact frame count) rather than to the container
        # duration: asking moviepy's reader past the last decodable frame yields warnings and stale frames.
        t_last = (info.n_frames - 1) / src.fps
        self.clip = src.time_transform(lambda t: min(t, t_last)).with_duration(duration)

    def draw(self, view: np.ndarray, t: float) -> None:
        """Draw the frame at time ``t`` into ``view`` (this cell's slice of a zeroed grid frame), labelled."""
        frame = self.clip.get_frame(t)
        (sw, sh), (ox, oy) = self.scaled, self.offset
        fh, fw = min(frame.shape[0], sh), min(frame.shape[1], sw)
        view[oy:oy + fh, ox:ox + fw] = frame[:fh, :fw, :3]
        if self.band is not None:
            self.band.apply(view)


def _grid_clip(cells: list[_Cell], rows: int, cols: int, cell: tuple[int, int], duration: float):
    """The whole grid as one moviepy ``VideoClip`` whose frame function copies each cell's frame into its
    slice of a fresh zeroed array (the zeros are the letterbox bars and the empty cells).

    This replaces ``clips_array``, whose ``CompositeVideoClip`` round-trips every cell through a PIL image
    (uint8 copy, ``Image.fromarray``, ``paste``, ``np.array``) for every frame. That compositing runs serially
    in the Python process, between the decoders and the encoder: for six 832x480 cells and 81 frames it took
    2.6-3.2 s of Python CPU against 0.8 s here. On 2 cores x264 dominates and the end-to-end gain is about 5%;
    with more cores the encoder gets faster and this serial step is what would bound the stitch. Drawing
    straight into the output array is also the simplest way to keep the reader's own buffers untouched.
    """
    from moviepy import VideoClip

    cell_w, cell_h = cell

    def frame_function(t: float) -> np.ndarray:
        canvas = np.zeros((rows * cell_h, cols * cell_w, 3), dtype=np.uint8)
        for k, c in enumerate(cells):
            r, col = divmod(k, cols)
            c.draw(canvas[r * cell_h:(r + 1) * cell_h, col * cell_w:(col + 1) * cell_w], t)
        return canvas

    return VideoClip(frame_function=frame_function, duration=duration)
