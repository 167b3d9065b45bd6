#!/usr/bin/env python3
"""Multi-GPU table from render outputs: step time, speedup and scaling efficiency against one GPU, and the output
against the one-GPU output of the same backend (frames PSNR, latents relative L2).

    python bench/parallel_summary.py RES [-o summary.json]

``RES`` holds one folder per model/size group (e.g. ``w13``, ``w14``, ``cog``), each holding one folder per
configuration (``1gpu`` = the baseline; any other name, e.g. ``diffusers_u2``, ``xfuser_cfg2``) with what
``run_wan.py`` / ``sageattn_cogvideo.py`` wrote there (``timing.json``, ``--save_frames`` .npy,
``--save_latents`` captures). The configuration's label and GPU count are read from the merged timing
(``parallel``: engine, Ulysses/ring/CFG layout), not from the folder name. Groups named ``_*`` are skipped
(e.g. profiled runs, whose step times include the profiler).

Cards of one machine differ in speed, and an N-GPU step runs at the pace of its slowest card, so a group may also
hold one-GPU renders of the same backend on each card (folders ``1gpu_<anything>``, e.g. ``1gpu_g1`` .. ``1gpu_g3``,
the ``1gpu`` render standing for its own card where no ``1gpu_*`` one ran there,
run side by side). Each render names its cards (``gpu_uuid``, as nvidia-smi does); an N-GPU row whose every card
has such a render also gets its speed-up against the slowest of its own cards (``speedup_vs_slowest_gpu``) and
against their mean (``speedup_vs_mean_gpu``), beside the speed-up against ``1gpu`` (one card, alone).

Step times use ``vdbench.timing``'s one definition, recomputed from each entry's raw ``step_times`` (so files
written before the warm-step keys read the same way): the warm step is the median of the steps after the first
(``warm_step_ms``, with ``warm_step_n`` and p20/p80), the first step is ``first_step_ms``; speed-ups and
efficiencies are ratios of warm steps. Rows that are not speed figures (CPU, n < 3, emulations) say so
(``speed_figure``, ``why_not_speed``); emulated backends get no time and no speed-up.
"""

from __future__ import annotations

import argparse
from vdbench.helptext import DefaultsHelpFormatter
import json
import sys
from pathlib import Path

import numpy as np


def _entries(cfg_dir: Path) -> dict:
    out = {}
    for p in sorted(cfg_dir.rglob("timing.json")):
        for e in json.loads(p.read_text()):
            out[e["attention_type"]] = e  # the last entry of a backend wins (its latest repetition)
    return out


def _frames(cfg_dir: Path, backend: str):
    f = sorted(cfg_dir.rglob(f"*attn_{backend}_*.npy")) or sorted(cfg_dir.rglob(f"*_{backend}.npy"))
    return np.load(f[0]) if f else None


def _latents(cfg_dir: Path, backend: str):
    import torch

    f = sorted(cfg_dir.rglob(f"latents_{backend}_rank0_*.pt"))
    return torch.load(f[-1], weights_only=True)["latents"].float() if f else None


def _kernels(e: dict) -> str:
    ranks = e.get("ranks") or [{"rank": 0, "attention": e["attention"]}]
    r0 = ranks[0]["attention"]["calls_by_kernel"]
    same = all(r["attention"]["calls_by_kernel"] == r0 for r in ranks)
    k = ",".join(f"{n}x{c}" for n, c in r0.items())
    return f"{len(ranks)} ranks: {k}" + ("" if same else " (rank 0; others differ)")


def _gpus(e: dict) -> list:
    """The cards a render ran on, in rank order (nvidia-smi's UUIDs; None where the render did not record one)."""
    if e.get("ranks"):
        return [r.get("gpu_uuid") for r in e["ranks"]]
    return [((e.get("run") or {}).get("system") or {}).get("gpu_uuid")]


def _card_steps(rows: list[dict]) -> dict:
    """(group, backend) -> {card UUID: one-GPU warm ms} of the rows from ``1gpu_*`` folders (the per-card
    baselines); a card without one takes the ``1gpu`` row's where that ran on it."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["config_dir"].startswith("1gpu_")):  # 1gpu_* last: they win
        if ((r["config_dir"] == "1gpu" or r["config_dir"].startswith("1gpu_")) and r["gpus"] == 1
                and r["warm_step_ms"] and r["gpu_uuids"][0]):
            out.setdefault((r["group"], r["backend"]), {})[r["gpu_uuids"][0]] = r["warm_step_ms"]
    return out


def _against_own_cards(rows: list[dict]) -> None:
    """Each N-GPU row whose every card has a one-GPU render (:func:`_card_steps`) gets its speed-up against the
    slowest and the mean of those cards' warm steps."""
    cards = _card_steps(rows)
    for r in rows:
        own = cards.get((r["group"], r["backend"]), {})
        if r["gpus"] > 1 and r["warm_step_ms"] and r["gpu_uuids"] and all(u in own for u in r["gpu_uuids"]):
            t = [own[u] for u in r["gpu_uuids"]]
            r["by_gpu_warm_ms"] = t
            r["speedup_vs_slowest_gpu"] = max(t) / r["warm_step_ms"]
            r["speedup_vs_mean_gpu"] = sum(t) / len(t) / r["warm_step_ms"]


