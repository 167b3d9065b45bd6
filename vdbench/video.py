"""Video files for the benchmark: write a pipeline's frames, probe and read them back (:mod:`vdbench.grid` stitches
several backends' videos into one labelled comparison grid over the same rules).

Everything goes through the ffmpeg binary that ``imageio-ffmpeg`` ships, so nothing depends on a system
ffmpeg, ImageMagick or system fonts (labels use the DejaVuSans font that matplotlib ships).

Two rules hold for every file this module writes:

* It is encoded to a temporary name in the destination directory and ``os.replace``-d onto the target only
  after the encoder finished and the result was checked (frame count read back). A crash, an exception or
  Ctrl-C therefore never leaves a truncated file at the target path that looks like a finished result, and
  the temporary file is removed on failure.
* Frames are streamed: memory stays flat in the number of frames (81-frame 832x480 clips times six inputs
  would otherwise be gigabytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import subprocess
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

try:
    import imageio_ffmpeg
except ImportError:  # reading and stitching need it; writing can use OpenCV instead (see write_video)
    imageio_ffmpeg = None
import numpy as np
from PIL import Image

from . import families

__all__ = [
    "VideoError",
    "VideoInfo",
    "write_video",
    "frame_to_rgb_uint8",
    "frames_to_rgb_uint8",
    "save_frames",
    "probe_video",
    "iter_frames",
    "label_from_filename",
    "identity_from_filename",
    "render_comment",
    "made_by",
    "written_by_render",
    "run_of",
    "MADE_BY_RENDER",
    "MADE_BY_GRID",
    "temp_path_next_to",
    "probe_result",
    "remove_quietly",
]

#: x264 constant-rate factor for written videos: 18 is visually lossless for these clips, which matters
#: because the videos are compared against each other for kernel-induced artefacts.
DEFAULT_CRF = 18

#: The container ``comment`` tag of every video this module writes: a render's video and a stitched grid. It is how
#: the tools recognise their own outputs (:func:`made_by`) -- a previous output may be replaced, any other file is
#: not without ``--overwrite``, and the stitcher never takes a grid of its own for a cell.
#: A render's comment also carries its run id (:func:`render_comment`), so a video renamed or moved away from the
#: path its record names still finds its record (:func:`run_of`).
MADE_BY_RENDER = "vdbench render"
MADE_BY_GRID = "vdbench comparison grid"
_MADE_BY_RE = re.compile(r"^\s*comment\s*:\s*(?P<tag>vdbench [a-z ]+?)(?: \(run (?P<run>[\w.:-]+)\))?\s*$",
                         re.MULTILINE)


def render_comment(run_id: str) -> str:
    """The comment tag of a render's video: :data:`MADE_BY_RENDER` and the run id its records carry."""
    return f"{MADE_BY_RENDER} (run {run_id})"


