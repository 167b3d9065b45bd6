"""Per-model state of the backends that need the token grid (``Backend.sparse``): the grid hooks of one patch.

Why a piece of its own: a sparse pattern needs the latent grid of each call, which only the transformer knows. For
every patched model and every member of the patch's schedule that carries a :class:`~vdbench.backends.SparseUse`,
the model family's hooks (``Family.grid_hooks``, :mod:`vdbench.sparse.hooks`) are installed on the transformer for
as long as the patch is; the core then hands such a backend's calls to :meth:`GridStates.attend`, which passes it
the grid of the forward in progress -- for self/joint attention only: a cross-attention call gets no grid and runs
dense, whatever its lengths happen to be.

Tile order once per forward (the hooks permute the tokens into the pattern's layout at the entry of the blocks and
back at their exit) is used when every call of a forward goes to one backend -- a single backend, or a schedule by
steps or call kinds (the hooks ask, at the entry of each forward, whether their backend serves this step's
self / joint calls; cross-attention on another backend then sees the tile-ordered queries, whose order it does not
depend on, and the padded rows are dropped at the exit). A schedule by layers
mixes backends inside one forward, and torch.compile traces the blocks the hooks sit on, so both get the per-call
form (each call permutes its own q, k, v). So does context parallelism: diffusers splits the sequence at the
blocks' entry, and a Ulysses attention call holds the whole sequence again, in the model's order.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..backends import Backend, BackendUnavailable

__all__ = ["GridStates"]

_GRID_KINDS = ("self", "joint")


class GridStates:
    """The grid hooks of one patch, by (backend name, model name)."""

    def __init__(self):
        self._hooks: dict[tuple[str, str], object] = {}

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def install(self, models, schedule, grid_hooks: Callable, step: Callable[[], int], once_per_forward: bool) -> None:
        """Hooks for every grid member on every model. ``step()``: the patch's step now (whether a backend serves
        the forward that starts); ``once_per_forward``: the caller allows the block hooks (False under compile)."""
        once = once_per_forward and not schedule.by_layer
        for model_name, model in models:
            for b in schedule.members:
                if b.sparse is None:
                    continue
                # the tokens go to tile order for a forward whose grid calls (self / joint) this backend serves
                active = (lambda b=b: any(schedule.at(step(), None, k) is b for k in _GRID_KINDS))
                try:
                    hooks = grid_hooks(model, b.sparse.spec, once_per_forward=once and b.sparse.once_per_forward,
                                       active=active)
                except TypeError as e:
                    raise BackendUnavailable(f"attention backend '{b.name}' can't run on {model_name}: {e}") from None
                self._hooks[(b.name, model_name)] = hooks

    def remove(self) -> None:
        for hooks in self._hooks.values():
            hooks.remove()
        self._hooks.clear()

    def _of(self, backend: Backend, model: str):
        try:
            return self._hooks[(backend.name, model)]
        except KeyError:
            raise BackendUnavailable(f"attention backend '{backend.name}' needs the token grid of {model}, and no "
                                     "grid hooks are installed there") from None

    def tile_ordered(self, backend: Backend, model: str) -> bool:
        """Whether the tokens of the forward in progress are in the backend's tile order (not the model's)."""
        return self._of(backend, model).layout is not None

    def attend(self, backend: Backend, model: str, kind: str, q, k, v, scale: Optional[float], is_causal: bool):
        """(out, kernel label, BlockStats) of one call (BHSD) through the backend's ``SparseUse.attend``."""
        hooks = self._of(backend, model)
        grid = hooks.grid if kind in _GRID_KINDS else None
        return backend.sparse.attend(q, k, v, grid=grid, tile_ordered=hooks.layout is not None, scale=scale,
                                     is_causal=is_causal)
