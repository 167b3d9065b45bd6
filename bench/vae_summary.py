#!/usr/bin/env python3
"""The VAE suites' summaries, from the JSON bench/bench_vae.py wrote (the last case of the ``vae`` and
``vae_encode`` suites):

    python3 bench/vae_summary.py decode OUT                  # every OUT/vae_*.json: time, memory, PSNR/SSIM, profiles
    python3 bench/vae_summary.py encode OUT -o OUT/summary.txt   # the encode table, its goal's verdict, the quick
                                                                 # case and the I2V render's stages

``encode`` reads OUT/vae_encode_i2v81.json, OUT/vae_encode_quick21.json and OUT/render_i2v14b_timing.json; the goal
(docs/PERFORMANCE.md): fast >= 1.8x diffusers' bf16 encode at >= 45 dB round trip against the fp32 round trip.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

NAN = float("nan")


def decode(out: Path) -> None:
    for f in sorted(out.glob("vae_*.json")):
        d = json.loads(f.read_text())
        a, s = d["args"], d["system"]
        print(f"{a['model']} {a['frames']}f {a['size']} on {s.get('gpu')} ({s.get('gpu_arch')}), torch {s['torch']}, "
              f"cuDNN {s.get('cudnn')}")
        for r in d["results"]:
            if r.get("status") != "ok":
                print(f"  {r['config']:<24} {r['status']}: {str(r.get('reason', ''))[:90]}")
                continue
            info = r.get("decode_info") or {}
            extra = " ".join(f"{k}={info[k]}" for k in ("path", "chunk_frames", "tile_px") if k in info)
            if "glue" in info:
                extra += " glue=" + info["glue"].split(" ")[0]
            if "graph_breaks" in r:
                extra += f" graph_breaks={r['graph_breaks']} graphs={r.get('compiled_graphs')}"
            print(f"  {r['config']:<24} {r['time_s_median']:6.3f} s [{r['time_s_min']:.3f}-{r['time_s_max']:.3f}]"
                  f" {r['peak_memory_gib'] or 0:6.2f} GiB  PSNR min/mean {r.get('psnr_min', NAN):6.2f}/"
                  f"{r.get('psnr_mean', NAN):6.2f}  SSIM min {r.get('ssim_min') or NAN:.4f}"
                  f"{'  FLAG' if r.get('quality_flag') else ''} {extra}")
        for r in d["results"]:
            p = r.get("profile")
            if not p:
                continue
            print(f"  profile {r['config']}: {p['total_ms']:.0f} ms of {p['time_kind']}; top 6:")
            for k in p["kernels"][:6]:
                print(f"    {k['pct']:5.1f}% {k['total_ms']:8.1f} ms {k['calls']:6d}x  {k['name'][:100]}")


def _rows(out: Path, name: str):
    p = out / f"{name}.json"
    if not p.exists():
        print(f"{name}: no results")
        return []
    d = json.loads(p.read_text())
    a, s = d["args"], d["system"]
    print(f"{name}: {a['model']} {a['frames']}f {a['size']} input={a['input']} ops={a['ops']} on {s.get('gpu')}, "
          f"torch {s['torch']}, cuDNN {s.get('cudnn')}")
    return d["results"]


def encode(out: Path) -> None:
    res = _rows(out, "vae_encode_i2v81")
    by = {r["config"]: r for r in res}
    base = (by.get("bf16") or {}).get("encode_time_s_median")
    for r in res:
        if r.get("status") != "ok" or "encode_time_s_median" not in r:
            print(f"  {r['config']:<22} {r.get('encode_status', r.get('status'))}: "
                  f"{str(r.get('encode_reason', r.get('reason', '')))[:90]}")
            continue
        t = r["encode_time_s_median"]
        info = r.get("encode_info") or {}
        print(f"  {r['config']:<22} encode {t:6.3f} s [{r['encode_time_s_min']:.3f}-{r['encode_time_s_max']:.3f}] "
              f"{(r.get('encode_peak_memory_gib') or 0):5.2f} GiB  x{(base / t) if base else NAN:4.2f} vs bf16  "
              f"latents rel L2 {r.get('latent_rel_l2', NAN):.2e}  round trip PSNR min/mean "
              f"{r.get('roundtrip_psnr_min', NAN):.2f}/{r.get('roundtrip_psnr_mean', NAN):.2f} "
              f"SSIM min {r.get('roundtrip_ssim_min') or NAN:.4f} {info.get('glue', '').split(' ')[0]}")
    fast = by.get("fast") or {}
    if base and fast.get("encode_time_s_median"):
        sp, q = base / fast["encode_time_s_median"], fast.get("roundtrip_psnr_min", 0)
        print(f"  GOAL fast >= 1.8x bf16 at >= 45 dB round trip: {sp:.2f}x, {q:.2f} dB -> "
              f"{'MET' if sp >= 1.8 and q >= 45 else 'NOT MET'}")
    for r in res:
        p = r.get("encode_profile")
        if p:
            print(f"  profile {r['config']}: {p['total_ms']:.0f} ms of {p['time_kind']}; top 8:")
            for k in p["kernels"][:8]:
                print(f"    {k['pct']:5.1f}% {k['total_ms']:8.1f} ms {k['calls']:6d}x  {k['name'][:100]}")
    for r in _rows(out, "vae_encode_quick21"):
        if r.get("status") != "ok":
            print(f"  {r['config']:<10} {r.get('status')}: {str(r.get('reason', ''))[:90]}")
            continue
        print(f"  {r['config']:<10} encode {r.get('encode_time_s_median', NAN):.3f} s  decode "
              f"{r.get('time_s_median', NAN):.3f} s  together {r.get('total_time_s_median', NAN):.3f} s  "
              f"rel L2 {r.get('latent_rel_l2', NAN):.2e}  round trip PSNR min "
              f"{r.get('roundtrip_psnr_min', NAN):.2f}  decode PSNR min {r.get('psnr_min', NAN):.2f}")
    p = out / "render_i2v14b_timing.json"
    if not p.exists():
        print("render_i2v14b: no timing.json")
        return
    e = json.loads(p.read_text())[-1]
    print(f"render_i2v14b: total {e['total_time']:.2f} s, pipe {e['pipe_time']:.2f} s, steps "
          f"{', '.join(f'{t:.2f}' for t in e['step_times'])} s, peak {(e.get('peak_memory_bytes') or 0) / 2**30:.1f} GiB")
    total = e["total_time"]
    for k, v in e["stages"].items():
        print(f"  {k:<13} " + ("-" if v is None else f"{v:8.3f} s ({v / total:.1%})"))
    w = e["unaccounted_where"]
    named = ("" if w["before_denoise"] is None else
             f"; before the denoising {w['before_denoise']:.3f} s, after {w['after_denoise']:.3f} s")
    print(f"  unaccounted   {e['unaccounted']:8.3f} s ({e['unaccounted_share']:.2%}{named}) -> within 2%: "
          f"{abs(e['unaccounted_share']) <= 0.02}")
    print(f"  vae_encode: {e.get('vae_encode')}; vae_decode: {e.get('vae_decode')}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=("decode", "encode"), help="which suite's summary")
    p.add_argument("out", type=Path, help="the suite's results folder")
    p.add_argument("-o", "--output", type=Path, default=None, help="also write the summary here (default: printed only)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        (decode if args.table == "decode" else encode)(args.out)
    sys.stdout.write(buf.getvalue())
    if args.output:
        args.output.write_text(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
