"""Render the same clip once per attention backend -- and per prompt and seed of a set --, side by side on the
machine's GPUs, keep going when one fails, compare, stitch a grid.

    bash render_all_WAN.sh --model-path tiny --output-dir outputs/demo --stitch
    bash render_all_WAN.sh --types sdpa_cudnn,fav3,sagev1 --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers -- --num_frames 33
    bash render_all_WAN.sh --gpus all --types sdpa_cudnn,fav3,sagev1,reference ...        # one render per GPU at once
    bash render_all_WAN.sh --nproc 8 --types sdpa_cudnn,fav3 --model-path Wan-AI/Wan2.1-T2V-14B-Diffusers --stitch
    bash render_all_WAN.sh --prompts prompts.txt --seeds 1,2,3 --types fav3,fav3_fp8,reference --report
    bash render_all_WAN.sh --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT ...     # this machine's share

Each render runs in its own process (or torchrun group) on GPUs of its own (``--gpus``, ``--nproc`` each; on a CPU
``--jobs`` at once), in the batch's order, the backends innermost: a crash or a failing rank loses that render only.
Its log is DIR/logs/<name>.log; its step lines (time, ETA) are shown here, prefixed by its name (with its prompt and
seed in a set). Ctrl-C or SIGTERM stops every running render (nothing half-written: renders write under temporary
names and rename; what a stopped one left is removed). The batch ends with a comparison table (warm ms/step,
speed-up vs the first exact backend, PSNR vs the reference render of the same content -- over a set: mean, min-max
and n per backend --, videos per GPU-hour and joules per video, kernels that ran; install hints and emulations of
the backends that can't run here). Past one machine: torchrun's ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``
(render ``i`` of the batch on its port + i), passed through (docs/MULTI_GPU.md has Slurm examples).
Exit code: 0 if every requested render succeeded; 1 if any failed or nothing rendered; 2 on bad options; 128 + the
signal when stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from . import backends as B
from . import families
from .helptext import DefaultsHelpFormatter
from .kernel_bench import child_env
from .pool import Done, Job, Pool, Rendezvous, Stopped, parse_gpus, visible_gpus
from .sets import Content, contents, in_shard, parse_seeds, parse_shard, read_prompts

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """Errors in one line (the scripts' contract: ``error: ...``, exit 2)."""

    def error(self, message):
        m = re.match(r"argument (\S+?)(/\S+)?: expected one argument", message)
        if m:
            message = f"{m.group(1)} needs a value (see --help)"
        elif message.startswith("unrecognized arguments: "):
            message = f"unknown option {message.split(': ', 1)[1].split()[0]} (see --help)"
        else:
            message = re.sub(r"^argument \S+: ", "", message)
        raise _Bad(message)


class _Bad(Exception):
    """A batch's arguments refused: its message is the one line the batch prints before it exits 2."""


def _positive(flag: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{flag} needs a positive integer, got '{text}'")
        return int(text)
    return parse


def build_parser(prog: str = "render_all_WAN.sh", fam: Optional[families.Family] = None) -> argparse.ArgumentParser:
    fam = fam or families.get("wan")
    p = _Parser(prog=prog, description=__doc__, formatter_class=DefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", default=f"outputs/render_all_{fam.name}",
                   help="where results/, logs/ and the grid go")
    p.add_argument("--types", default=None, help="backends to render, comma-separated (default: every backend that "
                                                 "can run on this machine)")
    p.add_argument("--model-path", "--model_path", "--model", dest="model", default="tiny",
                   help="hub id, local path, tiny or tiny:<variant>")
    p.add_argument("--nproc", "--nproc_per_node", "--nproc-per-node", type=_positive("--nproc"), default=1,
                   help="processes (GPUs) per render on each machine: each render under torchrun on N GPUs")
    p.add_argument("--ulysses-degree", "--ulysses_degree", dest="ulysses", type=_positive("--ulysses-degree"),
                   default=None, help="Ulysses degree of each render (default: all its processes, when no degree or "
                                      "CFG split is given)")
    p.add_argument("--ring-degree", "--ring_degree", dest="ring", type=_positive("--ring-degree"), default=None,
                   help="ring-attention degree of each render (default: 1)")
    p.add_argument("--use-cfg-parallel", "--use_cfg_parallel", dest="cfg", action="store_true",
                   help="split the guidance batch over 2 halves of each render's processes")
    p.add_argument("--parallel-engine", "--parallel_engine", dest="engine", default=None,
                   help="auto, xfuser or diffusers (default: auto: the faster engine for the family where it serves)")
    p.add_argument("--img-file-path", "--img_file_path", "--image", dest="image", default=None,
                   help="conditioning image (i2v; ti2v's image-to-video path) (default: none)")
    p.add_argument("--fps", type=_positive("--fps"), default=None,
                   help="frame rate of the rendered videos (and so of the grid) (default: the model family's)")
    p.add_argument("--font-size", "--font_size", dest="font_size", type=_positive("--font-size"), default=24,
                   help="label size of the grid, in pixels")
    p.add_argument("--stitch", action="store_true",
                   help="stitch the renders into DIR/comparison_grid.mp4 (needs two or more; a set: one grid per "
                        "prompt and seed, comparison_grid_<k>.mp4)")
    p.add_argument("--reuse", action="store_true",
                   help="skip a render whose video already exists (counted as rendered)")
    p.add_argument("--report", action="store_true",
                   help="write DIR/report.html and DIR/summary.csv (python -m vdbench.report)")
    g = p.add_argument_group("GPUs, prompt and seed sets, shards")
    g.add_argument("--gpus", default="all",
                   help="the GPUs the renders share, by id (0,1,3) or all: the visible ones; each render takes "
                        "--nproc of them, as many renders at once as they hold")
    g.add_argument("--jobs", type=_positive("--jobs"), default=None,
                   help="renders at once (default: as many as --gpus holds; 1 on a CPU)")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="render each backend on each prompt of FILE, one prompt a line (default: the renderer's "
                        "--prompt)")
    g.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="render each backend on each seed (default: the renderer's --seed)")
    g.add_argument("--shard", default=None, metavar="I/N",
                   help="this machine's share of the batch (I from 0 to N-1, e.g. a Slurm array task's): the "
                        "render of content c by backend b is shard (c + b) mod N's, so each shard has its share of "
                        "every backend (default: the whole batch)")
    g.add_argument("--collect", action="store_true",
                   help="render nothing: the table (and --stitch, --report) of the whole batch from what its "
                        "shards wrote to DIR")
    m = p.add_argument_group("past one machine (torchrun's rendezvous, passed through)")
    m.add_argument("--nnodes", type=_positive("--nnodes"), default=None,
                   help="machines each render spans (default: 1, this one)")
    m.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                   help="this machine's rank among them: its logs are <name>.node<R>.log; the static rendezvous "
                        "(--master-addr) needs it, c10d assigns ranks itself (default: none: the host name names "
                        "the logs)")
    m.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="endpoint", default=None, metavar="HOST:PORT",
                   help="where the renders meet: render i of the batch on PORT + i (default: none)")
    m.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None,
                   help="the rendezvous id, the same on every machine; render i adds -i (default: vdbench)")
    m.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None,
                   help="c10d or static (default: c10d with --rdzv-endpoint, static with --master-addr)")
    m.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="torchrun's static rendezvous: the rank-0 machine (default: none)")
    m.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="with --master-addr: render i of the batch on this port + i (default: 29500)")
    return p


