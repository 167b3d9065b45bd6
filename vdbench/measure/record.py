"""One measurement, one record: the schema every vdbench tool writes and every reader reads.

A :class:`Record` says what was measured and how far to trust it, in one shape whatever the tool:

* ``suite`` / ``case``: which tool (``render``, ``attention``, ``vae``, ``cold_decode``, ``quality``) and which of
  its cases (a render's backend stack, a kernel on an input, a VAE config);
* ``config``: the resolved configuration as data (backend stack, layout, model, sizes): readers take a run's
  identity from here (:func:`identity`; a render's layout and VAE modes from its entry in ``data``), never from a
  file name;
* ``figures``: named measurements; a timed one is :func:`figure` -- its samples, their spread (n, median, p20/p80,
  min/max) and the first call apart; others plain numbers;
* ``verdict``: ``speed_figure`` (True / False / None: not judged) and ``why_not``; ``timer``: how it was timed;
* ``system`` (devices, versions), ``commit`` (of the vdbench checkout, ``-dirty`` when it had changes),
  ``command`` (the exact command line), ``created`` (UTC);
* ``data``: the tool's own row or entry, whole (nothing the tool wrote is lost in the conversion).

Records are written one JSON object per line (``records.jsonl``: :class:`Writer`, appends under a file lock, each
line complete or absent) and read back by :func:`read`, which also reads the files the tools wrote before they wrote
records (a render's ``timing.json``, the attention, VAE and cold-decode benches' JSON, ``compare_outputs``' quality
JSON) as records of the same schema. A file of a newer schema version is refused, not guessed at.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from ..timing import spread

__all__ = ["SCHEMA", "VERSION", "Record", "figure", "commit", "command_line", "Writer", "read",
           "RecordError", "from_render_entry", "records_of", "write_beside", "Identity", "identity", "layout_tag",
           "run_label", "cache_tag", "spec_from_tag", "speed_options", "stack_name", "split_stack",
           "parse_layout", "layout_ranks",
           "options_tag", "options_from_tag", "STACK_WORDS", "STACK_KEYS", "fp8_gemm_scope",
           "settings_speed_options", "identity_tags", "split_identity_tags"]

SCHEMA = "vdbench.record"
#: Bump when a reader of the previous version would misread a record; readers refuse versions above theirs.
VERSION = 1


class RecordError(ValueError):
    """A file that holds no records this reader knows (with the path, and the line where there is one)."""


@dataclasses.dataclass
class Record:
    suite: str
    case: str
    config: dict = dataclasses.field(default_factory=dict)
    figures: dict = dataclasses.field(default_factory=dict)
    verdict: dict = dataclasses.field(default_factory=lambda: {"speed_figure": None, "why_not": None})
    timer: Optional[str] = None
    system: dict = dataclasses.field(default_factory=dict)
    commit: Optional[str] = None
    command: Optional[str] = None
    created: Optional[str] = None
    data: dict = dataclasses.field(default_factory=dict)
    schema: str = SCHEMA
    version: int = VERSION
    #: where a reader found it (not written): the file, and the line or index in it
    source: Optional[str] = dataclasses.field(default=None, compare=False)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    @classmethod
    def from_json(cls, d: dict, source: Optional[str] = None) -> "Record":
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise RecordError(f"{source or 'record'}: not a {SCHEMA} object")
        v = d.get("version")
        if not isinstance(v, int) or v > VERSION:
            raise RecordError(f"{source or 'record'}: {SCHEMA} version {v!r}; this vdbench reads up to {VERSION} "
                              "(update vdbench to read it)")
        names = {f.name for f in dataclasses.fields(cls)} - {"source"}
        missing = {"suite", "case"} - set(d)
        if missing:
            raise RecordError(f"{source or 'record'}: missing {', '.join(sorted(missing))}")
        return cls(**{k: d[k] for k in names if k in d}, source=source)

    @property
    def speed_figure(self) -> Optional[bool]:
        return self.verdict.get("speed_figure")


def figure(samples: Iterable, *, unit: str = "ms", first=None, **extra) -> dict:
    """A timed figure: the samples (all of them, so the spread can be recomputed), their spread
    (:func:`vdbench.timing.spread`), the unit, and the first call's time apart (never one of the samples)."""
    xs = [float(x) for x in samples if x is not None]
    return {"unit": unit, "samples": xs, **spread(xs), "first": None if first is None else float(first), **extra}