def _steps(e: dict) -> dict:
    """The warm-step figures of one timing entry (the slowest rank's step times for a merged parallel entry)."""
    from vdbench.timing import step_stats

    run = e.get("run") or {}
    return step_stats(e.get("step_times") or [], (run.get("resolved") or {}).get("device"),
                      bool((run.get("backend") or {}).get("emulated")))


def _energy(e: dict) -> dict:
    """A warm step's joules over every card (vdbench.power.warm_energy of each card's per-step joules, added up), and
    each card's warm power (its warm joules over its warm steps' time), median SM clock and power-capped share; {}
    where a card recorded no joules."""
    from vdbench.power import warm_energy

    cards = e["ranks"] if e.get("ranks") else [e]
    joules = [warm_energy((c.get("power") or {}).get("energy_j") or []) for c in cards]
    if None in joules:
        return {}
    warm_s = [sum((c.get("step_times") or [])[1:]) for c in cards]
    return {"warm_energy_j": round(sum(joules), 3),
            "warm_power_w_per_card": [round(j * (len(c["step_times"]) - 1) / t, 1) if t else None
                                      for j, c, t in zip(joules, cards, warm_s)],
            **{f"{k}_per_card": [(c.get("power") or {}).get(k) for c in cards]
               for k in ("warm_sm_clock_mhz", "warm_capped_share")}}


def summarize(res: Path) -> list[dict]:
    from vdbench.measure import quality as M
    from vdbench.timing import step_stats

    rows = []
    for group in sorted(p for p in res.iterdir() if p.is_dir() and not p.name.startswith("_")):
        base_dir = group / "1gpu"
        base = _entries(base_dir) if base_dir.is_dir() else {}
        cfgs = [base_dir] if base_dir.is_dir() else []
        cfgs += sorted(p for p in group.iterdir() if p.is_dir() and p.name != "1gpu")
        ref_cache: dict = {}
        for cfg_dir in cfgs:
            for b, e in _entries(cfg_dir).items():
                par = e.get("parallel") or {}
                n = par.get("world_size", 1)
                label = "1 GPU" if not par else f"{par.get('label')} ({par.get('engine')})"
                st = _steps(e)
                emulated = bool(((e.get("run") or {}).get("backend") or {}).get("emulated"))
                ms = lambda v: None if (v is None or emulated) else 1e3 * v  # noqa: E731
                r = {"group": group.name, "config_dir": cfg_dir.name, "backend": b, "config": label, "gpus": n,
                     "warm_step_ms": ms(st["warm_step_median"]), "warm_step_n": st["warm_step_n"],
                     "warm_step_p20_ms": ms(st["warm_step_p20"]), "warm_step_p80_ms": ms(st["warm_step_p80"]),
                     "first_step_ms": ms(st["first_step"]), "speed_figure": st["speed_figure"],
                     "why_not_speed": st["why_not_speed"], "emulated": emulated,
                     "step_times_ms": None if emulated else [1e3 * t for t in e["step_times"]],
                     "decode_s": e.get("vae_decode_time"), "kernels": _kernels(e),
                     "peak_memory_gib": (e.get("peak_memory_bytes") or 0) / 2**30}
                if e.get("ranks") and not emulated:
                    r["warm_step_ms_per_rank"] = [ms(step_stats(x.get("step_times") or [])["warm_step_median"])
                                                  for x in e["ranks"]]
                r["gpu_uuids"] = _gpus(e)
                r.update(_energy(e))
                ref = base.get(b)
                if ref is not None and cfg_dir != base_dir:
                    t1 = _steps(ref)["warm_step_median"]
                    if not emulated and t1 and st["warm_step_median"]:
                        r["speedup"] = t1 / st["warm_step_median"]
                        r["efficiency"] = r["speedup"] / n
                    e1 = _energy(ref).get("warm_energy_j")
                    if e1 and r.get("warm_energy_j"):
                        r["energy_vs_1gpu"] = r["warm_energy_j"] / e1
                    if b not in ref_cache:
                        ref_cache[b] = (_frames(base_dir, b), _latents(base_dir, b))
                    rf, rl = ref_cache[b]
                    f, lat = _frames(cfg_dir, b), _latents(cfg_dir, b)
                    if f is not None and rf is not None and f.shape == rf.shape:
                        r["psnr_vs_1gpu_db"] = M.psnr(f, rf, data_range=255)
                        r["identical_frames"] = bool(np.array_equal(f, rf))
                    if lat is not None and rl is not None and lat.shape == rl.shape:
                        r["latent_rel_l2_vs_1gpu"] = M.rel_l2(lat, rl)
                rows.append(r)
    _against_own_cards(rows)
    return rows


