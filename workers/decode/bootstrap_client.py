"""The decode worker's side of the bootstrap channel: handshake, then follow the room's events.

`transfer()` opens `Bootstrap.Transfer` on the prefill worker named by the router's
`DisaggParams`, sends the handshake, retrying with exponential backoff while the server is unreachable (the prefill
worker may still be starting) until `handshake_timeout_s`; then it reads the room's events in
order (sequence numbers checked), feeds KV chunks to the transport's sink, grants credit for
more every half window, and returns the
`TransferDone` or raises `TransferError`:

    unreachable for handshake_timeout_s          -> UNAVAILABLE
    no TransferDone within transfer_timeout_s    -> DEADLINE_EXCEEDED
    stream broken (prefill died)                 -> UNAVAILABLE
    TransferFailed from prefill                  -> its code
    corrupted / missing chunk                    -> INTERNAL

Cancelling the caller's task cancels the call, which the prefill side sees as "decode gone".
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.common.api import DisaggParams, FailureCode
from deepseek_pd.workers.common.bootstrap_protocol import PROTOCOL_VERSION, code_from_pb, target
from deepseek_pd.workers.common.kv_transfer.base import KVSink, TransferError
from deepseek_pd.workers.common.worker_config import BootstrapConfig

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    # Notice a dead prefill host without traffic, not only a closed socket.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # Our own backoff decides when to retry; do not let the channel sit in a long reconnect wait.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class BootstrapClient:
    """One per decode engine; keeps a channel per prefill bootstrap address."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, params: DisaggParams) -> pb_grpc.BootstrapStub:
        address = target(params.bootstrap_host, params.bootstrap_port)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        return pb_grpc.BootstrapStub(channel)

    async def transfer(self, params: DisaggParams, handshake: pb.Handshake, sink: KVSink) -> pb.TransferDone:
        handshake.protocol_version = PROTOCOL_VERSION
        handshake.room = params.bootstrap_room
        deadline = time.monotonic() + self.config.transfer_timeout_s
        call, window = await self._connect(params, handshake, deadline)
        finished = False
        try:
            done = await self._follow(call, window, sink, deadline, params)
            finished = True
            return done
        finally:
            if not finished:
                call.cancel()

    async def _connect(self, params: DisaggParams, handshake: pb.Handshake, deadline: float):
        stub = self._stub(params)
        address = target(params.bootstrap_host, params.bootstrap_port)
        give_up = min(deadline, time.monotonic() + self.config.handshake_timeout_s)
        backoff = self.config.retry_initial_s
        last_error = "no attempt"
        while True:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise TransferError(FailureCode.UNAVAILABLE,
                                    f"prefill bootstrap {address} unreachable for "
                                    f"{self.config.handshake_timeout_s}s: {last_error}")
            call = stub.Transfer(timeout=max(deadline - time.monotonic(), 0.001))
            try:
                await asyncio.wait_for(call.write(pb.DecodeMessage(handshake=handshake)), remaining)
                first = await asyncio.wait_for(call.read(), max(give_up - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                call.cancel()
                last_error = "no handshake answer"
                continue
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    last_error = exc.details() or "unavailable"
                    await asyncio.sleep(min(backoff, max(give_up - time.monotonic(), 0)))
                    backoff = min(backoff * 2, self.config.retry_max_s)
                    continue
                raise TransferError(_code_of(exc), f"bootstrap {address} refused room "
                                    f"{params.bootstrap_room}: {exc.details()}") from None
            if first is grpc.aio.EOF or first.WhichOneof("event") != "accepted" or first.seq != 0:
                call.cancel()
                raise TransferError(FailureCode.INTERNAL, f"bootstrap {address} answered the handshake "
                                    f"with {first!r} instead of an acknowledgement")
            if first.accepted.protocol_version != PROTOCOL_VERSION:
                call.cancel()
                raise TransferError(FailureCode.INTERNAL, f"prefill speaks bootstrap protocol "
                                    f"{first.accepted.protocol_version}, decode {PROTOCOL_VERSION}")
            return call, max(1, first.accepted.credit_window)

    async def _follow(self, call, window: int, sink: KVSink, deadline: float,
                      params: DisaggParams) -> pb.TransferDone:
        expected_seq = 1
        credited = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                    f"KV transfer for room {params.bootstrap_room} not done within "
                                    f"{self.config.transfer_timeout_s}s")
            try:
                event = await asyncio.wait_for(call.read(), remaining)
            except asyncio.TimeoutError:
                continue  # the loop's deadline check reports it
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                raise TransferError(FailureCode.UNAVAILABLE,
                                    f"prefill bootstrap stream of room {params.bootstrap_room} broke: "
                                    f"{exc.code().name} {exc.details()}", peer_knows=True) from None
            if event is grpc.aio.EOF:
                raise TransferError(FailureCode.UNAVAILABLE, f"prefill closed the stream of room "
                                    f"{params.bootstrap_room} without a status", peer_knows=True)
            if event.seq != expected_seq:
                raise TransferError(FailureCode.INTERNAL,
                                    f"bootstrap event {event.seq} arrived, expected {expected_seq} (lost event)")
            expected_seq += 1
            kind = event.WhichOneof("event")
            if kind == "chunk":
                # crc32 and the copy into the pool run off the loop: other requests keep streaming.
                write = asyncio.ensure_future(asyncio.to_thread(sink.on_chunk, event.chunk))
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    await asyncio.wait({write})  # the copy must end before the pages can be freed
                    raise
                if event.seq - credited >= max(1, window // 2):
                    credited = event.seq
                    try:
                        await call.write(pb.DecodeMessage(credit=pb.Credit(received_seq=credited)))
                    except grpc.aio.AioRpcError:
                        pass  # the stream is broken; the next read reports it
            elif kind == "done":
                sink.check_complete(event.done)  # raising here cancels the call: prefill learns it
                await _confirm_and_close(call, event.seq)
                return event.done
            elif kind == "failed":
                await _half_close(call)
                raise TransferError(code_from_pb(event.failed.code), f"prefill: {event.failed.reason}",
                                    peer_knows=True)
            else:
                raise TransferError(FailureCode.INTERNAL, f"unexpected bootstrap event {kind!r}")

    async def abort(self, params: DisaggParams, reason: str, timeout_s: float = 1.0) -> None:
        """Best effort: tells the prefill side to drop the room (cancelling the stream also does)."""
        try:
            await self._stub(params).Abort(pb.AbortRoom(room=params.bootstrap_room, reason=reason),
                                           timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("abort of room %d not delivered: %s", params.bootstrap_room, exc.code().name)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


async def _half_close(call) -> None:
    """Tells the prefill side we hold its last event, so it can end the call cleanly."""
    try:
        await call.done_writing()
    except (grpc.aio.AioRpcError, grpc.aio.UsageError):
        pass


async def _confirm_and_close(call, seq: int) -> None:
    """Credits the TransferDone itself: the prefill side's proof that decode accepted all KV."""
    try:
        await call.write(pb.DecodeMessage(credit=pb.Credit(received_seq=seq)))
    except (grpc.aio.AioRpcError, grpc.aio.UsageError):
        pass
    await _half_close(call)


def _code_of(exc: grpc.aio.AioRpcError) -> FailureCode:
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return FailureCode.DEADLINE_EXCEEDED
    if exc.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.INVALID_ARGUMENT):
        return FailureCode.INVALID_ARGUMENT  # e.g. a bootstrap room used twice
    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return FailureCode.INTERNAL  # protocol version mismatch: a deployment error
    return FailureCode.UNAVAILABLE
