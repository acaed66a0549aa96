"""`LayerProgress`: a forward says when each layer's latent KV is in the pool.

The model knows no roles. An executor (the plain op-list loop in `DeepseekForCausalLM`, or
`TwoBatchOverlap`) calls `progress.kv_written(layer_id)` once per layer and forward, right after
the op that writes that layer's KV (`KV_WRITE_OP`), for every sequence of the batch: with
two-batch overlap, once both micro-batches have written it. Layers are reported in increasing
order. Whoever passed the progress object in decides what that means; the prefill worker streams
the layer to the decode side while the forward goes on (layer-wise KV transfer).

Passing no progress (decode, CUDA-graph capture and replay, the offline engine) costs nothing:
the executors test `progress is not None` once per layer.

Example, a 3-layer model on CUDA:

    seen = []
    progress = LayerEvents(torch.device("cuda"), lambda layer, event: seen.append((layer, event)))
    runner.extend(seqs, progress=progress)
    # seen == [(0, ev0), (1, ev1), (2, ev2)]: evL is recorded on the forward's stream right after
    # layer L's KV write; a reader on another stream waits for it, not for the whole forward.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

# The op of every layer's list that writes the layer's latent KV into the pool (`MLAAttention.prepare`).
KV_WRITE_OP = "attn_prepare"


class LayerProgress(Protocol):
    """Told by the forward after each layer's KV write (see the module docstring)."""

    def kv_written(self, layer_id: int) -> None:
        """Layer `layer_id`'s KV of every new token of the batch is written (or, on CUDA, queued
        on the current stream). Called in the thread that runs the forward."""


# (layer_id, event): `event` orders a reader after the layer's KV write; None on the CPU, where
# the write has already happened when the listener is called.
LayerListener = Callable[[int, "torch.cuda.Event | None"], None]


class LayerEvents:
    """A `LayerProgress` that records a CUDA event per layer (none on the CPU) for a listener."""

    def __init__(self, device: torch.device | str, listener: LayerListener) -> None:
        self.device = torch.device(device)
        self.listener = listener
        self._cuda = self.device.type == "cuda"

    def kv_written(self, layer_id: int) -> None:
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.listener(layer_id, event)


def kv_written_event(device: torch.device | str) -> "torch.cuda.Event | None":
    """An event recorded now on `device`'s default stream, where the forward writes the KV; None on
    the CPU. Taken between forwards (the last one returned, the next not yet queued), it marks
    the KV of every forward so far: a transport read that waits for it, rather than for the
    stream itself (a `ready` of None), does not also wait for a forward queued after it."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.default_stream(device))
    return event
