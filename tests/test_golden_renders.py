"""Tiny renders are bit-identical to the frames main produced before the redesign (issue 17).

The hashes below are SHA-256 of the raw uint8 frames (``--save_frames``: (T, H, W, 3), C order) rendered by commit
691f123 on this project's CPU machine (torch 2.13.0 CPU build, 2 threads). Each case runs the render CLI exactly as a
user types it, so the whole path -- flag parsing, model loading, the attention patch, the denoising loop, the VAE
decode, the frame conversion -- must keep producing the same bytes. Same seed, same weights, same arithmetic: any
change here is a change of behaviour, not noise (the renders were checked deterministic: two runs, same bytes).
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--height", "64", "--width", "96", "--num_inference_steps", "2", "--num_frames", "9", "--save_frames"]

# name -> (script, extra args, output directory flag, frames file relative to the output directory, sha256)
CASES = {
    "wan_t2v_sdpa": ("run_wan.py", ["--model", "tiny", "--attention_type", "sdpa"], "--benchmark_output_directory",
                     "results/wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96.npy",
                     "f678e82ca1630d76a858fbd61e36f609c2538f4a2c936e73cfe8a575b95a7263"),
    "wan_t2v_sagev1_emu": ("run_wan.py", ["--model", "tiny", "--attention_type", "sagev1_emu"],
                           "--benchmark_output_directory",
                           "results/wan_result_t2v_tiny_9f_2s_attn_sagev1_emu_64x96.npy",
                           "89ef5baa60808e5755114565b589c4e1f2ae9faddb7b11b77e9e3943f8e6e5e0"),
    "wan_t2v_default_fast_vae": ("run_wan.py", ["--model", "tiny", "--attention_type", "default", "--vae_decode",
                                                "fast"], "--benchmark_output_directory",
                                 "results/wan_result_t2v_tiny_9f_2s_attn_default_64x96.npy",
                                 "6686b86c53bdbd53bd83376be36d1dcb0247c5a31e25c02832f6f4dee79a2a31"),
    "wan_i2v_reference": ("run_wan.py", ["--model", "tiny", "--task", "i2v", "--img_file_path", "{image}",
                                         "--force_output_size", "--attention_type", "reference"],
                          "--benchmark_output_directory",
                          "results/wan_result_i2v_tiny_9f_2s_attn_reference_64x96.npy",
                          "cdd95912eb2c5502870b4393f57cf21a93b96a34da967e2dbf7c502575554697"),
    "wan22_a14b_sdpa": ("run_wan.py", ["--model", "tiny:wan2.2-t2v-a14b", "--attention_type", "sdpa"],
                        "--benchmark_output_directory",
                        "results/wan_result_t2v_tiny-wan2.2-t2v-a14b_9f_2s_attn_sdpa_64x96.npy",
                        "a66a51e3525b7517e54c92596877908b9f3e01abf783a80b70b4aadb8563dca7"),
    "cogvideox_fp8_emu": ("sageattn_cogvideo.py", ["--model_path", "tiny", "--attention_type", "fp8_emu"],
                          "--output_dir", "cogvideox-tiny_fp8_emu.npy",
                          "4bbc1723962bba1031d17bf1f23316dcef49d964899b0ae1a502bb987f4ac83b"),
}


def _image(path: Path) -> Path:
    arr = (np.arange(64 * 96 * 3) % 251).astype("uint8").reshape(64, 96, 3)
    Image.fromarray(arr).save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_render_frames_unchanged(case, tmp_path):
    script, extra, out_flag, rel, want = CASES[case]
    image = _image(tmp_path / "img.png")
    extra = [a.replace("{image}", str(image)) for a in extra]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / script), *SMALL, *extra, out_flag, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frames = np.load(out / rel)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8
    got = hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()
    assert got == want, f"{case}: the frames changed (sha256 {got}, expected {want})"