class VideoError(ValueError):
    """A video file that cannot be used: missing, unreadable by ffmpeg, without frames, or an encode that
    did not produce what was asked. The message always names the file."""

    def __init__(self, path, reason: str):
        # Both go to args so that the exception pickles (multiprocessing) and round-trips.
        super().__init__(os.fspath(path), reason)
        self.path = os.fspath(path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` found. ``duration`` is ``n_frames / fps`` (the time the frames cover), not
    the container's duration field, which can include a trailing frame's display time or audio."""

    path: str
    width: int
    height: int
    fps: float
    n_frames: int
    duration: float


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------


def frame_to_rgb_uint8(frame, index: int) -> np.ndarray:
    """One frame as a C-contiguous (H, W, 3) uint8 array: exactly what the video encoder is fed, so raw frames
    saved beside a video (the render's ``--save_frames``) compare equal to its input.

    Floats are taken as [0, 1] (what diffusers returns with ``output_type="np"``), clipped and rounded;
    NaN/inf are refused rather than silently written as black, because a NaN frame from a broken kernel is
    a finding, not something to paper over. Grayscale is repeated to RGB and an alpha channel dropped.
    """
    if isinstance(frame, Image.Image):
        arr = np.asarray(frame.convert("RGB"))
    else:
        arr = np.asarray(frame)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
        raise ValueError(f"frame {index}: expected (H, W), (H, W, 1), (H, W, 3) or (H, W, 4), "
                         f"got shape {arr.shape}")
    if arr.shape[2] == 4:
        arr = arr[:, :, :3]
    elif arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    if np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():
            raise ValueError(f"frame {index}: contains NaN or inf values")
        arr = (np.clip(arr, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    elif arr.dtype != np.uint8 and (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        if arr.dtype == np.bool_:
            arr = arr.astype(np.uint8) * 255
        elif arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"frame {index}: integer frames must lie in 0..255 (got {arr.min()}..{arr.max()})")
        arr = arr.astype(np.uint8)
    elif arr.dtype != np.uint8:
        raise ValueError(f"frame {index}: unsupported dtype {arr.dtype}")
    return np.ascontiguousarray(arr)


def frames_to_rgb_uint8(frames) -> np.ndarray:
    """A tensor of float frames (T, H, W, 3) in [0, 1] -> (T, H, W, 3) uint8 numpy, byte for byte what
    :func:`frame_to_rgb_uint8` makes of each frame (float32, clipped, x 255 + 0.5, truncated; NaN/inf refused with
    the first such frame's index), computed where the tensor is.

    Why: a decode's frames are on the GPU; diffusers' ``postprocess_video(output_type="np")`` copies them to the host
    in the VAE's dtype and widens them to float32 there, and the writer then converts each to uint8 on the host: at
    720p x 81 about half a second of every render, whatever the decode mode. Converted on the GPU, the host gets a
    quarter of the float32 bytes and converts nothing. The two multiplications are separate IEEE float32 operations
    on either side (no fused multiply-add), so the bytes are the same (tests/test_video.py)."""
    import torch

    if frames.dim() != 4 or frames.shape[-1] != 3 or not frames.is_floating_point():
        raise ValueError(f"expected float frames (T, H, W, 3), got {tuple(frames.shape)} {frames.dtype}")
    x = frames.float()
    finite = torch.isfinite(x).flatten(1).all(dim=1)
    if not bool(finite.all()):
        raise ValueError(f"frame {int((~finite).nonzero()[0])}: contains NaN or inf values")
    x = torch.add(torch.mul(x.clamp(0.0, 1.0), 255.0), 0.5)
    return np.ascontiguousarray(x.to(torch.uint8).cpu().numpy())


def save_frames(frames, path) -> None:
    """Raw frames as uint8 (T, H, W, 3), converted exactly as the video encoder's input is
    (:func:`frame_to_rgb_uint8`), saved with ``np.save`` at ``path``; atomic (a temporary file beside it, renamed)."""
    path = Path(path)
    arr = np.stack([frame_to_rgb_uint8(f, i) for i, f in enumerate(frames)])
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def _pad_to_even(arr: np.ndarray) -> np.ndarray:
    """Pad the bottom/right edge by one replicated row/column where needed: yuv420p subsamples chroma 2x2,
    so x264 refuses odd sizes. Replicating the edge (rather than adding black, or rescaling the way
    imageio-ffmpeg's macro_block_size does) keeps every original pixel where it was."""
    h, w = arr.shape[:2]
    ph, pw = h % 2, w % 2
    if ph or pw:
        arr = np.ascontiguousarray(np.pad(arr, ((0, ph), (0, pw), (0, 0)), mode="edge"))
    return arr


def _iter_input_frames(frames) -> Iterator:
    if isinstance(frames, np.ndarray):
        if frames.ndim == 3:  # (T, H, W) grayscale stack
            frames = frames[..., None]
        if frames.ndim != 4:
            raise ValueError(f"expected a (T, H, W, C) array of frames, got shape {frames.shape}")
        return (frames[i] for i in range(frames.shape[0]))
    if isinstance(frames, Iterable):
        return iter(frames)
    raise TypeError(f"frames must be an array or an iterable of frames, got {type(frames).__name__}")


def temp_path_next_to(path: str, default_ext: str = ".mp4") -> str:
    """Create (empty) and return a hidden temporary file in the target's directory.

    Same directory so that the final ``os.replace`` is an atomic rename on one filesystem; the target's
    extension is kept at the end so ffmpeg picks the right container; the leading dot keeps it out of
    ``*.mp4`` globs (including :mod:`stitch_comparison`'s) if a killed process ever leaves one behind.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(path)
    ext = os.path.splitext(base)[1] or default_ext
    # Not tempfile.mkstemp: it creates mode 0600, and the renamed result would then be unreadable to
    # the other users of a shared results directory. os.open with 0666 lets the umask decide, as for
    # any ordinary file.
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(4)}.tmp{ext}")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"could not create a temporary file next to {path}")


def probe_result(tmp: str, target: str) -> VideoInfo:
    """Probe a just-encoded temporary file; a failure is reported against the target path the caller
    asked for, not the hidden temporary name."""
    try:
        return probe_video(tmp)
    except VideoError as exc:
        raise VideoError(target, f"the encoder produced an unusable file ({exc.reason})") from None


def remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def write_video(frames, path, fps: float = 16, *, crf: int = DEFAULT_CRF, preset: str = "medium",
                made_by: str = MADE_BY_RENDER) -> str:
    """Encode ``frames`` as H.264 (yuv420p) at ``path`` and return ``path`` (as a string).

    ``frames``: a (T, H, W, 3) array, float in [0, 1] or uint8, or an iterable of PIL images / arrays (all of
    one size). Frames are converted and sent to ffmpeg one at a time. Odd sizes are padded to even by edge
    replication (yuv420p needs even sizes), so such a video probes one pixel wider/taller.

    The file is written to a temporary name next to ``path`` and moved onto ``path`` only after ffmpeg
    finished and the frame count read back matches what was sent; on any failure the temporary file is
    removed and an existing file at ``path`` is left untouched. ``made_by`` goes into the container's comment
    tag (:func:`made_by`).
    """
    path = os.fspath(path)
    if not fps or fps <= 0:
        raise ValueError(f"fps must be positive, got {fps!r}")
    if imageio_ffmpeg is None:  # GPU images without it (its wheel is 68 MB): OpenCV's encoder, said out loud
        return _write_video_cv2(frames, path, fps)
    frame_iter = _iter_input_frames(frames)
    try:
        first = next(frame_iter)
    except StopIteration:
        raise ValueError(f"{path}: no frames to write") from None
    first = frame_to_rgb_uint8(first, 0)
    src_h, src_w = first.shape[:2]
    first = _pad_to_even(first)
    out_h, out_w = first.shape[:2]

    tmp = temp_path_next_to(path)
    writer = None
    try:
        writer = imageio_ffmpeg.write_frames(
            tmp,
            (out_w, out_h),
            pix_fmt_in="rgb24",
            pix_fmt_out="yuv420p",
            fps=Fraction(fps).limit_denominator(100000),
            quality=None,  # we pass -crf ourselves; quality would add a second, coarser -crf
            codec="libx264",
            macro_block_size=1,  # sizes are already even; never let imageio-ffmpeg rescale
            ffmpeg_log_level="error",
            output_params=["-crf", str(int(crf)), "-preset", preset, "-metadata", f"comment={made_by}"],
        )
        writer.send(None)  # start ffmpeg
        writer.send(first)
        n_sent = 1
        for i, frame in enumerate(frame_iter, start=1):
            arr = frame_to_rgb_uint8(frame, i)
            if arr.shape[:2] != (src_h, src_w):
                raise ValueError(f"frame {i}: size {arr.shape[1]}x{arr.shape[0]} differs from "
                                 f"the first frame's {src_w}x{src_h}")
            writer.send(_pad_to_even(arr))
            n_sent += 1
        writer.close()  # waits for ffmpeg to flush and exit
        writer = None
        info = probe_result(tmp, path)
        if info.n_frames != n_sent:
            raise VideoError(path, f"encoder wrote {info.n_frames} frames, {n_sent} were sent")
        os.replace(tmp, path)
    except BaseException:
        if writer is not None:
            writer.close()
        remove_quietly(tmp)
        raise
    return path


def _write_video_cv2(frames, path: str, fps: float) -> str:
    """OpenCV's MPEG-4 (mp4v) writer, for machines without imageio-ffmpeg; same temp-then-rename rule."""
    import sys

    import cv2

    tmp = temp_path_next_to(path)
    writer = None
    try:
        n = 0
        for i, frame in enumerate(_iter_input_frames(frames)):
            arr = frame_to_rgb_uint8(frame, i)
            if writer is None:
                h, w = arr.shape[:2]
                writer = cv2.VideoWriter(tmp, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (w, h))
                if not writer.isOpened():
                    raise VideoError(path, "OpenCV could not open an mp4v writer")
            writer.write(np.ascontiguousarray(arr[..., ::-1]))
            n += 1
        if writer is None:
            raise ValueError(f"{path}: no frames to write")
        writer.release()
        writer = None
        os.replace(tmp, path)
    except BaseException:
        if writer is not None:
            writer.release()
        remove_quietly(tmp)
        raise
    print(f"note: imageio-ffmpeg is not installed: wrote {path} with OpenCV (mp4v, not H.264)", file=sys.stderr)
    return path


# --------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------

_FRAME_RE = re.compile(rb"frame=\s*(\d+)")


def _count_frames(path: str) -> int:
    """Number of video frames, counted by remuxing the first video stream to the null muxer.

    ``-c copy`` counts packets without decoding (about 30 ms for an 81-frame 832x480 clip against about
    100 ms decoding); for the H.264/MP4 files this project writes, one packet is one frame. Returns 0 when
    ffmpeg reports no frame at all.
    """
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", path,
           "-map", "0:v:0", "-c", "copy", "-f", "null", "-"]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise VideoError(path, _ffmpeg_reason(proc.stderr))
    counts = _FRAME_RE.findall(proc.stderr)
    return int(counts[-1]) if counts else 0


def _ffmpeg_reason(blob) -> str:
    """A one-line reason from ffmpeg's stderr: the specific messages of its components (``[in#0 @ ...] moov
    atom not found``) and its final verdict, without the banner or the generic "Error opening ..." lead-ins,
    so that a user sees "moov atom not found; Invalid data found when processing input" for a truncated file."""
    if isinstance(blob, bytes):
        blob = blob.decode(errors="replace")
    lines = [ln.strip() for ln in str(blob).splitlines() if ln.strip()]
    if any("does not contain any stream" in ln or "matches no streams" in ln for ln in lines):
        return "no video stream"
    if not lines:
        return "ffmpeg failed without a message"
    details = [re.sub(r"^\[[^\]]*\]\s*", "", ln) for ln in lines if ln.startswith("[")][-2:]
    picks: list[str] = []
    for msg in details + [lines[-1]]:
        msg = re.sub(r"^Error opening input( files?)?:\s*", "", msg)
        if msg and msg not in picks:
            picks.append(msg)
    return "ffmpeg cannot read it: " + "; ".join(picks)


def _read_meta(path: str) -> dict:
    """ffmpeg's header information (size, fps, ...) as parsed by imageio-ffmpeg, without decoding frames."""
    gen = imageio_ffmpeg.read_frames(path)
    try:
        return next(gen)
    except (OSError, RuntimeError, StopIteration) as exc:
        raise VideoError(path, _ffmpeg_reason(str(exc))) from None
    finally:
        gen.close()


def _comment(path):
    path = os.fspath(path)
    if imageio_ffmpeg is None or not os.path.isfile(path):
        return None
    proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", path], capture_output=True,
                          timeout=60)
    return _MADE_BY_RE.search(proc.stderr.decode(errors="replace"))


def made_by(path) -> str | None:
    """The vdbench tag of a video this project wrote (:data:`MADE_BY_RENDER`, :data:`MADE_BY_GRID`), read from the
    container's comment by ffmpeg without decoding a frame; None for any other file (or one ffmpeg can't open)."""
    m = _comment(path)
    return m["tag"] if m else None


def written_by_render(path, timing_path=None) -> bool:
    """Whether the file at ``path`` is a video a render wrote (its container tag, or an entry of the timing.json at
    ``timing_path`` that names it: videos written before the tag existed, or by the OpenCV fallback), so that a
    render may replace it."""
    from .timing import load_timing

    if made_by(path) == MADE_BY_RENDER:
        return True
    if timing_path is not None and Path(timing_path).is_file():
        try:
            return any(e.get("output") == str(path) for e in load_timing(timing_path) if isinstance(e, dict))
        except (ValueError, OSError):
            return False
    return False


def run_of(path) -> str | None:
    """The run id a render wrote into its video's comment (:func:`render_comment`); None for a video written
    without one, any other file, or one ffmpeg can't open."""
    m = _comment(path)
    return m["run"] if m else None


def probe_video(path) -> VideoInfo:
    """Size, frame rate and exact frame count of a video; :class:`VideoError` naming the file if it is
    missing, unreadable or has no video frames."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise VideoError(path, "no such file")
    if os.path.getsize(path) == 0:
        raise VideoError(path, "empty file (0 bytes)")
    meta = _read_meta(path)
    size, fps = meta.get("size"), meta.get("fps")
    if not size or not fps or fps <= 0:
        raise VideoError(path, "no video stream with a size and frame rate")
    n_frames = _count_frames(path)
    if n_frames <= 0:
        raise VideoError(path, "contains no video frames")
    width, height = int(size[0]), int(size[1])
    return VideoInfo(path=path, width=width, height=height, fps=float(fps),
                     n_frames=n_frames, duration=n_frames / float(fps))


def iter_frames(path) -> Iterator[np.ndarray]:
    """Yield the frames of a video one at a time as writable (H, W, 3) uint8 arrays, decoding as it goes
    (never the whole video in memory). Raises :class:`VideoError` naming the file if it cannot be read or
    yields no frame. Closing the generator early stops the ffmpeg process."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise VideoError(path, "no such file")
    if imageio_ffmpeg is None:  # as the writer: OpenCV's decoder where ffmpeg's wheel is not installed
        yield from _iter_frames_cv2(path)
        return
    gen = imageio_ffmpeg.read_frames(path, pix_fmt="rgb24")
    try:
        try:
            meta = next(gen)
        except (OSError, RuntimeError, StopIteration) as exc:
            raise VideoError(path, _ffmpeg_reason(str(exc))) from None
        width, height = meta["size"]
        n = 0
        for buf in gen:
            yield np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3).copy()
            n += 1
        if n == 0:
            raise VideoError(path, "contains no video frames")
    finally:
        gen.close()


def _iter_frames_cv2(path: str) -> Iterator[np.ndarray]:
    """:func:`iter_frames` through OpenCV (BGR turned to RGB), for machines without imageio-ffmpeg."""
    try:
        import cv2
    except ImportError:
        raise VideoError(path, "no video decoder: pip install imageio-ffmpeg (or opencv-python-headless)") from None
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        cap.release()
        raise VideoError(path, "OpenCV cannot open it")
    n = 0
    try:
        while True:
            ok, bgr = cap.read()
            if not ok:
                break
            yield np.ascontiguousarray(bgr[..., ::-1])
            n += 1
    finally:
        cap.release()
    if n == 0:
        raise VideoError(path, "contains no video frames")


# --------------------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------------------

def identity_from_filename(path):
    """The :class:`vdbench.measure.record.Identity` a benchmark video's file name tells, parsed by the family that
    wrote it (:meth:`vdbench.families.Family.parse_name`, each registered family asked in turn), with ``source``
    ``"file name"``: ``wan_result_t2v_1.3B_81f_30s_attn_sdpa_cudnn_480x832.mp4`` -> ``sdpa_cudnn``, a parallel
    render's ``..._480x832_u2.mp4`` -> ``sdpa_cudnn`` on layout ``u2``; any other name -> its stem. The fallback
    for a video no record names: the readers take a render's identity from its record."""
    from .measure.record import Identity, identity_tags, split_identity_tags

    stem = Path(os.fspath(path)).stem
    _, seed, settings_id = split_identity_tags(stem)
    for name in families.names():
        parsed = families.get(name).parse_name(stem)
        if parsed is not None:
            return Identity(attention=parsed[0], layout=parsed[1], source="file name",
                            tag=" ".join(identity_tags(seed, settings_id)), **families.stem_stack(stem))
    return Identity(attention=stem, source="file name")


def label_from_filename(path) -> str:
    """The label of :func:`identity_from_filename` (``sdpa_cudnn``, ``cogvideox-2b_fav3_fp8.mp4`` -> ``fav3_fp8``,
    ``..._480x832_u2.mp4`` -> ``sdpa_cudnn+u2``; any other name -> its stem)."""
    return identity_from_filename(path).label
