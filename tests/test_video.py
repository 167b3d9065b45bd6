"""vdbench.video: writing, probing and reading videos, file-name labels and the label font."""

from __future__ import annotations

import os
import stat
import types

import imageio_ffmpeg
import numpy as np
import pytest
from PIL import Image

import vdbench.video as vv
from vdbench.grid import find_font
from vdbench.video import (VideoError, VideoInfo, frame_to_rgb_uint8, iter_frames, label_from_filename, probe_video,
                           write_video)


def moving_frames(n=8, h=48, w=64, seed=0) -> np.ndarray:
    """(n, h, w, 3) float32 in [0, 1]: a gradient sliding right plus a bright square moving down, so every
    frame differs from the previous one and the content is not flat (a constant video would hide bugs)."""
    t = np.arange(n, dtype=np.float32)[:, None, None]
    y = np.arange(h, dtype=np.float32)[None, :, None]
    x = np.arange(w, dtype=np.float32)[None, None, :]
    r = ((x + 3 * t + 7 * seed) % w) / w
    g = y / h
    b = np.float32(0.25 + 0.1 * (seed % 5))
    frames = np.stack(np.broadcast_arrays(r, g, b), axis=-1).copy()
    for i in range(n):
        top = (2 * i) % max(1, h - 10)
        frames[i, top:top + 10, 5:15] = 1.0
    return frames


def only_files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def pix_fmt(path) -> str:
    gen = imageio_ffmpeg.read_frames(str(path))
    try:
        return next(gen)["pix_fmt"].split("(")[0]
    finally:
        gen.close()


# -- write / probe / read ----------------------------------------------------------------------------------


def test_write_probe_round_trip(tmp_path):
    frames = moving_frames(8, 48, 64)
    out = write_video(frames, tmp_path / "a.mp4", fps=8)
    assert out == str(tmp_path / "a.mp4")
    info = probe_video(out)
    assert isinstance(info, VideoInfo)
    assert (info.width, info.height, info.n_frames) == (64, 48, 8)
    assert info.fps == pytest.approx(8.0)
    assert info.duration == pytest.approx(1.0)
    assert only_files(tmp_path) == ["a.mp4"]  # no temporary file left behind
    assert pix_fmt(out) == "yuv420p"  # plays everywhere (browsers, QuickTime)

    decoded = list(iter_frames(out))
    assert len(decoded) == 8
    ref = (frames * 255 + 0.5).astype(np.uint8)
    for got, want in zip(decoded, ref):
        assert got.shape == (48, 64, 3) and got.dtype == np.uint8
        # crf 18: visually lossless, a few levels of error on average
        assert np.abs(got.astype(int) - want.astype(int)).mean() < 6


def test_write_accepts_uint8_pil_and_fractional_fps(tmp_path):
    frames = (moving_frames(5, 32, 48) * 255).astype(np.uint8)
    pil = [Image.fromarray(f) for f in frames]
    p1 = write_video(pil, tmp_path / "pil.mp4", fps=12.5)
    p2 = write_video(list(frames), tmp_path / "list.mp4", fps=12.5)
    for p in (p1, p2):
        info = probe_video(p)
        assert (info.width, info.height, info.n_frames) == (48, 32, 5)
        assert info.fps == pytest.approx(12.5)


def test_written_file_has_ordinary_permissions(tmp_path):
    # The temporary file must not carry mkstemp's 0600 mode into the final result.
    old = os.umask(0o022)
    try:
        out = write_video(moving_frames(2, 16, 16), tmp_path / "perm.mp4", fps=8)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o644


def test_odd_size_is_padded_to_even_by_edge_replication(tmp_path):
    frames = moving_frames(4, 31, 45)
    out = write_video(frames, tmp_path / "odd.mp4", fps=8)
    info = probe_video(out)
    assert (info.width, info.height, info.n_frames) == (46, 32, 4)
    first = next(iter_frames(out)).astype(int)
    ref = (frames[0] * 255).astype(int)
    assert np.abs(first[:31, :45] - ref).mean() < 6
    # the added column/row repeat the edge instead of being black
    assert np.abs(first[:31, 45] - ref[:, 44]).mean() < 12
    assert np.abs(first[31, :45] - ref[30, :]).mean() < 12


def test_frame_to_rgb_uint8_is_the_encoders_input():
    """The one conversion the encoder and the render's raw --save_frames share: floats in [0, 1] rounded half up
    after clipping, grey repeated to RGB, alpha dropped, NaN refused with the frame's index."""
    f = np.array([[[0.0, 0.5, 1.0], [-0.2, 1.3, 0.999]]], dtype=np.float32)  # (1, 2, 3)
    out = vv.frame_to_rgb_uint8(f, 0)
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    assert out.tolist() == [[[0, 128, 255], [0, 255, 255]]]
    grey = vv.frame_to_rgb_uint8(np.full((2, 2), 7, dtype=np.uint8), 0)
    assert grey.shape == (2, 2, 3) and (grey == 7).all()
    assert vv.frame_to_rgb_uint8(np.zeros((2, 2, 4), dtype=np.uint8), 0).shape == (2, 2, 3)
    with pytest.raises(ValueError, match="frame 3: contains NaN"):
        vv.frame_to_rgb_uint8(np.full((2, 2, 3), np.nan), 3)


