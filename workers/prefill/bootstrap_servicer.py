"""The `Bootstrap` service on the prefill worker: one `Transfer` stream per decode handshake.

The stream's way: the decode side's Handshake attaches to its room and is acknowledged at once
(seq 0); the stream then waits for the prefill request to claim the room (else a TransferFailed
after `claim_timeout_s`), and forwards the room's events in order: KV chunks (grpc transport),
each only within the decode side's credit window, then one terminal event. A failure overtakes
queued chunks. The decode side's Credit for the TransferDone's seq, then its half-close, is its
confirmation; anything else (cancel, broken connection, no confirmation) fails the room.

Parallel KV streams (grpc): the ack says how many the room uses (`kv_stream_count` of decode's
offer and this worker's `grpc_streams`); each extra one arrives as a `KVStream` call that names
the room and its index, signed and bound to the handshake's nonce. It forwards that stream's
queue (its own seqs and credits) up to the end marker `Room.finish` puts there, then waits for
decode's half-close; a KV stream that ends any other way fails the room.

Authentication (workers/transport/internal_auth.py): a Handshake, KVStreamOpen, AbortRoom or
RouteRequest without a valid token of the deployment secret, addressed to this worker, fresh and
never seen before, is refused with UNAUTHENTICATED before any room is looked up, so a peer without
the secret can neither read a room's KV nor abort it, nor learn whether a room exists. The ack and the TransferDone are signed back, bound to the handshake's nonce.

DP ranks (workers/transport/bootstrap_routes.py): the handshake of a room that belongs to another DP
rank of this group is refused at once with FAILED_PRECONDITION, naming both ranks.

Metrics: every refusal above, and a room's claim timeout, counts once in
`bootstrap_handshake_failures_total{reason}` (metrics.HANDSHAKE_FAILURE_REASONS), so an attack or a
misconfigured peer shows on the prefill side too, not only in the decode side's transfer failures.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

import grpc

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.bootstrap_protocol import (
    ACCEPTED_VERSIONS, PROTOCOL_VERSION, code_to_pb, handshake_version, kv_stream_count)
from deepseek_pd.workers.transport import kv_cipher, kv_mac
from deepseek_pd.workers.transport.bootstrap_routes import RouteTable, misroute_reason
from deepseek_pd.workers.transport.internal_auth import AuthError, ReplayGuard
from deepseek_pd.workers.transport.wire import EncodedChunk
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.prefill.room import Room
from deepseek_pd.workers.prefill.room_registry import RoomRegistry

log = logging.getLogger(__name__)

class BootstrapServicer(pb_grpc.BootstrapServicer):
    def __init__(self, registry: RoomRegistry, hosts: tuple[str, ...] = (), kv_streams: int = 1,
                 metrics: WorkerMetrics | None = None,
                 answer: Callable[[pb.Handshake, pb.HandshakeAck], None] | None = None) -> None:
        """`hosts`: the addresses peers may dial this worker at (tokens must be addressed to one of
        them and to `port`, set once the server is bound); empty: any host, the port still counts.
        `kv_streams`: the most parallel KV streams a room may use (TransportConfig.grpc_streams).
        `metrics` counts the refused and failed handshakes (the engine's own). `answer`: the KV
        sender's part of each ack (`KVSender.answer_handshake`), before it is signed."""
        self.registry = registry
        self.answer = answer
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        self.kv_streams = kv_streams
        self.auth = registry.config.auth
        self.hosts = {host.lower() for host in hosts}
        self.port = 0
        self.guard = ReplayGuard(self.auth.max_skew_s)
        # A group's rank 0 publishes its DP ranks' endpoints here (None: the group is still forming).
        self.routes: RouteTable | None = RouteTable()

    @property
    def identity(self) -> str:
        return f"prefill@{next(iter(sorted(self.hosts)), '*')}:{self.port}"

    def _check(self, message, purpose: str, context: str = "", challenge: bytes | None = None) -> pb.AuthToken:
        """The message's token is valid and meant for this worker; raises AuthError."""
        token = self.auth.verify(message, purpose, context, challenge, guard=self.guard)
        if self.auth.enabled:
            host, _, port = token.receiver.rpartition(":")
            host = host.removeprefix("[").removesuffix("]").lower()
            if port != str(self.port) or (self.hosts and host not in self.hosts):
                raise AuthError(f"{purpose} is addressed to {token.receiver}, not to this prefill worker "
                                f"({self.identity}): replayed, or the router and --advertise-host disagree")
        return token

    async def Transfer(self, request_iterator: AsyncIterator[pb.DecodeMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent | EncodedChunk]:
        first = await self._first_message(request_iterator, "handshake", context)
        request = first.handshake
        try:
            token = self._check(request, "handshake")
        except AuthError as exc:
            log.warning("refused a bootstrap handshake for room %d from %s: %s", request.room, context.peer(), exc)
            await self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if request.protocol_version not in ACCEPTED_VERSIONS or request.protocol_version != handshake_version(request):
            room = self.registry.get(request.room)
            reason = (f"bootstrap protocol version mismatch: decode speaks {request.protocol_version}, "
                      f"prefill {'/'.join(map(str, ACCEPTED_VERSIONS))} (a pulled mooncake transfer is 3, "
                      f"anything else {PROTOCOL_VERSION})")
            if room is not None:
                room.mark_peer_gone(FailureCode.INTERNAL, reason)
            await self._refuse(context, "protocol", grpc.StatusCode.FAILED_PRECONDITION, reason)
        try:  # with a secret, mooncake KV cells are encrypted with a cipher decode offered (kv_cipher.py)
            cipher = kv_cipher.choose(request.mooncake.kv_cipher_algorithms) if self.auth.enabled else ""
            mac = kv_mac.choose(request.mooncake.kv_mac_algorithms)  # (the channel's pick: one rule)
        except ValueError as exc:
            room = self.registry.get(request.room)
            if room is not None:
                room.mark_peer_gone(FailureCode.INVALID_ARGUMENT, str(exc))
            await self._refuse(context, "protocol", grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        reason = misroute_reason(request.room, self.registry.config.dp_rank, self.registry.config.dp_size, request)
        if reason is not None:
            log.warning("refused the handshake of room %d from %s: %s", request.room, context.peer(), reason)
            await self._refuse(context, "wrong_dp_rank", grpc.StatusCode.FAILED_PRECONDITION, reason)
        try:
            room = self.registry.attach(request)
        except TransferError as exc:
            await self._refuse(context, "duplicate", grpc.StatusCode.ALREADY_EXISTS, exc.message)
        room.kv_key = self.auth.kv_key(request.room, token.nonce)  # before the engine sees the handshake
        if cipher:
            room.kv_cipher, room.kv_cipher_key = cipher, self.auth.kv_cipher_key(request.room, token.nonce)
        offered = request.grpc.streams if request.WhichOneof("destination") == "grpc" else 1
        room.open_kv_streams(kv_stream_count(offered, self.kv_streams))
        window = self.registry.config.event_queue_depth
        credits = _Credits(room.note_landed, room.note_credited)
        credit_task = asyncio.create_task(credits.follow(request_iterator))
        seq = 0
        delivered_terminal = delivered_done = False
        try:
            ack = pb.HandshakeAck(protocol_version=request.protocol_version, credit_window=window,
                                  kv_streams=room.kv_streams, kv_cipher=room.kv_cipher, kv_mac=mac)
            if self.answer is not None:  # the transport's part (a pulled mooncake transfer: its source)
                self.answer(request, ack)
            self.auth.sign(ack, "ack", self.identity, token.sender, f"room={request.room}", token.nonce)
            yield pb.TransferEvent(seq=seq, accepted=ack)
            try:
                rid = await asyncio.wait_for(asyncio.shield(room.claimed), self.registry.config.claim_timeout_s)
            except asyncio.TimeoutError:
                delivered_terminal = True
                self.metrics.count_handshake_failure("timeout")
                self.registry.drop(room)
                seq += 1
                yield pb.TransferEvent(seq=seq, failed=pb.TransferFailed(
                    code=code_to_pb(FailureCode.DEADLINE_EXCEEDED),
                    reason=f"prefill worker never received the request of room {request.room} "
                           f"within {self.registry.config.claim_timeout_s}s"))
                return
            log.debug("room %d: decode %s met prefill %s", request.room, request.decode_rid, rid)
            while True:
                event = await self._next_event(room)
                seq += 1
                if isinstance(event, EncodedChunk):
                    if event.seq != seq:  # the sender emitted out of its reserved order: a bug
                        room.fail(FailureCode.INTERNAL, f"KV chunk {event.seq} emitted as event {seq}")
                        event = pb.TransferEvent(failed=room.failure.result())
                    elif not await credits.wait_for(seq - window, room):
                        return  # decode went away while we waited for credit
                if room.failure.done():  # a failure overtakes whatever was queued
                    event = pb.TransferEvent(failed=room.failure.result())
                kind = "chunk" if isinstance(event, EncodedChunk) else event.WhichOneof("event")
                if kind != "chunk":
                    event.seq = seq
                if kind == "done":
                    self.auth.sign(event.done, "done", self.identity, token.sender,
                                   f"room={request.room};seq={seq}", token.nonce)
                yield event
                if kind in ("done", "failed"):
                    delivered_terminal = True
                    delivered_done = kind == "done"
                    return
        finally:
            if not delivered_terminal:
                room.mark_peer_gone(FailureCode.UNAVAILABLE,
                                    f"decode side closed the transfer stream of room {request.room}")
            if (room.tombstone and delivered_terminal) or not (room.tombstone or room.claimed.done()):
                self.registry.drop(room)  # else: a tombstone waiting for a late prefill request
            confirmed = False
            try:
                if delivered_terminal:
                    # Returning (or cancelling the pending read of the request stream) before the
                    # decode side half-closes can make gRPC core fail the call with INTERNAL
                    # before the terminal event is flushed: wait for its half-close. The
                    # half-close is also decode's confirmation that it accepted everything.
                    await asyncio.wait({credit_task}, timeout=self.registry.config.confirm_timeout_s)
                    # Decode credits the terminal event's seq only after accepting it.
                    confirmed = delivered_done and credits.received_seq >= seq
            finally:  # also when the call is cancelled during the wait above
                if delivered_done and not confirmed:
                    room.mark_peer_gone(FailureCode.UNAVAILABLE, f"decode side of room {request.room} did "
                                        "not confirm the transfer (it rejected the KV or went away)")
                if not room.delivered.done():
                    room.delivered.set_result(confirmed)
                credit_task.cancel()

    @staticmethod
    async def _next_event(room: Room) -> pb.TransferEvent | EncodedChunk:
        if not room.events.empty() and not room.failure.done():
            return room.events.get_nowait()
        get = asyncio.ensure_future(room.events.get())
        try:
            await asyncio.wait({get, room.failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if room.failure.done():
            return pb.TransferEvent(failed=room.failure.result())
        return get.result()

    async def KVStream(self, request_iterator: AsyncIterator[pb.KVStreamMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[EncodedChunk]:
        """One extra KV stream of a room (see the module doc)."""
        opening = (await self._first_message(request_iterator, "open", context)).open
        # The token before the room: an unauthenticated caller must not learn whether a room exists.
        try:
            token = self._check(opening, "kvstream", f"room={opening.room};index={opening.index}")
            room = self.registry.get(opening.room)
            if room is not None and room.handshake.done():
                self.auth.check_challenge(token, room.handshake.result().auth.nonce, "kvstream")
        except AuthError as exc:
            log.warning("refused KV stream %d of room %d from %s: %s", opening.index, opening.room,
                        context.peer(), exc)
            await self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if room is None or not room.handshake.done():
            await self._refuse(context, "unknown_room", grpc.StatusCode.FAILED_PRECONDITION,
                               f"KV stream {opening.index} for room {opening.room}, which has no handshake")
        if not 1 <= opening.index < room.kv_streams or room.stream_attached[opening.index - 1]:
            await self._refuse(context, "protocol", grpc.StatusCode.INVALID_ARGUMENT,
                               f"room {opening.room} has KV streams 1..{room.kv_streams - 1}, and "
                               f"{opening.index} is not one of them or is already open")
        index = opening.index
        room.stream_attached[index - 1] = True
        queue = room.stream_events[index - 1]
        window = self.registry.config.event_queue_depth
        credits = _Credits()
        credit_task = asyncio.create_task(credits.follow(request_iterator))
        seq, clean = 0, False
        try:
            while True:
                try:
                    chunk = await _next_chunk(queue, room, credit_task)
                except _StreamClosed:
                    break
                if chunk is None:  # the end marker, or the room failed (its Transfer stream tells)
                    clean = True
                    break
                seq += 1
                if chunk.seq != seq:
                    room.fail(FailureCode.INTERNAL, f"KV chunk {chunk.seq} emitted as event {seq} of stream {index}")
                    clean = True
                    break
                if not await credits.wait_for(seq - window, room):
                    break  # decode went away while we waited for credit
                if room.failure.done():
                    clean = True
                    break
                yield chunk
            if clean and not room.failure.done():
                # As on the Transfer stream: end only after decode's half-close, or gRPC core may
                # fail the call before the last chunk is flushed.
                await asyncio.wait({credit_task}, timeout=self.registry.config.confirm_timeout_s)
        finally:
            if not clean:
                room.mark_peer_gone(FailureCode.UNAVAILABLE,
                                    f"decode side closed KV stream {index} of room {opening.room}")
            credit_task.cancel()

    async def Abort(self, request: pb.AbortRoom, context: grpc.aio.ServicerContext) -> pb.AbortAck:
        try:
            self._check(request, "abort")
        except AuthError as exc:
            log.warning("refused an abort of room %d from %s: %s", request.room, context.peer(), exc)
            await self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return pb.AbortAck(found=self.registry.abort(request.room, request.reason))

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteReply:
        """This group's DP ranks' bootstrap endpoints (one rank: only this one), signed back."""
        try:
            token = self._check(request, "route")
        except AuthError as exc:
            log.warning("refused a route request from %s: %s", context.peer(), exc)
            await self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if self.routes is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill group is still forming")
        reply = self.routes.to_proto()
        self.auth.sign(reply, "route", self.identity, token.sender, challenge=token.nonce)
        return reply

    async def _refuse(self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode,
                      message: str) -> None:
        """Counts the refusal under `reason` (metrics.HANDSHAKE_FAILURE_REASONS) and ends the call."""
        self.metrics.count_handshake_failure(reason)
        await context.abort(code, message)

    async def _first_message(self, requests: AsyncIterator, kind: str, context: grpc.aio.ServicerContext):
        """The call's first message, which must be a `kind` ("handshake" | "open"); else the call is
        refused: "timeout" if nothing came within handshake_timeout_s, "protocol" otherwise."""
        what = "Transfer message must be a Handshake" if kind == "handshake" else "KVStream message must be a KVStreamOpen"
        timeout_s = self.registry.config.handshake_timeout_s
        try:
            first = await asyncio.wait_for(requests.__anext__(), timeout_s)
        except asyncio.TimeoutError:
            await self._refuse(context, "timeout", grpc.StatusCode.INVALID_ARGUMENT,
                               f"the first {what}; none came within {timeout_s}s")
        except StopAsyncIteration:
            first = None
        if first is None or first.WhichOneof("message") != kind:
            await self._refuse(context, "protocol", grpc.StatusCode.INVALID_ARGUMENT, f"the first {what}")
        return first


async def _next_chunk(queue: asyncio.Queue, room: Room, credit_task: asyncio.Task) -> EncodedChunk | None:
    """The next chunk of an extra KV stream; None at its end marker or once the room failed (or
    decode left it); raises _StreamClosed when decode ended this stream (its credits) first."""
    if not queue.empty() and not room.failure.done():
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait({get, room.failure, room.peer_gone, credit_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled() and not room.failure.done():
        return get.result()
    if room.failure.done() or room.peer_gone.done():
        return None
    raise _StreamClosed


class _StreamClosed(Exception):
    """The decode side ended an extra KV stream before its end marker."""


class _Credits:
    """The highest event seq the decode side has confirmed, fed by its Credit messages."""

    def __init__(self, on_landed: Callable[[int], None] | None = None,
                 on_credit: Callable[[int], None] | None = None) -> None:
        self.on_landed = on_landed  # the Transfer stream: Mooncake windows' landed pages go to the room
        self.on_credit = on_credit  # ... and its credits (pulled mooncake chunks free their slots)
        self.received_seq = 0
        self.changed = asyncio.Event()
        self.closed = False

    async def follow(self, requests: AsyncIterator[pb.DecodeMessage]) -> None:
        try:
            async for message in requests:
                if message.WhichOneof("message") == "credit":
                    self.received_seq = max(self.received_seq, message.credit.received_seq)
                    if self.on_landed is not None:
                        self.on_landed(message.credit.landed_pages)
                    if self.on_credit is not None:
                        self.on_credit(self.received_seq)
                    self.changed.set()
        except (grpc.aio.AioRpcError, asyncio.CancelledError, grpc.aio.UsageError):
            pass
        finally:
            self.closed = True
            self.changed.set()

    async def wait_for(self, seq: int, room: Room) -> bool:
        """Waits until events up to `seq` are confirmed; False if the decode side went away."""
        while self.received_seq < seq:
            if room.peer_gone.done() or room.failure.done():
                return not room.peer_gone.done()
            self.changed.clear()
            waiter = asyncio.ensure_future(self.changed.wait())
            await asyncio.wait({waiter, room.peer_gone, room.failure}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if self.closed and self.received_seq < seq:
                return False
        return True
