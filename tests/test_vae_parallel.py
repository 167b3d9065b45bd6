"""vdbench.vae.parallel: the band-parallel VAE decode (Wan 2.1/2.2, CogVideoX) under torchrun (gloo, CPU) equals
the single-process decode, as its benchmark (bench/bench_vae_parallel.py) measures it.

One torchrun of 3 processes (one launch, because starting torch + diffusers is most of the cost) checks:
3 ranks over 7 latent rows (uneven bands 3/2/2, a middle rank with two neighbours), a sub-group of 2 ranks
(bands 4/3, the ``group=`` argument and its rank mapping), Wan 2.1 (z_dim 16; one latent frame per decoder
call, i.e. diffusers' own loop, and all frames per call), Wan 2.2 (z_dim 48, residual up-blocks, patchify 2; all
frames per call), each also against the untouched ``vae.decode``, and CogVideoX (GroupNorm statistics
all-reduced; diffusers' own decode loop). The no-halo ablation shows the comparison would catch a missing halo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vdbench.vae.parallel import band_sizes, decode_video_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT_DB = 100.0  # fp32: the same arithmetic up to the conv kernels' summation order (observed ~140 dB)


def test_band_sizes_even_uneven_and_too_thin():
    assert band_sizes(60, 2) == [30, 30]
    assert band_sizes(7, 3) == [3, 2, 2]
    assert sum(band_sizes(44, 3)) == 44
    with pytest.raises(ValueError, match="at least 1 row"):
        band_sizes(2, 3)


def test_refuses_other_vaes_bad_arguments_and_missing_process_group():
    # The checks look at the class name before touching anything else; stand-ins keep this test light.
    class AutoencoderKLHunyuanVideo:  # noqa: N801
        use_tiling = False

    class AutoencoderKLCogVideoX:  # noqa: N801
        use_tiling = False

    class AutoencoderKLWan:  # noqa: N801
        use_tiling = False

    z = torch.zeros(1, 16, 2, 4, 4)
    with pytest.raises(NotImplementedError, match="AutoencoderKLHunyuanVideo"):
        decode_video_parallel(AutoencoderKLHunyuanVideo(), z)
    with pytest.raises(ValueError, match=r"chunk_frames applies to the VAEs decoded a few latent frames per call "
                                         r"\(wan\); cogvideox's"):
        decode_video_parallel(AutoencoderKLCogVideoX(), z, chunk_frames=2)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="process group"):
            decode_video_parallel(AutoencoderKLWan(), z)


def _db(q: dict) -> float:
    return float("inf") if q["identical"] else q["psnr_db"]


@pytest.mark.minutes
def test_torchrun_parallel_decode_matches_single_process(tmp_path, checkout_env):
    out = tmp_path / "vae_parallel.json"
    env = dict(checkout_env, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           os.path.join(ROOT, "bench", "bench_vae_parallel.py"), "--case", "tiny-wan2.1",
           "--case", "tiny-wan2.2:3x7x6:fp32:0", "--case", "tiny-cogvideox:5x7x6", "--latent", "3x7x6",
           "--dtype", "fp32", "--chunk_frames", "1", "--chunk_frames", "0", "--stock", "--ablation",
           "--subgroup", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["meta"]["backend"] == "gloo" and res["meta"]["world"] == 3
    assert [e["case"] for e in res["results"]] == ["tiny-wan2.1", "tiny-wan2.2", "tiny-cogvideox"]
    for e in res["results"]:
        cog = e["case"] == "tiny-cogvideox"
        # Wan 2.1 / CogVideoX: 8x spatial; Wan 2.2: 16x (8x decoder + patchify 2). 4x temporal: 3 latent frames
        # -> 9 frames, 5 (CogVideoX: two frame batches, 3 + 2, so its conv caches are used) -> 17.
        scale = 16 if e["case"] == "tiny-wan2.2" else 8
        frames = 17 if cog else 9
        # CogVideoX: one run of diffusers' own decode loop (the reference *is* the stock vae.decode).
        assert [r["chunk_frames"] for r in e["runs"]] == {"tiny-wan2.1": [1, 2], "tiny-wan2.2": [2],
                                                          "tiny-cogvideox": [None]}[e["case"]]
        for r in e["runs"]:
            where = f"{e['case']} K={r['chunk_frames']}"
            assert r["shape"] == [1, 3, frames, 7 * scale, 6 * scale], where
            assert _db(r["vs_single"]) >= EXACT_DB, (where, r["vs_single"])
            if not cog:
                assert _db(r["vs_stock"]) >= EXACT_DB, (where, r["vs_stock"])
            info = r["info"]  # rank 0's
            assert info["band_sizes"] == [3, 2, 2] and info["band_rows"] == [0, 3], where
            assert info["halo_exchanges"] > 0 and info["hooked_layers"] > 0, where
            assert r["hooks_left"] == 0, where  # the VAE is left as diffusers built it
            assert r["n"] == 1 and r["speed_figure"] is False and "CPU timing" in r["why_not_speed"], where
            if cog:
                assert info["reductions"] > 0, where  # GroupNorm statistics
            else:
                assert info["gathers"] >= 2, where  # mid-block attention k/v, and the output bands
            sub = r["subgroup"]
            assert _db(sub) >= EXACT_DB, (where, sub)
            assert sub["info"]["world"] == 2 and sub["info"]["band_sizes"] == [4, 3], where
        # Without the halo exchange the bands' edges are wrong: the comparison must see it.
        ablation = e["runs"][0]["ablation_no_halo_vs_single"]
        assert ablation["psnr_db"] is not None and ablation["psnr_db"] < 40, ablation


def test_harness_reference_decodes_record_no_autograd_graph():
    """Regression (CogVideoX harness at 3x20x30 on CPU: 19 GB RSS instead of ~4): the single-device reference
    ``vae.decode`` ran with grad enabled on a VAE whose parameters required grad, so every activation stayed
    alive with its output. Now the harness's VAE requires no grad and every timed call runs in inference mode."""
    from diffusers import AutoencoderKLCogVideoX

    from vdbench.vae_bench.parallel import timed
    from vdbench.families.cogvideox import COG_VAE
    from vdbench.pipelines import build_vae

    vae = build_vae("cogvideox", device=torch.device("cpu"), dtype=torch.float32, seed=0, tiny=True)
    assert not any(p.requires_grad for p in vae.parameters())
    torch.manual_seed(0)
    grad_vae = AutoencoderKLCogVideoX(**COG_VAE).eval()  # as diffusers builds it: parameters require grad
    assert all(p.requires_grad for p in grad_vae.parameters())
    z = torch.randn(1, 16, 2, 4, 6)
    modes = []

    def ref():
        modes.append(torch.is_inference_mode_enabled())
        return grad_vae.decode(z, return_dict=False)[0]

    out, t, times = timed(ref, torch.device("cpu"), warmup=1, repeats=2, barrier=False)
    assert modes == [True, True, True] and len(times) == 2 and t > 0
    assert out.grad_fn is None and not out.requires_grad and torch.is_inference(out)


def test_default_counts_give_five_timed_decodes_on_a_gpu():
    from vdbench.vae_bench.parallel import default_counts

    assert default_counts(True, None, None) == (1, 5)  # a median with a spread on a GPU
    assert default_counts(False, None, None) == (0, 1)  # the CPU run checks exactness, its times are no figures
    assert default_counts(True, 0, 2) == (0, 2)  # given: kept


def test_case_names_take_the_tiny_spelling_of_every_tool():
    from vdbench.vae_bench.parallel import parse_case

    assert parse_case("tiny", "3x7x6", "fp32", [1, 0]) == ("tiny-wan2.1", (3, 7, 6), "fp32", [1, 0])
    assert parse_case("tiny:cogvideox:5x7x6", "3x7x6", "fp32", [1]) == ("tiny-cogvideox", (5, 7, 6), "fp32", [1])
    assert parse_case("tiny:2x5x4:bf16", "3x7x6", "fp32", [1]) == ("tiny-wan2.1", (2, 5, 4), "bf16", [1])
    assert parse_case("tiny-wan2.2", "3x7x6", "fp32", [1])[0] == "tiny-wan2.2"  # the older spelling, still read
