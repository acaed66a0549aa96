"""Copies between a KV pool and flat host bytes laid out `[layer][page][slot][kv_dim]`.

Used by the byte-moving transport (grpc). Both directions run in worker threads: every call here
is a torch op, which releases the GIL, so the event loop keeps running while KV moves.

- `PageGather` (sender): one gather per layer into a reusable staging buffer (for CUDA pools an
  `index_select` into a device staging buffer, then one D2H copy into pinned host memory). A slot
  is held only while its bytes are being checksummed and copied into a message.
- `scatter_pages` (receiver): the received bytes are viewed, not copied; for CUDA pools one H2D
  copy and one `index_copy_` per layer, for CPU pools one copy per run of consecutive destination
  pages and layer.

CPU pools are copied through numpy views of the pool (uint8): on the shared worker threads
torch's CPU copy kernels fork OpenMP teams per call and ran 3x slower than numpy's plain loops
(measured: scatter 1.5 vs 5 GB/s, gather 2.2 vs 3.8 GB/s on one core); numpy releases the GIL too.
On CUDA every copy runs on a side stream, so a transfer neither waits for nor delays the model's
kernels on the default stream; a `ready` event (recorded after the KV write) orders the read.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
import weakref
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kv.pool import KVPool, copy_pages_

# The received message is immutable `bytes` and is only read: torch's one-time warning that the
# tensor over it is not writable says nothing useful here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def page_index(pool: KVPool, pages: Sequence[int]) -> torch.Tensor:
    """`pages` as a long tensor on the pool's device, enqueued on the current stream (on CUDA
    through the thread's page-locked buffer where its warm-up reserved one: `host_copy.upload`)."""
    return upload(torch.as_tensor(list(pages), dtype=torch.long), pool.device)


_HOST_VIEWS: "weakref.WeakKeyDictionary[KVPool, list[np.ndarray]]" = weakref.WeakKeyDictionary()


def _host_views(pool: KVPool) -> list[np.ndarray]:
    """Per layer, the CPU pool buffer as a uint8 numpy array `[num_pages, page_size, kv_dim * itemsize]`."""
    views = _HOST_VIEWS.get(pool)
    if views is None:
        views = _HOST_VIEWS[pool] = [buffer.view(torch.uint8).numpy() for buffer in pool.buffers]
    return views


def _host_shaped(flat, pool: KVPool, num_layers: int, num_pages: int) -> np.ndarray:
    """`flat` bytes (any buffer) as uint8 `[layers, pages, page_size, kv_dim * itemsize]`, no copy."""
    size = num_layers * num_pages * pool.bytes_per_page
    array = np.frombuffer(flat, dtype=np.uint8, count=size)
    return array.reshape(num_layers, num_pages, pool.page_size, pool.bytes_per_page // pool.page_size)


def _shaped(flat: torch.Tensor, pool: KVPool, num_layers: int, num_pages: int) -> torch.Tensor:
    size = num_layers * num_pages * pool.bytes_per_page
    return flat[:size].view(pool.dtype).view(num_layers, num_pages, pool.page_size, pool.kv_dim)


def wait_ready(pool: KVPool, ready: "torch.cuda.Event | None", stream: "torch.cuda.Stream | None") -> None:
    """Orders the following reads of `pool` after its KV was written.

    With an event: the side stream waits for it (no host block). Without one on CUDA: for
    everything queued so far on the default stream, where the model writes the KV.
    """
    if stream is None:
        return
    if ready is not None:
        stream.wait_event(ready)
    else:
        stream.wait_stream(torch.cuda.default_stream(pool.device))


def sync_ready(pool: KVPool, ready: "torch.cuda.Event | None") -> None:
    """Blocks this (worker) thread until the KV to be read is written: for transports that read
    the pool from outside torch's streams (a one-sided NIC write, a plain copy)."""
    if ready is not None:
        ready.synchronize()
    elif pool.device.type == "cuda":
        torch.cuda.default_stream(pool.device).synchronize()


class _Slot:
    def __init__(self, pool: KVPool, nbytes: int) -> None:
        cuda = pool.device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=pool.device) if cuda else None
        self.stream = torch.cuda.Stream(pool.device) if cuda else None


