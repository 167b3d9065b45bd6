"""Stand-ins for the GPU-only kernel packages, so the code around them runs on a CPU: a ``sageattention`` 2.x whose
functions compute ``sage2_reference`` below (recording every call), a 1.x one (``sageattn`` only), and an FA3 module
(``fa3_fwd_interface``) computing exact attention on the dequantized e4m3 operands.

Why a reference of its own and not vdbench's emulation: the code under test compares kernel outputs with
vdbench's emulations and with exact attention; a stand-in built from the emulation would agree with it whatever the
emulation computes. ``sage2_reference`` is written here from SageAttention 2's published algorithm and upstream's
Python wrappers and launch constants alone (K's mean over tokens subtracted in the dtypes upstream uses; INT8 Q and
K per scale group; an exact float64 softmax whose P is rounded, block by block, against the running max; P and V
rounded to e4m3 with V scaled per channel, or both to fp16; P·V in float64), so a test comparing an emulation with
the stand-in catches the emulation drifting. What the reference leaves out -- the accumulators' rounding, the
kernels' exact rounding rules -- bounds how far the two may differ (``twin_bound``). A recorded call list shows what
the wrappers passed (granularity, accumulation, layout).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import torch

# Scale groups of each SageAttention 2 kernel (rows of Q, rows of K sharing one INT8 scale), from the kernels'
# launch constants upstream (WARP_Q / CTA_K of qattn_sm90, qattn_sm89, qattn_sm80; BLKQ / BLKK of the Triton
# kernel). per_thread splits a Q group 8 ways (row mod 8) and a K group 4 ways ((row mod 8) div 2): the rows one
# thread of the MMA fragment holds.
SAGE2_GROUPS = {"sm90": (16, 128), "sm89": (32, 64), "sm80": (32, 64), "triton": (128, 64)}
E4M3_MAX = 448.0
# V's e4m3 range for the sm89 kernel with pv_accum_dtype "fp32+fp16" (its default): core.py quantizes V per channel
# to 2.25 instead of 448 there, so that P (up to 448) times V summed over a 64-key block fits the fp16 MMA accumulator
# (448 * 2.25 * 64 < 65504) before it is flushed into the fp32 buffer. The grid V is rounded to moves with it.
V_MAX_FP16_ACCUM = 2.25


def twin_bound(pv: str, dtype: torch.dtype) -> float:
    """How far vdbench's emulation of a SageAttention 2 kernel may be from the stand-in (``sage2_reference``), as a
    fraction of the kernel's rel L2 vs exact attention.

    Both follow the same algorithm; the reference leaves out the kernels' exact rounding rules (the quantizers' INT8
    ties and their 1e-7 on the scale, exp2 in fp32, 2^8.807 for 448) and the accumulators' rounding. An e4m3
    rounding those flip moves a P by a whole step (1/8 of a binade), so fp8 P·V differs more than fp16 P·V; bf16
    inputs add the output's own rounding (~1e-3, a tenth of the fp16 P·V error) and the flips it causes. Measured at
    s=150, d=64 (128) with a K bias, and at the benches' dry-run shapes: fp32 inputs <= 0.05 (fp16 P·V) and <= 0.14
    (fp8); bf16 inputs <= 0.21 and <= 0.28. An emulation that gets one step wrong -- K smoothing, V's range, the
    sm90 kernel's scale groups and blocks for the sm89 one's -- lands at 0.7 to 1.2 (tests/test_sage2_reference.py).
    """
    if dtype == torch.float32:
        return 0.25 if pv == "fp8" else 0.1
    return 0.4 if pv == "fp8" else 0.3


def _group_ids(n: int, gran: str, rows: int, which: str) -> torch.Tensor:
    r = torch.arange(n)
    if gran in ("per_warp", "per_block"):
        return r // rows
    return (r // rows) * 8 + r % 8 if which == "q" else (r // rows) * 4 + (r % 8) // 2


def _int8_dequantized(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D) float64 rounded to INT8 with one scale (amax / 127) per group of rows, and scaled back."""
    out = torch.empty_like(x)
    for g in ids.unique():
        rows = ids == g
        xs = x[:, :, rows]
        scale = xs.abs().amax(dim=(-1, -2), keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out[:, :, rows] = torch.round(xs / scale).clamp(-127, 127) * scale
    return out


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.float8_e4m3fn).double()