@functools.lru_cache(maxsize=None)
def commit(root: Optional[str] = None) -> Optional[str]:
    """The vdbench checkout's commit (``-dirty`` with uncommitted changes), or None where it isn't a git checkout
    (an installed package) or git isn't there."""
    root = root or str(Path(__file__).resolve().parents[2])
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def command_line(argv: Optional[list] = None) -> str:
    """The command as a user would type it again: the script's name and its arguments, shell-quoted."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = os.path.basename(argv[0]) if argv[0].endswith(".py") else argv[0]
    return shlex.join(argv)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class Writer:
    """Append records to a JSON-lines file (created with its folder), each line written whole under a file lock:
    concurrent writers (ranks, parallel benches) interleave lines, never bytes; a crash leaves the lines written
    before it."""

    def __init__(self, path):
        self.path = Path(path)

    def write(self, *records: Record) -> Path:
        from filelock import FileLock

        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(r.to_json(), default=str, sort_keys=True) + "\n" for r in records)
        with FileLock(str(self.path) + ".lock"):
            with open(self.path, "a") as f:
                f.write(lines)
                f.flush()
                os.fsync(f.fileno())
        return self.path


def read(path) -> list[Record]:
    """Every record in ``path``: a ``.jsonl`` file of records, or a JSON file a tool wrote before it wrote records
    (converted: see the module doc). RecordError with the path (and line) for anything else -- a malformed line,
    a newer schema version, a JSON shape no tool writes."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{i}: not JSON ({e.msg})") from None
            out.append(Record.from_json(d, f"{path}:{i}"))
        return out
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not JSON ({e.msg})") from None
    for _, test, convert in _LEGACY:
        if test(data):
            return [dataclasses.replace(r, source=f"{path}#{i}") for i, r in enumerate(convert(data))]
    raise RecordError(f"{path}: no vdbench tool writes this JSON shape (a record file is .jsonl; known older "
                      f"shapes: {', '.join(name for name, _, _ in _LEGACY)})")


def records_of(doc, *, command: Optional[str] = None) -> list[Record]:
    """The records of a document a tool builds (a timing.json list, a bench's JSON object: the shapes
    :func:`read` knows), stamped with the command (default: this process's) and the checkout's commit -- what a
    tool writes beside its own files."""
    for _, test, convert in _LEGACY:
        if test(doc):
            stamp = {"command": command or command_line(), "commit": commit(), "created": now()}
            return [dataclasses.replace(r, **{k: v for k, v in stamp.items() if getattr(r, k) is None})
                    for r in convert(doc)]
    raise RecordError("no vdbench tool builds this document shape")


def write_beside(path, doc, *, command: Optional[str] = None) -> Path:
    """Append ``doc``'s records (:func:`records_of`) to ``records.jsonl`` in the folder of ``path`` (the file the
    tool wrote)."""
    return Writer(Path(path).with_name("records.jsonl")).write(*records_of(doc, command=command))


# --- a render's identity ---------------------------------------------------------------------------------------

def layout_tag(ulysses: int = 1, ring: int = 1, cfg: bool = False) -> str:
    """The parallel layout as a tag: ``u2``, ``r2``, ``u2r2``, ``cfg2``, ``u2cfg2``; ``""`` for one process (what
    output file names end with, and the last piece of a run's stack name)."""
    return (f"u{ulysses}" if ulysses > 1 else "") + (f"r{ring}" if ring > 1 else "") + ("cfg2" if cfg else "")


_LAYOUT_TAG = re.compile(r"^(?=.)(?:u(?P<u>[2-9]|[1-9]\d+))?(?:r(?P<r>[2-9]|[1-9]\d+))?(?P<cfg>cfg2)?$")


def parse_layout(tag: str) -> Optional[tuple[int, int, bool]]:
    """``(ulysses, ring, cfg)`` of a layout tag (:func:`layout_tag`): ``"u2cfg2"`` -> ``(2, 1, True)``; None for
    anything that is not one (``""`` included)."""
    m = _LAYOUT_TAG.match(tag or "")
    if m is None:
        return None
    return int(m["u"] or 1), int(m["r"] or 1), bool(m["cfg"])


