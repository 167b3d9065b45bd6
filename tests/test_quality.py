"""vdbench.measure.quality: each metric against hand-computed values, the standard dicts of each kind of pair, and
the tools that report quality (bench_vae, bench_attention, bench_vae_parallel, gpu_kernels, compare_outputs, batch)
giving the shared module's numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vdbench.measure.quality import (attention_quality, cosine, frac_beyond_tol, frame_quality,
                                     max_abs, mean_abs, mean_psnr, nan_inf, psnr, psnr_from_mse, rel_l2, ssim,
                                     ssim_per_frame, stream_psnr, tensor_quality)


def test_tensor_metrics_hand_computed():
    ref = torch.tensor([3.0, 4.0])  # |ref| = 5
    x = torch.tensor([3.0, 5.0])  # x - ref = (0, 1)
    assert rel_l2(x, ref) == pytest.approx(1 / 5)
    assert cosine(x, ref) == pytest.approx((9 + 20) / (5 * math.sqrt(34)))
    assert max_abs(x, ref) == 1.0
    assert mean_abs(x, ref) == 0.5
    for f in (rel_l2, cosine, max_abs, mean_abs):
        assert isinstance(f(x, ref), float)


def test_tensor_metrics_accept_numpy_and_low_precision():
    ref = np.array([[1.0, -2.0], [2.0, 4.0]])  # |ref| = 5
    x = ref + np.array([[0.0, 0.0], [0.0, 3.0]])
    assert rel_l2(x, ref) == pytest.approx(3 / 5)
    # bf16 inputs are upcast before any arithmetic: identical tensors give exactly 0 / 1
    t = torch.randn(64, 64, dtype=torch.bfloat16)
    assert rel_l2(t, t.clone()) == 0.0
    assert cosine(t, t.clone()) == pytest.approx(1.0, abs=1e-12)


def test_tensor_metric_edge_cases():
    z = torch.zeros(4)
    assert rel_l2(z, z) == 0.0
    assert rel_l2(torch.ones(4), z) == math.inf
    assert cosine(z, z) == 1.0 and cosine(torch.ones(4), z) == 0.0
    assert cosine(torch.ones(4), -torch.ones(4)) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_l2(torch.ones(3), torch.ones(4))


def test_identical_frames():
    frames = np.random.default_rng(0).random((3, 32, 40, 3))
    assert psnr(frames, frames.copy()) == math.inf
    assert ssim(frames, frames.copy()) == pytest.approx(1.0, abs=1e-12)
    res = frame_quality(frames, frames.copy())
    assert res["psnr"] == math.inf and res["ssim"] == pytest.approx(1.0, abs=1e-12)
    assert res["psnr_per_frame"] == [math.inf] * 3
    assert res["max_abs"] == 0.0 and res["mean_abs"] == 0.0


@pytest.mark.parametrize("sigma", [0.01, 0.05, 0.1])
def test_psnr_of_known_gaussian_noise(sigma):
    rng = np.random.default_rng(1)
    ref = rng.uniform(0.3, 0.7, size=(4, 64, 64, 3))  # away from 0/1: no clipping of the noise
    noisy = ref + rng.normal(0.0, sigma, size=ref.shape)
    assert psnr(noisy, ref) == pytest.approx(20 * math.log10(1 / sigma), abs=0.1)
    assert psnr(noisy * 255, ref * 255, data_range=255) == pytest.approx(psnr(noisy, ref), abs=1e-9)
    res = frame_quality(noisy, ref)
    assert res["psnr"] == pytest.approx(20 * math.log10(1 / sigma), abs=0.1)
    assert all(abs(p - 20 * math.log10(1 / sigma)) < 0.2 for p in res["psnr_per_frame"])


def test_ssim_matches_reference_implementation():
    """Values from scikit-image 0.26 ``structural_similarity(gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=1.0, channel_axis=-1)``, averaged over frames, on these inputs."""
    rng = np.random.default_rng(0)
    a = rng.random((3, 40, 50, 3))
    b = np.clip(a + rng.normal(0, 0.1, a.shape), 0, 1)
    c = np.clip(a * 0.8 + 0.1, 0, 1)
    assert ssim(b, a) == pytest.approx(0.9449750248449046, abs=1e-10)
    assert ssim(c, a) == pytest.approx(0.9755175295294848, abs=1e-10)
    assert ssim(b[0], a[0]) == pytest.approx(0.9461864556838173, abs=1e-10)  # (H, W, C)
    assert ssim(b[0, ..., 0], a[0, ..., 0]) == pytest.approx(0.9509082205179772, abs=1e-10)  # (H, W)
    assert ssim(torch.from_numpy(b), torch.from_numpy(a)) == pytest.approx(0.9449750248449046, abs=1e-10)


def test_per_frame_helpers_are_what_the_aggregates_use():
    """psnr_from_mse / ssim_per_frame are public for callers that accumulate the MSE themselves or report the
    worst frame (the VAE benches): they must give exactly what psnr / ssim give."""
    rng = np.random.default_rng(4)
    ref = rng.random((3, 16, 20, 3))
    x = np.clip(ref + rng.normal(0, 0.05, ref.shape), 0, 1)
    assert psnr_from_mse(0.0, 1.0) == math.inf
    assert psnr_from_mse(1e-4, 1.0) == pytest.approx(40.0)
    assert psnr_from_mse(float(((x - ref) ** 2).mean()), 1.0) == psnr(x, ref)
    per = ssim_per_frame(x, ref, 1.0)
    assert len(per) == 3 and float(np.mean(per)) == ssim(x, ref)
    assert per[1] == pytest.approx(ssim(x[1], ref[1]), abs=1e-12)


def test_ssim_orders_degradations_and_rejects_bad_shapes():
    rng = np.random.default_rng(2)
    ref = rng.random((2, 48, 48, 3))
    light = ref + rng.normal(0, 0.02, ref.shape)
    heavy = ref + rng.normal(0, 0.2, ref.shape)
    assert 1.0 > ssim(light, ref) > ssim(heavy, ref) > 0.0
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim(np.zeros((8, 8, 3)), np.zeros((8, 8, 3)))
    with pytest.raises(ValueError, match=r"\(T, H, W, 1\)"):
        ssim(np.zeros((5, 32, 32)), np.zeros((5, 32, 32)))


def test_frame_quality_mixes_uint8_and_float():
    """A decoded video (uint8) can be compared with the pipeline's float output directly."""
    rng = np.random.default_rng(3)
    ref = rng.random((2, 24, 24, 3))
    decoded = np.round(ref * 255).astype(np.uint8)
    res = frame_quality(decoded, ref)
    assert res["max_abs"] <= 0.5 / 255 + 1e-12
    assert res["psnr"] > 50 and res["ssim"] > 0.999
    assert len(res["psnr_per_frame"]) == 2
    with pytest.raises(ValueError, match="shape mismatch"):
        frame_quality(decoded[:1], ref)


