"""The grammar of sparse video attention: the token grid of a call, and the pattern specs with their parsing.

* :class:`TokenGrid` -- the token grid of one attention call: latent (frames, height, width) after patchify, plus
  the text tokens of joint attention (CogVideoX puts 226 text tokens *first*; Wan's self-attention has none);
  :func:`parse_grid` reads the benches' ``FxHxW[+T]``.
* :data:`PATTERNS`, :class:`SparseSpec` / :func:`parse_spec` -- a pattern and its options, parsed from
  ``sta:window=3x3x3,tile=6x8x8`` (``+`` separates options too, for command lines that split lists on commas).
* :func:`split_attention_types` -- splits a comma-separated list of backend names without cutting a pattern's
  option list apart. It lives with the grammar because the grammar is what makes a comma ambiguous, and at the
  bottom layer because its callers sit on several layers (the CLI, the attention schedule's parser, the benches).

What the patterns mean is in :mod:`vdbench.sparse.patterns`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

__all__ = [
    "DEFAULT_BLOCK",
    "PAD_MODES",
    "PATTERNS",
    "SparseSpecError",
    "TokenGrid",
    "parse_grid",
    "SparseSpec",
    "parse_spec",
    "split_attention_types",
]

DEFAULT_BLOCK = 128
PAD_MODES = ("none", "block", "tile")

Triple = tuple[int, int, int]


class SparseSpecError(ValueError):
    """A sparse pattern spec that can't be used: unknown pattern or option, malformed or out-of-range value."""