def layout_ranks(tag: str) -> int:
    """The processes a layout runs on (1 for ``""``): Ulysses x ring x 2 with the CFG split."""
    u, r, cfg = parse_layout(tag) or (1, 1, False)
    return u * r * (2 if cfg else 1)


def cache_tag(spec: str) -> str:
    """The output-name tag of a step cache's canonical spec (``vdbench.cache``): ``fbc`` -> ``cache-fbc``,
    ``fbc:threshold=0.1,x=2`` -> ``cache-fbc-threshold=0.1-x=2``; ``""`` for none. Output names carry it before the
    layout tag (``..._64x96_cache-fbc_u2.mp4``) so a cached render never overwrites the uncached one."""
    return "cache-" + spec.replace(":", "-", 1).replace(",", "-") if spec else ""


def spec_from_tag(tag: str) -> str:
    """The canonical cache spec back from :func:`cache_tag` (a video without a record): a ``-`` before
    ``key=`` separated two parameters."""
    import re

    body = tag[len("cache-"):] if tag.startswith("cache-") else tag
    kind, _, rest = body.partition("-")
    return kind + (":" + re.sub(r"-(?=[a-z_]+=)", ",", rest) if rest else "")


def identity_tags(seed: Optional[int] = None, settings_id: Optional[str] = None) -> tuple[str, ...]:
    """The tags a render's file name ends with after its layout tag (:mod:`vdbench.identity`): ``seed7`` for a seed
    other than the default, ``id-3fa9c1d2`` for the render's other settings off their defaults; each left out when
    None."""
    return tuple(([f"seed{seed}"] if seed is not None else []) + ([f"id-{settings_id}"] if settings_id else []))


_IDENTITY_TAGS = re.compile(r"^(?P<rest>.+?)(?:_seed(?P<seed>-?\d+))?(?:_id-(?P<id>[0-9a-f]{8}))?$")


def split_identity_tags(stem: str) -> tuple[str, Optional[int], Optional[str]]:
    """``(stem without its identity tags, seed or None, id or None)``: ``"x_64x96_u2_seed7_id-3fa9c1d2"`` ->
    ``("x_64x96_u2", 7, "3fa9c1d2")`` (:func:`identity_tags` read back: the fallback for a video no record names)."""
    m = _IDENTITY_TAGS.match(stem)
    if not m:
        return stem, None, None
    return m["rest"], (int(m["seed"]) if m["seed"] is not None else None), m["id"]


# --- a render's stack: attention, speed options, VAE modes, step cache, as one name ---------------------------------

#: The stack options that are one word (the speed options): ``+compile`` (``--use_torch_compile``, inductor, its
#: default mode), ``+fp8gemm`` (``--use_fp8_gemms``: every Linear layer of the blocks), ``+bf16te``
#: (``--use_bf16_te_gemms``), ``+fp8x`` (``--ulysses_fp8_exchange on``), ``+eagerblock`` (``--fused_block off``:
#: the blocks' modulations and residuals in diffusers' eager passes; slower, the same frames).
STACK_WORDS = ("compile", "fp8gemm", "bf16te", "fp8x", "eagerblock")
#: The stack options with a value: ``compile=<backend>[:<mode>]`` (a compile other than inductor's default),
#: ``fp8gemm=<scope>`` (``--use_fp8_gemms <scope>`` other than ``all``: ``fp8gemm=ffn``), ``offload=<where>``
#: (``--offload <where>``, :mod:`vdbench.offload`), ``vae=<mode>``
#: (``--vae_decode``), ``encode=<mode>`` (``--vae_encode``), ``cache=<spec>`` (``--cache``; a stack name writes the
#: spec bare: ``+fbc:threshold=0.1``).
STACK_KEYS = ("compile", "fp8gemm", "offload", "vae", "encode", "cache")
#: What each valued option's value is, for the refusal that lists them.
_KEY_VALUE = {"compile": "backend[:mode]", "fp8gemm": "scope", "offload": "where", "cache": "spec"}
#: The attention spec's own ``+`` (a selector's ranges and kinds: ``0-4+45-``, ``self+cross``): a piece after a ``+``
#: that starts so continues the spec instead of naming an option.
_SPEC_GOES_ON = re.compile(r"^(\d|(self|cross|joint)\b)")