def table(rows: list[dict]) -> str:
    """The text table: warm step (median after the first step) with its n, speed-up, efficiency, output vs one GPU;
    a warning line per reason for the rows that are not speed figures."""
    lines = [f"{'group':6s} {'backend':10s} {'config':28s} {'gpus':>4s} {'warm ms':>8s} {'n':>3s} {'first ms':>9s} "
             f"{'speedup':>7s} {'eff':>5s} {'PSNR dB':>8s} {'lat RL2':>9s}  kernels"]
    not_speed: dict = {}
    for r in rows:
        p = r.get("psnr_vs_1gpu_db")
        ps = "ident" if r.get("identical_frames") else ("" if p is None else f"{p:.2f}")
        warm = "emulated" if r["emulated"] else ("-" if r["warm_step_ms"] is None else f"{r['warm_step_ms']:.1f}")
        first = "emulated" if r["emulated"] else ("-" if r["first_step_ms"] is None else f"{r['first_step_ms']:.1f}")
        if not r["speed_figure"] and not r["emulated"]:
            not_speed.setdefault(r["why_not_speed"], []).append(f"{r['group']}/{r['backend']}/{r['config']}")
        lines.append(f"{r['group']:6s} {r['backend']:10s} {r['config']:28s} {r['gpus']:4d} {warm:>8s} "
                     f"{r['warm_step_n']:3d} {first:>9s} "
                     f"{(format(r['speedup'], '.2f') + 'x') if 'speedup' in r else '':>7s} "
                     f"{format(r['efficiency'], '.2f') if 'efficiency' in r else '':>5s} {ps:>8s} "
                     f"{format(r['latent_rel_l2_vs_1gpu'], '.2e') if 'latent_rel_l2_vs_1gpu' in r else '':>9s}  "
                     f"{r['kernels']}")
    lines.append("warm ms = median of the steps after the first (n of them); first ms = the first step alone")
    for (g, b), cs in _card_steps(rows).items():
        lines.append(f"one-GPU warm step by card ({g}/{b}, 1gpu_* folders): "
                     + ", ".join(f"{u[:12]} {t:.1f} ms" for u, t in cs.items())
                     + f"; slowest/fastest {max(cs.values()) / min(cs.values()):.4f}")
    own = [r for r in rows if "speedup_vs_slowest_gpu" in r]
    if own:
        lines.append("against the one-GPU renders on its own cards (1gpu_* folders; an N-GPU step runs at its slowest "
                     "card's pace):")
        for r in own:
            lines.append(f"  {r['group']}/{r['backend']}/{r['config']} ({r['config_dir']}): "
                         f"{r['speedup_vs_slowest_gpu']:.3f}x vs its slowest card, {r['speedup_vs_mean_gpu']:.3f}x vs "
                         f"their mean (cards' one-GPU warm ms: {', '.join(f'{t:.1f}' for t in r['by_gpu_warm_ms'])})")
    energy = [r for r in rows if r.get("warm_energy_j") is not None]
    if energy:
        lines.append("energy of a warm step, every card's joules added (NVML; the mean of the steps after the first), "
                     "and each card's power, SM clock and share of it power-capped:")
        for r in energy:
            rel = f" = {r['energy_vs_1gpu']:.3f}x one GPU's" if "energy_vs_1gpu" in r else ""
            cards = "; ".join(f"{w} W, {c} MHz, capped {s}" for w, c, s in zip(
                r["warm_power_w_per_card"], r["warm_sm_clock_mhz_per_card"], r["warm_capped_share_per_card"]))
            lines.append(f"  {r['group']}/{r['backend']}/{r['config']} ({r['config_dir']}): "
                         f"{r['warm_energy_j']:.1f} J{rel} ({cards})")
    lines += [f"warning: not a speed figure ({why}): {', '.join(names)}" for why, names in not_speed.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("res", type=Path)
    ap.add_argument("-o", "--output", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not args.res.is_dir():
        print(f"error: {args.res} is not a directory", file=sys.stderr)
        return 2
    rows = summarize(args.res)
    print(table(rows))
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
