"""`RoundClock`: where one prefill round's wall-clock time went, from host timestamps alone.

A serving run cannot be traced without changing what it measures (session 12's traced step was
1.04x its runner, the untraced one 1.92x). The clock takes `time.perf_counter()` at the points a
round passes anyway and names each interval after the mark that closes it, so the phases are
contiguous and add up to the round's whole step (`total`), with nothing synchronised for them:

    hop_in     event loop hands the round to the model thread -> the thread starts it (executor
               hand-off, the thread's wake-up, the GIL)
    prepare    -> the forward reports layer 0's KV write: host-side preparation (the batch's
               metadata and its uploads, the embedding, layer 0's attention prologue)
    launch     -> the extend returns: the forward's remaining host time (on CUDA its launches;
               on the CPU its compute), less `handoffs`
    handoffs   per-layer callbacks of layer-wise sends on the model thread (`timed_progress`)
    sample     -> the first tokens' sampling is queued
    gpu_wait   the model thread blocked for the device: the first tokens' host copy (the round's
               one wait, extend_step.py), or the stream sync of a round that samples nothing
    mtp        the MTP layer's pass over the round (speculative decoding only)
    other      -> the model thread returns (the round's output objects)
    hop_out    -> the event loop resumes the scheduler with the result (its wake-up: a busy loop
               answers late)

On CUDA `launch` is host time: a forward that runs ahead of the GPU spends its device time in
`gpu_wait`. A round whose `hop_in`/`hop_out` grow is waiting for the GIL or the loop; one whose
`prepare` grows has host work before its first kernel. Example, one 789-token prompt:

    clock = RoundClock()                 # event loop, as the round is handed over
    clock.mark("hop_in")                 # model thread: first thing
    ...                                  # forward, sample, host copy, each closed by a mark
    clock.mark("hop_out")                # event loop, result in hand
    clock.phases  # {"hop_in": 0.0002, "prepare": 0.0011, "launch": 0.0301, ..., "hop_out": 0.0001}
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepseek_pd.model.kv.layer_progress import LayerProgress

# Every phase a prefill round reports, in the order a round passes them (module docstring).
PHASES = ("hop_in", "prepare", "launch", "handoffs", "sample", "gpu_wait", "mtp", "other", "hop_out")


class RoundClock:
    """Contiguous phases of one round (module docstring); used by one thread at a time."""

    def __init__(self) -> None:
        self.began = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}
        self._excluded = 0.0  # time inside the current interval that belongs to `handoffs`

    def mark(self, phase: str) -> None:
        """Ends the interval since the previous mark and adds it to `phase` (less any `handoffs`
        inside it)."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self._last) - self._excluded
        self._last, self._excluded = now, 0.0

    def mark_once(self, phase: str) -> None:
        """`mark`, unless `phase` already has time (the first layer's report ends `prepare`)."""
        if phase not in self.phases:
            self.mark(phase)

    def exclude(self, seconds: float) -> None:
        """`seconds` of the current interval were a hand-off: they go to `handoffs`, not to the
        phase that the next mark closes."""
        self.phases["handoffs"] = self.phases.get("handoffs", 0.0) + seconds
        self._excluded += seconds

    @property
    def total(self) -> float:
        """Seconds from the clock's start to its last mark: the sum of `phases`."""
        return self._last - self.began


class _TimedProgress:
    """A forward's `LayerProgress` that ends the clock's `prepare` at the first layer's report and
    counts the role's per-layer callback (`inner`, if any) as `handoffs`."""

    def __init__(self, clock: RoundClock, inner: "LayerProgress | None") -> None:
        self.clock = clock
        self.inner = inner

    def kv_written(self, layer_id: int) -> None:
        self.clock.mark_once("prepare")
        if self.inner is not None:
            began = time.perf_counter()
            self.inner.kv_written(layer_id)
            self.clock.exclude(time.perf_counter() - began)


def timed_progress(clock: RoundClock | None, inner: "LayerProgress | None") -> "LayerProgress | None":
    """The progress a round's forward gets: `inner` (the role's, or None) seen by `clock`; `inner`
    itself when there is no clock."""
    return inner if clock is None else _TimedProgress(clock, inner)