def fp8_gemm_scope(value: Union[bool, str, None]) -> Optional[str]:
    """The fp8 GEMMs' scope a render's ``fp8_gemms`` setting says: None (off) for None, False or ``""``; ``"all"``
    for True (records written before the setting took a scope); otherwise the scope itself (``"all"``, ``"ffn"``)."""
    if value is True:
        return "all"
    return str(value) if value else None


def speed_options(compile: bool = False, compile_backend: Optional[str] = "inductor",
                  compile_mode: Optional[str] = None, fp8_gemms: Union[bool, str, None] = None,
                  bf16_te_gemms: bool = False, offload: Optional[str] = None,
                  fp8_exchange: bool = False, fused_block: Optional[bool] = None) -> tuple[str, ...]:
    """The speed options of a render as stack options, in a stack name's order: ``("compile", "fp8gemm")``,
    ``("compile=eager",)``, ``("compile=inductor:max-autotune",)``, ``("fp8gemm=ffn",)``; ``()`` for none.
    ``fp8_gemms``: the scope (:func:`fp8_gemm_scope`), ``all`` written as the bare word. ``offload``: where the
    weights wait off the GPU (``--offload``: ``model``, ``group``, ``expert``, ``shard``); ``fp8_exchange``:
    Ulysses' V and output cross as fp8 (``fp8x``: ``--ulysses_fp8_exchange on``, lossy); ``fused_block`` False (``--fused_block
    off``): ``eagerblock`` (auto and on, the default where it runs, name nothing)."""
    out = []
    if compile:
        backend = compile_backend or "inductor"
        mode = compile_mode if backend == "inductor" else None  # the other backends take no mode (vdbench.speed)
        plain = backend == "inductor" and not mode
        out.append("compile" if plain else f"compile={backend}" + (f":{mode}" if mode else ""))
    scope = fp8_gemm_scope(fp8_gemms)
    out += [] if scope is None else ["fp8gemm" if scope == "all" else f"fp8gemm={scope}"]
    out += ["bf16te"] if bf16_te_gemms else []
    out += [f"offload={offload}"] if offload else []
    out += ["fp8x"] if fp8_exchange else []
    out += ["eagerblock"] if fused_block is False else []
    return tuple(out)


def settings_speed_options(s: dict) -> tuple[str, ...]:
    """:func:`speed_options` of a render's recorded settings (a timing entry's ``run.settings``, the RenderConfig's
    fields as data)."""
    exchange = s.get("ulysses_fp8_exchange")
    offload = s.get("offload") if s.get("offload") not in (None, "none") else ("model" if s.get("cpu_offload") else None)
    return speed_options(bool(s.get("compile")), s.get("compile_backend"), s.get("compile_mode"), s.get("fp8_gemms"),
                         bool(s.get("bf16_te_gemms")), offload, exchange is True or exchange == "on",
                         s.get("fused_block"))


def stack_name(attention: str, speed: Iterable[str] = (), vae_decode: Optional[str] = None,
               vae_encode: Optional[str] = None, cache: Optional[str] = None, layout: str = "") -> str:
    """A render's whole configuration of what makes it fast or changes its output, as one name: the attention spec
    as recorded (options, schedule), then ``+`` each speed option (:func:`speed_options`), ``+vae=<mode>`` and
    ``+encode=<mode>`` where not ``default``, the step cache's canonical spec, and the parallel layout
    (:func:`layout_tag`) of a torchrun render: ``sagev2_fp8:gran=per_warp+compile+fp8gemm+vae=fast+fbc:threshold=0.1``,
    ``fav3+u2cfg2``. A plain one-process render's stack is its attention spec. ``sweep.py --stacks`` takes the same
    string (:func:`split_stack`)."""
    parts = [attention, *speed]
    parts += [f"vae={vae_decode}"] if vae_decode not in (None, "default") else []
    parts += [f"encode={vae_encode}"] if vae_encode not in (None, "default") else []
    parts += [cache] if cache else []
    parts += [layout] if layout else []
    return "+".join(parts)


