"""Which backend serves which attention call: one backend for the whole run, or a schedule by step and layer.

Why: every sparse method keeps the first denoising steps dense (the layout of the video is decided early, where
sparse attention hurts most), and the same holds for quantized kernels (exact early steps). A schedule names one
backend for chosen steps (and optionally layers) and another elsewhere::

    --attention_schedule "fav3@steps:0-9,sta"                  # FA3 on steps 0-9, STA on the others
    --attention_schedule "fav3@steps:0-4+45-,sagev1"             # exact first and last steps, SageAttention between
    --attention_schedule "reference@layers:0-1,fav3_fp8"         # the first two blocks exact, fp8 elsewhere
    --attention_schedule "sta:window=3x3x3,tile=6x8x8@steps:10-,fav3"   # a backend with options
    --attention_schedule "fav3@kind:cross,sta"                  # cross attention on FA3, the rest on STA

Grammar: rules separated by ``,`` (a pattern's own ``key=value`` options stay with it); a rule is a backend name
(options allowed) followed by selectors ``@steps:RANGES`` / ``@layers:RANGES``; RANGES are ``N``, ``N-M``
(inclusive) or ``N-`` (open), joined by ``+``. Steps are 0-based denoising steps (the step counter the render
advances at every step boundary); layers are the transformer block index (the first integer in the attention
module's path, ``blocks.3.attn1`` -> 3). ``@kind:KINDS`` selects calls by kind, ``self``, ``cross`` (text and image
cross-attention) or ``joint`` (CogVideoX's text+video attention), joined by ``+``: a sparse pattern has no grid for
cross-attention and runs it dense on its own mechanism (FlexAttention), so ``fav3@kind:cross,sta`` gives those calls
to FA3, as FastVideo pairs STA with FlashAttention. The first rule that matches a call serves it; the last rule has no
selector and serves every other call. A plain backend name is the one-rule schedule, so the patching core has one
code path. Every separator of this grammar, and of the labels a run is shown under, is listed in
docs/ARCHITECTURE.md ("Run identity"): ``@`` here only ever starts a selector.

What keeps counting honest: a schedule is one :class:`~vdbench.patching.AttentionPatch` holding every backend;
each call is counted under the kernel that ran it, by step too (``attention.calls_by_step`` in timing.json).

Refusals before the model loads (:meth:`Schedule.check_plan`): an unknown or unavailable backend, a malformed
rule, steps beyond the run's, layer rules under torch.compile (compiled blocks share one graph and don't know
their index), a pattern on a family without a token grid, a pattern under ring attention or xfuser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

from ..backends import Backend, BackendUnavailable, resolve
from ..sparse import split_attention_types

__all__ = ["Rule", "Schedule", "ScheduleError", "parse_schedule", "resolve_attention", "layer_index", "KINDS",
           "kind_of"]

Ranges = tuple[tuple[int, Optional[int]], ...]  # inclusive (start, end); end None = open
_SELECTORS = ("steps", "layers", "kind")
KINDS = ("self", "cross", "joint")


def kind_of(call_kind: Optional[str]) -> Optional[str]:
    """A call's kind as the ``kind`` selector names it: the image cross-attention of Wan I2V (``cross+img``,
    ``cross_img``) is ``cross``; None stays unknown."""
    if call_kind is None:
        return None
    return "cross" if call_kind.startswith("cross") else call_kind


def _parse_kinds(text: str, where: str) -> tuple[str, ...]:
    kinds = tuple(k.strip().lower() for k in text.split("+"))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ScheduleError(f"{where}: kind {bad[0] if bad else text!r} is not one of {', '.join(KINDS)} "
                            "('+' joins kinds)")
    return kinds


class ScheduleError(ValueError):
    """A schedule that can't run: malformed, or at odds with the run (steps beyond it, layers under compile)."""


def layer_index(module_path: str) -> Optional[int]:
    """The block index of an attention module: the first integer component of its path (``blocks.3.attn1`` -> 3,
    ``transformer_blocks.12.attn1`` -> 12); None for a module outside the repeated blocks."""
    for part in module_path.split("."):
        if part.isdigit():
            return int(part)
    return None


def _fmt_ranges(ranges: Ranges) -> str:
    return "+".join(str(a) if a == b else (f"{a}-" if b is None else f"{a}-{b}") for a, b in ranges)


