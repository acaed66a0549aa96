"""One PD request's KV push on the prefill side: handshake, pages as they complete, then status.

The prefill scheduler calls `pages_ready` after every chunk it computes (all layers), or
`layers_ready` as each layer's forward has written its KV (layer-wise streaming: the transfer
overlaps the remaining layers); the pages are sent in order by a background task, so a slow
decode side never stalls the scheduler loop (it only delays this request's `finish`). Sends that
queued up while an earlier one was on its way (the same pages of consecutive layers) leave as
one: layer by layer while the transport keeps up, in larger layer ranges when it does not. A send
failure fails the room at once and is re-raised by `finish`; the engine, watching the room, ends
the request, which stops its compute.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.first_token_wire import put_first_top
from deepseek_pd.workers.transport import KVSender, SendChannel, SendPlan
from deepseek_pd.workers.transport.base import check_layout
from deepseek_pd.workers.engine.request_failure import RequestFailure, TransferError, failure_for
from deepseek_pd.workers.prefill.room import Room
from deepseek_pd.workers.prefill.room_registry import RoomRegistry

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Send:
    src_pages: list[int]
    page_begin: int
    layers: range
    ready: "torch.cuda.Event | None"

    def follows(self, other: "_Send") -> bool:
        """The same pages in the layers right after `other`'s: both can go as one send."""
        return (self.page_begin == other.page_begin and self.src_pages == other.src_pages
                and self.layers.start == other.layers.stop)


def _written(ready: "torch.cuda.Event | None") -> bool:
    """Whether the KV behind `ready` is already in the pool (no event: it was when the send was queued)."""
    return ready is None or ready.query()


def merge_queued(first: _Send, queued: "collections.deque[_Send | None]") -> _Send:
    """`first` plus the sends at the head of `queued` that continue it and whose KV is already
    written (popped from `queued`).

    Only written layers join: on CUDA the forward is queued far ahead of the GPU, and a send
    that waited for the last of many layers would give up the overlap for the others. The merged
    send waits for the last one's `ready` (events of one forward are recorded on one stream in
    layer order, so the last implies the others).
    """
    merged = first
    while queued and queued[0] is not None and queued[0].follows(merged) and _written(queued[0].ready):
        nxt = queued.popleft()
        merged = _Send(merged.src_pages, merged.page_begin, range(merged.layers.start, nxt.layers.stop), nxt.ready)
    return merged


