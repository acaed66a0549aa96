"""One PD request's meeting point on the prefill worker, and the phases its transfer goes through.

The prefill engine and the decode side's `Transfer` stream each hold the same `Room`: the engine
waits on it for the handshake and pushes KV chunks and the TransferDone into it; the servicer
forwards them down the stream and reports the decode side's departure (`peer_gone`) and its
confirmation (`delivered`). With parallel KV streams (grpc, `kv_streams` > 1) each extra stream
has its own queue (`stream_events`); a chunk goes to the queue of its `stream`, and `finish`
closes them (None) and tells decode how many chunks each carried.
"""
from __future__ import annotations

import asyncio
import enum

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.bootstrap_protocol import code_from_pb, code_to_pb
from deepseek_pd.workers.transport.wire import EncodedChunk
from deepseek_pd.workers.engine.request_failure import TransferError, failure_for


class TransferPhase(enum.Enum):
    """Where a room's transfer stands. Every allowed step is in `_NEXT`, nowhere else:

        HANDSHAKE --both sides met--> ACCEPTED --channel open--> STREAMING --TransferDone queued-->
        CONFIRMING --decode confirmed--> DONE;  any phase but DONE --failure--> FAILED

    Example: decode's handshake arrives (HANDSHAKE), then the prefill request claims the room
    (ACCEPTED); the handshake checks out and the transport channel opens (STREAMING); after the
    last page the TransferDone is queued (CONFIRMING) and decode's Credit for it makes it DONE.
    """

    HANDSHAKE = "handshake"  # waiting for the prefill request's claim and/or decode's handshake
    ACCEPTED = "accepted"  # both are here; the prefill side checks the handshake
    STREAMING = "streaming"  # the transport channel is open: KV may flow
    CONFIRMING = "confirming"  # TransferDone queued behind the KV; waiting for decode to confirm it
    DONE = "done"  # decode holds all the KV
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferPhase.DONE, TransferPhase.FAILED)


_NEXT: dict[TransferPhase, frozenset[TransferPhase]] = {
    TransferPhase.HANDSHAKE: frozenset({TransferPhase.ACCEPTED, TransferPhase.FAILED}),
    TransferPhase.ACCEPTED: frozenset({TransferPhase.STREAMING, TransferPhase.FAILED}),
    TransferPhase.STREAMING: frozenset({TransferPhase.CONFIRMING, TransferPhase.FAILED}),
    TransferPhase.CONFIRMING: frozenset({TransferPhase.DONE, TransferPhase.FAILED}),
    TransferPhase.DONE: frozenset(),
    TransferPhase.FAILED: frozenset(),
}


