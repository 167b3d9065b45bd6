"""Running the VAE bench's configs: one config in this process (``run_config``), under the watchdog, or isolated in
a child process (``python -m vdbench.vae_bench``: ``--isolate``, ``--cold``, the MIOpen presets), the fp32 reference
first."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .configs import NotApplicable, prepare_config
from .grammar import child_env, parse_config, parse_ops, parse_size, uses
from .measure import quality, time_fields, timed, to_frames
from .models import build_vae, family_of, make_latents, make_video
from .profiler import profile_op, profile_wanted
from .writer import print_row


#: ``caches`` of a config run in-process after another: it finds what the earlier configs compiled and planned.
SHARED_CACHES = "shared with earlier configs in this process"


def run_config(spec: str, args, device: str, ref: dict | None = None, wd=None) -> tuple[dict, dict]:
    """Build, warm up, time and check one config in this process: the decode of the latents and the encode of the
    video (``--ops``), each against the fp32 reference's (``ref``: its outputs). Returns (result row, outputs:
    ``frames`` of the decode, ``latents`` and ``roundtrip`` frames of the encode, on the CPU)."""
    import torch

    from ..measure.quality import rel_l2

    name, value = parse_config(spec)
    ops = parse_ops(args.ops)
    stage = wd.stage if wd is not None else (lambda s: None)
    res: dict = {"config": spec, "status": "ok"}
    stage("build vae")
    vae = build_vae(args.model, device, args.seed)
    family = family_of(vae)
    w, h = parse_size(args.size)
    stage("inputs")
    z = make_latents(vae, family, args.frames, w, h, args.seed, device, args.latents) if "decode" in ops else None
    video = make_video(vae, family, args.frames, w, h, args.seed, args.input) if "encode" in ops else None
    if z is not None:
        res["latent_shape"] = list(z.shape)
    stage("prepare config")
    comp = uses(name, "compile")
    if comp:
        from torch._dynamo.utils import counters

        breaks0 = dict(counters["graph_break"])
        graphs0 = counters["stats"]["unique_graphs"]
    try:
        vae, fns, desc, info, refused = prepare_config(name, value, vae, family, args, device, ops)
    except NotApplicable as e:
        return {**res, "status": "not_applicable", "reason": str(e)}, {}
    res.update(desc)
    for op in ops:
        if op in refused:
            res.update({f"{op}_status": "not_applicable", f"{op}_reason": refused[op]})
    ref = ref or {}
    outputs: dict = {}
    prof = getattr(args, "profile", 0) and profile_wanted(spec, getattr(args, "profile_configs", None))
    flags = []
    if "decode" in ops and "decode" in fns:
        times, first, peak, out = timed(fns["decode"], z, args, device, stage, "decode")
        res.update(**time_fields(times, first, peak, device), output_shape=list(out.shape),
                   decode_info=dict(info["decode"]))
        for key in ("chunk_frames", "tail_frames"):  # a config that left them to the decode: what it ran
            if key in res and res[key] is None:
                res[key] = info["decode"].get(key)
        frames = to_frames(out)
        del out
        if prof:
            stage("decode profile")
            res["profile"] = profile_op(fns["decode"], z, device, args.profile)
        stage("decode quality")
        if "frames" in ref:
            res.update(quality(frames, ref["frames"]))
            res["decode_quality_flag"] = res["psnr_min"] < args.min_psnr
            flags.append(res["decode_quality_flag"])
        outputs["frames"] = frames.cpu()
        del frames
    if "encode" in ops and "encode" in fns:
        x = video.to(device=device, dtype=vae.dtype)  # as the pipeline hands it over: in the VAE's dtype
        times, first, peak, lat = timed(fns["encode"], x, args, device, stage, "encode")
        res.update(**time_fields(times, first, peak, device, "encode_"), input_shape=list(x.shape),
                   encode_latent_shape=list(lat.shape), encode_info=dict(info["encode"]))
        if prof:
            stage("encode profile")
            res["encode_profile"] = profile_op(fns["encode"], x, device, args.profile)
        del x
        stage("round trip")
        rt_decode = fns.get("decode") or (lambda q: vae.decode(q.to(vae.dtype), return_dict=False)[0])
        with torch.no_grad():
            rt = to_frames(rt_decode(lat))
        res["roundtrip_decode"] = "this config's" if "decode" in fns else "diffusers' (the config's doesn't apply)"
        stage("encode quality")
        if "latents" in ref:
            res["latent_rel_l2"] = rel_l2(lat, ref["latents"], keep_device=True)
            q = quality(rt, ref["roundtrip"])
            res.update({f"roundtrip_{k}": v for k, v in q.items()})
            res["encode_quality_flag"] = q["psnr_min"] < args.min_psnr
            flags.append(res["encode_quality_flag"])
        outputs.update(latents=lat.float().cpu(), roundtrip=rt.cpu())
        del lat, rt
        if "time_s_median" in res:  # encode and decode apart (above) and together
            res["total_time_s_median"] = res["encode_time_s_median"] + res["time_s_median"]
    if comp:  # this config's compilations only (counters are per process)
        new = {k: v - breaks0.get(k, 0) for k, v in counters["graph_break"].items() if v > breaks0.get(k, 0)}
        res["graph_breaks"] = int(sum(new.values()))
        res["compiled_graphs"] = int(counters["stats"]["unique_graphs"] - graphs0)
        res["graph_break_reasons"] = sorted(str(k)[:200] for k in new)[:10]
    if flags:
        res["quality_flag"] = any(flags)
    return res, outputs


def run_guarded(spec, args, device, ref):
    """``run_config`` under the watchdog; errors and hangs become result rows, never exceptions."""
    from ..watchdog import Watchdog, WatchdogTimeout

    try:
        with Watchdog(args.timeout, label=f"config {spec}") as wd:
            return run_config(spec, args, device, ref, wd=wd)
    except WatchdogTimeout as e:
        r = e.report
        return {"config": spec, "status": "hung", "reason": str(e), "last_completed_stage": r.last_completed_stage,
                "current_stage": r.current_stage, "timeout_s": r.timeout_s}, {}
    except Exception as e:  # noqa: BLE001 - one config's failure (OOM, compile error) must not stop the others
        import traceback

        traceback.print_exc()
        return {"config": spec, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:500]}"}, {}
    finally:
        free(device)


def free(device):
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
        torch.backends.cudnn.benchmark = False


def child_main(args) -> int:
    """``--_child SPEC``: run one config, write its row (and outputs, for the reference) to the given files."""
    import torch

    ref = None
    if args._ref:
        ref = torch.load(args._ref, map_location="cpu", weights_only=True)  # to the GPU only for metrics

    def on_hang(report):  # the process may be ended right after this (stuck in native code): leave the row
        Path(args._result).write_text(json.dumps({"config": args._child, "status": "hung",
                                                  "last_completed_stage": report.last_completed_stage,
                                                  "current_stage": report.current_stage,
                                                  "timeout_s": report.timeout_s}))

    from ..watchdog import Watchdog, WatchdogTimeout

    try:
        with Watchdog(args.timeout, label=f"config {args._child}", on_hang=on_hang, grace_s=5) as wd:
            res, outputs = run_config(args._child, args, args.device, ref, wd=wd)
    except WatchdogTimeout as e:
        r = e.report
        res, outputs = {"config": args._child, "status": "hung", "reason": str(e),
                        "last_completed_stage": r.last_completed_stage, "current_stage": r.current_stage,
                        "timeout_s": r.timeout_s}, {}
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        res, outputs = {"config": args._child, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:500]}"}, {}
    res["pid"] = os.getpid()
    res.update(how_it_ran(args, first=True))
    if args._save_ref and outputs:
        torch.save(outputs, args._save_ref)
    Path(args._result).write_text(json.dumps(res, default=str))
    return 0


def how_it_ran(args, first: bool) -> dict:
    """A row's ``cold``, ``caches`` and ``cache_dirs``: the compile caches' state when this process started
    (``args._cache_state``, taken before anything compiled); a config after the first in one process finds what
    the earlier ones left."""
    state = getattr(args, "_cache_state", None) or {"caches": None, "cache_dirs": None}
    return {"cold": bool(args.cold), "caches": state["caches"] if first else SHARED_CACHES,
            "cache_dirs": state["cache_dirs"]}


def child_cmd(spec, args, result, ref=None, save_ref=None):
    cmd = [sys.executable, "-m", "vdbench.vae_bench", "--_child", spec, "--_result", str(result),
           "--model", args.model, "--frames", str(args.frames), "--size", args.size, "--tile_px", str(args.tile_px),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--min_psnr", str(args.min_psnr),
           "--device", args.device, "--seed", str(args.seed), "--vae_max_memory", str(args.vae_max_memory),
           "--compile_backend", args.compile_backend, "--profile", str(args.profile), "--ops", args.ops,
           "--input", args.input]
    if args.chunk_frames:
        cmd += ["--chunk_frames", str(args.chunk_frames)]
    if args.profile_configs:
        cmd += ["--profile_configs", args.profile_configs]
    if args.timeout:
        cmd += ["--timeout", str(args.timeout)]
    if args.cold:
        cmd += ["--cold"]
    if args.latents:
        cmd += ["--latents", args.latents]
    if ref:
        cmd += ["--_ref", str(ref)]
    if save_ref:
        cmd += ["--_save_ref", str(save_ref)]
    return cmd


def run_child(spec, args, tmp: Path, ref=None, save_ref=None) -> dict:
    """One config in its own process, with its environment presets (and with ``--cold`` new empty compile caches,
    removed when it ends); the parent enforces the timeout too (the child's own watchdog dumps stacks first; a
    child that is stuck beyond it is killed here)."""
    import contextlib

    from ..kernel_bench import child_env as this_vdbench
    from ..timing import fresh_cache_env

    result = tmp / f"{spec.replace('@', '_')}.json"
    result.unlink(missing_ok=True)
    cmd = child_cmd(spec, args, result, ref, save_ref)
    limit = (args.timeout + 30) if args.timeout else None
    t0 = time.monotonic()
    env = child_env(spec, this_vdbench())  # the child runs this same vdbench, with the config's presets
    caches = fresh_cache_env(env) if args.cold else contextlib.nullcontext(env)
    with caches as env:
        try:
            proc = subprocess.run(cmd, env=env, timeout=limit)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    if result.exists():
        try:
            res = json.loads(result.read_text())
        except json.JSONDecodeError:
            res = {"config": spec, "status": "error", "reason": "child wrote an unreadable result"}
        if rc not in (0, None) and res.get("status") == "ok":
            res.update(status="error", reason=f"child exited {rc}")
        res["child_exit_code"] = rc
        return res
    if rc is None:
        return {"config": spec, "status": "hung", "reason": f"killed by the parent after {limit} s",
                "last_completed_stage": None, "timeout_s": args.timeout, "cold": bool(args.cold)}
    return {"config": spec, "status": "error", "reason": f"child exited {rc} without a result",
            "wall_s": time.monotonic() - t0, "cold": bool(args.cold)}


def run_all(args, on_row=None) -> list[dict]:
    """The fp32 reference, then every config; ``on_row(rows)`` after each (results are written as they come,
    so a run killed from outside still leaves every finished config on disk)."""
    import torch

    specs = [s.strip() for s in args.configs.split(",") if s.strip()]
    for s in specs:
        parse_config(s)
    if "fp32" not in specs:  # the reference is always measured and reported
        specs.insert(0, "fp32")
    rows = []
    device = args.device
    with tempfile.TemporaryDirectory(prefix="bench_vae_") as td:
        tmp = Path(td)
        ref_path = tmp / "ref.pt"
        needs_child = lambda s: args.isolate or parse_config(s)[0].startswith("miopen_")  # noqa: E731
        # (a miopen_* base is always first in the name, so the prefix test covers its composites too)
        # The reference: fp32, untiled, stock decode of the same latents and stock encode of the same video.
        print(f"[bench_vae] reference: fp32 untiled {' and '.join(parse_ops(args.ops))}", flush=True)
        if args.isolate:
            ref_row = run_child("fp32", args, tmp, save_ref=ref_path)
            ref = torch.load(ref_path, map_location="cpu", weights_only=True) if ref_path.exists() else None
        else:
            ref_row, ref = run_guarded("fp32", args, device, None)  # its outputs are on the CPU: they must not
            ref_row.update(how_it_ran(args, first=True))            # count in later configs' peak memory
            if ref:
                torch.save(ref, ref_path)
        if not ref:
            ref = None
            print(f"[bench_vae] the fp32 reference did not complete: {ref_row.get('reason')}", flush=True)
        else:
            if "frames" in ref:
                ref_row.update(psnr_min=math.inf, psnr_mean=math.inf, ssim_min=1.0, ssim_mean=1.0,
                               decode_quality_flag=False)
            if "latents" in ref:
                ref_row.update(latent_rel_l2=0.0, roundtrip_psnr_min=math.inf, roundtrip_psnr_mean=math.inf,
                               roundtrip_ssim_min=1.0, roundtrip_ssim_mean=1.0, encode_quality_flag=False)
            ref_row.update(quality_flag=False, reference=True)
        for spec in specs:
            if spec == "fp32":
                rows.append(ref_row)
                print_row(ref_row)
                if on_row:
                    on_row(rows)
                continue
            print(f"[bench_vae] config {spec}", flush=True)
            if ref is None:
                row = {"config": spec, "status": "error", "reason": "no fp32 reference to compare with"}
            elif needs_child(spec):
                row = run_child(spec, args, tmp, ref=ref_path)
            else:
                row, _outputs = run_guarded(spec, args, device, ref)
                row.update(how_it_ran(args, first=False))
                del _outputs
            rows.append(row)
            print_row(row)
            if on_row:
                on_row(rows)
    return rows