def _parse_ranges(text: str, where: str) -> Ranges:
    out = []
    for part in text.split("+"):
        m = re.fullmatch(r"\s*(\d+)\s*(-\s*(\d*)\s*)?", part)
        if not m:
            raise ScheduleError(f"{where}: {part!r} is not N, N-M or N- (0-based, inclusive; '+' joins ranges)")
        a = int(m.group(1))
        b = a if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if b is not None and b < a:
            raise ScheduleError(f"{where}: range {part.strip()!r} ends before it starts")
        out.append((a, b))
    return tuple(out)


def _within(ranges: Optional[Ranges], x: Optional[int]) -> bool:
    if ranges is None:
        return True
    if x is None:
        return False
    return any(a <= x and (b is None or x <= b) for a, b in ranges)


@dataclass(frozen=True)
class Rule:
    """One backend and where it serves: ``steps`` / ``layers`` / ``kinds`` (None: every one)."""

    backend: Backend
    steps: Optional[Ranges] = None
    layers: Optional[Ranges] = None
    kinds: Optional[tuple[str, ...]] = None

    def matches(self, step: int, layer: Optional[int], kind: Optional[str] = None) -> bool:
        return (_within(self.steps, step) and _within(self.layers, layer)
                and (self.kinds is None or kind_of(kind) in self.kinds))

    def __str__(self) -> str:
        sel = "".join(f"@{k}:{_fmt_ranges(r)}" for k, r in (("steps", self.steps), ("layers", self.layers)) if r)
        return self.backend.name + sel + (f"@kind:{'+'.join(k for k in KINDS if k in self.kinds)}"
                                          if self.kinds else "")


@dataclass(frozen=True, eq=False)
class Schedule:
    """The backends of a run and the rule choosing one per call (the last rule: every other call)."""

    rules: tuple[Rule, ...]

    @classmethod
    def single(cls, backend: Backend) -> "Schedule":
        return cls((Rule(backend),))

    @property
    def name(self) -> str:
        """One spelling per schedule (the run's label: file names, timing.json, the report); a single backend's
        own name."""
        return ",".join(str(r) for r in self.rules)

    @property
    def members(self) -> tuple[Backend, ...]:
        """The distinct backends, in rule order."""
        seen: dict[str, Backend] = {}
        for r in self.rules:
            seen.setdefault(r.backend.name, r.backend)
        return tuple(seen.values())

    @property
    def is_single(self) -> bool:
        return len(self.rules) == 1

    @property
    def by_layer(self) -> bool:
        return any(r.layers is not None for r in self.rules)

    # what render and the report read off a backend entry, for the whole run
    @property
    def emulated(self) -> bool:
        """A run with an emulated member carries no speed figure."""
        return any(b.emulated for b in self.members)

    @property
    def exact(self) -> bool:
        """Exact when every member is (:attr:`vdbench.backends.Backend.exact`): one quantized or sparse rule makes
        the run's output differ from exact attention's."""
        return all(b.exact for b in self.members)

    @property
    def kernel(self) -> str:
        return "; ".join(b.kernel for b in self.members)

    @property
    def description(self) -> str:
        if self.is_single:
            return self.rules[0].backend.description
        return "schedule: " + "; ".join(
            f"{r.backend.name} ({r.backend.description})" + (f" on {str(r)[len(r.backend.name) + 1:]}" if
                                                              r.steps or r.layers or r.kinds else " elsewhere")
            for r in self.rules)

    def at(self, step: int, layer: Optional[int] = None, kind: Optional[str] = None) -> Backend:
        """The backend serving a call at ``step`` in block ``layer`` (None: unknown, as under compile) of ``kind``
        (the patch's call kind; None: unknown, only rules without a kind selector match)."""
        for r in self.rules:
            if r.matches(step, layer, kind):
                return r.backend
        return self.rules[-1].backend  # the last rule has no selector; kept for a direct constructor's rules

    def require(self, device=None, dtype=None, head_dims=()) -> "Schedule":
        """Every member can run here (``Backend.require``'s refusal of the first that can't)."""
        for b in self.members:
            b.require(device, dtype, head_dims)
        return self

    def check_plan(self, *, num_steps: Optional[int], compiled: bool, parallel=None,
                   grid_family: Optional[str]) -> None:
        """The refusals that need no weights (see the module docstring). ``grid_family``: the family's name when
        it supplies token-grid hooks, else None. ``parallel``: the torchrun layout
        (:class:`vdbench.parallel.ParallelSpec`: its ``engine`` and ``ring_degree`` are read), None for one process.

        A pattern runs under diffusers' Ulysses: inside attention each rank holds the whole sequence, in the model's
        order, for its share of the heads, so the mask of the whole token grid applies as on one process (the tile
        order is then taken per call: :class:`~vdbench.patching.AttentionPatch`'s ``tile_order_once`` is off
        under torchrun, as the sequence is split at the blocks' entry)."""
        if num_steps is not None:
            for r in self.rules:
                if r.steps and all(a >= num_steps for a, _ in r.steps):
                    raise ScheduleError(f"schedule rule {r}: steps {_fmt_ranges(r.steps)} lie beyond the run's "
                                        f"{num_steps} denoising steps (0-{num_steps - 1}); the rule would never "
                                        "serve a call")
        if compiled and self.by_layer:
            raise ScheduleError("a schedule by layers can't run under --use_torch_compile: the compiled blocks share "
                                "one graph and don't know their index; drop the compile option or schedule by steps")
        gridded = [b.name for b in self.members if b.sparse is not None]
        if gridded and grid_family is None:
            raise BackendUnavailable(f"attention backend '{gridded[0]}' needs the token grid of each call, which "
                                     "this model family does not provide (Family.grid_hooks); it runs on Wan and "
                                     "CogVideoX")
        if gridded and parallel is not None and parallel.ring_degree > 1:
            raise BackendUnavailable(f"attention backend '{gridded[0]}' can't serve ring attention (--ring_degree "
                                     f"{parallel.ring_degree}): each rank attends its chunk of queries to one chunk "
                                     "of keys at a time, and the pattern's mask is over the whole token grid\nuse "
                                     "--ulysses_degree alone (each rank then holds the whole sequence for its heads)")
        if gridded and parallel is not None and parallel.engine != "diffusers":
            raise BackendUnavailable(f"attention backend '{gridded[0]}' under --parallel_engine {parallel.engine}: "
                                     "xfuser pads the sequence to a multiple of its degree inside its own forward, "
                                     "so an attention call's sequence is not the token grid's\nuse "
                                     "--parallel_engine diffusers --ulysses_degree N")

    def check_layers(self, indices) -> None:
        """After the load: layer rules name blocks the model has (``indices``: the block indices it has)."""
        have = sorted(set(i for i in indices if i is not None))
        if not have:
            if self.by_layer:
                raise ScheduleError("a schedule by layers needs numbered blocks; this model's attention modules "
                                    "have no block index")
            return
        for r in self.rules:
            if r.layers and all(a > have[-1] for a, _ in r.layers):
                raise ScheduleError(f"schedule rule {r}: layers {_fmt_ranges(r.layers)} lie beyond the model's "
                                    f"blocks (0-{have[-1]})")


