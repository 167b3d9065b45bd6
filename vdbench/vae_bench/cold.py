"""What a VAE decode's first call in a fresh process costs, and where: one variant per fresh process, Triton and
inductor caches emptied (new temporary folders), the first call timed apart from the warm calls, its host time
split into convolutions (cuDNN's per-shape plans), the Triton glue launches (their JIT compiles) and the rest.

Variants (``--variants``, comma-separated):
  bf16              diffusers' own decode (``mode="default"``), the VAE in bf16
  fast              the fast decode, nothing ahead of it: what a standalone first call pays
  prewarm           the fast decode after vdbench.vae.prewarm's thread has finished (a render: it runs while the GPU
                    denoises): the glue compiled for the GPU from a decode on the meta device
  prewarm+main      prewarm, then two latent frames decoded at the real size on the calling thread (what is left
                    of the first call is then not per-shape work)
  prewarm+reserve   prewarm, then the caching allocator grown by one block of the warm decode's peak, freed (is
                    what is left the first call's cudaMalloc calls?)
  prewarm+tiny      prewarm, then a decode of a tiny latent (2 frames, 8x8) on another thread (is it the process's
                    first use of cuDNN's kernels, whatever the shapes?)
  prewarm+side      prewarm, then two latent frames decoded at the real size on another thread (per-thread state,
                    cuDNN's plans, or process-wide?)

    python3 bench/cold_decode.py --model wan2.1 --size 1280*720 --frames 81 -o cold_720.json
    python3 bench/cold_decode.py --model wan2.1 --size 832*480 --variants fast,prewarm --repeats 2

Prints one row per process; the JSON holds every row (seconds; n of warm calls; host-time breakdown; the glue
variants compiled during the first call; the prewarm's record; ``glue_trace``: on a GPU, the launch forms -- dtype,
shape, strides, alignment, ints, constexprs: what Triton specializes on -- that compiled a variant in each phase, and
those the first call made that the prewarm's meta-device decode did not). CPU runs are not speed figures (said per row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("bf16", "fast", "prewarm", "prewarm+main", "prewarm+reserve", "prewarm+tiny", "prewarm+side")


def _launch_spec(kernel, args, kw) -> str:
    """What Triton specializes a launch on, in words: per tensor dtype, shape, strides and 16-byte alignment; per
    int its value; the constexprs."""
    def one(a):
        if hasattr(a, "data_ptr") and hasattr(a, "stride"):
            return f"{str(a.dtype)[6:]}{list(a.shape)}@{list(a.stride())}{'' if a.data_ptr() % 16 == 0 else '!a16'}"
        return repr(a) if isinstance(a, (int, bool)) else type(a).__name__
    name = getattr(getattr(kernel, "fn", None), "__name__", None) or getattr(kernel, "__name__", str(kernel))
    return f"{name}({', '.join(one(a) for a in args)}; {', '.join(f'{k}={v}' for k, v in sorted(kw.items()))})"


def _prewarm_variant(args, variant: str, vae, z, row: dict, sync) -> None:
    """A ``prewarm*`` variant's work before the timed calls, its seconds into ``row``: vdbench.vae.prewarm's thread run
    to its end, then (by the variant) two latent frames decoded on the calling thread, the decode's peak reserved, or a
    small decode on a side thread."""
    import torch

    from ..vae import decode as D
    from ..vae import prewarm as W
    from ..vae.decode import DecodeOptions

    dev = z.device
    width, height = (int(x) for x in args.size.split("*"))
    t0 = time.perf_counter()
    p = W.plan(vae_class=type(vae).__name__, device=dev, decode_mode=D.check_decode("fast"),
               decode_options=DecodeOptions(), pixel_hw=(height, width),
               frames=(z.shape[2] - 1) * int(vae.config.scale_factor_temporal) + 1)
    row["prewarm"] = None if p is None else W.start_thread(
        lambda: W.meta_vae(type(vae), dict(vae.config)).to(vae.dtype), p).wait()
    row["prewarm_wall_s"] = time.perf_counter() - t0
    if variant == "prewarm+main":
        t0 = time.perf_counter()
        D.decode_video(vae, z[:, :, :2].clone(), mode="fast")
        sync()
        row["main_thread_warm_s"] = time.perf_counter() - t0
    elif variant == "prewarm+reserve" and dev.type == "cuda":
        t0 = time.perf_counter()
        peak = {"832*480": 3.4, "1280*720": 7.6}.get(args.size, 8.0)  # GiB: the warm fast decode's peak
        block = torch.empty(int(peak * 2**30), dtype=torch.uint8, device=dev)
        del block
        sync()
        row["reserve_s"] = time.perf_counter() - t0
    elif variant in ("prewarm+tiny", "prewarm+side"):
        import threading

        small = (z[:, :, :2, :8, :8] if variant == "prewarm+tiny" else z[:, :, :2]).clone()
        t0 = time.perf_counter()
        th = threading.Thread(target=lambda: (D.decode_video(vae, small, mode="fast"), sync()))
        th.start()
        th.join()
        row["side_thread_warm_s"] = time.perf_counter() - t0


def _child(args) -> dict:
    import torch
    import torch.nn.functional as F

    from .. import kernels as K
    from ..pipelines import build_vae
    from ..vae import decode as D
    from ..timing import cache_state, speed_verdict

    t_proc = time.perf_counter()
    caches = cache_state()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    width, height = (int(x) for x in args.size.split("*"))
    vae = build_vae(args.model, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                    tiny=args.tiny)
    s = int(vae.config.scale_factor_spatial)
    h, w, t = height // s, width // s, (args.frames - 1) // 4 + 1
    z = torch.randn((1, vae.config.z_dim, t, h, w), device=dev, dtype=vae.dtype,
                    generator=torch.Generator(dev).manual_seed(0))
    variant = args.child
    mode = "default" if variant == "bf16" else "fast"
    row = {"variant": variant, "model": args.model, "size": args.size, "frames": args.frames, "latent": list(z.shape),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "caches": caches["caches"]}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    trace = {"phase": "prewarm", "compiled_by": {"prewarm": [], "first": [], "warm": []}, "specs": {}}
    if mode == "fast" and dev.type == "cuda":  # which launches compiled a glue variant, in which phase
        from ..kernels import glue as _g

        launch = _g._launch

        def traced(kernel, grid, *a, **kw):
            before = K.compiled_variants("vae_glue")
            launch(kernel, grid, *a, **kw)
            spec = _launch_spec(kernel, a, kw)
            trace["specs"].setdefault(trace["phase"], set()).add(spec)
            if K.compiled_variants("vae_glue") != before:
                trace["compiled_by"][trace["phase"]].append(spec)

        _g._launch = traced

    if variant.startswith("prewarm"):
        _prewarm_variant(args, variant, vae, z, row, sync)

    host = {"conv": 0.0, "glue": 0.0}  # host seconds inside the calls (launch, plan building, JIT compiles)

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                host[key] += time.perf_counter() - t0
        return wrapper

    F.conv3d, F.conv2d = timed("conv", F.conv3d), timed("conv", F.conv2d)
    glue = None
    if mode == "fast" and dev.type == "cuda":
        from ..kernels import glue
        glue.rms_silu_rows, glue.add_rows_ = timed("glue", glue.rms_silu_rows), timed("glue", glue.add_rows_)

    calls = []
    for i in range(1 + args.warm):
        trace["phase"] = "first" if i == 0 else "warm"
        host.update(conv=0.0, glue=0.0)
        before = K.compiled_variants("vae_glue")
        info: dict = {}
        sync()
        t0 = time.perf_counter()
        D.decode_video(vae, z, mode=mode, info=info)
        t_host = time.perf_counter() - t0
        sync()
        wall = time.perf_counter() - t0
        after = K.compiled_variants("vae_glue")
        calls.append({"wall_s": wall, "host_s": t_host, "host_conv_s": host["conv"], "host_glue_s": host["glue"],
                      "glue_compiled": None if before is None or after is None else after - before,
                      "glue": info.get("glue", "diffusers")})
    warm = [c["wall_s"] for c in calls[1:]]
    row.update(first=calls[0], warm=calls[1:], first_s=calls[0]["wall_s"],
               warm_median_s=statistics.median(warm) if warm else None, warm_n=len(warm),
               first_excess_s=(calls[0]["wall_s"] - statistics.median(warm)) if warm else None,
               process_s=time.perf_counter() - t_proc)
    specs = trace["specs"]
    row["glue_trace"] = {
        "compiled_by": trace["compiled_by"],
        # launch forms the first call made that the prewarm's decode never made (what it still had to compile)
        "first_not_in_prewarm": sorted(specs.get("first", set()) - specs.get("prewarm", set()))
        if "prewarm" in specs else None,
        "prewarm_not_in_first": sorted(specs.get("prewarm", set()) - specs.get("first", set()))
        if "prewarm" in specs else None}
    ok, why = speed_verdict(dev, len(warm)) if warm else (False, "no warm call")
    row.update(speed_figure=ok, why_not_speed=why)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan2.1",
                   help="a Wan VAE name the VAE bench knows (wan2.1, wan2.2; default: wan2.1)")
    p.add_argument("--size", default="832*480", help="WIDTH*HEIGHT in pixels (default: 832*480)")
    p.add_argument("--frames", type=int, default=81, help="video frames (default: 81)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per variant (default: 1)")
    p.add_argument("--warm", type=int, default=2, help="warm calls after the first, per process (default: 2)")
    p.add_argument("--tiny", action="store_true", help="the tiny VAE (a CPU check of the plumbing; default: off)")
    p.add_argument("--keep_caches", action="store_true",
                   help="don't empty the Triton / inductor caches (the user's own caches, whatever they hold; "
                        "default: off)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per process (default: 300)")
    p.add_argument("-o", "--output", default=None, help="JSON file of every row (default: none)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(_child(args)), flush=True)
        return 0
    from ..kernel_bench import child_env
    from ..timing import fresh_cache_env

    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}; valid: {', '.join(VARIANTS)}")
    rows = []
    base = [sys.executable, "-m", "vdbench.vae_bench.cold", "--model", args.model, "--size", args.size,
            "--frames", str(args.frames), "--warm", str(args.warm)] + (["--tiny"] if args.tiny else [])
    print(f"{'variant':14s} {'first s':>8s} {'warm s':>8s} {'excess':>7s} {'conv host':>9s} {'glue host':>9s} "
          f"{'compiled':>8s}  prewarm")
    for rep in range(args.repeats):
        for v in variants:
            import contextlib

            env_cm = contextlib.nullcontext(child_env()) if args.keep_caches else fresh_cache_env(child_env())
            with env_cm as env:
                t0 = time.perf_counter()
                try:
                    r = subprocess.run(base + ["--child", v], env=env, capture_output=True, text=True,
                                       timeout=args.timeout)
                    out = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
                    row = json.loads(out[-1]) if out else {"variant": v, "error": (r.stderr or "no row")[-2000:],
                                                           "rc": r.returncode}
                except subprocess.TimeoutExpired:
                    row = {"variant": v, "error": f"timed out after {args.timeout} s"}
                row.update(repeat=rep, process_wall_s=time.perf_counter() - t0)
            rows.append(row)
            if "error" in row:
                print(f"{v:14s} ERROR {row['error'].splitlines()[-1] if row['error'] else ''}", flush=True)
                continue
            f = row["first"]
            pw = row.get("prewarm") or {}
            print(f"{v:14s} {row['first_s']:8.3f} {row['warm_median_s'] or float('nan'):8.3f} "
                  f"{row['first_excess_s'] or float('nan'):7.3f} {f['host_conv_s']:9.3f} {f['host_glue_s']:9.3f} "
                  f"{str(f['glue_compiled']):>8s}  {pw.get('status', '-')} {pw.get('seconds', 0):.2f}s", flush=True)
            if args.output:
                with open(args.output, "w") as fh:
                    json.dump({"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]), "rows": rows},
                              fh, indent=1)
    if args.output:  # the same rows in the record schema every tool writes, beside the JSON
        from ..measure.record import write_beside

        write_beside(args.output, {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
                                   "rows": [r for r in rows if "error" not in r]})
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
