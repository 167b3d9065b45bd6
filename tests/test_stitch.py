"""vdbench.grid.stitch_grid and the stitch_comparison.py command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # stitch_comparison.py is a top-level script, not part of the package
    sys.path.insert(0, str(REPO))

import stitch_comparison  # noqa: E402
from vdbench.grid import stitch_grid  # noqa: E402
from vdbench.video import VideoError, iter_frames, probe_video, write_video  # noqa: E402

WAN = "wan_result_t2v_1.3B_8f_2s_attn_{}_48x64.mp4"


def moving_frames(n=8, h=48, w=64, seed=0) -> np.ndarray:
    """(n, h, w, 3) float32 in [0, 1], mid-grey-ish and moving (a sliding gradient and a square), never
    flat, never white, so that a drawn label is visible against it."""
    t = np.arange(n, dtype=np.float32)[:, None, None]
    y = np.arange(h, dtype=np.float32)[None, :, None]
    x = np.arange(w, dtype=np.float32)[None, None, :]
    r = 0.2 + 0.5 * ((x + 3 * t + 7 * seed) % w) / w
    g = 0.2 + 0.5 * y / h
    b = np.float32(0.3 + 0.08 * (seed % 5))
    frames = np.stack(np.broadcast_arrays(r, g, b), axis=-1).copy()
    for i in range(n):
        top = (2 * i) % max(1, h - 10)
        frames[i, top:top + 10, 5:15] = 0.8
    return frames


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Four 64x48, 8-frame, 8 fps videos named like run_wan.py's outputs."""
    d = tmp_path_factory.mktemp("four")
    paths = [write_video(moving_frames(seed=k), d / WAN.format(name), fps=8)
             for k, name in enumerate(["sdpa", "sdpa_cudnn", "fav3_fp8", "sagev1"])]
    return d, sorted(paths)


def frames_of(path) -> np.ndarray:
    return np.stack(list(iter_frames(path))).astype(np.int16)


def files_in(directory) -> list[str]:
    return sorted(os.listdir(directory))


# -- stitch_grid -------------------------------------------------------------------------------------------


def test_stitch_four_into_2x2(four, tmp_path):
    _, paths = four
    out = stitch_grid(paths, tmp_path / "grid.mp4", font_size=12)
    assert out == str(tmp_path / "grid.mp4")
    info = probe_video(out)
    assert (info.width, info.height) == (128, 96)
    assert info.n_frames == 8 and info.fps == pytest.approx(8.0)
    assert files_in(tmp_path) == ["grid.mp4"]
    # moviepy asks libx264 for yuva420p, which it cannot do; ffmpeg must fall back to plain yuv420p
    meta = imageio_ffmpeg.read_frames(out)
    try:
        assert next(meta)["pix_fmt"].startswith("yuv420p")
    finally:
        meta.close()

    grid = frames_of(out)
    band = 24  # font 12: the label band (line height + padding) is about 21 rows
    for k, p in enumerate(paths):
        r, c = divmod(k, 2)
        cell = grid[:, r * 48:(r + 1) * 48, c * 64:(c + 1) * 64]
        src = frames_of(p)
        # below the band, the cell is the source video (up to re-encoding noise), in input order
        assert np.abs(cell[:, band:] - src[:, band:]).mean() < 4


def test_labels_are_drawn(four, tmp_path):
    _, paths = four
    labelled = frames_of(stitch_grid(paths, tmp_path / "l.mp4", labels=["A1", "B2", "C3", "D4"], font_size=14))
    plain = frames_of(stitch_grid(paths, tmp_path / "p.mp4", labels=["", "", "", ""], font_size=14))
    src = frames_of(paths[0])
    band_l, band_p, band_s = labelled[:, :12, :64], plain[:, :12, :64], src[:, :12]
    # without labels the top of the cell is the source; with labels it differs a lot ...
    assert np.abs(band_p - band_s).mean() < 4
    assert np.abs(band_l - band_s).mean() > 20
    # ... because of a darkened band with white text on it
    assert (band_l.max(axis=-1) > 200).sum() > 30  # text pixels (the source never exceeds ~0.8 * 255)
    right_of_text = labelled[:, 3:10, 40:64].mean()
    assert right_of_text < 0.6 * src[:, 3:10, 40:64].mean()  # band, no text: darker than the source
    # the rest of the cell is untouched
    assert np.abs(labelled[:, 24:48, :64] - src[:, 24:48]).mean() < 4


