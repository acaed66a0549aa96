"""KV over the bootstrap service's own Transfer stream, for clusters without Mooncake.

Prefill: each `send` cuts its pages x layers into one contiguous block per KV stream of the room
(`plan.split_for_streams`; one stream unless both ends set `grpc_streams` > 1), and each block
into chunks of at most the negotiated chunk size (several MB: the per-message cost of gRPC
dominates small ones). Worker threads gather each chunk into a reusable staging buffer
(`page_io.PageGather`), crc32 it (`checksum.py`) and encode the message (`wire.encode_chunk_event`:
one copy); up to `io_threads` chunks are in the making while earlier ones are on the wire, taken
from the streams in turn. `emit` waits for room on that stream's bounded queue and the decode
side's credits, so a slow decode side slows the prefill side; nothing buffers a whole prompt.

Decode: the bootstrap client hands each chunk to the sink in `executor`'s threads, off the event
loop that runs the decode scheduler: ranges, size, duplicates and crc32 are checked, then the
bytes are written into the pool straight from the message (`page_io.scatter_pages`), once decode's
finite check passed on them (`KVSink.check_on_landing`: a chunk with a NaN fails the transfer then,
before the TransferDone, and its bytes reach no page). The sink records which (layer, page) cells
it has, so a missing chunk is caught at TransferDone.

Same host: when the decode side offers its pool and this process can open it (direct_pool.py),
`DirectChannel` copies each chunk's pages device to device and emits the chunk without its bytes,
marked `written_directly`; the decode side checks and counts it like any other chunk, and runs the
finite check on the pages the peer wrote.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.base import (
    EmitChunk, KVReceiver, KVSender, KVSink, LandingCheck, SendChannel, TransportConfig, check_page_ids)
from deepseek_pd.workers.transport.checksum import crc32
from deepseek_pd.workers.transport.direct_pool import DirectPools, offer, offers_pool, write_pages
from deepseek_pd.workers.transport.local_peer import shares_host
from deepseek_pd.workers.transport.page_io import PageGather, read_pages, scatter_pages
from deepseek_pd.workers.transport.plan import ChunkShape, split_for_streams, split_into_chunks
from deepseek_pd.workers.transport.warm_up import warm_receiver, warm_sender
from deepseek_pd.workers.transport.wire import ChunkHeader, EncodedChunk, encode_chunk_event
from deepseek_pd.workers.engine.request_failure import RequestFailure, TransferError, failure_for

__all__ = ["GrpcReceiver", "GrpcSender", "GrpcSink", "read_pages"]
log = logging.getLogger(__name__)


class GrpcChannel(SendChannel):
    def __init__(self, pool: KVPool, dst_pages: Sequence[int], emit: EmitChunk, max_chunk_bytes: int,
                 timeout_s: float, gather: PageGather, executor: ThreadPoolExecutor, depth: int,
                 streams: int = 1) -> None:
        super().__init__(pool, dst_pages)
        self.emit = emit
        # Per KV stream: chunk k on it is its event k (on the Transfer stream, 0 is the ack).
        self._seqs = [0] * streams
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self.gather = gather
        self.executor = executor
        self.depth = depth  # chunks gathered ahead of the one being emitted

    async def send(self, src_pages: Sequence[int], page_begin: int, layer_begin: int = 0,
                   layer_end: int | None = None, ready: "torch.cuda.Event | None" = None) -> None:
        layers = self._check_range(src_pages, page_begin, layer_begin, layer_end)
        pages = range(page_begin, page_begin + len(src_pages))
        loop = asyncio.get_running_loop()
        making: collections.deque[asyncio.Future[EncodedChunk]] = collections.deque()
        try:
            for stream, shape in self._shapes(layers, pages):
                local = list(src_pages[shape.page_begin - page_begin:shape.page_end - page_begin])
                self._seqs[stream] += 1
                making.append(loop.run_in_executor(self.executor, self._encode, stream, self._seqs[stream],
                                                   shape, local, ready))
                if len(making) >= self.depth:
                    await self._emit(await making.popleft())
            while making:
                await self._emit(await making.popleft())
        finally:
            for future in making:  # a failed emit: the rest is never sent
                future.cancel()

    def _shapes(self, layers: range, pages: range) -> list[tuple[int, ChunkShape]]:
        """(stream, chunk) of one send: block i of the send on stream i, the streams taken in turn
        so that every stream has a chunk in the making from the start."""
        per_stream = [split_into_chunks(block_layers, block_pages, self.pool.bytes_per_page, self.max_chunk_bytes)
                      for block_layers, block_pages in split_for_streams(layers, pages, len(self._seqs))]
        return [(stream, chunks[turn]) for turn in range(max(map(len, per_stream)))
                for stream, chunks in enumerate(per_stream) if turn < len(chunks)]

    def _encode(self, stream: int, seq: int, shape: ChunkShape, pages: list[int],
                ready: "torch.cuda.Event | None") -> EncodedChunk:
        """In a worker thread: pool pages -> staging -> crc32 -> one message's bytes."""
        header = ChunkHeader(shape.layer_begin, shape.layer_end, shape.page_begin, shape.page_end)
        waited = 0.0

        def on_slot_wait(seconds: float) -> None:
            nonlocal waited
            waited = seconds
            self.stats.add("slot_wait", seconds)

        began = time.perf_counter()
        with self.gather.gather(range(shape.layer_begin, shape.layer_end), pages, ready, on_slot_wait) as data:
            self.stats.add("stage", time.perf_counter() - began - waited)
            with self.stats.timed("checksum"):
                crc = crc32(data)
            with self.stats.timed("serialise"):
                return encode_chunk_event(seq, header, data, crc, stream)

    async def _emit(self, chunk: EncodedChunk) -> None:
        with self.stats.timed("network"):
            try:
                await asyncio.wait_for(self.emit(chunk), self.timeout_s)
            except asyncio.TimeoutError:
                raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                    f"decode side took more than {self.timeout_s}s to accept a KV chunk") from None
        self.bytes_sent += chunk.kv_bytes
        self.stats.count(chunk.kv_bytes)


