"""Pulled Mooncake transfers (workers/transport/mooncake_pull_channel.py, mooncake_pull_sink.py) in
one process, on the stub engine (pdtest/mooncake_stub.py), which serves a READ only from memory the
peer registered now and, over RDMA, only into memory the reader registered: every page lands equal
to the prefill pool's, over TCP decode registers nothing at any time, and every prefill slot goes
back unregistered. The real engine, in a network namespace: test_kv_transfer_mooncake.py and the
tests/workers/test_security_mooncake_*.py attacks. Also the wire form of a pulled report and what
decode refuses of a bad peer's reports and acks."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport import TransportConfig, build_receiver
from deepseek_pd.workers.transport.bootstrap_protocol import (
    PROTOCOL_VERSION, PULL_PROTOCOL_VERSION, handshake_version, version_refusal_hint)
from deepseek_pd.workers.transport.wire import ChunkHeader, ChunkView, decode_event, encode_chunk_event
from pdtest import mooncake_stub
from pdtest.kv_transfer_harness import pages_equal, random_exchange, random_pool, run_exchange


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_a_pulled_transfer_lands_every_page_and_decode_registers_nothing_over_tcp(monkeypatch, protocol):
    engines = mooncake_stub.install(monkeypatch)
    rng = random.Random()
    page_size = rng.choice([1, 2, 4])
    exchange = random_exchange(rng, "mooncake", num_tokens=rng.randrange(2, 60), page_size=page_size,
                               layerwise=rng.random() < 0.5, seed=rng.randrange(1 << 30))
    # Stagings smaller than the prompt now and then: pieces on the prefill side, a window on decode's.
    tokens = rng.choice([2 * page_size, 4096])
    config = TransportConfig(mooncake_protocol=protocol, mooncake_staging_tokens=tokens)
    exchange = type(exchange)(**{**exchange.__dict__, "transport_config": config})
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(prefill, BaseException), repr(prefill)
    assert not isinstance(decode, BaseException), repr(decode)
    assert pages_equal(exchange)
    sender_engine, receiver_engine = engines  # (built in that order)
    assert sender_engine.writes == [] and receiver_engine.writes == []
    assert receiver_engine.reads and all(session == f"127.0.0.1:{sender_engine.get_rpc_port()}"
                                         for session, *_ in receiver_engine.reads)
    if protocol == "tcp":
        assert receiver_engine.ever_registered == [], "decode registered memory a peer could write"
        assert sender_engine.ever_registered and sender_engine.registered == {}, "a slot stayed registered"
    else:  # both stagings registered for good (the NIC's memory regions), nothing else
        assert len(receiver_engine.ever_registered) == len(sender_engine.ever_registered) == exchange.src.pool.num_layers


def test_a_pulled_report_keeps_its_source_slots_on_the_wire():
    slots = random.sample(range(1 << 20), random.randrange(1, 40))
    header = ChunkHeader(0, random.randrange(1, 60), 3, 3 + len(slots))
    encoded = encode_chunk_event(random.randrange(1, 1000), header, b"", 0, direct_bytes=7, source_slots=slots)
    assert list(pb.TransferEvent.FromString(encoded.payload).chunk.source_slots) == slots  # protobuf's view
    assert list(decode_event(encoded.payload).chunk.source_slots) == slots  # ours, without a copy
    unpacked = pb.TransferEvent.FromString(encoded.payload)
    raw = unpacked.SerializeToString()
    assert list(decode_event(raw).chunk.source_slots) == slots


def test_pull_handshakes_go_out_as_version_3_and_an_older_prefills_refusal_names_the_cure():
    handshake = pb.Handshake()
    handshake.mooncake.page_bytes = 8
    assert handshake_version(handshake) == PROTOCOL_VERSION
    handshake.mooncake.pull = True
    assert handshake_version(handshake) == PULL_PROTOCOL_VERSION
    handshake.protocol_version = handshake_version(handshake)
    assert "mooncake_kv_direction=write" in version_refusal_hint(handshake)
    assert version_refusal_hint(pb.Handshake(protocol_version=PROTOCOL_VERSION)) == ""


def _sink(monkeypatch, pages: int = 3):
    mooncake_stub.install(monkeypatch)
    pool = random_pool(random.Random(), 8, 2)
    receiver = build_receiver("mooncake", pool, TransportConfig())
    sink = receiver.open_sink(list(range(pages)))
    asyncio.run(sink.reserve())
    sink.expose()
    return pool, receiver, sink


def _ack(pool, slots: int = 4) -> pb.HandshakeAck:
    ack = pb.HandshakeAck()
    ack.mooncake_source.session_id = "127.0.0.1:15999"
    ack.mooncake_source.layer_base_addrs.extend([1 << 30] * pool.num_layers)
    ack.mooncake_source.page_bytes = pool.bytes_per_page
    ack.mooncake_source.pool_pages = slots
    return ack


@pytest.mark.parametrize("bad", ["no source", "short", "outside", "twice", "data"])
def test_decode_refuses_a_bad_peers_pulled_report_before_reading(monkeypatch, bad):
    pool, receiver, sink = _sink(monkeypatch)
    try:
        if bad != "no source":
            sink.accept_answer(_ack(pool))
        slots = {"short": (0,), "outside": (0, 4), "twice": (1, 1)}.get(bad, (0, 1))
        data = memoryview(b"\0" * 8 if bad == "data" else b"")
        with pytest.raises(TransferError) as refused:
            sink.on_chunk(ChunkView(0, pool.num_layers, 0, 2, data, 0, True, slots))
        assert sink.failed is refused.value and receiver.engine.engine.reads == []  # nothing was read
    finally:
        sink.withdraw()
        receiver.close()


@pytest.mark.parametrize("bad", ["missing", "layers", "page"])
def test_decode_refuses_an_ack_whose_source_cannot_hold_its_pages(monkeypatch, bad):
    pool, receiver, sink = _sink(monkeypatch)
    ack = _ack(pool)
    if bad == "missing":
        ack.ClearField("mooncake_source")
    elif bad == "layers":
        del ack.mooncake_source.layer_base_addrs[-1]
    else:
        ack.mooncake_source.page_bytes += 2
    try:
        with pytest.raises(TransferError):
            sink.accept_answer(ack)
        assert sink.failed is not None
    finally:
        sink.withdraw()
        receiver.close()


def test_a_pulled_transfer_done_without_any_report_is_refused(monkeypatch):
    """Decode would otherwise land its own (zeroed) slots as the KV: no MAC catches that without a secret."""
    pool, receiver, sink = _sink(monkeypatch)
    try:
        sink.accept_answer(_ack(pool))
        done = pb.TransferDone(num_pages=len(sink.pages), bytes_sent=len(sink.pages) * pool.num_layers * pool.bytes_per_page)
        with pytest.raises(TransferError, match="reported no send"):
            sink.check_complete(done)
    finally:
        sink.withdraw()
        receiver.close()


def test_a_prefill_worker_whose_reads_stall_holds_up_only_its_own_requests(monkeypatch):
    """Each prefill worker's pulled sends are read in threads of its own: with one read thread per
    worker, a read from a stalled worker (its engine never answers, until Mooncake's timeout) does
    not keep another worker's send from being read and landed."""
    engines = mooncake_stub.install(monkeypatch)
    pool = random_pool(random.Random(), 8, 2)
    receiver = build_receiver("mooncake", pool, TransportConfig(io_threads=1))
    source = random_pool(random.Random(), 4, 2)
    engine = engines[0]
    for buffer in source.buffers:  # the healthy worker's send staging, registered as it reads
        engine.registered[buffer.data_ptr()] = buffer.numel() * buffer.element_size()
    stalled, release = threading.Event(), threading.Event()
    read = mooncake_stub.StubTransferEngine.batch_transfer_sync_read

    def reading(self, session, *args):
        if session == "10.0.0.66:15000":
            stalled.set()
            release.wait(10)
            return -1
        return read(self, session, *args)
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "batch_transfer_sync_read", reading)
    sinks = []
    try:
        for host, session in (("bad-prefill", "10.0.0.66:15000"), ("good-prefill", f"127.0.0.1:{engine.get_rpc_port()}")):
            sink = receiver.open_sink([1 + len(sinks)], host)
            asyncio.run(sink.reserve())
            sink.expose()
            ack = _ack(pool)
            ack.mooncake_source.session_id = session
            del ack.mooncake_source.layer_base_addrs[:]
            ack.mooncake_source.layer_base_addrs.extend(b.data_ptr() for b in source.buffers)
            sink.accept_answer(ack)
            sinks.append(sink)
        bad, good = sinks
        chunk = ChunkView(0, pool.num_layers, 0, 1, memoryview(b""), 0, True, (0,))
        held = bad.executor.submit(bad.on_chunk, chunk)
        assert stalled.wait(5)
        good.executor.submit(good.on_chunk, chunk).result(timeout=5)  # not behind the stalled read
        for layer in range(pool.num_layers):
            assert torch.equal(pool.buffers[layer][2], source.buffers[layer][0])
        release.set()
        with pytest.raises(TransferError):
            held.result(timeout=5)
    finally:
        release.set()
        for sink in sinks:
            sink.withdraw()
        receiver.close()
