"""The decode worker's side of the bootstrap channel: handshake, then follow the room's events.

`transfer()` opens `Bootstrap.Transfer` on the prefill worker named by the router's
`DisaggParams`, sends the handshake, retrying with exponential backoff while the server is
unreachable (the prefill worker may still be starting) until `handshake_timeout_s`; then it
reads the room's events in order (sequence numbers checked) and hands KV chunks to the sink's
worker threads: the event loop, which also runs the decode scheduler, only parses the chunk
header (`wire.decode_event`, no copy of the KV) while the checks and the pool writes run beside
it, several chunks at once. Credit for more is granted every half window, for chunks already
written (so memory stays bounded by the window). With parallel KV streams (the ack's
`kv_streams` > 1) it also opens the room's extra streams, each on its own connection
(decode/kv_streams.py). It returns the `TransferDone` (after every chunk of every stream is
written) or raises a `RequestFailure` (workers/engine/request_failure.py):

    unreachable for handshake_timeout_s          -> UNAVAILABLE
    no TransferDone within transfer_timeout_s    -> DEADLINE_EXCEEDED
    stream broken (prefill died)                 -> UNAVAILABLE
    TransferFailed from prefill                  -> its code (ABORTED: a RequestAborted)
    corrupted / missing chunk                    -> INTERNAL
    ack or done without a valid token            -> INTERNAL (not the deployment's prefill worker)
    address not a registered prefill worker      -> INVALID_ARGUMENT, before any connection

Just before a handshake goes out, the sink's `exposure.handed_out()` records that the peer may know
the pages (kv_transfer/exposure.py): a one-sided peer may write them from then on, so a transfer
that fails later has its pages zeroed, while one refused before (an unregistered address, no
route) frees them untouched.

Every handshake and abort is signed with the deployment secret, and the prefill side's ack and
done must answer this stream's handshake (workers/transport/internal_auth.py).

A multi-rank prefill group keeps a room's KV on its DP rank `room % dp`: the handshake goes to that
rank's own bootstrap endpoint, learnt from the named address's signed route table (prefill_routes.py).

Cancelling the caller's task cancels the call, which the prefill side sees as "decode gone".
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.transfer_limits import MAX_CHUNK_BYTES
from deepseek_pd.workers.engine.interface import DisaggParams, FailureCode
from deepseek_pd.workers.transport.bootstrap_protocol import (
    MESSAGE_ENVELOPE_BYTES, code_from_pb, handshake_version, target, version_refusal_hint)
from deepseek_pd.workers.transport import kv_cipher, kv_mac
from deepseek_pd.workers.transport.internal_auth import AuthError
from deepseek_pd.workers.transport.base import KVSink
from deepseek_pd.workers.transport.wire import decode_event
from deepseek_pd.workers.engine.request_failure import (
    RequestAborted, RequestFailure, TransferError, failure_for)
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.decode.chunk_ingest import ChunkIngest
from deepseek_pd.workers.decode.kv_streams import KVStreamReader
from deepseek_pd.workers.decode.prefill_peers import PrefillPeers
from deepseek_pd.workers.decode.prefill_routes import PrefillRoutes, RouteUnavailable

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + MESSAGE_ENVELOPE_BYTES),
    # Notice a dead prefill host without traffic, not only a closed socket.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # Our own backoff decides when to retry; do not let the channel sit in a long reconnect wait.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _BootstrapStub:
    """The generated stub's two calls, with Transfer's events parsed by `wire.decode_event`."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.Transfer = channel.stream_stream(
            "/deepseek_pd.pd.v1.Bootstrap/Transfer", request_serializer=pb.DecodeMessage.SerializeToString,
            response_deserializer=decode_event)
        self.KVStream = channel.stream_stream(
            "/deepseek_pd.pd.v1.Bootstrap/KVStream", request_serializer=pb.KVStreamMessage.SerializeToString,
            response_deserializer=decode_event)
        self.Abort = channel.unary_unary(
            "/deepseek_pd.pd.v1.Bootstrap/Abort", request_serializer=pb.AbortRoom.SerializeToString,
            response_deserializer=pb.AbortAck.FromString)


