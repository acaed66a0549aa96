"""KV by one-sided writes with Mooncake's TransferEngine (TCP or RDMA).

Both workers start a `TransferEngine` in P2P-handshake mode. What they register is what any peer
that reaches the engine's ports may read and write (Mooncake authenticates nobody, not even in
0.3.14; its TCP server checks a write's range once, when its header arrives, and then takes the
body at the peer's pace):
- the decode side never registers its KV pool: writers reach only the slots of a small staging
  area (staging.py), registered per transfer while it runs over TCP (`MooncakeSink.expose`/`land`,
  around `pull_kv`'s transfer) and for good over RDMA (the NIC needs its memory regions); after
  the TransferDone decode copies the slots into the request's own pages (`MooncakeSink.land`) and
  checks the copy, so a write that lands later (a slow body) reaches no page the model reads;
- a prompt longer than the whole staging moves through a window of half of it
  (`MooncakeDestination.window_pages`): the prefill side writes whole pages a half window at a
  time, each once decode landed the pages whose slots it reuses (`Credit.landed_pages`, the room's
  `wait_landed`), and reports each on the stream as a KVChunk without data; decode copies each
  reported run into the request's pages as it comes (`MooncakeSink.on_chunk`) and checks the MAC
  over the whole private copy after the TransferDone, as for any transfer;
- the prefill side never registers its pool either: over TCP a write reads its local source
  directly; over RDMA (the NIC reads only registered memory) each send's pages are gathered into a
  registered send staging, written from there and zeroed (`MooncakeChannel._write_staged`);
- whatever a stranger writes into the slots before the copy fails that request: the prefill side
  seals what it sent with a keyed MAC in the signed TransferDone (`MooncakeChannel.seal`), the
  decode side checks the private copy (`MooncakeSink.check_sealed`; kv_mac.py)
  (tests/workers/test_security_mooncake_pool.py, test_security_mooncake_slow_body.py).
The decode side's handshake carries its engine's session id
(`host:rpc_port`), the base address of each staging layer buffer, the slots as `page_ids` and the
page size in bytes; the prefill
side then turns each `send` into ONE `batch_transfer_sync_write` covering all layers and all
contiguous page runs (batching per chunk rather than per layer took SGLang's transfers from
650 ms to 60 ms, FACTS "KV transfer"). The engine binds 0.0.0.0 whatever it is told (0.3.13.post1
ignores MC_TCP_BIND_ADDRESS for its listeners): tests run it inside a private network namespace,
and in Kubernetes the NetworkPolicy keeps other pods off its ports (docs/operations.md, Security).

Trust: the prefill side writes only where an authenticated handshake (the bootstrap servicer
checks its token before the room sees it) says, and only to pages that handshake lists, each
checked below the destination's size (`check_destination`); addresses come from the handshake's
layer bases plus page ids, never from anything else a peer sends. The decode side reveals its
addresses only in handshakes to registered prefill workers (decode/prefill_peers.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.kv.staging_size import staging_pages
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import kv_mac
from deepseek_pd.workers.transport.base import (
    EmitChunk, KVReceiver, KVSender, KVSink, SendChannel, TransportConfig, check_page_ids)
from deepseek_pd.workers.transport.page_io import consecutive_runs, sync_ready
from deepseek_pd.workers.transport.plan import merge_page_runs
from deepseek_pd.workers.transport.send_landing import SendLanding
from deepseek_pd.workers.transport.staging import StagingArea
from deepseek_pd.workers.transport.wire import ChunkHeader, encode_chunk_event
from deepseek_pd.workers.engine.request_failure import TransferError

log = logging.getLogger(__name__)
_warned_unsealed = False  # MooncakeSink.check_sealed: said once per process


def exposure_warning(host: str) -> str:
    """What to tell whoever starts Mooncake on `host`: its listener is wider than that."""
    return (f"mooncake's TransferEngine listens on ALL interfaces (0.0.0.0), not only {host}: it ignores the "
            f"address it is given (0.3.13.post1). Its ports authenticate no peer (a stranger can write the "
            f"staging of transfers in flight, failing them by their KV MAC, and over rdma read the KV in "
            f"flight); keep other hosts off them "
            f"(a firewall; in Kubernetes the deployment's NetworkPolicy). docs/operations.md, Security")


class MooncakeEngine:
    """One TransferEngine over a KV pool; `register_pool`: its layer buffers registered for good
    (else nothing is, unless `register_buffers` or a transfer registers its staging: `MooncakeSink`)."""

    def __init__(self, pool: KVPool, config: TransportConfig, register_pool: bool = True) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise UserError(f"KV transport 'mooncake' is not usable here: {exc} "
                            "(install mooncake-transfer-engine and Debian libibverbs1, or use --kv-transport grpc)"
                            ) from exc
        if config.advertise_host in ("0.0.0.0", "::", ""):
            raise UserError(f"KV transport 'mooncake' needs the address peers reach this worker at, not "
                            f"{config.advertise_host!r}: set the transport's advertise_host (e.g. the pod IP)")
        if pool.device.type != "cpu" and config.mooncake_protocol == "tcp":
            log.warning("mooncake over tcp with a %s pool: needs a CUDA-enabled mooncake build", pool.device)
        self.engine: Any = TransferEngine()
        status = self.engine.initialize(config.advertise_host, "P2PHANDSHAKE",
                                        config.mooncake_protocol, config.mooncake_device)
        if status != 0:
            raise UserError(f"mooncake TransferEngine.initialize({config.advertise_host!r}, P2PHANDSHAKE, "
                            f"{config.mooncake_protocol!r}) failed with status {status}")
        self.protocol = config.mooncake_protocol
        self.session_id = f"{config.advertise_host}:{self.engine.get_rpc_port()}"
        log.info("mooncake TransferEngine %s over %s (devices: %s)", self.session_id, self.protocol,
                 config.mooncake_device or "all")
        if config.warn_exposure:  # every rank's engine listens so; the node's first rank says it
            log.warning("%s (port %d)", exposure_warning(config.advertise_host), self.engine.get_rpc_port())
        self.base_addrs = [buffer.data_ptr() for buffer in pool.buffers]
        self.layer_bytes = [buffer.numel() * buffer.element_size() for buffer in pool.buffers]
        self._registered: list[int] = []
        if register_pool:
            self.register_buffers(self.base_addrs, self.layer_bytes)

    def register_buffers(self, addrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Registers buffers until `close`; raises UserError (after undoing all) if one is refused."""
        for addr, length in zip(addrs, lengths):
            if self.engine.register_memory(addr, length) != 0:
                self.close()
                raise UserError(f"mooncake could not register a {length}-byte KV buffer "
                                "(RDMA needs IPC_LOCK and GPUDirect; see docs)")
            self._registered.append(addr)

    def close(self) -> None:
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered.clear()


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
        self._on_land = None  # `check_on_landing`'s check
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

    def begin_check(self, key: bytes | None, room: int) -> None:
        if key is not None:  # (after `offer_into`: the header names the slots the handshake told)
            self._landing.begin_mac(self.pool, self.pages, key, kv_mac.header(room, self._told))

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
                self._staging.copy_into(self.pool, self._slots_of(range(self.landed, upto)),
                                        self.pages[self.landed:upto])  # (and zeroes the slots)
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
            self._staging.copy_into(self.pool, self.slots[begin:end], self.pages[begin:end], layers)
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
            self._on_land(layers, pages)
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
            self._staging.copy_into(self.pool, rest, self.pages[first:])  # (and zeroes the slots)
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
        try:
            # Landed send by send: only a digest is left. Else (or from here) the copies were
            # synchronised: the reads wait for no decode step queued meanwhile.
            macs = self._landing.take_macs(key, done.kv_mac_algorithm)
            tag = macs.digest() if macs is not None else kv_mac.kv_mac(
                self.pool, self.pages, key, kv_mac.header(room, self._told), done.kv_mac_algorithm, synced=True)
        except ValueError as exc:
            raise self.fail(TransferError(FailureCode.INTERNAL, f"cannot check the KV's MAC: {exc}")) from None
        if not kv_mac.tags_equal(tag, done.kv_mac):
            raise self.fail(TransferError(FailureCode.INTERNAL,
                                          f"the received KV of room {room} does not match the MAC the prefill "
                                          f"worker signed ({done.kv_mac_algorithm}): something else wrote into "
                                          f"its staging pages during the transfer; KV transfer refused"))


