"""Stand-ins for the GPU-only kernel packages, so the code around them runs on a CPU: a ``sageattention`` 2.x whose
functions are vdbench's own emulation of each kernel (recording every call), a 1.x one (``sageattn`` only), and an
FA3 module (``fa3_fwd_interface``) computing exact attention on the dequantized e4m3 operands.

Why emulations and not mocks: the code under test (the sagev2 backends, the benches) compares kernel outputs with
emulations and exact attention; a stand-in that returns what the real kernel's numerics give keeps those checks
meaningful, and a recorded call list shows what the wrappers passed (granularity, accumulation, layout).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

SAGE2_CORE = '''
"""A stand-in for sageattention 2 on CPU: each function is vdbench's emulation of the named kernel."""
from vdbench.numerics import sagev2_emulated

CALLS = []  # (function, options) of every call
SM80_ENABLED = SM89_ENABLED = SM90_ENABLED = True


def _kernel(name, pv, arch=None, accum=None, gran=None):
    """The emulation of one kernel, with its signature's defaults; ``gran`` fixed: the Triton kernel (no options)."""
    def fn(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread", sm_scale=None,
           pv_accum_dtype=accum, smooth_k=True, return_lse=False, **kwargs):
        opts = dict(tensor_layout=tensor_layout, return_lse=return_lse)
        if gran is None:
            opts.update(qk_quant_gran=qk_quant_gran, pv_accum_dtype=pv_accum_dtype)
        CALLS.append((name, opts))
        nhd = tensor_layout == "NHD"  # (B, S, H, D): upstream allocates its output in that layout too
        if nhd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        res = sagev2_emulated(q, k, v, scale=sm_scale, is_causal=is_causal, qk_gran=gran or qk_quant_gran, pv=pv,
                              arch=arch, pv_accum=pv_accum_dtype, smooth_k=smooth_k, return_lse=return_lse)
        if not nhd:
            return res
        o = (res[0] if return_lse else res).transpose(1, 2).contiguous()
        return (o, res[1]) if return_lse else o

    fn.__name__ = name
    return fn


sageattn_qk_int8_pv_fp8_cuda_sm90 = _kernel("sageattn_qk_int8_pv_fp8_cuda_sm90", "fp8", "sm90", "fp32+fp32")
sageattn_qk_int8_pv_fp8_cuda = _kernel("sageattn_qk_int8_pv_fp8_cuda", "fp8", "sm89", "fp32+fp16")
sageattn_qk_int8_pv_fp16_cuda = _kernel("sageattn_qk_int8_pv_fp16_cuda", "fp16", None, "fp32")
sageattn_qk_int8_pv_fp16_triton = _kernel("sageattn_qk_int8_pv_fp16_triton", "fp16", gran="per_block")


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
    CALLS.append(("sageattn", dict(tensor_layout=tensor_layout, return_lse=return_lse)))
    return sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                             sm_scale=sm_scale, return_lse=return_lse, pv_accum_dtype="fp32+fp32")
'''

SAGE1_INIT = '''
"""A stand-in for sageattention 1.x: sageattn only (smoothing K in place, as 1.0.6 does)."""
from vdbench.numerics import sagev1_emulated


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    return sagev1_emulated(q, k, v, scale=sm_scale, is_causal=is_causal)
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
        for name, src in files.items():
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
