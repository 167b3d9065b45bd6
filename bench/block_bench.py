#!/usr/bin/env python3
"""A Wan block's elementwise passes: diffusers' eager expressions against the fused kernels (``--fused_block``), at the
real models' shapes.

    python3 bench/block_bench.py -o outputs/block.json
    python3 bench/block_bench.py --shapes wan13 --ranks 2     # also a Ulysses-2 rank's share of the tokens

For each shape (Wan 2.1 1.3B 480p x81: 32760 tokens x 1536; 14B 720p x81: 75600 x 5120; with ``--ranks P`` also a
rank's S / P tokens), random bf16 hidden states and branch outputs, the block's fp32 modulation table and a bf16
``temb`` (one row per sample, as Wan 2.1 and 2.2 A14B; ``--per_token``: one per token, as Wan 2.2 TI2V):

* ``modulate``: diffusers 0.42's ``(norm(x.float()) * (1 + scale) + shift).type_as(x)`` on the norm's fp32 output,
  against :func:`vdbench.kernels.block.modulate` (the chunks' ``table + temb`` inside);
* ``residual``: the self-attention's ``(x.float() + out * gate).type_as(x)`` against
  :func:`vdbench.kernels.block.gated_residual`; ``residual_ffn``: the feed-forward's ``(x.float() + ff.float() *
  gate).type_as(x)`` (one pass more eagerly), against the same kernel.

Each is timed with CUDA events after a warm-up (:func:`vdbench.timing.sample_ms`: the first call apart, L2 flushed
between calls), and each fused output is compared with the eager one bit for bit (exit 1 if any differs). The JSON
gives the calls per step (two guidance branches, every block) and the per-step totals, and ``probes``: whether
PyTorch's layer norm of the bf16 hidden state computes the statistics it computes for the fp32 copy (a fused norm
could then start from the bf16 tensor and stay exact). CPU: not a speed figure (``speed_figure`` false), and the
kernels run under Triton's interpreter only.
"""

from __future__ import annotations

import argparse

import torch

from vdbench.helptext import DefaultsHelpFormatter

try:  # imported with the checkout on the path (the tests, a suite's PYTHONPATH)
    from bench.kernel_rows import add_options, finish, print_rows, timed_row
except ModuleNotFoundError as e:
    if e.name != "bench":
        raise
    from kernel_rows import add_options, finish, print_rows, timed_row  # run by path: bench/ is first on sys.path

#: name -> (tokens of one call, model width, blocks)
SHAPES = {"wan13": (32760, 1536, 30), "wan14": (75600, 5120, 40), "tiny": (48, 64, 2)}
#: bytes per element of the hidden state each form moves: eager (every pass's reads and writes), fused
BYTES = {"modulate": (4 + 4 + 4 + 4 + 4 + 2, 4 + 2), "residual": (2 + 4 + 2 + 4 + 4 + 4 + 4 + 4 + 2, 2 + 2 + 2),
         "residual_ffn": (2 + 4 + 4 + 4 + 2 + 4 + 4 + 4 + 4 + 4 + 2, 2 + 2 + 2)}
#: calls per block of each pass
PER_BLOCK = {"modulate": 2, "residual": 1, "residual_ffn": 1}


