"""Numerical distance between a backend's output and the reference backend's output.

Tensor metrics (``rel_l2``, ``cosine``, ``max_abs``, ``mean_abs``) compare raw outputs such as attention
results or latents; image metrics (``psnr``, ``ssim``, ``compare_frames``) compare decoded video frames.
Everything is computed in float64 on CPU so that the metric itself adds no error comparable to the bf16/fp8
differences being measured; torch tensors and numpy arrays are both accepted and results are Python floats.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["rel_l2", "cosine", "max_abs", "mean_abs", "psnr", "psnr_from_mse", "ssim", "ssim_per_frame",
           "compare_frames", "lpips_distance"]


def _as_f64(x, keep_device: bool = False) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device=x.device if keep_device else "cpu", dtype=torch.float64)
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def _pair(x, ref) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _as_f64(x), _as_f64(ref)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    return a, b


def rel_l2(x, ref) -> float:
    """``||x - ref|| / ||ref||`` (Frobenius norms): the error relative to the reference's magnitude, so it
    reads the same for tensors of any scale. 0 for identical inputs; inf if ``ref`` is all zeros and ``x``
    is not."""
    a, b = _pair(x, ref)
    num = torch.linalg.vector_norm(a - b).item()
    den = torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def cosine(x, ref) -> float:
    """Cosine similarity of the flattened inputs (1 = same direction). Two all-zero inputs count as
    identical (1.0); exactly one all-zero input has no direction to agree with (0.0)."""
    a, b = _pair(x, ref)
    a, b = a.flatten(), b.flatten()
    na, nb = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item()
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(torch.dot(a, b).item() / (na * nb))


def max_abs(x, ref) -> float:
    """Largest absolute elementwise difference."""
    a, b = _pair(x, ref)
    return float((a - b).abs().max().item()) if a.numel() else 0.0


def mean_abs(x, ref) -> float:
    """Mean absolute elementwise difference."""
    a, b = _pair(x, ref)
    return float((a - b).abs().mean().item()) if a.numel() else 0.0


def psnr(x, ref, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(data_range^2 / MSE)`` over all elements; inf when the
    inputs are identical. Use ``data_range=255`` for uint8 frames."""
    a, b = _pair(x, ref)
    mse = torch.mean((a - b) ** 2).item()
    return psnr_from_mse(mse, data_range)


def psnr_from_mse(mse: float, data_range: float) -> float:
    """PSNR in dB from an already computed mean squared error (inf for 0): the one formula for callers that
    accumulate the MSE themselves (per frame, on a GPU, in float64 over tensors too large to copy)."""
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(float(data_range) ** 2 / mse)


# SSIM after Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, statistics over the
# window positions that lie fully inside the image ("valid"), no sample-covariance correction.
_SSIM_WIN, _SSIM_SIGMA, _K1, _K2 = 11, 1.5, 0.01, 0.03


def _gauss_1d() -> torch.Tensor:
    r = torch.arange(_SSIM_WIN, dtype=torch.float64) - (_SSIM_WIN - 1) / 2
    g = torch.exp(-(r ** 2) / (2 * _SSIM_SIGMA ** 2))
    return g / g.sum()


def _as_frames(x) -> torch.Tensor:
    """(T, C, H, W) float64 from (H, W), (H, W, C) or (T, H, W, C)."""
    t = _as_f64(x, keep_device=True)
    if t.ndim == 2:
        t = t[None, :, :, None]
    elif t.ndim == 3:
        if t.shape[-1] > 4:
            raise ValueError(f"a 3-D input is read as (H, W, C) but its last dim is {t.shape[-1]}; "
                             "pass a grayscale stack as (T, H, W, 1)")
        t = t[None]
    elif t.ndim != 4:
        raise ValueError(f"expected (H, W), (H, W, C) or (T, H, W, C), got shape {tuple(t.shape)}")
    return t.permute(0, 3, 1, 2)


def ssim_per_frame(x, ref, data_range: float, device=None) -> list[float]:
    """Per-frame SSIM (the list :func:`ssim` averages), for callers that report the worst frame too. Frames are
    converted to float64 one at a time (a whole 81-frame 480p clip in float64 is ~0.8 GB per input), on
    ``device`` when given (a GPU computes the float64 windows far faster)."""
    if isinstance(x, np.ndarray) and isinstance(ref, np.ndarray) and x.ndim == 4:
        if x.shape != ref.shape:
            raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
        scale = 255.0 if x.dtype == np.uint8 else 1.0
        return [ssim_per_frame(_as_f64(x[i]).to(device) / scale if device else x[i] / scale,
                                _as_f64(ref[i]).to(device) / scale if device else ref[i] / scale,
                                data_range)[0] for i in range(x.shape[0])]
    a, b = _as_frames(x), _as_frames(ref)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    T, C, H, W = a.shape
    if H < _SSIM_WIN or W < _SSIM_WIN:
        raise ValueError(f"SSIM needs frames of at least {_SSIM_WIN}x{_SSIM_WIN}, got {W}x{H}")
    g = _gauss_1d().to(a.device)
    gh, gv = g.view(1, 1, 1, -1), g.view(1, 1, -1, 1)

    def blur(z: torch.Tensor) -> torch.Tensor:
        # The 2-D Gaussian is separable: two 11-tap passes instead of one 121-tap pass.
        return torch.nn.functional.conv2d(torch.nn.functional.conv2d(z, gh), gv)

    c1 = (_K1 * data_range) ** 2
    c2 = (_K2 * data_range) ** 2
    out = []
    with torch.no_grad():
        for i in range(T):  # frame by frame: float64 statistics of a whole 81-frame clip would be GBs
            p, q = a[i].reshape(C, 1, H, W), b[i].reshape(C, 1, H, W)
            mu_p, mu_q = blur(p), blur(q)
            s_pp = blur(p * p) - mu_p ** 2
            s_qq = blur(q * q) - mu_q ** 2
            s_pq = blur(p * q) - mu_p * mu_q
            ssim_map = ((2 * mu_p * mu_q + c1) * (2 * s_pq + c2)) / ((mu_p ** 2 + mu_q ** 2 + c1) * (s_pp + s_qq + c2))
            out.append(float(ssim_map.mean().item()))  # mean over positions and channels
    return out


