"""SageAttention 2 on BSHD memory: the "NHD" call vs the "HND" call on the same tensors (GPU, sageattention >= 2).

Why: diffusers' dispatcher hands attention BSHD tensors. Called with ``tensor_layout="HND"`` on their BHSD views,
sageattention returns a BHSD tensor the caller then copies back to BSHD; called with ``"NHD"`` on the BSHD memory,
the output is BSHD already. This check says, per real shape, whether both calls give the same output (and how far
each is from exact attention on sampled heads and rows), what each costs (CUDA events, median of REPS after a
warm-up, the copy back to BSHD included for "HND"), and what ``vdbench.backends.sage2.tensor_layout`` picks.

    python3 bench/lab/check_sage_layout.py --out DIR [--shapes wan2.1-1.3b-480p,wan2.1-14b-720p,cogvideox-2b]

A broken build shows here as rel L2 far above the kernels' ~4e-2 and both layouts uncorrelated (nhd_vs_hnd ~1.41):
the 2.2.0 tag did exactly that on an H200 (docs/gpu_results/h200/2026-11-23_sage_tag_build/).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from vdbench.backends import sage2
from vdbench.helptext import DefaultsHelpFormatter
from vdbench.measure.quality import rel_l2
from vdbench.timing import fixed_ms, spread, system_info

SHAPES = {"wan2.1-1.3b-480p": (12, 32760, 128), "wan2.1-14b-720p": (40, 75600, 128), "cogvideox-2b": (30, 17776, 64),
          "wan-cross-512": (40, 75600, 128, 512), "tiny": (2, 256, 64), "tiny-cross": (2, 256, 64, 128)}
DEFAULT_SHAPES = "wan2.1-1.3b-480p,wan2.1-14b-720p,cogvideox-2b,wan-cross-512"


def _timed(fn, reps: int, device: torch.device) -> dict:
    """vdbench.timing.spread of ``reps`` calls after one warm-up (the project's one median and p20/p80)."""
    return spread(fixed_ms(fn, device, reps=reps, warmup=1))


def check(name: str, shape: tuple, reps: int, device: torch.device) -> dict:
    import sageattention

    h, s, d = shape[:3]
    skv = shape[3] if len(shape) > 3 else s
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((1, s, h, d), generator=g, device=device).to(torch.bfloat16)  # BSHD memory, as diffusers has it
    k = (torch.randn((1, skv, h, d), generator=g, device=device) + 2.0 * torch.randn((1, 1, h, d), generator=g,
                                                                                  device=device)).to(torch.bfloat16)
    v = torch.randn((1, skv, h, d), generator=g, device=device).to(torch.bfloat16)
    qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))  # BHSD views, what the backend receives
    picked = sage2.tensor_layout(qv, kv, vv)
    nhd = lambda: sageattention.sageattn(q, k, v, tensor_layout="NHD", is_causal=False)  # noqa: E731
    hnd = lambda: sageattention.sageattn(qv, kv, vv, tensor_layout="HND", is_causal=False)  # noqa: E731
    hnd_back = lambda: hnd().transpose(1, 2).contiguous()  # noqa: E731  # what the caller then needs (BSHD)
    hnd_cont = lambda: sageattention.sageattn(*(t.contiguous() for t in (qv, kv, vv)),  # noqa: E731
                                              tensor_layout="HND", is_causal=False)
    o_nhd = nhd().transpose(1, 2)  # -> BHSD view
    o_hnd = hnd()
    o_cont = hnd_cont()
    heads, rows = list(range(0, h, max(1, h // 4)))[:4], torch.arange(0, s, max(1, s // 1024), device=device)[:1024]
    qs = qv[:, heads][:, :, rows].float()
    ref = F.scaled_dot_product_attention(qs, kv[:, heads].float(), vv[:, heads].float())
    pick = lambda o: o[:, heads][:, :, rows].float()  # noqa: E731
    row = dict(shape=name, H=h, S=s, S_kv=skv, D=d, picked_layout=picked,
               rel_l2_nhd=rel_l2(pick(o_nhd), ref), rel_l2_hnd_views=rel_l2(pick(o_hnd), ref),
               rel_l2_hnd_contiguous=rel_l2(pick(o_cont), ref),
               nhd_equals_hnd=bool(torch.equal(o_nhd, o_hnd)), nhd_vs_hnd_rel_l2=rel_l2(o_nhd.float(), o_hnd.float()),
               nan_nhd=bool(o_nhd.isnan().any()))
    for key, fn in (("nhd", nhd), ("hnd_views_plus_copy_back", hnd_back), ("hnd_views", hnd)):
        t = _timed(fn, reps, device)
        row[f"ms_{key}"], row[f"ms_{key}_p20"], row[f"ms_{key}_p80"], row["n"] = t["median"], t["p20"], t["p80"], t["n"]
    row["timer"] = "CUDA events" if device.type == "cuda" else "host clock: not a speed figure"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for sage_layout.json")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per function and shape (after one warm-up)")
    ap.add_argument("--device", default="cuda", help="cpu: the plumbing only (a stand-in package), not speed")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.shapes.split(","):
        try:
            rows.append(check(name, SHAPES[name], a.reps, device))
        except Exception as e:  # one shape failing keeps the others; the reason is the row
            rows.append(dict(shape=name, error=f"{type(e).__name__}: {e}"))
        print(json.dumps(rows[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out / "sage_layout.json").write_text(json.dumps(dict(system=system_info(a.device), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