def test_write_rejects_bad_input_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="no frames"):
        write_video([], tmp_path / "empty.mp4")
    bad = moving_frames(3, 16, 16)
    bad[1, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="frame 1: contains NaN"):
        write_video(bad, tmp_path / "nan.mp4")
    mixed = [moving_frames(1, 16, 16)[0], moving_frames(1, 16, 18)[0]]
    with pytest.raises(ValueError, match="frame 1: size"):
        write_video(mixed, tmp_path / "mixed.mp4")
    with pytest.raises(ValueError, match="fps"):
        write_video(moving_frames(2, 16, 16), tmp_path / "fps.mp4", fps=0)
    assert only_files(tmp_path) == []


def test_failure_while_feeding_frames_is_atomic(tmp_path):
    """A crash in the middle (here: the frame source raises) leaves no file at the target, no temporary
    file, and an earlier result at the target untouched."""
    target = tmp_path / "out.mp4"
    target.write_bytes(b"previous result")

    def frames():
        yield from moving_frames(3, 32, 32)
        raise RuntimeError("pipeline crashed at frame 3")

    with pytest.raises(RuntimeError, match="frame 3"):
        write_video(frames(), target, fps=8)
    assert target.read_bytes() == b"previous result"
    assert only_files(tmp_path) == ["out.mp4"]

    target.unlink()
    with pytest.raises(RuntimeError):
        write_video(frames(), target, fps=8)
    assert only_files(tmp_path) == []


def test_encoder_failure_is_atomic(tmp_path, monkeypatch):
    """The encoder itself dies mid-way (imageio-ffmpeg's writer raises on the third frame, as it does when
    ffmpeg's stdin pipe breaks): nothing at the target path, no temporary file."""
    real = imageio_ffmpeg.write_frames

    def failing_write_frames(path, *args, **kwargs):
        gen = real(path, *args, **kwargs)

        def wrapper():
            gen.send(None)
            try:
                for _ in range(3):
                    frame = yield
                    if frame is not None:
                        gen.send(frame)
                raise OSError("[Errno 32] Broken pipe (simulated ffmpeg crash)")
            finally:
                gen.close()

        return wrapper()

    monkeypatch.setattr(imageio_ffmpeg, "write_frames", failing_write_frames)
    with pytest.raises(OSError, match="Broken pipe"):
        write_video(moving_frames(8, 32, 32), tmp_path / "out.mp4", fps=8)
    assert only_files(tmp_path) == []


def test_short_encode_is_detected_before_rename(tmp_path, monkeypatch):
    """If the encoder exits 'successfully' but wrote fewer frames than sent, the result is not published."""
    monkeypatch.setattr(vv, "_count_frames", lambda path: 2)
    with pytest.raises(VideoError, match="encoder wrote 2 frames, 4 were sent"):
        write_video(moving_frames(4, 16, 16), tmp_path / "short.mp4", fps=8)
    assert only_files(tmp_path) == []


def test_probe_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.mp4"
    with pytest.raises(VideoError, match="missing.mp4: no such file"):
        probe_video(missing)

    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(VideoError, match="empty.mp4"):
        probe_video(empty)

    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"this is not a video" * 50)
    with pytest.raises(VideoError) as exc:
        probe_video(garbage)
    assert str(garbage) in str(exc.value) and "Invalid data" in str(exc.value)
    assert isinstance(exc.value, ValueError)

    # an mp4 container without any video stream
    no_stream = tmp_path / "zero.mp4"
    import subprocess

    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-f", "lavfi", "-i", "testsrc=size=32x32:rate=8",
                    "-frames:v", "0", "-c:v", "libx264", "-y", str(no_stream)], check=True)
    with pytest.raises(VideoError, match="zero.mp4: no video stream"):
        probe_video(no_stream)


def test_probe_zero_frames(tmp_path, monkeypatch):
    out = write_video(moving_frames(2, 16, 16), tmp_path / "v.mp4", fps=8)
    monkeypatch.setattr(vv, "_count_frames", lambda path: 0)
    with pytest.raises(VideoError, match="v.mp4: contains no video frames"):
        probe_video(out)


def test_iter_frames_streams(tmp_path):
    out = write_video(moving_frames(6, 24, 32), tmp_path / "s.mp4", fps=8)
    gen = iter_frames(out)
    assert isinstance(gen, types.GeneratorType)  # lazy: nothing decoded yet
    first = next(gen)
    assert first.shape == (24, 32, 3) and first.dtype == np.uint8
    first[0, 0] = 0  # frames are writable copies
    assert sum(1 for _ in gen) == 5
    gen.close()

    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"junk" * 100)
    with pytest.raises(VideoError, match="bad.mp4"):
        next(iter_frames(bad))


def test_video_error_pickles():
    import pickle

    err = pickle.loads(pickle.dumps(VideoError("/x/y.mp4", "no such file")))
    assert str(err) == "/x/y.mp4: no such file" and err.path == "/x/y.mp4"


