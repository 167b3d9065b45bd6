#!/usr/bin/env python3
"""Write every figure of the README and the recommendation / results pages from the raw records.

    python3 bench/docs_tables.py            # rewrite the tables and figures between the pages' markers
    python3 bench/docs_tables.py --check    # exit 1 naming page, table, row and column where a page differs
    python3 bench/docs_tables.py --records  # the records the declarations read

What each table holds is data, in ``bench/docs_tables.toml``: a ``[[table]]`` names its page, its header and its
rows; a row is its cells as text with ``{name}`` fields, and the figures those names are. A figure is a record
(a path under ``docs/gpu_results/``, read by :func:`vdbench.measure.record.read`: ``records.jsonl``, a render's
``timing.json``, the benches' JSON; a glob or a list of them gives their range or median), a selector for the entry
in it, a measure (:data:`MEASURES`: which number, and what makes it valid) and its rounding; or a ``ratio`` or
``diff`` of two figures, or a ``range`` of several. A ``[[fig]]`` is one inline figure in a page's prose. A page
holds each between markers::

    <!-- table:NAME -->          <!-- fig:NAME -->1.98×<!-- /fig:NAME -->
    | ... generated ... |
    <!-- /table:NAME -->

A figure states how it was taken: ``{a}`` is its value, ``{a.how}`` says warm (with n), a mean of N steps, or
cold (with the caches' state), ``{a.spread}`` its p20–p80, ``{a.n}`` its count; ``{links}`` links every record
of the row. A warm figure is refused where its record says it is not a speed figure or has fewer than 3 samples
(:func:`vdbench.timing.speed_verdict`); such a number can only appear as an ``obs_*`` measure, which says so. A
row is refused where it shows a timed figure without the words of its ``how``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import re
import statistics
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]

DECLARATIONS = ROOT / "bench" / "docs_tables.toml"
RESULTS = Path("docs") / "gpu_results"  # under the root: where every ``rec`` is


class DocsError(ValueError):
    """A declaration that can't be filled from its records (the message names the declaration and why)."""


# --- measures: which number of a record, and what kind of figure it is ------------------------------------------

@dataclass
class Val:
    """One figure as a page shows it: ``format(v)`` is the rounded value; ``how``, ``n``, ``spread``, ``link``."""

    value: float
    digits: int
    kinds: tuple  # the kinds of the timed figures in it (warm, mean, cold, obs); () for a quality or a count
    how: str = ""
    n: Optional[int] = None
    p20: Optional[float] = None
    p80: Optional[float] = None
    recs: tuple = ()
    text: Optional[str] = None  # a range's own text
    link: str = ""

    def __format__(self, spec: str) -> str:
        if self.text is not None:
            return self.text
        if self.value in (float("inf"), float("-inf")):  # a PSNR of identical frames
            return "∞" if self.value > 0 else "-∞"
        return format(self.value, spec or f".{self.digits}f")

    @property
    def spread(self) -> str:
        if self.p20 is None or self.p80 is None:
            return ""
        return f"[{self.p20:.{self.digits}f}–{self.p80:.{self.digits}f}]"


def _steps(rec):
    """The render's step figures by :func:`vdbench.timing.step_stats`, the one warm-step definition."""
    from vdbench.timing import step_stats

    times = rec.data.get("step_times") or [ms / 1e3 for ms in rec.data.get("step_times_ms") or []]
    if not times:  # (a parallel_summary.json row keeps its render's step times in ms)
        raise DocsError("not a render record (no step_times)")
    emulated = bool((rec.config.get("backend") or {}).get("emulated"))
    return step_stats(times, rec.system.get("device"), emulated)


def _timed(rec, key: str):
    """(median, n, p20, p80) of a timed figure (:func:`vdbench.measure.record.figure`)."""
    f = rec.figures.get(key)
    if not isinstance(f, dict):
        raise DocsError(f"the record has no timed figure {key!r} (it has {', '.join(rec.figures) or 'none'})")
    return f.get("median"), f.get("n"), f.get("p20"), f.get("p80")


