"""The prefill side of a pulled Mooncake transfer (MooncakeDestination.pull, the default): decode
reads the KV out of this worker's send staging, so nothing of decode's is written by a prefill
worker (workers/transport/mooncake.py gives the whole design).

Each send, in pieces the send staging holds, each piece through one set of slots in groups of
layers (layer_groups.py, about PIPELINE_PIECE_BYTES each) as a pipeline:

    take slots -> per group: gather its layers' pages into them (encrypted with a secret; hashed
    for the MAC beside it, in the MAC's threads) -> over TCP register each layer's runs of them
    (over RDMA the staging is registered for good) -> report the group on the stream (a KVChunk
    without data naming the slots, `source_slots`) -> the next group is staged at once, while
    decode reads, decrypts and hashes this one
    -> as decode credits each group (it read it) -> unregister and zero that group's layers
    -> once decode credited every group -> give the slots back.

    time ->   prefill: stage g0 | stage g1 | stage g2 | stage g3
              decode:             read+land g0 | read+land g1 | read+land g2 | read+land g3

So only groups staged and not yet read are reachable through the engine's ports (ciphertext of
this send only): each group is unregistered and zeroed, once, as soon as decode credits it, while
later groups are still staged and read. The slots are the piece's (`_HeldSlots`) until every staging
thread of it returned: a piece whose send gave up meanwhile (its deadline, a cancel) is given back
by whichever side ends last, once, unregistering and zeroing the groups not released yet.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Sequence

from deepseek_pd.future_outcome import retrieve
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport import kv_mac
from deepseek_pd.workers.transport.layer_groups import layer_groups
from deepseek_pd.workers.transport.mooncake_channel import MooncakeChannel
from deepseek_pd.workers.transport.page_io import consecutive_runs, sync_ready
from deepseek_pd.workers.transport.wire import ChunkHeader, encode_chunk_event

log = logging.getLogger(__name__)


class MooncakePullChannel(MooncakeChannel):
    """A MooncakeChannel whose sends are read by decode instead of written into it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.window = 0  # decode lands each piece through its own slots as it reads it
        self.streams_layers = True  # each layer's piece is read as soon as it is staged
        self.reports = True
        self._register = self.engine.protocol == "tcp"  # over RDMA the staging is registered for good

    async def send(self, src_pages: Sequence[int], page_begin: int, layer_begin: int = 0,
                   layer_end: int | None = None, ready=None) -> None:
        layers = self._check_range(src_pages, page_begin, layer_begin, layer_end)
        if self._emit is None or self.wait_credited is None:
            raise TransferError(FailureCode.INTERNAL, "a pulled mooncake transfer reports its sends on the stream "
                                "and waits for decode's credits")
        self.src_pages[page_begin:page_begin + len(src_pages)] = src_pages
        step = self.staging.num_pages
        for begin in range(0, len(src_pages), step):
            await self._send_piece(layers, page_begin + begin, list(src_pages[begin:begin + step]), ready)
        self.bytes_sent += len(src_pages) * self.pool.bytes_per_page * len(layers)

    async def _send_piece(self, layers: range, page_begin: int, src_pages: list[int], ready) -> None:
        """Pages the staging holds, through one set of slots, in groups of layers as a pipeline:
        group g + 1 is staged (encrypted, hashed) while decode reads group g; the slots go back once
        decode credited every group (or the send gave up)."""
        slots, dirty = await self.staging.acquire(len(src_pages), self.timeout_s)
        held = _HeldSlots(slots, range(len(self.staging.buffers)))
        loop = asyncio.get_running_loop()
        staging: asyncio.Future | None = None  # a group's staging thread in flight
        credits: list[asyncio.Future] = []
        hashing: list = []
        try:
            for group in layer_groups(layers, len(src_pages) * self.staging.page_bytes):
                abandoned = threading.Event()
                staging = loop.run_in_executor(None, self._stage, group, page_begin, src_pages, held, dirty,
                                               ready, abandoned)
                dirty = []  # (zeroed by the first group, in every layer)
                try:
                    hashed = await self._timed(asyncio.shield(staging))
                except BaseException:
                    abandoned.set()  # the thread stages nothing more; the slots go back once it ends
                    raise
                staging = None
                if hashed is not None:
                    hashing.append(hashed)
                self._seq += 1
                header = ChunkHeader(layer_begin=group.start, layer_end=group.stop, page_begin=page_begin,
                                     page_end=page_begin + len(src_pages))
                await self._emit(encode_chunk_event(self._seq, header, b"", 0, source_slots=slots,
                                                    direct_bytes=len(src_pages) * self.pool.bytes_per_page
                                                    * len(group)))
                credits.append(asyncio.ensure_future(self._credit(self._seq, held, group)))
            await asyncio.gather(*credits)
            for each in hashing:  # the MAC read the pool's pages beside the reads: done before they go
                await loop.run_in_executor(None, each.wait)
        finally:  # read, or the room is over: either way nobody needs them any more
            for credit in credits:
                credit.cancel()
            try:
                if credits:
                    await asyncio.gather(*credits, return_exceptions=True)
            finally:  # (even when this task is cancelled again while the credits wind down)
                if staging is not None and not staging.done():
                    staging.add_done_callback(lambda done: (retrieve(done), held.release(self)))
                else:
                    held.release(self)

    async def _credit(self, seq: int, held: "_HeldSlots", group: range) -> None:
        """Waits for decode's credit of report `seq` (`group` of `held`'s piece), then takes that
        group out of the engine's reach at once (the piece's later groups are still read)."""
        began = time.perf_counter()
        try:
            await self.wait_credited(seq, self.timeout_s)
        finally:
            self.stats.add("credit", time.perf_counter() - began)
        held.release_group(self, group)

    def _stage(self, layers: range, page_begin: int, src_pages: list[int], held: "_HeldSlots", dirty: list[int],
               ready, abandoned: threading.Event) -> "kv_mac.Hashing | None":
        """In a worker thread: gathers the pages of `layers` into the slots (encrypted after
        `begin_cipher`; hashed for the MAC in its threads beside it, returned to wait for) and
        exposes them. The slots stay `held`'s: whoever ends the piece gives them back, once this
        thread returned."""
        if abandoned.is_set():
            raise TransferError(FailureCode.ABORTED, "the send gave up before its KV was staged")
        if dirty:
            self.staging.scrub(dirty)
        held.clean(layers)
        sync_ready(self.pool, ready)
        hashing = self._hash_sent(layers, page_begin, src_pages, ready)
        try:
            with self.stats.timed("stage"):
                self.staging.fill_from(self.pool, layers, src_pages, held.slots, self._cipher, page_begin)
            if abandoned.is_set():
                raise TransferError(FailureCode.ABORTED, "the send gave up while its KV was staged")
            with self.stats.timed("register"):
                held.expose(layers, self._expose(held.slots, layers))
        except BaseException:
            if hashing is not None:
                hashing.wait()
            raise
        return hashing

    def _expose(self, slots: list[int], layers: range) -> list[int]:
        """Over TCP, registers each layer's runs of `slots` (decode's reads need them registered);
        raises TransferError after undoing its own registrations."""
        exposed: list[int] = []
        page_bytes = self.staging.page_bytes
        for base in self.staging.base_addrs[layers.start:layers.stop] if self._register else []:
            for begin, end, first in consecutive_runs(slots):
                addr = base + first * page_bytes
                if self.engine.engine.register_memory(addr, (end - begin) * page_bytes) != 0:
                    self._unexpose(exposed)
                    raise TransferError(FailureCode.INTERNAL, "mooncake could not register the send staging's slots")
                exposed.append(addr)
        return exposed

    def _unexpose(self, exposed: list[int]) -> None:
        for addr in exposed:
            self.engine.engine.unregister_memory(addr)
        exposed.clear()

    def _release(self, exposed: list[int], slots: list[int], layers: Sequence[int]) -> None:
        """Out of the engine's reach, zeroed in `layers`, back to the staging."""
        try:
            with self.stats.timed("register"):
                self._unexpose(exposed)
        finally:
            self._give_back(slots, layers)

    def _release_group(self, exposed: list[int], slots: list[int], layers: range) -> bool:
        """Out of the engine's reach and zeroed in `layers`, the slots still held; False when the
        zeroing failed (the piece's hand-back zeroes those layers again)."""
        with self.stats.timed("register"):
            self._unexpose(exposed)
        try:
            self.staging.scrub(slots, layers)
        except Exception:  # noqa: BLE001 - the hand-back zeroes them (or marks them dirty)
            log.exception("could not zero layers %s of %d mooncake send-staging slots at their credit",
                          layers, len(slots))
            return False
        return True