def test_long_label_is_fitted_into_the_cell(four, tmp_path):
    _, paths = four
    out = stitch_grid(paths, tmp_path / "long.mp4", font_size=40,
                      labels=["a_very_long_backend_name_that_cannot_fit", "b", "c", "d"])
    assert probe_video(out).width == 128


def test_mixed_sizes_lengths_and_fps(tmp_path):
    a = write_video(moving_frames(8, 48, 64, 1), tmp_path / "a.mp4", fps=8)      # 1.0 s
    b = write_video(moving_frames(12, 48, 32, 2), tmp_path / "b.mp4", fps=8)     # 1.5 s, narrow
    c = write_video(moving_frames(8, 48, 96, 3), tmp_path / "c.mp4", fps=16)     # 0.5 s, wide, faster
    out = stitch_grid([a, b, c], tmp_path / "out" / "grid.mp4", labels=["", "", ""])
    info = probe_video(out)
    # cell = the largest input (96x48); 3 videos -> 2x2 with one empty cell; fps of the first; 1.5 s
    assert (info.width, info.height) == (192, 96)
    assert info.fps == pytest.approx(8.0) and info.n_frames == 12
    grid = frames_of(out)
    # a (64x48) is pillarboxed in its 96x48 cell: 16 black columns each side
    assert grid[:, :48, :14].max() < 20 and grid[:, :48, 82:96].max() < 20
    assert grid[:, :48, 20:76].mean() > 40
    # b (32x48) is centred in the cell: black outside columns 32..64
    assert grid[:, :48, 96:96 + 30].max() < 20 and grid[:, :48, 96 + 66:].max() < 20
    # the empty fourth cell is black
    assert grid[:, 48:, 96:].max() < 20
    # a ends after 8 frames and holds its last frame, c (16 fps, 0.5 s) holds from output frame 4 on
    assert np.abs(grid[8:, :48, :96] - grid[7, :48, :96]).max() < 8
    assert np.abs(grid[4:, 48:, :96] - grid[4, 48:, :96]).max() < 8
    assert np.abs(grid[1, 48:, :96] - grid[3, 48:, :96]).mean() > 3  # ... but moves before that
    # and b keeps moving until the end
    assert np.abs(grid[11, :48, 96:] - grid[8, :48, 96:]).mean() > 3


def test_fps_override_and_cell_size(four, tmp_path):
    _, paths = four
    out = stitch_grid(paths[:2], tmp_path / "f.mp4", fps=16, cell_size=(32, 24))
    info = probe_video(out)
    assert (info.width, info.height) == (64, 24)  # two videos: 1 row x 2 cols
    assert info.fps == pytest.approx(16.0) and info.n_frames == 16


def test_layout_option(four, tmp_path):
    _, paths = four
    info = probe_video(stitch_grid(paths, tmp_path / "row.mp4", layout=(1, 4), font_size=10))
    assert (info.width, info.height) == (256, 48)
    info = probe_video(stitch_grid(paths[:3], tmp_path / "col.mp4", layout=(3, 1), font_size=10))
    assert (info.width, info.height) == (64, 144)
    with pytest.raises(ValueError, match="layout 1x3 has 3 cells, too few for 4 videos"):
        stitch_grid(paths, tmp_path / "small.mp4", layout=(1, 3))
    assert not (tmp_path / "small.mp4").exists()


