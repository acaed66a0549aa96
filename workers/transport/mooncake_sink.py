"""The decode side of a Mooncake transfer: its staging slots, their registration while it runs,
the copy into the request's own pages (decrypted on the way: kv_cipher.py) and the MAC check of
that copy (workers/transport/mooncake.py gives the whole design)."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from typing import Sequence

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import kv_cipher, kv_mac
from deepseek_pd.workers.transport.base import KVSink
from deepseek_pd.workers.transport.mooncake_engine import MooncakeEngine
from deepseek_pd.workers.transport.page_io import consecutive_runs
from deepseek_pd.workers.transport.send_landing import SendLanding
from deepseek_pd.workers.transport.staging import StagingArea
from deepseek_pd.workers.engine.request_failure import TransferError

log = logging.getLogger(__name__)
_warned_unsealed = False  # MooncakeSink.check_sealed: said once per process


class MooncakeSink(KVSink):
    """A decode transfer over Mooncake into staging slots (staging.py), never into the pages the model
    reads: `reserve` takes the slots (waiting on the event loop while the staging is full; a prompt
    longer than the staging takes half of it as a window, landed run by run in `on_chunk`), `expose`
    over TCP registers each layer's runs of them, the handshake lists them as the pages to write
    (`offer_into`); each send's report lands its cells in the request's pages (`on_chunk`, MACed
    there: send_landing.py); `land` unregisters the slots, copies what did not land yet and gives them
    back; `check_sealed` then checks the MAC of that private copy against the tag of what the prefill side sent (kv_mac.py), since anyone
    who reaches the engine's ports may have written the slots too. A transfer that ends otherwise
    (`withdraw`) lets its slots cool for the late-write grace before they are reused."""

    registers_pages = True
    one_sided = False  # a writer reaches only the staging: the pages are written by `land` alone

    def __init__(self, pool: KVPool, pages: Sequence[int], engine: MooncakeEngine, staging: StagingArea,
                 timeout_s: float, executor: Executor | None = None) -> None:
        super().__init__(pool, pages)
        self._engine = engine
        self._staging = staging
        self._timeout_s = timeout_s  # the slots' late-write grace, and the default wait for staging room
        self._register = engine.protocol == "tcp"  # over RDMA the staging is registered for good
        self.executor = executor  # where a window's copy runs (`on_chunk`)
        self.slots: list[int] = []  # the transfer's staging slots, while it runs
        # A prompt longer than the staging moves in windows of `window` pages (0: it has a slot per
        # page): page i goes through slot `slots[i % window]`; pages below `landed` are copied out.
        self.window = 0
        self.landed = 0
        self._written: set[int] = set()  # request pages reported written and not landed yet (windows)
        self._told: list[int] = []  # each request page's slot as the handshake named it, for the MAC's header
        self._dirty: list[int] = []  # slots to zero before they are exposed
        self._exposed: list[int] = []
        # Without windows, each send lands (copied out and MACed) as its report comes (send_landing.py).
        self._landing = SendLanding(pool.num_layers, len(self.pages))
        self._mac_agreed = ""  # `begin_check`: the MAC the signed ack agreed
        self._on_land = None  # `check_on_landing`'s check
        self._cipher: kv_cipher.CellCipher | None = None  # `begin_cipher`: the slots hold ciphertext
        # expose runs in a worker thread; a withdraw (the transfer cancelled meanwhile) waits for it
        # and wins: nothing stays registered or held after it.
        self._lock = threading.Lock()
        self._over = threading.Event()

    async def reserve(self, timeout_s: float | None = None) -> None:
        # A prompt longer than the whole staging moves through half of it in windows (the other half
        # stays for the prompts that fit, which take a slot per page).
        fits = len(self.pages) <= self._staging.num_pages
        count = len(self.pages) if fits else max(1, self._staging.num_pages // 2)
        try:
            slots, dirty = await self._staging.acquire(count, self._timeout_s if timeout_s is None else timeout_s)
        except TransferError as exc:
            raise self.fail(exc) from None
        if self._over.is_set():  # withdrawn meanwhile (not by cancelling this task)
            self._staging.release(slots, scrubbed=not dirty)
            raise self.fail(TransferError(FailureCode.ABORTED, "the transfer ended while it took staging room"))
        self.slots, self._dirty = slots, dirty
        self.window = 0 if fits else count

    @property
    def landed_pages(self) -> int:
        return self.landed

    def expose(self) -> None:
        with self._lock:
            if self._over.is_set():
                raise self.fail(TransferError(FailureCode.ABORTED, "the transfer ended before its staging was exposed"))
            self._staging.scrub(self._dirty)  # a failed transfer's bytes, before anyone may read them
            self._dirty = []
            page_bytes = self._staging.page_bytes
            for base in self._staging.base_addrs if self._register else []:
                for begin, end, first in consecutive_runs(self.slots):
                    addr = base + first * page_bytes
                    if self._engine.engine.register_memory(addr, (end - begin) * page_bytes) != 0:
                        self._unregister()
                        raise self.fail(TransferError(FailureCode.INTERNAL, "mooncake could not register "
                                                      "the transfer's staging pages"))
                    self._exposed.append(addr)

    def offer_into(self, handshake: pb.Handshake) -> None:
        # The writer writes the staging slots (the destination's layer bases are the staging's).
        self._told = self._slots_of(range(len(self.pages)))
        del handshake.page_ids[:]
        handshake.page_ids.extend(self._told)
        handshake.mooncake.window_pages = self.window

    def _slots_of(self, pages: range) -> list[int]:
        """The staging slot of each request page in `pages`."""
        return [self.slots[i % self.window] for i in pages] if self.window else self.slots[pages.start:pages.stop]

    def begin_cipher(self, algorithm: str, key: bytes) -> None:
        try:
            self._cipher = kv_cipher.CellCipher(key, self.pool.bytes_per_page, self.pool.device, algorithm)
        except ValueError as exc:
            raise self.fail(TransferError(FailureCode.INTERNAL, f"cannot decrypt the KV: {exc}")) from None

    def begin_check(self, key: bytes | None, room: int, algorithm: str = "") -> None:
        self._mac_agreed = algorithm
        if key is not None and algorithm:  # (after `offer_into`: the header names the slots the handshake told)
            self._landing.begin_mac(self.pool, self.pages, key, kv_mac.header(room, self._told), algorithm)

    def on_chunk(self, chunk) -> None:
        """A send's or a window's report (no data): the prefill side wrote request pages
        [page_begin, page_end) of its layers (a window: every layer) into their slots. Copies them out
        (and zeroes the slots) and MACs the copy; a window's credit then lets the writer reuse its
        slots (`landed_pages`)."""
        if self.failed is not None:
            raise self.failed
        if not self.window:
            self._land_send(chunk)
            return
        begin, end = chunk.page_begin, chunk.page_end
        with self._lock:  # (chunks may come in several threads at once)
            if self._over.is_set():
                raise self.fail(TransferError(FailureCode.ABORTED, "the transfer ended before its window landed"))
            if (not chunk.written_directly or len(chunk.data)
                    or (chunk.layer_begin, chunk.layer_end) != (0, self.pool.num_layers)
                    or not self.landed <= begin < end <= min(self.landed + self.window, len(self.pages))
                    or self._written & set(range(begin, end))):
                raise self.fail(TransferError(FailureCode.INTERNAL,
                                              f"prefill reported pages [{begin}, {end}) of layers "
                                              f"[{chunk.layer_begin}, {chunk.layer_end}) written; the window holds "
                                              f"pages [{self.landed}, {self.landed + self.window}) of every layer"))
            self._written.update(range(begin, end))
            landed = upto = self.landed
            while upto in self._written:
                upto += 1
            if upto > self.landed:
                self.exposure.wrote()
                with self.stats.timed("write"):
                    self._staging.copy_into(self.pool, self._slots_of(range(self.landed, upto)),
                                            self.pages[self.landed:upto], None, self._cipher,
                                            self.landed)  # (and zeroes the slots)
                self._written.difference_update(range(self.landed, upto))
                self.landed = upto
        if upto > landed:  # (the pages this report let land: hashed in order, after the copy)
            self._landing.hash(range(self.pool.num_layers), landed, upto)
            self._check_landed(range(self.pool.num_layers), self.pages[landed:upto])

    def _land_send(self, chunk) -> None:
        """One send's report: its cells, each landed once, copied out of the slots, then hashed."""
        layers, begin, end = range(chunk.layer_begin, chunk.layer_end), chunk.page_begin, chunk.page_end
        with self._lock:  # (chunks may come in several threads at once)
            if self._over.is_set():
                raise self.fail(TransferError(FailureCode.ABORTED, "the transfer ended before its send landed"))
            refused = (None if chunk.written_directly and not len(chunk.data) else
                       "prefill sent KV bytes on the stream; mooncake reports carry none")
            if refused is None:
                refused = self._landing.claim(layers, begin, end)
            if refused is not None:
                raise self.fail(TransferError(FailureCode.INTERNAL, refused))
            self.exposure.wrote()
            with self.stats.timed("write"):
                self._staging.copy_into(self.pool, self.slots[begin:end], self.pages[begin:end], layers,
                                        self._cipher, begin)
        self._landing.hash(layers, begin, end)
        self._check_landed(layers, self.pages[begin:end])

    def check_on_landing(self, check) -> None:
        self._on_land = check

    def checked_on_landing(self) -> bool:  # (after check_complete: every cell landed by report or window)
        return self._on_land is not None and (self._landing.reported or self.window > 0)

    def _check_landed(self, layers: range, pages: list[int]) -> None:
        if self._on_land is None:
            return
        try:
            with self.stats.timed("check"):
                self._on_land.pages(layers, pages)
        except TransferError as exc:  # kept: the MAC's verdict is reported first (kv_pull.py)
            with self._lock:
                self.landing_failure = self.landing_failure or exc

    def _check_cells(self) -> None:
        if self.window and self.landed != len(self.pages):
            raise self.fail(TransferError(FailureCode.INTERNAL, f"prefill reported {self.landed} of "
                                          f"{len(self.pages)} pages written through the staging window"))
        if (missing := self._landing.missing()) is not None:
            raise self.fail(TransferError(FailureCode.INTERNAL, missing))

    def withdraw(self) -> None:
        slots = self._end()
        # Its prefill side may still be writing them (it learns of the failure late): let them cool.
        self._staging.release(slots, self._timeout_s if self._told else 0.0)

    def land(self) -> None:
        # (windowed or reported send by send: all landed already)
        first = len(self.pages) if self._landing.reported else self.landed
        rest = self._slots_of(range(first, len(self.pages)))
        slots = self._end()
        try:
            self.exposure.wrote()
            with self.stats.timed("write"):
                self._staging.copy_into(self.pool, rest, self.pages[first:], None, self._cipher,
                                        first)  # (and zeroes the slots)
        except BaseException:
            self._staging.release(slots)
            raise
        self.landed = len(self.pages)
        self._staging.release(slots, scrubbed=True)  # every write of the prefill side completed before its done

    def _end(self) -> list[int]:
        """Stops the writer's reach and hands back the slots still held (once)."""
        self._over.set()
        with self._lock:
            self._unregister()
            slots, self.slots = self.slots, []
        return slots

    def _unregister(self) -> None:
        for addr in self._exposed:
            self._engine.engine.unregister_memory(addr)
        self._exposed.clear()

    def check_reads(self) -> bool:
        return self._landing.reads_left()

    def check_sealed(self, done: pb.TransferDone, key: bytes | None, room: int) -> None:
        if key is None:
            return
        if not done.kv_mac:
            # The done is signed, so no stranger stripped the MAC: this prefill worker predates it
            # (one that has it always seals when offered). Refusing would fail every request between
            # old prefill and new decode workers during a rolling upgrade.
            global _warned_unsealed
            if not _warned_unsealed:
                _warned_unsealed = True
                log.warning("a prefill worker sent KV without a MAC (an older version): its transfers are not "
                            "checked against writes by strangers on the mooncake ports; upgrade it")
            return
        if self._mac_agreed and done.kv_mac_algorithm != self._mac_agreed:
            raise self.fail(TransferError(FailureCode.INVALID_ARGUMENT,
                                          f"the prefill worker's TransferDone names the KV MAC "
                                          f"{done.kv_mac_algorithm!r}, its ack agreed {self._mac_agreed!r}"))
        try:
            # Landed send by send: only a digest is left. Else (or from here) the copies were
            # synchronised: the reads wait for no decode step queued meanwhile.
            macs = self._landing.take_macs(key, done.kv_mac_algorithm)
            if macs is None:
                macs = kv_mac.LandedMacs(self.pool, self.pages, key, kv_mac.header(room, self._told),
                                         done.kv_mac_algorithm)
            tag = macs.digest()
            self.stats.add("mac", macs.seconds)
        except ValueError as exc:
            raise self.fail(TransferError(FailureCode.INTERNAL, f"cannot check the KV's MAC: {exc}")) from None
        if not kv_mac.tags_equal(tag, done.kv_mac):
            raise self.fail(TransferError(FailureCode.INTERNAL,
                                          f"the received KV of room {room} does not match the MAC the prefill "
                                          f"worker signed ({done.kv_mac_algorithm}): something else wrote into "
                                          f"its staging pages during the transfer; KV transfer refused"))
