"""Pure-torch emulations of the Triton kernels' numerics (any device), for tests and accuracy comparisons.

They quantize exactly as the Triton pre-pass does (same blocks, same rounding), take S in the log2 domain,
and round P (×448) and V to e4m3 for the fp8 P·V products. One difference is inherent: the kernels round P
relative to the *running* row max of the online softmax, these emulations relative to the final row max, so
kernel and emulation agree closely but not bit for bit once a row spans several K tiles.
"""

from __future__ import annotations

import torch

from vdbench.backends import (LOG2E, _causal_mask, exact_attention, quantize_int8_per_block)  # noqa: F401

FP8_MAX = 448.0
P_SCALE = 448.0


def _rep(scale_blocks: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """(B, H, n_blocks) -> (B, H, n) per-token scale."""
    return scale_blocks.repeat_interleave(block, dim=2)[:, :, :n]


def quantize_fp8_per_block(x: torch.Tensor, block: int, pre_scale: float = 1.0):
    """e4m3 per ``block`` tokens per head, as quant.quant_blocks(fp8=True): (values as fp32 (B,H,S,D), scales (B,H,nb))."""
    b, h, s, d = x.shape
    xs = x.float() * pre_scale
    pad = (-s) % block
    xp = torch.nn.functional.pad(xs, (0, 0, 0, pad)) if pad else xs
    xb = xp.view(b, h, -1, block, d)
    scale = xb.abs().amax(dim=(-1, -2)) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = (xb / safe[..., None, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return q8.view(b, h, -1, d)[:, :, :s], scale


def _softmax_pv(s, v_f, v_scale_tok, v_scale_ch, pv, is_causal, sq, sk, device):
    if is_causal:
        s = s.masked_fill(~_causal_mask(sq, sk, device), float("-inf"))
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    if pv == "fp8":
        p8 = (p * P_SCALE).to(torch.float8_e4m3fn).float()
        vv = v_f if v_scale_tok is None else v_f * v_scale_tok[..., None]
        o = torch.matmul(p8, vv) / P_SCALE
        if v_scale_ch is not None:
            o = o * v_scale_ch[:, :, None, :]
    elif pv == "fp16":
        o = torch.matmul(p.half().float(), v_f)
    else:  # exact P
        o = torch.matmul(p, v_f)
    return o / denom


def fav3_sage_emulated(q, k, v, *, scale=None, is_causal=False, block_m=128, block_n=64, pv="fp8"):
    """fav3_sage's numerics: INT8 per-block Q (×scale·log2 e) and smoothed K, exp2 softmax, e4m3 P×448 and
    e4m3 V with a per-channel scale (``pv="fp8"``), or fp16 P and V (``pv="fp16"``). Not chunked: small inputs."""
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    sq, sk = q.shape[2], k.shape[2]
    kf = k.float() - k.float().mean(dim=2, keepdim=True)
    q8, qs = quantize_int8_per_block(q, block_m, pre_scale=sm * LOG2E)
    k8, ks = quantize_int8_per_block(kf, block_n)
    s = torch.matmul(q8[:, :, :sq], k8[:, :, :sk].transpose(-1, -2))
    s = s * _rep(qs[..., 0], block_m, sq)[..., None] * _rep(ks[..., 0], block_n, sk)[:, :, None, :]
    if pv == "fp8":
        vc = v.float().abs().amax(dim=2) / FP8_MAX
        vc = torch.where(vc > 0, vc, torch.ones_like(vc))
        v8 = (v.float() / vc[:, :, None, :]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        o = _softmax_pv(s, v8, None, vc, "fp8", is_causal, sq, sk, q.device)
    else:
        o = _softmax_pv(s, v.half().float(), None, None, "fp16", is_causal, sq, sk, q.device)
    return o.to(q.dtype)


def fp8_triton_emulated(q, k, v, *, scale=None, is_causal=False, block_m=128, block_n=128, smooth_k=True,
                        pv="fp8"):
    """fp8_triton's numerics: e4m3 Q (×scale·log2 e), smoothed K and V, one scale per tile of tokens; e4m3 P×448.
    ``pv="exact"`` keeps P and V unrounded (to split the error between Q·K and P·V)."""
    sm = q.shape[-1] ** -0.5 if scale is None else scale
    sq, sk = q.shape[2], k.shape[2]
    kf = k.float() - k.float().mean(dim=2, keepdim=True) if smooth_k else k.float()
    q8, qs = quantize_fp8_per_block(q, block_m, pre_scale=sm * LOG2E)
    k8, ks = quantize_fp8_per_block(kf, block_n)
    s = torch.matmul(q8, k8.transpose(-1, -2)) * _rep(qs, block_m, sq)[..., None] * _rep(ks, block_n, sk)[:, :, None, :]
    if pv == "fp8":
        v8, vs = quantize_fp8_per_block(v, block_n)
        o = _softmax_pv(s, v8, _rep(vs, block_n, sk), None, "fp8", is_causal, sq, sk, q.device)
    else:
        o = _softmax_pv(s, v.float(), None, None, "exact", is_causal, sq, sk, q.device)
    return o.to(q.dtype)
