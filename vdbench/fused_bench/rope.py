"""Wan's RoPE: diffusers' eager expressions against the fused kernel (``--fused_rope``), at the real models' shapes.

    python3 bench/rope_bench.py -o outputs/rope.json
    python3 bench/rope_bench.py --shapes wan13 --ranks 2     # also the Ulysses-2 form: a rank's tokens, into the
                                                            # exchange's send layout

For each shape (Wan 2.1 1.3B 480p x81: 32760 tokens x 12 heads x 128; 14B 720p x81: 75600 x 40 x 128), Q-sized
random bf16 inputs (a view of the projection's output, as the processor has them) and the frequencies of diffusers'
own ``WanRotaryPosEmbed`` for the model's latent grid:

* ``eager``: diffusers 0.42's ``apply_rotary_emb`` as written (four products, two sums, two strided casts);
* ``fused``: :func:`vdbench.kernels.rope.rope_pairs`;
* with ``--ranks P``: the same on one rank's S / P tokens written into the Ulysses send layout, eagerly as the Wan
  family's processor does it today (``rope_into``) and fused.

Each is timed with CUDA events after a warm-up (:func:`vdbench.timing.sample_ms`: the first call apart, L2 flushed
between calls), and the fused output is compared with the eager one bit for bit. A step of the model runs the RoPE
twice per self-attention call (Q and K): the JSON gives the per-step estimate too (calls per step x the median).
CPU: not a speed figure (``speed_figure`` false), and the kernel runs under Triton's interpreter only.
"""

from __future__ import annotations

import argparse

import torch

from ..helptext import DefaultsHelpFormatter

from .rows import add_options, finish, print_rows, timed_row

#: name -> (frames, height, width of the token grid (latent / patch), heads, head dim, layers): one self-attention call
SHAPES = {"wan13": (21, 30, 52, 12, 128, 30), "wan14": (21, 45, 80, 40, 128, 40), "tiny": (3, 4, 4, 2, 16, 2)}


def diffusers_rope(x, freqs_cos, freqs_sin):
    """diffusers 0.42's ``WanAttnProcessor`` ``apply_rotary_emb``, as written there."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def frequencies(f, h, w, d, device):
    """diffusers' ``WanRotaryPosEmbed`` of a latent (1, C, f, 2h, 2w) with patch (1, 2, 2): (1, f*h*w, 1, d) x 2."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rope = WanRotaryPosEmbed(attention_head_dim=d, patch_size=(1, 2, 2), max_seq_len=1024).to(device)
    return rope(torch.empty(1, 1, f, 2 * h, 2 * w, device=device))


def bench(name: str, ranks: int, device, budget_s: float) -> list[dict]:
    from ..families.wan import rope_into
    from ..kernels.rope import rope_pairs

    f, h, w, heads, d, layers = SHAPES[name]
    s = f * h * w
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, s, heads * d, device=device, dtype=torch.bfloat16, generator=g).unflatten(2, (heads, d))
    cos, sin = frequencies(f, h, w, d, device)
    rows = []

    def row(form, tokens, fn, ref, out):
        moved = tokens * heads * d * 2 * 2 + tokens * d * 4 * 2  # x in, out written (bf16); cos, sin (fp32) once
        calls = 2 * 2 * layers  # Q and K, both guidance branches, every layer (a rank: its share of each)
        rows.append(timed_row(fn, device, budget_s, moved=moved, calls=calls,
                              check=None if ref is None else lambda _: torch.equal(out(), ref),
                              shape=name, form=form, tokens=tokens, heads=heads, head_dim=d)[0])

    want = diffusers_rope(x, cos, sin)
    fused = torch.empty_like(x)
    row("eager", s, lambda: diffusers_rope(x, cos, sin), None, None)
    row("fused", s, lambda: rope_pairs(x, cos, sin, out=fused), want, lambda: fused)
    if ranks > 1:
        part = s // ranks
        xs, cs, ss = x[:, :part], cos[:, :part].unsqueeze(2), sin[:, :part].unsqueeze(2)
        buf = torch.empty(ranks, 1, part, heads // ranks, d, device=device, dtype=x.dtype)
        dst = buf.permute(1, 2, 0, 3, 4)
        src = xs.unflatten(2, (ranks, heads // ranks))
        ref = want[:, :part]
        row(f"rank_eager_u{ranks}", part, lambda: rope_into(src, cs, ss, dst), ref,
            lambda: dst.reshape(1, part, heads, d))
        row(f"rank_fused_u{ranks}", part, lambda: rope_pairs(src, cs, ss, out=dst), ref,
            lambda: dst.reshape(1, part, heads, d))
    return rows


def build_parser() -> argparse.ArgumentParser:
    return add_options(argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter),
                       SHAPES, ranks=2)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [r for name in args.shapes for r in bench(name, args.ranks, device, args.budget_s)]
    print_rows(rows, lambda r: f"{r['shape']:6s} {r['form']:16s}")
    return finish(rows, device, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
