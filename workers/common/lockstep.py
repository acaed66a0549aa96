"""`LockstepModelThread`: the model thread of one rank of a group, stepping with the other ranks.

It has `ModelThread`'s interface (`run(fn, *args)`, `close()`), so an engine does not know it is
one rank of many. Every rank schedules its own requests (DP attention: its own batch, its own KV
pool); what the ranks agree on is only *when a forward happens*, through one tiny all-reduce,
the tick, over the group's step process group:

    tick([wants_forward, is_extend])  ->  MAX over the ranks
      a rank about to run a forward ticks [1, mode]      (`forward()`, the runner's `StepSync` hook)
      a rank with nothing to run ticks [0, 0]            (the thread's idle loop)
      if the MAX says "forward", every rank runs one: its own, or an idle one (`runner.idle`) that
      joins the MoE all-to-alls with zero tokens (the seed's `is_non_idle_and_non_empty` case)
      if it says "nothing", every rank waits a little (the same backoff on all ranks, up to
      `idle_max_s`) and ticks again, so a new request starts within that time

Invariant: every tick that says "forward" is followed by exactly one forward on every rank, so
the collectives inside the forwards pair up. Jobs that run no forward (collecting a step's tokens)
run between ticks and need no agreement.

Failure: a collective that fails (a peer died: gloo sees its sockets close) or times out
(`collective_timeout_s`, a hung peer), or any exception inside a forward (the collective sequence is
then unknown), ends this process with `GROUP_FAILED_EXIT` and a log line naming the cause, so
the whole group goes down together and its supervisor (or Kubernetes) restarts the gang.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

import torch

from deepseek_pd.model.forward_batch import ForwardMode

log = logging.getLogger(__name__)

T = TypeVar("T")
GROUP_FAILED_EXIT = 3  # the exit status of a rank whose group broke (a peer died or hung)
_IDLE_MIN_S = 0.001


def _die(message: str) -> None:
    log.critical("rank group failed: %s; exiting so the whole group restarts", message)
    logging.shutdown()
    os._exit(GROUP_FAILED_EXIT)


class LockstepModelThread:
    """Runs model jobs in one thread and keeps this rank's forwards in step with the group's.

    `group` is the torch.distributed process group the ticks use (CPU tensors: gloo); `idle_forward`
    is what a rank with no forward of its own runs when another rank forwards (`runner.idle`).
    Call `start()` once every rank is up (ticks before that would time out on a loading peer).
    """

    def __init__(self, name: str, group: Any, idle_forward: Callable[[ForwardMode], None],
                 idle_max_s: float = 0.02, on_failure: Callable[[str], None] = _die) -> None:
        self._name = name
        self._group = group
        self._idle_forward = idle_forward
        self._idle_max_s = idle_max_s
        self._on_failure = on_failure
        self._jobs: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._in_thread = threading.local()
        self.forwards = 0  # this rank's own forwards (tests)
        self.idle_forwards = 0  # idle forwards run for other ranks (tests)

    def start(self) -> None:
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Runs `fn(*args)` in the model thread (as `ModelThread.run`)."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._stopping.set()
        self._jobs.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # ---- StepSync (called by the runner, in this thread) ------------------------------------------
    @contextlib.contextmanager
    def forward(self, mode: ForwardMode) -> Iterator[None]:
        self._tick(True, mode is ForwardMode.EXTEND)  # the MAX is "forward": everyone joins this one
        try:
            yield
        except BaseException as exc:
            self._fail(f"a forward failed on this rank, the group's collectives are out of step: {exc!r}")
            raise
        self.forwards += 1

    # ---- the thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        idle_s = _IDLE_MIN_S
        while True:
            try:
                item = self._jobs.get(timeout=idle_s) if self._jobs.empty() else self._jobs.get_nowait()
            except queue.Empty:
                item = ()
            if item is None:  # close()
                return
            if item:
                future, fn, args = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # the engine sees it; a broken group already exited
                        future.set_exception(exc)
                idle_s = _IDLE_MIN_S
                continue
            wants, extend = self._tick(False, False)
            if wants:
                try:
                    self._idle_forward(ForwardMode.EXTEND if extend else ForwardMode.DECODE)
                except Exception as exc:
                    self._fail(f"an idle forward failed: {exc!r}")
                self.idle_forwards += 1
                idle_s = _IDLE_MIN_S
            else:  # the whole group is idle: every rank backs off alike
                idle_s = min(idle_s * 2, self._idle_max_s)

    def _tick(self, wants: bool, extend: bool) -> tuple[bool, bool]:
        import torch.distributed as dist

        flags = torch.tensor([int(wants), int(extend)], dtype=torch.int32)
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        except Exception as exc:
            self._fail(f"a peer rank left or stopped answering: {exc}")
            raise
        return bool(flags[0]), bool(flags[1])

    def _fail(self, message: str) -> None:
        if self._stopping.is_set():
            raise SystemExit(0)  # shutting down: peers leaving is expected
        self._on_failure(message)
