"""A render's identity: every setting that changes its frames or its speed, and the files it decides.

Two renders that differ in any such setting never share a file. The readable part of a video's name is the family's
own (task, model, frames, steps, attention, size), the stack's options and step cache (:mod:`vdbench.measure.record`),
the parallel layout, then the seed where it is not :data:`DEFAULT_SEED` (``_seed7``). Everything else that changes
the frames or the speed -- the prompt, the negative prompt, the guidance scales, the flow shift, the experts'
boundary, the conditioning image's bytes, the dtypes, the exchange and offload options, the fused kernels' switches,
... -- goes into a short stable id (``_id-3fa9c1d2``): the first 8 hex digits of the sha256 of those settings that
differ from their defaults, as canonical JSON. A render with all of them at their defaults has no id, so its name
stays the family's plain one, and a render of identical settings writes (and may replace) its own file.

Not identity (:data:`NOT_IDENTITY`): where the files go and what is written beside them, how many repetitions are
timed and warmed up, the watchdog's timeout, the instruments (the power sampler, the attention timer, the profiler:
recorded beside the figures they take), and an explicit ``--overwrite``. A new :class:`~vdbench.render.RenderConfig` field is identity unless it is listed there.

A render's ``content`` is the part that says what the frames are *of* (model, task, size, prompt, seed, guidance, shift,
image): renders of one content are compared with each other (PSNR against the ``reference`` render of the same
content), whatever computed them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Optional

from . import families
from .measure.record import identity_tags

__all__ = ["DEFAULT_SEED", "NOT_IDENTITY", "IN_NAME", "CONTENT", "RenderIdentity", "of", "replaced_render",
           "check_output", "file_sha256"]

#: ``--seed`` when not given; a render of another seed says it in its file name.
DEFAULT_SEED = 42

#: RenderConfig fields that are not part of a render's identity (see the module's doc).
NOT_IDENTITY = frozenset({
    "output_path", "timing_path", "capture_dir", "traces_root", "rank", "overwrite",
    "num_repetitions", "warmup_calls", "vae_timeout", "save_latents", "save_frames",
    # the instruments: what they cost is their measurement's own, recorded beside the figures they take
    "power_interval_ms", "time_attention", "profile_output", "profile_wait", "profile_warmup", "profile_active",
})

#: RenderConfig fields the readable part of every name carries (the stack's options and cache tags, the layout tag,
#: the seed tag), beside the family's own (:attr:`vdbench.families.Family.name_settings`): left out of the id.
IN_NAME = frozenset({
    "family", "attention_type", "compile", "compile_backend", "compile_mode", "bf16_te_gemms", "fp8_gemms",
    "offload", "ulysses_fp8_exchange", "cache", "vae_decode", "vae_encode", "ulysses_degree", "ring_degree",
    "use_cfg_parallel", "seed", "fused_block",
})

#: What the frames are of: renders that agree on these are compared with each other.
CONTENT = ("family", "task", "model", "image", "height", "width", "num_frames", "num_inference_steps", "prompt",
           "negative_prompt", "guidance_scale", "guidance_scale_2", "boundary_ratio", "flow_shift", "seed")

_ID_LEN = 8


@dataclasses.dataclass(frozen=True)
class RenderIdentity:
    """``seed``; ``settings``: the settings the id is made of (those off their defaults, as canonical JSON values);
    ``id``: its 8 hex digits (None: every such setting at its default); ``content``: 12 hex digits of what the frames
    are of (:data:`CONTENT`, every value, default or not);
    ``full``: 16 hex digits of every identity setting, the name's readable ones too (two renders with the same
    ``full`` are the same render: the one test of whether a file may be replaced)."""

    seed: int
    settings: dict
    id: Optional[str]
    content: str
    full: str

    @property
    def tags(self) -> tuple[str, ...]:
        """The name's identity tags after the layout tag: ``("seed7", "id-3fa9c1d2")``, either left out at its
        default."""
        return identity_tags(self.seed if self.seed != DEFAULT_SEED else None, self.id)

    def name(self, plain: str) -> str:
        """``plain`` (a file name the family and the stack made) with :attr:`tags` before its suffix."""
        p = Path(plain)
        return p.stem + "".join("_" + t for t in self.tags) + p.suffix

    def as_dict(self) -> dict:
        """What a timing entry records (``identity``)."""
        return {"seed": self.seed, "id": self.id, "tag": " ".join(self.tags), "content": self.content,
                "full": self.full, "settings": self.settings}


def _canon(value: Any) -> Any:
    """A setting as canonical JSON data: paths as strings, floats that are whole kept as floats (1 and 1.0 differ
    as types only), mappings sorted."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return float(value)
    return value


