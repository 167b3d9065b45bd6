"""Transformer hooks for sparse attention: the token grid of each forward, and tile order once per forward (Wan).

Why hooks on the transformer: a sparse pattern needs the token grid of the call, and the grid is known exactly
where the latents enter the transformer (their shape and the patch size), not in the pipeline's pixel sizes,
and not in the attention call (which sees a flat sequence). Both classes below therefore read it from a forward
pre-hook on the transformer, per forward, so Wan 2.2's two transformers, i2v and any resolution need nothing
from the pipeline.

* :class:`GridTracker` (Wan and CogVideoX) -- the per-call form: ``attend`` permutes q, k, v into the pattern's
  tile layout and back inside every attention call.
* :class:`WanTileOrder` (Wan) -- the once-per-forward form (issue 21, item 2): the hidden states are permuted
  into the layout once when they enter the first block and back once when they leave the last one, and RoPE's
  frequencies (and Wan 2.2 ti2v's per-token timestep projection) are permuted the same way once, so every
  attention call -- self and cross -- already sees the layout and permutes nothing.

Hook points, read from diffusers 0.42's ``WanTransformer3DModel.forward``: ``rotary_emb = self.rope(hidden_states)``
is computed once before the blocks and passed to every block -> a forward hook on ``rope`` permutes its (cos, sin)
outputs, shape (1, S, 1, D), along dim 1; ``timestep_proj`` comes out of ``condition_embedder`` with a token
dimension only for ti2v (batch, S, 6 * dim) -> a forward hook there permutes it, while ``temb`` (used after the
blocks, in raster order) is left alone; the blocks are called as ``block(hidden_states, encoder_hidden_states,
timestep_proj, rotary_emb)`` -> a forward pre-hook on ``blocks[0]`` permutes ``hidden_states`` (B, S, C) and a
forward hook on ``blocks[-1]`` permutes its output back before ``norm_out`` / ``proj_out`` / unpatchify. These are
the very points diffusers' own context-parallel plan (``_cp_plan``) splits and gathers the sequence at, which is
why they are the least invasive: nothing of the model's code is replaced.

Padding decision for the once-per-forward form: the layout is the pattern's own (``pad`` option, default
``block``), so pad tokens do flow through the blocks. Every op of a Wan block but attention is per token (norms,
modulation, projections, FFN, cross-attention queries), so pads never change a real token (pad keys are masked in
self-attention, and pads are dropped at the exit); they cost work in proportion to their count. Measured with
:func:`vdbench.sparse.block_mask` on the two grids of the H200 probe (STA window 3x3x3, tile 6x8x8):

=====================  ==========  ===================  ============================
grid                   pad         extra tokens          partial / computed blocks
=====================  ==========  ===================  ============================
21x30x52 (1.3B 480p)   ``block``   14.1 %                12.7 %
21x30x52               ``none``    0                     37.1 %
21x45x80 (14B 720p)    ``block``   5.0 %                 8.5 %
21x45x80               ``none``    0                     33.1 %
=====================  ==========  ===================  ============================

Unpadded tile order (partial edge tiles) makes a third of the computed blocks partial -- blocks that straddle two
tiles and need the per-token ``mask_mod`` at 3-8x the cost of a full block (H200 probe) -- which costs more than the
5-14 % extra tokens through the per-token layers of the padded layout. ``pad=none`` stays available (the
spec's option) to measure the other side. Radial's layout is raster order with frames padded to whole blocks
(6.7 % / 3.1 % extra tokens; with ``pad=none`` it is the model's own order and the hook permutes nothing).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from .sparse import (SparseSpec, SparsityTally, TileLayout, TokenGrid, from_layout, layout_for, parse_spec,
                     to_layout)
from .sparse_attention import sparse_attention

__all__ = ["wan_token_grid", "cogvideox_token_grid", "GridTracker", "WanTileOrder", "wan_hooks", "cogvideox_hooks",
           "hooks_for"]


def _is_wan(transformer) -> bool:
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    return isinstance(transformer, WanTransformer3DModel)


def _is_cogvideox(transformer) -> bool:
    from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXTransformer3DModel

    return isinstance(transformer, CogVideoXTransformer3DModel)


def _arg(args, kwargs, pos: int, name: str):
    if name in kwargs:
        return kwargs[name]
    if len(args) > pos:
        return args[pos]
    raise TypeError(f"transformer called without {name!r}")


def wan_token_grid(transformer, hidden_states: torch.Tensor) -> TokenGrid:
    """Grid of a Wan forward: latents (B, C, F, H, W) over ``patch_size`` (t, h, w), as the model patchifies."""
    pt, ph, pw = transformer.config.patch_size
    _, _, f, h, w = hidden_states.shape
    return TokenGrid(f // pt, h // ph, w // pw)


def cogvideox_token_grid(transformer, hidden_states: torch.Tensor,
                         encoder_hidden_states: torch.Tensor) -> TokenGrid:
    """Grid of a CogVideoX forward: latents (B, F, C, H, W) over ``patch_size`` (and ``patch_size_t`` for 1.5),
    with the text tokens first (CogVideoX's joint attention concatenates [text, video])."""
    p, pt = transformer.config.patch_size, transformer.config.patch_size_t
    _, f, _, h, w = hidden_states.shape
    return TokenGrid(f // pt if pt else f, h // p, w // p, text_tokens=encoder_hidden_states.shape[1],
                     text_first=True)


class _Hooks:
    """Shared bookkeeping: the spec, the handles, the grid of the current forward, the sparsity tally."""

    def __init__(self, spec: Union[str, SparseSpec]):
        self.spec = parse_spec(spec)
        self.grid: Optional[TokenGrid] = None
        self.layout: Optional[TileLayout] = None  # the tile order the blocks' tokens are in (None: the model's)
        self.tally = SparsityTally()
        self._handles: list = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.grid = None
        self.layout = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


class GridTracker(_Hooks):
    """Per-call form: learns the grid of each forward; ``attend`` permutes inside every self-attention call.

    Works for Wan (no text in self-attention) and CogVideoX (joint attention, 226 text tokens first). Outside a
    forward (``grid`` None) and for cross-attention, ``attend`` runs dense FlexAttention and counts it dense.
    """

    def __init__(self, transformer: torch.nn.Module, spec: Union[str, SparseSpec]):
        super().__init__(spec)
        if _is_wan(transformer):
            self._grid_of = lambda a, kw: wan_token_grid(transformer, _arg(a, kw, 0, "hidden_states"))
        elif _is_cogvideox(transformer):
            self._grid_of = lambda a, kw: cogvideox_token_grid(transformer, _arg(a, kw, 0, "hidden_states"),
                                                               _arg(a, kw, 1, "encoder_hidden_states"))
        else:
            raise TypeError(f"GridTracker knows Wan and CogVideoX transformers, not {type(transformer).__name__}")
        self._handles.append(transformer.register_forward_pre_hook(self._enter, with_kwargs=True))
        self._handles.append(transformer.register_forward_hook(self._exit, always_call=True))

    def _enter(self, module, args, kwargs):
        self.grid = self._grid_of(args, kwargs)

    def _exit(self, module, args, output):
        self.grid = None

    def attend(self, q, k, v, *, scale=None, is_causal=False):
        out, stats = sparse_attention(q, k, v, grid=self.grid, spec=self.spec, scale=scale, is_causal=is_causal,
                                      return_stats=True)
        self.tally.add(stats)
        return out


class WanTileOrder(_Hooks):
    """Once-per-forward form on a diffusers ``WanTransformer3DModel`` (see the module docstring for the hook
    points and the padding decision). While a forward runs, ``layout`` is the active layout and every attention
    call of the blocks sees its tokens in it; ``attend`` then runs the pattern with ``already_tile_ordered``.

    ``WanTileOrder(transformer, "flex")`` keeps the model's order (the dense pattern has no layout), so the same
    code path measures the baseline. ``active()`` (default: always) is asked at the entry of each forward: False
    keeps that forward in the model's order -- a dense-step schedule runs its dense steps untouched.
    """

    def __init__(self, transformer: torch.nn.Module, spec: Union[str, SparseSpec],
                 active: Optional[Callable[[], bool]] = None):
        super().__init__(spec)
        if not _is_wan(transformer):
            raise TypeError(f"WanTileOrder hooks diffusers' WanTransformer3DModel, not {type(transformer).__name__}"
                            " (its forward computes rope, the blocks and the output stage where the hooks expect)")
        self._active = active or (lambda: True)
        self._transformer = transformer
        h = self._handles
        h.append(transformer.register_forward_pre_hook(self._enter, with_kwargs=True))
        h.append(transformer.rope.register_forward_hook(self._rope))
        h.append(transformer.condition_embedder.register_forward_hook(self._condition))
        h.append(transformer.blocks[0].register_forward_pre_hook(self._blocks_enter, with_kwargs=True))
        h.append(transformer.blocks[-1].register_forward_hook(self._blocks_exit))
        h.append(transformer.register_forward_hook(self._exit, always_call=True))

    @property
    def _permuting(self) -> bool:
        return self.layout is not None and not self.layout.is_identity

    def _enter(self, module, args, kwargs):
        self.grid = wan_token_grid(module, _arg(args, kwargs, 0, "hidden_states"))
        self.layout = None if self.spec.dense or not self._active() else layout_for(self.spec, self.grid)

    def _exit(self, module, args, output):
        self.grid = None
        self.layout = None

    def _rope(self, module, args, output):
        if not self._permuting:
            return None
        return tuple(to_layout(t, self.layout, 1) for t in output)

    def _condition(self, module, args, output):
        temb, timestep_proj, *rest = output
        if not self._permuting or timestep_proj.ndim != 3:
            return None  # one modulation per sample (Wan 2.1, 2.2 A14B): nothing per token to permute
        return (temb, to_layout(timestep_proj, self.layout, 1), *rest)

    def _blocks_enter(self, module, args, kwargs):
        if not self._permuting:
            return None
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=to_layout(kwargs["hidden_states"], self.layout, 1))
        else:
            args = (to_layout(args[0], self.layout, 1), *args[1:])
        return args, kwargs

    def _blocks_exit(self, module, args, output):
        if not self._permuting:
            return None
        return from_layout(output, self.layout, 1)

    def attend(self, q, k, v, *, scale=None, is_causal=False):
        out, stats = sparse_attention(q, k, v, grid=self.grid, spec=self.spec, scale=scale, is_causal=is_causal,
                                      already_tile_ordered=self.layout is not None, return_stats=True)
        self.tally.add(stats)
        return out


