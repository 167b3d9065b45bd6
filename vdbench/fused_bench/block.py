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
  gate).type_as(x)`` (one pass more eagerly), against the same kernel;
* ``norm_modulate`` (norm1, norm3): the norm as diffusers computes it -- ``FP32LayerNorm(x.float())``: the fp32 copy,
  torch's layer norm of it -- then the ``modulate`` kernel (the fused block without fused norms), against
  :func:`vdbench.kernels.block.layer_norm_stats` of the bf16 ``x`` and :func:`vdbench.kernels.block.norm_modulate`;
* ``norm`` (norm2, with a weight and a bias): diffusers' ``FP32LayerNorm(x.float()).type_as(x)`` against the
  statistics and :func:`vdbench.kernels.block.norm_affine` (its product-sum in the form that equals torch's: one
  fused multiply-add where torch's build contracts it, ``probes``' ``affine_fma``).

Each is timed with CUDA events after a warm-up (:func:`vdbench.timing.sample_ms`: the first call apart, L2 flushed
between calls), and each fused output is compared with the eager one bit for bit (exit 1 if any differs). The JSON
gives the calls per step (two guidance branches, every block) and the per-step totals, the time saved a step by all
the passes and by the two norm passes alone (what fusing the norms adds to the fused block) with the bytes that
saves, and ``probes``: whether PyTorch's layer norm of the bf16 hidden state computes the statistics it computes for
the fp32 copy, whether ``(x - mean) * rstd`` from them is its fp32 output, which of its kernels each call takes
(``paths``) and whether its affine is one fused multiply-add -- what the block forward's first-call check decides the
fused norms by. CPU: not a speed figure (``speed_figure`` false), and the kernels run under Triton's interpreter
only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ..helptext import DefaultsHelpFormatter

from .rows import add_options, finish, print_rows, timed_row

#: name -> (tokens of one call, model width, blocks)
SHAPES = {"wan13": (32760, 1536, 30), "wan14": (75600, 5120, 40), "tiny": (48, 64, 2)}
#: bytes per element of the hidden state each form moves: eager (every pass's reads and writes), fused. The norms:
#: the fp32 copy (2 + 4), torch's layer norm of it (4 + 4), the modulate kernel or the cast (4 + 2), against torch's
#: layer norm of the bf16 x for its statistics (2 + its bf16 output 2) and the kernel (2 + 2)
BYTES = {"modulate": (4 + 4 + 4 + 4 + 4 + 2, 4 + 2), "residual": (2 + 4 + 2 + 4 + 4 + 4 + 4 + 4 + 2, 2 + 2 + 2),
         "residual_ffn": (2 + 4 + 4 + 4 + 2 + 4 + 4 + 4 + 4 + 4 + 2, 2 + 2 + 2),
         "norm_modulate": (2 + 4 + 4 + 4 + 4 + 2, 2 + 2 + 2 + 2), "norm": (2 + 4 + 4 + 4 + 4 + 2, 2 + 2 + 2 + 2)}
#: calls per block of each pass
PER_BLOCK = {"modulate": 2, "residual": 1, "residual_ffn": 1, "norm_modulate": 2, "norm": 1}
#: the passes whose eager form is the fused block's without fused norms: what fusing the norms saves
NORMS = ("norm_modulate", "norm")
EPS = 1e-6  # Wan's


