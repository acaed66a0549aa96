"""The decode side of a pulled Mooncake transfer (MooncakeDestination.pull, the default): it reads
each reported send out of the prefill worker's send staging into its own slots, which no peer can
write (over TCP they are never registered), then lands them as any send (workers/transport/mooncake.py
gives the whole design).

    KVChunk [pages b..e) x layers, source_slots -> claim the cells (each once) -> Mooncake READ from
    the source the signed ack named into our slots -> copy into the request's pages (decrypted),
    zeroing the slots -> MAC and finite check of what landed -> credit the chunk (its slots free)

A prompt longer than the whole staging has fewer slots than pages (`window`): its reads go through
them piece by piece, one at a time."""
from __future__ import annotations

import contextlib
import threading

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.mooncake_channel import build_write_batch
from deepseek_pd.workers.transport.mooncake_sink import MooncakeSink


class MooncakePullSink(MooncakeSink):
    """A MooncakeSink that reads what the prefill side staged instead of being written into."""

    credits_each_chunk = True  # the prefill side frees a chunk's slots on its credit

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._register = False  # nothing of ours is written by a peer
        self._source: pb.MooncakeSource | None = None
        self._reading = threading.Lock()  # a window's slots serve one piece at a time

    def offer_into(self, handshake: pb.Handshake) -> None:
        # Nothing to name: the request-local pages are the MAC's header on both sides.
        self._told = list(range(len(self.pages)))
        del handshake.page_ids[:]
        handshake.page_ids.extend(self._told)
        handshake.mooncake.window_pages = 0

    def accept_answer(self, ack: pb.HandshakeAck) -> None:
        source = ack.mooncake_source
        if not ack.HasField("mooncake_source"):
            raise self.fail(TransferError(FailureCode.INVALID_ARGUMENT,
                                          "the prefill worker accepted a pulled mooncake transfer without naming "
                                          "its send staging: run one version on both"))
        if (len(source.layer_base_addrs) != self.pool.num_layers or source.page_bytes != self.pool.bytes_per_page
                or not source.pool_pages or not source.session_id):
            raise self.fail(TransferError(FailureCode.INVALID_ARGUMENT,
                                          f"the prefill worker's send staging ({len(source.layer_base_addrs)} layers "
                                          f"of {source.pool_pages} pages of {source.page_bytes} bytes) does not "
                                          f"hold this pool's pages ({self.pool.num_layers} layers, "
                                          f"{self.pool.bytes_per_page} bytes)"))
        self._source = source

    def on_chunk(self, chunk) -> None:
        if self.failed is not None:
            raise self.failed
        layers, begin, end = range(chunk.layer_begin, chunk.layer_end), chunk.page_begin, chunk.page_end
        source_slots = list(chunk.source_slots)
        with self._lock:  # (chunks may come in several threads at once)
            if self._over.is_set():
                raise self.fail(TransferError(FailureCode.ABORTED, "the transfer ended before its send was read"))
            refused = _refusal(chunk, source_slots, self._source)
            if refused is None:
                refused = self._landing.claim(layers, begin, end)
            if refused is not None:
                raise self.fail(TransferError(FailureCode.INTERNAL, refused))
        step = self.window or end - begin
        for first in range(begin, end, step):
            last = min(first + step, end)
            with self._reading if self.window else contextlib.nullcontext():
                self._read_piece(layers, first, last, source_slots[first - begin:last - begin])
        self._landing.hash(layers, begin, end)
        self._check_landed(layers, self.pages[begin:end])

    def _read_piece(self, layers: range, first: int, last: int, source_slots: list[int]) -> None:
        """Request pages [first, last) of `layers`: read into our slots, then landed in their pages."""
        assert self._source is not None
        slots = self.slots[:last - first] if self.window else self.slots[first:last]
        batch = build_write_batch(self._staging.base_addrs[layers.start:layers.stop],
                                  list(self._source.layer_base_addrs)[layers.start:layers.stop],
                                  self._staging.page_bytes, slots, source_slots)
        with self.stats.timed("network"):
            status = self._engine.engine.batch_transfer_sync_read(self._source.session_id, *batch)
        if status != 0:
            raise self.fail(TransferError(FailureCode.UNAVAILABLE, f"mooncake read from {self._source.session_id} "
                                          f"failed (status {status})"))
        with self._lock:
            if self._over.is_set():  # our slots may be another transfer's by now: no copy from them
                raise self.fail(TransferError(FailureCode.ABORTED, "the transfer ended while its send was read"))
            self.exposure.wrote()
            with self.stats.timed("write"):
                self._staging.copy_into(self.pool, slots, self.pages[first:last], layers, self._cipher,
                                        first)  # (and zeroes the slots)

    def _check_cells(self) -> None:
        # Every cell comes by report here: a done without any would land decode's own empty slots.
        missing = self._landing.missing() if self._landing.reported else "prefill reported no send of a pulled transfer"
        if missing is not None:
            raise self.fail(TransferError(FailureCode.INTERNAL, missing))


def _refusal(chunk, source_slots: list[int], source: pb.MooncakeSource | None) -> str | None:
    """Why a pulled chunk's report is refused, or None: it carries no data, names one source slot
    per page, each inside the prefill worker's send staging and none twice."""
    if not chunk.written_directly or len(chunk.data):
        return "prefill sent KV bytes on the stream; a pulled mooncake transfer's reports carry none"
    if source is None:
        return "prefill reported a send before naming its send staging"
    if len(source_slots) != chunk.page_end - chunk.page_begin:
        return (f"prefill named {len(source_slots)} send-staging slots for pages "
                f"[{chunk.page_begin}, {chunk.page_end})")
    if any(slot >= source.pool_pages for slot in source_slots) or len(set(source_slots)) != len(source_slots):
        return (f"prefill named send-staging slots {source_slots[:4]}... outside its {source.pool_pages} "
                f"slots, or one twice")
    return None
