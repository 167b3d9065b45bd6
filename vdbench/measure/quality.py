"""How far an output is from its reference: the one definition of every quality figure the tools report.

Three kinds of (output, reference) pairs, one function each returning the standard dict:

* video frames -- :func:`frame_quality`: PSNR over all frames and per frame (min, mean), SSIM per frame (min,
  mean), max / mean absolute difference, on the [0, 1] scale;
* latents and other raw tensors -- :func:`tensor_quality`: relative L2, cosine, max / mean abs, NaN/Inf count;
* attention outputs -- :func:`attention_quality`: relative L2, cosine, max abs over the finite elements, the share
  of elements beyond ``atol + rtol * |ref|``, NaN/Inf count.

The single figures (``rel_l2``, ``cosine``, ``max_abs``, ``mean_abs``, ``psnr``, ``ssim``, ``frac_beyond_tol``,
``nan_inf``) are the building blocks of those dicts and are used alone where a tool reports one number. Everything
is computed in float64 so that the metric itself adds no error comparable to the bf16/fp8 differences being
measured; torch tensors and numpy arrays are both accepted and results are Python floats. Tensor figures run on
the CPU unless ``keep_device=True`` (a GPU tensor too large to copy to the host, or a figure that must match one
computed there).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch

__all__ = ["rel_l2", "cosine", "max_abs", "mean_abs", "nan_inf", "frac_beyond_tol", "psnr", "psnr_from_mse",
           "ssim", "ssim_per_frame", "mean_psnr", "frame_quality", "stream_psnr", "tensor_quality",
           "attention_quality", "lpips_distance"]


def _as_f64(x, keep_device: bool = False) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device=x.device if keep_device else "cpu", dtype=torch.float64)
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def _pair(x, ref, keep_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _as_f64(x, keep_device), _as_f64(ref, keep_device)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    return a, b.to(a.device)


def rel_l2(x, ref, keep_device: bool = False) -> float:
    """``||x - ref|| / ||ref||`` (Frobenius norms): the error relative to the reference's magnitude, so it
    reads the same for tensors of any scale. 0 for identical inputs; inf if ``ref`` is all zeros and ``x``
    is not."""
    a, b = _pair(x, ref, keep_device)
    num = torch.linalg.vector_norm(a - b).item()
    den = torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def cosine(x, ref, keep_device: bool = False) -> float:
    """Cosine similarity of the flattened inputs (1 = same direction). Two all-zero inputs count as
    identical (1.0); exactly one all-zero input has no direction to agree with (0.0)."""
    a, b = _pair(x, ref, keep_device)
    a, b = a.flatten(), b.flatten()
    na, nb = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item()
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(torch.dot(a, b).item() / (na * nb))


def max_abs(x, ref, keep_device: bool = False) -> float:
    """Largest absolute elementwise difference."""
    a, b = _pair(x, ref, keep_device)
    return float((a - b).abs().max().item()) if a.numel() else 0.0


def mean_abs(x, ref, keep_device: bool = False) -> float:
    """Mean absolute elementwise difference."""
    a, b = _pair(x, ref, keep_device)
    return float((a - b).abs().mean().item()) if a.numel() else 0.0


def nan_inf(x) -> int:
    """Number of NaN or +-Inf elements (counted where ``x`` lies: no copy, no upcast)."""
    if isinstance(x, torch.Tensor):
        return int((~torch.isfinite(x)).sum().item())
    return int((~np.isfinite(np.asarray(x))).sum())


def frac_beyond_tol(x, ref, atol: float, rtol: float) -> float:
    """Share of elements with ``|x - ref| > atol + rtol * |ref|`` (torch.allclose's test, elementwise); a
    NaN or Inf in ``x`` counts as beyond whatever the reference. Computed on the inputs' device."""
    o, r = _pair(x, ref, keep_device=True)
    return _beyond(o, r, torch.isfinite(o), atol, rtol)


def _beyond(o: torch.Tensor, r: torch.Tensor, finite: torch.Tensor, atol: float, rtol: float) -> float:
    return (((o - r).abs() > atol + rtol * r.abs()) | ~finite).double().mean().item()


def psnr(x, ref, data_range: float = 1.0, keep_device: bool = False) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(data_range^2 / MSE)`` over all elements; inf when the
    inputs are identical. Use ``data_range=255`` for uint8 frames."""
    a, b = _pair(x, ref, keep_device)
    mse = torch.mean((a - b) ** 2).item()
    return psnr_from_mse(mse, data_range)


def psnr_from_mse(mse: float, data_range: float) -> float:
    """PSNR in dB from an already computed mean squared error (inf for 0): the one formula for callers that
    accumulate the MSE themselves (per frame, on a GPU, in float64 over tensors too large to copy)."""
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(float(data_range) ** 2 / mse)


def mean_psnr(values) -> float:
    """Mean of per-frame PSNRs in dB. Identical frames (inf) are left out of the mean, since one of them would
    make it inf however bad the others are; inf only when every frame is identical."""
    values = list(values)
    finite = [p for p in values if math.isfinite(p)]
    if len(finite) == len(values):
        return statistics.fmean(values)
    return math.inf if all(p == math.inf for p in values) else statistics.fmean(finite)


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
    return _mean_ssim(ssim_per_frame(x, ref, data_range))


def _mean_ssim(values) -> float:
    """A clip's SSIM: the mean of its frames'."""
    return float(np.mean(values))


def _frames_unit(frames) -> np.ndarray:
    """Frames as float64 in [0, 1]: uint8 (decoded video) is divided by 255, floats are taken as [0, 1]
    (diffusers ``output_type="np"``), so a decoded file can be compared with a pipeline's raw output."""
    arr = frames if isinstance(frames, np.ndarray) else np.stack([np.asarray(f) for f in frames])
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    return arr.astype(np.float64, copy=False)


def _sq_abs_max_u8(a: np.ndarray, b: np.ndarray) -> tuple[int, int, int]:
    """Sum of squared, sum of absolute and largest absolute difference of two uint8 frames, exact in integers."""
    d = a.astype(np.int32) - b.astype(np.int32)
    return int((d * d).sum(dtype=np.int64)), int(np.abs(d).sum(dtype=np.int64)), int(np.abs(d).max(initial=0))


def _psnr_u8(sq_sum: int, count: int) -> float:
    """PSNR (dB, on the [0, 1] scale) of uint8 data from its exact sum of squared differences over ``count``
    elements."""
    return psnr_from_mse(float(sq_sum) / count / 255.0 ** 2, 1.0) if sq_sum else math.inf


def frame_quality(frames, ref_frames, device=None) -> dict:
    """The standard quality dict of video ``frames`` against ``ref_frames``, on the [0, 1] scale.

    Inputs: (T, H, W, C) numpy arrays or lists of frames, uint8 or float in [0, 1] (a decoded video can be compared
    with a pipeline's float output), or two (T, H, W, C) torch tensors in [0, 1] on any device (the VAE bench's
    decodes: the float64 differences are taken there, one frame at a time). Two uint8 clips are compared in exact
    integer arithmetic (no float64 copy of the whole clip); ``device`` (e.g. "cuda") runs the SSIM windows of numpy
    frames there.

    Keys: ``psnr`` (from the MSE over all frames, so one bad frame is not averaged away in dB), ``psnr_min``,
    ``psnr_mean`` (:func:`mean_psnr`), ``psnr_per_frame`` (list, to spot drift over time), ``ssim`` (mean over
    frames), ``ssim_min``, ``ssim_per_frame`` (SSIM needs frames of at least 11x11: None, None and [] below that),
    ``max_abs``, ``mean_abs``.
    """
    if isinstance(frames, torch.Tensor) and isinstance(ref_frames, torch.Tensor):
        if frames.shape != ref_frames.shape:
            raise ValueError(f"shape mismatch: {tuple(frames.shape)} vs reference {tuple(ref_frames.shape)}")
        if frames.ndim != 4:
            raise ValueError(f"expected (T, H, W, C) frames, got shape {tuple(frames.shape)}")
        ref_frames = ref_frames.to(frames.device)
        mse, mx, mean = [], [], []
        for i in range(frames.shape[0]):  # frame by frame: a whole clip in float64 on the GPU would be GBs
            d = frames[i].double() - ref_frames[i].double()
            mse.append(float((d ** 2).mean()))
            mx.append(float(d.abs().max()))
            mean.append(float(d.abs().mean()))
        per_frame = [psnr_from_mse(m, 1.0) for m in mse]
        out = {"psnr": psnr_from_mse(statistics.fmean(mse), 1.0), "max_abs": max(mx), "mean_abs": statistics.fmean(mean)}
        a, b = frames, ref_frames
    elif isinstance(frames, np.ndarray) and isinstance(ref_frames, np.ndarray) and frames.dtype == np.uint8 \
            and ref_frames.dtype == np.uint8:
        if frames.shape != ref_frames.shape:
            raise ValueError(f"shape mismatch: {frames.shape} vs reference {ref_frames.shape}")
        if frames.ndim != 4:
            raise ValueError(f"expected (T, H, W, C) frames, got shape {frames.shape}")
        sums = [_sq_abs_max_u8(frames[i], ref_frames[i]) for i in range(frames.shape[0])]
        n, T = frames[0].size, frames.shape[0]
        per_frame = [_psnr_u8(sq, n) for sq, _, _ in sums]
        out = {"psnr": _psnr_u8(sum(s[0] for s in sums), n * T), "max_abs": max(s[2] for s in sums) / 255.0,
               "mean_abs": float(sum(s[1] for s in sums)) / (n * T) / 255.0}
        a, b = frames, ref_frames
    else:
        a, b = _frames_unit(frames), _frames_unit(ref_frames)
        if a.shape != b.shape:
            raise ValueError(f"shape mismatch: {a.shape} vs reference {b.shape}")
        if a.ndim != 4:
            raise ValueError(f"expected (T, H, W, C) frames, got shape {a.shape}")
        diff = a - b
        sq = diff.reshape(diff.shape[0], -1) ** 2
        per_frame = [psnr_from_mse(float(m), 1.0) for m in sq.mean(axis=1)]
        out = {"psnr": psnr_from_mse(float(sq.mean()), 1.0), "max_abs": float(np.abs(diff).max()),
               "mean_abs": float(np.abs(diff).mean())}
    ssim_frames = ssim_per_frame(a, b, 1.0, device=device) if min(a.shape[1], a.shape[2]) >= _SSIM_WIN else []
    return {"psnr": out["psnr"], "psnr_min": min(per_frame), "psnr_mean": mean_psnr(per_frame),
            "psnr_per_frame": per_frame, "ssim": _mean_ssim(ssim_frames) if ssim_frames else None,
            "ssim_min": min(ssim_frames) if ssim_frames else None, "ssim_per_frame": ssim_frames,
            "max_abs": out["max_abs"], "mean_abs": out["mean_abs"]}


def stream_psnr(frames, ref_frames) -> float | None:
    """PSNR (dB, over all frames) of two streams of uint8 frames, taken one pair at a time so two 81-frame 480p
    clips never sit in memory at once, in exact integer arithmetic (the value :func:`frame_quality` gives the same
    clips); None when their sizes or frame counts differ (not comparable)."""
    sq, n = 0, 0
    ref_iter = iter(ref_frames)
    for a in frames:
        b = next(ref_iter, None)
        if b is None or a.shape != b.shape:
            return None
        sq += _sq_abs_max_u8(a, b)[0]
        n += a.size
    if next(ref_iter, None) is not None:
        return None
    return _psnr_u8(sq, n)


def tensor_quality(x, ref, keep_device: bool = False) -> dict:
    """The standard quality dict of a raw tensor (latents, a decoder's float output) against its reference:
    ``rel_l2``, ``cosine``, ``max_abs``, ``mean_abs`` and ``nan_inf`` (non-finite elements of ``x``)."""
    return {"rel_l2": rel_l2(x, ref, keep_device), "cosine": cosine(x, ref, keep_device),
            "max_abs": max_abs(x, ref, keep_device), "mean_abs": mean_abs(x, ref, keep_device), "nan_inf": nan_inf(x)}


def attention_quality(out, ref, atol: float, rtol: float) -> dict:
    """The standard quality dict of an attention output against exact attention (``ref``, fp64): ``rel_l2`` and
    ``cosine`` with non-finite elements zeroed (so one NaN does not hide the error of the rest: they are counted
    apart), ``max_abs`` over the finite elements (inf when none is), ``frac_beyond_tol`` (:func:`frac_beyond_tol`),
    ``nan_inf``. The elementwise work runs on the output's device."""
    o, r = _pair(out, ref, keep_device=True)
    finite = torch.isfinite(o)
    diff = (o - r).abs()
    o_f = torch.where(finite, o, torch.zeros_like(o))
    return {"rel_l2": rel_l2(o_f, r), "cosine": cosine(o_f, r),
            "max_abs": diff[finite].max().item() if finite.any() else math.inf,
            "frac_beyond_tol": _beyond(o, r, finite, atol, rtol), "nan_inf": nan_inf(o)}


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