def _warm_ms(rec, spec):
    if spec.get("key"):  # a bench's timed figure by name (bench_fp8's ``registry_ms``)
        return _timed(rec, spec["key"])
    if "step_times" in rec.data or "step_times_ms" in rec.data:
        s = _steps(rec)
        ms = lambda k: None if s[k] is None else s[k] * 1e3  # noqa: E731
        return ms("warm_step_median"), s["warm_step_n"], ms("warm_step_p20"), ms("warm_step_p80")
    if "warm_ms" in rec.figures:  # a sweep's row: the render's warm step as the sweep ranked it
        f = rec.figures
        return f["warm_ms"], f.get("n"), f.get("p20_ms"), f.get("p80_ms")
    return _timed(rec, "time_ms")  # a kernel bench's row


def _figure(rec, key: str):
    v = rec.figures.get(key)
    if v is None:
        v = _walk(rec.data, key)
    if v is None:
        raise DocsError(f"the record has no figure {key!r} (it has {', '.join(rec.figures) or 'none'})")
    return v


def _plain(key: str):
    return lambda rec, spec: (_figure(rec, key), None, None, None)


def _vae_key(rec) -> str:
    return "time_s" if "time_s" in rec.figures else "decode_s"


@dataclass(frozen=True)
class Measure:
    get: Callable  # (record, spec) -> (value, n, p20, p80)
    kind: str  # warm: n >= 3 and the record's verdict; mean / cold: stated, no sample rule; obs: says n; value
    how: str  # filled with {n} and the spec's caches
    digits: int = 1


_CACHES = {"empty": "empty caches", "unknown": "cache state not recorded", "warm": "warm compile caches",
           "not empty": "cache not empty"}

#: name -> Measure. A new kind of number is one entry here; ``obs_<name>`` of each warm measure is made below.
MEASURES = {
    "warm_ms": Measure(_warm_ms, "warm", "warm, n = {n}"),
    "kernel_ms": Measure(_warm_ms, "warm", "warm, n = {n}", 2),
    "vae_s": Measure(lambda r, s: _timed(r, _vae_key(r)), "warm", "warm, n = {n}", 3),
    "vae_encode_s": Measure(lambda r, s: _timed(r, "encode_time_s"), "warm", "warm, n = {n}", 3),
    "energy_j": Measure(lambda r, s: (_figure(r, "step_energy_j"), _steps(r)["warm_step_n"], None, None), "warm",
                        "warm, n = {n}"),
    "mean_ms": Measure(lambda r, s: (_steps(r)["step_mean"] * 1e3, _steps(r)["warm_step_n"] + 1, None, None), "mean",
                       "mean of {n} steps"),
    "first_ms": Measure(lambda r, s: (_steps(r)["first_step"] * 1e3, 1, None, None), "cold",
                        "cold, {caches}"),
    "vae_first_s": Measure(lambda r, s: (r.figures[_vae_key(r)]["first"], 1, None, None), "cold",
                           "cold, {caches}", 3),
    "e2e_s": Measure(_plain("end_to_end_s"), "cold", "cold, {caches}"),
    # videos per GPU-hour of a render run alone, end to end (its process start to its video, the load included)
    "per_gpu_h": Measure(lambda r, s: (3600.0 / (_figure(r, "end_to_end_s")
                                                 * ((r.data.get("parallel") or {}).get("world_size") or 1)), 1, None,
                                       None), "cold", "one render end to end, cold, {caches}", 0),
    "cold_s": Measure(lambda r, s: (_figure(r, s["key"]), 1, None, None), "cold", "cold, {caches}", 2),
    "one_time_s": Measure(_plain("one_time_s"), "cold", "cold, {caches}"),
    "psnr_db": Measure(_plain("psnr_db"), "value", "", 2),
    "worst_psnr_db": Measure(_plain("worst_frame_psnr_db"), "value", "", 2),
    "tflops": Measure(_plain("tflops"), "value", "", 0),
    "rel_l2": Measure(_plain("rel_l2"), "value", "", 2),
    "skipped_pct": Measure(lambda r, s: (100 * r.data["cache"]["skipped_share"], None, None, None), "value", "", 0),
    "field": Measure(lambda r, s: (_figure(r, s["key"]), None, None, None), "value", "", 1),
    "gib": Measure(lambda r, s: (_figure(r, s["key"]) / 2**30, None, None, None), "value", "", 1),
    "text": Measure(lambda r, s: (str(_figure(r, s["key"])), None, None, None), "value", ""),
    "json": Measure(None, "value", ""),  # a plain JSON file's value at ``key`` (no record reader knows the file)
}
for _name, _m in list(MEASURES.items()):
    if _m.kind == "warm":
        MEASURES["obs_" + _name] = Measure(_m.get, "obs", "n = {n}: not a speed figure", _m.digits)