def test_input_errors(four, tmp_path):
    _, paths = four
    with pytest.raises(ValueError, match="no input videos"):
        stitch_grid([], tmp_path / "x.mp4")
    with pytest.raises(ValueError, match="at least two") as exc:
        stitch_grid(paths[:1], tmp_path / "x.mp4")
    assert paths[0] in str(exc.value)
    with pytest.raises(ValueError, match="3 labels given for 4 videos"):
        stitch_grid(paths, tmp_path / "x.mp4", labels=["a", "b", "c"])
    with pytest.raises(ValueError, match="also one of the inputs"):
        stitch_grid(paths, paths[0])

    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"\x00" * 1000)
    with pytest.raises(VideoError) as exc:
        stitch_grid([paths[0], str(bad)], tmp_path / "x.mp4")
    assert str(bad) in str(exc.value)
    with pytest.raises(VideoError, match="gone.mp4: no such file"):
        stitch_grid([paths[0], tmp_path / "gone.mp4"], tmp_path / "x.mp4")
    assert files_in(tmp_path) == ["broken.mp4"]


def test_failing_stitch_leaves_nothing(four, tmp_path, monkeypatch):
    """The encoder fails after a few frames: no (partial) file at the output path, no temporary file, and a
    previous result at the output path is untouched."""
    from moviepy.video.io.ffmpeg_writer import FFMPEG_VideoWriter

    _, paths = four
    real = FFMPEG_VideoWriter.write_frame
    calls = {"n": 0}

    def flaky(self, img):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError("simulated encoder crash")
        return real(self, img)

    monkeypatch.setattr(FFMPEG_VideoWriter, "write_frame", flaky)
    out = tmp_path / "grid.mp4"
    with pytest.raises(OSError, match="simulated encoder crash"):
        stitch_grid(paths, out)
    assert files_in(tmp_path) == []

    out.write_bytes(b"previous grid")
    calls["n"] = 0
    with pytest.raises(OSError):
        stitch_grid(paths, out)
    assert out.read_bytes() == b"previous grid"
    assert files_in(tmp_path) == ["grid.mp4"]


# -- command line ------------------------------------------------------------------------------------------


