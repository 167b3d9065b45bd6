"""Compile the attention kernels for a GPU target without a GPU (Triton's ahead-of-time path): CI's check that
they still build to real GPU code (e.g. wgmma on sm_90), not only run under the interpreter.

    python -m vdbench.kernels.aot --target cuda:90 [--d 128 64] [--causal]
    python -m vdbench.kernels.aot --target hip:gfx950
    python -m vdbench.kernels.aot --target cuda:90 --helpers   # fav3_fp8's pre-pass, the zero-V-channel guard

Prints one line per kernel variant (OK with the MMA instruction count, or ERR with the error) and exits 1 if
any failed. Must run WITHOUT TRITON_INTERPRET (an interpreted function cannot be compiled).

What is compiled is not listed here: every module of a kernel registered in ``vdbench.kernels.KERNELS`` that
defines ``aot_specs(d, causal, config)`` (label -> jit function, argument types, constexprs, compile options)
is compiled -- the modules holding attention backends by default, the ones holding only helpers with --helpers.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time


def _modules(helpers: bool, only=None) -> list:
    """The registered kernels' modules (``vdbench.kernels.KERNELS``, in order, each once) that define
    ``aot_specs``: those holding attention backends, or with ``helpers`` those holding only helpers of backends;
    ``only``: the modules of these kernel names alone. Imports them (without TRITON_INTERPRET: compiled mode)."""
    import importlib

    from vdbench import kernels

    mods = []
    for name in (only or kernels.names()):
        k = kernels.KERNELS[name]
        holds_backend = any(o.backend for o in kernels.KERNELS.values() if o.module == k.module)
        if k.module not in mods and (only is not None or holds_backend != helpers):
            mods.append(k.module)
    loaded = [importlib.import_module(m) for m in mods]
    return [m for m in loaded if hasattr(m, "aot_specs")]


def specs(helpers: bool = False, d: int = 128, causal: bool = False, config: dict | None = None, only=None) -> dict:
    """label -> (jit function, argument types by name (others: i32), constexprs by name, compile options): every
    specialization the kernels' modules ask to be compiled (their ``aot_specs(d, causal, config)``)."""
    out = {}
    for mod in _modules(helpers, only):
        if mod.INTERPRETED:
            raise RuntimeError("TRITON_INTERPRET is set: cannot compile ahead of time")
        out.update(mod.aot_specs(d, causal, config))
    return out


def compile_spec(spec, target):
    """Compile one of ``specs()``'s entries for ``target``."""
    import triton
    from triton.compiler import ASTSource

    fn, types, consts, options = spec
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=target, options=options)


def compile_variant(name: str, d: int, target, causal: bool = False, config: dict | None = None):
    """Compile the attention specialization ``name`` (a label of ``specs()``) at head dim ``d``."""
    return compile_spec(specs(False, d, causal, config)[name], target)


def compile_helper(name: str, target):
    """Compile one of the helpers' specializations (``specs(helpers=True)``) for ``target``."""
    return compile_spec(specs(True)[name], target)


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
    p.add_argument("--kernels", nargs="+", default=None,
                   help="labels of the attention specializations to compile (default: every one the kernels' "
                        "modules list)")
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
        for name in specs(True):
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
    labels = args.kernels or list(specs(False))
    for d in args.d:
        for name in labels:
            for causal in (False, True) if args.causal else (False,):
                bad += attempt(f"{name:20s} D{d} causal={causal}",
                               lambda name=name, d=d, causal=causal: compile_variant(name, d, target, causal), attn)
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
