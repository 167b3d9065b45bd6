#!/usr/bin/env python3
"""Sequence-parallel Wan on 2 GPUs against one (the ``parallel`` suite): the all-to-all at the Ulysses-2 shard and the
summary table with a 4- and 8-GPU model.

    python -m torch.distributed.run --nproc_per_node=2 bench/lab/ulysses_model.py a2a OUT/a2a.json
    python bench/lab/ulysses_model.py summary RES OUT     # -> OUT/parallel_summary.json, OUT/summary.txt

``a2a``: one Q/K/V/O tensor per rank at Wan 1.3B's Ulysses-2 shape, (1, 12 heads, 32760 / N tokens, 128) bf16,
all_to_all_single timed 20 times after 5 warm-ups (CUDA events); rank 0 writes the median.
``summary``: RES holds one folder per configuration (``1gpu``, ``diffusers_u2``, ``xfuser_r2``...) with what
run_wan.py wrote there; per backend: warm ms/step, speed-up, PSNR / rel L2 of frames and latents against the 1-GPU
output of the same backend, attention kernel counts per rank; then the Ulysses model: compute splits evenly over N,
an all-to-all moves (N-1)/N of a rank's (S/N)*H*D shard, so its time scales as (N-1)/N^2 (per-GPU NVLink bandwidth
constant on an NVSwitch host); per step 30 layers x 2 guidance passes x 4 all-to-alls = 240, not overlapped.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys


def _registry_order(names):
    """``names`` in the registry's order (vdbench.backends.names()), unknown ones last: rows follow the backend
    table, no name is singled out here."""
    from vdbench import backends as B

    rank = {n: i for i, n in enumerate(B.names())}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def a2a(path: str) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"]); torch.cuda.set_device(rank); dist.init_process_group("nccl")
    n = dist.get_world_size(); x = torch.randn(1, 12, 32760 // n, 128, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x); ts = []
    for i in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier(); a.record(); dist.all_to_all_single(y, x); b.record(); b.synchronize()
        if i >= 5: ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    if rank == 0:
        json.dump({"world": n, "bytes_per_rank": x.numel() * 2, "a2a_s_median": ts[len(ts) // 2]}, open(path, "w"))
    dist.destroy_process_group()


def summary(res: str, out: str) -> None:
    import numpy as np
    import torch

    def entries(cfg):
        p = os.path.join(res, cfg, "results", "timing.json")
        return {e["attention_type"]: e for e in json.load(open(p))} if os.path.exists(p) else {}
    def frames(cfg, b):
        f = glob.glob(os.path.join(res, cfg, "results", f"*attn_{b}_*.npy"))
        return np.load(f[0]) if f else None
    def latents(cfg, b):
        f = sorted(glob.glob(os.path.join(res, cfg, "captures", f"latents_{b}_rank0_*.pt")))
        return torch.load(f[-1], weights_only=True)["latents"].float() if f else None
    def psnr(a, b):
        mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
        return None if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)  # None: identical frames
    base = entries("1gpu")
    rows, table = [], []
    configs = [("1gpu", "1 GPU", "-")] + [(f"{e}_{p}2", f"{p}-2".replace("u-", "Ulysses-").replace("r-", "ring-"), e)
                                         for p in ("u", "r") for e in ("diffusers", "xfuser")]
    for b in _registry_order(base):
        ref_e, ref_f, ref_l = base.get(b), frames("1gpu", b), latents("1gpu", b)
        for cfg, label, engine in configs:
            e = entries(cfg).get(b)
            if e is None:
                continue
            r = {"backend": b, "config": label, "engine": engine, "step_ms": 1e3 * e["warm_step_median"],
                 "step_times_ms": [1e3 * t for t in e["step_times"]], "decode_s": e["vae_decode_time"],
                 "attention_s": e["attention"].get("attention_time_s")}
            if ref_e and cfg != "1gpu":
                r["speedup"] = ref_e["warm_step_median"] / e["warm_step_median"]
                f, l = frames(cfg, b), latents(cfg, b)
                if f is not None and ref_f is not None:
                    r["psnr_vs_1gpu_db"] = psnr(f, ref_f)
                    r["identical_frames"] = bool(np.array_equal(f, ref_f))
                if l is not None and ref_l is not None:
                    r["latent_rel_l2_vs_1gpu"] = float((l - ref_l).norm() / ref_l.norm())
            if "ranks" in e:
                r["kernels_per_rank"] = {pr["rank"]: pr["attention"]["calls_by_kernel"] for pr in e["ranks"]}
                r["step_ms_per_rank"] = {pr["rank"]: 1e3 * pr["warm_step_median"] for pr in e["ranks"]}
                r["attention_s_per_rank"] = {pr["rank"]: pr["attention"].get("attention_time_s") for pr in e["ranks"]}
            else:
                r["kernels_per_rank"] = {0: e["attention"]["calls_by_kernel"]}
            rows.append(r)
            k = "; ".join(f"r{rk}: " + ",".join(f"{n}x{c}" for n, c in kk.items()) for rk, kk in r["kernels_per_rank"].items())
            table.append(f"{b:10s} {label:11s} {engine:9s} {r['step_ms']:8.1f} {r.get('speedup', float('nan')):6.2f}x "
                         f"{('  ident' if r.get('identical_frames') else format(r.get('psnr_vs_1gpu_db') or float('nan'), '7.2f'))} {r.get('latent_rel_l2_vs_1gpu', float('nan')):9.2e}  {k}")
    # 4- and 8-GPU model (Ulysses): compute splits evenly over N; an all-to-all moves (N-1)/N of a rank's
    # (S/N)*H*D shard, so its time scales as (N-1)/N^2 (per-GPU NVLink bandwidth constant on an NVSwitch host).
    # Per step: 30 layers x 2 guidance passes x 4 all-to-alls (Q, K, V in; O out) = 240, not overlapped today.
    model = {}
    a2a = json.load(open(os.path.join(out, "a2a.json"))) if os.path.exists(os.path.join(out, "a2a.json")) else None
    f = lambda n: (n - 1) / n ** 2
    for b in _registry_order(base):
        t1 = base.get(b, {}).get("warm_step_median")
        for eng in ("diffusers", "xfuser"):
            u2 = entries(f"{eng}_u2").get(b, {}).get("warm_step_median")
            if not (t1 and u2):
                continue
            over2 = u2 - t1 / 2  # measured cost of going parallel at N=2 (all-to-all + imbalance + gathers)
            m = {"t1_ms": 1e3 * t1, "u2_ms": 1e3 * u2, "overhead2_ms": 1e3 * over2}
            if a2a:
                m["a2a_240_ms_measured_n2"] = 1e3 * 240 * a2a["a2a_s_median"]
            for n in (4, 8):
                serial = t1 / n + over2 * f(n) / f(2)
                m[f"n{n}_ms_no_overlap"] = 1e3 * serial
                m[f"n{n}_speedup_no_overlap"] = t1 / serial
                if a2a:
                    comm = 240 * a2a["a2a_s_median"] * f(n) / f(2)
                    m[f"n{n}_ms_full_overlap"] = 1e3 * max(t1 / n, comm)
                    m[f"n{n}_speedup_full_overlap"] = t1 / max(t1 / n, comm)
            model[f"{b}/{eng}"] = m
    json.dump({"rows": rows, "model": model, "a2a": a2a}, open(os.path.join(out, "parallel_summary.json"), "w"), indent=1)
    lines = ["backend    config      engine    ms/step  speedup PSNR(dB) latentRL2  kernels per rank",
             *table, "", "a2a (Ulysses-2 shard, 1 call): " + (f"{1e3 * a2a['a2a_s_median']:.3f} ms for "
             f"{a2a['bytes_per_rank'] / 2**20:.1f} MiB/rank" if a2a else "n/a"), "Ulysses model (ms/step, speedup):"]
    for k, m in model.items():
        lines.append(f"  {k}: 1GPU {m['t1_ms']:.0f}, U2 {m['u2_ms']:.0f} (overhead {m['overhead2_ms']:.0f}"
                     + (f", 240 a2a {m['a2a_240_ms_measured_n2']:.0f}" if 'a2a_240_ms_measured_n2' in m else "") + ")"
                     + "".join(f"; N={n}: {m[f'n{n}_ms_no_overlap']:.0f} ({m[f'n{n}_speedup_no_overlap']:.2f}x)"
                               + (f" / overlapped {m[f'n{n}_ms_full_overlap']:.0f} ({m[f'n{n}_speedup_full_overlap']:.2f}x)"
                                  if f'n{n}_ms_full_overlap' in m else "") for n in (4, 8)))
    open(os.path.join(out, "summary.txt"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    for d in glob.glob(os.path.join(res, "*", "results", "timing.json")):  # the merged per-rank timings, kept
        c = os.path.basename(os.path.dirname(os.path.dirname(d)))
        with open(d) as f, open(os.path.join(out, f"timing_{c}.json"), "w") as g:
            g.write(f.read())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("a2a", help="time the all-to-all (under torchrun)")
    a.add_argument("json", help="rank 0 writes the median here")
    s = sub.add_parser("summary", help="the table and the model from the renders")
    s.add_argument("res", help="the renders: one folder per configuration")
    s.add_argument("out", help="where parallel_summary.json and summary.txt go (a2a.json is read from here)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "a2a":
        a2a(args.json)
    else:
        summary(args.res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
