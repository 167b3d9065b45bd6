"""Band-parallel VAE decode (vdbench.vae.parallel) under torchrun: exactness against the single-device decode,
time, peak memory. Every rank also decodes the whole latent alone (the single-device reference and time: Wan through
``wan_decode_chunked``, the loop the band decode drives; CogVideoX through diffusers' own ``decode``), then its
band in the parallel decode; medians of ``--repeats`` timed runs after ``--warmup`` (on a GPU 5 after 1 unless
given: a figure from fewer than 3 is no speed figure, ``speed_figure`` / ``why_not_speed`` per run), synchronized
(and barrier-aligned for the parallel one, whose time is the slowest rank's).

    torchrun --nproc_per_node=2 bench/bench_vae_parallel.py --case tiny --case tiny:wan2.2 --json out.json
    torchrun --nproc_per_node=3 bench/bench_vae_parallel.py --case tiny:cogvideox:5x7x6 --ablation  # on CPU: gloo

(``torchrun -m vdbench.vae_bench.parallel`` where vdbench is installed; ``python3 bench/suite.py vae_parallel`` runs
it on GPUs). Cases ``NAME[:TxHxW[:DTYPE[:K,K..]]]``: random-weight VAEs of the tiny or the real widths, latent frames x
rows x cols, chunk sizes. Per run: ``vs_single`` (PSNR of the [0, 1] video and max |difference| against the
single-device decode), with ``--stock`` ``vs_stock`` (against diffusers' untouched ``vae.decode``), with
``--ablation`` the decode without halo exchange (must differ), with ``--subgroup N`` the decode on a sub-group of
the first N ranks. Rank 0 prints one line per run and writes ``--json`` after every case.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..helptext import DefaultsHelpFormatter
from ..measure import quality as Q
from ..timing import TARGET_SAMPLES, speed_verdict
from ..vae.fast import wan_decode_chunked
from ..vae.parallel import decode_video_parallel


def build_case_vae(case: str, device, dtype, seed: int, num_res_blocks: Optional[int] = None, comm_group=None):
    """``case`` (``[tiny-]<name>``, a name of :func:`vdbench.pipelines.vae_names`) from the one VAE builder
    (:func:`vdbench.pipelines.build_vae`: seeded random weights, no parameter requiring grad -- an autograd graph
    recorded by diffusers' undecorated ``vae.decode`` kept every activation alive: 19.1 GB max RSS before, 4.1 GB
    after, CogVideoX VAE on CPU), ``num_res_blocks`` overriding the Wan VAEs' depth; then the weights broadcast
    from rank 0 so all ranks hold the same."""
    import torch.distributed as dist

    from ..pipelines import build_vae, vae_names

    tiny = case.startswith("tiny-")
    name = case[5:] if tiny else case
    if name not in vae_names():
        cases = [prefix + n for n in vae_names() for prefix in ("tiny-", "")]
        raise SystemExit(f"unknown case {case!r}; valid: {', '.join(cases)}")
    depth = {} if num_res_blocks is None or "cogvideox" in case else {"num_res_blocks": num_res_blocks}
    vae = build_vae(name, device=device, dtype=dtype, seed=seed, tiny=tiny, **depth)
    for p in list(vae.parameters()) + list(vae.buffers()):
        dist.broadcast(p.data, src=0, group=comm_group)
    return vae


def sync(device):
    """Wait for the device's queued work (a host clock around an asynchronous GPU measures only the launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup: int, repeats: int, barrier: bool):
    """Median wall time (s) of ``fn()`` after ``warmup`` calls; synchronized (and, for collective work,
    barrier-aligned) before and after each call, so it covers the device work and the communication.
    Every call runs under ``torch.inference_mode()``: the single-device references (diffusers' ``vae.decode``,
    which is not grad-free by itself) must never record an autograd graph, whatever the VAE's parameters say;
    the previous call's output is released before the next call starts."""
    out = None
    for _ in range(warmup):
        out = None
        with torch.inference_mode():
            out = fn()
    times = []
    for _ in range(repeats):
        out = None
        if barrier:
            dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return out, times[len(times) // 2], times


class Peak:
    """CUDA peak memory (GiB) since the previous call, above what was allocated then (None off CUDA)."""

    def __init__(self, device):
        self.device = device
        self._reset()

    def _reset(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self):
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        v = round((torch.cuda.max_memory_allocated(self.device) - self.base) / 2 ** 30, 2)
        self._reset()
        return v


def quality(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """PSNR of the video in [-1, 1] (data range 2: the same dB as the saved frames mapped to [0, 1]) and the
    largest absolute difference, in float64 on the tensors' device (no 1 GB host copies)."""
    p = Q.psnr(x, ref, data_range=2.0, keep_device=True)
    return {"psnr_db": None if p == float("inf") else round(p, 2), "identical": p == float("inf"),
            "max_abs": Q.max_abs(x, ref, keep_device=True)}


def parse_case(spec: str, default_latent: str, default_dtype: str, default_chunks: list):
    """``name[:TxHxW[:dtype[:K,K...]]]`` -> (name, (T, H, W), dtype name, chunk sizes). The tiny VAEs are spelled
    as every vdbench tool spells the tiny models: ``tiny`` (the tiny Wan 2.1 VAE) or ``tiny:<name>``; the older
    ``tiny-<name>`` is read too and is the name results carry."""
    parts = spec.split(":")
    if parts[0] == "tiny":  # tiny[:<name>][:TxHxW...]: the name is the next part when it is no latent size
        named = len(parts) > 1 and parts[1] and not parts[1][0].isdigit()
        parts = ["tiny-" + (parts[1] if named else "wan2.1")] + parts[(2 if named else 1):]
    name = parts[0]
    latent = parts[1] if len(parts) > 1 and parts[1] else default_latent
    dtype = parts[2] if len(parts) > 2 and parts[2] else default_dtype
    chunks = [int(k) for k in parts[3].split(",")] if len(parts) > 3 and parts[3] else default_chunks
    if dtype not in DTYPES:
        raise SystemExit(f"case {spec!r}: dtype must be one of {', '.join(DTYPES)}")
    t, h, w = (int(v) for v in latent.lower().split("x"))
    return name, (t, h, w), dtype, chunks


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_counts(gpu: bool, warmup: Optional[int], repeats: Optional[int]) -> tuple[int, int]:
    """(warm-up, timed decodes) per run, the ones not given filled in: on a GPU 1 and ``TARGET_SAMPLES`` (5: a
    median with a spread), on a CPU 0 and 1 (the run checks exactness; its times are no speed figures)."""
    return ((1 if gpu else 0) if warmup is None else warmup,
            (TARGET_SAMPLES if gpu else 1) if repeats is None else repeats)


def _run_line(tag: str, run: dict, single_s: float, subgroup: int, first_k: int) -> str:
    """One run's printed line: the times, the parallel decode's distance to the single one (and to diffusers' own,
    the no-halo ablation's, the sub-group's, the first chunk size's single decode, where they ran)."""
    q, k = run["vs_single"], run["chunk_frames"]
    return (f"[{tag} K={k}] single {single_s:.3f}s  parallel {run['parallel_s']:.3f}s  ratio "
            f"{run['ratio']:.3f}  PSNR vs single {'inf' if q['identical'] else q['psnr_db']} dB  "
            f"max|d| {q['max_abs']:.2e}"
            + (f"  PSNR vs stock {run['vs_stock']['psnr_db'] or 'inf'} dB" if "vs_stock" in run else "")
            + (f"  no-halo ablation {run['ablation_no_halo_vs_single']['psnr_db']} dB"
               if "ablation_no_halo_vs_single" in run else "")
            + (f"  subgroup({subgroup}) PSNR {run['subgroup']['psnr_db'] or 'inf'} dB" if "subgroup" in run else "")
            + (f"  (single K={k} vs single K={first_k}: {run['single_vs_first_chunk_single']['psnr_db'] or 'inf'} dB)"
               if "single_vs_first_chunk_single" in run else ""))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Band-parallel Wan VAE decode: self-check and benchmark "
                                             "(run under torchrun). Every rank also decodes the whole latent alone "
                                             "(the single-device reference and time).",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--case", action="append",
                    help="NAME[:TxHxW[:DTYPE[:K,K..]]] with NAME one of tiny (tiny:wan2.1), tiny:wan2.2, "
                         "tiny:cogvideox, wan2.1, wan2.2 "
                         "(real widths, random weights); latent frames x rows x cols; chunk sizes (repeatable; "
                         "default: tiny-wan2.1)")
    ap.add_argument("--latent", default="3x7x6", help="latent T x H x W of a case that gives none")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="dtype of a case that gives none")
    ap.add_argument("--chunk_frames", type=int, action="append",
                    help="latent frames per decoder call (repeatable; 0 = all; default: 1 and 0)")
    ap.add_argument("--num_res_blocks", type=int, default=None, help="override the config's num_res_blocks")
    ap.add_argument("--stock", action="store_true", help="also compare with diffusers' untouched vae.decode")
    ap.add_argument("--ablation", action="store_true", help="also decode without halo exchange (must differ)")
    ap.add_argument("--subgroup", type=int, default=0,
                    help="also decode on a sub-group of the first N ranks (exercises group= and rank mapping)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed decodes per run (default: 1 on a GPU, 0 on a CPU)")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed decodes per run (default: {TARGET_SAMPLES} on a GPU, 1 on a CPU, where the run "
                         "checks exactness and its times are no speed figures)")
    ap.add_argument("--budget_s", type=float, default=0, help="skip the remaining runs once this much wall time "
                                                              "has passed (0: no limit)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and latents")
    ap.add_argument("--json", default=None, help="rank 0 writes the results here (after every case)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)

    t_start = time.perf_counter()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a.warmup, a.repeats = default_counts(device.type == "cuda", a.warmup, a.repeats)
    default_chunks = a.chunk_frames or [1, 0]
    sub = dist.new_group(list(range(a.subgroup))) if a.subgroup else None
    meta = {"torch": torch.__version__, "backend": dist.get_backend(), "world": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    results: list = []
    tf32_default = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)

    def over_budget() -> bool:  # decided on rank 0, so that all ranks skip together
        flag = torch.tensor([float(a.budget_s > 0 and time.perf_counter() - t_start > a.budget_s)], device=device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def dump():
        if rank == 0 and a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)

    for spec in a.case or ["tiny-wan2.1"]:
        case, (t, h, w), dname, chunks = parse_case(spec, a.latent, a.dtype, default_chunks)
        if over_budget():
            results.append({"case": spec, "skipped": f"budget of {a.budget_s}s spent"})
            if rank == 0:
                print(f"[{spec}] skipped: budget of {a.budget_s}s spent", flush=True)
            continue
        dtype = DTYPES[dname]
        # fp32 cases measure exactness: TF32 convs/matmuls (cuDNN's default) would round to ~1e-3 differently
        # for the band and the full-frame shapes. Half-precision cases keep the defaults (what a render runs).
        torch.backends.cudnn.allow_tf32 = tf32_default[0] and dname != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = tf32_default[1] and dname != "fp32"
        vae = build_case_vae(case, device, dtype, a.seed, a.num_res_blocks)
        cfg = vae.config
        g = torch.Generator().manual_seed(a.seed + 1)
        is_cog = "z_dim" not in cfg  # CogVideoX: diffusers' decode loop is both the reference and the driver
        z = torch.randn((1, cfg.get("z_dim") or cfg["latent_channels"], t, h, w), generator=g).to(device, dtype)
        entry = {"case": case, "latent": [t, h, w], "dtype": dname, "world": world,
                 "tf32": torch.backends.cudnn.allow_tf32 if device.type == "cuda" else None,
                 "num_res_blocks": cfg.get("num_res_blocks", cfg.get("layers_per_block")), "runs": []}
        results.append(entry)
        tag = f"{case} {dname} latent {t}x{h}x{w} world={world}"
        stock = None
        if a.stock and not is_cog:
            stock, st, _ = timed(lambda: vae.decode(z, return_dict=False)[0], device, a.warmup, a.repeats, False)
            entry["stock_s"] = round(st, 4)
        case_chunks = [None] if is_cog else chunks
        first_single = None  # the first chunk size's single decode: two valid decodes' distance = rounding floor
        for k0 in case_chunks:
            if over_budget():
                entry["runs"].append({"chunk_frames": k0, "skipped": f"budget of {a.budget_s}s spent"})
                if rank == 0:
                    print(f"[{tag} K={k0}] skipped: budget spent", flush=True)
                continue
            k = None if is_cog else (k0 or max(1, t - 1))
            peak = Peak(device)
            single_fn = ((lambda: vae.decode(z, return_dict=False)[0]) if is_cog
                         else (lambda: wan_decode_chunked(vae, z, k)))
            single, ts, _ = timed(single_fn, device, a.warmup, a.repeats, False)
            peak_single = peak()
            info: dict = {}
            par, tp, tps = timed(lambda: decode_video_parallel(vae, z, chunk_frames=k, info=info), device,
                                  a.warmup, a.repeats, True)
            peak_par = peak()
            tmax = torch.tensor([tp], dtype=torch.float64, device=device)
            dist.all_reduce(tmax, op=dist.ReduceOp.MAX)  # the slowest rank's median
            run = {"chunk_frames": k, "shape": list(par.shape), "single_s": round(ts, 4),
                   "parallel_s": round(float(tmax.item()), 4), "ratio": round(float(tmax.item()) / ts, 3),
                   "parallel_times_rank0": [round(x, 4) for x in tps], "vs_single": quality(par, single),
                   "n": a.repeats, "info": info}
            run["speed_figure"], run["why_not_speed"] = speed_verdict(device, a.repeats)
            # the hooks are per call: afterwards no module of the VAE may keep an instance-level forward
            run["hooks_left"] = sum("forward" in m.__dict__ or hasattr(m, "_vdbench_halo") for m in vae.modules())
            if peak_single is not None:
                run["peak_gib_single"], run["peak_gib_parallel_rank0"] = peak_single, peak_par
            if stock is not None:
                run["vs_stock"] = quality(par, stock)
                run["single_vs_stock"] = quality(single, stock)
            del par
            if first_single is None:
                first_single = single
            else:
                run["single_vs_first_chunk_single"] = quality(single, first_single)
            if sub is not None and rank < a.subgroup:
                sinfo: dict = {}
                run["subgroup"] = quality(decode_video_parallel(vae, z, group=sub, chunk_frames=k, info=sinfo),
                                           single)
                run["subgroup"]["info"] = sinfo
            if a.ablation and k0 == case_chunks[0]:
                abl = decode_video_parallel(vae, z, chunk_frames=k, _zero_halo=True)
                run["ablation_no_halo_vs_single"] = quality(abl, single)
                del abl
            entry["runs"].append(run)
            del single
            if rank == 0:
                print(_run_line(tag, run, ts, a.subgroup, case_chunks[0] or t - 1), flush=True)
        del vae, stock, z, first_single
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dump()
    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    dump()
    if rank == 0:
        print(f"done in {meta['wall_s']}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