class Room:
    """Meeting point of one request's prefill engine and decode handshake."""

    def __init__(self, room_id: int, queue_depth: int) -> None:
        loop = asyncio.get_running_loop()
        self.room_id = room_id
        self.phase = TransferPhase.HANDSHAKE
        self.prefill_rid: str | None = None
        self.handshake: asyncio.Future[pb.Handshake] = loop.create_future()
        self.claimed: asyncio.Future[str] = loop.create_future()
        self.peer_gone: asyncio.Future[tuple[FailureCode, str]] = loop.create_future()
        self.failure: asyncio.Future[pb.TransferFailed] = loop.create_future()
        self.events: asyncio.Queue[pb.TransferEvent | EncodedChunk] = asyncio.Queue(maxsize=queue_depth)
        self.kv_streams = 1  # decided with the HandshakeAck (open_kv_streams)
        self.stream_events: list[asyncio.Queue[EncodedChunk | None]] = []  # streams 1 .. kv_streams-1
        self.stream_attached: list[bool] = []
        self._stream_chunks: list[int] = [0]  # chunks queued per stream
        # True once the decode side confirmed (a Credit for its seq) that it accepted TransferDone.
        self.delivered: asyncio.Future[bool] = loop.create_future()
        # Kept after its request ended so the other side's late arrival fails at once; expires.
        self.tombstone = False
        # The one-time key of this transfer's KV MAC (InternalAuth.kv_key of the accepted
        # handshake), set by the servicer; None: insecure, no MAC.
        self.kv_key: bytes | None = None
        # The cipher of its KV cells (transport/kv_cipher.py: one decode offered, with a secret) and
        # its one-time key (InternalAuth.kv_cipher_key), set by the servicer; "": in the clear.
        self.kv_cipher = ""
        self.kv_cipher_key: bytes | None = None
        # Mooncake windows: request pages decode has copied out of its staging (Credit.landed_pages).
        self.landed_pages = 0
        self._landed = asyncio.Event()
        # Pulled mooncake transfers: decode read every chunk up to this seq (Credit.received_seq).
        self.credited_seq = 0
        self._credited = asyncio.Event()

    # ---- phases -------------------------------------------------------------------------------
    def advance(self, to: TransferPhase) -> bool:
        """Moves to phase `to`; False (and no change) once terminal; a step `_NEXT` forbids is a bug."""
        if self.phase.terminal:
            return False
        if to not in _NEXT[self.phase]:
            raise RuntimeError(f"room {self.room_id}: transfer phase {self.phase.name} -> {to.name} is not allowed")
        self.phase = to
        return True

    @property
    def finished(self) -> bool:
        """A terminal event has been queued (or the room failed): nothing more goes to decode."""
        return self.phase in (TransferPhase.CONFIRMING, TransferPhase.DONE, TransferPhase.FAILED)

    def met(self) -> None:
        """Called when the claim or the handshake arrives: ACCEPTED once both are here."""
        if self.phase is TransferPhase.HANDSHAKE and self.claimed.done() and self.handshake.done():
            self.advance(TransferPhase.ACCEPTED)

    def open_kv_streams(self, count: int) -> None:
        """The servicer's choice for this room, before its HandshakeAck: `count` KV streams."""
        self.kv_streams = count
        self.stream_events = [asyncio.Queue(maxsize=self.events.maxsize) for _ in range(count - 1)]
        self.stream_attached = [False] * (count - 1)
        self._stream_chunks = [0] * count

    # ---- prefill engine side ----------------------------------------------------------------
    async def wait_handshake(self, timeout_s: float) -> pb.Handshake:
        done, _ = await asyncio.wait({self.handshake, self.peer_gone}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if self.peer_gone in done:
            raise failure_for(*self.peer_gone.result())
        if not done:
            raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                f"no decode handshake for bootstrap room {self.room_id} within {timeout_s}s")
        return self.handshake.result()

    def start_streaming(self) -> None:
        """The prefill side accepted the handshake and opened its transport channel."""
        self.advance(TransferPhase.STREAMING)

    async def emit_chunk(self, chunk: EncodedChunk) -> None:
        """Queues an encoded KV chunk, waiting for room (flow control); raises if decode has gone
        or the room failed (its stream forwards nothing more, so waiting for room would hang)."""
        if not 0 <= chunk.stream < self.kv_streams:
            raise TransferError(FailureCode.INTERNAL, f"KV chunk for stream {chunk.stream} of room {self.room_id}, "
                                f"which has {self.kv_streams}")
        queue = self.events if chunk.stream == 0 else self.stream_events[chunk.stream - 1]
        await self._put(chunk, stop_on_failure=True, queue=queue)
        self._stream_chunks[chunk.stream] += 1

    async def wait_landed(self, pages: int, timeout_s: float) -> None:
        """Waits until decode reports request pages 0 .. pages-1 landed (their staging slots free for
        the next window); raises if decode has gone, the room failed, or after `timeout_s`."""
        await self._wait_for(lambda: self.landed_pages >= pages, self._landed, timeout_s,
                             f"decode did not land pages below {pages} of room {self.room_id} within "
                             f"{timeout_s}s (its staging window)")

    async def wait_credited(self, seq: int, timeout_s: float) -> None:
        """Waits until decode credits event `seq` of the Transfer stream (a pulled mooncake chunk:
        read out of this side's send staging); raises as `wait_landed`."""
        await self._wait_for(lambda: self.credited_seq >= seq, self._credited, timeout_s,
                             f"decode did not read KV chunk {seq} of room {self.room_id} out of the send "
                             f"staging within {timeout_s}s")

    async def _wait_for(self, reached, changed: asyncio.Event, timeout_s: float, late: str) -> None:
        give_up = asyncio.get_running_loop().time() + timeout_s
        while not reached():
            stops = {self.peer_gone, self.failure}
            if not any(stop.done() for stop in stops):
                changed.clear()
                waiter = asyncio.ensure_future(changed.wait())
                remaining = give_up - asyncio.get_running_loop().time()
                await asyncio.wait({waiter, *stops}, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            if reached():
                return
            if self.peer_gone.done():
                raise failure_for(*self.peer_gone.result())
            if self.failure.done():
                failure = self.failure.result()
                raise failure_for(code_from_pb(failure.code), failure.reason)
            if asyncio.get_running_loop().time() >= give_up:
                raise TransferError(FailureCode.DEADLINE_EXCEEDED, late)

    async def finish(self, done: pb.TransferDone, timeout_s: float) -> None:
        """Sends TransferDone after every queued chunk; returns once the decode side confirmed it
        (so success here means decode holds all the KV), raises a RequestFailure otherwise."""
        give_up = asyncio.get_running_loop().time() + timeout_s
        for queue in self.stream_events:  # each extra KV stream ends after its last chunk
            await self._put(None, timeout_s, queue=queue)
        done.stream_chunks[:] = self._stream_chunks[1:]
        # Bounded too: behind a full queue of a decode side that went silent, this waited forever.
        await self._put(pb.TransferEvent(done=done), timeout_s)
        self.advance(TransferPhase.CONFIRMING)
        remaining = max(0.0, give_up - asyncio.get_running_loop().time())
        finished, _ = await asyncio.wait({self.delivered, self.peer_gone}, timeout=remaining,
                                         return_when=asyncio.FIRST_COMPLETED)
        if self.delivered in finished and self.delivered.result():
            self.advance(TransferPhase.DONE)
            return
        self.advance(TransferPhase.FAILED)
        if self.peer_gone.done():
            raise failure_for(*self.peer_gone.result())
        raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                            f"decode side did not confirm the transfer of room {self.room_id} within {timeout_s}s")

    def fail(self, code: FailureCode, reason: str) -> None:
        """Tells decode the transfer failed; overtakes queued chunks. Idempotent; once TransferDone
        is queued there is nothing left to tell (decode's confirmation decides)."""
        if not self.finished and not self.failure.done():
            self.failure.set_result(pb.TransferFailed(code=code_to_pb(code), reason=reason))
        self.advance(TransferPhase.FAILED)

    async def _put(self, event: pb.TransferEvent | EncodedChunk | None, timeout_s: float | None = None,
                   stop_on_failure: bool = False, queue: asyncio.Queue | None = None) -> None:
        stops = {self.peer_gone, self.failure} if stop_on_failure else {self.peer_gone}
        if not any(stop.done() for stop in stops):
            put = asyncio.ensure_future((self.events if queue is None else queue).put(event))
            await asyncio.wait({put, *stops}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if put.done():
                return
            put.cancel()
        if self.peer_gone.done():
            raise failure_for(*self.peer_gone.result())
        if stop_on_failure and self.failure.done():
            failure = self.failure.result()
            raise failure_for(code_from_pb(failure.code), failure.reason)
        raise TransferError(FailureCode.DEADLINE_EXCEEDED, f"decode side of room {self.room_id} "
                            f"accepted no event within {timeout_s}s")

    # ---- decode side (servicer) -------------------------------------------------------------
    def note_landed(self, pages: int) -> None:
        """Decode's Credit said request pages 0 .. pages-1 landed."""
        if pages > self.landed_pages:
            self.landed_pages = pages
            self._landed.set()

    def note_credited(self, seq: int) -> None:
        """Decode's Credit said it holds every event up to `seq` of the Transfer stream."""
        if seq > self.credited_seq:
            self.credited_seq = seq
            self._credited.set()

    def mark_peer_gone(self, code: FailureCode, reason: str) -> None:
        if not self.peer_gone.done():
            self.peer_gone.set_result((code, reason))
        self.advance(TransferPhase.FAILED)
