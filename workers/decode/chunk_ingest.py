"""Chunk writes of one KV stream in flight in the sink's threads, and the credits they earn.

The bootstrap client's event loop only parses a chunk's header; `start` hands the chunk to the
sink's worker threads (check + pool write), several at once. Credit for more goes back on the
stream every half window, for the written prefix of the stream, so memory stays bounded by the
window however slow the writes are; a Mooncake window that landed (`KVSink.landed_pages`) is
credited at once, with the pages landed, since its writer waits for those slots. One per
stream: the Transfer stream and each extra KV stream.
"""
from __future__ import annotations

import asyncio
import collections

import grpc

from deepseek_pd.future_outcome import retrieve
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.base import KVSink
from deepseek_pd.workers.transport.wire import ChunkEvent


class ChunkIngest:
    """`call.write(credit_message(seq, landed_pages))` grants credit; the Transfer and KVStream calls
    take different request messages, hence `credit_message`."""

    def __init__(self, sink: KVSink, call, window: int, credit_message=None) -> None:
        self.sink = sink
        self.call = call
        self.every = max(1, window // 2)
        self.credited = 0
        self.landed = 0  # the sink's landed pages last reported
        self.writable = True  # False once this side half-closed the stream: no credit is needed then
        self.credit_message = credit_message or (
            lambda seq, landed: pb.DecodeMessage(credit=pb.Credit(received_seq=seq, landed_pages=landed)))
        self._pending: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def start(self, seq: int, chunk: ChunkEvent) -> None:
        loop = asyncio.get_running_loop()
        if self.sink.executor is None:
            self.sink.on_chunk(chunk)  # refused at once (transports that carry no chunks)
            future: asyncio.Future = loop.create_future()
            future.set_result(None)
        else:
            future = loop.run_in_executor(self.sink.executor, self.sink.on_chunk, chunk)
        self._pending.append((seq, future))

    def oldest(self) -> set[asyncio.Future]:
        return {self._pending[0][1]} if self._pending else set()

    async def credit_written(self) -> None:
        """Credits the written prefix of the stream; raises the first failed write's error."""
        written = None
        while self._pending and self._pending[0][1].done():
            seq, future = self._pending.popleft()
            future.result()
            written = seq
        landed = self.sink.landed_pages
        # A window that landed is credited at once: its writer waits for the slots.
        # So is a pulled chunk (`credits_each_chunk`): its sender frees the slots it was read from then.
        if written is not None and self.writable and (written - self.credited >= self.every or landed > self.landed
                                                      or self.sink.credits_each_chunk):
            self.credited, self.landed = written, landed
            try:
                await self.call.write(self.credit_message(written, landed))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # the stream is broken (the next read reports it) or already half-closed

    async def drain(self) -> None:
        """Waits for every write; raises the first failure in stream order."""
        while self._pending:
            seq, future = self._pending.popleft()
            await asyncio.wait({future})
            future.result()

    async def settle(self) -> None:
        """Waits for the writes still running (after a failure they end quickly: the sink is failed)."""
        futures = {future for _, future in self._pending}
        self._pending.clear()
        if futures:
            await asyncio.wait(futures)
            for future in futures:
                retrieve(future)