# -- labels ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, label",
    [
        ("wan_result_t2v_1.3B_81f_30s_attn_sdpa_480x832.mp4", "sdpa"),
        ("wan_result_t2v_1.3B_81f_30s_attn_sdpa_cudnn_480x832.mp4", "sdpa_cudnn"),
        ("wan_result_i2v_14B-720p_81f_40s_attn_fav3_fp8_720x1280.mp4", "fav3_fp8"),
        ("/some/dir/wan_result_t2v_tiny_9f_2s_attn_sage_v2_int8_64x64.mp4", "sage_v2_int8"),
        # a model tag that itself contains "_attn_" does not leak into the type
        ("wan_result_t2v_my_attn_test_81f_30s_attn_flash_480x832.mp4", "flash"),
        ("cogvideox-2b_sagev1.mp4", "sagev1"),
        ("cogvideox-tiny_fp8_emu.mp4", "fp8_emu"),
        ("cogvideox-1.5-5b_sdpa_cudnn.mp4", "sdpa_cudnn"),
        ("cogvideox-5b-i2v_fav3.mp4", "fav3"),
        ("compare.mp4", "compare"),
        ("my_run_v2.mp4", "my_run_v2"),
        ("wan_result_broken.mp4", "wan_result_broken"),
    ],
)
def test_label_from_filename(name, label):
    assert label_from_filename(name) == label


def test_find_font_is_dejavu_from_matplotlib():
    import matplotlib
    from PIL import ImageFont

    font = find_font(30)
    assert isinstance(font, ImageFont.FreeTypeFont)
    assert font.size == 30
    assert os.path.basename(font.path) == "DejaVuSans.ttf"
    assert font.path.startswith(matplotlib.get_data_path())
    # a real scalable font: bigger size, wider text
    assert find_font(40).getlength("sdpa_cudnn") > find_font(20).getlength("sdpa_cudnn")


def test_find_font_missing_is_an_error(tmp_path, monkeypatch):
    import matplotlib

    monkeypatch.setattr(matplotlib, "get_data_path", lambda: str(tmp_path))
    find_font.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="DejaVuSans.ttf"):
            find_font(17)
    finally:
        find_font.cache_clear()


def test_without_imageio_ffmpeg_opencv_writes_and_reads_the_same_frames(tmp_path, monkeypatch):
    """The GPU images have no imageio-ffmpeg (its wheel is too big to carry): OpenCV writes and reads there, and
    what it reads back is the video the ffmpeg path reads (a sweep compares renders with the reference there)."""
    frames = moving_frames(6, 48, 64)
    by_ffmpeg = np.stack(list(iter_frames(write_video(frames, tmp_path / "ffmpeg.mp4", fps=8))))
    monkeypatch.setattr(vv, "imageio_ffmpeg", None)
    out = write_video(frames, tmp_path / "cv2.mp4", fps=8)
    gen = iter_frames(out)
    assert isinstance(gen, types.GeneratorType)
    by_cv2 = np.stack(list(gen))
    assert by_cv2.shape == by_ffmpeg.shape == (6, 48, 64, 3) and by_cv2.dtype == np.uint8
    truth = (frames * 255).round()
    # two lossy codecs of one input: each close to the frames written, and the colours not swapped (BGR/RGB)
    assert np.abs(by_cv2 - truth).mean() < 6 and np.abs(by_ffmpeg - truth).mean() < 6
    assert np.abs(by_cv2[..., 2].astype(float).mean() - truth[..., 2].mean()) < 6
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"junk" * 100)
    with pytest.raises(VideoError, match="bad.mp4"):
        next(iter_frames(bad))


def test_frames_converted_where_they_are_are_the_writers_bytes():
    """The decode's uint8 frames (vdbench.video.frames_to_rgb_uint8, run on the GPU in a render) equal what the
    writer makes of float frames one by one, at the rounding edges too; NaN refused with its frame's index."""
    import torch

    from vdbench.video import frames_to_rgb_uint8

    g = torch.Generator().manual_seed(0)
    x = torch.rand((3, 8, 10, 3), generator=g) * 1.2 - 0.1  # beyond [0, 1] on both sides: clipped
    edges = (torch.arange(256, dtype=torch.float32) + 0.5) / 255  # each level's rounding boundary
    x[0, 0, :, 0] = edges[:10]
    x[1, 0, :, 0] = torch.nextafter(edges[100:110], torch.tensor(0.0))
    for dtype in (torch.float32, torch.bfloat16):
        t = x.to(dtype)
        want = np.stack([frame_to_rgb_uint8(f, i) for i, f in enumerate(t.float().numpy())])
        got = frames_to_rgb_uint8(t)
        assert got.dtype == np.uint8 and got.flags["C_CONTIGUOUS"] and np.array_equal(got, want)
    bad = x.clone()
    bad[2, 3, 4, 1] = float("nan")
    with pytest.raises(ValueError, match="frame 2: contains NaN or inf"):
        frames_to_rgb_uint8(bad)
    with pytest.raises(ValueError, match="expected float frames"):
        frames_to_rgb_uint8(x[..., :2])