def staging_for(pool: KVPool, config: TransportConfig) -> StagingArea:
    """The staging area `config.mooncake_staging_tokens` asks for (at most the pool's size), logged.
    Its memory is kept out of the pool's budget (model/kv/staging_size.py, workers/serve/kv_staging.py)."""
    pages = min(pool.num_pages, staging_pages(config.mooncake_staging_tokens, pool.page_size))
    log.info("mooncake staging: %d pages (%d tokens, %.1f MiB) on %s", pages, pages * pool.page_size,
             pages * pool.bytes_per_page * pool.num_layers / 2**20, pool.device)
    return StagingArea(pool, pages)


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
    """`staging` (over RDMA): where each send's pages are gathered for the NIC, which reads only
    registered memory; None (TCP): writes read the pool itself, unregistered."""

    def __init__(self, pool: KVPool, engine: MooncakeEngine, destination: pb.MooncakeDestination,
                 dst_pages: Sequence[int], timeout_s: float, staging: StagingArea | None = None,
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
        self._src_pages: list[int | None] = [None] * len(self.dst_pages)  # request page -> ours, for `seal`
        self._macs: kv_mac.LayerMacs | None = None  # `begin_seal`: the MAC, as the sends go out
        self._mac_room: int | None = None
        self._mac_algorithm = next((name for name in destination.kv_mac_algorithms
                                    if name in kv_mac.algorithms()), None)
        if destination.kv_mac_algorithms and self._mac_algorithm is None:
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"decode checks the KV with a MAC of {list(destination.kv_mac_algorithms)}, "
                                f"this prefill worker computes {list(kv_mac.algorithms())}: install "
                                f"`cryptography` on both or neither")

    async def send(self, src_pages: Sequence[int], page_begin: int, layer_begin: int = 0,
                   layer_end: int | None = None, ready=None) -> None:
        layers = self._check_range(src_pages, page_begin, layer_begin, layer_end)
        self._src_pages[page_begin:page_begin + len(src_pages)] = src_pages
        if self.window:
            await self._send_windows(list(src_pages), page_begin, layers, ready)
        else:
            await self._write_pages(layers, page_begin, list(src_pages),
                                    self.dst_pages[page_begin:page_begin + len(src_pages)], ready)
            if self.reports:
                await self._report(layers, page_begin, page_begin + len(src_pages))
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
        if self.staging is None:
            status = await self._timed(asyncio.to_thread(self._write, layers, page_begin, src_pages, dst, ready))
        else:  # in pieces the staging holds, each through slots held only while it is written
            status, step = 0, self.staging.num_pages
            for begin in range(0, len(src_pages), step):
                if status == 0:
                    status = await self._write_staged(layers, page_begin + begin, src_pages[begin:begin + step],
                                                      dst[begin:begin + step], ready)
        if status != 0:
            raise TransferError(FailureCode.UNAVAILABLE,
                                f"mooncake write to {self.destination.session_id} failed (status {status})")

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
        if None in self._src_pages:
            raise TransferError(FailureCode.INTERNAL, "KV MAC asked for before every page was sent")
        macs = self._macs
        if macs is None or macs.key != key or self._mac_room != room:  # not begun (or for another transfer)
            macs = kv_mac.LayerMacs(self.pool.num_layers, key, kv_mac.header(room, self.dst_pages),
                                    self._mac_algorithm)
        self._macs = None
        done.kv_mac = macs.digest(self.pool, self._src_pages)
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
        """One piece through staging slots; they go back zeroed (what the NIC may still read after a
        timeout cools first: that write fails its request by the KV MAC, nothing else)."""
        slots, dirty = await self.staging.acquire(len(src_pages), self.timeout_s)
        try:
            status = await self._timed(asyncio.to_thread(self._write_from_slots, layers, page_begin, src_pages, slots, dirty,
                                                         dst_pages, ready))
        except BaseException:
            self.staging.release(slots, delay_s=self.timeout_s)
            raise
        self.staging.release(slots, scrubbed=True)
        return status

    def _write_from_slots(self, layers: range, page_begin: int, src_pages: list[int], slots: list[int], dirty: list[int],
                          dst_pages: list[int], ready) -> int:
        """In a worker thread: gathers the pages into the slots once their KV is written, one batch
        write from there, then zeroes what it used (a reader of the registered staging sees no KV
        that is not in flight)."""
        self.staging.scrub(dirty)
        sync_ready(self.pool, ready)
        hashing = self._hash_sent(layers, page_begin, src_pages, ready)
        try:
            self.staging.fill_from(self.pool, layers, src_pages, slots)
            batch = build_write_batch(self.staging.base_addrs[layers.start:layers.stop],
                                      list(self.destination.layer_base_addrs)[layers.start:layers.stop],
                                      self.pool.bytes_per_page, slots, dst_pages)
            status = self.engine.engine.batch_transfer_sync_write(self.destination.session_id, *batch)
            self.staging.scrub(slots, layers)
        finally:
            if hashing is not None:
                hashing.wait()
        return status

    def _write(self, layers: range, page_begin: int, src_pages: list[int], dst_pages: list[int], ready) -> int:
        """In a worker thread: ONE batch write for every layer and merged page run of this send
        (FACTS "KV transfer"); building the batch (1 ms for 64 pages x 27 layers) stays off the loop."""
        batch = build_write_batch(self.engine.base_addrs[layers.start:layers.stop],
                                  list(self.destination.layer_base_addrs)[layers.start:layers.stop],
                                  self.pool.bytes_per_page, src_pages, dst_pages)
        sync_ready(self.pool, ready)  # the NIC reads the pool behind torch's back
        hashing = self._hash_sent(layers, page_begin, src_pages, ready)
        try:
            return self.engine.engine.batch_transfer_sync_write(self.destination.session_id, *batch)
        finally:
            if hashing is not None:
                hashing.wait()