def split_stack(text: str, cache_kinds: Iterable[str] = ()) -> tuple[str, list[tuple[str, Optional[str]]]]:
    """``(attention spec, [(option, value or None), ...])`` of a stack (:func:`stack_name`'s grammar, in any order):
    ``"fav3+compile+vae=fast+fbc:threshold=0.1"`` -> ``("fav3", [("compile", None), ("vae", "fast"), ("cache",
    "fbc:threshold=0.1")])``. A step cache is ``cache=<spec>`` or, for a kind in ``cache_kinds``, its bare spec. A
    ``+`` inside the attention spec (a selector's ranges or kinds) or inside the cache's spec (a sequence's items)
    stays in it. ValueError naming the valid options for anything else; the values are checked by the render."""
    kinds = set(cache_kinds)
    head, *pieces = [p.strip() for p in text.split("+")]
    if not head:
        raise ValueError(f"stack {text!r}: no attention type before the options")
    attention, opts = head, []
    for piece in pieces:
        key, sep, value = piece.partition("=")
        if piece in STACK_WORDS:
            opts.append((piece, None))
        elif parse_layout(piece) is not None:
            opts.append(("layout", piece))
        elif sep and key in STACK_KEYS and value:
            opts.append((key, value))
        elif piece.partition(":")[0] in kinds:
            opts.append(("cache", piece))
        elif opts and opts[-1][0] == "cache":  # a sequence's next item: the cache's parser judges it
            opts[-1] = ("cache", f"{opts[-1][1]}+{piece}")
        elif not opts and _SPEC_GOES_ON.match(piece):
            attention += "+" + piece
        else:
            valid = [*STACK_WORDS, *(f"{k}=<{_KEY_VALUE.get(k, 'mode')}>" for k in STACK_KEYS)]
            valid += ["<cache spec>"] if kinds else []
            raise ValueError(f"stack {text!r}: unknown option {piece!r}; valid: {', '.join(valid)}")
    return attention, opts


def options_tag(speed: Iterable[str] = (), vae_decode: Optional[str] = None, vae_encode: Optional[str] = None) -> str:
    """The output-name tag of a stack's speed options and VAE modes (its cache has :func:`cache_tag`): the options
    joined by ``-``, a value's ``:`` written ``-`` (``compile-fp8gemm-vae=fast``, ``compile=inductor-max-autotune``,
    ``compile-fp8gemm=ffn``);
    ``""`` for none, so a plain render keeps its name. Output names carry it before the cache tag."""
    parts = [*speed] + ([f"vae={vae_decode}"] if vae_decode not in (None, "default") else [])
    parts += [f"encode={vae_encode}"] if vae_encode not in (None, "default") else []
    return "-".join(p.replace(":", "-") for p in parts)


#: Where one option of :func:`options_tag` starts (a compile mode's own ``-`` stays in it).
_TAG_OPTION = re.compile(r"-(?=(?:compile|fp8gemm|bf16te|fp8x|eagerblock)(?:-|=|$)|(?:offload|vae|encode)=)")


def options_from_tag(tag: str) -> tuple[tuple[str, ...], Optional[str], Optional[str]]:
    """``(speed options, VAE decode mode, VAE encode mode)`` back from :func:`options_tag` (a video without a
    record)."""
    speed, decode, encode = [], None, None
    for part in _TAG_OPTION.split(tag) if tag else []:
        key, _, value = part.partition("=")
        if key == "vae":
            decode = value
        elif key == "encode":
            encode = value
        else:
            speed.append(part if not value else f"{key}={value.replace('-', ':', 1)}")
    return tuple(speed), decode, encode


def run_label(attention: str, layout: str = "", vae_decode: Optional[str] = None,
              vae_encode: Optional[str] = None, cache: Optional[str] = None, speed: Iterable[str] = ()) -> str:
    """A run's label: its stack name (:func:`stack_name`), the parallel layout included: ``sdpa``, ``sdpa+u2``,
    ``fav3@steps:0-9,sta+compile+vae=fast+fbc+u2``. What the batch table, the report and the stitched grid show,
    the same spelling timing.json records and ``sweep.py --stacks`` takes."""
    return stack_name(attention, speed, vae_decode, vae_encode, cache, layout)


