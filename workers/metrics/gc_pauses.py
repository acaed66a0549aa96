"""Garbage-collector pauses in a worker: the startup heap frozen, every pause measured.

After start a worker's heap is large and lives as long as the process: the model's modules and
parameters, the imported libraries, the tokenizer (341k tracked objects for the V2-Lite shape).
CPython's full (generation-2) collection walks all of it while holding the GIL: 160-200 ms on the
2-core CI machine (`bench/gc_pauses.py`), a stall of every thread of the worker (the model thread,
gRPC, the KV stream) that lands in some request's TTFT or inter-token gap. `freeze_startup_heap()`
(once the engine has started, before the worker reports ready) collects once and moves what is
left into the permanent generation (`gc.freeze`), as vLLM does after its engine starts: later
collections walk only what was made while serving. Frozen objects are never collected as cycles;
only what is alive at start is frozen, and that lives as long as the worker.

`GcPauses` times every collection (`gc.callbacks`, run by whichever thread triggered it) into a
callback by generation (WorkerMetrics.observe_gc_pause: `deepseek_pd:gc_pause_seconds`) and logs
a warning for a pause of `warn_s` or more, so a stall shows in /metrics and in the log:

    pauses = GcPauses(metrics.observe_gc_pause)
    pauses.install()
    ...                                 # start the engine
    freeze_startup_heap()
    ...                                 # serve
    pauses.uninstall()
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

# A pause this long is worth a line in the log: an inter-token gap of several decode steps.
WARN_S = 0.05

PauseSink = Callable[[int, float], None]  # (generation, seconds)


def freeze_startup_heap() -> int:
    """Collects everything unreachable, then freezes the rest; returns the objects now frozen."""
    began = time.perf_counter()
    gc.collect()
    full_s = time.perf_counter() - began
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze the startup heap: %d objects no collection walks again (a full collection of them "
             "took %.0f ms)", frozen, full_s * 1e3)
    return frozen


class GcPauses:
    """Times each garbage collection of this process into `sink(generation, seconds)`."""

    def __init__(self, sink: PauseSink, warn_s: float = WARN_S) -> None:
        self.sink = sink
        self.warn_s = warn_s
        self._began: float | None = None

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # Collections never overlap: the GIL is held from "start" to "stop".
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:  # installed during a collection
            return
        seconds, self._began = time.perf_counter() - self._began, None
        generation = info["generation"]
        self.sink(generation, seconds)
        if seconds >= self.warn_s:
            log.warning("garbage collection of generation %d paused this worker for %.0f ms (%d objects "
                        "collected)", generation, seconds * 1e3, info.get("collected", 0))