class PageGather:
    """Sender side: `slots` reusable staging buffers of `max_bytes`, filled by `gather`.

    The slots are made here, not on first use: a page-locked allocation synchronises the CUDA
    context, so a slot made during a send would wait for the forward queued meanwhile (warm_up.py).
    """

    def __init__(self, pool: KVPool, max_bytes: int, slots: int) -> None:
        self.pool = pool
        self.max_bytes = max_bytes
        self.num_slots = slots
        self._slots: "queue.Queue[_Slot]" = queue.Queue()
        for _ in range(slots):
            self._slots.put(_Slot(pool, max_bytes))

    def _acquire(self) -> _Slot:
        return self._slots.get()

    def warm(self, page_counts: Sequence[int]) -> None:
        """Gathers `page_counts` pages of layer 0 once through every slot (each has its own stream,
        so its own allocator cache): the kernels and cached blocks later gathers use (warm_up.py)."""
        held = [self._slots.get() for _ in range(self.num_slots)]
        try:
            for slot in held:
                for count in page_counts:
                    count = min(count, self.max_bytes // self.pool.bytes_per_page)
                    if count:
                        self._fill(slot, range(1), list(range(count)), None)
        finally:
            for slot in held:
                self._slots.put(slot)

    @contextlib.contextmanager
    def gather(self, layers: range, pages: Sequence[int], ready: "torch.cuda.Event | None" = None,
               on_slot_wait: Callable[[float], None] | None = None) -> Iterator[memoryview]:
        """Yields the bytes of `pages` x `layers` as a view of a staging slot, valid inside the block.

        `on_slot_wait` hears the seconds spent waiting for a free slot (apart from the copy itself).
        """
        size = len(layers) * len(pages) * self.pool.bytes_per_page
        if size > self.max_bytes:
            raise ValueError(f"{size} bytes of pages exceed the staging buffer of {self.max_bytes}")
        began = time.perf_counter()
        slot = self._acquire()
        if on_slot_wait is not None:
            on_slot_wait(time.perf_counter() - began)
        try:
            self._fill(slot, layers, pages, ready)
            yield memoryview(slot.host[:size].numpy())
        finally:
            self._slots.put(slot)

    def _fill(self, slot: _Slot, layers: range, pages: Sequence[int], ready: "torch.cuda.Event | None") -> None:
        """The bytes of `pages` x `layers` into `slot.host`; returns once they are there."""
        if slot.stream is None:
            index = np.asarray(pages, dtype=np.int64)
            out = _host_shaped(slot.host.numpy(), self.pool, len(layers), len(pages))
            views = _host_views(self.pool)
            for offset, layer in enumerate(layers):
                np.take(views[layer], index, axis=0, out=out[offset])
            return
        size = len(layers) * len(pages) * self.pool.bytes_per_page
        with torch.cuda.stream(slot.stream):
            wait_ready(self.pool, ready, slot.stream)
            index = page_index(self.pool, pages)
            out = _shaped(slot.device, self.pool, len(layers), len(pages))
            for offset, layer in enumerate(layers):
                torch.index_select(self.pool.buffers[layer], 0, index, out=out[offset])
            slot.host[:size].copy_(slot.device[:size], non_blocking=True)
        slot.stream.synchronize()


_streams = threading.local()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own copy stream for `device` (writes of different chunks run side by side)."""
    streams = _streams.__dict__.setdefault("by_device", {})
    stream = streams.get(str(device))
    if stream is None:
        stream = streams[str(device)] = torch.cuda.Stream(device)
    return stream


def consecutive_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(begin, end, first page id): maximal runs of consecutive page ids among `pages`."""
    runs: list[tuple[int, int, int]] = []
    for index, page in enumerate(pages):
        if runs and page == runs[-1][2] + index - runs[-1][0]:
            runs[-1] = (runs[-1][0], index + 1, runs[-1][2])
        else:
            runs.append((index, index + 1, page))
    return runs


def scatter_pages(pool: KVPool, layers: range, pages: Sequence[int], data) -> None:
    """Writes `data` (`[layer][page][slot][dim]` bytes of `layers` x `pages`) into the pool.

    Returns once the bytes are in the pool (on CUDA: the side stream is synchronised).
    """
    expected = len(layers) * len(pages) * pool.bytes_per_page
    if memoryview(data).nbytes != expected:
        raise ValueError(f"{memoryview(data).nbytes} bytes for {len(layers)} layers x {len(pages)} pages "
                         f"({expected} expected)")
    if pool.device.type != "cuda":
        values = _host_shaped(data, pool, len(layers), len(pages))
        views = _host_views(pool)
        for begin, end, dst in consecutive_runs(pages):
            for offset, layer in enumerate(layers):
                views[layer][dst:dst + end - begin] = values[offset, begin:end]
        return
    stream = side_stream(pool.device)
    with torch.cuda.stream(stream):
        index = page_index(pool, pages)
        # The one H2D copy (through the thread's page-locked buffer where its warm-up reserved one).
        flat = upload(torch.frombuffer(data, dtype=torch.uint8), pool.device)
        on_device = _shaped(flat, pool, len(layers), len(pages))
        for offset, layer in enumerate(layers):
            copy_pages_(pool.buffers[layer], index, on_device[offset])
    stream.synchronize()


def read_pages(pool: KVPool, layers: range, pages: Sequence[int]) -> bytes:
    """Reference (slow) gather: the bytes `PageGather` produces, for tests and tools."""
    index = torch.as_tensor(list(pages), dtype=torch.long, device=pool.device)
    stacked = torch.stack([pool.buffers[layer].index_select(0, index) for layer in layers])
    return stacked.cpu().contiguous().view(torch.uint8).numpy().tobytes()
