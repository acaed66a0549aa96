"""The `Bootstrap` service on the prefill worker: one `Transfer` stream per decode handshake.

The stream's way: the decode side's Handshake attaches to its room and is acknowledged at once
(seq 0); the stream then waits for the prefill request to claim the room (else a TransferFailed
after `claim_timeout_s`), and forwards the room's events in order: KV chunks (grpc transport),
each only within the decode side's credit window, then one terminal event. A failure overtakes
queued chunks. The decode side's Credit for the TransferDone's seq, then its half-close, is its
confirmation; anything else (cancel, broken connection, no confirmation) fails the room.

Authentication (workers/common/internal_auth.py): a Handshake or AbortRoom without a valid token
of the deployment secret, addressed to this worker, fresh and never seen before, is refused with
UNAUTHENTICATED before it touches any room, so a peer without the secret can neither read a room's
KV nor abort it. The ack and the TransferDone are signed back, bound to the handshake's nonce.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.common.api import FailureCode
from deepseek_pd.workers.common.bootstrap_protocol import PROTOCOL_VERSION, code_to_pb
from deepseek_pd.workers.common.bootstrap_routes import RouteTable
from deepseek_pd.workers.common.internal_auth import AuthError, ReplayGuard
from deepseek_pd.workers.common.kv_transfer.base import TransferError
from deepseek_pd.workers.common.kv_transfer.wire import EncodedChunk
from deepseek_pd.workers.prefill.room import Room
from deepseek_pd.workers.prefill.room_registry import RoomRegistry

log = logging.getLogger(__name__)
_HALF_CLOSE_WAIT_S = 2.0

class BootstrapServicer(pb_grpc.BootstrapServicer):
    def __init__(self, registry: RoomRegistry, hosts: tuple[str, ...] = ()) -> None:
        """`hosts`: the addresses peers may dial this worker at (tokens must be addressed to one of
        them and to `port`, set once the server is bound); empty: any host, the port still counts."""
        self.registry = registry
        self.auth = registry.config.auth
        self.hosts = {host.lower() for host in hosts}
        self.port = 0
        self.guard = ReplayGuard(self.auth.max_skew_s)
        # A group's rank 0 publishes its DP ranks' endpoints here (None: the group is still forming).
        self.routes: RouteTable | None = RouteTable()

    @property
    def identity(self) -> str:
        return f"prefill@{next(iter(sorted(self.hosts)), '*')}:{self.port}"

    def _check(self, message, purpose: str) -> pb.AuthToken:
        """The message's token is valid and meant for this worker; raises AuthError."""
        token = self.auth.verify(message, purpose, guard=self.guard)
        if self.auth.enabled:
            host, _, port = token.receiver.rpartition(":")
            host = host.removeprefix("[").removesuffix("]").lower()
            if port != str(self.port) or (self.hosts and host not in self.hosts):
                raise AuthError(f"{purpose} is addressed to {token.receiver}, not to this prefill worker "
                                f"({self.identity}): replayed, or the router and --advertise-host disagree")
        return token

    async def Transfer(self, request_iterator: AsyncIterator[pb.DecodeMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent | EncodedChunk]:
        first = await _first_message(request_iterator, self.registry.config.handshake_timeout_s)
        if first is None or first.WhichOneof("message") != "handshake":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Transfer message must be a Handshake")
        request = first.handshake
        try:
            token = self._check(request, "handshake")
        except AuthError as exc:
            log.warning("refused a bootstrap handshake for room %d from %s: %s", request.room, context.peer(), exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if request.protocol_version != PROTOCOL_VERSION:
            room = self.registry.get(request.room)
            reason = (f"bootstrap protocol version mismatch: decode speaks {request.protocol_version}, "
                      f"prefill {PROTOCOL_VERSION}")
            if room is not None:
                room.mark_peer_gone(FailureCode.INTERNAL, reason)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        try:
            room = self.registry.attach(request)
        except TransferError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, exc.message)
        window = self.registry.config.event_queue_depth
        credits = _Credits()
        credit_task = asyncio.create_task(credits.follow(request_iterator))
        seq = 0
        delivered_terminal = delivered_done = False
        try:
            ack = pb.HandshakeAck(protocol_version=PROTOCOL_VERSION, credit_window=window)
            self.auth.sign(ack, "ack", self.identity, token.sender, f"room={request.room}", token.nonce)
            yield pb.TransferEvent(seq=seq, accepted=ack)
            try:
                rid = await asyncio.wait_for(asyncio.shield(room.claimed), self.registry.config.claim_timeout_s)
            except asyncio.TimeoutError:
                delivered_terminal = True
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
                    # before the terminal event is flushed: wait for its half-close, briefly. The
                    # half-close is also decode's confirmation that it accepted everything.
                    await asyncio.wait({credit_task}, timeout=_HALF_CLOSE_WAIT_S)
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

    async def Abort(self, request: pb.AbortRoom, context: grpc.aio.ServicerContext) -> pb.AbortAck:
        try:
            self._check(request, "abort")
        except AuthError as exc:
            log.warning("refused an abort of room %d from %s: %s", request.room, context.peer(), exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return pb.AbortAck(found=self.registry.abort(request.room, request.reason))

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteReply:
        """This group's DP ranks' bootstrap endpoints (one rank: only this one), signed back."""
        try:
            token = self._check(request, "route")
        except AuthError as exc:
            log.warning("refused a route request from %s: %s", context.peer(), exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if self.routes is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill group is still forming")
        reply = self.routes.to_proto()
        self.auth.sign(reply, "route", self.identity, token.sender, challenge=token.nonce)
        return reply


async def _first_message(requests: AsyncIterator[pb.DecodeMessage], timeout_s: float) -> pb.DecodeMessage | None:
    try:
        return await asyncio.wait_for(requests.__anext__(), timeout_s)
    except (StopAsyncIteration, asyncio.TimeoutError):
        return None


class _Credits:
    """The highest event seq the decode side has confirmed, fed by its Credit messages."""

    def __init__(self) -> None:
        self.received_seq = 0
        self.changed = asyncio.Event()
        self.closed = False

    async def follow(self, requests: AsyncIterator[pb.DecodeMessage]) -> None:
        try:
            async for message in requests:
                if message.WhichOneof("message") == "credit":
                    self.received_seq = max(self.received_seq, message.credit.received_seq)
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