#: the words a row must show beside a figure of each kind (its ``how`` holds them)
_SAYS = {"warm": "warm", "mean": "mean of", "cold": "cold", "obs": "not a speed figure"}


# --- records and selectors ---------------------------------------------------------------------------------------

class Records:
    """The records under ``root/docs/gpu_results``, each file read once."""

    def __init__(self, root: Path):
        self.root, self._cache = Path(root), {}

    def read(self, rel: str) -> list:
        if rel not in self._cache:
            path = self.root / RESULTS / rel
            if not path.is_file():
                raise DocsError(f"no record {RESULTS / rel}")
            from vdbench.measure.record import RecordError, read

            try:
                self._cache[rel] = read(path)
            except RecordError as e:
                raise DocsError(f"{e} (a JSON file no record reader knows is read by its keys: m = \"json\")")
        return self._cache[rel]

    def plain(self, rel: str):
        """A JSON file as it is (a sweep's ``sweep.json``, a summary), or a CSV table as its rows (the report's
        ``summary.csv``: numbers as numbers), for ``m = "json"``."""
        key = ("json", rel)
        if key not in self._cache:
            path = self.root / RESULTS / rel
            if not path.is_file():
                raise DocsError(f"no record {RESULTS / rel}")
            if path.suffix == ".csv":
                with open(path, newline="") as f:
                    self._cache[key] = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
            else:
                self._cache[key] = json.loads(path.read_text())
        return self._cache[key]

    def glob(self, pattern: str) -> list[str]:
        base = self.root / RESULTS
        return sorted(p.relative_to(base).as_posix() for p in base.glob(pattern) if p.is_file())


def _number(text: str):
    """A CSV cell: a float where it reads as one (``inf`` too), else the text."""
    try:
        return float(text)
    except ValueError:
        return text


def _fields(rec, key: str) -> tuple:
    """What a selector's key may mean: ``case`` / ``suite``, else a dotted path into the record's config and into its
    data (a plain JSON row: into the row); the entry matches where either holds the value."""
    if isinstance(rec, dict):
        return (_walk(rec, key),)
    if key in ("case", "suite"):
        return (getattr(rec, key),)
    return _walk(rec.config, key), _walk(rec.data, key)


def _walk(d, key: str):
    for part in key.split("."):
        if isinstance(d, list) and part.isdigit():
            d = d[int(part)] if int(part) < len(d) else None
        elif isinstance(d, dict):
            d = d.get(part)
        else:
            return None
    return d


def _select(recs: list, sel: dict, at: Optional[int], where: str):
    hits = [r for r in recs if all(any(str(x) == str(v) for x in _fields(r, k)) for k, v in sel.items())]
    if at is not None:
        if not -len(hits) <= at < len(hits):
            raise DocsError(f"{where}: {len(hits)} entries match {sel}, none at {at}")
        return hits[at]
    if len(hits) != 1:
        raise DocsError(f"{where}: {len(hits)} entries match {sel} (say which with `at`)")
    return hits[0]


# --- figures -----------------------------------------------------------------------------------------------------

