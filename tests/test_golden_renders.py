"""Tiny renders are bit-identical to the frames of a reference commit (691f123, main before the redesign).

Bit-identical frames depend on the arithmetic of the machine as well as on the code: torch picks its CPU kernels
per machine (AVX512, AVX2 or none; oneDNN / MKL likewise), the same render differs by a level or a few of 255
between them, and even the tiny models' random weights come out slightly different where torch samples them with
other kernels. The tiny models are so weakly coupled that swapping the attention backend for an int8 one moves
their frames by no more than that, so no tolerance tells a changed behaviour from a changed CPU, and no test here
bounds a difference between two renders by what the CPU's arithmetic happens to give.

Each case therefore runs the render CLI exactly as a user types it -- flag parsing, model loading, the attention
patch, the denoising loop, the VAE decode, the frame conversion -- and compares the SHA-256 of the raw uint8 frames
(``--save_frames``: (T, H, W, 3), C order) with the hashes recorded on the machines listed below; on any other
machine it renders the same case with the reference commit's code (``git archive`` of this clone, same
interpreter, same machine, same environment) and requires the same bytes. Same seed, same weights, same
arithmetic: a difference is a change of behaviour, not noise (the renders were checked deterministic: two runs,
same bytes). Both trees build their tiny models into one temporary cache, here and in this run (a persistent cache
may hold weights that another CPU built, from a shared home directory or a run under ``ATEN_CPU_CAPABILITY``, and
the two trees would then differ for a reason that is not the code); each tree's render of a case is made once per
module.

That fallback is what a machine never seen runs, so it is exercised on every run, recorded machine or not: one
test per case takes the case's recorded hashes away and requires it to pass through the reference render (the same
code, the same bytes; the reference render's frames are found however the reference code names its file, while
the code under test must write the name the case expects), another renders a case with the reference code changed
by one line -- the frame conversion
truncates instead of rounding, which moves each frame value by 0 or 1 level by construction, whatever the CPU --
and requires the check to fail on a difference of exactly one level.

Recorded with torch 2.13.0 (CPU build), 2 threads: the machine the cases were first recorded on (first hash of each
case) and an AMD EPYC with AVX512 (second), where 691f123 and the redesigned code were checked to give the same
bytes.
"""

import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests import launch

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--height", "64", "--width", "96", "--num_inference_steps", "2", "--num_frames", "9", "--save_frames"]

