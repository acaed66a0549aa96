"""KV by one-sided writes with Mooncake's TransferEngine (TCP or RDMA).

Here: the sender and receiver the transport registries build, and the staging each allocates.
Beside it: `mooncake_engine.py` (one TransferEngine per rank, what it registers), `mooncake_sink.py`
(decode's side of one transfer) and `mooncake_channel.py` (prefill's writes and its checks on the
destination). The design, for all four:

Both workers start a `TransferEngine` in P2P-handshake mode. What they register is what any peer
that reaches the engine's ports may read and write (Mooncake authenticates nobody, not even in
0.3.14; its TCP server checks a write's range once, when its header arrives, and then takes the
body at the peer's pace).

Pulled transfers, the default (`TransportConfig.mooncake_kv_direction`, decode's choice): decode
*reads* the KV out of the prefill side's send staging (`mooncake_pull_channel.py` stages, registers
over TCP and reports each piece, then frees it on decode's credit; `mooncake_pull_sink.py` reads
each reported piece into its own slots and lands it as below). Mooncake needs no registration of a
READ's local side over TCP, so decode registers nothing (over RDMA its staging, the reads' landing),
and a prefill worker, holding the secret or not, reaches nothing of decode's: it can spoil only the
requests it serves. The rest of this design holds for both directions except where it names decode's
staging as a write target, which is the write direction's (`mooncake_kv_direction=write`):
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
- the prefill side never registers its pool either: each send's pages are gathered into a send
  staging, written from there and zeroed (`MooncakeChannel._write_staged`: the slots are the send's
  worker thread's until its write returns, past any deadline, so a hung write never zeroes another
  send's slots); over RDMA (the NIC reads only registered memory) it is registered, over TCP never;
- with a deployment secret, what either staging holds is ciphertext: the prefill side encrypts each
  cell as it gathers it, decode decrypts as it copies a send out (kv_cipher.py), so a stranger who
  reads a slot in flight (Mooncake serves reads of registered memory as it serves writes) gets no
  KV (tests/workers/test_security_mooncake_inflight_read.py);
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
addresses only in handshakes to registered prefill workers (decode/prefill_peers.py). A pulled
transfer's reads come from the source the signed ack names plus the slots each report names, each
checked below that source's slot count, one per page and none twice (`mooncake_pull_sink._refusal`),
into decode's own slots of that transfer: a lying prefill worker lands garbage only in its own
request's pages, which its MAC then refuses.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.kv.staging_size import staging_pages
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport import kv_cipher, kv_mac
from deepseek_pd.workers.transport.base import EmitChunk, KVReceiver, KVSender, KVSink, SendChannel, TransportConfig
from deepseek_pd.workers.transport.mooncake_channel import MooncakeChannel, check_destination, check_engine_match
from deepseek_pd.workers.transport.mooncake_pull_channel import MooncakePullChannel
from deepseek_pd.workers.transport.mooncake_pull_sink import MooncakePullSink
from deepseek_pd.workers.transport.mooncake_engine import MooncakeEngine
from deepseek_pd.workers.transport.mooncake_sink import MooncakeSink
from deepseek_pd.workers.transport.staging import StagingArea

log = logging.getLogger(__name__)
MAX_READ_POOLS = 256  # prefill workers whose pulled reads get threads of their own (MooncakeReceiver._reads_of)


def staging_for(pool: KVPool, config: TransportConfig) -> StagingArea:
    """The staging area `config.mooncake_staging_tokens` asks for (at most the pool's size), logged.
    Its memory is kept out of the pool's budget (model/kv/staging_size.py, workers/serve/kv_staging.py)."""
    pages = min(pool.num_pages, staging_pages(config.mooncake_staging_tokens, pool.page_size))
    log.info("mooncake staging: %d pages (%d tokens, %.1f MiB) on %s", pages, pages * pool.page_size,
             pages * pool.bytes_per_page * pool.num_layers / 2**20, pool.device)
    return StagingArea(pool, pages)


class MooncakeSender(KVSender):
    name = "mooncake"

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        super().__init__(pool, config)
        # The pool is never registered: each send is gathered (and encrypted: kv_cipher.py) into a
        # send staging and written from there; over RDMA the NIC reads only registered memory, so
        # the staging is registered; over TCP a write reads its local source without a registration.
        kv_cipher.require(pool.device)
        self.engine = MooncakeEngine(pool, config)
        self.staging = staging_for(pool, config)
        if self.engine.protocol != "tcp":
            self.engine.register_buffers(self.staging.base_addrs,
                                         [self.staging.num_pages * pool.bytes_per_page] * pool.num_layers)

    def answer_handshake(self, handshake: pb.Handshake, ack: pb.HandshakeAck) -> None:
        if handshake.WhichOneof("destination") != "mooncake" or not handshake.mooncake.pull:
            return
        source = ack.mooncake_source  # where decode reads: this rank's send staging
        source.session_id = self.engine.session_id
        source.layer_base_addrs.extend(self.staging.base_addrs)
        source.page_bytes = self.pool.bytes_per_page
        source.pool_pages = self.staging.num_pages

    def _open(self, handshake: pb.Handshake, emit: EmitChunk, streams: int) -> SendChannel:
        destination = handshake.mooncake
        if destination.pull:  # decode reads out of the send staging (mooncake_pull_channel.py)
            check_engine_match(destination, self.pool.bytes_per_page, self.engine.protocol)
            log.debug("room %d: mooncake %s serves %d pages to %s (decode DP rank %d), read by decode",
                      handshake.room, self.engine.session_id, len(handshake.page_ids), destination.session_id,
                      handshake.decode_dp_rank)
            return MooncakePullChannel(self.pool, self.engine, destination, handshake.page_ids,
                                       self.config.send_timeout_s, self.staging, emit)
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
        kv_cipher.require(pool.device)
        self.engine = MooncakeEngine(pool, config)
        self.staging = staging_for(pool, config)
        # Pulled (the default): decode reads the KV out of the prefill side's send staging, and over
        # TCP registers nothing; over RDMA the staging is the reads' landing (the NIC needs it registered).
        self.pull = config.mooncake_kv_direction == "pull"
        # Windows' copies out of the staging (`MooncakeSink.on_chunk`), off the event loop.
        self._copies = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-land")
        self._reads: dict[str, ThreadPoolExecutor] = {}  # pulled: per prefill worker (`_reads_of`)
        if self.engine.protocol != "tcp":  # the NIC needs its memory regions, and writers cache their keys
            self.engine.register_buffers(self.staging.base_addrs,
                                         [self.staging.num_pages * pool.bytes_per_page] * pool.num_layers)

    def open_sink(self, pages: Sequence[int], peer_host: str | None = None) -> KVSink:
        if not self.pull:
            return MooncakeSink(self.pool, pages, self.engine, self.staging, self.config.send_timeout_s, self._copies)
        return MooncakePullSink(self.pool, pages, self.engine, self.staging, self.config.send_timeout_s,
                                self._reads_of(peer_host))

    def _reads_of(self, peer_host: str | None) -> ThreadPoolExecutor:
        """Where the pulled sends of prefill worker `peer_host` are read and landed: threads of its
        own, so a peer whose engine stalls reads (each bounded by Mooncake's transfer timeout) holds
        up only its own requests, never another prefill worker's. Threads start only once a
        handshake with that (registered) peer succeeded; past MAX_READ_POOLS names, the shared pool."""
        key = peer_host or ""
        pool = self._reads.get(key)
        if pool is None:
            if len(self._reads) >= MAX_READ_POOLS:
                return self._copies
            pool = self._reads[key] = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix=f"kv-read-{key}")
        return pool

    def fill_destination(self, handshake: pb.Handshake) -> None:
        handshake.mooncake.session_id = self.engine.session_id  # (pulled: the engine that reads, for logs)
        if self.pull:  # nothing of ours to write into: the prefill side answers with its source
            handshake.mooncake.pull = True
        else:
            handshake.mooncake.layer_base_addrs.extend(self.staging.base_addrs)
        handshake.mooncake.page_bytes = self.pool.bytes_per_page
        handshake.mooncake.pool_pages = self.staging.num_pages
        handshake.mooncake.protocol = self.engine.protocol
        handshake.mooncake.kv_mac_algorithms.extend(kv_mac.algorithms())
        handshake.mooncake.report_sends = True  # each send lands and is MACed as it comes (MooncakeSink)
        handshake.mooncake.kv_cipher_algorithms.extend(kv_cipher.algorithms())  # (used with a secret)

    def close(self) -> None:
        self._copies.shutdown(wait=False)
        for pool in self._reads.values():
            pool.shutdown(wait=False)
        self.engine.close()