def figure(spec: dict, records: Records, done: dict, where: str) -> Val:
    """The Val of one figure spec (``done``: the row's figures made so far, for ratios and ranges)."""
    if "ratio" in spec or "diff" in spec:  # [a, b]: a / b (a speed-up is [the baseline, the faster]), or a - b
        a, b = (done[k] for k in spec.get("ratio", spec.get("diff")))
        value = a.value / b.value if "ratio" in spec else a.value - b.value
        return Val(value, spec.get("d", 2), a.kinds + b.kinds, recs=a.recs + b.recs)
    if "range" in spec:
        vals = [done[k] for k in spec["range"]]
        d = spec.get("d", vals[0].digits)
        lo, hi = (f"{x:.{d}f}" for x in (min(v.value for v in vals), max(v.value for v in vals)))
        ns = sorted({v.n for v in vals if v.n is not None})
        how = vals[0].how.replace(f"= {vals[0].n}", f"= {ns[0]}–{ns[-1]}") if len(ns) > 1 else vals[0].how
        return Val(min(v.value for v in vals), d, sum((v.kinds for v in vals), ()), how, ns[0] if ns else None,
                   recs=sum((v.recs for v in vals), ()), text=lo if lo == hi else f"{lo}–{hi}")
    m = MEASURES.get(spec.get("m", ""))
    if m is None:
        raise DocsError(f"{where}: unknown measure {spec.get('m')!r}; known: {', '.join(MEASURES)}")
    if isinstance(spec["rec"], list) or "*" in spec["rec"]:  # several records: their range or median (``of``)
        return _of_many(spec, records, where)
    if spec["m"] == "json":
        rec = records.plain(spec["rec"])
        if isinstance(rec, list):  # a list of rows (a parallel_summary.json): the selector picks one
            rec = _select(rec, spec.get("sel", {}), spec.get("at"), f"{where}: {spec['rec']}")
        value, n, p20, p80 = _walk(rec, spec["key"]), None, None, None
    else:
        rec = _select(records.read(spec["rec"]), spec.get("sel", {}), spec.get("at"), f"{where}: {spec['rec']}")
        try:
            value, n, p20, p80 = m.get(rec, spec)
        except (DocsError, KeyError, TypeError) as e:
            why = e if isinstance(e, DocsError) else f"{type(e).__name__}: {e}"
            raise DocsError(f"{where}: {spec['rec']}: {why}") from None
        _judge(m, rec, n, where, spec)
    if value is None:
        raise DocsError(f"{where}: {spec['rec']}: no value for {spec.get('m')}")
    caches = _CACHES.get(spec.get("caches", ""), "")
    if m.kind == "cold" and not caches:
        raise DocsError(f"{where}: a cold figure says its caches' state: caches = {' | '.join(_CACHES)}")
    kinds = (m.kind,) if m.kind in _SAYS else ()
    if isinstance(value, str):
        return Val(0.0, 0, kinds, recs=(spec["rec"],), text=value)
    return Val(float(value) * spec.get("scale", 1), spec.get("d", m.digits), kinds,
               m.how.format(n=n, caches=caches), n, p20, p80, (spec["rec"],))


def _of_many(spec: dict, records: Records, where: str) -> Val:
    pats = spec["rec"] if isinstance(spec["rec"], list) else [spec["rec"]]
    paths = [p for pat in pats for p in (records.glob(pat) if "*" in pat else [pat])]
    if not paths:
        raise DocsError(f"{where}: no record matches {spec['rec']}")
    vals = [figure({**spec, "rec": p}, records, {}, where) for p in paths]
    d, xs = vals[0].digits, sorted(v.value for v in vals)
    folder = os.path.commonpath(paths) + "/"
    if spec.get("of", "range") == "median":
        value = statistics.median(xs)
        return Val(value, d, vals[0].kinds, f"{vals[0].how}, median of {len(xs)} renders", len(xs), recs=(folder,))
    lo, hi = f"{xs[0]:.{d}f}", f"{xs[-1]:.{d}f}"
    return Val(xs[0], d, vals[0].kinds, f"{vals[0].how}; {len(xs)} renders", vals[0].n, recs=(folder,),
               text=lo if lo == hi else f"{lo}–{hi}")


