"""Neighborhood attention on the latent token grid: NATTEN's 3-D fused kernels (``natten``), as the sparse backend
``natten`` (``natten:window=TxHxW``).

What the package offers (read from natten 0.21.7): ``natten.na3d(query, key, value, kernel_size, stride=1,
dilation=1, is_causal=False, scale=None, additional_keys=None, additional_values=None, backend=None, ...,
return_lse=False)`` on heads-last tensors (batch, X, Y, Z, heads, head_dim) -- here (batch, frames, height, width,
heads, head_dim); every query attends the ``kernel_size`` window of grid tokens around it (shifted inwards at the
grid's edges, so it always holds kernel_size tokens), plus ``additional_keys`` / ``additional_values`` (batch,
tokens, heads, head_dim) when given. ``kernel_size`` must be >= 2 and <= the grid along each axis. ``backend=None``
takes the best kernel that runs: Blackwell FNA (sm100/103, head dims <= 128), Hopper FNA (sm90, fp16 / bf16, head
dims 32, 64, 128, 256), the CUTLASS 2.x FNA (head dims a multiple of 8), then a FlexAttention path.
``natten.attention(q, k, v, scale=None)`` is its dense FMHA on (batch, tokens, heads, head_dim). On this package
index natten 0.21.7 is a source distribution: ``pip install natten`` compiles its CUDA extensions (nvcc, a long build).

Why it sits with the sparse patterns: like ``sta``, it is a statement about neighbours on the (frames, height,
width) latent grid, which a flat attention call does not know. So the entry carries a ``SparseUse`` and the patching
core gives every self / joint call the grid of the forward in progress, from the model family's grid hooks. Unlike
``sta`` it needs no tile order: NATTEN takes the tokens in the model's raster order, reshaped to the grid, so its
``SparseUse`` asks for the per-call form on the dense spec (``flex``: the hooks track the grid and permute nothing).

The window: ``natten:window=TxHxW``, the grammar of ``sta``'s option -- odd sizes (the window is centred on the
query), but counted in latent *tokens*, not tiles (NATTEN has no tiles). The default 17x23x23 is about the token
extent of ``sta``'s default, 3x3x3 tiles of 6x8x8 (18x24x24), made odd. A window wider than the grid along an axis is
cut to the grid there (every query then sees the whole axis, which is what the wider window means); an axis of one
token (a single latent frame) is refused, NATTEN's kernel size being at least 2.

Text tokens (CogVideoX's joint attention): video queries attend their window plus every text token (NATTEN's
additional keys), text queries attend every token (``natten.attention``), as ``sta`` treats them. A call with no grid
(cross-attention) runs dense on ``natten.attention`` and is counted under that label. The work figure counts token
pairs (NATTEN's own tiling is not modelled). There is no log-sum-exp form: ring attention splits the sequence, a
grid pattern needs it whole.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch

from vdbench.sparse import BlockStats, TokenGrid, parse_spec

from .registry import HALF, Backend, SparseUse, Option, UnsupportedCall, cuda, register, requires_package

ORDER = 37

DEFAULT_WINDOW = (17, 23, 23)
DENSE_KERNEL = "natten.attention"
_HINT = ("pip install natten; 0.21.7 is a source distribution here: it compiles NATTEN's CUDA extensions, which "
         "needs nvcc and a long build, NATTEN_CUDA_ARCH picking the architectures")
_NO_LSE = "the natten wrapper does not return NATTEN's log-sum-exp (grid patterns refuse ring attention)"
_WINDOW_HELP = "TxHxW latent tokens, odd ints >= 3 (the window is centred on the query token)"


def _parse_window(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise ValueError(f"window={text!r} is not {_WINDOW_HELP}")
    window = tuple(int(p) for p in parts)
    if any(w < 3 or w % 2 == 0 for w in window):
        raise ValueError(f"window={text!r}: every size must be odd and >= 3 ({_WINDOW_HELP}; NATTEN's kernel size is "
                         "at least 2, and an even window is not centred on its query)")
    return window  # type: ignore[return-value]


def _spell(window) -> str:
    return "x".join(map(str, window))


def kernel_label(window) -> str:
    return f"natten.na3d[window={_spell(window)}]"


def kernel_size(window, grid: TokenGrid) -> tuple[int, int, int]:
    """The window cut to ``grid`` along each axis (NATTEN refuses a kernel wider than the grid); UnsupportedCall
    for an axis of one token."""
    if min(grid.shape) < 2:
        raise UnsupportedCall(f"backend 'natten' needs at least 2 latent tokens along every axis of the grid (NATTEN's "
                              f"kernel size is >= 2), not {grid}")
    return tuple(min(w, n) for w, n in zip(window, grid.shape))  # type: ignore[return-value]


def _pairs(grid: TokenGrid, ks) -> BlockStats:
    """Token pairs the call computes: a video query its window's tokens and the text, a text query every token."""
    n, t, s = grid.video_tokens, grid.text_tokens, grid.seq_len
    computed = n * (ks[0] * ks[1] * ks[2] + t) + t * s
    return BlockStats(computed=computed, full=computed, partial=0, total=s * s, dense=s * s, sparse_call=True)