# name -> (script, extra args, output directory flag, frames file relative to the output directory, sha256)
CASES = {
    "wan_t2v_sdpa": ("run_wan.py", ["--model", "tiny", "--attention_type", "sdpa"], "--benchmark_output_directory",
                     "results/wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96.npy",
                     ("f678e82ca1630d76a858fbd61e36f609c2538f4a2c936e73cfe8a575b95a7263",
                 "baacfa57be75df705f82a70d6ff675edf494b2ae1f10495942575ec356a54a04")),
    "wan_t2v_sagev1_emu": ("run_wan.py", ["--model", "tiny", "--attention_type", "sagev1_emu"],
                           "--benchmark_output_directory",
                           "results/wan_result_t2v_tiny_9f_2s_attn_sagev1_emu_64x96.npy",
                           ("89ef5baa60808e5755114565b589c4e1f2ae9faddb7b11b77e9e3943f8e6e5e0",
                 "f97a2b4c2b9a7aa701eb6726b44ab86fec9e9d880f5304d7008e66f4e7519623")),
    "wan_t2v_default_fast_vae": ("run_wan.py", ["--model", "tiny", "--attention_type", "default", "--vae_decode",
                                                "fast"], "--benchmark_output_directory",
                                 "results/wan_result_t2v_tiny_9f_2s_attn_default_64x96_vae=fast.npy",
                                 ("6686b86c53bdbd53bd83376be36d1dcb0247c5a31e25c02832f6f4dee79a2a31",
                 "d23756662dce90ee372ec83246a94d08bd435e5a6d80c65132cd251465b3d399")),
    "wan_i2v_reference": ("run_wan.py", ["--model", "tiny", "--task", "i2v", "--img_file_path", "{image}",
                                         "--force_output_size", "--attention_type", "reference"],
                          "--benchmark_output_directory",
                          # the conditioning image is part of the render's identity (its pixels): the name's id
                          "results/wan_result_i2v_tiny_9f_2s_attn_reference_64x96_id-11c0b076.npy",
                          ("cdd95912eb2c5502870b4393f57cf21a93b96a34da967e2dbf7c502575554697",
                 "db148064182e86a325e4d16cb437fc6a26b1b4c785091bc3e5945aea293c99d8")),
    # the flow shift the reference commit resolved for it (its size rule); the model's own (12.0) is the default now
    "wan22_a14b_sdpa": ("run_wan.py", ["--model", "tiny:wan2.2-t2v-a14b", "--attention_type", "sdpa",
                                       "--flow_shift", "3"],
                        "--benchmark_output_directory",
                        "results/wan_result_t2v_tiny-wan2.2-t2v-a14b_9f_2s_attn_sdpa_64x96_id-bbba1dfd.npy",
                        ("a66a51e3525b7517e54c92596877908b9f3e01abf783a80b70b4aadb8563dca7",
                 "1e9c4477c1b41bfe4602bf0d14f669f10a12f8559dba37238a571c7eec04c510")),
    "cogvideox_fp8_emu": ("sageattn_cogvideo.py", ["--model_path", "tiny", "--attention_type", "fp8_emu"],
                          # CogVideoX's names carry the model and backend; this size, frame and step count (the
                          # tiny model's are 128x192, 17, 4) go into the name's identity id
                          "--output_dir", "cogvideox-tiny_fp8_emu_id-3a7e2335.npy",
                          ("4bbc1723962bba1031d17bf1f23316dcef49d964899b0ae1a502bb987f4ac83b",
                 "03f2c74bcef129858190e54d9441120abeb0e75b72edf27e4cf6e2c54dc7d805")),
}


def _image(path: Path) -> Path:
    arr = (np.arange(64 * 96 * 3) % 251).astype("uint8").reshape(64, 96, 3)
    Image.fromarray(arr).save(path)
    return path


REFERENCE_COMMIT = "691f123"

# The case the fallback tests run, and the line they change in the reference commit's frame conversion
# (vdbench/video.py: floats in [0, 1] to uint8, rounded to nearest) to truncate instead: each value moves by 0 or 1.
FALLBACK_CASE = "wan_t2v_sdpa"
ROUNDED, TRUNCATED = "* 255.0 + 0.5).astype(np.uint8)", "* 255.0).astype(np.uint8)"


@pytest.fixture(scope="module")
def reference_tree(tmp_path_factory):
    """The reference commit's tree (``git archive`` of this clone), made once, on first need."""
    made: dict = {}

    def get() -> Path:
        if "root" not in made:
            dest = tmp_path_factory.mktemp("golden_reference")
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", REFERENCE_COMMIT], capture_output=True)
            if archive.returncode:
                pytest.fail(f"the golden check needs the reference commit {REFERENCE_COMMIT} to render its frames "
                            f"here, and it is not in this clone (a shallow clone?): {archive.stderr.decode()[-300:]}")
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
            made["root"] = dest
        return made["root"]

    return get


@pytest.fixture(scope="module")
def render(tmp_path_factory, vdbench_cache):
    """``render(root, case)``: the frames of ``case`` rendered by the code of the tree at ``root``, made once per
    module (a render is deterministic: a second one would give the same bytes), with the session's tiny models.
    The code under test (``ROOT``) must write them where the case says (its file name is part of the behaviour);
    another tree -- the reference commit's -- is found by the one frames file it wrote, however it names it."""
    made: dict = {}

    def get(root: Path, case: str) -> np.ndarray:
        if (root, case) not in made:
            made[root, case] = _render(root, case, tmp_path_factory.mktemp(case), vdbench_cache)
        return _frames(made[root, case], CASES[case][3] if root == ROOT else None)

    return get