# --------------------------------------------------------------------------------------------------------------
# what to render
# --------------------------------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(msg, flush=True)


def _layout_args(args, world: int) -> list[str]:
    """The render's parallel flags: Ulysses over all ``world`` processes unless a degree or the CFG split is given."""
    ulysses = args.ulysses
    if world > 1 and args.ulysses is None and args.ring is None and not args.cfg:
        ulysses = world
    return ((["--ulysses_degree", str(ulysses)] if ulysses else []) + (["--ring_degree", str(args.ring)]
                                                                        if args.ring else [])
            + (["--use_cfg_parallel"] if args.cfg else []) + (["--parallel_engine", args.engine]
                                                              if args.engine else []))


def _captured(family: str, argv: list[str], err_path: Path) -> tuple[int, list[str]]:
    """The render CLI run here on ``argv`` (a listing or the output paths): (its code, its stdout lines); its
    stderr to ``err_path``."""
    from . import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(family, argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    err_path.parent.mkdir(parents=True, exist_ok=True)
    err_path.write_text(err.getvalue())
    return code, [ln for ln in out.getvalue().splitlines() if ln.strip()]


def _check(args, extra: list[str]) -> None:
    if args.image and not Path(args.image).is_file():
        raise _Bad(f"--img-file-path {args.image}: no such file")
    multi = Rendezvous.of(args)
    try:
        multi.check()
    except ValueError as e:
        raise _Bad(str(e)) from None
    world = args.nproc * (args.nnodes or 1)
    if world == 1 and ((args.ulysses or 1) > 1 or (args.ring or 1) > 1 or args.cfg):
        raise _Bad("--ulysses-degree / --ring-degree / --use-cfg-parallel split a render over processes: add "
                   "--nproc N")
    if multi.multi_node and args.reuse:
        raise _Bad("--reuse with several machines: each would decide alone which render to skip; render the "
                   "missing ones on one machine, or with --shard")
    for flag, given in (("--prompts", "--prompt"), ("--seeds", "--seed")):
        if getattr(args, flag[2:]) and any(a == given or a.startswith(given + "=") for a in extra):
            raise _Bad(f"{flag} and {given} after --: give the set or the one {given[2:]}, not both")


def _types(args, extra: list[str], logs: Path) -> list[str]:
    valid = B.names() + list(B.aliases())
    if args.types is None:
        code, found = _captured(args.family, ["--list_available", *extra], logs / ".types.err")
        if code != 0:
            raise _Bad("could not list backends: " + next(
                (ln for ln in (logs / ".types.err").read_text().splitlines() if ln.startswith("error:")), "")[7:])
        return found
    from .sparse.spec import split_attention_types

    types = split_attention_types(args.types)
    for t in types:  # a name, an alias, or either with options (fav3_fp8:smooth_v=1, sta:window=3x5x5+pad=none)
        if t.partition(":")[0] not in valid:
            raise _Bad(f"unknown attention type '{t}'; valid: {' '.join(valid)}")
        try:
            B.resolve(t)
        except (B.BackendUnavailable, ValueError) as e:
            raise _Bad(f"--types {t}: {str(e).splitlines()[0]}") from None
    if not types:
        raise _Bad("no backend to render (--types is empty)")
    return types


def _jobs(args, types: list[str], sets: list[Content], render_args: list[str], logs: Path,
          node: str) -> tuple[list[Job], dict]:
    """Every render of the batch, in its order (each content's backends together), each with its output path
    (computed by the renderer itself: ``--print_output_path``); {job index: output path}."""
    jobs, outputs = [], {}
    for ci, content in enumerate(sets):
        argv = [*render_args, *content.args(), "--attention_type", ",".join(types), "--print_output_path"]
        code, paths = _captured(args.family, argv, logs / ".paths.err")
        if code != 0 or len(paths) != len(types):
            text = (logs / ".paths.err").read_text().splitlines()
            first = next((ln for ln in text if ln.startswith("error:")), "error: ")
            hint = next((ln for ln in text if ln.startswith("hint:")), "")
            raise _Bad(f"could not compute the output paths: {first[7:]}" + (f"\n{hint}" if hint else ""))
        for ti, (t, path) in enumerate(zip(types, paths)):
            k = len(jobs)
            name = f"{t} {content.tag}" if content.tag else t
            log = logs / (re.sub(r"[^A-Za-z0-9_.+=:@-]+", "_", name) + (f".{node}" if node else "") + ".log")
            program = ["-m", "vdbench.cli", args.family, *render_args, *content.args(), "--attention_type", t]
            jobs.append(Job(name, program, log, args.nproc, content.tag, index=k,
                            data={"type": t, "content": content, "at": (ci, ti)}))
            outputs[k] = Path(path)
    return jobs, outputs


# --------------------------------------------------------------------------------------------------------------
# what happened
# --------------------------------------------------------------------------------------------------------------

def _code_text(d: Done, nproc: int) -> str:
    """``2``, ``1; ranks exited -9 4`` (torchrun's summary in the log), ``stopped``, ``signal SIGKILL``."""
    if d.timed_out:
        return "timed out"
    text = str(d.code)
    if d.code < 0:
        with contextlib.suppress(ValueError):  # a number no signal has: the code as it is
            text = f"signal {signal.Signals(-d.code).name}"
    try:
        log = d.job.log.read_text(errors="replace")
    except OSError:
        return text
    ranks = sorted(set(re.findall(r"exitcode +: (-?[0-9]+)", log)))
    return f"{text}; ranks exited {' '.join(ranks)}" if ranks and nproc > 1 else text


def _lines(log: Path, prefix: str) -> str:
    try:
        return next((ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith(prefix)), "")
    except OSError:
        return ""


def _remove_leftovers(output: Path) -> None:
    """What a stopped render may have left beside its output: its temporary files (dot names, renamed on
    success)."""
    for p in output.parent.glob(f".{glob.escape(output.stem)}.*"):
        p.unlink(missing_ok=True)


def _names(done: list[str]) -> str:
    if len(done) <= 16:
        return " ".join(done) or "none"
    counts: dict[str, int] = {}
    for n in done:
        counts[n.split(" ")[0]] = counts.get(n.split(" ")[0], 0) + 1
    return " ".join(f"{t}×{c}" for t, c in counts.items())


def _logged(main, argv: list[str], log: Path) -> tuple[int, str]:
    """A command line's ``main(argv)`` run here, its output (a crash's traceback too) into ``log``: (its code, the
    output)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = main(argv)
        except Exception:  # noqa: BLE001 - said in one line by the caller, the traceback in the log
            import traceback

            traceback.print_exc()
            code = 1
    log.write_text(buf.getvalue())
    return code, buf.getvalue()


def _stitch(args, out_dir: Path, ok_outputs: list[Path], reference_ok: bool) -> int:
    from . import stitch
    from .batch import contents_of

    groups = contents_of(None, [str(p) for p in ok_outputs])
    rc = 0
    if sum(len(paths) >= 2 for _, _, paths in groups) == 0:
        _say("not stitching: fewer than two renders succeeded" + (" of any one content" if len(groups) > 1 else ""))
        return 0
    for k, (_, desc, paths) in enumerate(groups, 1):
        if len(paths) < 2:
            continue
        grid = out_dir / ("comparison_grid.mp4" if len(groups) == 1 else f"comparison_grid_{k}.mp4")
        argv = ["--output", str(grid), "--font_size", str(args.font_size),
                *(["--reference", "reference"] if reference_ok else []), *paths]
        log = out_dir / "logs" / ("stitch.log" if len(groups) == 1 else f"stitch_{k}.log")
        code, _ = _logged(stitch.main, argv, log)
        if code == 0:
            _say(f"grid: {grid}" + (f" ({desc})" if len(groups) > 1 else ""))
        else:
            print(f"stitching failed: {_lines(log, 'stitch_comparison: error:')}", file=sys.stderr)
            rc = 1
    return rc


def _report(results_dir: Path, out_dir: Path) -> int:
    from . import report

    log = out_dir / "logs" / "report.log"
    code, text = _logged(report.main, [str(results_dir), "-o", str(out_dir)], log)
    if code == 0:
        _say(f"report: {out_dir / 'report.html'}")
        return 0
    first = next((ln for ln in text.splitlines() if "error" in ln.lower()), "see " + str(log))
    print(f"report failed: {first}", file=sys.stderr)
    return 1


def _table(results_dir: Path, outputs: list[Path], failed: list[tuple], gpus: int) -> None:
    from . import batch

    try:
        _say(batch.table(results_dir, [str(p) for p in outputs], failed, gpus=gpus))
    except Exception as e:  # noqa: BLE001 - the renders are done: the table is a convenience
        print(f"warning: the comparison table could not be made ({type(e).__name__}: {e})", file=sys.stderr)


# --------------------------------------------------------------------------------------------------------------
# the batch
# --------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """The batch (``argv``: the script's arguments; ``--family`` and ``--prog``, given by the scripts, first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    given = {k: argv[i + 1] for i, k in enumerate(argv[:-1]) if k in ("--family", "--prog")}
    argv = [a for i, a in enumerate(argv) if a not in given and (i == 0 or argv[i - 1] not in given)]
    try:
        fam = families.get(given.get("--family", "wan"))
        args = build_parser(given.get("--prog", "render_all_WAN.sh"), fam).parse_args(argv)
        args.family = fam.name
        _check(args, extra)
        return _run(args, fam, extra)
    except _Bad as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _setup(args) -> tuple:
    """(prompts, seeds, shard, gpus, rendezvous) of the arguments, each checked (:class:`_Bad` in one line)."""
    rdzv = Rendezvous.of(args)
    try:
        prompts = read_prompts(args.prompts) if args.prompts else None
        seeds = parse_seeds(args.seeds) if args.seeds else None
        shard = parse_shard(args.shard)
        visible = visible_gpus()
        if not visible and args.gpus not in (None, "", "all"):
            raise ValueError(f"--gpus {args.gpus}: no GPU visible here (on a CPU --jobs N runs N renders at once)")
        gpus = parse_gpus(args.gpus, visible) if visible else []
    except ValueError as e:
        raise _Bad(str(e)) from None
    if gpus and args.nproc > len(gpus):
        raise _Bad(f"--nproc {args.nproc}: each render needs {args.nproc} GPUs, --gpus gives {len(gpus)}")
    return prompts, seeds, shard, gpus, rdzv


def _run(args, fam: families.Family, extra: list[str]) -> int:
    out_dir = Path(args.output_dir)
    logs = out_dir / "logs"
    results_dir = out_dir / fam.cli.results_subdir if fam.cli.results_subdir else out_dir
    prompts, seeds, shard, gpus, rdzv = _setup(args)
    world = args.nproc * (args.nnodes or 1)
    render_args = ["--model", args.model, "--benchmark_output_directory", str(out_dir), *_layout_args(args, world),
                   *(["--img_file_path", args.image] if args.image else []),
                   *(["--fps", str(args.fps)] if args.fps else []), *extra]
    types = _types(args, extra, logs)
    sets = contents(prompts, seeds)
    node = "" if not rdzv.multi_node else f"node{args.node_rank}" if args.node_rank is not None else \
        socket.gethostname()
    jobs, outputs = _jobs(args, types, sets, render_args, logs, node)
    if args.collect:
        return _collect(args, out_dir, results_dir, jobs, outputs)
    mine = [j for j in jobs if in_shard(*j.data["at"], shard)]
    under = ""
    if world > 1:
        nodes = f"{args.nnodes} machines x " if (args.nnodes or 1) > 1 else ""
        under = f" under torchrun on {nodes}{args.nproc} processes ({' '.join(_layout_args(args, world))})"
    _say(f"rendering {len(types)} backend(s){under} into {results_dir}/")
    pool = Pool(gpus, args.jobs, rdzv=rdzv, env=child_env(), show=_say)
    if len(sets) > 1 or shard[1] > 1 or pool.limit > 1:
        what = f" ({len(types)} backend(s) x {len(sets)} prompt/seed pairs)" if len(sets) > 1 else ""
        part = f"shard {shard[0]}/{shard[1]}: {len(mine)} of {len(jobs)} renders" if shard[1] > 1 else \
            f"{len(jobs)} renders"
        _say(f"{part}{what}, {pool.describe(args.nproc)}")
    ok, failed, todo = [], [], []
    for j in mine:
        path = outputs[j.index]
        if args.reuse and path.is_file() and path.stat().st_size > 0:
            _say(f"[{j.name}] reused {path}")
            ok.append(j)
        else:
            todo.append(j)
    start = time.monotonic()

    def started(job: Job, where: tuple) -> None:
        on = f" on GPU {','.join(where)}" if where and (pool.limit > 1 or len(gpus) > args.nproc) else ""
        _say(f"[{job.name}] rendering{on} (log: {job.log})")

    def ended(d: Done) -> None:
        path = outputs[d.job.index]
        if d.code == 0 and (rdzv.multi_node or path.is_file() and path.stat().st_size > 0):
            ok.append(d.job)
            return
        if d.stopped:
            _remove_leftovers(path)
        code = "stopped" if d.stopped and not d.timed_out else _code_text(d, world)
        _say(f"[{d.job.name}] FAILED (exit {code}): {_lines(d.job.log, 'error:')[7:]}")
        hint = _lines(d.job.log, "hint:")
        if hint:
            _say(f"    {hint}")
        failed.append((d.job, code))

    stopped = None
    try:
        pool.run(todo, started, ended)
    except Stopped as e:
        stopped = e.signum
        _say(f"stopped by {signal.Signals(e.signum).name}: every running render ended (their temporary files "
             "removed)")
    ended_names = {j.name for j in ok} | {j.name for j, _ in failed}
    left = [j.name for j in todo if j.name not in ended_names]
    _say("")
    _say(f"rendered in {time.monotonic() - start:.0f} s: {len(ok)} succeeded ({_names([j.name for j in ok])}), "
         f"{len(failed)} failed ({_names([j.name for j, _ in failed])})"
         + (f", {len(left)} not rendered ({_names(left)})" if left else ""))
    videos = [outputs[j.index] for j in sorted(ok, key=lambda j: j.index) if outputs[j.index].is_file()]
    if rdzv.multi_node and not videos and ok:
        _say("the videos and timing.json are written on the machine where rank 0 of each render ran")
    else:
        _say(f"videos and timing.json: {results_dir}/")
    _say("")
    if videos or failed:
        _table(results_dir, videos, [(j.name, code, j.log, j.data["type"]) for j, code in failed], len(gpus))
    if stopped:
        return 128 + stopped
    if not ok:
        print(f"error: nothing rendered (see the logs in {logs}/)", file=sys.stderr)
        return 1
    rc = 1 if failed else 0
    if args.stitch and videos:
        rc |= _stitch(args, out_dir, videos, any(j.data["type"] == "reference" for j in ok))
    if args.report and videos:
        rc |= _report(results_dir, out_dir)
    return rc


def _collect(args, out_dir: Path, results_dir: Path, jobs: list[Job], outputs: dict) -> int:
    """``--collect``: the table, grids and report of every render of the batch found in DIR (every shard's)."""
    found = [outputs[j.index] for j in jobs if outputs[j.index].is_file()]
    missing = [j.name for j in jobs if not outputs[j.index].is_file()]
    _say(f"collected {len(found)} of {len(jobs)} renders from {results_dir}/" + (
        f"; not there: {_names(missing)}" if missing else ""))
    _say("")
    _table(results_dir, found, [], 0)
    if not found:
        print(f"error: nothing rendered yet in {results_dir}/", file=sys.stderr)
        return 1
    rc = 0
    if args.stitch:
        rc |= _stitch(args, out_dir, found, any(j.data["type"] == "reference" and outputs[j.index] in found
                                                for j in jobs))
    if args.report:
        rc |= _report(results_dir, out_dir)
    return rc | (1 if missing else 0)


if __name__ == "__main__":
    sys.exit(main())