class _HeldSlots:
    """One piece's send-staging slots while its layer groups are staged and read: what each group
    registered, which layers may hold KV (to zero), each group's release at its credit and the one
    hand-back, each exactly once (a group's release runs on the event loop while a staging thread
    may register the next group: hence the lock)."""

    def __init__(self, slots: list[int], touched: range) -> None:
        self.slots = slots
        self._exposed: dict[range, list[int]] = {}  # each group's registrations, until released
        self._touched = touched  # every layer until the first group zeroed the dirty slots
        self._clean: range | None = None
        self._zeroed: set[int] = set()  # layers zeroed at their group's credit
        self._released = False
        self._lock = threading.Lock()

    def expose(self, group: range, addrs: list[int]) -> None:
        """`group`'s layers of the slots are registered at `addrs` (none over RDMA)."""
        with self._lock:
            self._exposed[group] = addrs

    def release_group(self, channel: "MooncakePullChannel", group: range) -> None:
        """Decode read `group`: unregistered and zeroed now, once (not after the hand-back)."""
        with self._lock:
            if self._released or group not in self._exposed:
                return
            exposed = self._exposed.pop(group)
        if channel._release_group(exposed, self.slots, group):
            with self._lock:
                self._zeroed.update(group)

    def clean(self, layers: range) -> None:
        """The slots were clean (zeroed if dirty) before `layers` were staged into them."""
        self._clean = layers if self._clean is None else range(min(self._clean.start, layers.start),
                                                               max(self._clean.stop, layers.stop))

    def release(self, channel: "MooncakePullChannel") -> None:
        """The hand-back: what is still registered unregistered, the layers that may hold KV and
        were not zeroed at a credit zeroed, the slots back to the staging."""
        with self._lock:
            if self._released:
                return
            self._released = True
            exposed = [addr for addrs in self._exposed.values() for addr in addrs]
            self._exposed.clear()
            touched = self._touched if self._clean is None else self._clean
            remaining = [layer for layer in touched if layer not in self._zeroed]
        channel._release(exposed, self.slots, remaining)