def _dense(q, k, v, scale):
    """``natten.attention`` on BHSD tensors (its layout is (batch, tokens, heads, head_dim))."""
    import natten

    out = natten.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


def _natten_attend(window):
    label = kernel_label(window)

    def attend(q, k, v, *, grid: Optional[TokenGrid], tile_ordered: bool = False, scale=None, is_causal=False):
        """BHSD in and out, tokens in the model's order. ``grid`` None or a cross-attention call: dense."""
        if is_causal:
            raise UnsupportedCall("backend 'natten' is bidirectional; a causal call cannot run under it")
        if tile_ordered:  # the entry's SparseUse asks for the model's order; tile order here is a wiring bug
            raise ValueError("backend 'natten' takes the tokens in the model's order, not a tile order")
        sq, sk = q.shape[2], k.shape[2]
        if grid is None or sq != sk:
            return _dense(q, k, v, scale), DENSE_KERNEL, BlockStats.dense_call(sq, sk)
        if sq != grid.seq_len:
            raise ValueError(f"backend 'natten': a self-attention call of {sq} tokens does not match the grid {grid} "
                             f"({grid.seq_len} tokens)")
        ks = kernel_size(window, grid)
        import natten

        b, h, _, d = q.shape
        lo, hi = grid.video_start, grid.video_start + grid.video_tokens

        def video(x):  # (B, H, S, D) -> (B, T, Hh, W, H, D): NATTEN's heads-last grid layout
            return x[:, :, lo:hi].transpose(1, 2).reshape(b, *grid.shape, x.shape[1], x.shape[-1])

        text = None
        if grid.text_tokens:
            text_idx = slice(0, lo) if grid.text_first else slice(hi, sq)
            text = tuple(x[:, :, text_idx].transpose(1, 2) for x in (q, k, v))
        out_v = natten.na3d(video(q), video(k), video(v), kernel_size=ks, scale=scale,
                            additional_keys=None if text is None else text[1],
                            additional_values=None if text is None else text[2])
        out_v = out_v.reshape(b, grid.video_tokens, h, d).transpose(1, 2)
        if text is not None:
            out_t = natten.attention(text[0], k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)
            out_v = torch.cat([out_t, out_v] if grid.text_first else [out_v, out_t], dim=2)
        return out_v.to(q.dtype), label, _pairs(grid, ks)

    return attend


def _needs_grid(q, k, v, *, scale=None, is_causal=False):
    raise UnsupportedCall("backend 'natten' needs the token grid of the call: install it into a Wan or CogVideoX "
                          "pipeline (vdbench.use_backend, --attention_type), or call its SparseUse.attend with a grid "
                          "(bench/bench_attention.py --grid FxHxW)")


def _grid_use(window) -> SparseUse:
    # the dense spec: the family's hooks give the grid and keep the model's token order (NATTEN reshapes, no tiles)
    return SparseUse(parse_spec("flex"), _natten_attend(window), once_per_forward=False)


def _bind(base: Backend, opts: dict) -> Backend:
    window = opts["window"]
    return dataclasses.replace(base, kernel=kernel_label(window), sparse=_grid_use(window),
                               description=f"{base.description.split(':')[0]}: window {_spell(window)} tokens")


register(Backend(
    "natten", f"NATTEN 3-D neighborhood attention on the latent grid: window {_spell(DEFAULT_WINDOW)} tokens",
    fn=_needs_grid, kernel=kernel_label(DEFAULT_WINDOW),
    constraints=(requires_package("natten", hint=_HINT), cuda(min_arch=(8, 0))),
    dtypes=HALF, head_dims=(32, 64, 128, 256), supports_causal=False, no_lse_reason=_NO_LSE,
    sparse=_grid_use(DEFAULT_WINDOW),
    options=(Option("window", DEFAULT_WINDOW, parse=_parse_window, spell=_spell, help=_WINDOW_HELP),),
    bind=_bind,
    notes="needs the token grid (Wan, CogVideoX); window in tokens, cut to the grid; not yet measured on the "
          "project's GPU"))