class DirectChannel(GrpcChannel):
    """A GrpcChannel whose chunks are copied straight into the decode pool's `dst_buffers`
    (direct_pool.py); each chunk then goes out without its bytes, marked `written_directly`.

    Not layer-wise: a device copy of a whole chunk takes about a millisecond (25 MB at 23 GB/s on
    the H200), and at 8k tokens per-chunk sends measured the same TTFT as per-layer ones."""

    streams_layers = False

    def __init__(self, *args, dst_buffers: Sequence[torch.Tensor], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dst_buffers = dst_buffers

    def _encode(self, stream: int, seq: int, shape: ChunkShape, pages: list[int],
                ready: "torch.cuda.Event | None") -> EncodedChunk:
        layers = range(shape.layer_begin, shape.layer_end)
        with self.stats.timed("write"):
            write_pages(self.pool, self.dst_buffers, layers, pages,
                        self.dst_pages[shape.page_begin:shape.page_end], ready)
        header = ChunkHeader(shape.layer_begin, shape.layer_end, shape.page_begin, shape.page_end)
        return encode_chunk_event(seq, header, b"", 0, stream,
                                  direct_bytes=len(layers) * len(pages) * self.pool.bytes_per_page)


# A direct chunk carries no bytes: one per KV stream and send is enough (no staging to bound).
DIRECT_CHUNK_BYTES = 1 << 40


class GrpcSender(KVSender):
    name = "grpc"

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        super().__init__(pool, config)
        self.executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-send")
        # One staging slot per thread: a chunk holds its slot only while it is checksummed and
        # encoded, so requests sending at once share them.
        self.gather = PageGather(pool, config.max_chunk_bytes, config.io_threads)
        self.direct = DirectPools(pool) if config.same_host_direct != "off" else None
        warm_sender(pool, self.executor, config.io_threads, self.gather)

    async def prepare(self, handshake: pb.Handshake) -> None:
        # Mapping a pool is a CUDA IPC open per layer (again after it idled out): in a thread, so
        # the event loop keeps serving the other requests meanwhile; `open` then finds it cached.
        if self.direct is not None and handshake.grpc.HasField("direct") and not self.direct.is_cached(
                handshake.grpc.direct):
            await asyncio.to_thread(self.direct.open, handshake.grpc.direct)

    def _open(self, handshake: pb.Handshake, emit: EmitChunk, streams: int) -> SendChannel:
        limit = min(self.config.max_chunk_bytes, handshake.grpc.max_chunk_bytes or self.config.max_chunk_bytes)
        if self.pool.bytes_per_page > limit:
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"one KV page is {self.pool.bytes_per_page} bytes, above the chunk limit {limit}")
        offered = handshake.grpc.direct if handshake.grpc.HasField("direct") else None
        dst_buffers = self.direct.open(offered) if offered is not None and self.direct is not None else None
        if dst_buffers is not None:
            check_page_ids(handshake.page_ids, offered.pool_pages)
            return DirectChannel(self.pool, handshake.page_ids, emit, DIRECT_CHUNK_BYTES, self.config.send_timeout_s,
                                 self.gather, self.executor, depth=self.config.io_threads, streams=streams,
                                 dst_buffers=dst_buffers)
        return GrpcChannel(self.pool, handshake.page_ids, emit, limit, self.config.send_timeout_s,
                           self.gather, self.executor, depth=self.config.io_threads, streams=streams)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.direct is not None:
            self.direct.close()