def _digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _image_value(path) -> Optional[str]:
    """A conditioning image as identity: the sha256 of its pixels (RGB) and size -- an image replaced at the same
    path is another render, the same picture saved again is not --, or its path where it can't be read (the render
    then refuses it)."""
    if not path:
        return None
    from PIL import Image

    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    except (OSError, ValueError):
        return str(path)
    h = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return "rgb-sha256:" + h.hexdigest()[:16]


def _defaults(family: families.Family, config_class) -> dict:
    """Each field's default of ``config_class`` (the RenderConfig): the dataclass's, the family's command-line
    defaults for the ones it sets."""
    out = {}
    for f in dataclasses.fields(config_class):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    cli = family.cli
    out.update(prompt=cli.prompt, negative_prompt=cli.negative_prompt, guidance_scale=cli.guidance_scale,
               fps=cli.fps, seed=DEFAULT_SEED, image=None, task=family.tasks[0])
    return out


def _identity_values(settings: dict) -> dict:
    """The identity settings of recorded or live settings, canonical, the image by its bytes."""
    values = {k: v for k, v in settings.items() if k not in NOT_IDENTITY}
    values["image"] = _image_value(values.get("image"))
    if (values.get("ulysses_degree") or 1) <= 1 and (values.get("ring_degree") or 1) <= 1 \
            and not values.get("use_cfg_parallel"):
        values.pop("parallel_engine", None)  # one process: no engine runs
    return {k: _canon(v) for k, v in values.items()}


def of(settings: dict, config_class, family: Optional[families.Family] = None) -> RenderIdentity:
    """The identity of a render from its settings: a RenderConfig as data (``dataclasses.asdict``, what a timing
    entry records as ``run.settings``; a render recorded before identities were is read the same way).
    ``config_class``: the RenderConfig class, whose defaults a setting is compared with (a setting the record lacks
    is at its default)."""
    family = family or families.get(settings["family"])
    defaults = _defaults(family, config_class)
    # a size the name doesn't carry is at its default where it is the family's for the model
    defaults.update(family.cli.tiny if str(settings.get("model", "")).startswith("tiny") else family.cli.real)
    values = _identity_values({**defaults, **settings})
    named = IN_NAME | set(family.name_settings)
    off = {k: v for k, v in sorted(values.items()) if k not in named and v != _canon(defaults.get(k))}
    return RenderIdentity(seed=int(settings["seed"]), settings=off, id=_digest(off)[:_ID_LEN] if off else None,
                          content=_digest({k: values.get(k) for k in CONTENT})[:12], full=_digest(values)[:16])


def replaced_render(settings: dict, output, timing_path, config_class,
                    family: Optional[families.Family] = None) -> Optional[str]:
    """The settings another render differs from this one's (``settings``, as :func:`of` takes them) in, where the
    video at ``output`` is the latest that the ``timing.json`` at ``timing_path`` records for that path and that
    render is not this one; None where the file may be replaced (no entry names it, the latest is this render, or its
    record holds no settings to compare)."""
    from .timing import load_timing

    try:
        entries = [e for e in load_timing(timing_path) if isinstance(e, dict) and e.get("output") == str(output)]
    except (OSError, ValueError):
        return None
    if not entries:
        return None
    theirs = (entries[-1].get("run") or {}).get("settings") or {}
    if not theirs.get("family"):  # a record older than its settings: nothing to tell it apart by
        return None
    family = family or families.get(settings["family"])
    defaults = _defaults(family, config_class)
    a, b = _identity_values({**defaults, **settings}), _identity_values({**defaults, **theirs})
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not differ:
        return None
    return ", ".join(differ[:4]) + (" ..." if len(differ) > 4 else "")


def check_output(settings: dict, output, timing_path, config_class, family: families.Family, *,
                 overwrite: bool = False) -> None:
    """Never a file this tool did not write replaced (:func:`vdbench.video.written_by_render`), nor another render's
    video (:func:`replaced_render`: its identity differs) -- unless ``overwrite``."""
    from .video import written_by_render

    if overwrite or not Path(output).exists():
        return
    if not written_by_render(output, timing_path):
        raise ValueError(f"{output} exists and is not a video this tool wrote; not replacing it\n"
                         "move it away, choose another --benchmark_output_directory, or pass --overwrite")
    other = replaced_render(settings, output, timing_path, config_class, family)
    if other is not None:
        raise ValueError(f"{output} holds another render's video (it differs in {other}); not "
                         "replacing it\nwrite to another path, or pass --overwrite")
