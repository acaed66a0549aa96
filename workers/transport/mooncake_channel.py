"""The prefill side of a Mooncake transfer: the checks on decode's destination, the one batch
write per send through a send staging (encrypted there: kv_cipher.py; registered over RDMA),
windows through decode's staging, and the KV MAC sealed into the TransferDone
(workers/transport/mooncake.py gives the whole design)."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Sequence

from deepseek_pd.future_outcome import retrieve
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import kv_cipher, kv_mac
from deepseek_pd.workers.transport.base import EmitChunk, SendChannel, check_page_ids
from deepseek_pd.workers.transport.layer_groups import layer_groups
from deepseek_pd.workers.transport.mooncake_engine import MooncakeEngine
from deepseek_pd.workers.transport.page_io import sync_ready
from deepseek_pd.workers.transport.plan import merge_page_runs
from deepseek_pd.workers.transport.staging import StagingArea
from deepseek_pd.workers.transport.wire import ChunkHeader, encode_chunk_event
from deepseek_pd.workers.engine.request_failure import TransferError

log = logging.getLogger(__name__)


def build_write_batch(src_base: Sequence[int], dst_base: Sequence[int], page_bytes: int,
                      src_pages: Sequence[int], dst_pages: Sequence[int]
                      ) -> tuple[list[int], list[int], list[int]]:
    """(local addrs, remote addrs, lengths) for the given layers x contiguous runs, layer-major.

    `src_base`/`dst_base` are the base addresses of the layers to write (a slice for a layer range).
    """
    runs = merge_page_runs(src_pages, dst_pages)
    local: list[int] = []
    remote: list[int] = []
    lengths: list[int] = []
    for src_layer, dst_layer in zip(src_base, dst_base):
        for run in runs:
            local.append(src_layer + run.src * page_bytes)
            remote.append(dst_layer + run.dst * page_bytes)
            lengths.append(run.length * page_bytes)
    return local, remote, lengths


class MooncakeChannel(SendChannel):
    """`staging`: where each send's pages are gathered (and encrypted, `begin_cipher`) and written
    from: registered over RDMA (the NIC reads only registered memory), not over TCP."""

    def __init__(self, pool: KVPool, engine: MooncakeEngine, destination: pb.MooncakeDestination,
                 dst_pages: Sequence[int], timeout_s: float, staging: StagingArea,
                 emit: EmitChunk | None = None) -> None:
        super().__init__(pool, dst_pages)
        self.engine = engine
        self.staging = staging
        self.destination = destination
        self.timeout_s = timeout_s
        # Through decode's staging in windows of `window` pages (0: a slot per page): whole pages
        # only, each window reported on the stream (`emit`) and its slots reused once decode landed it.
        self.window = destination.window_pages
        self.streams_layers = not self.window
        # Each send reported once written (decode lands and MACs it then: send_landing.py); windows
        # report theirs anyway.
        self.reports = destination.report_sends and not self.window
        self._emit = emit
        self._seq = 0  # the stream's chunk numbers: window reports
        self.src_pages: list[int | None] = [None] * len(self.dst_pages)  # each request page's page of ours (`seal`)
        self._macs: kv_mac.LayerMacs | None = None  # `begin_seal`: the MAC, as the sends go out
        self._mac_room: int | None = None
        self._cipher: kv_cipher.CellCipher | None = None  # `begin_cipher`: each cell encrypted as it is staged
        try:  # (the bootstrap servicer's ack named the same pick: `kv_mac.choose` is one rule)
            self._mac_algorithm = kv_mac.choose(destination.kv_mac_algorithms) or None
        except ValueError as exc:
            raise TransferError(FailureCode.INVALID_ARGUMENT, str(exc)) from None

    async def send(self, src_pages: Sequence[int], page_begin: int, layer_begin: int = 0,
                   layer_end: int | None = None, ready=None) -> None:
        layers = self._check_range(src_pages, page_begin, layer_begin, layer_end)
        self.src_pages[page_begin:page_begin + len(src_pages)] = src_pages
        if self.window:
            await self._send_windows(list(src_pages), page_begin, layers, ready)
        elif self.reports:  # in groups of layers, each reported once written: decode lands group g
            # while group g + 1 is staged and written (layer_groups.py)
            dst = self.dst_pages[page_begin:page_begin + len(src_pages)]
            for group in layer_groups(layers, len(src_pages) * self.pool.bytes_per_page):
                await self._write_pages(group, page_begin, list(src_pages), dst, ready)
                await self._report(group, page_begin, page_begin + len(src_pages))
        else:  # an older decode worker lands everything after the TransferDone: one write
            await self._write_pages(layers, page_begin, list(src_pages),
                                    self.dst_pages[page_begin:page_begin + len(src_pages)], ready)
        self.bytes_sent += len(src_pages) * self.pool.bytes_per_page * len(layers)

    async def _report(self, layers: range, first: int, end: int) -> None:
        """Tells decode, on the stream (a KVChunk without data), that request pages [first, end) of
        `layers` are written into its staging."""
        if self._emit is None:
            raise TransferError(FailureCode.INTERNAL, "a mooncake channel that reports its sends needs the stream")
        self._seq += 1
        header = ChunkHeader(layer_begin=layers.start, layer_end=layers.stop, page_begin=first, page_end=end)
        await self._emit(encode_chunk_event(self._seq, header, b"", 0,
                                            direct_bytes=(end - first) * self.pool.bytes_per_page * len(layers)))

    async def _send_windows(self, src_pages: list[int], page_begin: int, layers: range, ready) -> None:
        """Pages through decode's staging window: in pieces of half a window (one is written while
        decode copies the other out), each once decode landed the pages that held its slots before
        it, then reported on the stream (a KVChunk without data) so that decode lands it."""
        if layers != range(self.pool.num_layers) or self.wait_landed is None or self._emit is None:
            raise TransferError(FailureCode.INTERNAL, "a windowed mooncake transfer sends whole pages (every "
                                "layer), waiting for decode's landed pages")
        step = max(1, self.window // 2)
        for begin in range(0, len(src_pages), step):
            first, end = page_begin + begin, page_begin + min(begin + step, len(src_pages))
            if end - self.window > 0:  # page i's slot held page i - window until decode copied it out
                await self.wait_landed(end - self.window, self.timeout_s)
            await self._write_pages(layers, first, src_pages[begin:begin + step], self.dst_pages[first:end], ready)
            await self._report(layers, first, end)

    async def _write_pages(self, layers: range, page_begin: int, src_pages: list[int], dst: list[int],
                           ready) -> None:
        """Writes `src_pages` (the request's pages from `page_begin` on) of `layers` into decode's slots
        `dst`, hashing them for the MAC beside the write; raises TransferError."""
        status, step = 0, self.staging.num_pages  # in pieces the staging holds, each through slots
        for begin in range(0, len(src_pages), step):  # held only while it is written
            if status == 0:
                status = await self._write_staged(layers, page_begin + begin, src_pages[begin:begin + step],
                                                  dst[begin:begin + step], ready)
        if status != 0:
            raise TransferError(FailureCode.UNAVAILABLE,
                                f"mooncake write to {self.destination.session_id} failed (status {status})")

    def begin_cipher(self, algorithm: str, key: bytes) -> None:
        if self.bytes_sent:
            raise TransferError(FailureCode.INTERNAL, "a KV cipher must begin before the first send")
        self._cipher = kv_cipher.CellCipher(key, self.pool.bytes_per_page, self.pool.device, algorithm)

    def begin_seal(self, key: bytes, room: int) -> None:
        # Each send hashes what it wrote (in `_write`, beside the write), so `seal` on the first
        # token's path reads only what no send hashed in order; the tag is the same either way.
        if self._mac_algorithm is not None:
            self._macs = kv_mac.LayerMacs(self.pool.num_layers, key, kv_mac.header(room, self.dst_pages),
                                          self._mac_algorithm)
            self._mac_room = room

    def seal_reads(self) -> bool:
        return self._mac_algorithm is not None and (
            self._macs is None or min(self._macs.hashed, default=0) < len(self.dst_pages))

    def seal(self, done: pb.TransferDone, key: bytes, room: int) -> None:
        if self._mac_algorithm is None:  # an older decode worker, which checks no MAC
            return
        if None in self.src_pages:
            raise TransferError(FailureCode.INTERNAL, "KV MAC asked for before every page was sent")
        macs = self._macs
        if macs is None or macs.key != key or self._mac_room != room:  # not begun (or for another transfer)
            macs = kv_mac.LayerMacs(self.pool.num_layers, key, kv_mac.header(room, self.dst_pages),
                                    self._mac_algorithm)
        self._macs = None
        done.kv_mac = macs.digest(self.pool, self.src_pages)
        self.stats.add("mac", macs.seconds)
        done.kv_mac_algorithm = self._mac_algorithm

    def _hash_sent(self, layers: range, page_begin: int, src_pages: list[int], ready) -> kv_mac.Hashing | None:
        """In the send's worker thread, before its write: starts hashing its pages in the MAC's threads
        (`begin_seal`), so the hash runs beside the write; None when not sealing."""
        if self._macs is None:
            return None
        return self._macs.update(self.pool, layers, page_begin, src_pages, ready)

    async def _timed(self, call) -> int:
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                f"mooncake write to {self.destination.session_id} took more than "
                                f"{self.timeout_s}s") from None

    async def _write_staged(self, layers: range, page_begin: int, src_pages: list[int], dst_pages: list[int],
                            ready) -> int:
        """One piece through staging slots. The slots are the worker thread's until it returns (it
        gives them back zeroed), whatever happens here: a write that outlives its deadline still
        reads them, and must never zero (or read) slots that another send took meanwhile. A thread
        that begins after the deadline writes nothing (`abandoned`): decode's slots of this transfer
        may serve another one by then."""
        slots, dirty = await self.staging.acquire(len(src_pages), self.timeout_s)
        abandoned = threading.Event()
        # Submitted at once and shielded: a cancelled or timed-out wait never unschedules the
        # thread, which alone hands the slots back.
        work = asyncio.get_running_loop().run_in_executor(
            None, self._write_from_slots, layers, page_begin, src_pages, slots, dirty, dst_pages, ready, abandoned)
        work.add_done_callback(retrieve)  # (its waiter may have given up on the shielded write)
        try:
            return await self._timed(asyncio.shield(work))
        except BaseException:
            abandoned.set()
            raise

    def _write_from_slots(self, layers: range, page_begin: int, src_pages: list[int], slots: list[int], dirty: list[int],
                          dst_pages: list[int], ready, abandoned: threading.Event) -> int:
        """In a worker thread: gathers the pages into the slots once their KV is written (encrypted
        on the way, after `begin_cipher`), one batch write from there unless the send was
        `abandoned` meanwhile, then zeroes the slots and gives them back (a reader of the registered
        staging sees no KV that is not in flight, and with a cipher none at all)."""
        hashing, touched = None, range(len(self.staging.buffers))  # what to zero after: every layer...
        try:
            if abandoned.is_set():
                return -1
            self.staging.scrub(dirty)
            touched = layers  # ... or, once the slots were clean, the layers gathered into them
            sync_ready(self.pool, ready)
            hashing = self._hash_sent(layers, page_begin, src_pages, ready)
            with self.stats.timed("stage"):
                self.staging.fill_from(self.pool, layers, src_pages, slots, self._cipher, page_begin)
            batch = build_write_batch(self.staging.base_addrs[layers.start:layers.stop],
                                      list(self.destination.layer_base_addrs)[layers.start:layers.stop],
                                      self.pool.bytes_per_page, slots, dst_pages)
            if abandoned.is_set():
                return -1
            with self.stats.timed("network"):
                return self.engine.engine.batch_transfer_sync_write(self.destination.session_id, *batch)
        finally:
            try:
                if hashing is not None:
                    hashing.wait()
            finally:
                self._give_back(slots, touched)

    def _give_back(self, slots: list[int], layers: Sequence[int]) -> None:
        """The slots back to the staging, zeroed in `layers` (else zeroed when next taken; logged)."""
        try:
            self.staging.scrub(slots, layers)
        except Exception:  # noqa: BLE001 - the slots must go back either way
            log.exception("could not zero %d mooncake send-staging slots: zeroed when next taken", len(slots))
            self.staging.release(slots)
            return
        self.staging.release(slots, scrubbed=True)


def check_destination(destination: pb.MooncakeDestination, page_ids: Sequence[int], page_bytes: int,
                      num_layers: int, protocol: str) -> None:
    """Every write of this room lands inside the decode staging's layer buffers, over the protocol
    this engine speaks, and windowed page ids repeat one window's slots: raises TransferError."""
    check_engine_match(destination, page_bytes, protocol)
    if len(destination.layer_base_addrs) != num_layers:
        raise TransferError(FailureCode.INVALID_ARGUMENT,
                            f"decode sent {len(destination.layer_base_addrs)} layer addresses, "
                            f"the model has {num_layers} layers")
    window = destination.window_pages
    if window:
        if window >= len(page_ids) or any(page != page_ids[i % window] for i, page in enumerate(page_ids)):
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"decode's staging window of {window} pages does not repeat its slots over the "
                                f"request's {len(page_ids)} pages")
        page_ids = page_ids[:window]
    check_page_ids(page_ids, destination.pool_pages)


def check_engine_match(destination: pb.MooncakeDestination, page_bytes: int, protocol: str) -> None:
    """Decode's engine speaks this engine's protocol and holds pages of this size: raises TransferError."""
    if destination.protocol and destination.protocol != protocol:
        # One side fell back to TCP (serve --kv-tcp-fallback) and the other did not: every write
        # would fail, so say why once, per request, instead.
        raise TransferError(FailureCode.INVALID_ARGUMENT,
                            f"decode's mooncake engine speaks {destination.protocol}, this prefill worker's "
                            f"{protocol}: one of them fell back to tcp (see its start log); give both RDMA "
                            f"devices or use kvTransfer.protocol tcp")
    if destination.page_bytes != page_bytes:
        raise TransferError(FailureCode.INVALID_ARGUMENT,
                            f"decode page is {destination.page_bytes} bytes, prefill page {page_bytes}")
