"""The one command line of the render CLIs (``run_wan.py``, ``sageattn_cogvideo.py``): parser, config, exit codes.

Why one module: the two scripts had grown 25 flags twice and drifted apart (flags only one had, one option under two
names, memory flags for one family only although the renderer served both). Here every flag is declared once, the
model family supplies only its defaults and its rules (``vdbench.families``), and the scripts are three-line shims.
The flags themselves -- their spellings, types, defaults, help and the :class:`~vdbench.render.RenderConfig` field
each fills -- are declared in :mod:`vdbench.options`; the parser and the config are built from there.

Spellings: every flag is accepted as ``--a_b`` and ``--a-b``; the names users of the original scripts type are kept
as aliases of one option (``--model``/``--model_path``, ``--img_file_path``/``--image``,
``--benchmark_output_directory``/``--output_dir``, ``--use_torch_compile``/``--compile``,
``--save_inputs --max_captures --input_dir``). Where the two original scripts laid out their outputs differently
(Wan under ``<dir>/results/``, CogVideoX directly in ``<dir>``) the family keeps its layout, so existing scripts
find their files where they did.

Exit codes (also in ``--help``): 0 ok; 2 bad input (unknown or unavailable backend, bad size, a model that can't
be loaded, a refused option), 3 an attention call the backend can't serve (see ``--on_unsupported``), 4 another
torchrun rank failed, 124 a watched stage (``--vae_timeout``) hung.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from . import backends as B
from . import families
from .cache import parse_cache
from .helptext import DefaultsHelpFormatter
from .options import DEFAULT_ATTENTION, OPTIONS, add_options
from .parallel import EXIT_PEER_FAILED, ParallelSpec
from .patching.schedule import resolve_attention
from .sparse import split_attention_types

__all__ = ["build_parser", "config_from_args", "main", "EXIT_OK", "EXIT_BAD_INPUT", "EXIT_UNSUPPORTED_CALL",
           "EXIT_PEER_FAILED", "EXIT_HUNG"]

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # unknown/unavailable backend, bad size, model that can't be loaded, refused option
EXIT_UNSUPPORTED_CALL = 3  # the backend met a call it cannot serve during the run
EXIT_HUNG = 124  # a watched stage (--vae_timeout) ran past its timeout (timeout(1)'s code)

EPILOG = ("exit codes: 0 ok, 2 bad input (unknown or unavailable backend, bad size, model not loadable, refused "
          f"option), 3 an attention call the backend can't serve (see --on_unsupported), {EXIT_PEER_FAILED} another "
          f"torchrun rank failed, {EXIT_HUNG} a watched stage hung (--vae_timeout)")


def build_parser(family: str | families.Family, prog: Optional[str] = None,
                 description: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of one family's render CLI: the same flags for every family (:data:`vdbench.options.OPTIONS`),
    the family's defaults."""
    fam = families.get(family) if isinstance(family, str) else family
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=EPILOG,
                                formatter_class=DefaultsHelpFormatter)
    add_options(p, fam)
    return p


def _model(fam: families.Family, args) -> str:
    return args.model or fam.default_models[args.task]


def _fill_defaults(fam: families.Family, args, model: str) -> None:
    """Size and step arguments left unset take the tiny model's CPU-sized defaults or the real model's."""
    for k, v in (fam.cli.tiny if model.startswith("tiny") else fam.cli.real).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def _image_sized(fam: families.Family, task: str, model: str) -> Optional[int]:
    """The multiple an image-derived output size is rounded to, when this task takes an image; else None."""
    if not fam.takes_image(task) and task not in fam.image_refusals:
        return None
    return fam.image_size_multiple(task, model)


def results_dir(fam: families.Family, args) -> Path:
    """Where the video and timing.json go: the family's layout under the output directory."""
    out = Path(args.output_dir)
    return out / fam.cli.results_subdir if fam.cli.results_subdir else out


def canonical_attention(attention_type: str) -> str:
    """The name a run is recorded under: an alias -> the backend's name, options and schedules in their one
    spelling; a name that doesn't resolve comes back as given (the render refuses it, with the reason)."""
    try:
        return resolve_attention(attention_type).name
    except (B.BackendUnavailable, ValueError):
        return attention_type