class GrpcSink(KVSink):
    """Checks and writes chunks; thread-safe, so several chunks may be written at once."""

    one_sided = False  # every byte in the pages is one this sink wrote (`on_chunk`)

    def __init__(self, pool: KVPool, pages: Sequence[int], executor: ThreadPoolExecutor | None = None,
                 offer: pb.DirectPool | None = None) -> None:
        """`offer`: the pool offered to this transfer's writer for direct writes (direct_pool.py);
        the peer may then write the pages itself: one-sided."""
        self.offer = offer
        self.one_sided = offer is not None
        super().__init__(pool, pages)
        self.executor = executor
        # claimed[layer][page]: a chunk took the cell (duplicates refused); written: its bytes are in.
        self.claimed = torch.zeros(pool.num_layers, len(self.pages), dtype=torch.bool)
        self.written = torch.zeros(pool.num_layers, len(self.pages), dtype=torch.bool)
        self._lock = threading.Lock()
        self._on_land: LandingCheck | None = None  # `check_on_landing`'s check, run on every chunk

    def check_on_landing(self, check: LandingCheck) -> None:
        self._on_land = check

    def checked_on_landing(self) -> bool:  # (after check_complete: every cell came in a chunk)
        return self._on_land is not None

    @property
    def offered_direct(self) -> bool:
        return self.offer is not None

    def offer_into(self, handshake: pb.Handshake) -> None:
        if self.offer is not None:
            handshake.grpc.direct.CopyFrom(self.offer)

    def on_chunk(self, chunk: pb.KVChunk) -> None:
        if self.failed is not None:
            raise failure_for(self.failed.code, f"transfer already failed: {self.failed.message}")
        layers, pages = range(chunk.layer_begin, chunk.layer_end), self.pages[chunk.page_begin:chunk.page_end]
        try:
            with self.stats.timed("check"):
                self._check(chunk)
                if self._on_land is not None and not chunk.written_directly:
                    self._on_land.data(layers, chunk.data)  # before the bytes reach any page
            if not chunk.written_directly:
                self.exposure.wrote()  # a write that fails half-way leaves bytes behind too
                with self.stats.timed("write"):
                    scatter_pages(self.pool, layers, pages, chunk.data)
            elif self._on_land is not None:
                with self.stats.timed("check"):  # (the peer's copy was complete before it sent the chunk)
                    self._on_land.pages(layers, pages)
        except RequestFailure as exc:
            raise self.fail(exc) from None
        except Exception as exc:  # a bug must still fail this transfer, not leave it half-written
            raise self.fail(TransferError(FailureCode.INTERNAL, f"writing a KV chunk failed: {exc!r}")) from exc
        with self._lock:
            self.written[chunk.layer_begin:chunk.layer_end, chunk.page_begin:chunk.page_end] = True
        self.stats.count(self._cells_bytes(chunk))

    def _cells_bytes(self, chunk: pb.KVChunk) -> int:
        return (chunk.layer_end - chunk.layer_begin) * (chunk.page_end - chunk.page_begin) * self.pool.bytes_per_page

    def _check(self, chunk: pb.KVChunk) -> None:
        where = (f"layers [{chunk.layer_begin}, {chunk.layer_end}) pages "
                 f"[{chunk.page_begin}, {chunk.page_end})")
        if not (0 <= chunk.layer_begin < chunk.layer_end <= self.pool.num_layers
                and 0 <= chunk.page_begin < chunk.page_end <= len(self.pages)):
            raise TransferError(FailureCode.INTERNAL, f"KV chunk {where} is out of range "
                                f"({self.pool.num_layers} layers, {len(self.pages)} pages)")
        if chunk.written_directly:
            if not self.offered_direct:
                raise TransferError(FailureCode.INTERNAL, f"KV chunk {where} claims a direct write, but this "
                                    "decode worker offered its pool to no writer")
            if len(chunk.data):
                raise TransferError(FailureCode.INTERNAL, f"KV chunk {where} is marked written directly "
                                    f"and carries {len(chunk.data)} bytes")
        else:
            expected = self._cells_bytes(chunk)
            if len(chunk.data) != expected:
                raise TransferError(FailureCode.INTERNAL,
                                    f"KV chunk {where} has {len(chunk.data)} bytes, its ranges need {expected}")
            if crc32(chunk.data) != chunk.crc32:
                raise TransferError(FailureCode.INTERNAL, f"KV chunk {where} failed its crc32 check (corrupted)")
        with self._lock:
            cells = self.claimed[chunk.layer_begin:chunk.layer_end, chunk.page_begin:chunk.page_end]
            if bool(cells.any()):
                raise TransferError(FailureCode.INTERNAL, f"KV chunk {where} repeats pages already received")
            cells.fill_(True)

    @property
    def received(self) -> torch.Tensor:
        """[layers, pages]: True where the cell's bytes are in the pool."""
        return self.written

    def _check_cells(self) -> None:
        with self._lock:
            missing = int((~self.written).sum())
        if missing:
            raise self.fail(TransferError(FailureCode.INTERNAL,
                                          f"transfer reported done but {missing} (layer, page) cells never arrived"))


