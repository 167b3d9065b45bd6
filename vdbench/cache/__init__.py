"""diffusers' step caches as a render option (``--cache KIND[:key=value,...]``): the kinds, their parsing, the
checks before the load, their application to the loaded denoisers and the count of what each step computed.

Why diffusers' hooks and not a cache of our own: the caches are the library's (``transformer.enable_cache``), so a
render measures what a diffusers user gets; vdbench only chooses the config, fills in what the pipeline provides
(the current timestep, the step count), refuses what can't apply before any weight loads, and counts.

A kind is one :class:`CacheKind`: its short name, diffusers' config class, the parameters a user may set (taken
from the config dataclass: its fields of a type the command line can spell, with the dataclass's defaults), the
defaults vdbench sets where diffusers' own match nothing in these families, what the render fills in, and a
check against the family. A spec's canonical spelling (:attr:`CacheSpec.name`) names only the parameters given,
in the dataclass's order: ``fbc``, ``fbc:threshold=0.1``; sequences join their items with ``+``
(``pab:spatial_attention_timestep_skip_range=-1+900``).

Counting (:class:`CacheCounter`): the modules a cache hooks (whole blocks for ``fbc``/``mag``/``sea``, attention
modules for ``pab``/``faster``/``taylor``) are its units. Each unit's own ``forward`` is wrapped with a counter
before ``enable_cache``, so diffusers' hook, which calls it only when it computes, leaves it uncalled when the
output comes from the cache; a pre-hook counts every call of the unit. Per denoising step: computed = inner
calls, reused = outer - inner, and the denoiser calls this process computed (``forwards_per_step``: Wan's two guidance
passes on one process; under a CFG split one per rank, the other branch's call answered by the split's gather, which
the summary's ``guidance_split`` says), and which denoiser ran the step (``denoiser_per_step``: Wan 2.2's expert).

Two experts (Wan 2.2 A14B): each denoiser gets a config of its own (:func:`apply_cache`), and diffusers' hooks keep
each one's state apart, so the low-noise expert's first step starts from an empty cache.
"""

from .apply import apply_cache, check_cache, share_decisions
from .counter import MAG_LOGGER, CacheCounter
from .spec import CACHE_HELP, KINDS, CacheKind, CacheSpec, parse_cache

__all__ = ["CacheKind", "CacheSpec", "CacheCounter", "KINDS", "parse_cache", "check_cache", "apply_cache",
           "share_decisions", "CACHE_HELP"]