def test_cli_stitches_and_prints(four, tmp_path, capsys):
    d, paths = four
    out = d / "compare.mp4"
    try:
        assert stitch_comparison.main(["--input_dir", str(d), "--output", str(out), "--font_size", "10"]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert printed[0] == str(out)
        assert [ln.split()[1] for ln in printed[1:]] == ["fav3_fp8", "sagev1", "sdpa", "sdpa_cudnn"]  # name order
        info = probe_video(out)
        assert (info.width, info.height, info.n_frames) == (128, 96, 8)

        # run again into the same directory: the previous grid is not taken as a fifth input
        assert stitch_comparison.main(["--input_dir", str(d), "--output", str(out), "--labels", "a,b,c,d",
                                       "--layout", "1x4", "--fps", "4"]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert len(printed) == 5 and [ln.split()[1] for ln in printed[1:]] == ["a", "b", "c", "d"]
        info = probe_video(out)
        assert (info.width, info.height, info.n_frames) == (256, 48, 4)
    finally:
        out.unlink(missing_ok=True)


def test_cli_pattern_selects_inputs(four, tmp_path, capsys):
    d, _ = four
    out = tmp_path / "sdpa.mp4"
    assert stitch_comparison.main(["--input_dir", str(d), "--output", str(out), "--pattern", "*_sdpa*.mp4"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [ln.split()[1] for ln in printed[1:]] == ["sdpa", "sdpa_cudnn"]


def test_cli_explicit_files_keep_their_order(four, tmp_path, capsys):
    """render_all_WAN.sh --stitch passes the rendered files in render order with one label each."""
    _, paths = four
    out = tmp_path / "grid.mp4"
    files = [paths[2], paths[0], paths[1]]
    assert stitch_comparison.main(["--output", str(out), "--labels", "x,y,z", *files]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(out)
    assert [ln.split()[1] for ln in printed[1:]] == ["x", "y", "z"]
    assert [ln.split()[-1] for ln in printed[1:]] == [os.path.basename(p) for p in files]
    assert probe_video(out).width == 128

    err = _cli_error(["--output", str(out), paths[0]], capsys)
    assert paths[0] in err and "at least two" in err
    err = _cli_error(["--output", str(out), paths[0], str(tmp_path / "missing.mp4")], capsys)
    assert "missing.mp4: no such file" in err
    with pytest.raises(SystemExit) as exc:
        stitch_comparison.main(["--output", str(out), "--input_dir", str(tmp_path), *files])
    assert exc.value.code == 2 and "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        stitch_comparison.main(["--output", str(out)])
    assert exc.value.code == 2 and "--input_dir" in capsys.readouterr().err


def _cli_error(argv, capsys) -> str:
    assert stitch_comparison.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_cli_errors(four, tmp_path, capsys):
    d, paths = four
    out = str(tmp_path / "o.mp4")
    err = _cli_error(["--input_dir", str(d), "--output", out, "--pattern", "*.mkv"], capsys)
    assert "no files match '*.mkv'" in err and str(d) in err

    err = _cli_error(["--input_dir", str(tmp_path / "nodir"), "--output", out], capsys)
    assert "nodir" in err and "does not exist" in err

    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(paths[0], one / "only.mp4")
    err = _cli_error(["--input_dir", str(one), "--output", out], capsys)
    assert "only.mp4" in err and "at least two" in err

    err = _cli_error(["--input_dir", str(d), "--output", out, "--labels", "a,b"], capsys)
    assert "2 labels for 4 videos" in err

    err = _cli_error(["--input_dir", str(d), "--output", out, "--layout", "1x2"], capsys)
    assert "layout 1x2" in err

    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(paths[0], broken / "a.mp4")
    (broken / "b.mp4").write_bytes(b"garbage" * 100)
    err = _cli_error(["--input_dir", str(broken), "--output", out], capsys)
    assert str(broken / "b.mp4") in err
    assert not os.path.exists(out)


def test_cli_bad_arguments_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        stitch_comparison.main(["--input_dir", str(tmp_path), "--output", "o.mp4", "--layout", "2by3"])
    assert exc.value.code == 2
    assert "ROWSxCOLS" in capsys.readouterr().err


def test_cli_as_a_script(tmp_path):
    """The real entry point: exit status 2 and one line on stderr naming the directory and pattern."""
    proc = subprocess.run([sys.executable, str(REPO / "stitch_comparison.py"), "--input_dir", str(tmp_path),
                           "--output", str(tmp_path / "o.mp4")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"stitch_comparison: error: no files match '*.mp4' in {tmp_path}"
    assert proc.stdout == ""


# -- what the stitcher takes, and what it never replaces ------------------------------------------------------


def test_cli_defaults_its_output_and_never_takes_its_own_grids_as_cells(four, tmp_path, capsys):
    """The original command (input dir and font size alone) writes <input_dir>/comparison_grid.mp4; re-running
    into the same directory leaves that grid -- and any grid this tool made, whatever its name -- out of the
    cells, and says so."""
    from vdbench.video import MADE_BY_GRID, MADE_BY_RENDER, made_by

    d = tmp_path / "res"
    shutil.copytree(four[0], d)
    assert stitch_comparison.main(["--input_dir", str(d), "--font_size", "48"]) == 0
    grid = d / "comparison_grid.mp4"
    assert made_by(grid) == MADE_BY_GRID and made_by(d / WAN.format("sdpa")) == MADE_BY_RENDER
    shutil.copy(grid, d / "zz_grid_of_yesterday.mp4")
    capsys.readouterr()
    assert stitch_comparison.main(["--input_dir", str(d), "--font-size", "48"]) == 0  # the grid is replaced
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == str(grid) and len(out.splitlines()) == 1 + 4  # the four renders, no grid
    assert "comparison_grid.mp4 left out (the output of this run)" in err
    assert "zz_grid_of_yesterday.mp4 left out (a comparison grid this tool made)" in err
    assert probe_video(grid).width == 128  # 2x2 cells of 64 px, not a grid inside a grid


def test_cli_matches_message_says_what_was_left_out(four, tmp_path, capsys):
    _, paths = four
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(paths[0], one / "a.mp4")
    shutil.copy(paths[1], one / "b.mp4")
    assert stitch_comparison.main(["--input_dir", str(one), "--output", str(one / "b.mp4"), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"stitch_comparison: error: only one video to stitch in {one}: a.mp4 matches '*.mp4'; b.mp4 left "
                   "out (the output of this run); need at least two to compare")


def test_cli_never_replaces_a_file_it_did_not_make(four, tmp_path, capsys):
    _, paths = four
    precious = tmp_path / "precious.mp4"
    precious.write_bytes(b"not a video of ours")
    assert stitch_comparison.main(["--output", str(precious), paths[0], paths[1]]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"stitch_comparison: error: {precious} exists and is not a grid this tool made; not replacing it",
                   "hint: choose another --output, or pass --overwrite to replace it"]
    assert precious.read_bytes() == b"not a video of ours"
    render = tmp_path / "render.mp4"  # a render of ours is no grid either: kept
    shutil.copy(paths[2], render)
    assert stitch_comparison.main(["--output", str(render), paths[0], paths[1]]) == 2
    assert frames_of(render).shape[2] == 64
    assert stitch_comparison.main(["--output", str(precious), "--overwrite", paths[0], paths[1]]) == 0
    assert probe_video(precious).width == 128
    # named files and no --output: the grid goes beside the first of them
    here = tmp_path / "here"
    here.mkdir()
    a, b = shutil.copy(paths[0], here / "a.mp4"), shutil.copy(paths[1], here / "b.mp4")
    assert stitch_comparison.main([str(a), str(b)]) == 0 and (here / "comparison_grid.mp4").is_file()


def test_labels_wrap_at_one_size_for_every_cell(tmp_path):
    """Labels carrying figures wrap onto up to three lines at one font size shared by the grid's cells, rather than
    being cut: every cell's band is as tall, and the text is all there."""
    from vdbench import grid
    from vdbench.grid import LABEL_MAX_LINES

    def fit_labels(labels, width, font_size):
        """(size, lines of each label): how a grid of cells ``width`` pixels wide draws ``labels``."""
        size = grid._label_size(labels, width, font_size)
        return size, [grid._LabelBand._fit(t, width, size)[1] if t else [] for t in labels]

    labels = ["sdpa · 705 ms/step 1.00× (n=3: not a speed figure) · 58.4 dB", "sagev1_emu · emulated · 37.7 dB"]
    size, lines = fit_labels(labels, 192, 24)
    assert 8 <= size < 24
    assert all(1 <= len(ls) <= LABEL_MAX_LINES for ls in lines)
    assert [" ".join(ls) for ls in lines] == labels  # nothing ellipsised
    assert fit_labels(["sdpa"], 192, 24) == (24, [["sdpa"]])


def test_cli_labels_cells_with_each_renders_record(tmp_path, capsys):
    """The default labels are the renders' identities as their records say them (records.jsonl beside the
    videos, matched by the video's path): a schedule keeps its '@' and ',', a parallel run its layout; a video no
    record names is labelled from its file name."""
    import json

    from vdbench.measure.record import Writer, from_render_entry

    sched, plain, loose = (tmp_path / "a.mp4", tmp_path / "b.mp4", tmp_path / WAN.format("sagev1"))
    for k, p in enumerate((sched, plain, loose)):
        write_video(moving_frames(seed=k), p, fps=8)
    entries = [{"attention_type": "fav3@steps:0-9,sta", "output": str(sched), "run_id": "s", "step_times": [1.0],
                "run": {"backend": {"name": "fav3@steps:0-9,sta"}},
                "parallel": {"tag": "u2", "label": "ulysses2", "engine": "xfuser", "world_size": 2}},
               {"attention_type": "sdpa", "output": str(plain), "run_id": "p", "step_times": [1.0],
                "run": {"backend": {"name": "sdpa"}}}]
    Writer(tmp_path / "records.jsonl").write(*(from_render_entry(e) for e in entries))
    (tmp_path / "timing.json").write_text(json.dumps(entries))
    out = tmp_path / "grid.mp4"
    assert stitch_comparison.main(["--output", str(out), "--font_size", "10", str(sched), str(plain),
                                   str(loose)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [ln.split("  <- ")[0].split("] ", 1)[1] for ln in printed[1:]] == [
        "fav3@steps:0-9,sta+u2", "sdpa", "sagev1"]