@dataclasses.dataclass(frozen=True)
class Identity:
    """Which run a render is: ``attention`` (a backend name with its options, or a schedule's one spelling: the
    recorded ``config["backend"]["name"]``), ``layout`` (the parallel layout tag, ``""`` for one process), the VAE
    decode and encode modes, the step cache's canonical spec (``cache``, None: none), the speed options
    (``speed``: :func:`speed_options`), whether the backend is an emulation / exact where the record says (None: not
    recorded), the ``run_id``, and ``source``: ``"record"``, or ``"file name"`` for a video no record names (the
    documented fallback: the family's output-name parser). ``stack``: the whole configuration, layout included, as
    one name (:func:`stack_name`). ``tag``: the render's identity tags (:func:`identity_tags`: ``seed7 id-3fa9c1d2``;
    ``""`` where every other setting is at its default) and ``content``: what its frames are of
    (:attr:`vdbench.identity.RenderIdentity.content`; None where not recorded); ``label``: the stack, with the tag in brackets
    where there is one (two renders of one stack and other settings are two runs)."""

    attention: str
    layout: str = ""
    vae_decode: Optional[str] = None
    vae_encode: Optional[str] = None
    cache: Optional[str] = None
    emulated: Optional[bool] = None
    exact: Optional[bool] = None
    run_id: Optional[str] = None
    source: str = "record"
    speed: tuple[str, ...] = ()
    tag: str = ""
    content: Optional[str] = None

    @property
    def stack(self) -> str:
        return stack_name(self.attention, self.speed, self.vae_decode, self.vae_encode, self.cache, self.layout)

    @property
    def label(self) -> str:
        return f"{self.stack} [{self.tag}]" if self.tag else self.stack

    @property
    def from_record(self) -> bool:
        return self.source == "record"


def identity(rec: Record) -> Identity:
    """A render record's :class:`Identity`, from its configuration and its entry alone (no file name): the backend
    stack as recorded (``config.backend``), the layout from the entry's ``parallel`` section (else the settings'
    degrees), the VAE modes from the entry (else the settings), the speed options from the settings."""
    cfg, data = rec.config or {}, rec.data or {}
    backend = cfg.get("backend") if isinstance(cfg.get("backend"), dict) else {"name": cfg.get("backend")}
    settings = cfg.get("settings") or {}
    attention = backend.get("name") or data.get("attention_type") or settings.get("attention_type") or rec.case
    par = data.get("parallel") or {}
    if par.get("tag") is not None:
        layout = par["tag"]
    else:
        src = par or settings
        layout = layout_tag(int(src.get("ulysses_degree") or 1), int(src.get("ring_degree") or 1),
                            bool(src.get("use_cfg_parallel")))
    # the entry's section says the mode that ran; an entry without an encode stage has ``vae_encode: None``, so
    # the settings' encode mode (given to a text-to-video render too) is taken only where the entry has no key
    decode = (data.get("vae_decode") or {}).get("mode") or settings.get("vae_decode")
    encode = (data["vae_encode"] or {}).get("mode") if "vae_encode" in data else settings.get("vae_encode")
    cache = (data.get("cache") or {}).get("spec") or settings.get("cache") or None
    speed = settings_speed_options(settings)
    ident = data.get("identity") or {}
    return Identity(attention=str(attention), layout=layout, vae_decode=decode, vae_encode=encode, cache=cache,
                    emulated=backend.get("emulated"), exact=backend.get("exact"),
                    run_id=data.get("run_id") or rec.created, speed=speed, tag=ident.get("tag") or "",
                    content=ident.get("content"))


# --- the files the tools wrote before records -------------------------------------------------------------------