def check_destination(destination: pb.MooncakeDestination, page_ids: Sequence[int], page_bytes: int,
                      num_layers: int, protocol: str) -> None:
    """Every write of this room lands inside the decode staging's layer buffers, over the protocol
    this engine speaks, and windowed page ids repeat one window's slots: raises TransferError."""
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


class MooncakeSender(KVSender):
    name = "mooncake"

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        super().__init__(pool, config)
        # The pool is never registered: over TCP a write reads its local source without a
        # registration; over RDMA the NIC reads a send staging the pages are gathered into.
        self.engine = MooncakeEngine(pool, config, register_pool=False)
        self.staging = None
        if self.engine.protocol != "tcp":
            self.staging = staging_for(pool, config)
            self.engine.register_buffers(self.staging.base_addrs,
                                         [self.staging.num_pages * pool.bytes_per_page] * pool.num_layers)

    def _open(self, handshake: pb.Handshake, emit: EmitChunk, streams: int) -> SendChannel:
        destination = handshake.mooncake
        check_destination(destination, handshake.page_ids, self.pool.bytes_per_page, self.pool.num_layers,
                          self.engine.protocol)
        # Which engine writes into which: under DP each rank's own engine writes rank to rank.
        log.debug("room %d: mooncake %s writes %d pages into %s (decode DP rank %d)", handshake.room,
                  self.engine.session_id, len(handshake.page_ids), destination.session_id, handshake.decode_dp_rank)
        return MooncakeChannel(self.pool, self.engine, destination, handshake.page_ids,
                               self.config.send_timeout_s, self.staging, emit)

    def close(self) -> None:
        self.engine.close()


