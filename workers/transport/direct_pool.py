"""Same-host KV by direct device copies: the decode pool's buffers, opened by the prefill process.

The grpc transport's byte stream tops out near 1.5 GB/s in Python (docs/performance.md), while a
prefill and a decode worker on one host (`deepseek-pd up`, or pods that share a node and see the
same GPU) need not send the bytes at all. The decode side offers its pool in the handshake
(`pb.DirectPool`) to a prefill whose bootstrap address may be this host (local_peer.py): the
host's boot id, its pid, the GPU's UUID and, for a CUDA pool, torch's CUDA IPC description of
every layer buffer. A prefill worker that can open them (`DirectPools.open`)
copies each chunk's pages device to device (`write_pages`: per layer one index_select and one
index_copy_ on a side stream, ordered after the KV write) and sends, in place of the chunk's bytes,
a KVChunk marked `written_directly` (grpc_stream.DirectChannel). Flow control, per-stream order,
TransferDone and the decode side's cell accounting stay those of the byte stream.

Whatever cannot be opened keeps the byte stream, with the reason logged once per pool: another
host, the GPU not visible here or not this process's own (copies between two GPUs would also need
the destination's stream order: not done yet), IPC refused (containers without a shared IPC
namespace), or a CPU pool in another process (a CPU pool is only ever shared within its own
process: tests, tools). Pools unused for `IDLE_S` are let go, so a dead decode worker's GPU
memory is not kept mapped here.

    same_host_direct   decode offers           prefill writes directly when
    "auto" (default)   CUDA pools              it can open the offer
    "on"               any pool                it can open the offer (a CPU pool: same process)
    "off"              nothing                 never (a prefill with "off" also declines offers)

Trust: as with Mooncake, only an authenticated handshake reveals a pool, and a writer writes only
the pages that handshake lists, each checked below the pool's size (`base.check_page_ids`). The
decode side treats a transfer it offered its pool for as one-sided (exposure.py): a failed one's
pages are zeroed after the late-write grace.
"""
from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from deepseek_pd.model.kv.pool import KVPool, copy_pages_
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.page_io import page_index, side_stream, wait_ready

log = logging.getLogger(__name__)

# Pools exported by this process, by pool id: a writer in the same process uses them as they are
# (CUDA IPC cannot open a handle in the process that made it).
_EXPORTED: "weakref.WeakValueDictionary[str, KVPool]" = weakref.WeakValueDictionary()


def host_id() -> str:
    """This host's boot id ("" where the kernel has none: then only the same process matches)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return ""


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def offers_pool(pool: KVPool, mode: str) -> bool:
    """Whether a decode worker offers `pool` (`mode`: TransportConfig.same_host_direct)."""
    return mode == "on" or (mode == "auto" and pool.device.type == "cuda")


def offer(pool: KVPool) -> pb.DirectPool:
    """The decode side's offer of `pool`, made once per worker (each CUDA export pins an IPC slot)."""
    pool_id = secrets.token_hex(8)
    _EXPORTED[pool_id] = pool
    made = pb.DirectPool(host=host_id(), pid=os.getpid(), pool_id=pool_id, pool_pages=pool.num_pages,
                         page_bytes=pool.bytes_per_page)
    if pool.device.type == "cuda":
        made.device_uuid = _device_uuid(pool.device)
        for buffer in pool.buffers:
            (_, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
             event_sync_required) = buffer.untyped_storage()._share_cuda_()
            made.layers.add(handle=handle, size_bytes=size_bytes, offset_bytes=offset_bytes,
                            ref_counter_handle=ref_counter_handle, ref_counter_offset=ref_counter_offset,
                            event_handle=event_handle or b"", event_sync_required=event_sync_required)
    return made


# A decode pool that no transfer used for this long is let go. Holding it would keep a dead (or
# restarted) decode worker's GPU memory mapped here, so the worker that replaces it could not size
# its own pool; opening it again costs a few milliseconds.
IDLE_S = 5.0


@dataclass
class _Opened:
    buffers: list[torch.Tensor] | None  # None: this process cannot write that pool
    used_at: float


