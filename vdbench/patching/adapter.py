"""The adapter interface: how one kind of attention processor reaches attention, and what a patch puts in its way.

A diffusers processor reaches its attention kernel in one of three ways, each served by one adapter module:
diffusers' dispatcher (``dispatcher.py``), ``F.scaled_dot_product_attention`` (``sdpa.py``) or xfuser's attention
registry (``xfuser.py``). The core (``core.py``) copies each processor with its ``__call__`` rebound to a private
globals dict and asks the processor's adapter to put its replacement there (``rebind``); an adapter that needs a
patch-wide swap as well (xfuser's registry) does it in ``install`` and undoes it in ``remove``. Every replacement
ends in the patch's ``serve`` / ``record`` so counting, timing and refusals are the same whatever the route.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

from ..backends import UnsupportedCall
from ..parallel import sequence_layout

__all__ = ["Adapter", "path_tag"]


class Adapter(ABC):
    """One route to attention. ``mode`` names it (the compiled op and ``call_kind`` key on it); one instance
    per patch and route, holding the patch its replacements serve."""

    mode: str = ""

    def __init__(self, patch):
        self.patch = patch

    @classmethod
    @abstractmethod
    def reaches(cls, names: tuple[str, ...]) -> bool:
        """Whether a processor whose ``__call__`` reads the global/attribute ``names`` (its ``co_names``) reaches
        attention this way: read from the code, not guessed from the class name."""

    @abstractmethod
    def rebind(self, g: dict) -> None:
        """Put this route's replacement into ``g``, the copied globals of one processor class's ``__call__``."""

    def install(self) -> None:
        """Patch-wide setup once the processors are rebound. A route reached through the rebound globals alone
        has nothing more to install; xfuser's registry overrides this."""

    def remove(self) -> None:
        """Undo ``install``; nothing to undo for a route reached through the rebound globals alone."""

    def op_call(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, parallel: bool = False):
        """The eager body of the compiled ``vdbench::attention`` op for this route (BSHD in, BSHD out; ``parallel``:
        a context-parallel call, whose collectives run here too). Routes that torch.compile can't reach through the
        op refuse."""
        raise UnsupportedCall(f"attention reached through {self.mode!r} can't run under torch.compile through the "
                              "vdbench::attention op")


@functools.lru_cache(maxsize=None)
def path_tag(ulysses: int, ring: int) -> str:
    """Suffix of a call's kernel label under sequence parallelism: which path ran it ('@ulysses2', '@ring2',
    '@ulysses2xring2', named by vdbench.parallel.sequence_layout); nothing for a local call. Cached: it is asked at
    every parallel attention call, for the one layout of the run."""
    layout = sequence_layout(ulysses, ring)
    return "@" + layout if layout else ""