def _judge(m: Measure, rec, n, where: str, spec: dict) -> None:
    """A warm figure is a speed figure or refused: the record's own verdict, the render's steps judged by
    :func:`vdbench.timing.step_stats` (n >= 3, a GPU, not an emulation), a bench's sample count."""
    from vdbench.timing import speed_verdict

    if m.kind != "warm":
        return
    ok, why = speed_verdict(None, n if n is not None else 0)
    if ok and ("step_times" in rec.data or "step_times_ms" in rec.data):
        s = _steps(rec)
        ok, why = bool(s["speed_figure"]), s["why_not_speed"]
    if rec.speed_figure is False:
        ok, why = False, rec.verdict.get("why_not") or "speed_figure false"
    if not ok:
        raise DocsError(f"{where}: {spec['rec']}: refused as a speed figure ({why}); an obs_{spec['m']} "
                        "figure shows it as what it is")


# --- tables and pages --------------------------------------------------------------------------------------------

def _names(template: str) -> list[str]:
    return [f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(template) if f]


def render_cells(cells: list, figs: dict, records: Records, page: str, where: str, folders: bool = False,
                 says: str = "") -> list[str]:
    """The row's cells with its figures filled in, refused where a timed figure is shown without its ``how`` in the
    row or in ``says`` (its table's header)."""
    used = [n for c in cells for n in _names(c)]
    done: dict[str, Val] = {}

    def resolve(name: str) -> None:
        if name in done or name == "links":
            return
        if name not in figs:
            raise DocsError(f"{where}: {{{name}}} is not declared (figures here: {', '.join(figs) or 'none'})")
        spec = figs[name]
        for dep in spec.get("ratio", spec.get("diff", spec.get("range", ()))):
            resolve(dep)
        done[name] = figure(figs[name], records, done, f"{where} {{{name}}}")

    for name in used:
        resolve(name)
    links = {}
    for name in used:
        if name != "links":
            links.update(dict.fromkeys(_folder(r) if folders else r for r in done[name].recs))
    link = functools.partial(_link, page_dir=Path(page).parent.as_posix())
    fields = {**done, "links": ", ".join(link(r) for r in links)}
    for v in done.values():
        v.link = ", ".join(link(r) for r in dict.fromkeys(v.recs))
    out = [c.format_map(fields) for c in cells]
    text = " ".join(out) + " " + says
    for name in used:
        for kind in done[name].kinds if name in done else ():
            if _SAYS[kind] not in text:
                raise DocsError(f"{where}: {{{name}}} holds a {kind} figure and the row does not say "
                                f"{_SAYS[kind]!r}")
    return out


@functools.lru_cache(maxsize=None)
def _link(rel: str, page_dir: str) -> str:
    """A Markdown link to a record (or folder) under docs/gpu_results from a page in ``page_dir``."""
    target = Path(os.path.relpath(RESULTS / rel, page_dir)).as_posix() + ("/" if rel.endswith("/") else "")
    return f"[{_label(rel)}]({target})"


def _folder(rel: str) -> str:
    """The dated folder a record is in (``h200/2026-11-27_sweep15/``): what a table with ``links = "folder"`` links."""
    parts = Path(rel).parts
    i = next((k for k, p in enumerate(parts) if re.match(r"\d{4}-\d\d-\d\d", p)), None)
    return rel if i is None else "/".join(parts[:i + 1]) + "/"


def _label(rel: str) -> str:
    """A record's link text: its path from its dated folder, the date left out (``sweep15/sweep13/records.jsonl``)."""
    parts = list(Path(rel).parts)
    i = next((k for k, p in enumerate(parts) if re.match(r"\d{4}-\d\d-\d\d", p)), None)
    if i is None:  # outside gpu_results (../results/...)
        parts = [p for p in parts if p != ".."]
        i = 0
    elif i == len(parts) - 1:  # the dated folder itself
        return parts[i] + "/"
    else:
        parts[i] = re.sub(r"^\d{4}-\d\d-\d\d_", "", parts[i])
    return "/".join(p for p in parts[i:] if p != "results") + ("/" if rel.endswith("/") else "")


