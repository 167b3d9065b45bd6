"""The VAE bench's output: a row printed, the results written (JSON, or CSV), the exit code."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from .grammar import OPS


def _fmt_time(r, prefix: str = "") -> str:
    """The warm median with its n and spread, the first call apart, the peak memory."""
    mem = r.get(f"{prefix}peak_memory_gib")
    first = r.get(f"{prefix}first_call_s")
    return (f"{r[prefix + 'time_s_median']:.3f} s (warm, n={r.get(prefix + 'time_s_n')}, p20–p80 "
            f"{r[prefix + 'time_s_p20']:.3f}–{r[prefix + 'time_s_p80']:.3f}, min {r[prefix + 'time_s_min']:.3f}, "
            f"max {r[prefix + 'time_s_max']:.3f})"
            + (f", first call {first:.3f} s (+{r[prefix + 'first_call_excess_s']:.3f})" if first is not None else "")
            + f"  peak {f'{mem:.2f} GiB' if mem is not None else 'n/a (CPU)'}")


def _fmt_quality(r, prefix: str = "") -> str:
    if r.get(f"{prefix}psnr_min") is None:
        return ""
    q = f"PSNR min/mean {r[prefix + 'psnr_min']:.2f}/{r.get(prefix + 'psnr_mean', float('nan')):.2f} dB"
    return q + (f", SSIM min {r[prefix + 'ssim_min']:.4f}" if r.get(f"{prefix}ssim_min") is not None else "")


def print_row(r):
    """The config's decode, encode (latents and round trip against the fp32 ones) and both together."""
    if r.get("status") != "ok":
        extra = f" (last completed stage: {r.get('last_completed_stage')})" if r.get("status") == "hung" else ""
        print(f"  {r['config']:<18} {r['status'].upper()}: {r.get('reason', '')}{extra}", flush=True)
        return
    flag = "  ** BELOW --min_psnr **"
    lines = []
    if "time_s_median" in r:
        lines.append(f"decode {_fmt_time(r)}  {_fmt_quality(r)}{flag if r.get('decode_quality_flag') else ''}")
    for op in OPS:
        if r.get(f"{op}_status") == "not_applicable":
            lines.append(f"{op} not applicable: {r.get(f'{op}_reason')}")
    if "encode_time_s_median" in r:
        rel = r.get("latent_rel_l2")
        lines.append(f"encode {_fmt_time(r, 'encode_')}  latents rel L2 "
                     f"{'n/a' if rel is None else f'{rel:.2e}'}, round trip {_fmt_quality(r, 'roundtrip_')}"
                     f"{flag if r.get('encode_quality_flag') else ''}")
    if "total_time_s_median" in r:
        lines.append(f"encode + decode {r['total_time_s_median']:.3f} s")
    print(f"  {r['config']:<18} " + ("\n" + " " * 21).join(lines), flush=True)
    if "graph_breaks" in r:
        print(f"    compile: {r['graph_breaks']} graph breaks, {r.get('compiled_graphs')} graphs", flush=True)
    for op, key in (("decode", "decode_info"), ("encode", "encode_info")):
        glue = (r.get(key) or {}).get("glue")
        if glue:
            print(f"    {op} glue: {glue}", flush=True)
    for op, key in (("decode", "profile"), ("encode", "encode_profile")):
        prof = r.get(key)
        if prof:
            print(f"    {op}: top {len(prof['kernels'])} by {prof['time_kind']} (total {prof['total_ms']:.1f} ms):",
                  flush=True)
            for k in prof["kernels"]:
                print(f"    {k['pct']:5.1f}% {k['total_ms']:9.2f} ms {k['calls']:6d}x  {k['name'][:110]}", flush=True)


def write_output(path: str, header: dict, rows: list[dict]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".csv":
        timing = ["time_s_median", "time_s_min", "time_s_max", "time_s_p20", "time_s_p80", "time_s_n",
                  "first_call_s", "first_call_excess_s", "speed_figure", "why_not_speed"]
        keys = ["config", "status", "dtype", *timing, "peak_memory_gib",
                "psnr_min", "psnr_mean", "ssim_min", "ssim_mean", "quality_flag", "reason", "last_completed_stage",
                *(f"encode_{k}" for k in timing), "encode_peak_memory_gib",
                "latent_rel_l2", "roundtrip_psnr_min", "roundtrip_psnr_mean", "roundtrip_ssim_min",
                "encode_quality_flag", "total_time_s_median", "encode_status", "encode_reason", "cold", "caches"]
        with open(p, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=["model", "latents", "output_shape", *keys, "video"],
                                extrasaction="ignore")
            wr.writeheader()
            a = header["args"]
            for r in rows:
                shape = r.get("output_shape")
                wr.writerow({"model": a["model"], "latents": a.get("latents") or f"random {a['frames']}f {a['size']}",
                             **r, "output_shape": "x".join(map(str, shape)) if shape else "",
                             "video": f"{a['input']} {a['frames']}f {a['size']}" if "encode" in a["ops"] else ""})
    else:
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps({**header, "results": rows}, indent=1, default=str))
        os.replace(tmp, p)


def exit_code(rows: list[dict]) -> int:
    if any(r.get("status") not in ("ok", "not_applicable") for r in rows):
        return 1
    if any(r.get("quality_flag") for r in rows):
        return 2
    return 0
