"""Processors that call ``F.scaled_dot_product_attention`` directly (CogVideoX's ``CogVideoXAttnProcessor2_0``).

The rebound ``__call__`` reads ``F`` from its globals: there it finds an ``_FProxy`` whose
``scaled_dot_product_attention`` is ours and whose every other attribute is torch's. ``torch.nn.functional``
itself is never touched, so every other module of the process keeps the real sdpa. BHSD in, BHSD out, by keyword
or positionally, like the original.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .adapter import Adapter
from .calls import call_args, torch_sdpa

__all__ = ["SdpaAdapter"]


class _FProxy:
    """Stands in for ``torch.nn.functional`` inside one rebound processor: everything but sdpa delegates."""

    def __init__(self, sdpa: Callable):
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name):
        return getattr(F, name)


class SdpaAdapter(Adapter):
    mode = "sdpa"

    @classmethod
    def reaches(cls, names: tuple[str, ...]) -> bool:
        return "F" in names or "scaled_dot_product_attention" in names

    def rebind(self, g: dict) -> None:
        g["F"] = _FProxy(self.sdpa)

    def op_call(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, parallel=False):
        return self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, dropout_p, is_causal,
                         scale, enable_gqa).transpose(1, 2)

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """Replacement for ``F.scaled_dot_product_attention`` (keyword or positional): BHSD."""
        patch = self.patch
        if torch.compiler.is_compiling():
            out = patch.compiled_call(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                                      dropout_p, is_causal, scale, enable_gqa, mode=self.mode)
            return out.transpose(1, 2)
        if patch.passthrough:
            label = patch.backend.call_label(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            out = patch.timed(lambda: torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                 enable_gqa), query)
            patch.record(label, query, key, value, out, bshd=False,
                         args=call_args(attn_mask, dropout_p, is_causal, scale))
            return out
        return patch.serve(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
