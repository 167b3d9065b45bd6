"""A rank's failure under torchrun, bounded: a failing rank posts it in the process group's store and every other
rank stops within ``POLL_S`` seconds (:class:`FailureWatch`, exit ``EXIT_PEER_FAILED``) instead of waiting in a
collective until the NCCL timeout; a rank that dies without a word is found by its missing heartbeat; each rank
exits with its documented code whichever exits first (:func:`set_outcome`, :func:`finish`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from typing import Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .group import DistContext, OneProcess

__all__ = ["EXIT_PEER_FAILED", "POLL_S", "SILENT_S", "FailureWatch", "maybe_inject_failure", "set_outcome", "finish"]

EXIT_PEER_FAILED = 4  # this rank stopped because another rank failed
POLL_S = 1.0
ACK_TIMEOUT_S = 30.0  # how long a failing rank waits for its peers to read its failure
_FAIL_KEY = "vdbench/failed"
_ACK_KEY = "vdbench/failure_read"
_BEAT_KEY = "vdbench/beat/{}"  # + rank: a counter each rank's watch advances every POLL_S while the rank lives
SILENT_S = 3 * POLL_S  # a peer whose heartbeat doesn't advance for this long is gone (killed, its host down)
_OUTCOME: dict = {"code": None, "watch": None}  # this process's pending exit code (SIGTERM handler)


class FailureWatch:
    """Bounded failure propagation: a failing rank sets a flag in the process group's store; a thread on every
    rank polls it and ends its process (exit EXIT_PEER_FAILED) within POLL_S seconds of a peer's failure,
    instead of waiting in a collective until the NCCL/gloo timeout; the failing rank waits (bounded) until every
    peer has read the flag before it exits, since it may host the store.

    Exit codes that don't depend on timing: torchrun stops the remaining workers with SIGTERM as soon as one exits
    non-zero, which would end a rank still on its way out as -15 instead of its code. The watch installs a SIGTERM
    handler that ends the rank with the code it is on its way to (:func:`set_outcome`: a refusal's, a failure's,
    EXIT_PEER_FAILED when a peer failed), so every rank exits with its documented code whichever exits first.

    A rank that dies without a word (SIGKILL, the OOM killer, a segfault, its host gone) posts nothing. Every rank's
    watch therefore also beats (a counter in the store, every POLL_S); a rank whose collective broke, or that
    torchrun stops, first asks whether a peer fell silent (:meth:`silent_peers`) and, if one did, stops naming it
    (exit EXIT_PEER_FAILED) instead of taking the broken collective for its own failure."""

    def __init__(self, ctx: DistContext | OneProcess):
        self.ctx = ctx
        self.store = None
        self._stop = threading.Event()
        self._reading = threading.Event()  # set while the poller reads the failure flag (cleared by fail())
        self._attributing = False  # inside fail(): this rank's error may be the consequence of a silent peer
        self._thread = None
        if not ctx.distributed:
            return
        self.store = c10d._get_default_store()
        self._reading.set()
        self.store.add(_BEAT_KEY.format(ctx.rank), 1)
        _OUTCOME.update(code=None, watch=self)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigterm)
        self._thread = threading.Thread(target=self._poll, name="vdbench-failure-watch", daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.wait(POLL_S):
            try:
                self.store.add(_BEAT_KEY.format(self.ctx.rank), 1)  # alive: beats on while fail() asks the peers
                if self._reading.is_set() and self.store.check([_FAIL_KEY]):
                    who = self.store.get(_FAIL_KEY).decode(errors="replace")
                    self.stop_for_peer(who)
            except Exception:  # the store went away (a peer's exit took the master down): stop as well
                if not self._stop.is_set() and self._reading.is_set():
                    self.stop_for_peer("the process group's store is gone: another rank exited first")

    def silent_peers(self, window_s: float = SILENT_S) -> list[int]:
        """The peers whose heartbeat does not advance within ``window_s`` (waiting only until every peer has beaten
        once: a live peer's watch beats every POLL_S, also while its main thread waits in a collective); [] when
        the store can't be read."""
        if self.store is None:
            return []
        try:
            keys = {r: _BEAT_KEY.format(r) for r in range(self.ctx.world_size) if r != self.ctx.rank}
            first = {r: self.store.add(k, 0) for r, k in keys.items()}
            waiting = set(keys)
            deadline = time.monotonic() + window_s
            while waiting and time.monotonic() < deadline:
                time.sleep(0.1)
                waiting = {r for r in waiting if self.store.add(keys[r], 0) == first[r]}
        except Exception:  # noqa: BLE001 - the store is gone: the callers' store-gone path says so
            return []
        return sorted(waiting)

    @staticmethod
    def silent_message(ranks: list[int]) -> str:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        return (f"{who} stopped without a word (no heartbeat for {SILENT_S:.0f} s: killed by a signal such as "
                "SIGKILL or the OOM killer, or its host is gone)")

    def stop_for_peer(self, who: str) -> None:
        """End this rank because of a peer's failure: say whose, tell the failing rank it was read, exit 4."""
        set_outcome(EXIT_PEER_FAILED)
        print(f"error: rank {self.ctx.rank}: stopping because {who}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # the store is gone with its host: nobody waits for the ack
            self.store.add(_ACK_KEY, 1)
        os._exit(EXIT_PEER_FAILED)

    def peer_failure(self) -> Optional[str]:
        """A peer's posted failure, if any (None also when the store can't be read)."""
        try:
            if self.store is not None and self.store.check([_FAIL_KEY]):
                return self.store.get(_FAIL_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return None
        return None

    def fail(self, exc: BaseException) -> Optional[str]:
        """Post this rank's failure, unless a peer's came first: one atomic compare-and-set elects the first
        failure of the run, so which rank failed and which stopped because of it (exit EXIT_PEER_FAILED) doesn't
        depend on thread timing -- a rank whose collective broke because a peer died reads that peer's failure
        here. Returns the peer's message when a peer failed first (or the store is gone with its host rank),
        None when this rank's failure is the run's."""
        if self.store is None:
            return None
        self._reading.clear()  # this rank's own poller must not take its own flag for a peer's failure
        self._attributing = True
        try:
            posted = self.peer_failure()
            if posted is not None:
                return posted
            # a collective broken by a peer that died without a word: that peer's failure, not this rank's
            silent = self.silent_peers()
            mine = (self.silent_message(silent) if silent
                    else f"rank {self.ctx.rank} failed: {type(exc).__name__}: {exc}"[:2000])
            try:
                first = self.store.compare_set(_FAIL_KEY, "", mine).decode(errors="replace")
            except Exception as e:  # the store is gone: its host rank exited, the run failed there first
                return f"the process group's store is gone ({type(e).__name__}): another rank exited first"
            return None if (first == mine and not silent) else first
        finally:
            self._attributing = False

    def wait_for_peers(self, timeout_s: float = ACK_TIMEOUT_S) -> None:
        """After posting the run's failure: wait until every peer has read it (each adds to an ack counter as it
        stops) or ``timeout_s``, so this rank -- perhaps the store's host -- doesn't pull the store away first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.add(_ACK_KEY, 0) >= self.ctx.world_size - 1:
                    return
            except Exception:  # noqa: BLE001 - the store is gone: its host read the flag and left
                return
            time.sleep(0.1)

    def close(self) -> None:
        """Stop polling and wait for the poller to be out of the store: a thread still inside a store call while
        the process group is torn down (or the interpreter exits) is what ended a rank with SIGABRT ("terminate
        called without an active exception") about once in seven refused runs."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=POLL_S + 5.0)


def maybe_inject_failure(rank: int, where: str, name: Optional[str] = None) -> None:
    """Test hook: ``VDBENCH_TEST_FAIL=<rank>:<where>[:<backend>]`` makes that rank raise there (in the render of
    that backend only, when one is named: one failing render of a batch), for the tests of propagation; with
    ``VDBENCH_TEST_FAIL_SIGNAL=N`` the rank is killed by signal N there instead (9: a rank that dies without a word,
    as the OOM killer ends one)."""
    spec = os.environ.get("VDBENCH_TEST_FAIL")
    if spec and spec in (f"{rank}:{where}", f"{rank}:{where}:{name}"):
        signum = os.environ.get("VDBENCH_TEST_FAIL_SIGNAL")
        if signum:
            print(f"injected signal {signum} on rank {rank} at {where} (VDBENCH_TEST_FAIL_SIGNAL)", file=sys.stderr,
                  flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), int(signum))
        raise RuntimeError(f"injected failure on rank {rank} at {where} (VDBENCH_TEST_FAIL)")


def set_outcome(code: Optional[int]) -> None:
    """The exit code this rank is on its way to; a SIGTERM from torchrun ends the rank with it (FailureWatch)."""
    _OUTCOME["code"] = code


def _on_sigterm(signum, frame) -> None:
    """torchrun stops the remaining workers once one has exited non-zero (or was killed): end with the code this
    rank is on its way to -- its refusal's or failure's, EXIT_PEER_FAILED when a peer's failure is posted or a
    peer fell silent (killed without a word: this rank says which) -- else 128 + SIGTERM (stopped from outside)."""
    code = _OUTCOME.get("code")
    watch = _OUTCOME.get("watch")
    if watch is not None and (code is None or watch._attributing):
        who = watch.peer_failure()
        if who is None:
            silent = watch.silent_peers()
            who = watch.silent_message(silent) if silent else None
        if who is not None:
            watch.stop_for_peer(who)
    os._exit(code if code is not None else 128 + signum)


def finish(ctx: DistContext | OneProcess, watch: FailureWatch, error: Optional[BaseException],
           code: int = 1) -> None:
    """End of a run: on error flag it for the peers; on success leave the group cleanly. ``code`` is the exit code
    ``error`` means (the CLI's mapping: 2 for a refusal, 3 for an unsupported call, 1 for a crash)."""
    if not ctx.distributed:
        return
    if error is not None and getattr(error, "_vd_agreed", False):
        # every rank stops here together, each with the message (exit code of the error's kind); they leave the
        # group together too, so no rank's exit (rank 0 hosts the store) pulls the store from under a peer
        set_outcome(code)
        watch.close()
        _leave_group(ctx)
        return
    if error is not None:
        set_outcome(code)
        peer = watch.fail(error)
        watch.close()
        if peer is not None:  # this rank's error is the consequence (a broken collective): say whose failure it was
            watch.stop_for_peer(peer)
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()
        error._vd_reported = True  # its traceback is out: the CLI doesn't print it twice
        watch.wait_for_peers()  # the peers read the flag before this process (perhaps the store's host) goes away
        return
    set_outcome(0)
    watch.close()
    _leave_group(ctx)


def _leave_group(ctx: DistContext) -> None:
    """All ranks at the same point: a barrier, then the process group destroyed (its threads joined) before exit
    -- if this run created it; a group the caller made stays up for the caller's next render."""
    if dist.is_initialized():
        dist.barrier()
        if ctx.owns_group:
            dist.destroy_process_group()