class KVPush:
    def __init__(self, registry: RoomRegistry, sender: KVSender, room_id: int, rid: str,
                 num_tokens: int) -> None:
        self.registry = registry
        self.sender = sender
        self.rid = rid
        self.num_tokens = num_tokens
        self.plan = SendPlan(num_tokens, sender.pool.page_size, sender.pool.num_layers)
        self.room: Room = registry.claim(room_id, rid)
        self.channel: SendChannel | None = None
        self._queue: collections.deque[_Send | None] = collections.deque()  # None: no more sends
        self._queued = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._error: RequestFailure | None = None
        self._started = time.monotonic()
        self._send_seconds = 0.0  # time spent inside channel.send: the transfer's own rate
        self._num_sends = 0

    async def handshake(self, timeout_s: float) -> pb.Handshake:
        """Waits for the decode side's handshake and opens the transport channel."""
        handshake = await self.room.wait_handshake(timeout_s)
        try:
            # The layout first: pages of another size also miscount, and only the layout says why.
            check_layout(self.sender.pool, handshake.layout)
            if handshake.num_tokens != self.num_tokens or len(handshake.page_ids) != self.plan.num_pages:
                raise TransferError(FailureCode.INVALID_ARGUMENT,
                                    f"decode prepared {handshake.num_tokens} tokens in {len(handshake.page_ids)} "
                                    f"pages, prefill has a {self.num_tokens}-token prompt "
                                    f"({self.plan.num_pages} pages)")
            await self.sender.prepare(handshake)
            self.channel = self.sender.open(handshake, self.room.emit_chunk, streams=self.room.kv_streams)
            self.channel.wait_landed = self.room.wait_landed  # (mooncake windows wait for decode's copies)
            self.channel.wait_credited = self.room.wait_credited  # (pulled mooncake chunks, for decode's reads)
            if self.room.kv_cipher:  # (mooncake with a secret: each cell encrypted as it is staged)
                self.channel.begin_cipher(self.room.kv_cipher, self.room.kv_cipher_key)
            if self.room.kv_key is not None:  # (mooncake: MACs each send as it goes, off `finish`)
                self.channel.begin_seal(self.room.kv_key, self.room.room_id)
        except RequestFailure as exc:  # the decode side gets the same reason
            self.room.fail(exc.code, exc.message)
            raise
        self.room.start_streaming()
        self._task = asyncio.create_task(self._send_loop(), name=f"kv-push-{self.rid}")
        return handshake

    @property
    def failed(self) -> RequestFailure | None:
        if self._error is None and self.room.peer_gone.done():
            return failure_for(*self.room.peer_gone.result())
        return self._error

    @property
    def streams_layers(self) -> bool:
        """Whether this request's channel wants each layer as the forward writes it (`layers_ready`)."""
        return self.channel is not None and self.channel.streams_layers

    def pages_ready(self, computed_tokens: int, pages: Sequence[int], ready: "torch.cuda.Event | None" = None) -> None:
        """`pages` is the request's page table; sends every page the computed tokens complete,
        in every layer not yet sent that far. `ready` (CUDA): as for `layers_ready`."""
        self.layers_ready(computed_tokens, pages, 0, self.sender.pool.num_layers, ready)

    def layers_ready(self, computed_tokens: int, pages: Sequence[int], layer_begin: int, layer_end: int,
                     ready: "torch.cuda.Event | None" = None) -> None:
        """Layers [layer_begin, layer_end) now hold the KV of the first `computed_tokens` tokens:
        sends the pages that completes in those layers. `ready` (CUDA): an event recorded after
        those layers' KV writes; the transport's read waits for it, not for the whole forward.

        Example, 27 layers, one 4096-token chunk: the forward calls `layers_ready(4096, pages, l,
        l + 1, event_l)` after layer l, for l = 0 .. 26; `finish` may follow the last one.
        """
        final = computed_tokens == self.num_tokens
        for layers, ready_pages in self.plan.ready_layers(computed_tokens, range(layer_begin, layer_end), final):
            self._put(_Send([pages[i] for i in ready_pages], ready_pages.start, layers, ready))

    @property
    def bytes_sent(self) -> int:
        return self.channel.bytes_sent if self.channel is not None else 0

    @property
    def send_seconds(self) -> float:
        """Time spent inside `channel.send`: the transfer's own share of the request's time."""
        return self._send_seconds

    @property
    def num_sends(self) -> int:
        """`channel.send` calls so far (after merging queued layer ranges)."""
        return self._num_sends

    def _put(self, item: _Send | None) -> None:
        self._queue.append(item)
        self._queued.set()

    async def _next(self) -> _Send | None:
        while not self._queue:
            self._queued.clear()
            await self._queued.wait()
        item = self._queue.popleft()
        return None if item is None else merge_queued(item, self._queue)

    async def _send_loop(self) -> None:
        assert self.channel is not None
        while (item := await self._next()) is not None:
            # Once the room is over (decode gone, the room failed) its pages are no longer this
            # transfer's: a one-sided channel would write them before learning that at `emit`.
            if self._error is not None or self.room.finished:
                continue
            self._num_sends += 1
            began = time.monotonic()
            try:
                if item.layers == range(self.sender.pool.num_layers) and item.ready is None:
                    await self.channel.send(item.src_pages, item.page_begin)  # the original two-argument form
                else:
                    await self.channel.send(item.src_pages, item.page_begin, item.layers.start,
                                            item.layers.stop, item.ready)
                self._send_seconds += time.monotonic() - began
            except RequestFailure as exc:
                self._error = exc
                self.room.fail(exc.code, exc.message)
            except Exception as exc:  # a transport bug must still end both sides cleanly
                log.exception("KV send of %s failed", self.rid)
                self._error = TransferError(FailureCode.INTERNAL, f"KV send failed: {exc!r}")
                self.room.fail(self._error.code, self._error.message)

    async def finish(self, first_token_id: int, logprob: float, cached_tokens: int,
                     top: TopLogprobs | None = None, draft: "tuple[int, list[float]] | None" = None) -> None:
        """Waits for every queued page, then sends TransferDone (with the first token's `top`
        logprobs when the request asked for them, and with the MTP layer the first `draft`: its
        token and MTP hidden state). Raises the transfer's error."""
        if not self.plan.done:
            raise RuntimeError(f"{self.rid}: finish before every page was handed to pages_ready")
        assert self._task is not None and self.channel is not None
        self._put(None)
        await asyncio.shield(self._task)
        if self.failed is not None:
            raise self.failed
        done = pb.TransferDone(
            first_token_id=first_token_id, first_token_logprob=logprob, num_pages=self.plan.num_pages,
            cached_tokens=cached_tokens, bytes_sent=self.channel.bytes_sent)
        if self.room.kv_key is not None and self.channel.seal_reads():  # KV to read (a MAC): off the loop
            await asyncio.to_thread(self.channel.seal, done, self.room.kv_key, self.room.room_id)
        elif self.room.kv_key is not None:  # only a digest of what the sends hashed: no thread hop, nor
            self.channel.seal(done, self.room.kv_key, self.room.room_id)  # a queue behind other transfers'
        put_first_top(done, top)
        if draft is not None:
            done.mtp_draft_token_id = draft[0]
            done.mtp_hidden.extend(draft[1])
        await self.room.finish(done, timeout_s=self.sender.config.send_timeout_s)
        sent, busy = self.channel.bytes_sent, max(self._send_seconds, 1e-9)
        log.debug("%s: pushed %d bytes of KV in %d sends, %.4fs of sending (%.3f GB/s), done %.3fs after "
                  "arrival; %s", self.rid, sent, self._num_sends, busy, sent / busy / 1e9,
                  time.monotonic() - self._started, self.channel.stats.summary())

    def fail(self, code: FailureCode, reason: str) -> None:
        self.room.fail(code, reason)

    def close(self) -> None:
        """Always called last: stops the send task, fails the room if it is not finished."""
        self.room.fail(FailureCode.ABORTED, f"prefill request {self.rid} ended")  # no-op after finish
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.channel is not None:
            self.channel.close()
        self.registry.release(self.room)