def sage2_reference(q, k, v, *, scale=None, is_causal=False, gran="per_thread", pv="fp8", groups="sm90",
                    pv_accum=None, return_lse=False):
    """SageAttention 2 on (B, H, S, D) tensors, from the paper's algorithm, in float64: K smoothed by its mean over
    tokens (rounded as upstream's Python rounds it), Q and K rounded to INT8 per scale group of ``groups``' kernel,
    S = Q·Kᵀ·scale exact, softmax exact; then P (times 448 against the running max of its block of keys) and V (per
    channel, to 448; to 2.25 for sm89's pv_accum="fp32+fp16", whose fp16 accumulator's own rounding is left out)
    rounded to e4m3 for pv="fp8", or both to fp16 for pv="fp16", the product and the normalisation in float64. A V
    channel that is 0 everywhere has scale 0 and gives NaN (0·inf), as the fp8 kernels do. return_lse: also the
    natural-log LSE of the unsmoothed scores, fp32. is_causal: top-left aligned (query i sees keys j <= i)."""
    dim = q.shape[-1]
    scale = dim ** -0.5 if scale is None else float(scale)
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (k, v))
    qd, vd = q.double(), v.double()
    # K smoothing as upstream's Python does it: core.py takes the mean in the input dtype; the Triton quantizers
    # (per_thread, per_block) get K - mean from a torch subtraction in that dtype, per_warp's CUDA quantizer
    # subtracts inside its kernel in fp32. In bf16 those roundings move K - mean by ~2^-9 of |K|: enough to flip
    # INT8 roundings, so the reference must round where upstream does to stay close to a faithful emulation.
    k_mean_in = k.mean(dim=2, keepdim=True)
    k_smooth = k.double() - k_mean_in.double() if gran == "per_warp" else (k - k_mean_in).double()
    gq, gk = SAGE2_GROUPS["triton" if gran == "per_block" else groups]
    if groups == "sm80" and pv_accum == "fp16+fp32" and dim > 64:
        gq = 16  # core.py launches the sm80 kernel with 16-row warps there (head dim padded to 128)
    qi = _int8_dequantized(qd, _group_ids(q.shape[2], gran, gq, "q"))
    ki = _int8_dequantized(k_smooth, _group_ids(k.shape[2], gran, gk, "k"))
    s = qi @ ki.transpose(-1, -2) * scale
    if is_causal:
        seen = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None]
        s = s.masked_fill(~seen, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    # the online softmax: keys go in blocks of CTA_K (the K group size), and each block's P is rounded relative to
    # the running max so far -- below the row max for blocks before the row's largest score, which moves P's rounding
    # grid (an e4m3 step is 1/8 of a binade: the largest single difference from rounding against the row max)
    n, blk = k.shape[2], gk
    block_max = torch.stack([s[..., j:j + blk].amax(dim=-1) for j in range(0, n, blk)], dim=-1)
    running = torch.cummax(block_max, dim=-1).values.repeat_interleave(blk, dim=-1)[..., :n]
    lift = torch.exp(m - running)  # P relative to the running max is p * lift (>= 1)
    if pv == "fp8":
        amax = vd.abs().amax(dim=2, keepdim=True)
        v_max = V_MAX_FP16_ACCUM if pv_accum == "fp32+fp16" else E4M3_MAX
        v_rounded = _e4m3(vd * (v_max / amax)) * (amax / v_max)
        p_rounded = _e4m3(p * lift * E4M3_MAX) / (lift * E4M3_MAX)
    else:
        v_rounded, p_rounded = vd.half().double(), (p * lift).half().double() / lift
    out = (p_rounded @ v_rounded / p.sum(dim=-1, keepdim=True)).to(q.dtype)
    if not return_lse:
        return out
    # the correction for the smoothing, q·mean(K), is a matmul in the input dtype in core.py (its rounding, ~2^-9 of
    # |q·mean(K)| in bf16, is most of the LSE's difference from fp64 when K has a large mean)
    lse = torch.logsumexp(s, dim=-1) + (q @ k_mean_in.transpose(-1, -2)).double().squeeze(-1) * scale
    return out, lse.float()


SAGE2_CORE = '''
"""A stand-in for sageattention 2 on CPU: each function computes the tests' independent reference of its kernel."""
from tests.fake_packages import sage2_reference

CALLS = []  # (function, options) of every call
SM80_ENABLED = SM89_ENABLED = SM90_ENABLED = True


def _kernel(name, pv, groups, accum=None, gran=None):
    """The reference of one kernel, with its signature's defaults; ``gran`` fixed: the Triton kernel (no options)."""
    def fn(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread", sm_scale=None,
           pv_accum_dtype=accum, smooth_k=True, return_lse=False, **kwargs):
        opts = dict(tensor_layout=tensor_layout, return_lse=return_lse)
        if gran is None:
            opts.update(qk_quant_gran=qk_quant_gran, pv_accum_dtype=pv_accum_dtype)
        CALLS.append((name, opts))
        nhd = tensor_layout == "NHD"  # (B, S, H, D): upstream allocates its output in that layout too
        if nhd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        res = sage2_reference(q, k, v, scale=sm_scale, is_causal=is_causal, gran=gran or qk_quant_gran, pv=pv,
                              groups=groups, pv_accum=pv_accum_dtype, return_lse=return_lse)
        if not nhd:
            return res
        o = (res[0] if return_lse else res).transpose(1, 2).contiguous()
        return (o, res[1]) if return_lse else o

    fn.__name__ = name
    return fn


sageattn_qk_int8_pv_fp8_cuda_sm90 = _kernel("sageattn_qk_int8_pv_fp8_cuda_sm90", "fp8", "sm90", "fp32+fp32")
sageattn_qk_int8_pv_fp8_cuda = _kernel("sageattn_qk_int8_pv_fp8_cuda", "fp8", "sm89", "fp32+fp16")
sageattn_qk_int8_pv_fp16_cuda = _kernel("sageattn_qk_int8_pv_fp16_cuda", "fp16", "sm80", "fp32")
sageattn_qk_int8_pv_fp16_triton = _kernel("sageattn_qk_int8_pv_fp16_triton", "fp16", "triton", gran="per_block")


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
    CALLS.append(("sageattn", dict(tensor_layout=tensor_layout, return_lse=return_lse)))
    return sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                             sm_scale=sm_scale, return_lse=return_lse, pv_accum_dtype="fp32+fp32")
'''

SAGE1_INIT = '''
"""A stand-in for sageattention 1.x: sageattn only -- SageAttention 1's algorithm (INT8 Q per 128 rows and K per 64
after smoothing K, fp16 P·V) is the reference's per_block / fp16 case."""
from tests.fake_packages import sage2_reference


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    return sage2_reference(q, k, v, scale=sm_scale, is_causal=is_causal, gran="per_block", pv="fp16")
'''

FA3 = '''
"""A stand-in for FA3 (fa3_fwd_interface) on CPU: exact fp64 attention on the dequantized operands, BSHD."""
import torch

from vdbench.numerics import exact_attention

CALLS = []


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                    return_attn_probs=False, **kwargs):
    CALLS.append(dict(dtype=str(q.dtype), descales=q_descale is not None, lse=return_attn_probs))

    def deq(x, d):
        x = x.float().transpose(1, 2)  # BSHD -> BHSD
        return x if d is None else x * d[:, :, None, None]

    o, lse = exact_attention(deq(q, q_descale), deq(k, k_descale), deq(v, v_descale), scale=softmax_scale,
                             is_causal=causal, return_lse=True)
    out = o.to(torch.bfloat16).transpose(1, 2)
    return (out, lse.float()) if return_attn_probs else out
'''


def install(tmp_path: Path, monkeypatch, package: str, files: dict[str, str]) -> None:
    """Put a package ``package`` made of ``files`` (name -> source) first on sys.path for this test, dropping any
    copy of it already imported."""
    root = tmp_path / f"fake_{package}"
    if len(files) == 1 and "__init__.py" not in files:  # a single module
        root.mkdir(parents=True, exist_ok=True)
        (name, src), = files.items()
        (root / name).write_text(textwrap.dedent(src))
    else:
        pkg = root / package
        pkg.mkdir(parents=True, exist_ok=True)
        for name, src in files.items():  # a name may hold a folder (a namespace package's subpackage)
            (pkg / name).parent.mkdir(parents=True, exist_ok=True)
            (pkg / name).write_text(textwrap.dedent(src))
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] == package]:
        monkeypatch.delitem(sys.modules, name)


