#!/usr/bin/env python3
"""How local is the captured attention? The share of each query's softmax mass inside a sparse pattern's window.

    python bench/lab/window_mass.py outputs/x/captures --grid 21x30x52 --pattern sta --pattern radial -o mass.json
    python bench/lab/window_mass.py CAPTURES --grid 21x45x80 --pattern sta:window=3x5x5 --device cuda --max_queries 2048

Why: a sparse pattern is only as good as the attention it keeps. For every self-attention capture on the grid
(``run_wan.py --save_inputs --max_captures N``; joint attention for CogVideoX with ``--grid FxHxW+T``) and every
head, sampled queries' softmax rows are computed exactly (fp32, the capture's scale) and split into the mass on the
keys the pattern keeps and the rest. Beside it, ``key_share`` is the share of keys the pattern keeps -- the mass a
query would put inside if it attended uniformly. A trained video model concentrates its mass near the query
(mass >> key_share: the pattern loses little); random weights do not (mass ~ key_share: the pattern drops most of
the attention), which is why quality figures of sparse patterns on random-weight models are a lower bound.

Printed per capture and pattern: the per-head mean of the in-window mass (the queries' mean, with the heads'
min / max), the key share and their ratio; JSON rows per head with the queries' mean, median and p10.
Runs on a CPU (small captures, the test) or a GPU (``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from vdbench.capture import CaptureError, list_captures, load_capture
from vdbench.sparse import TokenGrid, layout_for, parse_grid, parse_spec, pattern_cells
from vdbench.helptext import DefaultsHelpFormatter

_SELF_KINDS = ("self", "joint")


def token_cells(spec, grid: TokenGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """(cell of each token in the model's order, cell x cell allow matrix) of a pattern on a grid."""
    layout = layout_for(spec, grid)
    cell, allow, _ = pattern_cells(parse_spec(spec), layout)
    return cell[layout.inverse], allow


def window_mass(q: torch.Tensor, k: torch.Tensor, cells: torch.Tensor, allow: torch.Tensor, queries: torch.Tensor,
                scale: float, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, key_share), each (heads, len(queries)): the softmax mass of each sampled query inside the pattern,
    and the share of keys the pattern keeps for it. ``q``, ``k``: (heads, seq, dim) of one sample."""
    heads = q.shape[0]
    masses, shares = [], []
    allow = allow.to(q.device)
    cells = cells.to(q.device)
    for start in range(0, len(queries), chunk):
        idx = queries[start:start + chunk].to(q.device)
        keep = allow[cells[idx]][:, cells]  # (n, seq) bool: the keys the pattern keeps for these queries
        scores = torch.einsum("hnd,hsd->hns", q[:, idx].float(), k.float()) * scale
        p = torch.softmax(scores, dim=-1)
        masses.append((p * keep[None]).sum(-1))
        shares.append(keep.float().mean(-1)[None].expand(heads, -1))
    return torch.cat(masses, 1), torch.cat(shares, 1)


def analyse(files, grid: TokenGrid, patterns: list[str], max_queries: int, device, seed: int = 0):
    """JSON rows (one per capture, pattern and head) and the printed summary lines."""
    rows, lines, skipped = [], [], []
    cells = {p: token_cells(p, grid) for p in patterns}
    for f in files:
        try:
            q, k, _, meta = load_capture(f)
        except CaptureError as e:
            skipped.append(f"{Path(f).name}: {e}")
            continue
        order = (meta.get("args") or {}).get("tile_order")
        if order:
            skipped.append(f"{Path(f).name}: its tokens are in the tile order of {order}, not the model's (capture "
                           "with a dense backend)")
            continue
        if meta.get("kind") not in _SELF_KINDS or q.shape[2] != grid.seq_len or k.shape[2] != grid.seq_len:
            skipped.append(f"{Path(f).name}: {meta.get('kind')} attention of {q.shape[2]}x{k.shape[2]} tokens, not "
                           f"self-attention on the grid {grid} ({grid.seq_len} tokens)")
            continue
        scale = (meta.get("args") or {}).get("scale") or q.shape[-1] ** -0.5
        g = torch.Generator().manual_seed(seed)
        n = grid.seq_len
        queries = torch.randperm(n, generator=g)[:max_queries].sort().values if max_queries and max_queries < n \
            else torch.arange(n)
        for b in range(q.shape[0]):
            qb, kb = q[b].to(device), k[b].to(device)
            for pattern in patterns:
                mass, share = window_mass(qb, kb, *cells[pattern], queries, scale)
                per_head = mass.mean(1)
                for h in range(mass.shape[0]):
                    m = mass[h].cpu()
                    rows.append({"file": Path(f).name, "layer": meta.get("layer"), "step": meta.get("step"),
                                 "sample": b, "pattern": parse_spec(pattern).canonical(), "head": h,
                                 "queries": len(queries), "mass_mean": m.mean().item(),
                                 "mass_median": m.median().item(), "mass_p10": m.quantile(0.1).item(),
                                 "key_share": share[h].mean().item()})
                ks = share.mean().item()
                lines.append(f"{Path(f).name} [{meta.get('layer')}, step {meta.get('step')}] {pattern}: mass inside "
                             f"{per_head.mean().item():.3f} (heads {per_head.min().item():.3f}-"
                             f"{per_head.max().item():.3f}), key share {ks:.3f}, ratio "
                             f"{per_head.mean().item() / ks:.2f} ({len(queries)} queries x {mass.shape[0]} heads)")
    return rows, lines, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("input_dir", help="captures (run_wan.py --save_inputs)")
    p.add_argument("--grid", required=True, type=parse_grid, help="the token grid of the self-attention calls")
    p.add_argument("--pattern", action="append", help="a sparse pattern with options (repeatable; default: sta)")
    p.add_argument("--max_queries", type=int, default=2048, help="queries sampled per capture (0: all)")
    p.add_argument("--device", default="cpu", help="where the scores are computed")
    p.add_argument("-o", "--output", help="JSON rows per capture, pattern and head")
    args = p.parse_args(argv)
    patterns = args.pattern or ["sta"]
    for pattern in patterns:
        parse_spec(pattern)  # a bad option string fails before any capture is read
    files = list_captures(args.input_dir)
    if not files:
        print(f"error: no capture files (attn_*.pt) in {args.input_dir}", file=sys.stderr)
        return 2
    rows, lines, skipped = analyse(files, args.grid, patterns, args.max_queries, torch.device(args.device))
    print("\n".join(lines))
    for s in skipped:
        print(f"skipped: {s}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps({"grid": str(args.grid), "patterns": patterns, "rows": rows,
                                                 "skipped": skipped}, indent=1))
    if not rows:
        print(f"error: no self-attention capture on the grid {args.grid}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
