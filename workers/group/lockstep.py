"""`LockstepModelThread`: the model thread of one rank of a group, stepping with the other ranks.

It has `ModelThread`'s interface (`run(fn, *args)`, `close()`), so an engine does not know it is
one rank of many. Every rank schedules its own requests (DP attention: its own batch, its own KV
pool); what the ranks agree on is only *when a forward happens*, through one tiny all-reduce,
the tick, over the group's step process group:

    tick([wants_model, model_extends, wants_mtp, mtp_extends, stop])  ->  MAX over the ranks
      a rank about to run a forward of kind K ticks wants_K = 1 and K_extends = its mode
                                                         (`forward()`, the runner's `StepSync` hook)
      a rank with nothing to run ticks all zeros          (the thread's idle loop)
      rank 0, closing, ticks stop = 1                     (the group's stop, after rank 0 drained)
      if the MAX says "forward", the step's kind is the model's if any rank wants one, else the
      MTP layer's (step_sync.ForwardKind: speculative decoding); every rank runs one forward of
      that kind: its own, or an idle one (`runner.idle(mode, kind)`) that joins that network's MoE
      all-to-alls with zero tokens (the seed's `is_non_idle_and_non_empty` case); a rank whose own
      forward is of the other kind runs the idle one and ticks again for its own
      if it says "nothing", every rank waits a little (a backoff up to `idle_max_s`) and ticks
      again; after `sleep_after_ticks` such ticks in a row the whole group sleeps (below)
      if it says "stop", every rank finishes that step and its thread ends: `group_stopped` is set

Invariant: every tick that says "forward" is followed by exactly one forward of the tick's kind on
every rank, so the collectives inside the forwards pair up. A waiting MTP forward runs at the
latest when every rank's next forward is the MTP layer's or none: each speculative step and
prefill round runs an MTP forward after its model forward, so none waits without bound.
Jobs that run no forward (collecting a step's tokens) run between ticks and need no agreement.

Sleeping (`waker`, e.g. the group's TCPStore: rank_group.StoreWaker): an idle group does not tick
at all. The decision to sleep follows from tick results only (never from a rank's own jobs that
run no forward), so every rank makes it at the same tick and counts the same sleep `epoch`. A
sleeping rank blocks in `waker.wait(epoch)` (no CPU, no traffic); whoever gets a job during the
sleep (`run`, `close`, or this thread finding its queue non-empty just as it would sleep) calls
`waker.wake(epoch)`, which wakes every rank at once, and the ticks resume. A wake for an old
epoch is ignored, so two ranks waking the group at once cannot leave a rank ticking alone.

Failure: a collective that fails (a peer died: gloo sees its sockets close) or times out
(`collective_timeout_s`, a hung peer), or any exception inside a forward (the collective sequence is
then unknown), ends this process with `GROUP_FAILED_EXIT` and a log line naming the cause, so
the whole group goes down together and its supervisor (or Kubernetes) restarts the gang. A rank
that left through the group's stop exits with `GROUP_STOPPED_EXIT` (group_main.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Protocol, TypeVar

import torch

from deepseek_pd.model.distributed.step_sync import ForwardKind
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.workers.engine.model_thread import model_call

log = logging.getLogger(__name__)

T = TypeVar("T")
GROUP_FAILED_EXIT = 3  # the exit status of a rank whose group broke (a peer died or hung)
GROUP_STOPPED_EXIT = 0  # the exit status of every rank after rank 0 drained and stopped the group
_IDLE_MIN_S = 0.001


class GroupStopped(RuntimeError):
    """The group has stopped (rank 0 drained and closed it): no more forwards on this rank."""


class Waker(Protocol):
    def wait(self, epoch: int) -> None:
        """Blocks until some rank calls `wake(epoch)` (or raises: the group is gone)."""
        ...

    def wake(self, epoch: int) -> None:
        """Ends every rank's `wait(epoch)`, now or as soon as they call it."""
        ...


def exit_group_failed(message: str) -> None:
    """Ends this process with GROUP_FAILED_EXIT (its group is broken), after logging why and
    where every thread of this rank stood (stderr): a hung peer's group is otherwise undiagnosable,
    since the collective that timed out says nothing of what the other ranks were doing."""
    log.critical("rank group failed: %s; exiting so the whole group restarts", message)
    logging.shutdown()
    with contextlib.suppress(Exception):  # best effort: the exit must happen
        faulthandler.dump_traceback(all_threads=True)
    os._exit(GROUP_FAILED_EXIT)