def install_sage2(tmp_path: Path, monkeypatch, core: str = SAGE2_CORE, omit: tuple[str, ...] = ()) -> None:
    """A fake sageattention 2.x whose ``__init__`` exports every function of ``core`` but those in ``omit``."""
    names = ["sageattn", "sageattn_qk_int8_pv_fp8_cuda_sm90", "sageattn_qk_int8_pv_fp8_cuda",
             "sageattn_qk_int8_pv_fp16_cuda", "sageattn_qk_int8_pv_fp16_triton"]
    init = "from .core import " + ", ".join(n for n in names if n not in omit) + "\n"
    install(tmp_path, monkeypatch, "sageattention", {"core.py": core, "__init__.py": init})


def install_sage1(tmp_path: Path, monkeypatch) -> None:
    install(tmp_path, monkeypatch, "sageattention", {"__init__.py": SAGE1_INIT})


def install_fa3(tmp_path: Path, monkeypatch) -> None:
    install(tmp_path, monkeypatch, "fa3_fwd_interface", {"fa3_fwd_interface.py": FA3})


def forget(package: str) -> None:
    """Drop a fake package's modules after a test (monkeypatch restores the entries it replaced, not new ones)."""
    for name in [m for m in sys.modules if m.split(".")[0] == package]:
        del sys.modules[name]