def output_path(fam: families.Family, args, model: str, attention_type: str) -> Path:
    """The video these arguments write for one backend or schedule (:func:`render_path` of their config)."""
    one = argparse.Namespace(**vars(args))
    if not args.attention_schedule:
        one.attention_type = attention_type
    return config_from_args(fam, one, model).output_path


def render_path(fam: families.Family, cfg) -> Path:
    """The video a render writes, decided by its identity (:mod:`vdbench.identity`): the family's name for the
    backend (an alias named by the backend it resolves to), then the stack's speed options and VAE modes
    (``_compile-fp8gemm-vae=fast``, :func:`vdbench.measure.record.options_tag`), the step cache's tag
    (``_cache-fbc-threshold=0.1``, :func:`vdbench.measure.record.cache_tag`), the parallel layout (``_u2``, ``_r2``,
    ``_u2r2``, ``_cfg2``) of a torchrun render, and the identity's tags (``_seed7``, ``_id-3fa9c1d2``) in that order;
    a render with none of them keeps the family's plain name. Beside its ``timing.json``."""
    from . import identity
    from .measure.record import cache_tag, options_tag, settings_speed_options

    layout = ParallelSpec(cfg.parallel_engine, cfg.ulysses_degree, cfg.ring_degree, cfg.use_cfg_parallel).tag
    name = Path(fam.output_name(task=cfg.task, model=cfg.model, num_frames=cfg.num_frames,
                                steps=cfg.num_inference_steps, attention_type=canonical_attention(cfg.attention_type),
                                height=cfg.height, width=cfg.width, **({"layout": layout} if layout else {})))
    cache = parse_cache(cfg.cache)
    settings = dataclasses.asdict(cfg)
    tags = [options_tag(settings_speed_options(settings), cfg.vae_decode, cfg.vae_encode),
            cache_tag(cache.name) if cache is not None else ""]
    tags = [t for t in tags if t]
    if tags:  # before the layout tag
        rest, tag = families.split_layout(name.stem)
        name = name.with_name(f"{rest}_{'_'.join(tags)}{'_' + tag if tag else ''}{name.suffix}")
    return cfg.timing_path.parent / identity.of(settings, type(cfg), fam).name(name.name)


def config_from_args(fam: families.Family, args, model: Optional[str] = None):
    """The RenderConfig these arguments describe (defaults filled in, the image-conditioned size resolved), writing
    where its identity says (:func:`render_path`)."""
    from .render import RenderConfig

    model = model or _model(fam, args)
    out = Path(args.output_dir)
    capture_dir = Path(args.input_dir) if args.input_dir else out / "captures"
    if args.attention_schedule:
        if args.attention_type != DEFAULT_ATTENTION:
            raise ValueError("give --attention_type or --attention_schedule, not both (a schedule names its "
                             "backends itself, e.g. 'fav3@steps:0-9,sta')")
        args.attention_type = args.attention_schedule
    # every declared option fills its field; the paths, the model and the rank are the CLI's own
    settings = {o.fills: o.convert(getattr(args, o.name)) for o in OPTIONS if o.fills is not None}
    cfg = RenderConfig(family=fam.name, model=model, output_path=Path(),
                       timing_path=results_dir(fam, args) / "timing.json", capture_dir=capture_dir,
                       traces_root=out / "traces", rank=int(os.environ.get("RANK", 0)), **settings)
    return dataclasses.replace(cfg, output_path=render_path(fam, cfg))


def _listing(args) -> None:
    from .render import resolve_device, resolve_dtype

    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    print(B.capability_table(dev, dtype) if args.list_backends else "\n".join(B.available_names(dev, dtype)))


