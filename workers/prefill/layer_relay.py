"""`LayerRelay`: a forward's per-layer KV notices, handed from the model thread to the event loop with
one wake-up per group of layers rather than one per layer.

Layer-wise streaming (engine.py `_PushHooks.layer_progress`) tells the event loop after each layer's
KV write, from the model thread, in the middle of a forward. Each wake-up of the loop is a send: the
loop's drain, the push, the channel's hop to a KV thread and back, the message out. All of it is
Python, and the model thread gives the GIL up at every torch op, so the loop and the KV threads
take it in turns with the forward: with a send per layer, the forward waits for the GIL hundreds
of times and stretches well past the runner's (bench/prefill_thread_cpu.py measures it in `up`'s
real process layout; figures: docs/performance.md, "which threads run while the prefill worker's
forward does"; tests/workers/prefill/test_layer_send_gil.py holds the bound).

So a notice joins a list, and the loop is woken only when the notices since the last wake-up make
a group (`every` layers: `layers_per_send`, enough of them to hold the round's `min_bytes` of KV,
`SchedulerConfig.layerwise_min_bytes`) or at the forward's last layer; a loop that is busy then
takes every layer written meanwhile in one callback, in order, and the push sends them as one:

    relay = LayerRelay(loop, deliver, every=2, last_layer=2)   # deliver(layer, ready) runs on the loop
    relay.notice(0, ev0)                    # model thread: no wake-up (1 of 2)
    relay.notice(1, ev1)                    # a group: schedules a drain
    relay.notice(2, ev2)                    # the last layer: schedules one unless one is pending
    # loop: deliver(0, ev0); deliver(1, ev1); deliver(2, ev2)

Why groups of `min_bytes`: each send costs about the same whatever it carries, so the fewer the
better, but KV held back waits for the forward. A group holding `min_bytes` keeps the sends few for
short prompts and leaves a long prompt's layers (each above the floor alone) streaming one by one,
so what is left after the forward is at most one group's transfer. A round whose one group would
hold every layer is sent per chunk, after its forward, with no relay
(engine.py `_PushHooks.layer_progress`). What this gives V2-Lite (sends per prompt length, and the
other threads' CPU during a forward) is recorded once, in the same docs/performance.md entry.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


def layers_per_send(layer_bytes: int, min_bytes: int, num_layers: int) -> int:
    """The layers one hand-off groups: as many as hold `min_bytes` of KV at `layer_bytes` each, at
    least 1, at most `num_layers`. Example: 0.9 MB a layer, 8 MiB floor, 27 layers -> 10."""
    if min_bytes <= 0 or layer_bytes >= min_bytes:
        return 1
    if layer_bytes <= 0:
        return max(1, num_layers)
    return max(1, min(num_layers, -(-min_bytes // layer_bytes)))


class LayerRelay:
    """Calls `deliver(layer, ready)` on `loop` for every `notice`, in notice order, waking the loop
    once per `every` notices and at `last_layer` (module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[int, Any], None], every: int = 1,
                 last_layer: int | None = None) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self._loop = loop
        self._deliver = deliver
        self.every = every
        self.last_layer = last_layer
        self._pending: list[tuple[int, Any]] = []
        self._since_wake = 0  # notices since the last one that was due
        self._scheduled = False  # a drain is scheduled and has not taken the list yet
        self._lock = threading.Lock()

    def notice(self, layer: int, ready: Any) -> None:
        """From any thread: layer `layer`'s KV is written (`ready`: its CUDA event, or None)."""
        with self._lock:
            self._pending.append((layer, ready))
            self._since_wake += 1
            due = self._since_wake >= self.every or layer == self.last_layer
            if due:
                self._since_wake = 0
            wake = due and not self._scheduled
            self._scheduled = self._scheduled or wake
        if wake:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        for layer, ready in batch:
            self._deliver(layer, ready)
