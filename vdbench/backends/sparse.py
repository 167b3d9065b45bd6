"""Attention that skips work: the sparse video patterns on PyTorch's FlexAttention (``flex``, ``sta``, ``radial``)
and the packaged sliding-tile kernel where it imports (``sta_kernel``).

Why these entries differ from the others: a pattern is a statement about neighbours on the latent token grid, and
an attention call sees a flat sequence. So ``sta`` / ``radial`` carry a :class:`~.registry.SparseUse` (their
``sparse`` part) -- per-model state: the patching core installs the model family's grid hooks on each patched
transformer and routes every call through ``SparseUse.attend`` with the grid of the forward in progress (and, for
Wan, the tokens already in the pattern's tile order, permuted once per forward). Called bare (no grid), their ``fn``
refuses: running dense there would report a pattern that never ran. Where no grid applies (cross-attention), the
call runs dense on the same FlexAttention path and is counted as ``flex.dense``.

Options: ``sta:window=3x3x3,tile=6x8x8`` (``+`` separates options too). The parsing is
:func:`vdbench.sparse.parse_spec`'s; an entry's ``sparse.configure(options)`` returns the entry of that option set
(one per spelling-independent set, cached), named by the options that differ from the defaults
(:func:`entry_name`: ``sta:window=3x5x5``) -- the base name when there are none, so ``sta`` and
``sta:window=3x3x3`` are one render.

``sta_kernel``: FastVideo's compiled STA kernel (``st_attn`` or ``fastvideo_kernel``, ThunderKittens, H100-class),
called as its packages document it (``sliding_tile_attention(q, k, v, window per head, text_length, has_text,
dit_seq_shape)`` on tokens in (6, 8, 8) tile order). It is available only where the package *imports* (the
reason names what the import said -- as shipped, both fail to load against torch 2.11/2.13: undefined symbols)
and serves only the latent grids the package hard-codes (checked per call, refused with the grid otherwise). No
ABI workaround is attempted here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from typing import Optional

import torch

from vdbench.sparse import PATTERNS, BlockStats, SparseSpec, TokenGrid, block_mask, from_layout, parse_spec, to_layout
from vdbench.sparse.attention import flex_attention_dense, sparse_attention

from .registry import (ANY_FLOAT, Backend, SparseUse, UnsupportedCall, cuda, probe, register, requires_package)

__all__ = ["DENSE_LABEL", "pattern_label", "entry_name", "STA_KERNEL_GRIDS"]

ORDER = 35

DENSE_LABEL = "flex.dense"
_NO_LSE = "the FlexAttention wrappers do not return its log-sum-exp (sparse patterns refuse ring attention)"
_FLEX_NOTE = "compiled on CUDA; eager on a CPU (O(S^2) memory: correctness only)"
_GRID_NOTE = "needs the token grid (Wan, CogVideoX); " + _FLEX_NOTE


def _flex_probe(device: torch.device) -> tuple[bool, str]:
    """FlexAttention importable; on CUDA it compiles to a Triton kernel; CPU runs it eagerly."""
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        return False, f"torch {torch.__version__} has no FlexAttention ({e}); it needs torch >= 2.5"
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return False, "FlexAttention compiles to a Triton kernel on CUDA: package not installed: triton"
        return True, "ok"
    if device.type != "cpu":
        return False, f"FlexAttention runs on CUDA (compiled) or on a CPU (eager), not on {device.type}"
    return True, "ok"


def pattern_label(spec: SparseSpec) -> str:
    """The kernel label of a sparse call: ``flex.sta[window=3x3x3,tile=6x8x8]`` -- the pattern's geometry always,
    ``pad`` / ``block`` only where they differ from the defaults."""
    defaults = PATTERNS[spec.pattern]
    geometry = ("window", "tile") if spec.pattern == "sta" else ("decay", "sink")
    parts = []
    for key, value in spec.options().items():
        if key in geometry or value != defaults[key]:
            parts.append(f"{key}={_text(value)}")
    return f"flex.{spec.pattern}[{','.join(parts)}]"


def _text(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else (
        f"{value:g}" if isinstance(value, float) else str(value))


def entry_name(spec: SparseSpec) -> str:
    """The name of a configured entry: the pattern and the options that differ from its defaults, ``+``-separated
    (``sta:window=3x5x5``, ``radial:decay=0.5+pad=none``); the bare pattern for the defaults. One name per option
    set, whatever the spelling typed, and it parses back to the same spec."""
    defaults = PATTERNS[spec.pattern]
    parts = [f"{k}={_text(v)}" for k, v in spec.options().items() if v != defaults[k]]
    return f"{spec.pattern}:{'+'.join(parts)}" if parts else spec.pattern


def _needs_grid(name: str):
    def fn(q, k, v, *, scale=None, is_causal=False):
        raise UnsupportedCall(f"backend '{name}' needs the token grid of the call: install it into a Wan or "
                              "CogVideoX pipeline (vdbench.use_backend, --attention_type), or call its "
                              "SparseUse.attend with a grid (bench/bench_attention.py --grid FxHxW)")

    fn.__name__ = f"{name}_needs_grid"
    return fn


def _flex_attend(spec: SparseSpec):
    label = pattern_label(spec)

    def attend(q, k, v, *, grid: Optional[TokenGrid], tile_ordered: bool = False, scale=None, is_causal=False):
        """``grid`` None (cross-attention, or no forward in progress): dense FlexAttention, counted dense."""
        out, stats = sparse_attention(q, k, v, grid=grid, spec=spec, scale=scale, is_causal=is_causal,
                                      already_tile_ordered=tile_ordered, return_stats=True)
        return out, (label if stats.sparse_call else DENSE_LABEL), stats

    return attend


_LOCK = threading.Lock()
_CONFIGURED: dict[tuple[str, SparseSpec], Backend] = {}  # (mechanism, spec) -> entry


def _configure(base: str):
    def configure(options: str) -> Backend:
        spec = parse_spec(f"{base}:{options}")
        if spec == parse_spec(base):
            from .registry import resolve

            return resolve(base)
        with _LOCK:
            key = ("flex", spec)
            if key not in _CONFIGURED:
                _CONFIGURED[key] = _pattern_entry(spec, entry_name(spec))
            return _CONFIGURED[key]

    return configure


_DESCRIPTIONS = {
    "sta": "sliding tile attention (FastVideo's window rule) on FlexAttention, tokens in tile order",
    "radial": "radial attention (band shrinking with the frame distance, block-aligned) on FlexAttention",
}


def _pattern_entry(spec: SparseSpec, name: str) -> Backend:
    return Backend(
        name, f"{_DESCRIPTIONS[spec.pattern]}: {pattern_label(spec)}", fn=_needs_grid(name),
        kernel=pattern_label(spec), constraints=(probe(_flex_probe),), dtypes=ANY_FLOAT, supports_causal=False,
        no_lse_reason=_NO_LSE, notes=_GRID_NOTE,
        sparse=SparseUse(spec, _flex_attend(spec), once_per_forward=True, configure=_configure(spec.pattern)))


register(Backend(
    "flex", "FlexAttention, dense (no mask): the sparse patterns' baseline on the same kernel family",
    fn=flex_attention_dense, kernel=DENSE_LABEL, constraints=(probe(_flex_probe),), dtypes=ANY_FLOAT,
    no_lse_reason=_NO_LSE, notes=_FLEX_NOTE))
register(_pattern_entry(parse_spec("sta"), "sta"))
register(_pattern_entry(parse_spec("radial"), "radial"))


# ----------------------------------------------------------------------------------------------------------
# The packaged STA kernel (FastVideo's ThunderKittens kernel)
# ----------------------------------------------------------------------------------------------------------

_STA_MODULES = ("st_attn", "fastvideo_kernel")
_STA_TILE = (6, 8, 8)
#: The latent grids (frames, height, width; no text tokens) the packaged kernel is compiled for, with the
#: ``dit_seq_shape`` string it takes (st_attn 0.0.7's ``sliding_tile_attention``: StepVideo 36x48x48, Wan
#: 69x768x1280 = 18x48x80; its third shape, HunyuanVideo's 30x48x80, needs 256 padded text tokens and is left out).
STA_KERNEL_GRIDS = {(36, 48, 48): "36x48x48", (18, 48, 80): "18x48x80"}


@functools.lru_cache(maxsize=None)
def _sta_module() -> tuple[Optional[object], str]:
    """(the first packaged STA module that imports, '') or (None, what each import said)."""
    said = []
    for name in _STA_MODULES:
        if importlib.util.find_spec(name) is None:
            said.append(f"{name}: not installed")
            continue
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # an extension built for another torch: ImportError / OSError (undefined symbol)
            said.append(f"{name}: import failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if not callable(getattr(mod, "sliding_tile_attention", None)):
            said.append(f"{name}: imports, but has no sliding_tile_attention")
            continue
        return mod, ""
    return None, "; ".join(said)


def _sta_kernel_probe(device: torch.device) -> tuple[bool, str]:
    mod, said = _sta_module()
    return (True, "ok") if mod is not None else (False, said)


def _sta_kernel_attend(spec: SparseSpec):
    label_opts = _triple(spec.window)

    def attend(q, k, v, *, grid: Optional[TokenGrid], tile_ordered: bool = False, scale=None, is_causal=False):
        if grid is None:  # cross-attention: the packaged kernel has no dense mode; the same FlexAttention as sta
            out = flex_attention_dense(q, k, v, scale=scale, is_causal=is_causal)
            return out, DENSE_LABEL, BlockStats.dense_call(q.shape[2], k.shape[2], spec.block)
        shape = STA_KERNEL_GRIDS.get(grid.shape)
        if shape is None or grid.text_tokens:
            known = ", ".join(STA_KERNEL_GRIDS.values())
            raise UnsupportedCall(f"backend 'sta_kernel' runs the latent grids its package is compiled for "
                                  f"({known}, no text tokens), not {grid}; use 'sta' (FlexAttention) for this grid")
        if is_causal:
            raise UnsupportedCall("backend 'sta_kernel' is bidirectional; a causal call cannot run under it")
        if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6 * q.shape[-1] ** -0.5:
            raise UnsupportedCall(f"backend 'sta_kernel' applies 1/sqrt(head_dim); the call asks scale={scale}")
        mod, said = _sta_module()
        if mod is None:
            raise UnsupportedCall(f"backend 'sta_kernel': {said}")
        _, stats, layout = block_mask(spec, grid, q.device)
        if not tile_ordered:
            q, k, v = (to_layout(t, layout, 2) for t in (q, k, v))
        out = mod.sliding_tile_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                         [tuple(spec.window)] * q.shape[1], 0, False, dit_seq_shape=shape)
        if not tile_ordered:
            out = from_layout(out, layout, 2)
        return out, f"{mod.__name__}.sliding_tile_attention[window={label_opts}]", stats

    return attend


def _sta_kernel_entry(spec: SparseSpec, name: str) -> Backend:
    return Backend(
        name, f"FastVideo's compiled sliding tile attention kernel (st_attn / fastvideo_kernel), window "
              f"{_triple(spec.window)} tiles of 6x8x8", fn=_needs_grid(name),
        kernel="sta_kernel.sliding_tile_attention", layout="BHSD",
        constraints=(requires_package(*_STA_MODULES, hint="pip install st-attn (or fastvideo-kernel) built for "
                                                           "this torch"), cuda(major=9), probe(_sta_kernel_probe)),
        dtypes=(torch.bfloat16,), head_dims=(128,), supports_causal=False, no_lse_reason=_NO_LSE,
        sparse=SparseUse(spec, _sta_kernel_attend(spec), once_per_forward=True, configure=_sta_kernel_configure),
        notes=f"grids {', '.join(STA_KERNEL_GRIDS.values())} only (the package's); " + _GRID_NOTE.split(";")[0])


def _sta_kernel_spec(options: str = "") -> SparseSpec:
    """The kernel's spec: its (6, 8, 8) tile, no padding (its grids are whole tiles); only the window is an
    option."""
    spec = parse_spec("sta:" + options) if options else parse_spec("sta")
    if spec.tile != _STA_TILE or spec.pad != "block" or spec != parse_spec(f"sta:window={_triple(spec.window)}"):
        raise ValueError(f"sta_kernel: the packaged kernel's tile is 6x8x8 with 128-token blocks and no padding; "
                         f"window= is its only option (got {options!r})")
    return SparseSpec("sta", tile=_STA_TILE, window=spec.window, pad="none")


def _triple(t) -> str:
    return "x".join(map(str, t))


def _sta_kernel_configure(options: str) -> Backend:
    spec = _sta_kernel_spec(options)
    if spec == _sta_kernel_spec():
        from .registry import resolve

        return resolve("sta_kernel")
    with _LOCK:
        key = ("sta_kernel", spec)
        if key not in _CONFIGURED:
            _CONFIGURED[key] = _sta_kernel_entry(spec, f"sta_kernel:window={_triple(spec.window)}")
        return _CONFIGURED[key]


register(_sta_kernel_entry(_sta_kernel_spec(), "sta_kernel"))