def diffusers_chunks(table, temb):
    """``scale_shift_table + temb.float()`` in six chunks, as diffusers' ``WanTransformerBlock.forward`` makes them."""
    if temb.ndim == 4:
        return [c.squeeze(2) for c in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return list((table + temb.float()).chunk(6, dim=1))


def probes(x, weight, bias) -> dict:
    """Whether ``native_layer_norm`` of the bf16 ``x`` gives the mean and rstd it gives for ``x.float()``, whether
    ``rstd * (x - mean)`` from them is ``F.layer_norm(x.float())`` (no affine, Wan's norm1 / norm3) bit for bit, which
    of torch's kernels each call takes, and whether torch's affine (norm2's) is ``weight * n + bias`` as one fused
    multiply-add or as two roundings (:func:`vdbench.kernels.block.norm_affine`'s two forms, written in fp32)."""
    from ..kernels.block import layer_norm_paths, norm_affine

    d = x.shape[-1]
    _, mean16, rstd16 = torch.native_layer_norm(x, (d,), None, None, EPS)
    want, mean32, rstd32 = torch.native_layer_norm(x.float(), (d,), None, None, EPS)
    same = bool(torch.equal(mean16.float(), mean32) and torch.equal(rstd16.float(), rstd32))
    affine = torch.native_layer_norm(x.float(), (d,), weight, bias, EPS)[0]
    stats = (mean32.reshape(-1), rstd32.reshape(-1))
    forms = {f: bool(torch.equal(norm_affine(x, *stats, weight, bias, fma=f, out=torch.empty_like(affine)), affine))
             for f in (True, False)}
    return {"stats_dtype": str(mean16.dtype).replace("torch.", ""), "bf16_stats_equal": same,
            "norm_from_stats_equal": bool(torch.equal(rstd32 * (x.float() - mean32), want)),
            "paths": layer_norm_paths(x, weight, bias), "affine_fma": forms[True],
            "affine_two_roundings": forms[False]}


def bench(name: str, ranks: int, per_token: bool, device, budget_s: float) -> tuple[list[dict], dict]:
    from ..kernels.block import gated_residual, layer_norm_stats, modulate, norm_affine, norm_modulate

    tokens, d, blocks = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(1, tokens, d, device=device, generator=g) * 4).bfloat16()
    y = (torch.randn(1, tokens, d, device=device, generator=g) * 4).bfloat16()
    table = torch.randn(1, 6, d, device=device, generator=g) / d ** 0.5
    temb = torch.randn(1, *((tokens,) if per_token else ()), 6, d, device=device, generator=g).bfloat16()
    weight = 1 + torch.randn(d, device=device, generator=g) / 4  # norm2's, kept in fp32
    bias = torch.randn(d, device=device, generator=g) / 4
    norm = torch.nn.functional.layer_norm(x.float(), (d,), eps=EPS)
    rows = []
    stats_of = layer_norm_stats
    if layer_norm_stats(x[:, :1], EPS)[0].dtype != torch.float32:  # a CPU: bf16 statistics (a render refuses)
        stats_of = _stats_of_the_fp32_copy

    def row(kind, form, n, fn, ref):
        calls = PER_BLOCK[kind] * blocks * 2  # both guidance branches (a rank: its share of each)
        moved = n * d * BYTES[kind][form.startswith("fused")]
        got, out = timed_row(fn, device, budget_s, moved=moved, calls=calls,
                             check=None if ref is None else lambda o: torch.equal(o, ref),
                             shape=name, form=form, tokens=n, dim=d, per_token=per_token, bytes_per_step=moved * calls,
                             **{"pass": kind})
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
        ref = row("norm_modulate", "eager" + suffix, n,
                  lambda: modulate(F.layer_norm(xs.float(), (d,), eps=EPS), table[0], ts, 0, 1, xs.dtype), None)
        row("norm_modulate", "fused" + suffix, n,
            lambda: norm_modulate(xs, *stats_of(xs, EPS), table[0], ts, 0, 1), ref)
        ref = row("norm", "eager" + suffix, n, lambda: F.layer_norm(xs.float(), (d,), weight, bias, EPS).type_as(xs),
                  None)
        fma = torch.equal(norm_affine(xs, *stats_of(xs, EPS), weight, bias), ref)  # the form the check keeps
        row("norm", "fused" + suffix, n, lambda: norm_affine(xs, *stats_of(xs, EPS), weight, bias, fma=fma), ref)
    return rows, {**probes(x, weight, bias), "fused_norm_stats": "the bf16 tensor's" if stats_of is layer_norm_stats
                  else "the fp32 copy's (torch's of the bf16 tensor aren't fp32 here: a render runs diffusers' norms)"}


def _stats_of_the_fp32_copy(x, eps):
    _, mean, rstd = torch.native_layer_norm(x.float(), x.shape[-1:], None, None, eps)
    return mean.reshape(-1), rstd.reshape(-1)


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
    print_rows(rows, lambda r: f"{r['shape']:6s} {r['pass']:13s} {r['form']:9s}")
    saved, norms, norm_bytes = {}, {}, {}
    for r in rows:
        key = (r["shape"], r["form"].partition("_")[2])
        sign = -1 if r["form"].startswith("fused") else 1
        saved[key] = saved.get(key, 0.0) + sign * (r["per_step_ms"] or 0.0)
        if r["pass"] in NORMS:
            norms[key] = norms.get(key, 0.0) + sign * (r["per_step_ms"] or 0.0)
            norm_bytes[key] = norm_bytes.get(key, 0) + sign * r["bytes_per_step"]
    for (shape, part), ms in saved.items():
        print(f"{shape} {part or 'one GPU'}: the fused kernels save {ms:.1f} ms a step (the passes above, both "
              f"branches), the fused norms {norms[shape, part]:.1f} ms of it ({norm_bytes[shape, part] / 1e9:.1f} GB "
              "a step not moved)")
    for shape, c in checks.items():
        print(f"{shape} layer norm of bf16 vs fp32 input: {c}")

    def by_name(d):
        return {f"{s}{'_' + p if p else ''}": v for (s, p), v in d.items()}

    return finish(rows, device, args.output, probes=checks, per_step_saved_ms=by_name(saved),
                  norm_saved_ms=by_name(norms), norm_saved_bytes=by_name(norm_bytes))

if __name__ == "__main__":
    raise SystemExit(main())
