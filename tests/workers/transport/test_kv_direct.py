"""Same-host direct KV writes on the grpc transport (kv_transfer/direct_pool.py), on CPU pools.

A CPU pool is shared only within its own process, so here both sides run in one process with
`same_host_direct="on"`; the CUDA IPC path between two processes is test_kv_direct_cuda.py. The
oracle is the source pool itself: every listed page equal, every other page untouched.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.direct_pool import DirectPools, offer
from deepseek_pd.workers.transport.grpc_stream import (
    DirectChannel, GrpcChannel, GrpcReceiver, GrpcSender, GrpcSink)
from deepseek_pd.workers.transport.wire import ChunkHeader, decode_event, encode_chunk_event
from deepseek_pd.workers.engine.request_failure import TransferError
from pdtest.kv_transfer_harness import Exchange, pages_equal, random_exchange, random_pool, run_exchange

pytestmark = pytest.mark.timeout(60)
DIRECT = TransportConfig(same_host_direct="on")


def _exchange(rng: random.Random, **kwargs) -> Exchange:
    page_size = rng.choice([1, 3, 4])
    return random_exchange(rng, num_tokens=rng.randrange(2, 40), page_size=page_size, num_layers=rng.randrange(1, 5),
                           seed=rng.randrange(1 << 30), **kwargs)


def _spy(chunks: list):
    def hook(emit):
        async def wrapped(chunk):
            chunks.append(chunk)
            await emit(chunk)
        return wrapped
    return hook


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("streams", [1, 3])
def test_direct_writes_copy_scattered_pages_exactly_with_no_bytes_on_the_wire(layerwise, streams):
    rng = random.Random()
    exchange = _exchange(rng, layerwise=layerwise,
                         transport_config=dataclasses.replace(DIRECT, grpc_streams=streams))
    before = [b.clone() for b in exchange.dst.pool.buffers]
    chunks: list = []
    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=_spy(chunks)))
    assert not isinstance(prefill, BaseException), prefill
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(exchange)
    untouched = sorted(set(range(exchange.dst.pool.num_pages)) - set(exchange.dst.pages))
    for layer, buffer in enumerate(exchange.dst.pool.buffers):
        assert torch.equal(buffer[untouched], before[layer][untouched])
    cells = len(exchange.src.pages) * exchange.src.pool.num_layers
    assert prefill == cells * exchange.src.pool.bytes_per_page  # bytes_sent counts the cells moved
    assert chunks and all(c.data_len == 0 and decode_event(c.payload).chunk.written_directly for c in chunks)


def test_a_prefill_that_cannot_open_the_offer_streams_the_bytes():
    """Another host, another process's CPU pool, or a prefill with same_host_direct off: the byte
    stream, with the same result."""
    rng = random.Random()
    for case in ("host", "pid", "off"):
        exchange = _exchange(rng, decode_transport_config=DIRECT,
                             transport_config=TransportConfig(same_host_direct="off") if case == "off" else DIRECT)
        chunks: list = []
        real_offer = offer

        def faked(pool, case=case):
            made = real_offer(pool)
            if case == "host":
                made.host = "another-" + made.host
            elif case == "pid":
                made.pid += 1
            return made

        import deepseek_pd.workers.transport.grpc_stream as grpc_stream
        grpc_stream.offer, saved = faked, grpc_stream.offer
        try:
            prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=_spy(chunks)))
        finally:
            grpc_stream.offer = saved
        assert not isinstance(decode, BaseException), (case, decode)
        assert pages_equal(exchange), case
        assert chunks and all(c.data_len > 0 for c in chunks), case


def _pools(rng: random.Random):
    src = random_pool(rng, 8, 2, num_layers=2)
    dst = random_pool(rng, 8, 2, num_layers=2)
    return src, dst


def _handshake(receiver: GrpcReceiver, pages: list[int]) -> pb.Handshake:
    handshake = pb.Handshake(room=1, page_ids=pages, layout=layout_of(receiver.pool))
    receiver.fill_destination(handshake)
    receiver.open_sink(pages, "127.0.0.1").offer_into(handshake)  # a writer on this host gets the offer
    return handshake


async def _no_emit(chunk) -> None:
    return None


def test_the_sender_checks_the_pages_of_an_opened_offer_and_opens_each_pool_once():
    rng = random.Random()
    src, dst = _pools(rng)
    receiver, sender = GrpcReceiver(dst, DIRECT), GrpcSender(src, DIRECT)
    try:
        assert isinstance(sender.open(_handshake(receiver, [1, 5]), _no_emit), DirectChannel)
        opened = dict(sender.direct._opened)
        assert isinstance(sender.open(_handshake(receiver, [2]), _no_emit), DirectChannel)
        assert dict(sender.direct._opened).keys() == opened.keys()  # cached, not opened again
        for bad, match in (([1, 8], "outside"), ([3, 3], "twice")):
            with pytest.raises(TransferError, match=match) as caught:
                sender.open(_handshake(receiver, bad), _no_emit)
            assert caught.value.code == FailureCode.INVALID_ARGUMENT
    finally:
        sender.close()
        receiver.close()
    # Without an offer (decode's default for a CPU pool) the channel streams bytes.
    plain = GrpcReceiver(dst, TransportConfig())
    sender = GrpcSender(src, DIRECT)
    try:
        assert plain.direct is None and plain.late_write_grace_s == 0
        channel = sender.open(_handshake(plain, [1]), _no_emit)
        assert isinstance(channel, GrpcChannel) and not isinstance(channel, DirectChannel)
    finally:
        sender.close()
        plain.close()


def test_an_offered_pool_is_mapped_off_the_event_loop_once():
    """`prepare` (awaited by KVPush before `open`) maps a pool it has not cached in a thread; `open`
    on the loop then answers from the cache, and a cached pool costs no thread hop."""
    import threading
    rng = random.Random()
    src, dst = _pools(rng)
    receiver, sender = GrpcReceiver(dst, DIRECT), GrpcSender(src, DIRECT)
    mapped_in: list[str] = []
    real_open = sender.direct._open
    sender.direct._open = lambda offered: mapped_in.append(threading.current_thread().name) or real_open(offered)

    async def handshakes() -> str:
        for pages in ([1, 5], [2]):
            handshake = _handshake(receiver, pages)
            await sender.prepare(handshake)
            assert isinstance(sender.open(handshake, _no_emit), DirectChannel)
        return threading.current_thread().name
    try:
        loop_thread = asyncio.run(handshakes())
    finally:
        sender.close()
        receiver.close()
    assert len(mapped_in) == 1 and mapped_in[0] != loop_thread


def test_an_offered_pool_makes_the_transfer_one_sided_with_the_send_timeout_as_grace():
    rng = random.Random()
    _, dst = _pools(rng)
    config = dataclasses.replace(DIRECT, send_timeout_s=rng.uniform(1, 30))
    receiver = GrpcReceiver(dst, config)
    try:
        sink = receiver.open_sink([0, 1])
        assert sink.one_sided and receiver.late_write_grace_s == config.send_timeout_s
        sink.exposure.handed_out()
        assert sink.exposure.may_be_written and sink.exposure.late_writes
    finally:
        receiver.close()


def _direct_chunk(pool, layers: range, pages: range, data: bytes = b""):
    header = ChunkHeader(layers.start, layers.stop, pages.start, pages.stop)
    encoded = encode_chunk_event(1, header, data, 0, 0, direct_bytes=len(layers) * len(pages) * pool.bytes_per_page)
    return decode_event(encoded.payload).chunk


def test_a_sink_refuses_direct_chunks_it_never_offered_for_or_that_carry_bytes():
    rng = random.Random()
    _, dst = _pools(rng)
    chunk = _direct_chunk(dst, range(0, 2), range(0, 1))
    with pytest.raises(TransferError, match="offered its pool to no writer"):
        GrpcSink(dst, [3, 4]).on_chunk(chunk)
    sink = GrpcSink(dst, [3, 4], offer=pb.DirectPool())
    with pytest.raises(TransferError, match="carries"):
        sink.on_chunk(_direct_chunk(dst, range(0, 1), range(0, 1), data=b"\x01" * 4))
    # A refused chunk fails the transfer; an accepted one counts its cells, and only complete
    # coverage passes TransferDone.
    sink = GrpcSink(dst, [3, 4], offer=pb.DirectPool())
    sink.on_chunk(_direct_chunk(dst, range(0, 2), range(0, 1)))
    done = pb.TransferDone(num_pages=2, bytes_sent=2 * 2 * dst.bytes_per_page)
    with pytest.raises(TransferError, match="never arrived"):
        sink.check_complete(done)
    sink = GrpcSink(dst, [3, 4], offer=pb.DirectPool())
    sink.on_chunk(_direct_chunk(dst, range(0, 2), range(0, 2)))
    sink.check_complete(done)
    with pytest.raises(TransferError, match="repeats"):
        sink.on_chunk(_direct_chunk(dst, range(1, 2), range(1, 2)))


def test_the_direct_flag_is_protobufs_own_encoding():
    """Our hand-written wire form parses with protobuf and back (any peer reads the flag)."""
    rng = random.Random()
    for _ in range(20):
        header = ChunkHeader(rng.randrange(3), rng.randrange(3, 9), rng.randrange(5), rng.randrange(5, 20))
        direct = rng.choice([0, rng.randrange(1, 1 << 20)])
        data = b"" if direct else rng.randbytes(rng.randrange(1, 64))
        encoded = encode_chunk_event(rng.randrange(1, 1000), header, data, rng.randrange(1 << 32), 0,
                                     direct_bytes=direct)
        parsed = pb.TransferEvent.FromString(encoded.payload)
        assert parsed.chunk.written_directly == bool(direct) and parsed.chunk.data == data
        assert decode_event(parsed.SerializeToString()).chunk.written_directly == bool(direct)
        assert encoded.kv_bytes == (direct or len(data))


def test_direct_pools_refuse_a_pool_of_another_page_size_or_device_kind():
    rng = random.Random()
    src = random_pool(rng, 8, 2, num_layers=2)
    other = random_pool(rng, 8, 4, num_layers=2)
    pools = DirectPools(src)
    assert pools.open(offer(other)) is None
    assert pools.open(offer(random_pool(rng, 8, 2, num_layers=2))) is not None


def test_same_host_direct_takes_only_its_three_modes():
    for mode in ("auto", "on", "off"):
        assert TransportConfig(same_host_direct=mode).same_host_direct == mode
    with pytest.raises(ValueError, match="same_host_direct .* is not one of auto, on, off"):
        TransportConfig(same_host_direct=random.choice(["yes", "", "AUTO"]))


def test_opened_pools_are_let_go_when_idle_and_reopened_on_use(caplog):
    """A dead decode worker's pool must not stay mapped here (its GPU memory would stay taken):
    idle pools are dropped by the sweeper; a later transfer opens the pool again, logged once."""
    rng = random.Random()
    src, dst = _pools(rng)
    pools = DirectPools(src, idle_s=rng.uniform(0.1, 0.3))
    offered, declined = offer(dst), offer(dst)
    declined.host = "another-host"
    try:
        with caplog.at_level("INFO", logger="deepseek_pd.workers.transport.direct_pool"):
            assert pools.open(offered) is not None and pools.open(declined) is None
            deadline = time.monotonic() + 10
            while pools._opened and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not pools._opened, "idle pools were not let go"
            buffers = pools.open(offered)
            assert buffers is not None and all(a is b for a, b in zip(buffers, dst.buffers))
            assert pools.open(declined) is None
        told = [r.getMessage() for r in caplog.records]
        assert len(told) == 2 and sum("device to device" in m for m in told) == 1, told
        assert pools.sweep() == 0  # just used: nothing idle yet
    finally:
        pools.close()
    assert not pools._opened
    pools._sweeper.join(timeout=5)
    assert not pools._sweeper.is_alive()


def test_write_pages_in_batches_copies_every_page_exactly(monkeypatch):
    """Large sends go in batches of `COPY_BATCH_BYTES` per layer (the gather's temporary stays in
    the block the warm-up made): the pages land exactly as one copy per page would put them."""
    from deepseek_pd.workers.transport import direct_pool

    rng = random.Random()
    layers, pages, page_size, dim = rng.randint(1, 4), rng.randint(20, 60), rng.choice([1, 4]), rng.randint(2, 16)
    src, dst = (KVPool(layers, pages, page_size, dim, dtype=torch.float32) for _ in range(2))
    for buffer in src.buffers:
        buffer.copy_(torch.randn(buffer.shape))
    want = [buffer.clone() for buffer in dst.buffers]
    count = rng.randint(1, pages)
    src_pages, dst_pages = rng.sample(range(pages), count), rng.sample(range(pages), count)
    written = range(rng.randrange(layers), layers)
    for layer in written:
        for s, d in zip(src_pages, dst_pages):
            want[layer][d] = src.buffers[layer][s]
    monkeypatch.setattr(direct_pool, "COPY_BATCH_BYTES", rng.randint(1, 5) * src.bytes_per_page)
    direct_pool.write_pages(src, dst.buffers, written, src_pages, dst_pages, ready=None)
    for got, expected in zip(dst.buffers, want):
        assert torch.equal(got, expected)