def parse_schedule(text: str) -> Schedule:
    """``"fav3@steps:0-9,sta"`` -> :class:`Schedule` (every backend resolved; see the module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise ScheduleError("empty attention schedule; write e.g. 'fav3@steps:0-9,sta'")
    rules = []
    pieces = split_attention_types(text)
    for i, piece in enumerate(pieces):
        name, *selectors = piece.split("@")
        where = f"schedule rule {piece.strip()!r}"
        if not name.strip():
            raise ScheduleError(f"{where}: no backend before '@'")
        backend = resolve(name.strip())
        found: dict[str, Ranges] = {}
        for sel in selectors:
            key, colon, ranges = sel.partition(":")
            key = key.strip().lower()
            if key not in _SELECTORS or not colon:
                raise ScheduleError(f"{where}: selector {sel!r} is not steps:RANGES, layers:RANGES or kind:KINDS")
            if key in found:
                raise ScheduleError(f"{where}: {key} given twice")
            found[key] = _parse_kinds(ranges, where) if key == "kind" else _parse_ranges(ranges, where)
        last = i == len(pieces) - 1
        if last and found:
            raise ScheduleError(f"{where}: the last rule serves every other call, so it takes no selector; end "
                                f"the schedule with a plain backend (e.g. '{text.strip()},fav3')")
        if not last and not found:
            raise ScheduleError(f"{where}: only the last rule may be a plain backend (it serves every call the "
                                "rules before it don't)")
        rules.append(Rule(backend, found.get("steps"), found.get("layers"), found.get("kind")))
    return Schedule(tuple(rules))


def resolve_attention(what: Union[str, Backend, Schedule]) -> Union[Backend, Schedule]:
    """A backend name (aliases, options) -> its entry; a schedule (``@`` in it) -> the :class:`Schedule`;
    entries and schedules come back as they are."""
    if isinstance(what, (Backend, Schedule)):
        return what
    if isinstance(what, str) and "@" in what:
        return parse_schedule(what)
    return resolve(what)


def as_schedule(what: Union[str, Backend, Schedule]) -> Schedule:
    what = resolve_attention(what)
    return what if isinstance(what, Schedule) else Schedule.single(what)