def table_text(t: dict, records: Records, shared: dict) -> tuple[str, list[list[str]]]:
    """The Markdown of one declared table, and its cells (for ``--check``'s cell-by-cell report)."""
    head = t["head"]
    align = t.get("align", "l" * len(head))
    rows = []
    for i, row in enumerate(t.get("row", []), 1):
        figs = {k: _defaults(v, row, t) for k, v in {**shared, **t.get("figs", {}), **row.get("figs", {})}.items()}
        where = f"{t['page']}: table {t['name']}, row {i}"
        if len(row["cells"]) != len(head):
            raise DocsError(f"{where}: {len(row['cells'])} cells, the header has {len(head)}")
        rows.append(render_cells(row["cells"], figs, records, t["page"], where, t.get("links") == "folder",
                                 says=" ".join(head)))
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(r) + " |" for r in [head, sep, *rows]]
    return "\n".join(lines), rows


def _defaults(spec: dict, row: dict, t: dict) -> dict:
    """A record figure without its own ``rec`` reads the row's (else the table's) ``rec``, its ``sel`` over the
    row's over the table's, and their ``at``: a table of one file's entries declares each row in two lines."""
    if any(k in spec for k in ("ratio", "diff", "range")) or not ("rec" in row or "rec" in t or "rec" in spec):
        return spec
    out = {"rec": row.get("rec", t.get("rec")), **spec}
    if "rec" not in spec:
        out["sel"] = {**t.get("sel", {}), **row.get("sel", {}), **spec.get("sel", {})}
        if "at" not in spec and "at" in {**t, **row}:
            out["at"] = row.get("at", t.get("at"))
    return out


def fig_text(f: dict, records: Records, shared: dict) -> str:
    figs = {**shared, **f.get("figs", {})}
    return render_cells([f["text"]], figs, records, f["page"], f"{f['page']}: fig {f['name']}")[0]


def _block(kind: str, name: str) -> re.Pattern:
    if kind == "table":
        return re.compile(rf"(<!-- table:{re.escape(name)} -->\n)(.*?)\n?(<!-- /table:{re.escape(name)} -->)", re.S)
    return re.compile(rf"(<!-- fig:{re.escape(name)} -->)(.*?)(<!-- /fig:{re.escape(name)} -->)", re.S)


def load(path: Path = DECLARATIONS) -> dict:
    import tomllib

    with open(path, "rb") as f:
        spec = tomllib.load(f)
    names = [d["name"] for d in spec.get("table", []) + spec.get("fig", [])]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise DocsError(f"{path}: declared twice: {', '.join(sorted(dup))}")
    return spec


def generate(root: Path, spec: dict) -> tuple[dict, list[str]]:
    """{page: new text} for every page with a declaration, and what differs from the committed pages (one line
    per differing cell: page, table, row, column, committed and generated)."""
    records, pages, diffs = Records(root), {}, []
    decls = [("table", t) for t in spec.get("table", [])] + [("fig", f) for f in spec.get("fig", [])]
    for kind, d in decls:
        page = d["page"]
        text = pages.get(page)
        if text is None:
            path = root / page
            if not path.is_file():
                raise DocsError(f"{kind} {d['name']}: no page {page}")
            text = pages[page] = path.read_text()
        shared = spec.get("figs", {})
        new, cells = table_text(d, records, shared) if kind == "table" else (fig_text(d, records, shared), None)
        m = _block(kind, d["name"]).search(text)
        if m is None:
            diffs.append(f"{page}: {kind} {d['name']}: no <!-- {kind}:{d['name']} --> marker in the page")
            continue
        if m.group(2) != new:
            diffs += _cell_diffs(page, d, m.group(2), new, cells)
        pages[page] = text[:m.end(1)] + new + ("\n" if kind == "table" else "") + text[m.start(3):]
    for page, text in pages.items():  # a marker without a declaration is a figure nobody generates
        declared = {(k, d["name"]) for k, d in decls if d["page"] == page}
        for kind, name in re.findall(r"<!-- (table|fig):([\w.-]+) -->", text):
            if (kind, name) not in declared:
                diffs.append(f"{page}: {kind} {name}: a marker no declaration in {DECLARATIONS.name} fills")
    return pages, diffs


