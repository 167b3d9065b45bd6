"""Prompt and seed sets: what a batch or a sweep renders each backend on, and quality over the set.

``--prompts FILE`` (one prompt a line) and ``--seeds 1,2,3`` make a set of contents, every (prompt, seed) pair, the
prompts outermost; each backend renders each content, and each render keeps its own files through its identity
(the prompt goes into its ``_id-``, the seed into ``_seed<N>``: :mod:`vdbench.identity`). A render is compared with
the reference render of its own content; over the set a backend's quality is the mean of its renders' PSNR with the
min-max and n (:func:`spread`). ``--shard I/N`` takes one machine's share of a batch (:func:`in_shard`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["Content", "read_prompts", "parse_seeds", "contents", "parse_shard", "in_shard", "spread", "spread_text",
           "describe"]


@dataclass(frozen=True)
class Content:
    """One (prompt, seed) of a set: ``prompt`` / ``seed`` None where the set does not vary it (the renderer's own
    then: its ``--prompt`` / ``--seed``); ``prompt_no``: the prompt's line in the file (1-based)."""

    prompt: Optional[str] = None
    seed: Optional[int] = None
    prompt_no: Optional[int] = None

    @property
    def tag(self) -> str:
        """``p2 seed7``: what a job's name and its step lines carry ("" for a batch without a set)."""
        return " ".join(filter(None, [f"p{self.prompt_no}" if self.prompt_no else "",
                                      f"seed{self.seed}" if self.seed is not None else ""]))

    def args(self) -> list[str]:
        """The render flags this content sets."""
        return (["--prompt", self.prompt] if self.prompt is not None else []) + (
            ["--seed", str(self.seed)] if self.seed is not None else [])


def read_prompts(path) -> list[str]:
    """The prompts of ``path``, one a line (a final newline allowed); ValueError in one line for a missing or empty
    file or a blank line (naming its number)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--prompts {path}: {e.strerror or e}") from None
    lines = text.splitlines()
    if not lines or not text.strip():
        raise ValueError(f"--prompts {path}: the file is empty (one prompt a line)")
    blank = [i for i, ln in enumerate(lines, 1) if not ln.strip()]
    if blank:
        raise ValueError(f"--prompts {path}: line {blank[0]} is blank (one prompt a line, no blank lines)")
    return lines


def parse_seeds(text: str) -> list[int]:
    """``1,2,3`` -> [1, 2, 3]; ValueError for anything else (a repeated seed too: it would render the same video
    twice)."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds {text}: comma-separated integers (e.g. 1,2,3)") from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text}: each seed once")
    return seeds


def contents(prompts: Optional[list[str]], seeds: Optional[list[int]]) -> list[Content]:
    """Every (prompt, seed), the prompts outermost; one content of neither without a set."""
    ps = [(p, i) for i, p in enumerate(prompts, 1)] if prompts else [(None, None)]
    return [Content(p, s, i) for p, i in ps for s in (seeds or [None])]


def parse_shard(text: Optional[str]) -> tuple[int, int]:
    """``--shard I/N`` -> (I, N), 0 <= I < N; (0, 1) without; ValueError otherwise."""
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text}: I/N, this machine's share of N (I from 0 to N-1)") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: I from 0 to N-1 (N >= 1)")
    return i, n


def in_shard(content: int, backend: int, shard: tuple[int, int]) -> bool:
    """Whether the render of the ``content``-th content by the ``backend``-th backend (0-based, in the batch's
    order) is shard (I, N)'s: the one of ``(content + backend) mod N``, so that each shard gets its share of every
    backend (a slow exact reference is not one machine's alone) and of every content."""
    return (content + backend) % shard[1] == shard[0]


def spread(values: Iterable[Optional[float]]) -> Optional[dict]:
    """{"mean", "min", "max", "n"} of the finite-or-infinite values given (None left out); None where none is. A
    mean over identical renders (inf dB) is inf."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    mean = math.inf if any(math.isinf(v) for v in vals) else sum(vals) / len(vals)
    return {"mean": mean, "min": min(vals), "max": max(vals), "n": len(vals)}


def spread_text(s: Optional[dict], unit: str = " dB", spec: str = ".1f") -> str:
    """``31.2 dB (29.8–33.0, n=4)``; ``∞ dB (n=4)`` where every render is identical to its reference."""
    if s is None:
        return "–"

    def f(v: float) -> str:
        return "∞" if math.isinf(v) else format(v, spec)

    if s["n"] == 1:
        return f"{f(s['mean'])}{unit}"
    if math.isinf(s["min"]):
        return f"∞{unit} (n={s['n']})"
    return f"{f(s['mean'])}{unit} ({f(s['min'])}–{f(s['max'])}, n={s['n']})"


def describe(settings: dict, width: int = 60) -> str:
    """A content as a reader tells it apart: ``seed 7, "A cat walks on ..."`` from a render's recorded settings."""
    prompt = str(settings.get("prompt") or "")
    short = prompt if len(prompt) <= width else prompt[:width - 1].rstrip() + "…"
    seed = settings.get("seed")
    return ", ".join(filter(None, [f"seed {seed}" if seed is not None else "", f'"{short}"' if prompt else ""]))