def _offer(pool: KVPool) -> pb.DirectPool | None:
    """The pool's same-host offer, or None where this torch cannot share it (the byte stream stays)."""
    try:
        return offer(pool)
    except Exception as exc:  # e.g. an allocator mode without IPC handles
        log.warning("the KV pool cannot be offered for same-host direct writes (%r); KV arrives over the "
                    "gRPC byte stream", exc)
        return None


class GrpcReceiver(KVReceiver):
    name = "grpc"

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        super().__init__(pool, config)
        self.executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-ingest")
        self.direct = _offer(pool) if offers_pool(pool, config.same_host_direct) else None
        warm_receiver(pool, self.executor, config.io_threads, config.max_chunk_bytes)

    def fill_destination(self, handshake: pb.Handshake) -> None:
        handshake.grpc.max_chunk_bytes = self.config.max_chunk_bytes
        handshake.grpc.streams = self.config.grpc_streams

    def open_sink(self, pages: Sequence[int], peer_host: str | None = None) -> KVSink:
        # The pool goes only to a writer that may be on this host (local_peer.py): offered to one
        # that cannot open it, a failed transfer's pages would wait out the grace for nothing.
        offer = self.direct if peer_host is None or shares_host(peer_host) else None
        return GrpcSink(self.pool, pages, self.executor, offer=offer)

    @property
    def late_write_grace_s(self) -> float:
        # A direct write the prefill side started before it learnt of the failure (it starts none
        # after: KVPush) is one device copy behind at most the forward in flight: well inside this.
        return self.config.send_timeout_s if self.direct is not None else 0.0

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