class DirectPools:
    """The prefill side's opened decode pools, by pool id; None for one it cannot write.

    A background thread lets go of pools idle for `idle_s` (a channel in use keeps its own
    reference, so a transfer is never cut off); `close` lets go of all."""

    def __init__(self, pool: KVPool, max_pools: int = 64, idle_s: float = IDLE_S) -> None:
        self.pool = pool
        self.max_pools = max_pools
        self.idle_s = idle_s
        self._opened: collections.OrderedDict[str, _Opened] = collections.OrderedDict()
        self._told: collections.OrderedDict[str, bool] = collections.OrderedDict()  # outcome logged
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None

    def is_cached(self, offered: pb.DirectPool) -> bool:
        """Whether `open(offered)` would answer from the cache (opened, or known unopenable)."""
        with self._lock:
            return _key(offered) in self._opened

    def open(self, offered: pb.DirectPool) -> list[torch.Tensor] | None:
        """The offered pool's layer buffers `[pool_pages, page_size, kv_dim]`, or None (the reason
        logged once per pool). Thread-safe; two threads opening one pool at once both get it
        (torch maps one IPC handle once per process)."""
        key = _key(offered)
        with self._lock:
            entry = self._opened.get(key)
            if entry is not None:
                entry.used_at = time.monotonic()
                self._opened.move_to_end(key)
                return entry.buffers
        try:
            buffers = self._open(offered)
        except Exception as exc:  # IPC refused, a bad handle: the byte stream still works
            buffers, reason = None, f"opening it failed: {exc!r}"
        else:
            reason = "" if isinstance(buffers, list) else buffers
            buffers = buffers if isinstance(buffers, list) else None
        with self._lock:
            if key not in self._told:
                self._told[key] = True
                if len(self._told) > 4 * self.max_pools:
                    self._told.popitem(last=False)
                if buffers is None:
                    log.info("decode KV pool %s (pid %d) is not written directly from here (%s); its KV goes "
                             "over the gRPC byte stream", offered.pool_id, offered.pid, reason)
                else:
                    log.info("decode KV pool %s (pid %d): KV is copied device to device (same host)",
                             offered.pool_id, offered.pid)
            self._opened[key] = _Opened(buffers, time.monotonic())
            while len(self._opened) > self.max_pools:
                self._opened.popitem(last=False)
            if self._sweeper is None and not self._closed.is_set():
                self._sweeper = threading.Thread(target=self._sweep_loop, name="direct-pools", daemon=True)
                self._sweeper.start()
        return buffers

    def sweep(self) -> int:
        """Lets go of the pools idle for `idle_s`; returns how many."""
        deadline = time.monotonic() - self.idle_s
        with self._lock:
            idle = [key for key, entry in self._opened.items() if entry.used_at <= deadline]
            for key in idle:
                del self._opened[key]
        return len(idle)

    def _sweep_loop(self) -> None:
        while not self._closed.wait(self.idle_s / 2):
            self.sweep()

    def close(self) -> None:
        """Lets go of every pool and stops the sweeper; idempotent."""
        self._closed.set()
        with self._lock:
            self._opened.clear()

    def _open(self, offered: pb.DirectPool) -> list[torch.Tensor] | str:
        """The buffers, or why not."""
        if offered.page_bytes != self.pool.bytes_per_page:
            return f"its page is {offered.page_bytes} bytes, ours {self.pool.bytes_per_page}"
        if not offered.host or offered.host != host_id():
            return "another host"
        if offered.pid == os.getpid():
            exported = _EXPORTED.get(offered.pool_id)
            if exported is None:
                return "no such pool in this process"
            if _index(exported.device) != _index(self.pool.device):
                return f"a pool on {exported.device}, this one is on {self.pool.device}"
            return list(exported.buffers)
        if self.pool.device.type != "cuda" or not offered.device_uuid:
            return "a CPU pool of another process"
        device = self._local_device(offered.device_uuid)
        if device is None:
            return f"its GPU {offered.device_uuid} is not visible here"
        if ("cuda", device) != _index(self.pool.device):
            # The copies, their stream order and the sync before TransferDone are written for one
            # device; between two GPUs they would need the destination's stream too (not done yet).
            return f"it is on another GPU (cuda:{device}) than this pool ({self.pool.device})"
        if len(offered.layers) != self.pool.num_layers:
            return f"it offers {len(offered.layers)} layer buffers, the model has {self.pool.num_layers}"
        shape = (offered.pool_pages, self.pool.page_size, self.pool.kv_dim)
        needed = offered.pool_pages * self.pool.bytes_per_page  # bytes_per_page: one layer's page
        buffers = []
        for layer in offered.layers:
            if layer.size_bytes < needed:
                return f"a layer buffer of {layer.size_bytes} bytes, {needed} needed"
            storage = torch.UntypedStorage._new_shared_cuda(
                device, layer.handle, layer.size_bytes, layer.offset_bytes, layer.ref_counter_handle,
                layer.ref_counter_offset, layer.event_handle or None, layer.event_sync_required)
            tensor = torch.empty(0, dtype=self.pool.dtype, device=torch.device("cuda", device))
            buffers.append(tensor.set_(storage, 0, shape))
        return buffers

    @staticmethod
    def _local_device(uuid: str) -> int | None:
        for index in range(torch.cuda.device_count()):
            if _device_uuid(torch.device("cuda", index)) == uuid:
                return index
        return None


def _key(offered: pb.DirectPool) -> str:
    return f"{offered.host}/{offered.pid}/{offered.pool_id}"


def _index(device: torch.device) -> tuple[str, int]:
    """(type, index) with CUDA's "current device" made explicit, so equal devices compare equal."""
    if device.type == "cuda":
        return "cuda", device.index if device.index is not None else torch.cuda.current_device()
    return device.type, 0


# The most bytes one layer's gathered pages take at a time. The gather's temporary then always fits
# the block the caching allocator made for this thread's stream when warm_up.py ran it (a request
# under 10 MiB is served from a 20 MiB block): a bigger one would be a new cudaMalloc during a send.
COPY_BATCH_BYTES = 8 << 20


def write_pages(src: KVPool, dst: Sequence[torch.Tensor], layers: range, src_pages: Sequence[int],
                dst_pages: Sequence[int], ready: "torch.cuda.Event | None") -> None:
    """Copies `src_pages` of `layers` of `src` into `dst_pages` of the `dst` buffers; returns once
    the bytes are there. On CUDA the copies run on this thread's side stream after `ready` (or
    everything on the default stream), like the byte stream's gather, at most `COPY_BATCH_BYTES`
    of pages per layer at a time."""
    step = max(1, COPY_BATCH_BYTES // src.bytes_per_page)

    def copy() -> None:
        for begin in range(0, len(src_pages), step):
            src_index = page_index(src, src_pages[begin:begin + step])
            dst_index = page_index(src, dst_pages[begin:begin + step])  # DirectPools opens pools on this device only
            for layer in layers:
                copy_pages_(dst[layer], dst_index, src.buffers[layer].index_select(0, src_index))

    if src.device.type != "cuda":
        copy()
        return
    stream = side_stream(src.device)
    with torch.cuda.stream(stream):
        wait_ready(src, ready, stream)
        copy()
    stream.synchronize()