# ---------------------------------------------------------------------------------------------------------------
# The figures the shared dicts add, against hand-computed values
# ---------------------------------------------------------------------------------------------------------------


def test_nan_inf_and_frac_beyond_tol_hand_computed():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    assert nan_inf(x) == 3 and nan_inf(x.numpy()) == 3 and nan_inf(torch.zeros(3)) == 0
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = torch.tensor([1.0, 2.5, 3.0, float("nan")])  # |d| = 0, 0.5, 0, nan; bound 0.1 + 0.1|ref| = .2 .3 .4 .5
    assert frac_beyond_tol(out, ref, atol=0.1, rtol=0.1) == 0.5  # element 1 beyond, element 3 not finite
    assert frac_beyond_tol(ref, ref, atol=0.0, rtol=0.0) == 0.0


def test_mean_psnr_leaves_identical_frames_out():
    assert mean_psnr([30.0, 40.0]) == 35.0
    assert mean_psnr([30.0, math.inf, 40.0]) == 35.0
    assert mean_psnr([math.inf, math.inf]) == math.inf


def test_frame_quality_hand_computed_uint8_and_torch():
    ref = np.full((2, 12, 12, 3), 100, dtype=np.uint8)
    out = ref.copy()
    out[1, 0, 0, 0] = 110  # frame 1: one element off by 10/255 -> MSE (10/255)^2 / 432
    q = frame_quality(out, ref)
    mse1 = (10 / 255) ** 2 / 432
    assert q["psnr_per_frame"][0] == math.inf and q["psnr_per_frame"][1] == pytest.approx(-10 * math.log10(mse1))
    assert q["psnr"] == pytest.approx(-10 * math.log10(mse1 / 2)) and q["psnr_min"] == q["psnr_per_frame"][1]
    assert q["psnr_mean"] == q["psnr_per_frame"][1]  # the identical frame is left out of the mean
    assert q["max_abs"] == 10 / 255 and q["mean_abs"] == pytest.approx(10 / 255 / 864)
    assert q["ssim_per_frame"][0] == pytest.approx(1.0) and q["ssim_min"] == q["ssim_per_frame"][1] < 1.0
    # the same clip as float tensors: the same figures (the VAE bench's path, per frame on the tensors' device)
    t = frame_quality(torch.from_numpy(out) / 255.0, torch.from_numpy(ref) / 255.0)
    for k in ("psnr", "psnr_min", "psnr_mean", "ssim", "ssim_min", "max_abs", "mean_abs"):
        assert t[k] == pytest.approx(q[k], rel=1e-5), k
    assert list(t) == list(q)