def wan_hooks(transformer, spec, *, once_per_forward: bool = True, active: Optional[Callable[[], bool]] = None):
    """Wan's grid hooks: the tile order once per forward (:class:`WanTileOrder`), or the per-call form
    (:class:`GridTracker`: under torch.compile, whose compiled blocks would trace the block hooks, and for
    schedules by layer, where one forward mixes backends)."""
    if once_per_forward:
        return WanTileOrder(transformer, spec, active=active)
    return GridTracker(transformer, spec)


def cogvideox_hooks(transformer, spec, *, once_per_forward: bool = True, active: Optional[Callable[[], bool]] = None):
    """CogVideoX's grid hooks: per call (:class:`GridTracker`) -- a once-per-forward tile order would have to move
    the text tokens and CogVideoX's 3-D RoPE inside its processors, which is not implemented; the per-call form
    permutes q, k, v in every call instead (what ``once_per_forward`` and ``active`` would change is ignored)."""
    return GridTracker(transformer, spec)


def hooks_for(transformer, spec, *, once_per_forward: bool = True, active: Optional[Callable[[], bool]] = None):
    """The grid hooks of a transformer known by its class (library use, where no model family is named); a
    TypeError for a transformer without a known token grid."""
    if _is_wan(transformer):
        return wan_hooks(transformer, spec, once_per_forward=once_per_forward, active=active)
    if _is_cogvideox(transformer):
        return cogvideox_hooks(transformer, spec, once_per_forward=once_per_forward, active=active)
    raise TypeError(f"{type(transformer).__name__} has no known token grid (sparse patterns run on Wan and "
                    "CogVideoX transformers)")