class BootstrapClient:
    """One per decode engine; keeps a channel per prefill bootstrap address."""

    def __init__(self, config: BootstrapConfig, identity: str = "decode") -> None:
        """`identity`: this worker's name in the tokens it signs (e.g. "decode@10.0.0.7")."""
        self.config = config
        self.identity = identity
        self.peers = PrefillPeers(config.prefill_peers)
        self.routes = PrefillRoutes(config.auth, identity)
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}

    def _channel(self, host: str, port: int, stream: int = 0) -> grpc.aio.Channel:
        """Stream 0 (Transfer, Abort, Route) shares one connection per prefill endpoint; extra KV
        stream i gets a connection of its own, reused by the next room's stream i."""
        address = target(host, port)
        channel = self._channels.get((address, stream))
        if channel is None:
            # A channel of its own subchannel pool opens its own connection.
            options = _CHANNEL_OPTIONS + ([("grpc.use_local_subchannel_pool", 1)] if stream else [])
            channel = self._channels[(address, stream)] = grpc.aio.insecure_channel(address, options=options)
        return channel

    def _stub(self, params: DisaggParams) -> _BootstrapStub:
        """The stub of the address `params` name itself (not routed to a rank)."""
        return _BootstrapStub(self._channel(params.bootstrap_host, params.bootstrap_port))

    async def transfer(self, params: DisaggParams, handshake: pb.Handshake, sink: KVSink) -> pb.TransferDone:
        handshake.protocol_version = handshake_version(handshake)
        handshake.room = params.bootstrap_room
        await self.peers.check(params.bootstrap_host, params.bootstrap_port)  # before any connection
        deadline = time.monotonic() + self.config.transfer_timeout_s
        call, ack, endpoint = await self._connect(params, handshake, sink, deadline)
        window = max(1, ack.credit_window)
        finished = False
        readers: list[KVStreamReader] = []
        try:
            # The accepted handshake's nonce keys the KV MAC, the ack names it: the sink may check
            # each chunk as it lands.
            sink.begin_check(self.config.auth.kv_key(params.bootstrap_room, handshake.auth.nonce),
                             params.bootstrap_room, self._mac_agreed(handshake, ack, sink))
            sink.accept_answer(ack)
            self._begin_cipher(params.bootstrap_room, handshake, ack, sink)
            await self._open_kv_streams(params, endpoint, handshake, ack, sink, window, deadline, readers)
            done = await self._follow(call, window, sink, deadline, params, handshake.auth.nonce, readers)
            finished = True
            return done
        finally:
            if not finished:
                call.cancel()
                sink.fail(TransferError(FailureCode.UNAVAILABLE, f"transfer of room {params.bootstrap_room} failed"))
            for reader in readers:  # the pages may be freed only once no write into them runs
                await reader.close(cancel=not finished)

    async def _open_kv_streams(self, params: DisaggParams, endpoint: tuple[str, int], handshake: pb.Handshake,
                               ack: pb.HandshakeAck, sink: KVSink, window: int, deadline: float,
                               readers: list[KVStreamReader]) -> None:
        """Opens the room's extra KV streams 1 .. kv_streams-1 to the prefill rank that accepted the
        handshake (`endpoint`), appended to `readers` as they open."""
        count = max(1, ack.kv_streams)
        offered = max(1, handshake.grpc.streams) if handshake.WhichOneof("destination") == "grpc" else 1
        if count > offered:
            raise TransferError(FailureCode.INTERNAL, f"prefill announced {count} KV streams for room "
                                f"{params.bootstrap_room}, decode offered {offered}")
        address = target(*endpoint)
        for index in range(1, count):
            call = _BootstrapStub(self._channel(*endpoint, stream=index)).KVStream(timeout=max(deadline - time.monotonic(), 0.001))
            opening = pb.KVStreamOpen(room=params.bootstrap_room, index=index)
            self.config.auth.sign(opening, "kvstream", self.identity, address,
                                  f"room={params.bootstrap_room};index={index}", handshake.auth.nonce)
            readers.append(KVStreamReader(call, index, sink, window, params.bootstrap_room))
            try:
                await call.write(pb.KVStreamMessage(open=opening))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                raise TransferError(FailureCode.UNAVAILABLE, f"KV stream {index} of room "
                                    f"{params.bootstrap_room} could not be opened: {exc!r}") from None

    @staticmethod
    def _mac_agreed(handshake: pb.Handshake, ack: pb.HandshakeAck, sink: KVSink) -> str:
        """The KV MAC the (signed) ack names, one this side offered (transport/kv_mac.py; "" when it
        offered none); raises TransferError for one it did not offer."""
        try:
            return kv_mac.agreed(handshake.mooncake.kv_mac_algorithms, ack.kv_mac)
        except ValueError as exc:
            raise sink.fail(TransferError(FailureCode.INVALID_ARGUMENT, str(exc))) from None

    def _begin_cipher(self, room: int, handshake: pb.Handshake, ack: pb.HandshakeAck, sink: KVSink) -> None:
        """The KV cipher the (signed) ack names, one this side offered: the sink decrypts with it
        as the KV lands (transport/kv_cipher.py); raises TransferError for one it did not offer."""
        try:
            cipher = kv_cipher.agreed(handshake.mooncake.kv_cipher_algorithms, ack.kv_cipher, self.config.auth.enabled)
            key = self.config.auth.kv_cipher_key(room, handshake.auth.nonce) if cipher else None
            if cipher and key is None:
                raise ValueError(f"the prefill worker encrypts KV with {cipher!r}, and this worker has no secret")
        except ValueError as exc:
            raise sink.fail(TransferError(FailureCode.INVALID_ARGUMENT, str(exc))) from None
        if cipher:
            sink.begin_cipher(cipher, key)

    async def _connect(self, params: DisaggParams, handshake: pb.Handshake, sink: KVSink, deadline: float):
        origin = (params.bootstrap_host, params.bootstrap_port)
        address = target(*origin)
        give_up = min(deadline, time.monotonic() + self.config.handshake_timeout_s)
        backoff = self.config.retry_initial_s
        last_error = "no attempt"
        while True:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise TransferError(FailureCode.UNAVAILABLE,
                                    f"prefill bootstrap {address} unreachable for "
                                    f"{self.config.handshake_timeout_s}s: {last_error}")
            try:  # the prefill rank that holds this room (the named address itself for one rank)
                route = await self.routes.route(self._channel(*origin), *origin, params.bootstrap_room)
            except RouteUnavailable as exc:
                last_error = f"route table: {exc}"
                await asyncio.sleep(min(backoff, max(give_up - time.monotonic(), 0)))
                backoff = min(backoff * 2, self.config.retry_max_s)
                continue
            endpoint = route.address
            address = target(*endpoint)
            # The ranks this room goes between: the prefill rank refuses one that is not its own.
            handshake.prefill_dp_rank, handshake.prefill_dp_size = route.dp_rank, route.dp_size
            handshake.decode_dp_rank = self.config.dp_rank
            call = _BootstrapStub(self._channel(*endpoint)).Transfer(timeout=max(deadline - time.monotonic(), 0.001))
            # A fresh token per attempt: the prefill side refuses a nonce it has seen.
            self.config.auth.sign(handshake, "handshake", self.identity, address)
            # From here the peer may know the pages (a write that fails may still have gone out).
            sink.exposure.handed_out()
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
                    if endpoint != origin:  # the group may have restarted with other rank endpoints
                        self.routes.invalidate(*origin)
                    await asyncio.sleep(min(backoff, max(give_up - time.monotonic(), 0)))
                    backoff = min(backoff * 2, self.config.retry_max_s)
                    continue
                hint = version_refusal_hint(handshake) if "protocol version" in (exc.details() or "") else ""
                raise TransferError(_code_of(exc), f"bootstrap {address} refused room "
                                    f"{params.bootstrap_room}: {exc.details()}{hint}") from None
            if first is grpc.aio.EOF or first.WhichOneof("event") != "accepted" or first.seq != 0:
                call.cancel()
                raise TransferError(FailureCode.INTERNAL, f"bootstrap {address} answered the handshake "
                                    f"with {first!r} instead of an acknowledgement")
            if first.accepted.protocol_version != handshake.protocol_version:
                call.cancel()
                raise TransferError(FailureCode.INTERNAL, f"prefill speaks bootstrap protocol "
                                    f"{first.accepted.protocol_version}, decode {handshake.protocol_version}")
            try:
                self.config.auth.verify(first.accepted, "ack", f"room={handshake.room}", handshake.auth.nonce)
            except AuthError as exc:
                call.cancel()
                raise TransferError(FailureCode.INTERNAL, f"bootstrap {address} is not this deployment's "
                                    f"prefill worker: {exc}") from None
            return call, first.accepted, endpoint

    async def _follow(self, call, window: int, sink: KVSink, deadline: float, params: DisaggParams,
                      challenge: bytes, readers: list[KVStreamReader]) -> pb.TransferDone:
        ingest = ChunkIngest(sink, call, window)
        read: asyncio.Future | None = None
        expected_seq = 1
        succeeded = False
        try:
            while True:
                await ingest.credit_written()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                        f"KV transfer for room {params.bootstrap_room} not done within "
                                        f"{self.config.transfer_timeout_s}s")
                if read is None:
                    read = asyncio.ensure_future(call.read())
                # Wake for the next event, or for the oldest chunk's write (its credit may be what
                # the prefill side waits for), or for an extra KV stream's end, or for the deadline.
                streams = {reader.task for reader in readers if not reader.task.done()}
                await asyncio.wait({read} | ingest.oldest() | streams, timeout=remaining,
                                   return_when=asyncio.FIRST_COMPLETED)
                for reader in readers:
                    if (error := reader.failure()) is not None:
                        raise sink.fail(error)
                if not read.done():
                    continue
                finished, read = read, None
                try:
                    event = finished.result()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        continue  # the loop's deadline check reports it
                    raise TransferError(FailureCode.UNAVAILABLE,
                                        f"prefill bootstrap stream of room {params.bootstrap_room} broke: "
                                        f"{exc.code().name} {exc.details()}", peer_knows=True) from None
                if event is grpc.aio.EOF:
                    raise TransferError(FailureCode.UNAVAILABLE, f"prefill closed the stream of room "
                                        f"{params.bootstrap_room} without a status", peer_knows=True)
                if event.seq != expected_seq:
                    raise sink.fail(TransferError(FailureCode.INTERNAL, f"bootstrap event {event.seq} arrived, "
                                                  f"expected {expected_seq} (lost event)"))
                expected_seq += 1
                kind = event.WhichOneof("event")
                if kind == "chunk":
                    ingest.start(event.seq, event.chunk)
                elif kind == "done":
                    try:
                        self.config.auth.verify(event.done, "done", f"room={params.bootstrap_room};seq={event.seq}",
                                                challenge)
                    except AuthError as exc:
                        raise sink.fail(TransferError(FailureCode.INTERNAL, f"TransferDone of room "
                                                      f"{params.bootstrap_room} refused: {exc}")) from None
                    expected = list(event.done.stream_chunks)
                    if len(expected) != len(readers):
                        raise sink.fail(TransferError(FailureCode.INTERNAL, f"TransferDone of room "
                                                      f"{params.bootstrap_room} counts {len(expected)} extra KV "
                                                      f"streams, {len(readers)} are open"))
                    for reader, count in zip(readers, expected):
                        try:
                            await reader.finish(count, deadline)
                        except RequestFailure as exc:
                            raise sink.fail(exc) from None
                    await ingest.drain()  # every chunk written before the completeness check
                    sink.check_complete(event.done)  # raising here cancels the call: prefill learns it
                    await _confirm_and_close(call, event.seq)
                    succeeded = True
                    return event.done
                elif kind == "failed":
                    await _half_close(call)
                    raise sink.fail(failure_for(code_from_pb(event.failed.code),
                                                f"prefill: {event.failed.reason}", peer_knows=True))
                else:
                    raise sink.fail(TransferError(FailureCode.INTERNAL, f"unexpected bootstrap event {kind!r}"))
        finally:
            if read is not None:
                read.cancel()
            if not succeeded:
                sink.fail(RequestAborted(f"transfer of room {params.bootstrap_room} ended"))
            await ingest.settle()  # the pages may be freed only once no write into them is running

    async def abort(self, params: DisaggParams, reason: str, timeout_s: float = 1.0) -> None:
        """Best effort: tells the prefill side to drop the room (cancelling the stream also does)."""
        try:
            await self.peers.check(params.bootstrap_host, params.bootstrap_port)
        except TransferError:
            return  # never a connection to an address that is not a registered prefill worker
        origin = (params.bootstrap_host, params.bootstrap_port)
        route = self.routes.cached(*origin, params.bootstrap_room, any_age=True)
        endpoint = route.address if route is not None else origin  # the room's rank, if known
        message = pb.AbortRoom(room=params.bootstrap_room, reason=reason)
        self.config.auth.sign(message, "abort", self.identity, target(*endpoint))
        try:
            await _BootstrapStub(self._channel(*endpoint)).Abort(message, timeout=timeout_s)
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
    if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
                      grpc.StatusCode.PERMISSION_DENIED):
        return FailureCode.INTERNAL  # protocol version or secret mismatch: a deployment error
    return FailureCode.UNAVAILABLE
