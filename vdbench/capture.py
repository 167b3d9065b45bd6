"""Capture attention inputs and latents during a real run, in a format that loads without unpickling code.

Format (one file per attention call)::

    <dir>/attn_<backend>_rank<R>_<index:06d>.pt   torch.save({"q": T, "k": T, "v": T, "meta": {...}})

Tensors are BHSD (batch, heads, seq, head_dim), on the CPU, in the dtype the kernel received. ``meta`` holds
plain types only: index, layer, kind (self/cross/cross_img/joint), step, model, rank, backend, kernel, shapes,
dtype, layout and the call's non-tensor arguments. Files are loaded with ``torch.load(weights_only=True)``:
a file that holds anything but tensors and plain containers is refused, never unpickled. At the end
``metadata_<backend>_rank<R>.json`` records the total calls seen, the number captured and the unique shapes.
Latents before VAE decode go to ``latents_<backend>_rank<R>_<rep:03d>.pt`` the same way.

A capture is checked before anything uses it (:func:`check_capture`, run by :func:`load_capture`): the file's size
against a limit (``max_bytes``) before it is read, then q/k/v dense (contiguous, their storage as large as their
shape says -- a few-KB file whose zero strides claim 10^6 tokens is refused, not handed to a kernel that would
allocate gigabytes), shapes that make one attention call, floating dtypes, and ``meta`` agreeing with the tensors.
Every refusal is one whole line: the file, what is wrong, and that it was not loaded (or not used).

Names carry backend and rank, so ranks and backends never overwrite each other; indices are zero-padded so a
plain sort is numeric, and ``list_captures`` sorts numerically anyway.

Copies off the GPU are asynchronous (pinned host buffers, ``non_blocking``) and synchronized once per file
write in a background thread, so a capture costs the run the copy bandwidth, not a stall per call; its time
is measured and reported (``CaptureStats``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

__all__ = ["AttentionCapture", "CaptureError", "load_capture", "check_capture", "list_captures", "save_latents",
           "load_latents", "CAPTURE_KEYS", "MAX_CAPTURE_BYTES"]

CAPTURE_KEYS = ("q", "k", "v")
#: The default size limit of one capture (file on disk, and q + k + v in memory): 8 GiB, over three times the
#: largest real call (Wan 14B at 720p: 1 x 40 x 75600 x 128 bf16 = 0.77 GB per tensor).
MAX_CAPTURE_BYTES = 8 * 2**30
_GLOBAL_RE = re.compile(r"GLOBAL (\S+)")
_NAME = re.compile(r"^attn_(?P<backend>.+)_rank(?P<rank>\d+)_(?P<index>\d+)\.pt$")
_PLAIN = (str, int, float, bool, type(None))


class CaptureError(ValueError):
    """A capture file that is not a plain tensor capture (hostile, truncated, or of the wrong shape)."""


@dataclass
class CaptureStats:
    seen: int = 0
    saved: int = 0
    bytes: int = 0
    host_time_s: float = 0.0  # time the run's thread spent issuing copies
    writer_time_s: float = 0.0  # time the background writer spent (overlaps the run)
    shapes: dict = field(default_factory=dict)


def _plain(obj):
    """Reduce to JSON-able plain types (what weights_only loading and the metadata file accept)."""
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_plain(o) for o in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        return str(obj) if not isinstance(obj, torch.Size) else list(obj)
    raise TypeError(f"capture metadata must be plain types, got {type(obj).__name__}")


def _atomic_save(obj, path: Path):
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class AttentionCapture:
    """A ``patching.AttentionPatch`` observer saving Q/K/V of the first ``max_captures`` calls (0 = all)."""

    def __init__(self, directory, backend: str, rank: int = 0, max_captures: int = 0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.backend, self.rank, self.max = backend, rank, max_captures
        self.stats = CaptureStats()
        self._q: queue.Queue = queue.Queue(maxsize=8)  # bounded: a slow disk slows the run, never OOMs it
        self._err: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._writer, daemon=True)
        self._thread.start()

    def path_for(self, index: int) -> Path:
        return self.dir / f"attn_{self.backend}_rank{self.rank}_{index:06d}.pt"

    def __call__(self, info) -> None:
        self.stats.seen += 1
        key = f"{tuple(info.query.shape)}|{tuple(info.key.shape)}|{info.query.dtype}"
        self.stats.shapes[key] = self.stats.shapes.get(key, 0) + 1
        if self.max and self.stats.saved >= self.max:
            return
        if self._err:
            raise RuntimeError(f"capture writer failed: {self._err}") from self._err
        t0 = time.perf_counter()
        tensors, event = {}, None
        for name, t in (("q", info.query), ("k", info.key), ("v", info.value)):
            if t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                tensors[name] = host
            else:
                tensors[name] = t.detach().contiguous().clone()
        if info.query.is_cuda:
            event = torch.cuda.Event()
            event.record()
        meta = {"index": info.index, "layer": info.layer, "kind": info.kind, "step": info.step,
                "model": info.model, "rank": self.rank, "backend": self.backend, "kernel": info.kernel,
                "layout": "BHSD", "dtype": str(info.query.dtype).replace("torch.", ""),
                "shapes": {n: list(t.shape) for n, t in tensors.items()}, "args": _plain(info.args)}
        self.stats.saved += 1
        self.stats.bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.stats.host_time_s += time.perf_counter() - t0
        self._q.put((self.path_for(info.index), tensors, meta, event))

    def _writer(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            path, tensors, meta, event = item
            t0 = time.perf_counter()
            try:
                if event is not None:
                    event.synchronize()
                _atomic_save({**tensors, "meta": meta}, path)
            except BaseException as e:  # surfaced on the next call / at close
                self._err = e
            self.stats.writer_time_s += time.perf_counter() - t0

    def close(self, extra: Optional[dict] = None) -> Path:
        """Flush pending writes and write the metadata file; returns its path."""
        self._q.put(None)
        self._thread.join()
        if self._err:
            raise RuntimeError(f"capture writer failed: {self._err}") from self._err
        meta = {"backend": self.backend, "rank": self.rank, "total_calls": self.stats.seen,
                "captured": self.stats.saved, "max_captures": self.max, "bytes": self.stats.bytes,
                "host_time_s": self.stats.host_time_s, "writer_time_s": self.stats.writer_time_s,
                "unique_shapes": [{"shape": k, "calls": v} for k, v in self.stats.shapes.items()],
                "layout": "BHSD", "file_pattern": f"attn_{self.backend}_rank{self.rank}_NNNNNN.pt",
                **_plain(extra or {})}
        path = self.dir / f"metadata_{self.backend}_rank{self.rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, path)
        return path


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**27 else f"{n / 2**20:.3g} MiB" if n >= 2**17 else f"{n} bytes"


def _safe_load(path, max_bytes: int = MAX_CAPTURE_BYTES) -> dict:
    """The file's top-level dict, loaded with ``weights_only=True`` after its size was checked; CaptureError in one
    whole line otherwise (torch's own message advises re-running with ``weights_only=False``, exactly what must not
    be done with a file of unknown origin, so it is not repeated)."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise CaptureError(f"{path}: not loaded: the file is {_gib(size)}, over the {_gib(max_bytes)} limit of one "
                           "capture")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for hostile objects; RuntimeError/EOFError for truncation
        text = str(e)
        if "weights_only" in text or "Unsupported" in text or "GLOBAL" in text:
            found = _GLOBAL_RE.search(text)
            what = f" ({found.group(1)})" if found else ""
            raise CaptureError(f"{path}: refused, not loaded: it holds pickled objects{what} beyond tensors and "
                               "plain values, which could run code when unpickled") from None
        raise CaptureError(f"{path}: not loaded: the file is truncated or corrupt (torch.load raised "
                           f"{type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise CaptureError(f"{path}: not a capture (top level is {type(obj).__name__}, expected a dict)")
    return obj


def check_capture(path, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: dict,
                  max_bytes: int = MAX_CAPTURE_BYTES) -> None:
    """Refuse (CaptureError, one line) q/k/v that are not one attention call's dense inputs: a non-floating dtype
    or dtypes that differ, a tensor that is not 4-D, shapes that don't make one call (batch, heads of K/V dividing
    Q's, head dim, key length), ``meta`` that disagrees with the tensors, a tensor that is not dense (zero or
    overlapping strides, or a storage smaller than its shape says: what a few-KB file claiming 10^6 tokens is), more
    than ``max_bytes`` in all. Only shapes, strides and storage sizes are read: no element is touched."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise CaptureError(f"{path}: not used: {name} is {str(t.dtype).replace('torch.', '')}, not a float "
                               "tensor")
        if t.dim() != 4:
            raise CaptureError(f"{path}: not used: {name} has {t.dim()} dims {tuple(t.shape)}, expected 4 (BHSD)")
    if not (q.dtype == k.dtype == v.dtype):
        raise CaptureError(f"{path}: not used: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    layout = meta.get("layout", "BHSD")
    if layout not in ("BHSD", "BSHD"):
        raise CaptureError(f"{path}: not used: unknown layout {layout!r} (BHSD or BSHD)")
    b, h, s = (0, 1, 2) if layout == "BHSD" else (0, 2, 1)
    if (q.shape[b] != k.shape[b] or k.shape[b] != v.shape[b] or q.shape[-1] != k.shape[-1]
            or k.shape[s] != v.shape[s] or k.shape[h] != v.shape[h] or q.shape[h] % k.shape[h]):
        raise CaptureError(f"{path}: not used: inconsistent shapes q{tuple(q.shape)} k{tuple(k.shape)} "
                           f"v{tuple(v.shape)} ({layout})")
    shapes = meta.get("shapes")
    if shapes is not None and shapes != {n: list(t.shape) for n, t in (("q", q), ("k", k), ("v", v))}:
        raise CaptureError(f"{path}: not used: meta says shapes {shapes}, the tensors are q{tuple(q.shape)} "
                           f"k{tuple(k.shape)} v{tuple(v.shape)}")
    if meta.get("dtype") is not None and meta["dtype"] != str(q.dtype).replace("torch.", ""):
        raise CaptureError(f"{path}: not used: meta says dtype {meta['dtype']}, the tensors are {q.dtype}")
    total = 0
    for name, t in (("q", q), ("k", k), ("v", v)):
        size = t.numel() * t.element_size()
        # dense: every element its own storage (no zero or overlapping strides), all of it inside the storage
        end = (t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1) + 1) * \
            t.element_size()
        have = t.untyped_storage().nbytes()
        overlapping = any(st == 0 for n, st in zip(t.shape, t.stride()) if n > 1) or end - t.storage_offset() * \
            t.element_size() < size
        if overlapping or end > have:
            raise CaptureError(f"{path}: not used: {name} {tuple(t.shape)} is not dense (strides {t.stride()}, "
                               f"{_gib(have)} of storage for a shape of {_gib(size)})")
        total += size
    if total > max_bytes:
        raise CaptureError(f"{path}: not used: q, k, v hold {_gib(total)}, over the {_gib(max_bytes)} limit")


def load_capture(path, max_bytes: int = MAX_CAPTURE_BYTES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Load one attention capture as BHSD (q, k, v, meta), checked (:func:`check_capture`); refuse anything that
    isn't one."""
    obj = _safe_load(path, max_bytes)
    missing = [k for k in CAPTURE_KEYS if not isinstance(obj.get(k), torch.Tensor)]
    if missing:
        raise CaptureError(f"{path}: not an attention capture (missing tensors: {', '.join(missing)})")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise CaptureError(f"{path}: 'meta' must be a dict")
    q, k, v = obj["q"], obj["k"], obj["v"]
    check_capture(path, q, k, v, meta, max_bytes)
    if meta.get("layout", "BHSD") == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return q, k, v, meta


def list_captures(directory, pattern: str = "attn_*.pt") -> list[Path]:
    """Capture files in numeric order of (backend, rank, index) — not lexicographic."""
    files = [p for p in Path(directory).glob(pattern) if p.is_file()]

    def key(p: Path):
        m = _NAME.match(p.name)
        if m:
            return (0, m["backend"], int(m["rank"]), int(m["index"]), p.name)
        nums = [int(n) for n in re.findall(r"\d+", p.stem)]
        return (1, "", 0, nums[-1] if nums else -1, p.name)

    return sorted(files, key=key)


def save_latents(directory, latents: torch.Tensor, backend: str, rank: int = 0, repetition: int = 0,
                 meta: Optional[dict] = None) -> Path:
    path = Path(directory) / f"latents_{backend}_rank{rank}_{repetition:03d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_save({"latents": latents.detach().to("cpu").contiguous(),
                  "meta": _plain({"backend": backend, "rank": rank, "repetition": repetition,
                                  "shape": list(latents.shape), "dtype": str(latents.dtype).replace("torch.", ""),
                                  **(meta or {})})}, path)
    return path


def load_latents(path) -> tuple[torch.Tensor, dict]:
    obj = _safe_load(path)
    if not isinstance(obj.get("latents"), torch.Tensor):
        raise CaptureError(f"{path}: not a latents capture (no 'latents' tensor)")
    return obj["latents"], obj.get("meta", {})
