"""Install an attention backend into a pipeline for the duration of a run, count what ran, remove it after.

One mechanism serves the three ways diffusers' video models reach attention, each handled by one adapter:

* ``dispatcher`` -- Wan's ``WanAttnProcessor`` calls ``dispatch_attention_fn(query, key, value, ...)`` with
  BSHD tensors (diffusers' attention dispatcher, and its context parallelism);
* ``sdpa`` -- CogVideoX's ``CogVideoXAttnProcessor2_0`` calls ``F.scaled_dot_product_attention(query=...,
  key=..., value=...)`` directly, by keyword, with BHSD tensors;
* ``xfuser`` -- xDiT's processors call USP, which takes its kernel from xfuser's attention registry.

``core`` holds ``AttentionPatch`` (install / remove, counting, timing, observers, the torch.compile op);
``targets`` what it is installed into and whether the backend can run there. Every call is counted by the kernel
that actually ran (``PatchStats.calls``).
"""

from .calls import CallInfo, PatchStats
from .core import ON_UNSUPPORTED_CHOICES, AttentionPatch, attention_modules, install_backend, no_grid_hooks

__all__ = ["AttentionPatch", "CallInfo", "PatchStats", "install_backend", "attention_modules", "no_grid_hooks",
           "ON_UNSUPPORTED_CHOICES"]