def ssim(x, ref, data_range: float = 1.0) -> float:
    """Structural similarity (Gaussian-window SSIM, per channel, averaged over channels, positions and
    frames). Accepts (H, W), (H, W, C) or (T, H, W, C); 1.0 for identical inputs."""
    return float(np.mean(ssim_per_frame(x, ref, data_range)))


def _frames_unit(frames) -> np.ndarray:
    """Frames as float64 in [0, 1]: uint8 (decoded video) is divided by 255, floats are taken as [0, 1]
    (diffusers ``output_type="np"``), so a decoded file can be compared with a pipeline's raw output."""
    arr = frames if isinstance(frames, np.ndarray) else np.stack([np.asarray(f) for f in frames])
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    return arr.astype(np.float64, copy=False)


def compare_frames(frames, ref_frames, device=None) -> dict:
    """Image-quality summary of ``frames`` against ``ref_frames`` ((T, H, W, C) arrays or lists of frames,
    uint8 or float in [0, 1], compared on the [0, 1] scale).

    Returns ``psnr`` (from the MSE over all frames, so one bad frame is not averaged away in dB), ``ssim``
    (mean over frames), ``psnr_per_frame`` (list, to spot drift over time), ``max_abs`` and ``mean_abs``.
    Two uint8 clips are compared in exact integer arithmetic (no float64 copy of the whole clip); ``device``
    (e.g. "cuda") runs the SSIM windows there.
    """
    if isinstance(frames, np.ndarray) and isinstance(ref_frames, np.ndarray) and frames.dtype == np.uint8 \
            and ref_frames.dtype == np.uint8:
        if frames.shape != ref_frames.shape:
            raise ValueError(f"shape mismatch: {frames.shape} vs reference {ref_frames.shape}")
        if frames.ndim != 4:
            raise ValueError(f"expected (T, H, W, C) frames, got shape {frames.shape}")
        T = frames.shape[0]
        sq_sum = np.zeros(T, dtype=np.int64)
        abs_sum = np.zeros(T, dtype=np.int64)
        max_d = 0
        for i in range(T):
            d = frames[i].astype(np.int32) - ref_frames[i].astype(np.int32)
            sq_sum[i] = int((d * d).sum(dtype=np.int64))
            abs_sum[i] = int(np.abs(d).sum(dtype=np.int64))
            max_d = max(max_d, int(np.abs(d).max()))
        n = frames[0].size
        return {
            "psnr": psnr_from_mse(float(sq_sum.sum()) / (n * T) / 255.0 ** 2, 1.0),
            "ssim": float(np.mean(ssim_per_frame(frames, ref_frames, 1.0, device=device))),
            "psnr_per_frame": [psnr_from_mse(float(v) / n / 255.0 ** 2, 1.0) for v in sq_sum],
            "max_abs": max_d / 255.0,
            "mean_abs": float(abs_sum.sum()) / (n * T) / 255.0,
        }
    a, b = _frames_unit(frames), _frames_unit(ref_frames)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs reference {b.shape}")
    if a.ndim != 4:
        raise ValueError(f"expected (T, H, W, C) frames, got shape {a.shape}")
    diff = a - b
    sq = diff.reshape(diff.shape[0], -1) ** 2
    per_frame_mse = sq.mean(axis=1)
    return {
        "psnr": psnr_from_mse(float(sq.mean()), 1.0),
        "ssim": float(np.mean(ssim_per_frame(a, b, 1.0, device=device))),
        "psnr_per_frame": [psnr_from_mse(float(m), 1.0) for m in per_frame_mse],
        "max_abs": float(np.abs(diff).max()),
        "mean_abs": float(np.abs(diff).mean()),
    }


def lpips_distance(frames, ref_frames, max_frames: int = 16):
    """Mean LPIPS (AlexNet) over up to ``max_frames`` evenly spaced frames: ``(value, None)``, or
    ``(None, reason)`` when the optional ``lpips`` package or its pretrained weights are not available — the
    caller reports the reason instead of a number (the weights come from the internet on first use)."""
    import importlib.util

    if importlib.util.find_spec("lpips") is None:
        return None, "LPIPS not computed: the optional 'lpips' package is not installed"
    try:
        import lpips

        net = lpips.LPIPS(net="alex", verbose=False).eval()
    except Exception as exc:  # noqa: BLE001 - missing weights offline, incompatible torchvision, ...
        return None, f"LPIPS not computed: its pretrained weights could not be loaded ({type(exc).__name__})"
    a, b = _frames_unit(frames), _frames_unit(ref_frames)
    idx = np.linspace(0, a.shape[0] - 1, num=min(max_frames, a.shape[0])).round().astype(int)
    to_t = lambda x: torch.from_numpy(np.ascontiguousarray(x[idx])).permute(0, 3, 1, 2).float() * 2 - 1  # noqa: E731
    with torch.no_grad():
        return float(net(to_t(a), to_t(b)).mean().item()), None