def from_render_entry(e: dict) -> Record:
    """The record of one timing.json entry (a render's repetition): its backend stack and settings as the
    configuration, the warm steps (after the first) as the timed figure with the first step apart, the stage and
    end-to-end seconds beside it."""
    if not isinstance(e, dict):
        raise RecordError("timing.json entry is not an object")
    run = e.get("run") or {}
    steps = e.get("step_times") or []
    figs: dict[str, Any] = {"step_ms": figure([s * 1e3 for s in steps[1:]], first=steps[0] * 1e3 if steps else None)}
    for k in ("denoise_s", "step_mean", "end_to_end_s", "steady_s", "vae_decode_time", "vae_encode_time",
              "text_encode_time", "peak_memory_bytes"):
        if e.get(k) is not None:
            figs[k] = e[k]
    if isinstance(e.get("one_time"), dict):
        figs["one_time_s"] = e["one_time"].get("total_s")
    if isinstance(e.get("cache"), dict):  # what the cache skipped: a cached step's median isn't its mean
        figs["cache_skipped_share"] = e["cache"].get("skipped_share")
    # a warm step's joules (every card's, on several), the card's power and how much of it ran power-capped
    from ..power import warm_energy

    power = e.get("power_all_ranks") or e.get("power") or {}
    joules = warm_energy(power.get("energy_j") or []) if power.get("source") else None
    if joules is not None:
        figs["step_energy_j"] = joules
    for k in ("warm_power_w", "warm_capped_share"):
        if (e.get("power") or {}).get(k) is not None:
            figs[k.replace("warm_", "step_")] = e["power"][k]
    system = run.get("system") or {}
    backend = run.get("backend") or {"name": e.get("attention_type")}
    return Record(
        suite="render", case=str(backend.get("name", e.get("attention_type"))),
        config={"backend": backend, "cache": (e.get("cache") or {}).get("spec"), "stack": e.get("stack"),
                "settings": run.get("settings") or {}, "resolved": run.get("resolved") or {}},
        figures=figs, verdict={"speed_figure": e.get("speed_figure"), "why_not": e.get("why_not_speed")},
        timer=("CUDA events per step" if str(system.get("device", "")).startswith("cuda") else "host clock per step"),
        system=system, commit=run.get("commit"), command=run.get("command"), created=e.get("run_id"), data=e)


def _render(entries: list) -> Iterator[Record]:
    for e in entries:
        yield from_render_entry(e)


def _attention(d: dict) -> Iterator[Record]:
    for r in d["rows"]:
        samples = r.get("time_samples_ms") or []
        f = {"unit": "ms", "samples": samples, "n": r.get("time_n"), "median": r.get("time_ms"),
             "p20": r.get("time_p20_ms"), "p80": r.get("time_p80_ms"), "min": r.get("time_min_ms"),
             "max": r.get("time_max_ms"), "mean": None, "first": r.get("first_call_ms")}
        figs = {"time_ms": f}
        for k in ("tflops", "gbps", "rel_l2", "cosine", "max_abs", "quant_ms"):
            if r.get(k) not in (None, ""):
                figs[k] = r[k]
        yield Record(suite="attention", case=f"{r.get('input')}/{r.get('kernel')}",
                     config={"backend": r.get("kernel"), "kernel": r.get("kernel_label"), "input": r.get("input"),
                             "shape": {k: r.get(k) for k in ("B", "H", "Sq", "Sk", "D")}, "dtype": r.get("dtype"),
                             "grid": r.get("grid") or None},
                     figures=figs, verdict={"speed_figure": r.get("speed_figure"), "why_not": r.get("why_not_speed")
                                            or (r.get("status") if r.get("status") not in (None, "ok") else None)},
                     timer=r.get("timer"), system=d.get("system") or {}, data=r)


def _vae(d: dict) -> Iterator[Record]:
    args = d.get("args") or {}
    for r in d["results"]:
        figs = {k: r[k] for k in ("peak_memory_gib", "psnr_min", "psnr_mean", "ssim_min", "latent_rel_l2")
                if r.get(k) is not None}
        if r.get("times_s"):  # the decode's (or, with --ops encode alone, the encode's) warm calls
            figs["time_s"] = figure(r["times_s"], unit="s", first=r.get("first_call_s"))
        if r.get("encode_times_s"):
            figs["encode_time_s"] = figure(r["encode_times_s"], unit="s", first=r.get("encode_first_call_s"))
        yield Record(suite="vae", case=str(r.get("config")),
                     config={"vae_config": r.get("config"), "model": args.get("model"), "size": args.get("size"),
                             "frames": args.get("frames"), "dtype": r.get("dtype")},
                     figures=figs, verdict={"speed_figure": r.get("speed_figure"), "why_not": r.get("why_not_speed")},
                     system=d.get("system") or {}, data=r)


def _cold(d: dict) -> Iterator[Record]:
    for r in d["rows"]:
        warm = [c.get("wall_s") for c in r.get("warm") or []]
        yield Record(suite="cold_decode", case=str(r.get("variant")),
                     config={"variant": r.get("variant"), "model": r.get("model"), "size": r.get("size"),
                             "frames": r.get("frames"), "caches": r.get("caches")},
                     figures={"decode_s": figure(warm, unit="s", first=r.get("first_s"))},
                     verdict={"speed_figure": r.get("speed_figure"), "why_not": r.get("why_not_speed")},
                     timer="host clock around a synchronized call", system={"device": r.get("device")},
                     command=d.get("command"), data=r)


