"""The prefill side of a pulled Mooncake transfer (MooncakeDestination.pull, the default): decode
reads the KV out of this worker's send staging, so nothing of decode's is written by a prefill
worker (workers/transport/mooncake.py gives the whole design).

Each send, in pieces the send staging holds:

    take slots -> gather the pages into them (encrypted with a secret; hashed for the MAC beside it)
    -> over TCP register each layer's runs of them (over RDMA the staging is registered for good)
    -> report the piece on the stream (a KVChunk without data naming the slots, `source_slots`)
    -> wait for decode's credit of that chunk (it read the slots) -> unregister, zero, give back.

So only slots of pieces in flight are reachable through the engine's ports, each for one round
trip. The slots are the staging thread's until it hands them over: a piece whose send gave up
meanwhile (its deadline, a cancel) is given back by whichever side holds it then, never twice.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Sequence

from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.mooncake_channel import MooncakeChannel
from deepseek_pd.workers.transport.page_io import consecutive_runs, sync_ready
from deepseek_pd.workers.transport.wire import ChunkHeader, encode_chunk_event


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
        slots, dirty = await self.staging.acquire(len(src_pages), self.timeout_s)
        abandoned = threading.Event()
        work = asyncio.get_running_loop().run_in_executor(
            None, self._stage, layers, page_begin, src_pages, slots, dirty, ready, abandoned)
        try:
            exposed = await self._timed(asyncio.shield(work))
        except BaseException:
            abandoned.set()  # the thread gives the slots back, or (past that check) the callback does
            work.add_done_callback(lambda done: self._give_back_late(done, slots, layers))
            raise
        try:
            self._seq += 1
            seq = self._seq
            header = ChunkHeader(layer_begin=layers.start, layer_end=layers.stop, page_begin=page_begin,
                                 page_end=page_begin + len(src_pages))
            await self._emit(encode_chunk_event(seq, header, b"", 0, source_slots=slots,
                                                direct_bytes=len(src_pages) * self.pool.bytes_per_page * len(layers)))
            await self.wait_credited(seq, self.timeout_s)
        finally:  # read, or the room is over: either way nobody needs them any more
            self._release(exposed, slots, layers)

    def _stage(self, layers: range, page_begin: int, src_pages: list[int], slots: list[int], dirty: list[int],
               ready, abandoned: threading.Event) -> list[int] | None:
        """In a worker thread: gathers the pages into the slots (encrypted after `begin_cipher`,
        hashed for the MAC beside it) and exposes them; returns the registered addresses, handing
        the slots over, or None (given back) when the send was abandoned meanwhile."""
        hashing, touched, exposed, handed = None, range(len(self.staging.buffers)), [], False
        try:
            if abandoned.is_set():
                return None
            self.staging.scrub(dirty)
            touched = layers
            sync_ready(self.pool, ready)
            hashing = self._hash_sent(layers, page_begin, src_pages, ready)
            self.staging.fill_from(self.pool, layers, src_pages, slots, self._cipher, page_begin)
            exposed = self._expose(slots, layers)
            if hashing is not None:
                hashing, waiting = None, hashing
                waiting.wait()
            if abandoned.is_set():
                return None
            handed = True
            return exposed
        finally:
            try:
                if hashing is not None:
                    hashing.wait()
            finally:
                if not handed:
                    self._release(exposed, slots, touched)

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

    def _release(self, exposed: list[int], slots: list[int], layers: range) -> None:
        """Out of the engine's reach, zeroed in `layers`, back to the staging."""
        try:
            self._unexpose(exposed)
        finally:
            self._give_back(slots, layers)

    def _give_back_late(self, work: asyncio.Future, slots: list[int], layers: range) -> None:
        """A staging thread that finished after its send gave up and had handed the slots over."""
        if not work.cancelled() and work.exception() is None and work.result() is not None:
            self._release(work.result(), slots, layers)