def _cell_diffs(page: str, d: dict, old: str, new: str, cells) -> list[str]:
    if cells is None:
        return [f"{page}: fig {d['name']}: the page says {old!r}, its records give {new!r}"]
    split = lambda line: [c.strip() for c in line.strip().strip("|").split(" | ")]  # noqa: E731
    lines = old.splitlines()
    if not lines:
        return [f"{page}: table {d['name']}: empty in the page, its records give {len(cells)} rows"]
    olds = [split(x) for x in lines[2:]]
    out = []
    if split(lines[0]) != d["head"]:
        out.append(f"{page}: table {d['name']}: the header differs from the declaration")
    for i, row in enumerate(cells):
        was = olds[i] if i < len(olds) else []
        for j, (col, cell) in enumerate(zip(d["head"], row)):
            if j >= len(was) or was[j] != cell:
                label = re.sub(r"[`*]", "", next((c for c in row[:2] if c), ""))[:50]
                out.append(f"{page}: table {d['name']}, row {i + 1} ({label}), column '{col}': the page says "
                           f"{(was[j] if j < len(was) else None)!r}, its records give {cell!r}")
    if len(olds) != len(cells):
        out.append(f"{page}: table {d['name']}: the page has {len(olds)} rows, the declaration {len(cells)}")
    return out or [f"{page}: table {d['name']}: differs in spacing"]


def records_read(spec: dict, root: Path = ROOT) -> set[str]:
    """Every record a declaration names, under docs/gpu_results (what a copy of the pages needs to be checked)."""
    specs = list(spec.get("figs", {}).values())
    for d in spec.get("table", []) + spec.get("fig", []):
        specs += [d] + d.get("row", [])  # their own ``rec`` (a default for their figures)
        for figs in [d.get("figs", {})] + [r.get("figs", {}) for r in d.get("row", [])]:
            specs += figs.values()
    pats = {p for f in specs if "rec" in f for p in (f["rec"] if isinstance(f["rec"], list) else [f["rec"]])}
    records = Records(root)
    return {p for pat in pats for p in (records.glob(pat) if "*" in pat else [pat])}


def main(argv=None) -> int:
    from vdbench.helptext import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a page differs from its records")
    ap.add_argument("--records", action="store_true", help="list the records the declarations read, and exit")
    ap.add_argument("--root", type=Path, default=None,
                    help="the checkout whose pages and records to use (default: the one this script is in)")
    ap.add_argument("--declarations", type=Path, default=None,
                    help="the declarations file (default: bench/docs_tables.toml beside this script)")
    args = ap.parse_args(argv)
    args.root, args.declarations = args.root or ROOT, args.declarations or DECLARATIONS
    t0 = time.perf_counter()
    try:
        import vdbench.measure.record  # noqa: F401 - the records' reader: this checkout's package, torch with it
    except ModuleNotFoundError as e:
        print(f"error: bench/docs_tables.py reads the records with vdbench ({e})\n"
              "hint: run it in the project's environment: source .venv/bin/activate (make setup creates it)",
              file=sys.stderr)
        return 2
    try:
        spec = load(args.declarations)
        if args.records:
            print("\n".join(sorted(records_read(spec, args.root))))
            return 0
        pages, diffs = generate(args.root, spec)
    except (DocsError, OSError) as e:
        print(f"error: {e}\nhint: the declarations are in {args.declarations}", file=sys.stderr)
        return 2
    if args.check:
        for line in diffs:
            print(line, file=sys.stderr)
        took = f"({len(pages)} pages, {time.perf_counter() - t0:.1f} s)"
        print(f"{len(diffs)} cells differ from their records; `python3 bench/docs_tables.py` rewrites them {took}"
              if diffs else f"every table and figure matches its records {took}", file=sys.stderr)
        return 1 if diffs else 0
    for page, text in pages.items():
        path = args.root / page
        if path.read_text() != text:
            path.write_text(text)
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
