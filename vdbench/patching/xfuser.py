"""Processors of xDiT (xfuser), which reach attention through xfuser's attention-function registry.

xfuser's processors call ``USP`` (directly, or as ``self.attention_function``), and USP looks its kernel up in
``ATTENTION_FUNCTION_REGISTRY[backend]`` -- for the Ulysses call *and* for the function it hands to torch's
templated ring attention. Swapping the registry entries for the configured backends (self and cross) therefore
covers Ulysses, ring and hybrid at once; patching only the Ulysses call site would leave ring on xfuser's own
kernel. The processors' globals are left as they are.
"""

from __future__ import annotations

from ..backends import UnsupportedCall
from .adapter import Adapter, path_tag

__all__ = ["XfuserAdapter"]


class XfuserAdapter(Adapter):
    mode = "xfuser"

    def __init__(self, patch):
        super().__init__(patch)
        self._saved: list[tuple[dict, object, object]] = []  # (registry, key, its original function)
        self._ring = 1  # xfuser's ring degree and the USP calls' path tag, read once at install (fixed for the run)
        self._tag = ""

    @classmethod
    def reaches(cls, names: tuple[str, ...]) -> bool:
        return ("attention_function" in names or "USP" in names) and "dispatch_attention_fn" not in names

    def rebind(self, g: dict) -> None:
        """Nothing in the globals: the kernel is reached through xfuser's registry, swapped in ``install``."""

    def install(self) -> None:
        """Put our kernel behind xfuser's attention registry for its configured backends (self and cross)."""
        from xfuser.core.distributed import (get_ring_parallel_world_size, get_runtime_state,
                                             get_ulysses_parallel_world_size)
        from xfuser.core.distributed.attention_backend import ATTENTION_FUNCTION_REGISTRY as reg

        self._ring = get_ring_parallel_world_size()
        self._tag = path_tag(get_ulysses_parallel_world_size(), self._ring)
        state = get_runtime_state()
        keys = {state.attention_backend}
        cross = getattr(state, "get_cross_attention_backend", lambda: None)()
        if cross is not None:
            keys.add(cross)
        for key in keys:
            self._saved.append((reg, key, reg.get(key)))
            reg[key] = self.attention

    def remove(self) -> None:
        for registry, key, fn in reversed(self._saved):
            registry[key] = fn
        self._saved.clear()

    def attention(self, query, key, value, dropout_p=0.0, is_causal=False, attention_kwargs=None, **_):
        """xfuser's attention-function contract: BHSD in, (out, lse or None) out; LSE only on the ring path."""
        patch = self.patch
        if patch.passthrough:
            raise UnsupportedCall(f"backend '{patch.backend.name}' can't be installed into xfuser's registry: "
                                  "name a backend")
        if attention_kwargs and attention_kwargs.get("attn_mask") is not None:
            raise UnsupportedCall(f"backend '{patch.backend.name}' got an attention mask through xfuser")
        # xfuser's Wan cross-attention calls the registry without USP (local); self-attention goes through USP
        local = patch.context[2].startswith("cross")
        need_lse = not local and self._ring > 1
        tag = "" if local else self._tag
        res = patch.serve(query, key, value, None, dropout_p, is_causal, None, False, need_lse=need_lse, tag=tag)
        return res if need_lse else (res, None)