def size_from_image(path: str, height: int, width: int, mod: int) -> tuple[int, int]:
    """Largest (h, w), multiples of ``mod`` (VAE stride x patch size), with the image's aspect ratio and
    h * w <= height * width -- what Wan's image-to-video examples do."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            iw, ih = img.size
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the conditioning image {path}: {e}") from None
    area, aspect = height * width, ih / iw
    h = max(mod, int(round((area * aspect) ** 0.5)) // mod * mod)
    w = max(mod, int(round((area / aspect) ** 0.5)) // mod * mod)
    return h, w


def say(e: BaseException, file=None) -> None:
    """An error as a user reads it: ``error: <what is wrong>`` on one line, then ``hint: ...`` with the rest of
    the message (what to do, what can run instead) on one more. The project's messages put the fact on their first
    line and the advice after it."""
    file = file if file is not None else sys.stderr
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    print(f"error: {lines[0]}", file=file)
    if len(lines) > 1:
        print(f"hint: {' '.join(lines[1:])}", file=file)
    file.flush()


def _quiet_peer(e: BaseException) -> bool:
    """Under torchrun a refusal all ranks agreed on is said once, by rank 0 (each rank exits with its code)."""
    return getattr(e, "_vd_agreed", False) and int(os.environ.get("RANK", 0)) != 0


def exit_code(e: BaseException) -> int:
    """The exit code an error means (the epilog's list): 2 bad input, 3 an unsupported call, 124 a hang, 1 else."""
    from .pipelines import ModelLoadError
    from .render import VAEHang
    from .speed import SpeedOptionError

    if isinstance(e, B.UnsupportedCall):
        return EXIT_UNSUPPORTED_CALL
    if isinstance(e, VAEHang):
        return EXIT_HUNG
    if isinstance(e, (B.BackendUnavailable, ModelLoadError, SpeedOptionError, ValueError, FileNotFoundError)):
        return EXIT_BAD_INPUT
    return 1


def run(cfg, log=print) -> int:
    """Run a render and turn the project's expected failures into one clear line and an exit code."""
    from .render import render
    from .timing import wall_start

    try:  # end_to_end_s counts from the process's start (the first render of the process)
        render(cfg, log=log, exit_code_of=exit_code, started=wall_start(from_process=True))
    except Exception as e:  # noqa: BLE001 - the expected ones get their code; anything else is re-raised
        code = exit_code(e)
        if code == 1:
            raise
        if not _quiet_peer(e):
            say(e)
        return code
    return EXIT_OK


def main(family: str, argv=None, *, prog: Optional[str] = None, description: Optional[str] = None) -> int:
    """The whole CLI of one family: parse, list or print paths, or render.

    Under torchrun a rank that ends non-zero leaves at once with its code (``os._exit`` after flushing, its process
    group already left): torchrun stops the other workers with SIGTERM as soon as one exits non-zero, and a
    process caught in the interpreter's teardown -- where Python's signal handlers are gone -- would end as -15
    instead of with its documented code."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return _main(family, argv, prog, description)
    try:
        code = _main(family, argv, prog, description)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - a crash: its traceback, exit 1
        if not getattr(e, "_vd_reported", False):
            traceback.print_exc()
        code = 1
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(family: str, argv, prog: Optional[str], description: Optional[str]) -> int:
    fam = families.get(family)
    args = build_parser(fam, prog=prog, description=description).parse_args(argv)
    try:
        if args.list_backends or args.list_available:
            _listing(args)
            return EXIT_OK
        model = _model(fam, args)
        _fill_defaults(fam, args, model)
        if args.num_repetitions < 1:
            raise ValueError("--num_repetitions must be >= 1")
        mod = _image_sized(fam, args.task, model)
        if args.img_file_path and mod and not args.force_output_size:
            args.height, args.width = size_from_image(args.img_file_path, args.height, args.width, mod=mod)
            print(f"output size {args.height}x{args.width} (the image's aspect ratio; --force_output_size to keep "
                  "--height/--width)", file=sys.stderr)
        if args.print_output_path:  # comma-separated types: one path per line (one process for a whole sweep)
            types = [args.attention_schedule] if args.attention_schedule else split_attention_types(args.attention_type)
            for t in types:
                print(output_path(fam, args, model, t))
            return EXIT_OK
        cfg = config_from_args(fam, args)
    except (B.BackendUnavailable, ValueError) as e:
        say(e)
        return EXIT_BAD_INPUT
    return run(cfg)


if __name__ == "__main__":  # python -m vdbench.cli FAMILY ARGS...: the render CLI of a family (what torchrun -m runs)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