def diffusers_chunks(table, temb):
    """``scale_shift_table + temb.float()`` in six chunks, as diffusers' ``WanTransformerBlock.forward`` makes them."""
    if temb.ndim == 4:
        return [c.squeeze(2) for c in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return list((table + temb.float()).chunk(6, dim=1))


def probes(x) -> dict:
    """Whether ``native_layer_norm`` of the bf16 ``x`` gives the mean and rstd it gives for ``x.float()``, and whether
    ``rstd * (x - mean)`` from them is ``F.layer_norm(x.float())`` (no affine, Wan's norm1 / norm3) bit for bit."""
    d = x.shape[-1]
    _, mean16, rstd16 = torch.native_layer_norm(x, (d,), None, None, 1e-6)
    want, mean32, rstd32 = torch.native_layer_norm(x.float(), (d,), None, None, 1e-6)
    same = bool(torch.equal(mean16.float(), mean32) and torch.equal(rstd16.float(), rstd32))
    return {"stats_dtype": str(mean16.dtype).replace("torch.", ""), "bf16_stats_equal": same,
            "norm_from_stats_equal": bool(torch.equal(rstd32 * (x.float() - mean32), want))}


def bench(name: str, ranks: int, per_token: bool, device, budget_s: float) -> tuple[list[dict], dict]:
    from vdbench.kernels.block import gated_residual, modulate

    tokens, d, blocks = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(1, tokens, d, device=device, generator=g) * 4).bfloat16()
    y = (torch.randn(1, tokens, d, device=device, generator=g) * 4).bfloat16()
    table = torch.randn(1, 6, d, device=device, generator=g) / d ** 0.5
    temb = torch.randn(1, *((tokens,) if per_token else ()), 6, d, device=device, generator=g).bfloat16()
    norm = torch.nn.functional.layer_norm(x.float(), (d,), eps=1e-6)
    rows = []

    def row(kind, form, n, fn, ref):
        calls = PER_BLOCK[kind] * blocks * 2  # both guidance branches (a rank: its share of each)
        moved = n * d * BYTES[kind][form.startswith("fused")]
        got, out = timed_row(fn, device, budget_s, moved=moved, calls=calls,
                             check=None if ref is None else lambda o: torch.equal(o, ref),
                             shape=name, form=form, tokens=n, dim=d, per_token=per_token, **{"pass": kind})
        rows.append(got)
        return out

    for part in [1] + ([ranks] if ranks > 1 else []):
        n = tokens // part
        xs, ys, ns = x[:, :n], y[:, :n], norm[:, :n]
        ts = temb[:, :n] if per_token else temb
        c = diffusers_chunks(table, ts)
        suffix = f"_u{part}" if part > 1 else ""
        ref = row("modulate", "eager" + suffix, n, lambda: (ns * (1 + c[1]) + c[0]).type_as(xs), None)
        row("modulate", "fused" + suffix, n, lambda: modulate(ns, table[0], ts, 0, 1, xs.dtype), ref)
        ref = row("residual", "eager" + suffix, n, lambda: (xs.float() + ys * c[2]).type_as(xs), None)
        row("residual", "fused" + suffix, n, lambda: gated_residual(xs, ys, table[0], ts, 2), ref)
        ref = row("residual_ffn", "eager" + suffix, n, lambda: (xs.float() + ys.float() * c[5]).type_as(xs), None)
        row("residual_ffn", "fused" + suffix, n, lambda: gated_residual(xs, ys, table[0], ts, 5), ref)
    return rows, probes(x)


def build_parser() -> argparse.ArgumentParser:
    p = add_options(argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter),
                    SHAPES, ranks=1)
    p.add_argument("--per_token", action="store_true", help="temb one row per token (Wan 2.2 TI2V's form)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, checks = [], {}
    for name in args.shapes:
        got, checks[name] = bench(name, args.ranks, args.per_token, device, args.budget_s)
        rows += got
    print_rows(rows, lambda r: f"{r['shape']:6s} {r['pass']:12s} {r['form']:9s}")
    saved = {}
    for r in rows:
        key = (r["shape"], r["form"].partition("_")[2])
        sign = -1 if r["form"].startswith("fused") else 1
        saved[key] = saved.get(key, 0.0) + sign * (r["per_step_ms"] or 0.0)
    for (shape, part), ms in saved.items():
        print(f"{shape} {part or 'one GPU'}: the fused kernels save {ms:.1f} ms a step (the passes above, both "
              "branches)")
    for shape, c in checks.items():
        print(f"{shape} layer norm of bf16 vs fp32 input: {c}")
    return finish(rows, device, args.output, probes=checks,
                  per_step_saved_ms={f"{s}{'_' + p if p else ''}": ms for (s, p), ms in saved.items()})


if __name__ == "__main__":
    raise SystemExit(main())
