"""The decode side of a room's extra KV streams (grpc transport, `grpc_streams` > 1).

After the HandshakeAck names `kv_streams` = N, the bootstrap client opens streams 1 .. N-1 with
`Bootstrap.KVStream`, each on its own connection (so gRPC's per-connection work runs side by
side), and one `KVStreamReader` per stream follows it: chunks in its own seq order go to the
room's sink (the same sink and threads as the Transfer stream's chunks), credits go back on that
stream. The TransferDone says how many chunks each stream carried; `finish` waits for that many,
half-closes the stream (the prefill side then ends it) and for every write. A stream that breaks,
skips a seq or carries another count fails the transfer:

    stream broken                     -> UNAVAILABLE "KV stream 2 of room 7 broke: ..."
    event out of order / not a chunk  -> INTERNAL
    fewer or more chunks than done    -> INTERNAL "KV stream 2 of room 7 carried 3 chunks, ..."
"""
from __future__ import annotations

import asyncio
import time

import grpc

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.base import KVSink
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.decode.chunk_ingest import ChunkIngest

_EOF_WAIT_S = 2.0  # after our half-close: how long the prefill side may take to end the stream


def _credit(seq: int, landed: int) -> pb.KVStreamMessage:
    return pb.KVStreamMessage(credit=pb.Credit(received_seq=seq, landed_pages=landed))


class KVStreamReader:
    """Follows one extra KV stream of a room (see the module doc)."""

    def __init__(self, call, index: int, sink: KVSink, window: int, room: int) -> None:
        self.call = call
        self.index = index
        self.room = room
        self.ingest = ChunkIngest(sink, call, window, credit_message=_credit)
        self.received = 0
        self._progress = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name=f"kv-stream-{room}-{index}")

    @property
    def where(self) -> str:
        return f"KV stream {self.index} of room {self.room}"

    async def _run(self) -> None:
        read: asyncio.Future | None = None
        try:
            while True:
                await self.ingest.credit_written()
                if read is None:
                    read = asyncio.ensure_future(self.call.read())
                await asyncio.wait({read} | self.ingest.oldest(), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    continue
                finished, read = read, None
                try:
                    event = finished.result()
                except grpc.aio.AioRpcError as exc:
                    raise TransferError(FailureCode.UNAVAILABLE,
                                        f"{self.where} broke: {exc.code().name} {exc.details()}") from None
                if event is grpc.aio.EOF:
                    return
                if event.WhichOneof("event") != "chunk" or event.seq != self.received + 1:
                    raise TransferError(FailureCode.INTERNAL, f"{self.where}: event {event.seq} "
                                        f"({event.WhichOneof('event')}) arrived, expected chunk {self.received + 1}")
                self.received += 1
                self.ingest.start(event.seq, event.chunk)
                self._progress.set()
        finally:
            if read is not None:
                read.cancel()
            self._progress.set()

    def failure(self) -> BaseException | None:
        """The error that ended this stream, if it ended with one."""
        if self.task.done() and not self.task.cancelled():
            return self.task.exception()
        return None

    async def finish(self, expected: int, deadline: float) -> None:
        """After the TransferDone: the stream's `expected` chunks are written, or this raises."""
        while self.received < expected and not self.task.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                    f"{self.where}: {self.received} of {expected} chunks by the deadline")
            self._progress.clear()
            waiter = asyncio.ensure_future(self._progress.wait())
            await asyncio.wait({waiter, self.task}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if (error := self.failure()) is not None:
            raise error
        if self.received != expected:
            raise TransferError(FailureCode.INTERNAL, f"{self.where} carried {self.received} chunks, "
                                f"the TransferDone says {expected}")
        self.ingest.writable = False
        try:
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass
        await asyncio.wait({self.task}, timeout=max(0.001, min(_EOF_WAIT_S, deadline - time.monotonic())))
        if (error := self.failure()) is not None:
            raise error
        await self.ingest.drain()

    async def close(self, cancel: bool) -> None:
        """Stops following (cancelling the call if `cancel`) once no write into the pages runs."""
        if cancel:
            self.call.cancel()
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.ingest.settle()