def _render(root: Path, case: str, tmp: Path, cache: Path) -> Path:
    """Render ``case`` with the code of the tree at ``root``; returns its output directory."""
    script, extra, out_flag, rel, _ = CASES[case]
    image = _image(tmp / "img.png")
    extra = [a.replace("{image}", str(image)) for a in extra]
    out = tmp / "out"
    # the tree's own vdbench, not the installed one; tiny models built here, in this run
    # forked from this process (tests/launch.py): the tree's vdbench imported afresh, torch and diffusers kept
    proc = launch.script(root / script, [*SMALL, *extra, out_flag, str(out)], tmp / "render.log", root=root,
                         PYTHONPATH=str(root), VDBENCH_CACHE=str(cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _frames(out: Path, rel) -> np.ndarray:
    """The frames a render wrote under ``out``: at ``rel`` (the name the case expects), or, with ``rel`` None, the
    one ``.npy`` it wrote, whatever its name."""
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.npy"))
    if rel is None:
        assert len(written) == 1, f"expected one frames file under {out}, found {written}"
        rel = written[0]
    assert (out / rel).is_file(), f"the render wrote {written}, not the case's {rel}"
    frames = np.load(out / rel)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8
    return frames


def _sha(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


def _check(case: str, frames: np.ndarray, reference_frames) -> None:
    """The golden check of ``frames``, a render of ``case``: a hash recorded for the case, or else byte for byte
    the reference commit's render of the case on this machine (``reference_frames()``, called only then)."""
    if _sha(frames) in CASES[case][4]:
        return  # the bytes recorded on a known machine
    ref = reference_frames()  # an unrecorded machine: the reference code, here
    diff = np.abs(frames.astype(np.int16) - ref).max()
    assert np.array_equal(frames, ref), (f"{case}: the frames differ from commit {REFERENCE_COMMIT}'s on this machine "
                                         f"(max |diff| {diff} levels; sha256 {_sha(frames)} vs {_sha(ref)})")


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_render_frames_unchanged(case, render, reference_tree):
    _check(case, render(ROOT, case), lambda: render(reference_tree(), case))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fallback_accepts_the_same_code(case, render, reference_tree, monkeypatch):
    """What a machine never seen runs, forced here for every case: with the case's recorded hashes taken away, the
    frames of the code under test pass only by being byte for byte the reference commit's render on this machine
    (found however the reference code names its output)."""
    script, extra, flag, rel, _ = CASES[case]
    monkeypatch.setitem(CASES, case, (script, extra, flag, rel, ()))
    _check(case, render(ROOT, case), lambda: render(reference_tree(), case))


@pytest.mark.slow
def test_a_wrong_expected_file_name_fails_the_check(render, monkeypatch):
    """The frames file of the code under test is the one the case names: a case expecting another name fails,
    saying what the render wrote (the name is part of what a user gets)."""
    render(ROOT, FALLBACK_CASE)  # made once for the module
    script, extra, flag, rel, hashes = CASES[FALLBACK_CASE]
    monkeypatch.setitem(CASES, FALLBACK_CASE, (script, extra, flag, rel.replace(".npy", "_vae=fast.npy"), hashes))
    with pytest.raises(AssertionError, match="the render wrote .*64x96.npy'], not the case's .*_vae=fast.npy"):
        render(ROOT, FALLBACK_CASE)


@pytest.mark.slow
def test_the_fallback_catches_a_change_of_one_level(render, reference_tree, tmp_path):
    """The reference commit's code with its frame conversion truncating instead of rounding to nearest -- a change
    of behaviour that moves frame values by 0 or 1 level by construction, whatever the CPU's arithmetic -- fails
    the check (no recorded hash is theirs, so it goes to the reference render), on exactly one level. The change
    lives in the tree's vdbench package, so this also shows that a tree's render runs its own code."""
    tree = tmp_path / "changed"
    shutil.copytree(reference_tree(), tree)
    video = tree / "vdbench" / "video.py"
    text = video.read_text()
    assert text.count(ROUNDED) == 1, "the reference commit's frame conversion is not where this test changes it"
    video.write_text(text.replace(ROUNDED, TRUNCATED))
    with pytest.raises(AssertionError, match=r"max \|diff\| 1 levels"):
        _check(FALLBACK_CASE, render(tree, FALLBACK_CASE), lambda: render(reference_tree(), FALLBACK_CASE))
