"""Compile the attention kernels for a GPU target without a GPU (Triton's ahead-of-time path): CI's check that
they still build to real GPU code (e.g. wgmma on sm_90), not only run under the interpreter.

    python -m vdbench.kernels.aot --target cuda:90 [--d 128 64] [--causal]
    python -m vdbench.kernels.aot --target hip:gfx950
    python -m vdbench.kernels.aot --target cuda:90 --helpers   # fav3_fp8's pre-pass, the zero-V-channel guard

Prints one line per kernel variant (OK with the MMA instruction count, or ERR with the error) and exits 1 if
any failed. Must run WITHOUT TRITON_INTERPRET (an interpreted function cannot be compiled).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

VARIANTS = {  # name -> (Q/K/V/Out element types, QK_MODE, PV_MODE, config key)
    "fav2_triton[bf16]": (("bf16", "bf16", "bf16", "bf16"), 0, 0, "fav2_triton"),
    "fav2_triton[fp16]": (("fp16", "fp16", "fp16", "fp16"), 0, 0, "fav2_triton"),
    "fav3_sage": (("i8", "i8", "fp8e4nv", "bf16"), 1, 2, "fav3_sage"),
    "fav3_sage[pv=fp16]": (("i8", "i8", "bf16", "bf16"), 1, 1, "fav3_sage"),
    "fp8_triton": (("fp8e4nv", "fp8e4nv", "fp8e4nv", "bf16"), 2, 3, "fp8_triton"),
}
_ORDER = (["Q", "K", "V", "QS", "KS", "VS", "Out", "sq_len", "sk_len", "H", "nq_blk", "nk_blk"]
          + [f"s{t}{x}" for t in "qkvo" for x in "bhsd"] + ["qk_scale", "causal_shift"])


def compile_variant(name: str, d: int, target, causal: bool = False, config: dict | None = None):
    import triton
    from triton.compiler import ASTSource

    from vdbench.kernels import attention as A

    if A.INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET is set: cannot compile ahead of time")
    (qt, kt, vt, ot), qkm, pvm, key = VARIANTS[name]
    cfg = dict(A.CONFIGS[(key, d)], **(config or {}))
    tma = bool(cfg.get("TMA", 0))
    types = {"Q": qt, "K": kt, "V": vt, "Out": ot}
    names = list(inspect.signature(A._attn_fwd.fn).parameters)
    sig = {}
    for n, o in zip(names, _ORDER):
        sig[n] = ("*" + types[o]) if o in types else ("*fp32" if o in ("QS", "KS", "VS") else
                                                       ("fp32" if o == "qk_scale" else "i32"))
    consts = dict(D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], QK_MODE=qkm, PV_MODE=pvm, IS_CAUSAL=causal,
                  P_SC=A.P_SCALE, UPCAST_DOT=False, FIX_FP8=False,
                  TMA_QK=tma, TMA_V=tma, PV_ACC=bool(cfg.get("PV_ACC", 0)) and pvm >= 2,
                  FOLD=bool(cfg.get("FOLD", 0)),
                  P_SHIFT=A.P_SHIFT if cfg.get("FOLD", 0) and pvm >= 2 else 0.0)
    for c in consts:
        sig[c] = "constexpr"
    src = ASTSource(fn=A._attn_fwd, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=target, options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def _helper_kernels():
    """name -> (jit function, pointer types, constexprs): the backends' helper kernels (fa3_prepass, channels)."""
    from vdbench.kernels import channels as C
    from vdbench.kernels import fa3_prepass as P

    red = {"X": "*bf16", "Amax": "*fp32", "CMax": "*fp32", "CMin": "*fp32"}
    quant = {"X": "*bf16", "Out": "*fp8e4nv", "Descale": "*fp32", "Mean": "*fp32"}
    qkv = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "QO": "*fp8e4nv", "KO": "*fp8e4nv", "VO": "*fp8e4nv",
           "Amax": "*fp32", "Descale": "*fp32"}
    return {
        "fa3_prepass.reduce": (P._reduce_kernel, red, dict(BLK=P.CHUNK, BD=128, CHANNEL=False)),
        "fa3_prepass.reduce[channel]": (P._reduce_kernel, red, dict(BLK=P.CHUNK, BD=128, CHANNEL=True)),
        "fa3_prepass.quant": (P._quant_kernel, quant, dict(BLK=P.CHUNK, BD=128, HAS_MEAN=False, FIX=False)),
        "fa3_prepass.quant[mean]": (P._quant_kernel, quant, dict(BLK=P.CHUNK, BD=128, HAS_MEAN=True, FIX=False)),
        "fa3_prepass.qkv_amax": (P._qkv_amax_kernel, qkv, dict(BLK=P.CHUNK, BD=128)),
        "fa3_prepass.qkv_quant": (P._qkv_quant_kernel, qkv, dict(BLK=P.CHUNK, BD=128, FIX=False)),
        "channels.zero": (C._zero_kernel, {"Out": "*bf16", "Flags": "*u8"}, dict(BLK=C.CHUNK, BD=128)),
    }


