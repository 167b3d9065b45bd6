"""The registry: ``Backend`` (one entry carries everything about one attention backend), its composable checks,
and ``register()`` / ``resolve()``.

Every CLI of the project (run_wan.py, sageattn_cogvideo.py, bench/) takes the same names. A backend is a
callable with ONE layout convention, the one of ``torch.nn.functional.scaled_dot_product_attention``::

    out = backend(q, k, v, scale=None, is_causal=False)      # q, k, v, out: (batch, heads, seq, head_dim)

``out`` has q's dtype. A kernel that wants another layout (FlashAttention's BSHD) transposes views inside its
wrapper; ``Backend.layout`` records the one the kernel itself uses.

Why an entry carries every fact about its backend: availability needs a *reason* (package missing, no CUDA,
wrong architecture, unsupported head dim or dtype) so that a run asking for a backend that can't run stops
before any work saying why, and every caller (patching, parallel, render, the bench, ``--list_backends``) must
agree on what a name means. Callers ask the entry -- ``passthrough``, ``lse_form(device)``, ``call_label(...)``,
``bench.bytes_moved(...)``, ``bench.prepass``, ``sparse`` -- and never compare names, so adding a kernel is one
``register(Backend(...))`` next to its wrapper in one module of this package, and no caller changes.

An entry has three parts, each read by different callers: the runtime facts on ``Backend`` itself (what every
caller that runs attention needs), ``Backend.bench`` (a ``BenchProfile``: the bytes model and the quantization
pre-pass, read by the bench and by ``exact``) and ``Backend.sparse`` (a ``SparseUse``, or None for a dense kernel:
the pattern, its call with the token grid and its option grammar, read by the patching core, the bench and
``resolve``). An entry that gives no bench profile gets the default one (Q, K, V read and O written at the input's
width, no pre-pass).

Options: an entry may declare ``options`` (``Option``: key, default, accepted values) and a ``bind`` hook; then
``resolve("sagev2_fp8:gran=per_warp")`` returns the entry bound to those options -- named by its canonical spelling
(options in declared order, defaults left out, ``+`` between them so a comma-separated list of names stays whole;
``,`` is accepted on input too), its kernel label naming them -- and a spelling whose options are all defaults is
the entry itself, so one behaviour has one name (output files, timing.json, the report). The mechanism is generic:
any entry module (the sparse patterns' ``sta:window=3x3x3,tile=6x8x8`` too) declares its options and binds them in
one function; every caller that takes a name takes a spelling with options.

What this deliberately does not copy from diffusers' ``_AttentionBackendRegistry``: there is no global active
backend (``vdbench.patching`` installs one backend into one pipeline for one run), and a call a backend cannot
serve exactly as asked raises ``UnsupportedCall`` instead of dropping the argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.machinery
import importlib.util
import itertools
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

__all__ = ["Backend", "BenchProfile", "CallShape", "SparseUse", "BackendUnavailable", "UnsupportedCall", "LSEForm",
           "Option", "BytesMoved", "traffic", "HALF", "ANY_FLOAT", "RequiresPackage", "requires_package", "cuda",
           "cuda_dtypes", "probe", "register", "unregister", "registered", "resolve", "get_backend", "canonical_name",
           "names", "aliases", "availability", "available_names", "capability_table", "require_here", "BACKENDS"]

HALF = (torch.float16, torch.bfloat16)
ANY_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_ARCH_NAMES = {7: "Volta/Turing", 8: "Ampere/Ada", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}


class BackendUnavailable(RuntimeError):
    """A requested backend cannot run here (unknown name, package, device, architecture, dtype or head dim)."""


class UnsupportedCall(RuntimeError):
    """One attention call has arguments the backend cannot serve (a mask, dropout, a dtype, a head dim)."""


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _device_of(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ----------------------------------------------------------------------------------------------------------
# What an entry carries besides its callable
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LSEForm:
    """The log-sum-exp-returning form of a backend, which ring attention needs to merge partial results.

    ``fn(q, k, v, *, scale=None, is_causal=False) -> (out, lse)``, BHSD, ``lse`` (batch, heads, seq_q) float32,
    the natural-log LSE of the scaled scores -- the kernel's own, never recomputed beside it. ``devices``: the
    device types it gives one on; ``label``: the kernel label its calls are counted under, or ``label(q) -> str``
    where the kernel that runs is decided per device (a package's own dispatcher).
    """

    fn: Callable
    devices: tuple[str, ...]
    label: Union[str, Callable[[torch.Tensor], str]]

    def call_label(self, q: torch.Tensor) -> str:
        """The label a call on ``q`` is counted under."""
        return self.label if isinstance(self.label, str) else self.label(q)


@dataclass(frozen=True)
class SparseUse:
    """The sparse part of an entry: the pattern it computes, how a call with the token grid runs it and how its
    option string is parsed -- what a backend that needs per-model state (the token grid of each call) asks of the
    patching core.

    Why: a sparse pattern (``sta``, ``radial``) is a statement about grid neighbours, and the grid is known on
    the transformer (its latent shape and patch size), not in a flat attention call. The patching core installs
    the model family's grid hooks on every patched transformer (``Family.grid_hooks``) and routes the calls of
    such a backend through ``attend(hooks, q, k, v, *, scale, is_causal) -> (out, label, block stats)``, where
    ``hooks.grid`` is the grid of the forward in progress and ``hooks.layout`` the tile order the tokens already
    arrive in (None: the model's own order). ``spec`` is what the hooks are built with (the pattern, whose layout
    a once-per-forward hook puts the tokens in); ``once_per_forward``: the backend accepts tokens already in that
    layout (False: the hooks only track the grid and ``attend`` permutes per call). ``configure(options) -> entry``:
    the pattern's own option grammar (``sta:window=3x3x3,tile=6x8x8``), which ``resolve`` hands the text after the
    ``:`` to instead of the generic ``Option`` parsing (None: the entry takes no options).
    """

    spec: object
    attend: Callable
    once_per_forward: bool = True
    configure: Optional[Callable[[str], "Backend"]] = field(default=None, compare=False)


class BytesMoved(NamedTuple):
    """Bytes one attention call really moves: by the kernel (Q/K/V read, O written) and by its quantization
    pre-pass (0 where there is none), so a bandwidth figure can count both and say whether the time holds both."""

    kernel: int
    prepass: int

    @property
    def total(self) -> int:
        return self.kernel + self.prepass


def traffic(widths: tuple = (None, None, None), prepass_reads: tuple = (0, 0, 0)) -> Callable[..., BytesMoved]:
    """A bytes model ``(b, h, sq, sk, d, itemsize) -> BytesMoved``.

    The kernel reads Q, K, V at ``widths`` bytes per element (None: the input's itemsize; int8/fp8 count 1) and
    writes O at the itemsize. The pre-pass reads tensor i ``prepass_reads[i]`` times at the itemsize (a K mean or
    a V amax is one more read) and writes it once at its kernel width. Tile padding and the per-block scales are
    left out (well under 1 % at the models' sizes).
    """

    def model(b: int, h: int, sq: int, sk: int, d: int, itemsize: int) -> BytesMoved:
        elems = (b * h * sq * d, b * h * sk * d, b * h * sk * d)
        width = [itemsize if w is None else w for w in widths]
        kernel = sum(n * w for n, w in zip(elems, width)) + elems[0] * itemsize
        pre = sum(n * (reads * itemsize + w) for n, w, reads in zip(elems, width, prepass_reads) if reads)
        return BytesMoved(kernel, pre)

    return model


@dataclass(frozen=True)
class BenchProfile:
    """The part of an entry only the bench reads (and ``Backend.exact``, which asks the bytes model whether the
    kernel reads narrower inputs): ``bytes_model(b, h, sq, sk, d, itemsize) -> BytesMoved`` (``traffic``; the
    default reads Q, K, V and writes O at the input's width) and ``prepass(q, k, v, scale)``, the quantization
    pre-pass alone so that it can be timed apart (None: there is none, or it runs inside a call that exposes no
    way to run it alone -- then its bytes are still counted by the model)."""

    bytes_model: Callable[..., BytesMoved] = field(default=traffic(), compare=False)
    prepass: Optional[Callable] = None

    def bytes_moved(self, b: int, h: int, sq: int, sk: int, d: int, itemsize: int) -> BytesMoved:
        return self.bytes_model(b, h, sq, sk, d, itemsize)


class CallShape(NamedTuple):
    """One attention call's shape as a render will make it, known before the load (``Family.attention_calls``, from
    the model's configs and the render's size): what a backend's ``prewarm`` compiles its kernels for. Q is (batch,
    heads, seq, head_dim), K and V (batch, heads_kv, seq_kv, head_dim)."""

    batch: int
    heads: int
    seq: int
    heads_kv: int
    seq_kv: int
    head_dim: int

    def meta_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) of this shape on the meta device (no storage), BHSD views of BSHD memory -- the layout
        diffusers' attention dispatch hands the backends -- for a call run for its shapes alone."""
        def make(h, s):
            return torch.empty((self.batch, s, h, self.head_dim), device="meta", dtype=dtype).transpose(1, 2)

        return make(self.heads, self.seq), make(self.heads_kv, self.seq_kv), make(self.heads_kv, self.seq_kv)


@dataclass(frozen=True)
class Option:
    """One option of an entry, given as ``name:key=value``: its key, default, the values it accepts and what it does.

    ``choices``: the accepted spellings (the value is the spelling itself); else ``parse(text) -> value`` (raising
    ValueError that says what is accepted) and ``spell(value) -> text`` its inverse (a tile ``(6, 8, 8)`` spelled
    ``6x8x8``). ``help`` is shown by ``--list_backends`` and in every error about the option.
    """

    key: str
    default: object
    choices: tuple[str, ...] = ()
    parse: Optional[Callable[[str], object]] = field(default=None, compare=False)
    spell: Callable[[object], str] = field(default=str, compare=False)
    help: str = ""

    def __post_init__(self):
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.key):
            raise ValueError(f"option key {self.key!r}: lower-case letters, digits and _ only")
        if self.choices and self.default not in self.choices:
            raise ValueError(f"option {self.key!r}: default {self.default!r} is not one of {self.choices}")
        if not self.choices and self.parse is None:
            raise ValueError(f"option {self.key!r} needs choices or a parse function")

    def value(self, text: str):
        if self.choices:
            if text not in self.choices:
                raise ValueError(f"{self.key}={text!r} is not one of {'|'.join(self.choices)}")
            return text
        return self.parse(text)

    def describe(self) -> str:
        accepted = "|".join(self.choices) if self.choices else self.help
        return (f"{self.key}={accepted} (default {self.spell(self.default)})"
                + (f": {self.help}" if self.help and self.choices else ""))


# ----------------------------------------------------------------------------------------------------------
# Composable checks: each is ``check(device, dtype, head_dim) -> reason or None``, run in the order given
# ----------------------------------------------------------------------------------------------------------

def _cuda_problem(device: torch.device, min_arch: Optional[tuple[int, int]], major: Optional[int]) -> Optional[str]:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability(device)
    if min_arch and cap < min_arch:
        return f"needs compute capability >= {min_arch[0]}.{min_arch[1]}, GPU is {cap[0]}.{cap[1]}"
    if major is not None and cap[0] != major:
        return f"built for sm_{major}0 ({_ARCH_NAMES.get(major, 'one architecture')}) only, GPU is sm_{cap[0]}{cap[1]}"
    return None


def _findable(module: str) -> bool:
    """Whether ``module`` is on the path, found without importing it -- nor, for a dotted name, its parent package.

    Why the walk for a dotted name: ``importlib.util.find_spec("a.b")`` imports ``a`` first (and raises when ``a`` is
    missing). FlashAttention-4's ``flash_attn.cute`` shares the ``flash_attn`` package with FlashAttention-2, whose
    ``__init__`` loads FA2's CUDA extension: an availability check must not pay for (or fail on) that import.
    """
    if "." not in module or module.rpartition(".")[0] in sys.modules:
        return importlib.util.find_spec(module) is not None
    head, *tail = module.split(".")
    spec = importlib.util.find_spec(head)
    name = head
    for part in tail:
        if spec is None:
            return False
        where = getattr(spec, "submodule_search_locations", None)
        if where is None:  # a plain module has no submodules; a stand-in spec (tests pretending) counts as found
            return not isinstance(spec, importlib.machinery.ModuleSpec)
        name = f"{name}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(name, list(where))
    return spec is not None


@dataclass(frozen=True)
class RequiresPackage:
    """Any one of ``modules`` importable (checked without importing it, or a dotted name's parent package);
    ``hint`` says how to install it."""

    modules: tuple[str, ...]
    hint: Optional[str] = None

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        if any(_findable(m) for m in self.modules):
            return None
        return f"package not installed: {' or '.join(self.modules)}" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Cuda:
    """A CUDA device with a working CUDA runtime, at least ``min_arch``, or exactly ``major`` (kernels built for
    one architecture, FA3's Hopper)."""

    min_arch: Optional[tuple[int, int]] = None
    major: Optional[int] = None

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        if device.type != "cuda":
            return f"needs a CUDA GPU (device is {device.type})"
        return _cuda_problem(device, self.min_arch, self.major)


@dataclass(frozen=True)
class CudaDtypes:
    """On a CUDA device only: a working CUDA runtime and one of ``dtypes`` (torch's flash kernel: half only on
    CUDA, fp32 too on a CPU). Off CUDA it says nothing: the entry's own dtypes decide."""

    dtypes: tuple[torch.dtype, ...]

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        if device.type != "cuda":
            return None
        problem = _cuda_problem(device, None, None)
        if problem is None and dtype is not None and dtype not in self.dtypes:
            problem = f"dtype {_dtype_names([dtype])} unsupported (supports {_dtype_names(self.dtypes)})"
        return problem


@dataclass(frozen=True)
class Probe:
    """A runtime probe ``fn(device) -> (ok, why)`` (the Triton kernels: GPU, or the interpreter on a CPU)."""

    fn: Callable[[torch.device], tuple[bool, str]]

    def __call__(self, device, dtype, head_dim) -> Optional[str]:
        ok, why = self.fn(device)
        return None if ok else why


# The spellings entries use; the classes above stay inspectable (the install hint is read off RequiresPackage).

def requires_package(*modules: str, hint: Optional[str] = None) -> RequiresPackage:
    return RequiresPackage(tuple(modules), hint)


def cuda(min_arch: Optional[tuple[int, int]] = None, major: Optional[int] = None) -> Cuda:
    return Cuda(min_arch, major)


def cuda_dtypes(*dtypes: torch.dtype) -> CudaDtypes:
    return CudaDtypes(tuple(dtypes))


def probe(fn: Callable[[torch.device], tuple[bool, str]]) -> Probe:
    return Probe(fn)


# ----------------------------------------------------------------------------------------------------------
# The entry
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """A registry entry. ``fn`` follows the layout convention (BHSD in, BHSD out).

    ``constraints`` are checked in order by ``availability`` before the call-level capabilities (``dtypes``,
    ``head_dims``, ``max_head_dim``), which ``check_call`` enforces per call with ``supports_mask`` and
    ``supports_causal``. ``passthrough``: installing it leaves the pipeline's own attention running (counted).
    ``twin``: the registered emulation of this kernel's numerics; ``install_hint`` defaults to the hint of a
    ``requires_package`` constraint. ``label(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)`` names
    the kernel of one call where that is decided per call (torch sdpa's choice). ``options`` /
    ``bind(entry, values) -> entry``: the options the entry takes and how an entry bound to a full set of values is
    made (``resolve`` calls it; a ValueError from it is the refusal of that combination); ``bound``: the
    non-default (key, value) pairs a bound entry carries (empty for a registered one); ``variants``: option sets
    (``"smooth_v=1"``) worth ranking beside the plain entry -- the form to use where the plain one keeps a package's
    own numerics for comparison; the sweep benches and may render each as a candidate of its own.

    ``bench``: what only the bench reads (``BenchProfile``: bytes model, pre-pass); ``sparse``: the pattern of an
    entry that needs the token grid (``SparseUse``; None for a dense kernel). A bind hook that changes them
    replaces the whole part (``bench=BenchProfile(...)``).

    ``prewarm(calls, device, dtype) -> dict``: what the entry's first calls would compile (a JIT's kernels), done
    ahead for the ``CallShape`` s a render will call it with -- compile-only, on meta tensors, no GPU launch;
    returns what it did (``compiled``: how many kernels, ``note``: why nothing where nothing was due); with no
    calls, only what it imports. The render runs it in a worker process and then on a thread of its own during the
    load (:mod:`vdbench.backends.prewarm`) and its first attention call waits for it; None: the entry compiles
    nothing on first use worth moving.
    """

    name: str
    description: str
    fn: Callable[..., torch.Tensor]
    kernel: str  # label of the kernel that runs; call counts are keyed by it
    layout: str = "BHSD"
    constraints: tuple = ()
    dtypes: tuple[torch.dtype, ...] = ANY_FLOAT
    head_dims: Optional[tuple[int, ...]] = None  # None: any
    max_head_dim: Optional[int] = None
    supports_mask: bool = False
    supports_causal: bool = True
    lse: Optional[LSEForm] = None
    no_lse_reason: str = ""
    passthrough: bool = False
    emulated: bool = False
    twin: Optional[str] = None
    install_hint: Optional[str] = None
    label: Optional[Callable[..., str]] = None
    aliases: tuple[str, ...] = ()
    notes: str = ""
    options: tuple[Option, ...] = ()
    bind: Optional[Callable[["Backend", dict], "Backend"]] = field(default=None, compare=False)
    bound: tuple[tuple[str, object], ...] = ()
    variants: tuple[str, ...] = ()
    bench: BenchProfile = field(default_factory=BenchProfile)
    sparse: Optional[SparseUse] = None
    prewarm: Optional[Callable[..., dict]] = field(default=None, compare=False)

    def __post_init__(self):
        if self.layout not in ("BHSD", "BSHD"):
            raise ValueError(f"backend '{self.name}': layout must be BHSD or BSHD, got {self.layout!r}")
        if self.options and self.bind is None:
            raise ValueError(f"backend '{self.name}' declares options but no bind hook to apply them")
        if self.options and self.sparse is not None and self.sparse.configure is not None:
            raise ValueError(f"backend '{self.name}': options are parsed either by Option/bind or by its sparse "
                             "pattern's configure, not both")
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "constraints", tuple(self.constraints))
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "variants", tuple(self.variants))
        if self.variants and not self.options:
            raise ValueError(f"backend '{self.name}' lists variants but takes no options")
        if self.install_hint is None:
            hints = [c.hint for c in self.constraints if isinstance(c, RequiresPackage) and c.hint]
            object.__setattr__(self, "install_hint", hints[0] if hints else None)

    # ----- can it run here -----

    def availability(self, device=None, dtype: Optional[torch.dtype] = None,
                     head_dim: Optional[int] = None) -> tuple[bool, str]:
        """(available, reason): the first check that fails says why; "ok" when none does."""
        dev = _device_of(device)
        for check in self.constraints:
            why = check(dev, dtype, head_dim)
            if why:
                return False, why
        if dtype is not None and dtype not in self.dtypes:
            return False, f"dtype {_dtype_names([dtype])} unsupported (supports {_dtype_names(self.dtypes)})"
        if head_dim is not None:
            problem = self._head_dim_problem(head_dim)
            if problem:
                return False, problem
        return True, "ok"

    def require(self, device=None, dtype: Optional[torch.dtype] = None, head_dims: Sequence[int] = ()) -> "Backend":
        """This entry, or BackendUnavailable with the reason (the install hint in it) and the emulation to use."""
        for hd in sorted(set(head_dims)) or [None]:
            ok, reason = self.availability(device, dtype, hd)
            if not ok:
                twin = f"; '{self.twin}' emulates its numerics on any device" if self.twin else ""
                raise BackendUnavailable(f"attention backend '{self.name}' can't run here: {reason}{twin}")
        return self

    def _head_dim_problem(self, head_dim: int) -> Optional[str]:
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"does not support head dim {head_dim} (supports {list(self.head_dims)})"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"supports head dims up to {self.max_head_dim}, got {head_dim}"
        return None

    def check_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None,
                   dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> None:
        """Raise UnsupportedCall if this backend cannot serve the call exactly as asked."""
        if attn_mask is not None and not self.supports_mask:
            raise UnsupportedCall(f"backend '{self.name}' does not support an attention mask "
                                  f"(got mask of shape {tuple(attn_mask.shape)})")
        if dropout_p:
            raise UnsupportedCall(f"backend '{self.name}' does not support dropout (dropout_p={dropout_p})")
        if is_causal and not self.supports_causal:
            raise UnsupportedCall(f"backend '{self.name}' does not support causal attention")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise UnsupportedCall(f"backend '{self.name}' needs 4-D (batch, heads, seq, dim) inputs, got "
                                  f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if k.shape[1] != q.shape[1] and not enable_gqa:
            raise UnsupportedCall(f"backend '{self.name}': query has {q.shape[1]} heads, key {k.shape[1]} "
                                  "(grouped-query attention not requested)")
        if q.dtype not in self.dtypes:
            raise UnsupportedCall(f"backend '{self.name}' does not support dtype {q.dtype} "
                                  f"(supports {_dtype_names(self.dtypes)})")
        problem = self._head_dim_problem(q.shape[-1])
        if problem:
            raise UnsupportedCall(f"backend '{self.name}' {problem}")

    # ----- what callers ask instead of comparing names -----

    def lse_form(self, device=None) -> LSEForm:
        """The log-sum-exp form on ``device``, or BackendUnavailable saying why there is none. Resolve it once
        per run and keep it: the answer does not change between calls."""
        if self.lse is None:
            raise BackendUnavailable(self.no_lse_reason)
        dev = _device_of(device).type
        if dev not in self.lse.devices:
            raise BackendUnavailable(f"backend '{self.name}' returns the log-sum-exp only on "
                                     f"{', '.join(self.lse.devices)} (device is {dev})")
        return self.lse

    def has_lse(self, device=None) -> bool:
        return self.lse is not None and _device_of(device).type in self.lse.devices

    def call_label(self, q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
                   enable_gqa: bool = False) -> str:
        """The kernel label one call is counted under."""
        if self.label is None:
            return self.kernel
        return self.label(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    @property
    def base_name(self) -> str:
        """The registered name this entry is (or was bound from)."""
        return self.name.split(":", 1)[0]

    @property
    def option_values(self) -> dict:
        """Every option's value for this entry: the defaults, overridden by what it is bound to."""
        return {**{o.key: o.default for o in self.options}, **dict(self.bound)}

    @property
    def exact(self) -> bool:
        """A real kernel computing attention at its inputs' precision: not an emulation, and its bytes model reads
        no input narrower than it came (INT8 / fp8 kernels read 1 byte per element of a 2-byte input). What a
        speed-up is measured against in a batch's comparison (its first exact backend)."""
        return not self.emulated and self.bench.bytes_moved(1, 1, 1, 1, 1, 2).kernel >= 4 * 2

    def __call__(self, q, k, v, *, scale=None, is_causal=False):
        return self.fn(q, k, v, scale=scale, is_causal=is_causal)


# ----------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------

BACKENDS: dict[str, Backend] = {}  # canonical name -> entry, in names() order (kept sorted in place)
_ALIASES: dict[str, str] = {}  # alias -> canonical name
_BOUND: dict[tuple, Backend] = {}  # (name, non-default option items) -> the bound entry, made once
_PLACE: dict[str, tuple[int, int]] = {}  # canonical name -> (its module's ORDER, registration sequence)
_SEQ = itertools.count()
LAST = 1000  # the ORDER of entries registered from a module that defines none


def register(backend: Backend, *, order: Optional[int] = None) -> Backend:
    """Add ``backend`` to the registry; refuses a name or alias already taken.

    ``order`` places it in ``names()``; by default the ``ORDER`` of the module calling ``register`` (read from
    the caller's globals, as ``collections.namedtuple`` reads its caller's ``__name__``), so an entry module
    states its place once and every entry of it follows, in the order they are registered.
    """
    wanted = (backend.name, *backend.aliases)
    odd = [n for n in wanted if not re.fullmatch(r"[A-Za-z0-9_.\-]+", n)]
    if odd or backend.bound:
        raise ValueError(f"can't register backend '{backend.name}': names and aliases are letters, digits, _ . - "
                         f"only (':' starts options){'' if odd else '; a bound entry is made by resolve()'}")
    taken = sorted({n for n in wanted if n in BACKENDS or n in _ALIASES or wanted.count(n) > 1})
    if taken:
        raise ValueError(f"can't register backend '{backend.name}': name or alias already taken: {', '.join(taken)}")
    if backend.lse is None and not backend.no_lse_reason:
        raise ValueError(f"backend '{backend.name}' gives neither a log-sum-exp form (lse) nor the reason it has "
                         "none (no_lse_reason): ring attention needs one or the other")
    if order is None:
        order = sys._getframe(1).f_globals.get("ORDER", LAST)
    _PLACE[backend.name] = (order, next(_SEQ))
    BACKENDS[backend.name] = backend
    _ALIASES.update((a, backend.name) for a in backend.aliases)
    ordered = sorted(BACKENDS.items(), key=lambda kv: _PLACE[kv[0]])
    BACKENDS.clear()
    BACKENDS.update(ordered)
    return backend


def unregister(name: str) -> Backend:
    """Remove an entry and its aliases (tests registering a toy backend take it out again)."""
    backend = BACKENDS.pop(name)
    del _PLACE[name]
    for a in backend.aliases:
        del _ALIASES[a]
    for key in [k for k in _BOUND if k[0] == name]:
        del _BOUND[key]
    return backend


@contextlib.contextmanager
def registered(backend: Backend, *, order: int = LAST):
    """``with registered(Backend(...)):`` -- registered inside the block only."""
    register(backend, order=order)
    try:
        yield backend
    finally:
        unregister(backend.name)


def resolve(name_or_backend) -> Backend:
    """The entry for a canonical name, an alias (diffusers' or SGLang's name), a name with options
    (``sagev2_fp8:gran=per_warp``, see ``Option``; a sparse entry's ``SparseUse.configure`` parses its own
    options, ``sta:window=3x3x3,tile=6x8x8``) or an entry itself."""
    if isinstance(name_or_backend, Backend):
        return name_or_backend
    text = str(name_or_backend).strip()
    head, sep, rest = text.partition(":")
    name = _ALIASES.get(head, head)
    try:
        base = BACKENDS[name]
    except KeyError:
        raise BackendUnavailable(_unknown(head if sep else name_or_backend)) from None
    if not sep:
        return base
    if base.sparse is not None and base.sparse.configure is not None:  # the pattern's own spec grammar
        try:
            return base.sparse.configure(rest)
        except ValueError as e:
            raise BackendUnavailable(str(e)) from None
    return _bind(base, _parse_options(base, rest, text))


get_backend = resolve


def canonical_name(name: str) -> str:
    """The registry's name for ``name`` or an alias of it, for naming outputs (a file typed with ``native`` is
    the ``sdpa`` render; ``sagev2_fp8:gran=per_thread`` is ``sagev2_fp8``, its default); a name the registry
    doesn't know, or options it refuses, come back as given -- ``resolve`` refuses them."""
    if ":" in str(name):
        try:
            return resolve(name).name
        except BackendUnavailable:
            return name
    return _ALIASES.get(name, name)


def _parse_options(base: Backend, rest: str, text: str) -> dict:
    """``key=value`` items separated by ``,`` or ``+`` -> {key: value}; every refusal names the entry, the option and
    what it accepts."""
    where = f"attention backend '{base.name}'"
    if not base.options:
        raise BackendUnavailable(f"{where} takes no options (got {text!r})")
    known = {o.key: o for o in base.options}
    offer = "; ".join(o.describe() for o in base.options)
    items = [i.strip() for i in re.split(r"[,+]", rest)]
    if not rest.strip() or not all(items):
        raise BackendUnavailable(f"{where}: empty option in {text!r}; options: {offer}")
    values: dict = {}
    for item in items:
        key, eq, val = (p.strip() for p in item.partition("="))
        if not eq or not val:
            raise BackendUnavailable(f"{where}: option {item!r} is not key=value; options: {offer}")
        if key not in known:
            raise BackendUnavailable(f"{where}: unknown option {key!r}; options: {offer}")
        if key in values:
            raise BackendUnavailable(f"{where}: option {key!r} given twice in {text!r}")
        try:
            values[key] = known[key].value(val)
        except ValueError as e:
            raise BackendUnavailable(f"{where}: {e}") from None
    return values


def _bind(base: Backend, values: dict) -> Backend:
    """The entry ``base`` bound to ``values`` (defaults filled in), made once per distinct binding; ``base`` itself
    when every value is its default."""
    full = {o.key: values.get(o.key, o.default) for o in base.options}
    bound = tuple((o.key, full[o.key]) for o in base.options if full[o.key] != o.default)
    if not bound:
        return base
    key = (base.name, bound)
    if key not in _BOUND:
        try:
            entry = base.bind(base, full)
        except ValueError as e:
            raise BackendUnavailable(f"attention backend '{base.name}': {e}") from None
        opts = {o.key: o for o in base.options}
        spelled = "+".join(f"{k}={opts[k].spell(v)}" for k, v in bound)
        _BOUND[key] = dataclasses.replace(entry, name=f"{base.name}:{spelled}", aliases=(), bound=bound,
                                          options=base.options, bind=base.bind)
    return _BOUND[key]


def _unknown(name: str) -> str:
    close = difflib.get_close_matches(str(name), [*BACKENDS, *_ALIASES], n=1)
    guess = "; "
    if close:
        target = _ALIASES.get(close[0])
        guess = f"; did you mean '{close[0]}'" + (f" (= '{target}')" if target else "") + "? "
    return (f"unknown attention backend {name!r}{guess}valid: {', '.join(BACKENDS)} "
            "(or an alias: diffusers' and SGLang's names, see --list_backends)")


def names() -> list[str]:
    return list(BACKENDS)


def aliases() -> dict[str, str]:
    """alias -> canonical name, in names() order."""
    return {a: b.name for b in BACKENDS.values() for a in b.aliases}


def availability(name: str, device=None, dtype: Optional[torch.dtype] = None,
                 head_dim: Optional[int] = None) -> tuple[bool, str]:
    return resolve(name).availability(device, dtype, head_dim)


def available_names(device=None, dtype=None, head_dim=None) -> list[str]:
    return [n for n, b in BACKENDS.items() if b.availability(device, dtype, head_dim)[0]]


def require_here(backend, device, dtype, head_dims) -> Backend:
    """``backend``'s entry (an entry, or a schedule, which requires its every backend: ``require``), or
    BackendUnavailable with what *can* run here (every registered backend that serves each of ``head_dims``)."""
    try:
        return backend.require(device, dtype, head_dims)
    except BackendUnavailable as e:
        can = [n for n, b in BACKENDS.items()
               if all(b.availability(device, dtype, h)[0] for h in (head_dims or [None]))]
        dims = ",".join(map(str, sorted(set(head_dims))))
        raise BackendUnavailable(
            f"{e}.\nBackends that can run here ({device}, {str(dtype).replace('torch.', '')}, head dim {dims}): "
            f"{', '.join(can)}") from None


def capability_table(device=None, dtype=None, head_dim=None) -> str:
    """What ``--list_backends`` prints: per backend availability and reason, kernel, dtypes, head dims, mask,
    causal, log-sum-exp, layout; then the aliases."""
    dev = _device_of(device)
    rows = [("backend", "available", "kernel", "dtypes", "head dims", "mask", "causal", "lse", "layout",
             "reason / notes")]
    for b in BACKENDS.values():
        ok, reason = b.availability(dev, dtype, head_dim)
        hd = ",".join(map(str, b.head_dims)) if b.head_dims else (f"<={b.max_head_dim}" if b.max_head_dim else "any")
        note = (reason + (f"; emulation: {b.twin}" if b.twin else "")) if not ok else \
            (b.notes or ("emulated, slow" if b.emulated else ""))
        rows.append((b.name, "yes" if ok else "no", b.kernel, _dtype_names(b.dtypes).replace("float", "f"), hd,
                     "y" if b.supports_mask else "-", "y" if b.supports_causal else "-",
                     "y" if b.lse is not None else "-", b.layout, note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"attention backends on {dev}" + (f", dtype {dtype}" if dtype else "")
             + (f", head dim {head_dim}" if head_dim else "") + " (layout convention: BHSD)"]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    lines.append("aliases (diffusers' and SGLang's names for the same kernels):")
    lines += [f"  {', '.join(b.aliases)} -> {b.name}" for b in BACKENDS.values() if b.aliases]
    with_options = [b for b in BACKENDS.values() if b.options]
    if with_options:
        lines.append("options (name:key=value, several joined by + or ,):")
        lines += [f"  {b.name}: " + "; ".join(o.describe() for o in b.options) for b in with_options]
    return "\n".join(lines)