# ----------------------------------------------------------------------------------------------------------
# The token grid of a call
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenGrid:
    """The token sequence of one self-attention call: a latent (frames, height, width) grid after patchify, in
    raster order (frame-major, then rows, then columns, as diffusers' Wan and CogVideoX flatten it), plus
    ``text_tokens`` of joint attention placed before the video tokens (``text_first``, CogVideoX) or after them.
    """

    frames: int
    height: int
    width: int
    text_tokens: int = 0
    text_first: bool = True

    def __post_init__(self):
        for name in ("frames", "height", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TokenGrid.{name} must be a positive int, got {v!r}")
        if not isinstance(self.text_tokens, int) or self.text_tokens < 0:
            raise ValueError(f"TokenGrid.text_tokens must be an int >= 0, got {self.text_tokens!r}")

    @property
    def shape(self) -> Triple:
        return (self.frames, self.height, self.width)

    @property
    def video_tokens(self) -> int:
        return self.frames * self.height * self.width

    @property
    def seq_len(self) -> int:
        return self.video_tokens + self.text_tokens

    @property
    def video_start(self) -> int:
        """Index of the first video token in the model's sequence."""
        return self.text_tokens if self.text_first else 0

    def decode(self, index: int) -> Optional[Triple]:
        """(t, h, w) of sequence position ``index``, or None for a text token."""
        v = index - self.video_start
        if not 0 <= v < self.video_tokens:
            if not 0 <= index < self.seq_len:
                raise IndexError(f"position {index} outside a sequence of {self.seq_len} tokens")
            return None
        hw = self.height * self.width
        return (v // hw, (v % hw) // self.width, v % self.width)

    def __str__(self) -> str:
        text = (f" + {self.text_tokens} text ({'first' if self.text_first else 'last'})"
                if self.text_tokens else "")
        return f"{self.frames}x{self.height}x{self.width}{text}"


def parse_grid(text: str) -> TokenGrid:
    """``"21x30x52"`` -> TokenGrid(21, 30, 52) (latent frames x height x width after patchify); ``"13x30x45+226"``:
    226 text tokens first (CogVideoX's joint attention). What the benches' ``--grid`` takes."""
    shape, _, text_tokens = str(text).partition("+")
    parts = shape.lower().split("x")
    if len(parts) != 3 or not all(x.strip().isdigit() for x in parts) or (text_tokens and not text_tokens.isdigit()):
        raise ValueError(f"grid {text!r} is not FxHxW (latent frames x height x width after patchify), optionally "
                         "+T text tokens")
    f, h, w = (int(x) for x in parts)
    return TokenGrid(f, h, w, int(text_tokens) if text_tokens else 0, True)


# ----------------------------------------------------------------------------------------------------------
# Specs and their parsing
# ----------------------------------------------------------------------------------------------------------

#: Options of each pattern with their defaults (``flex`` is the dense baseline on the same mechanism).
PATTERNS: dict[str, dict[str, object]] = {
    "flex": {},
    "sta": {"window": (3, 3, 3), "tile": (6, 8, 8), "pad": "block", "block": DEFAULT_BLOCK},
    "radial": {"decay": 1.0, "sink": 1, "pad": "block", "block": DEFAULT_BLOCK},
}

_OPTION_HELP = {
    "window": "TxHxW tiles, odd positive ints (the window is centred on the query tile)",
    "tile": "TxHxW latent tokens, positive ints",
    "decay": "a positive number (band = 2**bit_length(H*W) * decay / 2**bit_length(frame distance) tokens)",
    "sink": "an int >= 0 (leading latent frames every query attends)",
    "pad": f"one of {', '.join(PAD_MODES)}",
    "block": "a power of two >= 16 (FlexAttention block size)",
}


@dataclass(frozen=True)
class SparseSpec:
    """A pattern and its options; hashable, so it keys the layout and block-mask caches."""

    pattern: str
    tile: Optional[Triple] = None
    window: Optional[Triple] = None
    decay: Optional[float] = None
    sink: Optional[int] = None
    pad: str = "block"
    block: int = DEFAULT_BLOCK

    def __post_init__(self):
        # A spec built directly (not through parse_spec) is checked by the same rules, via its own spelling.
        if self.pattern not in PATTERNS:
            raise SparseSpecError(f"unknown sparse pattern {self.pattern!r}; known: {', '.join(PATTERNS)}")
        known = PATTERNS[self.pattern]
        for key in ("tile", "window", "decay", "sink"):
            if key not in known and getattr(self, key) is not None:
                raise SparseSpecError(f"{self.pattern} has no option {key!r}")
            if key in known and getattr(self, key) is None:
                raise SparseSpecError(f"{self.pattern} needs option {key!r} ({_OPTION_HELP[key]})")
        for key in known:
            v = getattr(self, key)
            _parse_value(key, "x".join(map(str, v)) if isinstance(v, tuple) else str(v), self.pattern)

    @property
    def dense(self) -> bool:
        return self.pattern == "flex"

    def options(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in PATTERNS[self.pattern]}

    def canonical(self) -> str:
        """One spelling per spec (every option, fixed order, ``+``-separated): labels, cache keys, file names."""
        if not PATTERNS[self.pattern]:
            return self.pattern
        parts = []
        for k, v in self.options().items():
            parts.append(f"{k}={'x'.join(map(str, v)) if isinstance(v, tuple) else _fmt_number(v)}")
        return f"{self.pattern}:{'+'.join(parts)}"

    def __str__(self) -> str:
        return self.canonical()


def _fmt_number(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _parse_triple(key: str, value: str, pattern: str) -> Triple:
    parts = value.lower().split("x")
    if len(parts) != 3 or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise SparseSpecError(f"{pattern}: {key}={value!r} is not {_OPTION_HELP[key]}")
    t = tuple(int(p) for p in parts)
    if min(t) < 1:
        raise SparseSpecError(f"{pattern}: {key}={value!r} has a zero; {key} is {_OPTION_HELP[key]}")
    if key == "window" and any(w % 2 == 0 for w in t):
        raise SparseSpecError(
            f"{pattern}: window={value!r} has an even size; STA windows are centred on the query tile, so they "
            "span an odd number of tiles (FastVideo's rule, half = window // 2, would make an even window w "
            "cover w + 1 tiles)")
    return t  # type: ignore[return-value]


def _parse_value(key: str, value: str, pattern: str):
    if key in ("window", "tile"):
        return _parse_triple(key, value, pattern)
    if key == "decay":
        try:
            x = float(value)
        except ValueError:
            raise SparseSpecError(f"{pattern}: decay={value!r} is not {_OPTION_HELP[key]}") from None
        if not math.isfinite(x) or x <= 0:
            raise SparseSpecError(f"{pattern}: decay={value!r} is not {_OPTION_HELP[key]}")
        return x
    if key in ("sink", "block"):
        if not re.fullmatch(r"\d+", value):
            raise SparseSpecError(f"{pattern}: {key}={value!r} is not {_OPTION_HELP[key]}")
        x = int(value)
        if key == "block" and (x < 16 or x & (x - 1)):
            raise SparseSpecError(f"{pattern}: block={value!r} is not {_OPTION_HELP[key]}")
        return x
    if key == "pad":
        if value not in PAD_MODES:
            raise SparseSpecError(f"{pattern}: pad={value!r} is not {_OPTION_HELP[key]}")
        return value
    raise AssertionError(key)


def parse_spec(text: Union[str, SparseSpec]) -> SparseSpec:
    """``"sta:window=3x3x3,tile=6x8x8"`` -> :class:`SparseSpec` (options not given take their defaults).

    Options are ``key=value`` separated by ``,`` or ``+``; every error names the pattern, the option and what
    is accepted, so a command line fails before any model is loaded.
    """
    if isinstance(text, SparseSpec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise SparseSpecError(f"empty sparse pattern spec {text!r}; known patterns: {', '.join(PATTERNS)}")
    name, sep, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name not in PATTERNS:
        raise SparseSpecError(f"unknown sparse pattern {name!r}; known: {', '.join(PATTERNS)}")
    known = PATTERNS[name]
    values = dict(known)
    seen: set[str] = set()
    items = [s.strip() for s in re.split(r"[,+]", rest)] if sep else []
    if sep and not rest.strip():
        raise SparseSpecError(f"{name}: ':' but no options (write {name!r} alone for the defaults)")
    for item in items:
        if not item:
            raise SparseSpecError(f"{name}: empty option in {text!r}")
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not value:
            raise SparseSpecError(f"{name}: option {item!r} is not key=value")
        if not known:
            raise SparseSpecError(f"{name} takes no options (got {item!r})")
        if key not in known:
            raise SparseSpecError(f"{name}: unknown option {key!r}; options: "
                                  + "; ".join(f"{k} ({_OPTION_HELP[k]})" for k in known))
        if key in seen:
            raise SparseSpecError(f"{name}: option {key!r} given twice")
        seen.add(key)
        values[key] = _parse_value(key, value, name)
    return SparseSpec(pattern=name, **values)  # type: ignore[arg-type]


def split_attention_types(text: str) -> list[str]:
    """Split a comma-separated list of backend names without cutting a pattern's options apart.

    ``"sdpa,sta:window=3x3x3,tile=6x8x8,fa3"`` -> ``["sdpa", "sta:window=3x3x3,tile=6x8x8", "fa3"]``: a piece
    that is ``key=value`` (an ``=`` with no ``:`` before it) continues the previous name's options, since no
    backend name contains ``=``.
    """
    out: list[str] = []
    for piece in text.split(","):
        head = piece.split("=", 1)[0]
        if out and "=" in piece and ":" not in head and ":" in out[-1]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return [p.strip() for p in out if p.strip()]