def compile_helper(name: str, target):
    """Compile one of ``_helper_kernels()`` for ``target`` (every other argument a 32-bit int)."""
    import triton
    from triton.compiler import ASTSource

    fn, types, consts = _helper_kernels()[name]
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=target, options=dict(num_warps=8 if name.startswith("fa3_prepass") else 4))


def resource_usage(kernel) -> str:
    """Registers / spill bytes of the compiled cubin (cuobjdump bundled with Triton), '' when unavailable."""
    import os as _os
    import re
    import subprocess
    import tempfile

    import triton

    cubin = kernel.asm.get("cubin")
    tool = _os.path.join(_os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not _os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", res)
    return f"regs={m.group(1)} stack={m.group(2)} local={m.group(3)}" if m else ""


def mma_count(kernel) -> str:
    asm = kernel.asm
    if "ptx" in asm:
        return f"wgmma={asm['ptx'].count('wgmma.mma_async')} mma.sync={asm['ptx'].count('mma.sync')}"
    text = asm.get("amdgcn", "")
    return f"mfma={text.count('v_mfma')}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cuda:90", help="cuda:<sm> (e.g. cuda:90) or hip:<gfx> (e.g. hip:gfx950)")
    p.add_argument("--d", type=int, nargs="+", default=[128, 64])
    p.add_argument("--kernels", nargs="+", default=list(VARIANTS))
    p.add_argument("--causal", action="store_true", help="also the causal variants")
    p.add_argument("--helpers", action="store_true",
                   help="compile the backends' helper kernels (fav3_fp8's pre-pass, the zero-V guard) instead")
    p.add_argument("--sweep", action="store_true",
                   help="compile every config of attention.SWEEP (what the kernels suite's sweep runs) instead")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: unset TRITON_INTERPRET to compile ahead of time", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget

    backend, arch = args.target.split(":")
    target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)
    tag = f"(triton {triton.__version__}, {args.target})"

    def attempt(label: str, make, describe) -> int:
        """Compile one kernel and print OK with ``describe(kernel)`` or ERR with the error; 1 if it failed."""
        t0 = time.time()
        try:
            k = make()
        except Exception as e:  # report and go on
            print(f"ERR {label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
            return 1
        print(f"OK  {label}  {describe(k)}  {resource_usage(k)}  {time.time() - t0:.1f}s  {tag}", flush=True)
        return 0

    def attn(k) -> str:
        return f"{mma_count(k)}  shared={k.metadata.shared}"

    bad = 0
    if args.helpers:
        for name in _helper_kernels():
            bad += attempt(f"{name:28s}", lambda name=name: compile_helper(name, target),
                           lambda k: f"{len(k.asm.get('ptx', k.asm.get('amdgcn', '')))} chars of code")
        return 1 if bad else 0
    if args.sweep:
        from vdbench.kernels import attention as A

        for d in args.d:
            for kname, cfgs in A.SWEEP[d].items():
                for cfg in cfgs:
                    name = {"fav2_triton": "fav2_triton[bf16]"}.get(kname, kname)
                    bad += attempt(f"{name:20s} D{d} {A.config_label(cfg)}",
                                   lambda name=name, d=d, cfg=cfg: compile_variant(name, d, target, False, cfg), attn)
        return 1 if bad else 0
    for d in args.d:
        for name in args.kernels:
            for causal in (False, True) if args.causal else (False,):
                bad += attempt(f"{name:20s} D{d} causal={causal}",
                               lambda name=name, d=d, causal=causal: compile_variant(name, d, target, causal), attn)
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