class MooncakeReceiver(KVReceiver):
    name = "mooncake"

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        super().__init__(pool, config)
        # The pool is never registered: writers reach only the staging (staging.py).
        self.engine = MooncakeEngine(pool, config, register_pool=False)
        self.staging = staging_for(pool, config)
        # Windows' copies out of the staging (`MooncakeSink.on_chunk`), off the event loop.
        self._copies = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-land")
        if self.engine.protocol != "tcp":  # the NIC needs its memory regions, and writers cache their keys
            self.engine.register_buffers(self.staging.base_addrs,
                                         [self.staging.num_pages * pool.bytes_per_page] * pool.num_layers)

    def open_sink(self, pages: Sequence[int], peer_host: str | None = None) -> KVSink:
        return MooncakeSink(self.pool, pages, self.engine, self.staging, self.config.send_timeout_s, self._copies)

    def fill_destination(self, handshake: pb.Handshake) -> None:
        handshake.mooncake.session_id = self.engine.session_id
        handshake.mooncake.layer_base_addrs.extend(self.staging.base_addrs)
        handshake.mooncake.page_bytes = self.pool.bytes_per_page
        handshake.mooncake.pool_pages = self.staging.num_pages
        handshake.mooncake.protocol = self.engine.protocol
        handshake.mooncake.kv_mac_algorithms.extend(kv_mac.algorithms())
        handshake.mooncake.report_sends = True  # each send lands and is MACed as it comes (MooncakeSink)

    def close(self) -> None:
        self._copies.shutdown(wait=False)
        self.engine.close()
