"""The prefill worker's bootstrap server: one room per PD request, met by both sides.

The router sends Generate to prefill and decode at the same time, so either may arrive first:

- the prefill engine `claim`s the room when its Generate arrives and waits for the handshake;
- the decode side's `Transfer` call `attach`es its handshake and waits for the claim.

Whichever waits too long fails cleanly (prefill: DEADLINE_EXCEEDED for its request; decode: a
TransferFailed on its stream). After both meet, the room's events (KV chunks for the grpc
transport, then TransferDone) flow to decode in order through a bounded queue; a failure
overtakes queued chunks. If the decode side goes away (stream cancelled, connection lost, Abort),
`peer_gone` fires and the prefill engine fails its request with UNAVAILABLE or ABORTED.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from deepseek_pd.errors import UserError
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.common.api import FailureCode
from deepseek_pd.workers.common.bootstrap_protocol import PROTOCOL_VERSION, code_to_pb
from deepseek_pd.workers.common.kv_transfer.base import TransferError
from deepseek_pd.workers.common.worker_config import BootstrapConfig

log = logging.getLogger(__name__)
_HALF_CLOSE_WAIT_S = 2.0


class Room:
    """Meeting point of one request's prefill engine and decode handshake."""

    def __init__(self, room_id: int, queue_depth: int) -> None:
        loop = asyncio.get_running_loop()
        self.room_id = room_id
        self.prefill_rid: str | None = None
        self.handshake: asyncio.Future[pb.Handshake] = loop.create_future()
        self.claimed: asyncio.Future[str] = loop.create_future()
        self.peer_gone: asyncio.Future[tuple[FailureCode, str]] = loop.create_future()
        self.failure: asyncio.Future[pb.TransferFailed] = loop.create_future()
        self.events: asyncio.Queue[pb.TransferEvent] = asyncio.Queue(maxsize=queue_depth)
        # True once the decode side confirmed (a Credit for its seq) that it accepted TransferDone.
        self.delivered: asyncio.Future[bool] = loop.create_future()
        self.finished = False  # a terminal event has been queued
        # Kept after its request ended so the other side's late arrival fails at once; expires.
        self.tombstone = False

    # ---- prefill engine side ----------------------------------------------------------------
    async def wait_handshake(self, timeout_s: float) -> pb.Handshake:
        done, _ = await asyncio.wait({self.handshake, self.peer_gone}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if self.peer_gone in done:
            code, reason = self.peer_gone.result()
            raise TransferError(code, reason)
        if not done:
            raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                f"no decode handshake for bootstrap room {self.room_id} within {timeout_s}s")
        return self.handshake.result()

    async def emit_chunk(self, chunk: pb.KVChunk) -> None:
        """Queues a KV chunk, waiting for room (flow control); raises if decode has gone."""
        await self._put(pb.TransferEvent(chunk=chunk))

    async def finish(self, done: pb.TransferDone, timeout_s: float) -> None:
        """Sends TransferDone after every queued chunk; returns once the decode side confirmed it
        (so success here means decode holds all the KV), raises TransferError otherwise."""
        give_up = asyncio.get_running_loop().time() + timeout_s
        # Bounded too: behind a full queue of a decode side that went silent, this waited forever.
        await self._put(pb.TransferEvent(done=done), timeout_s)
        self.finished = True
        remaining = max(0.0, give_up - asyncio.get_running_loop().time())
        finished, _ = await asyncio.wait({self.delivered, self.peer_gone}, timeout=remaining,
                                         return_when=asyncio.FIRST_COMPLETED)
        if self.delivered in finished and self.delivered.result():
            return
        if self.peer_gone.done():
            raise TransferError(*self.peer_gone.result())
        raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                            f"decode side did not confirm the transfer of room {self.room_id} within {timeout_s}s")

    def fail(self, code: FailureCode, reason: str) -> None:
        """Tells decode the transfer failed; overtakes queued chunks. Idempotent."""
        if not self.failure.done() and not self.finished:
            self.failure.set_result(pb.TransferFailed(code=code_to_pb(code), reason=reason))
        self.finished = True

    async def _put(self, event: pb.TransferEvent, timeout_s: float | None = None) -> None:
        if self.peer_gone.done():
            raise TransferError(*self.peer_gone.result())
        put = asyncio.ensure_future(self.events.put(event))
        await asyncio.wait({put, self.peer_gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            if not self.peer_gone.done():
                raise TransferError(FailureCode.DEADLINE_EXCEEDED, f"decode side of room {self.room_id} "
                                    f"accepted no event within {timeout_s}s")
            raise TransferError(*self.peer_gone.result())

    # ---- decode side (servicer) -------------------------------------------------------------
    def mark_peer_gone(self, code: FailureCode, reason: str) -> None:
        if not self.peer_gone.done():
            self.peer_gone.set_result((code, reason))


class RoomRegistry:
    """Rooms by id; owned by the prefill engine, shared with the bootstrap servicer."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        self._rooms: dict[int, Room] = {}

    def _get_or_create(self, room_id: int) -> Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = Room(room_id, self.config.event_queue_depth)
        return room

    def claim(self, room_id: int, rid: str) -> Room:
        """The prefill engine takes the room for request `rid`; a room serves one request."""
        room = self._get_or_create(room_id)
        if room.claimed.done():
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"bootstrap room {room_id} is already used by request {room.prefill_rid}")
        room.prefill_rid = rid
        room.claimed.set_result(rid)
        return room

    def attach(self, handshake: pb.Handshake) -> Room:
        room = self._get_or_create(handshake.room)
        if room.handshake.done():
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"bootstrap room {handshake.room} already has a decode handshake")
        room.handshake.set_result(handshake)
        return room

    def abort(self, room_id: int, reason: str) -> bool:
        """The decode side gave up on the room. If prefill has not claimed it yet, a tombstone
        stays for `claim_timeout_s` so that a late Generate fails at once instead of waiting."""
        found = room_id in self._rooms
        room = self._get_or_create(room_id)
        room.mark_peer_gone(FailureCode.ABORTED, f"decode side aborted room {room_id}: {reason}")
        if not room.claimed.done():
            self._keep_as_tombstone(room)
        return found

    def release(self, room: Room) -> None:
        """The prefill request is over. If it failed before decode's handshake came, the room
        stays as a tombstone for `claim_timeout_s` so that handshake gets the failure at once."""
        if not room.handshake.done() and room.failure.done() and not room.tombstone:
            self._keep_as_tombstone(room)
        else:
            self.drop(room)

    def drop(self, room: Room) -> None:
        if self._rooms.get(room.room_id) is room:
            del self._rooms[room.room_id]

    def _keep_as_tombstone(self, room: Room) -> None:
        room.tombstone = True
        asyncio.get_running_loop().call_later(self.config.claim_timeout_s, self.drop, room)

    @property
    def num_active(self) -> int:
        """Rooms of requests in progress (tombstones excluded)."""
        return sum(1 for room in self._rooms.values() if not room.tombstone)

    def get(self, room_id: int) -> Room | None:
        return self._rooms.get(room_id)

    def __len__(self) -> int:
        return len(self._rooms)


class BootstrapServicer(pb_grpc.BootstrapServicer):
    def __init__(self, registry: RoomRegistry) -> None:
        self.registry = registry

    async def Transfer(self, request_iterator: AsyncIterator[pb.DecodeMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransferEvent]:
        first = await _first_message(request_iterator, self.registry.config.handshake_timeout_s)
        if first is None or first.WhichOneof("message") != "handshake":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Transfer message must be a Handshake")
        request = first.handshake
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
            yield pb.TransferEvent(seq=seq, accepted=pb.HandshakeAck(
                protocol_version=PROTOCOL_VERSION, credit_window=window))
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
                event.seq = seq
                kind = event.WhichOneof("event")
                if kind == "chunk" and not await credits.wait_for(seq - window, room):
                    return  # decode went away while we waited for credit
                if kind == "failed" or room.failure.done():
                    event = pb.TransferEvent(seq=seq, failed=room.failure.result()) if room.failure.done() else event
                    kind = "failed"
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
    async def _next_event(room: Room) -> pb.TransferEvent:
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
        return pb.AbortAck(found=self.registry.abort(request.room, request.reason))


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


class BootstrapServer:
    """The gRPC server that hosts `BootstrapServicer` on the bootstrap port."""

    def __init__(self, registry: RoomRegistry, config: BootstrapConfig, max_message_bytes: int) -> None:
        self.registry = registry
        self.config = config
        # Chunks are capped at TransportConfig.max_chunk_bytes; leave headroom for the envelope.
        options = [("grpc.max_send_message_length", max_message_bytes + (64 << 10)),
                   ("grpc.max_receive_message_length", 16 << 20),  # a handshake lists every page id
                   ("grpc.so_reuseport", 0)]  # a second worker on this port must fail, not share it
        self.server = grpc.aio.server(options=options)
        pb_grpc.add_BootstrapServicer_to_server(BootstrapServicer(registry), self.server)
        try:  # grpc raises RuntimeError on a busy port (older versions returned 0)
            self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise UserError(f"bootstrap server cannot listen on {config.host}:{config.port} "
                            f"(in use? choose another --bootstrap-port)")

    async def start(self) -> None:
        await self.server.start()
        log.info("bootstrap server listening on %s:%d", self.config.host, self.port)

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.stop(grace_s)