def test_frame_quality_below_the_ssim_window_gives_no_ssim():
    ref = torch.rand(2, 8, 8, 3, generator=torch.Generator().manual_seed(0))
    q = frame_quality(ref + 0.01, ref)
    assert q["ssim"] is None and q["ssim_min"] is None and q["ssim_per_frame"] == []
    assert q["psnr"] == pytest.approx(40.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        frame_quality(ref[:1], ref)


def test_identical_inputs_of_every_kind():
    t = torch.randn(2, 3, 16, 16, dtype=torch.bfloat16)
    assert rel_l2(t, t.clone()) == 0.0 and psnr(t, t.clone()) == math.inf
    assert tensor_quality(t, t.clone()) == {"rel_l2": 0.0, "cosine": pytest.approx(1.0), "max_abs": 0.0,
                                            "mean_abs": 0.0, "nan_inf": 0}
    a = attention_quality(t, t.double(), atol=0.0, rtol=0.0)
    assert a["rel_l2"] == 0.0 and a["max_abs"] == 0.0 and a["frac_beyond_tol"] == 0.0 and a["nan_inf"] == 0
    clip = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    q = frame_quality(clip, clip.copy())
    assert q["psnr"] == q["psnr_min"] == q["psnr_mean"] == math.inf and q["ssim"] == pytest.approx(1.0)
    assert stream_psnr(iter(clip), iter(clip.copy())) == math.inf


def test_nan_inputs_are_counted():
    ref = torch.tensor([[3.0, 4.0], [1.0, 1.0]], dtype=torch.float64)
    out = torch.tensor([[3.0, 4.0], [float("nan"), float("inf")]])
    a = attention_quality(out, ref, atol=1e-2, rtol=1e-2)
    assert a["nan_inf"] == 2 and a["frac_beyond_tol"] == 0.5 and a["max_abs"] == 0.0
    assert a["rel_l2"] == pytest.approx(math.sqrt(2) / math.sqrt(27))  # non-finite elements zeroed
    assert math.isinf(attention_quality(torch.full((2,), float("nan")), ref[0], 0.0, 0.0)["max_abs"])
    assert tensor_quality(out, ref)["nan_inf"] == 2


def test_attention_quality_hand_computed():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    out = torch.tensor([3.0, 4.5])
    a = attention_quality(out, ref, atol=0.1, rtol=0.1)
    assert a == {"rel_l2": pytest.approx(0.1), "cosine": pytest.approx((9 + 18) / (5 * math.sqrt(29.25))),
                 "max_abs": 0.5, "frac_beyond_tol": 0.0, "nan_inf": 0}


def test_stream_psnr_is_frame_quality_psnr_and_rejects_mismatches():
    rng = np.random.default_rng(5)
    ref = rng.integers(0, 256, (3, 12, 16, 3), dtype=np.uint8)
    out = np.clip(ref.astype(int) + rng.integers(-4, 5, ref.shape), 0, 255).astype(np.uint8)
    assert stream_psnr(iter(out), iter(ref)) == frame_quality(out, ref)["psnr"]
    assert stream_psnr(iter(out[:2]), iter(ref)) is None and stream_psnr(iter(out), iter(ref[:2])) is None
    assert stream_psnr(iter(out[:, :8]), iter(ref)) is None


# ---------------------------------------------------------------------------------------------------------------
# The tools give the shared module's numbers
# ---------------------------------------------------------------------------------------------------------------


def _clips():
    g = torch.Generator().manual_seed(1)
    ref = torch.rand(3, 16, 20, 3, generator=g)
    return (ref + 0.02 * torch.randn(ref.shape, generator=g)).clamp(0, 1), ref


def test_bench_vae_quality_is_the_shared_frame_quality():
    from vdbench.vae_bench import cli as bv

    out, ref = _clips()
    got, q = bv.quality(out, ref), frame_quality(out, ref)
    assert list(got) == ["psnr_min", "psnr_mean", "psnr_all", "ssim_min", "ssim_mean", "psnr_per_frame",
                         "ssim_per_frame"]  # the CSV/JSON names
    assert got == {"psnr_min": q["psnr_min"], "psnr_mean": q["psnr_mean"], "psnr_all": q["psnr"],
                   "ssim_min": q["ssim_min"], "ssim_mean": q["ssim"], "psnr_per_frame": q["psnr_per_frame"],
                   "ssim_per_frame": q["ssim_per_frame"]}
    mse = [float(((out[i].double() - ref[i].double()) ** 2).mean()) for i in range(3)]
    assert got["psnr_all"] == psnr_from_mse(sum(mse) / 3, 1.0)
    assert got["psnr_per_frame"] == [psnr_from_mse(m, 1.0) for m in mse]


def test_bench_attention_accuracy_is_the_shared_attention_quality():
    from vdbench import kernel_bench as ba

    g = torch.Generator().manual_seed(2)
    ref = torch.randn(1, 2, 32, 16, generator=g, dtype=torch.float64)
    out = (ref + 1e-2 * torch.randn(ref.shape, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    out[0, 0, 0, 0] = float("nan")
    assert ba.accuracy(out, ref) == attention_quality(out, ref, ba.ATOL, ba.RTOL)
    assert ba.accuracy(out, ref)["nan_inf"] == 1


def test_vae_parallel_and_gpu_kernels_figures_are_the_shared_ones():
    from vdbench import kernel_tune as gk
    from vdbench.vae_bench import parallel as bvp

    out, ref = _clips()
    q = bvp.quality(out * 2 - 1, ref * 2 - 1)  # [-1, 1] video: the same dB as the frames on [0, 1]
    assert q["psnr_db"] == round(psnr(out, ref), 2) and q["max_abs"] == pytest.approx(2 * max_abs(out, ref))
    assert bvp.quality(ref, ref.clone()) == {"psnr_db": None, "identical": True, "max_abs": 0.0}
    assert gk.rel(out, ref) == rel_l2(out, ref)


def test_compare_outputs_columns_are_the_shared_frame_quality():
    from bench import compare_outputs as co

    rng = np.random.default_rng(6)
    ref = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    out = np.clip(ref.astype(int) + rng.integers(-5, 6, ref.shape), 0, 255).astype(np.uint8)
    q = frame_quality(out, ref)
    assert co.quality_columns(out, ref) == {"psnr_db": q["psnr"], "ssim": q["ssim"],
                                            "worst_frame_psnr_db": min(q["psnr_per_frame"]),
                                            "max_abs": q["max_abs"], "mean_abs": q["mean_abs"]}
    assert set(co.quality_columns(out[:2], ref).values()) == {None}


def test_batch_and_report_psnr_are_the_shared_one(tmp_path):
    from vdbench import batch, report
    from vdbench.video import iter_frames, write_video

    rng = np.random.default_rng(7)
    ref = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    noisy = np.clip(ref.astype(int) + rng.integers(-6, 7, ref.shape), 0, 255).astype(np.uint8)
    videos = []
    for name, frames in (("reference", ref), ("sagev1_emu", noisy)):
        videos.append(tmp_path / f"wan_result_t2v_tiny_3f_4s_attn_{name}_16x16.mp4")
        write_video(frames, videos[-1], fps=8)
    decoded = [np.stack(list(iter_frames(v))) for v in videos]
    expect = frame_quality(decoded[1], decoded[0])["psnr"]
    assert report.video_psnr(videos[1], videos[0]) == expect
    rows, _ = batch.rows(tmp_path, videos)
    assert rows[1]["psnr"] == f"{expect:.1f} dB" and rows[0]["psnr"] == "ref"


def test_compare_outputs_finds_a_reference_by_its_attention_and_times_a_cached_render_by_its_mean():
    from bench import compare_outputs as co

    sources = {"reference+vae=fast": 1, "sdpa+vae=fast": 2, "sdpa+vae=fast+fbc:threshold=0.2+u2": 3}
    assert co._label("reference", sources) == "reference+vae=fast"  # its stack's attention part
    assert co._label("sdpa+vae=fast", sources) == "sdpa+vae=fast"  # a full label as it is
    # the kernel alone beside its stacks: the one with the fewest options
    assert co._label("sdpa", sources) == "sdpa+vae=fast"
    assert co._label("sdpa", {"sdpa+vae=fast": 1, "sdpa+compile": 2}) == "sdpa"  # a tie: not guessed
    assert co._label("fav3", sources) == "fav3"
    # a stack named without the settings' tag its renders carry (e.g. a batch with --parallel_engine diffusers)
    tagged = {"fav3+u2 [id-337af5e3]": 1, "fav3+offload=shard+u2 [id-337af5e3]": 2}
    assert co._label("fav3+u2", tagged) == "fav3+u2 [id-337af5e3]"
    assert co._label("fav3+u2", {**tagged, "fav3+u2 [seed7]": 3}) == "fav3+u2"  # two: not guessed


def test_the_report_finds_a_reference_by_its_stack_with_a_settings_tag():
    from vdbench.measure.record import Identity
    from vdbench.report.records import match_label, references

    runs = {"fav3+offload=shard+u2 [id-337af5e3]": Identity(attention="fav3", layout="u2", speed=("offload=shard",),
                                                            tag="id-337af5e3", content="c"),
            "fav3+u2 [id-337af5e3]": Identity(attention="fav3", layout="u2", tag="id-337af5e3", content="c")}
    assert [i.stack for i in runs.values()] == ["fav3+offload=shard+u2", "fav3+u2"]
    assert match_label("fav3+u2", runs) == "fav3+u2 [id-337af5e3]"
    assert references("fav3+u2", runs) == {"c": "fav3+u2 [id-337af5e3]"}
    assert match_label("fav3", runs) == "fav3+offload=shard+u2 [id-337af5e3]"  # by attention: the first
