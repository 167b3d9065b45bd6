"""Transformer hooks for sparse attention: the token grid of each forward, and the tile order once per forward.

Why hooks on the transformer: a sparse pattern needs the token grid of the call, and the grid is known exactly
where the latents enter the transformer (their shape and the patch size), not in the pipeline's pixel sizes,
and not in the attention call (which sees a flat sequence). Both classes below therefore read it from a forward
pre-hook on the transformer, per forward, so a model's several transformers, image-to-video and any resolution
need nothing from the pipeline.

This module is the mechanism only. What a model family knows -- how its latents' shape becomes a grid, which of
its submodules the tokens pass through -- is in its module under :mod:`vdbench.families`, whose
``Family.grid_hooks`` builds one of these:

* :class:`GridTracker` -- the per-call form: ``attend`` permutes q, k, v into the pattern's tile layout and back
  inside every attention call.
* :class:`TileOrder` -- the once-per-forward form: the hidden states are permuted into the layout once when they
  enter the first block and back once when they leave the last one, and whatever else the blocks receive per token
  (RoPE's frequencies, per-token timestep projections: the family's ``rewrites``) is permuted the same way once, so
  every attention call -- self and cross -- already sees the layout and permutes nothing. Pad tokens of the layout
  flow through the blocks (they never change a real token where every op but attention is per token, and pad keys
  are masked); the family's module says why that is the better side for its model.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from .attention import sparse_attention
from .layout import TileLayout, from_layout, layout_for, to_layout
from .masks import SparsityTally
from .spec import SparseSpec, TokenGrid, parse_spec

__all__ = ["call_arg", "GridTracker", "TileOrder"]

#: ``grid_of(transformer, args, kwargs) -> TokenGrid``: the grid of one forward, from the transformer's arguments.
GridOf = Callable[[Any, tuple, dict], TokenGrid]


def call_arg(args, kwargs, pos: int, name: str):
    """Argument ``name`` of a hooked call, given by keyword or at position ``pos``."""
    if name in kwargs:
        return kwargs[name]
    if len(args) > pos:
        return args[pos]
    raise TypeError(f"transformer called without {name!r}")


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
    """Per-call form: learns the grid of each forward (``grid_of``, the family's); ``attend`` permutes inside every
    self/joint-attention call. Outside a forward (``grid`` None) and for cross-attention, ``attend`` runs dense
    FlexAttention and counts it dense."""

    def __init__(self, transformer: torch.nn.Module, spec: Union[str, SparseSpec], grid_of: GridOf):
        super().__init__(spec)
        self._grid_of = grid_of
        self._handles.append(transformer.register_forward_pre_hook(self._enter, with_kwargs=True))
        self._handles.append(transformer.register_forward_hook(self._exit, always_call=True))

    def _enter(self, module, args, kwargs):
        self.grid = self._grid_of(module, args, kwargs)

    def _exit(self, module, args, output):
        self.grid = None

    def attend(self, q, k, v, *, scale=None, is_causal=False):
        out, stats = sparse_attention(q, k, v, grid=self.grid, spec=self.spec, scale=scale, is_causal=is_causal,
                                      return_stats=True)
        self.tally.add(stats)
        return out


#: ``rewrite(output, permute) -> new output | None``: a hooked submodule's output with its per-token tensors put
#: through ``permute`` (a tensor (B, S, ...) -> the same in tile order, along dim 1); None leaves it as it is.
Rewrite = Callable[[Any, Callable[[torch.Tensor], torch.Tensor]], Any]


class TileOrder(_Hooks):
    """Once-per-forward form (module doc). While a forward runs, ``layout`` is the active layout and every attention
    call of the blocks sees its tokens in it; ``attend`` then runs the pattern with ``already_tile_ordered``.

    ``grid_of``: the grid of a forward (the family's). ``entry`` / ``exit``: the first and the last block; the
    ``hidden_states`` argument (keyword, or the first positional) of ``entry`` is permuted into the layout and the
    output of ``exit`` back. ``rewrites``: (submodule, :data:`Rewrite`) pairs for the other per-token inputs of the
    blocks, computed once per forward before them. ``spec`` ``"flex"`` keeps the model's order (the dense pattern
    has no layout), so the same code path measures the baseline. ``active()`` (default: always) is asked at the
    entry of each forward: False keeps that forward in the model's order -- a dense-step schedule runs its dense
    steps untouched.
    """

    def __init__(self, transformer: torch.nn.Module, spec: Union[str, SparseSpec], grid_of: GridOf, *,
                 entry: torch.nn.Module, exit: torch.nn.Module,
                 rewrites: Sequence[tuple[torch.nn.Module, Rewrite]] = (),
                 active: Optional[Callable[[], bool]] = None):
        super().__init__(spec)
        self._grid_of = grid_of
        self._active = active or (lambda: True)
        h = self._handles
        h.append(transformer.register_forward_pre_hook(self._enter, with_kwargs=True))
        for module, rewrite in rewrites:
            h.append(module.register_forward_hook(self._rewrite_hook(rewrite)))
        h.append(entry.register_forward_pre_hook(self._blocks_enter, with_kwargs=True))
        h.append(exit.register_forward_hook(self._blocks_exit))
        h.append(transformer.register_forward_hook(self._exit, always_call=True))

    @property
    def _permuting(self) -> bool:
        return self.layout is not None and not self.layout.is_identity

    def _permute(self, t: torch.Tensor) -> torch.Tensor:
        return to_layout(t, self.layout, 1)

    def _enter(self, module, args, kwargs):
        self.grid = self._grid_of(module, args, kwargs)
        self.layout = None if self.spec.dense or not self._active() else layout_for(self.spec, self.grid)

    def _exit(self, module, args, output):
        self.grid = None
        self.layout = None

    def _rewrite_hook(self, rewrite: Rewrite):
        def hook(module, args, output):
            if not self._permuting:
                return None
            return rewrite(output, self._permute)
        return hook

    def _blocks_enter(self, module, args, kwargs):
        if not self._permuting:
            return None
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=self._permute(kwargs["hidden_states"]))
        else:
            args = (self._permute(args[0]), *args[1:])
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