# ----------------------------------------------------------------------------------------------------------
# FlashAttention-4, FlashInfer, NATTEN: stand-ins with each package's API and layout, computing exact attention in
# float64 with torch's own sdpa (never vdbench's code), so a layout or argument slip in a wrapper shows as an error
# ----------------------------------------------------------------------------------------------------------

def exact64(q, k, v, scale=None, is_causal=False, mask=None):
    """(out, natural-log LSE) of exact attention on (..., S, D) tensors in float64, from torch's sdpa and logsumexp.
    ``is_causal``: bottom-right aligned (query i sees keys up to sk - sq + i), the packages' convention."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sq, sk = q.shape[-2], k.shape[-2]
    if is_causal:
        causal = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        mask = causal if mask is None else mask & causal
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(s, dim=-1)


FA4_INTERFACE = '''
"""A stand-in for flash_attn.cute.interface (flash-attn-4): flash_attn_func on BSHD, (out, lse) as 4.0.0b36 returns."""
from tests.fake_packages import exact64

CALLS = []


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), return_lse=False, **kwargs):
    CALLS.append(dict(shapes=[tuple(t.shape) for t in (q, k, v)], softmax_scale=softmax_scale, causal=causal,
                      return_lse=return_lse))
    o, lse = exact64(*(t.transpose(1, 2) for t in (q, k, v)), scale=softmax_scale, is_causal=causal)
    return o.transpose(1, 2).to(q.dtype), (lse.float() if return_lse else None)
'''

FA4_INIT = "from .interface import flash_attn_func\n"

FLASHINFER = '''
"""A stand-in for flashinfer: single_prefill_with_kv_cache on ONE request, q NHD, k / v NHD or HND, base-2 LSE."""
import math

from tests.fake_packages import exact64

CALLS = []


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                                 use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
                                 rope_scale=None, rope_theta=None, backend="auto", return_lse=False, **kwargs):
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "one request: 3-D tensors"
    CALLS.append(dict(shapes=[tuple(t.shape) for t in (q, k, v)], kv_layout=kv_layout, causal=causal,
                      sm_scale=sm_scale, return_lse=return_lse, backend=backend,
                      contiguous=[t.is_contiguous() for t in (q, k, v)], ptrs=[t.data_ptr() for t in (q, k, v)]))
    if kv_layout == "NHD":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    o, lse = exact64(q.transpose(0, 1), k, v, scale=sm_scale, is_causal=causal)  # (H, S, D)
    o = o.transpose(0, 1).to(q.dtype)
    return (o, (lse / math.log(2.0)).transpose(0, 1).float()) if return_lse else o
'''

NATTEN = '''
"""A stand-in for natten: na3d (heads-last (B, X, Y, Z, heads, D), NATTEN's window rule, additional keys) and
attention ((B, S, heads, D)), exact in float64."""
import torch

from tests.fake_packages import exact64

CALLS = []


def _starts(n, k):
    # NATTEN's neighborhood of position i on an axis of n: k tokens starting at i - k // 2, shifted inside the axis
    i = torch.arange(n)
    return (i - k // 2).clamp(min=0).clamp(max=n - k)


def na3d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None, additional_keys=None,
         additional_values=None, backend=None, return_lse=False, **kwargs):
    b, x, y, z, h, d = query.shape
    ks = (kernel_size,) * 3 if isinstance(kernel_size, int) else tuple(kernel_size)
    assert all(2 <= kk <= n for kk, n in zip(ks, (x, y, z))), (ks, (x, y, z))
    CALLS.append(dict(fn="na3d", shape=tuple(query.shape), kernel_size=ks, scale=scale,
                      additional=None if additional_keys is None else tuple(additional_keys.shape)))
    coords = torch.stack(torch.meshgrid(torch.arange(x), torch.arange(y), torch.arange(z), indexing="ij"), -1)
    coords = coords.reshape(-1, 3)
    allowed = torch.ones(len(coords), len(coords), dtype=torch.bool)
    for axis, (n, kk) in enumerate(zip((x, y, z), ks)):
        start = _starts(n, kk)[coords[:, axis]]
        key_pos = coords[:, axis]
        allowed &= (key_pos[None, :] >= start[:, None]) & (key_pos[None, :] < start[:, None] + kk)
    flat = lambda t: t.reshape(b, x * y * z, t.shape[-2], t.shape[-1]).transpose(1, 2)  # -> (B, H, N, D)
    q, k, v = flat(query), flat(key), flat(value)
    if additional_keys is not None:
        k = torch.cat([k, additional_keys.transpose(1, 2)], dim=2)
        v = torch.cat([v, additional_values.transpose(1, 2)], dim=2)
        allowed = torch.cat([allowed, torch.ones(len(coords), additional_keys.shape[1], dtype=torch.bool)], dim=1)
    o, _ = exact64(q, k, v, scale=scale, mask=allowed)
    return o.transpose(1, 2).reshape(b, x, y, z, h, value.shape[-1]).to(query.dtype)


def attention(query, key, value, is_causal=False, scale=None, return_lse=False, **kwargs):
    CALLS.append(dict(fn="attention", shapes=[tuple(t.shape) for t in (query, key, value)], scale=scale))
    o, _ = exact64(*(t.transpose(1, 2) for t in (query, key, value)), scale=scale, is_causal=is_causal)
    return o.transpose(1, 2).to(query.dtype)
'''


def install_fa4(tmp_path: Path, monkeypatch, *, with_fa2: bool = False) -> None:
    """flash-attn-4's layout: ``flash_attn`` a namespace package holding ``cute``. ``with_fa2``: a FlashAttention-2
    ``flash_attn/__init__.py`` beside it whose import fails (its CUDA extension missing), as where both are installed
    on a machine without FA2's extension -- what an availability check must not import."""
    files = {"cute/__init__.py": FA4_INIT, "cute/interface.py": FA4_INTERFACE}
    if with_fa2:
        files["__init__.py"] = "raise ImportError('flash_attn_2_cuda: cannot open shared object file')\n"
    install(tmp_path, monkeypatch, "flash_attn", files)


def install_flashinfer(tmp_path: Path, monkeypatch) -> None:
    install(tmp_path, monkeypatch, "flashinfer", {"__init__.py": FLASHINFER})


def install_natten(tmp_path: Path, monkeypatch) -> None:
    install(tmp_path, monkeypatch, "natten", {"__init__.py": NATTEN})
