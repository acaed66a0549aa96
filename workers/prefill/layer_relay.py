"""`LayerRelay`: a forward's per-layer KV notices, handed from the model thread to the event loop with
one wake-up per batch rather than one per layer.

Layer-wise streaming (engine.py `_PushHooks.layer_progress`) tells the event loop after each layer's
KV write, from the model thread, in the middle of a forward. `loop.call_soon_threadsafe` per layer
writes the loop's self-pipe each time (a syscall, and a wake of the loop thread, which then takes
the GIL from the forward), 27 times a round on V2-Lite. Here a notice joins a list, and only the
one that finds the list empty schedules the loop's drain; a loop that is busy (serving streams,
sending the previous layer) then takes every layer written meanwhile in one callback, in order:

    relay = LayerRelay(loop, deliver)       # deliver(layer, ready) runs on the loop
    relay.notice(0, ev0)                    # model thread: schedules a drain
    relay.notice(1, ev1)                    # the drain has not run yet: no wake-up
    # loop: deliver(0, ev0); deliver(1, ev1)

CPU profile of the tiny model (bench/prefill_step_ratio.py --tiny --profile, 2 shared cores): the
per-layer `call_soon_threadsafe` was 15% of the worker's forward, nearly all of it the self-pipe's
`send`.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


class LayerRelay:
    """Calls `deliver(layer, ready)` on `loop` for every `notice`, in notice order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[int, Any], None]) -> None:
        self._loop = loop
        self._deliver = deliver
        self._pending: list[tuple[int, Any]] = []
        self._lock = threading.Lock()

    def notice(self, layer: int, ready: Any) -> None:
        """From any thread: layer `layer`'s KV is written (`ready`: its CUDA event, or None)."""
        with self._lock:
            self._pending.append((layer, ready))
            wake = len(self._pending) == 1  # else a drain is scheduled and has not taken the list yet
        if wake:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for layer, ready in batch:
            self._deliver(layer, ready)
