"""Classifier-free guidance across ranks: split over two halves of the world (``--use_cfg_parallel``,
:class:`GuidanceSplit` installed by :func:`split_guidance` where the engine has no split of its own), or both branches
of a step computed together on every rank, interleaved on two host threads (``--guidance_overlap``:
:func:`interleaved`, the branches taking turns at each :func:`turn`, :class:`Baton`)."""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import families
from .group import DistContext, OneProcess

__all__ = ["GUIDANCE_HOOK", "GuidanceSplit", "split_guidance", "guidance_split", "Baton", "interleaved", "turn"]


GUIDANCE_HOOK = "vdbench_guidance_split"


class GuidanceSplit:
    """Classifier-free guidance over two halves of the world: each rank evaluates one guidance branch of every step
    and one gather over its guidance pair (``ctx.cfg_group``) gives every rank both predictions -- no all-to-all,
    one exchange of the noise prediction per step. What diffusers' pipelines leave out (their context parallelism
    splits the sequence only), done with torch.distributed inside the pipeline's own loop:

    * ``batched=False`` (Wan: the denoiser is called twice per step, conditional then unconditional, the two calls
      differing only in ``encoder_hidden_states``): at a step's first call the rank of branch 1 swaps in the
      negative prompt's embeddings (recorded from the pipeline's ``encode_prompt``), each rank computes its branch,
      the pair gathers both; the first call returns the conditional prediction, the second call returns the
      unconditional one without computing (and is checked to be the pair's twin: same latents, the recorded
      negative embeddings). Each branch is computed exactly as on one GPU, so exact kernels give identical latents.
    * ``batched=True`` (CogVideoX: one call with the batch ``[uncond, cond]``): each rank computes its half of the
      batch and the halves are gathered back in order. A half-batch may pick other GEMM kernels than the full batch
      on one GPU, so latents agree to rounding rather than bit for bit.

    A diffusers cache (when one is stacked) keeps one state per guidance branch on one GPU; here each rank always
    computes the same branch under the pipeline's context, so its state is that branch's, as on one GPU.

    ``index=None`` (``--guidance_overlap``, pair mode only): no split -- every rank computes both branches at a
    step's first call, interleaved (:func:`interleaved`: the conditional call on the
    pipeline's thread, the unconditional one on a helper thread, taking turns at the Ulysses processor's phase
    ends), and serves the second call as above; no gather."""

    def __init__(self, group, index: Optional[int], batched: bool):
        self.group, self.index, self.batched = group, index, batched
        self.handovers = 0  # index None: the turns the two interleaved branches took
        self.negative = None  # the pipeline's negative prompt embeddings (pair mode), from its encode_prompt
        self.pending = None  # between a pair's two calls: (the step's latents, the unconditional prediction)
        self.gathers = 0
        self.served = 0  # denoiser calls answered without computing (a pair's second call: the other rank's branch)

    def record_prompts(self, pipe) -> None:
        """Keep the negative prompt embeddings ``pipe.encode_prompt`` returns (the second of its pair)."""
        encode = pipe.encode_prompt

        def recording(*args, **kwargs):
            out = encode(*args, **kwargs)
            self.negative = out[1]
            return out

        pipe.encode_prompt = recording

    def forward(self, inner, *args, **kwargs):
        return (self._batch if self.batched else self._pair)(inner, args, kwargs)

    def _gather(self, mine):
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine.contiguous(), group=self.group)
        self.gathers += 1
        return both

    def _pair(self, inner, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        ehs = kwargs.get("encoder_hidden_states")
        if ehs is None:
            raise RuntimeError("--use_cfg_parallel: the denoiser was called without encoder_hidden_states as a "
                               "keyword; this pipeline's guidance can't be split by branch")
        if self.pending is not None:  # the step's second call: the unconditional branch, computed by the pair
            latents, negative, out = self.pending
            self.pending = None
            if hs is not latents or not torch.equal(ehs, negative):
                raise RuntimeError("--use_cfg_parallel: the second denoiser call of a step is not the first's "
                                   "unconditional twin (other latents or text embeddings); run without the CFG split")
            self.served += 1
            return out
        if self.negative is None:
            raise RuntimeError("--use_cfg_parallel: the pipeline's negative prompt embeddings were not recorded "
                               "(its encode_prompt did not run); run without the CFG split")
        negative = self.negative.to(device=ehs.device, dtype=ehs.dtype)
        uncond_kwargs = {**kwargs, "encoder_hidden_states": negative}
        if self.index is None:  # both branches here, interleaved
            out, other, turns = interleaved(lambda: inner(*args, **kwargs), lambda: inner(*args, **uncond_kwargs),
                                            hs.device)
            self.handovers += turns
            self.pending = (hs, negative, other)
            return out
        out = inner(*args, **(uncond_kwargs if self.index == 1 else kwargs))
        cond, uncond = self._gather(_prediction(out))
        self.pending = (hs, negative, _with_prediction(out, uncond))
        return _with_prediction(out, cond)

    def _batch(self, inner, args, kwargs):
        if args:
            raise RuntimeError("--use_cfg_parallel: the denoiser was called with positional arguments; this "
                               "pipeline's guidance batch can't be split")
        n = kwargs["hidden_states"].shape[0]
        if n % 2:
            raise RuntimeError(f"--use_cfg_parallel: a guidance batch of {n} can't be split in two halves "
                               "(is classifier-free guidance on?)")
        h = n // 2
        part = {k: v[self.index * h:(self.index + 1) * h] if isinstance(v, torch.Tensor) and v.dim() and
                v.shape[0] == n else v for k, v in kwargs.items()}
        out = inner(**part)
        return _with_prediction(out, torch.cat(self._gather(_prediction(out)), dim=0))


# ----- two guidance branches interleaved on two host threads (--guidance_overlap) -----

_LOCAL = threading.local()  # (baton, this thread's side) while a thread runs one branch of an interleaved pair


class _Abandoned(Exception):
    """Raised in a branch's thread when the other branch failed: its work is of no use any more."""


class Baton:
    """Two host threads issuing GPU work in turns: only the holder runs; :meth:`pass_` (a phase's end) hands the
    turn to the other side and waits for it to come back. Only one thread runs at a time, so the order of kernels
    and collectives follows from the code alone -- the same on every rank, never decided by thread timing (the
    ranks' collectives must match one for one).

    ``lead``: how many of each side's first passes are skipped. The processor passes at three points of each layer
    -- its entry (E), after Q, K and V are sent (V), after the output's exchange is started (O) -- and leads of
    (2, 1) offset the two branches by one phase, so that the stream receives A's attention, B's projections, A's
    out-projection to next-layer norm, B's attention, A's projections, ...: each exchange (A's Q/K/V, A's output,
    B's Q/K/V, B's output) has the other branch's GEMMs beside it, never the attention kernel (whose persistent
    grid holds every SM). A side that has finished passes nothing: the other runs alone to its end."""

    def __init__(self, lead: tuple[int, int] = (2, 1), start_second: Optional[Callable[[], None]] = None):
        self._cv = threading.Condition()
        self._owner = 0
        self._skip = list(lead)
        self._done = [False, False]
        self._failed = False
        self.passes = 0  # hand-overs made (recorded: a pair that never alternated overlapped nothing)
        # called once, at the first hand-over to side 1 (or when side 0 ends without one): side 1's thread is woken
        # only then, so its wake-up costs the host nothing at the call's start, where the GPU waits for the host
        self._start_second = start_second

    def _second_started(self) -> None:
        start, self._start_second = self._start_second, None
        if start is not None:
            start()

    def wait(self, side: int) -> None:
        """Block until ``side`` holds the turn; :class:`_Abandoned` if the other side failed."""
        with self._cv:
            self._cv.wait_for(lambda: self._owner == side or self._failed)
            if self._failed:
                raise _Abandoned()

    def pass_(self, side: int) -> None:
        if self._skip[side]:
            self._skip[side] -= 1
            return
        with self._cv:
            if self._done[1 - side]:
                return
            self._owner = 1 - side
            self.passes += 1
            self._cv.notify_all()
        self._second_started()
        self.wait(side)

    def finish(self, side: int, failed: bool = False) -> None:
        """``side`` is done (or ``failed``: the other side stops at its next pass)."""
        with self._cv:
            self._done[side] = True
            self._failed = self._failed or failed
            self._owner = 1 - side
            self._cv.notify_all()
        self._second_started()


def turn() -> None:
    """A phase's end in a branch of an :func:`interleaved` pair: the other branch's turn. Nothing outside one."""
    held = getattr(_LOCAL, "held", None)
    if held is not None:
        held[0].pass_(held[1])


@contextlib.contextmanager
def _holding(baton: Baton, side: int):
    _LOCAL.held = (baton, side)
    try:
        yield
    finally:
        _LOCAL.held = None


def _thread_state(device: torch.device):
    """What of the calling thread's torch state a branch's thread must share (grad and inference mode are
    thread-local; so are the current CUDA device and stream, which must be the caller's: one stream orders both
    branches' kernels as the host issued them)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def state():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(inference))
            stack.enter_context(torch.set_grad_enabled(grad))
            if stream is not None:
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(stream))
            yield

    return state


class _Helper:
    """The one long-lived thread that runs the second branch of every interleaved pair: a render calls
    :func:`interleaved` once per step, and a thread started per step would put its start-up (and the GIL hand-overs
    it brings) into every step's first layer, where the host is already behind the GPU."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs = self._thread = None

    def submit(self, fn, *args) -> threading.Event:
        """Run ``fn(*args)`` on the helper thread; the event is set once it has returned (or raised: ``fn`` keeps
        its own errors). A process forked after the thread started has the queue but not the thread (fork copies
        only the calling thread): a thread not alive is started afresh, with a queue of its own."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,),
                                                name="vdbench-guidance-branch", daemon=True)
                self._thread.start()
        done = threading.Event()
        self._jobs.put((fn, args, done))
        return done

    @staticmethod
    def _serve(jobs) -> None:
        while True:
            fn, args, done = jobs.get()
            try:
                fn(*args)
            finally:
                done.set()


_HELPER = _Helper()


def interleaved(first: Callable[[], object], second: Callable[[], object], device) -> tuple[object, object, int]:
    """``first()`` on this thread and ``second()`` on a helper thread, taking turns at every :func:`turn` (a
    :class:`Baton`, ``first`` leading; the helper is handed ``second`` at the first hand-over, when the GPU already
    holds the first branch's opening work). Returns both results and the number of hand-overs. An error in either
    stops both and is raised here (the first's own error when both failed)."""
    result: dict = {}
    state = _thread_state(torch.device(device))
    ended = threading.Event()

    def start_second():
        nonlocal ended
        ended = _HELPER.submit(contextvars.copy_context().run, run_second)

    baton = Baton(start_second=start_second)

    def run_second():
        try:
            with state(), _holding(baton, 1):
                baton.wait(1)
                result["second"] = second()
        except _Abandoned:  # the first branch failed: its error is the one the caller raises
            return
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e
        finally:
            baton.finish(1, failed="error" in result)

    try:
        with _holding(baton, 0):
            out = first()
    except _Abandoned:
        baton.finish(0)
        ended.wait()
        raise result["error"] from None
    except BaseException:
        baton.finish(0, failed=True)
        ended.wait()
        raise
    baton.finish(0)
    ended.wait()
    if "error" in result:
        raise result["error"]
    return out, result["second"], baton.passes


def _prediction(out):
    """The noise prediction in a denoiser's output (a tuple with ``return_dict=False``, else ``.sample``)."""
    return out[0] if isinstance(out, tuple) else out.sample


def _with_prediction(out, pred):
    if isinstance(out, tuple):
        return (pred, *out[1:])
    return type(out)(sample=pred)


def split_guidance(ctx: DistContext, pipe, models: list, family: families.Family) -> GuidanceSplit:
    """Install :class:`GuidanceSplit` on every denoiser of ``pipe`` (both Wan 2.2 experts) as a diffusers hook,
    outermost, over ``ctx.cfg_group``; how the family's pipelines run guidance is the family's
    (``guidance_in_one_batch``)."""
    from diffusers.hooks import HookRegistry, ModelHook  # here: diffusers takes seconds to import

    overlap = not ctx.spec.use_cfg_parallel  # --guidance_overlap: both branches on every rank
    split = GuidanceSplit(None if overlap else ctx.cfg_group, None if overlap else ctx.cfg_index,
                          family.guidance_in_one_batch)
    if not split.batched:
        split.record_prompts(pipe)

    class _Hook(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return split.forward(self.fn_ref.original_forward, *args, **kwargs)

    for _, m in models:
        HookRegistry.check_if_exists_or_initialize(m).register_hook(_Hook(), GUIDANCE_HOOK)
    pipe._vdbench_guidance_split = ctx.guidance = split
    return split


def guidance_split(ctx: DistContext | OneProcess, pipe) -> Optional[tuple[dict, Optional[Callable[[], int]]]]:
    """Under ``--use_cfg_parallel``: what this rank computes of each step's guidance (timing.json's
    ``cache.guidance_split``), and a count of the denoiser calls it answers without computing (vdbench's
    :class:`GuidanceSplit`: a pair's second call; None where the engine's own pipeline splits guidance, whose calls
    are each rank's own). None without a CFG split."""
    if not ctx.spec.use_cfg_parallel:
        return None
    split = getattr(pipe, "_vdbench_guidance_split", None)
    if split is None:
        part = "one guidance branch per step (the engine's own split)"
    elif split.batched:
        part = "its half of each step's guidance batch"
    else:
        part = f"the {('conditional', 'unconditional')[split.index]} branch of each step"
    note = {"this_rank_computes": part, "counts": "this rank's (every rank's under ranks[].cache)"}
    return note, ((lambda: split.served) if split is not None else None)