class LockstepModelThread:
    """Runs model jobs in one thread and keeps this rank's forwards in step with the group's.

    `group` is the torch.distributed process group the ticks use (CPU tensors: gloo); `idle_forward`
    is what a rank with no forward of its own (or of the step's kind) runs when another rank
    forwards, given the step's mode and kind (`runner.idle`).
    `leader`: this rank's `close()` stops the whole group (rank 0). `waker`: lets an idle group sleep
    (None: it keeps ticking every `idle_max_s`). Call `start()` once every rank is up (ticks before
    that would time out on a loading peer).
    """

    def __init__(self, name: str, group: Any, idle_forward: Callable[[ForwardMode, ForwardKind], None],
                 idle_max_s: float = 0.02, on_failure: Callable[[str], None] = exit_group_failed, leader: bool = False,
                 waker: Waker | None = None, sleep_after_ticks: int = 8) -> None:
        self._name = name
        self._group = group
        self._idle_forward = idle_forward
        self._idle_max_s = idle_max_s
        self._on_failure = on_failure
        self._leader = leader
        self._waker = waker
        self._sleep_after_ticks = sleep_after_ticks
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # the queue's puts vs the thread's decision to sleep
        self._asleep_epoch: int | None = None
        self._epoch = 0
        self._quiet_ticks = 0  # ticks in a row whose MAX said "nothing": the group's idleness
        self._stop_seen = False
        self._ended = False  # the thread is over: nothing may be queued any more
        self._stopping = threading.Event()
        self.group_stopped = threading.Event()  # the group's stop tick was seen; the thread has ended
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.forwards = 0  # this rank's own forwards (tests)
        self.idle_forwards = 0  # idle forwards run for other ranks (tests)
        self.ticks = 0  # all-reduce ticks of this rank (tests, benches)
        self.sleeps = 0  # times this rank slept with its group (tests, benches)

    def start(self) -> None:
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Runs `fn(*args)` in the model thread (as `ModelThread.run`); raises GroupStopped once the
        thread has ended (the group stopped)."""
        future: Future = Future()
        epoch = self._put((future, fn, args))
        if epoch is not None:
            await asyncio.to_thread(self._wake, epoch)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Ends the thread; on the leader, after telling every rank to stop (the stop tick)."""
        self._stopping.set()
        try:
            epoch = self._put(None)
        except GroupStopped:
            return  # already over
        if epoch is not None:
            self._wake(epoch)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # ---- StepSync (called by the runner, in this thread) ------------------------------------------
    @contextlib.contextmanager
    def forward(self, mode: ForwardMode, kind: ForwardKind = ForwardKind.MODEL) -> Iterator[ForwardMode]:
        # The MAX is "forward": everyone joins one, in EXTEND mode if any rank of it extends; a step
        # of the other kind comes first when some rank asks for one (the model's win), and this
        # rank joins it idle before asking again.
        while True:
            step_kind, extend = self._tick(True, mode is ForwardMode.EXTEND, kind=kind)
            if step_kind is kind:
                break
            self._join_step(step_kind, extend)
            if self._stop_seen:  # the others end after this step: this forward would tick alone
                raise GroupStopped(f"{self._name}: the group stopped before this rank's forward")
        try:
            yield ForwardMode.EXTEND if extend else ForwardMode.DECODE
        except BaseException as exc:
            self._fail(f"a forward failed on this rank, the group's collectives are out of step: {exc!r}")
            raise
        self.forwards += 1

    # ---- the thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        idle_s = _IDLE_MIN_S  # this rank's wait between idle ticks: local timing only
        try:
            while not self._stop_seen:
                try:
                    item = self._jobs.get(timeout=idle_s) if self._jobs.empty() else self._jobs.get_nowait()
                except queue.Empty:
                    item = ()
                if item is None:  # close()
                    if self._leader:  # the other ranks finish this step with us, then end too
                        self._join_step(*self._tick(False, False, stop=True))
                    return
                if item:
                    self._run_job(*item)
                    idle_s = _IDLE_MIN_S
                    continue
                if self._join_step(*self._tick(False, False)):
                    idle_s = _IDLE_MIN_S
                    continue
                if self._waker is not None and self._quiet_ticks >= self._sleep_after_ticks and not self._stop_seen:
                    self._sleep()
                    idle_s = _IDLE_MIN_S
                else:
                    idle_s = min(idle_s * 2, self._idle_max_s)
        finally:
            self._end()

    def _run_job(self, future: Future, fn: Callable, args: tuple) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(model_call(fn, *args))
            except BaseException as exc:  # the engine sees it; a broken group already exited
                future.set_exception(exc)

    def _join_step(self, kind: ForwardKind | None, extend: bool) -> bool:
        """After a tick this rank runs no forward of its own in: the idle forward of the step's
        kind, if the tick says "forward" (`kind` not None)."""
        if kind is None:
            return False
        try:
            model_call(self._idle_forward, ForwardMode.EXTEND if extend else ForwardMode.DECODE, kind)
        except Exception as exc:
            self._fail(f"an idle forward failed: {exc!r}")
        self.idle_forwards += 1
        return True

    def _sleep(self) -> None:
        self._epoch += 1
        self._quiet_ticks = 0  # every rank passes here at the same tick (or wakes it at once)
        with self._lock:
            busy = not self._jobs.empty()
            if not busy:
                self._asleep_epoch = self._epoch
        if busy:  # a job came in as the group decided to sleep: the others are asleep now
            self._wake(self._epoch)
            return
        self.sleeps += 1
        try:
            self._waker.wait(self._epoch)
        except Exception as exc:
            self._fail(f"the group's wake-up channel broke while idle: {exc!r}")
        finally:
            with self._lock:
                self._asleep_epoch = None

    def _put(self, item) -> int | None:
        """Queues `item`; returns the epoch to wake if the thread sleeps with its group. Raises
        GroupStopped once the thread has ended (a job queued then would never run)."""
        with self._lock:
            if self._ended:
                raise GroupStopped(f"{self._name}: the group has stopped")
            self._jobs.put(item)
            return self._asleep_epoch

    def _wake(self, epoch: int) -> None:
        try:
            self._waker.wake(epoch)
        except Exception as exc:
            self._fail(f"cannot wake the group: {exc!r}")

    def _tick(self, wants: bool, extend: bool, stop: bool = False,
              kind: ForwardKind = ForwardKind.MODEL) -> tuple[ForwardKind | None, bool]:
        """One tick; returns the step's kind (None: no forward this step) and whether it extends."""
        import torch.distributed as dist

        flags = torch.zeros(5, dtype=torch.int32)  # [wants_model, model_extends, wants_mtp, mtp_extends, stop]
        flags[2 * kind], flags[2 * kind + 1], flags[4] = int(wants), int(wants and extend), int(stop)
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        except Exception as exc:
            self._fail(f"a peer rank left or stopped answering: {exc}")
            raise
        self.ticks += 1
        # The sleep decision reads only tick results, which every rank sees alike. (A rank's own
        # jobs that run no forward, such as admitting a request whose KV is still in flight, must
        # not count: that rank would sleep ticks after its peers and tick alone into a collective.)
        step_kind = ForwardKind.MODEL if flags[0] else ForwardKind.MTP if flags[2] else None
        self._quiet_ticks = 0 if step_kind is not None else self._quiet_ticks + 1
        if flags[4] and not self._stop_seen:  # this step's forward still runs everywhere, then the end
            log.info("%s: rank 0 stopped the group", self._name)
            self._stop_seen = True
        return step_kind, step_kind is not None and bool(flags[2 * step_kind + 1])

    def _end(self) -> None:
        """The thread is over: jobs still queued fail, and (after a stop tick) `group_stopped` is set."""
        with self._lock:
            self._ended = True
        if self._stop_seen or self._leader:
            self.group_stopped.set()
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item:
                future = item[0]
                if future.set_running_or_notify_cancel():
                    future.set_exception(GroupStopped(f"{self._name}: the group has stopped"))

    def _fail(self, message: str) -> None:
        if self._stopping.is_set() or self._stop_seen:
            raise SystemExit(0)  # shutting down: peers leaving is expected
        self._on_failure(message)