def _quality(d: dict) -> Iterator[Record]:
    for r in d["rows"]:
        if not isinstance(r, dict):
            raise RecordError("quality row is not an object")
        case = r.get("video") or r.get("name") or r.get("backend") or "?"
        figs = {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        yield Record(suite="quality", case=str(case), config={"reference": d.get("reference")}, figures=figs,
                     data=r)


def _spread_figure(t, unit="ms") -> Optional[dict]:
    """A spread the tool kept without its samples (``{n, median, p20, p80, ...}`` or ``median_ms`` keys)."""
    if not isinstance(t, dict):
        return None
    g = lambda k: t.get(k, t.get(f"{k}_ms"))  # noqa: E731
    return {"unit": unit, "samples": [], "n": t.get("n"), "median": g("median"), "p20": g("p20"), "p80": g("p80"),
            "min": g("min"), "max": g("max"), "mean": g("mean"), "first": None}


def _fp8(d: dict) -> Iterator[Record]:
    for r in d["rows"]:
        figs = {k: r[k] for k in ("rel_l2", "rel_l2_emu", "emu_vs_kernel_rel_l2", "emu_ratio", "registry_over_bare",
                                  "lse_max_abs") if r.get(k) is not None}
        for k in ("time_registry", "time_bare", "time_prepass", "time_torch_prepass_then_kernel"):
            f = _spread_figure(r.get(k))
            if f:
                figs[k[5:] + "_ms"] = f
        yield Record(suite="fp8", case=f"{r.get('input')}/{r.get('backend')}",
                     config={"backend": r.get("backend"), "kernel": r.get("kernel"), "input": r.get("input"),
                             "twin": r.get("twin")}, figures=figs,
                     verdict={"speed_figure": None, "why_not": None if r.get("status") == "ok" else r.get("status")},
                     timer="CUDA events, interleaved", system=d.get("system") or {}, data=r)


def _sage2(d: dict) -> Iterator[Record]:
    system = {k: d.get(k) for k in ("torch", "python", "device", "capability")}
    for shape in d["shapes"]:
        for v in shape.get("variants") or []:
            figs = {k: v[k] for k in ("rel_l2", "rel_l2_emu", "emu_vs_kernel_rel_l2", "emu_ratio", "tflops")
                    if v.get(k) is not None}
            t = _spread_figure(v.get("time"))
            if t:
                figs["time_ms"] = t
            yield Record(suite="sage2", case=f"{shape.get('name')}/{v.get('name')}",
                         config={"backend": v.get("name"), "function": v.get("function"), "kwargs": v.get("kwargs"),
                                 "shape": {k: shape.get(k) for k in ("B", "H", "S", "D")}}, figures=figs,
                         verdict={"speed_figure": None,
                                  "why_not": None if v.get("status") == "ok" else v.get("status")},
                         timer="CUDA events", system=system, data=v)


#: (what wrote it, does a document have its shape, its records), in the order :func:`read` tries them
_LEGACY = (
    ("a render's timing.json (a list of entries)", lambda d: isinstance(d, list), _render),
    ("the attention bench's JSON ({system, rows})",
     lambda d: isinstance(d, dict) and "rows" in d and "system" in d and "flops" in d, _attention),
    ("the VAE bench's JSON ({system, args, results})",
     lambda d: isinstance(d, dict) and "results" in d and "args" in d, _vae),
    ("bench/cold_decode.py's JSON ({command, rows})",
     lambda d: isinstance(d, dict) and "rows" in d and "command" in d, _cold),
    ("bench/compare_outputs.py's JSON ({reference, rows})",
     lambda d: isinstance(d, dict) and "rows" in d and "reference" in d, _quality),
    ("bench/bench_fp8.py's JSON ({system, rows, alpha, checks})",
     lambda d: isinstance(d, dict) and "rows" in d and "alpha" in d and "checks" in d, _fp8),
    ("bench/bench_sage2.py's JSON ({device, capability, shapes})",
     lambda d: isinstance(d, dict) and "shapes" in d and "capability" in d, _sage2),
)
