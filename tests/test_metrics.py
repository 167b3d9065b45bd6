"""vdbench.metrics: tensor distances and frame-quality metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vdbench.metrics import (compare_frames, cosine, max_abs, mean_abs, psnr, psnr_from_mse, rel_l2, ssim,
                             ssim_per_frame)


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
    res = compare_frames(frames, frames.copy())
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
    res = compare_frames(noisy, ref)
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


def test_compare_frames_mixes_uint8_and_float():
    """A decoded video (uint8) can be compared with the pipeline's float output directly."""
    rng = np.random.default_rng(3)
    ref = rng.random((2, 24, 24, 3))
    decoded = np.round(ref * 255).astype(np.uint8)
    res = compare_frames(decoded, ref)
    assert res["max_abs"] <= 0.5 / 255 + 1e-12
    assert res["psnr"] > 50 and res["ssim"] > 0.999
    assert len(res["psnr_per_frame"]) == 2
    with pytest.raises(ValueError, match="shape mismatch"):
        compare_frames(decoded[:1], ref)
