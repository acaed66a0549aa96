"""KV transports (fake, grpc) through the real bootstrap service: exact copies, integrity, failures.

Mooncake, which binds 0.0.0.0, runs in its own network namespace: test_kv_transfer_mooncake.py.
"""
from __future__ import annotations

import asyncio
import random
import zlib

import grpc
import pytest
import torch

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.bootstrap_protocol import PROTOCOL_VERSION
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.grpc_stream import GrpcSink, read_pages
from deepseek_pd.workers.transport.mooncake_channel import build_write_batch
from deepseek_pd.workers.transport.plan import (
    PageRun, SendPlan, merge_page_runs, split_into_chunks)
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from pdtest.kv_transfer_harness import (
    Exchange, Side, pages_equal, random_exchange, random_pool, run_exchange, server_stopped_after, slowed)

pytestmark = pytest.mark.timeout(60)


def make_exchange(transport: str, seed: int, **kwargs) -> Exchange:
    rng = random.Random(seed)
    page_size = rng.choice([1, 3, 4])
    return random_exchange(rng, transport, num_tokens=rng.randrange(2, 40), page_size=page_size, **kwargs)


# ---- pure planning ----------------------------------------------------------------------------

def test_merge_page_runs_matches_pairwise_oracle():
    rng = random.Random()
    for _ in range(200):
        n = rng.randrange(0, 30)
        src = [rng.choice([i, rng.randrange(100)]) for i in range(n)]
        dst = [rng.choice([i + 50, rng.randrange(100)]) for i in range(n)]
        runs = merge_page_runs(src, dst)
        expanded = [(r.src + k, r.dst + k) for r in runs for k in range(r.length)]
        assert expanded == list(zip(src, dst))
        for left, right in zip(runs, runs[1:]):  # maximal: no two neighbours could have merged
            assert not (right.src == left.src + left.length and right.dst == left.dst + left.length)
    assert merge_page_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [PageRun(4, 0, 2), PageRun(6, 7, 1), PageRun(9, 8, 1)]


def test_mooncake_write_batch_is_one_entry_per_layer_and_run():
    page_bytes = 96
    src_base, dst_base = [1000, 900000], [5000, 700000]
    local, remote, lengths = build_write_batch(src_base, dst_base, page_bytes, [3, 4, 8], [10, 11, 2])
    assert local == [1000 + 3 * 96, 1000 + 8 * 96, 900000 + 3 * 96, 900000 + 8 * 96]
    assert remote == [5000 + 10 * 96, 5000 + 2 * 96, 700000 + 10 * 96, 700000 + 2 * 96]
    assert lengths == [2 * 96, 96, 2 * 96, 96]


def test_chunks_cover_every_cell_once_and_respect_the_limit():
    rng = random.Random()
    for _ in range(100):
        layers, page_bytes = rng.randrange(1, 6), rng.randrange(16, 200)
        begin = rng.randrange(0, 5)
        end = begin + rng.randrange(1, 12)
        limit = rng.randrange(page_bytes, page_bytes * layers * 4 + 1)
        cells = []
        chunks = split_into_chunks(range(layers), range(begin, end), page_bytes, limit)
        for c in chunks:
            assert (c.layer_end - c.layer_begin) * (c.page_end - c.page_begin) * page_bytes <= limit
            cells += [(lay, p) for lay in range(c.layer_begin, c.layer_end) for p in range(c.page_begin, c.page_end)]
        assert sorted(cells) == [(lay, p) for lay in range(layers) for p in range(begin, end)]
        fit = limit // (page_bytes * layers)
        if fit:  # whole-layer chunks: as few as the limit allows, and even (sizes differ by <= 1 page)
            assert len(chunks) == -(-(end - begin) // fit)
            sizes = [c.page_end - c.page_begin for c in chunks]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="chunk limit"):
        split_into_chunks(range(2), range(0, 1), page_bytes=500, max_chunk_bytes=400)


def test_send_plan_sends_full_pages_early_and_the_partial_page_last():
    rng = random.Random()
    for _ in range(100):
        page_size, num_tokens = rng.randrange(1, 6), rng.randrange(1, 40)
        plan = SendPlan(num_tokens, page_size)
        sent: list[int] = []
        computed = 0
        while computed < num_tokens:
            computed = min(num_tokens, computed + rng.randrange(1, 10))
            ready = plan.ready(computed, final=computed == num_tokens)
            assert all((i + 1) * page_size <= computed or computed == num_tokens for i in ready)
            sent += list(ready)
        assert sent == list(range(-(-num_tokens // page_size))) and plan.done


# ---- transports end to end ---------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["fake", "grpc"])
@pytest.mark.parametrize("seed", range(3))
def test_transport_copies_scattered_pages_exactly(transport, seed):
    seed = random.randrange(1 << 30) + seed
    exchange = make_exchange(transport, seed)
    before = [b.clone() for b in exchange.dst.pool.buffers]
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(prefill, BaseException), prefill
    assert not isinstance(decode, BaseException), decode
    assert decode.first_token_id == 42 and decode.num_pages == len(exchange.dst.pages)
    assert pages_equal(exchange), f"seed {seed}"
    untouched = sorted(set(range(exchange.dst.pool.num_pages)) - set(exchange.dst.pages))
    for layer, buffer in enumerate(exchange.dst.pool.buffers):  # nothing written outside the pages
        assert torch.equal(buffer[untouched], before[layer][untouched])
    page_cells = len(exchange.src.pages) * exchange.src.pool.num_layers
    assert prefill == page_cells * exchange.src.pool.bytes_per_page


def test_grpc_transport_splits_big_pages_below_the_chunk_limit():
    while True:  # a prompt of one small page fits one chunk and cannot show a split (was flaky)
        exchange = make_exchange("grpc", random.randrange(1 << 30),
                                 transport_config=TransportConfig(max_chunk_bytes=1024))
        pool = exchange.src.pool
        if len(exchange.src.pages) * pool.num_layers * pool.bytes_per_page > 1024:
            break
    chunks: list[pb.KVChunk] = []

    def spy(emit):
        async def wrapped(chunk):
            chunks.append(chunk)
            await emit(chunk)
        return wrapped

    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=spy))
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(exchange)
    assert len(chunks) > 1 and all(c.data_len <= 1024 for c in chunks)


def test_bf16_pages_survive_the_grpc_stream():
    rng = random.Random()
    src_pool = random_pool(rng, 6, 4, dtype=torch.bfloat16)
    dst_pool = random_pool(rng, 6, 4, dtype=torch.bfloat16)
    exchange = Exchange("grpc", Side(src_pool, [5, 1]), Side(dst_pool, [0, 3]), 7, [4, 7])
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(exchange)


def test_corrupted_chunk_fails_the_crc_check_on_both_sides():
    exchange = make_exchange("grpc", random.randrange(1 << 30))

    def corrupt(emit):
        async def wrapped(chunk):
            payload = bytearray(chunk.payload)
            payload[chunk.data_offset + chunk.data_len // 2] ^= 0x40
            chunk.payload = bytes(payload)
            await emit(chunk)
        return wrapped

    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=corrupt))
    assert isinstance(decode, TransferError) and decode.code == FailureCode.INTERNAL
    assert "crc32" in decode.message
    assert isinstance(prefill, TransferError)  # decode closed the stream: prefill learns it


def test_sink_rejects_bad_chunks_and_reports_missing_pages():
    rng = random.Random()
    pool = random_pool(rng, 8, 2)
    data = read_pages(pool, range(pool.num_layers), [0])
    good = pb.KVChunk(layer_begin=0, layer_end=pool.num_layers, page_begin=0, page_end=1, data=data,
                      crc32=zlib.crc32(data))
    sink = GrpcSink(pool, [3, 6])
    sink.on_chunk(good)
    assert torch.equal(pool.buffers[1][3], pool.buffers[1][0])
    with pytest.raises(TransferError, match="never arrived"):
        sink.check_complete(pb.TransferDone(num_pages=2))
    bad = {
        "repeats": good,
        "out of range": pb.KVChunk(layer_begin=0, layer_end=1, page_begin=1, page_end=3),
        "bytes": pb.KVChunk(layer_begin=0, layer_end=1, page_begin=1, page_end=2, data=b"xx"),
    }
    for reason, chunk in bad.items():
        sink = GrpcSink(pool, [3, 6])
        if reason == "repeats":
            sink.on_chunk(good)
        with pytest.raises(TransferError, match=reason):
            sink.on_chunk(chunk)
        assert sink.failed is not None and reason in sink.failed.message
        # Failed for good: a valid chunk after that is refused, and so is the TransferDone.
        with pytest.raises(TransferError, match="already failed"):
            sink.on_chunk(pb.KVChunk(layer_begin=0, layer_end=pool.num_layers, page_begin=1, page_end=2,
                                     data=data, crc32=zlib.crc32(data)))
        with pytest.raises(TransferError, match=reason):
            sink.check_complete(pb.TransferDone(num_pages=2))


def test_stalled_decode_times_out_the_prefill_send():
    """The decode side handshakes, then never reads: bounded queue + HTTP/2 window fill, send times out."""
    rng = random.Random(3)
    src_pool, dst_pool = random_pool(rng, 1500, 4, kv_dim=64), random_pool(rng, 1500, 4, kv_dim=64)
    exchange = Exchange("grpc", Side(src_pool, list(range(1500))), Side(dst_pool, list(range(1500))), 6000, [6000],
                        transport_config=TransportConfig(max_chunk_bytes=8192, send_timeout_s=1.0),
                        bootstrap_config=BootstrapConfig(port=0, event_queue_depth=1, handshake_timeout_s=5))

    async def stall(coro, server):
        coro.close()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        handshake = pb.Handshake(protocol_version=PROTOCOL_VERSION, room=7, num_tokens=6000,
                                 page_ids=list(range(1500)), layout=layout_of(dst_pool))
        handshake.grpc.max_chunk_bytes = 8192
        exchange.bootstrap_config.auth.sign(handshake, "handshake", "decode", f"127.0.0.1:{server.port}")
        call = pb_grpc.BootstrapStub(channel).Transfer()
        await call.write(pb.DecodeMessage(handshake=handshake))
        first = await call.read()
        assert first.WhichOneof("event") == "accepted"
        await asyncio.sleep(2)  # never read again while the prefill side pushes
        call.cancel()
        await channel.close()
        return "stalled"

    prefill, decode = asyncio.run(run_exchange(exchange, decode_hook=stall))
    assert decode == "stalled"
    assert isinstance(prefill, TransferError) and prefill.code == FailureCode.DEADLINE_EXCEEDED, prefill


def test_stalled_prefill_times_out_the_decode_side():
    exchange = make_exchange("grpc", random.randrange(1 << 30),
                             transport_config=TransportConfig(send_timeout_s=1.5),
                             bootstrap_config=BootstrapConfig(port=0, transfer_timeout_s=1.0))

    def hang(emit):
        async def wrapped(chunk):
            await asyncio.sleep(10)
        return wrapped

    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=hang))
    assert isinstance(decode, TransferError) and decode.code == FailureCode.DEADLINE_EXCEEDED, decode
    assert isinstance(prefill, TransferError)  # the cancelled stream reaches the prefill side


def test_prefill_server_killed_mid_transfer_fails_decode_unavailable():
    while True:  # >= 8 chunks at 0.05 s each: still on the wire at the kill (small ones were flaky)
        exchange = make_exchange("grpc", random.randrange(1 << 30),
                                 transport_config=TransportConfig(max_chunk_bytes=1024))
        pool = exchange.src.pool
        if len(exchange.src.pages) * pool.num_layers * pool.bytes_per_page > 8 * 1024:
            break
    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=slowed(0.05), decode_hook=server_stopped_after(0.2)))
    assert isinstance(decode, TransferError) and decode.code == FailureCode.UNAVAILABLE, decode
    assert isinstance(prefill, TransferError), prefill


def test_unreachable_bootstrap_is_unavailable_within_the_timeout():
    import socket
    import time

    from deepseek_pd.workers.engine.interface import DisaggParams
    from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
    from deepseek_pd.workers.decode.kv_pull import pull_kv
    from deepseek_pd.workers.transport import build_receiver

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = random_pool(random.Random(), 4, 2)
    receiver = build_receiver("grpc", pool, TransportConfig())

    async def run():
        client = BootstrapClient(BootstrapConfig(handshake_timeout_s=1.0))
        try:
            return await pull_kv(client, receiver, DisaggParams("127.0.0.1", port, 1), "d", 3, [0, 1])
        finally:
            await client.close()

    start = time.monotonic()
    with pytest.raises(TransferError) as info:
        asyncio.run(run())
    assert info.value.code == FailureCode.UNAVAILABLE and "unreachable" in info.value.message
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("mismatch", ["layout", "transport"])
def test_mismatched_sides_fail_both_with_a_clear_reason(mismatch, monkeypatch):
    """Different KV layouts (another model or dtype) or transports must never copy bytes."""
    from pdtest import kv_transfer_harness
    from deepseek_pd.workers.transport.fake import FakeReceiver

    rng = random.Random()
    src_pool = random_pool(rng, 8, 4, kv_dim=24)
    dst_pool = random_pool(rng, 8, 4, kv_dim=32 if mismatch == "layout" else 24)
    exchange = Exchange("grpc", Side(src_pool, [1, 2]), Side(dst_pool, [3, 4]), 6, [6])
    before = [b.clone() for b in dst_pool.buffers]
    if mismatch == "transport":  # the decode side advertises the fake transport, prefill speaks grpc
        monkeypatch.setattr(kv_transfer_harness, "build_receiver", lambda name, pool, config: FakeReceiver(pool, config))

    prefill, decode = asyncio.run(run_exchange(exchange))
    assert isinstance(prefill, TransferError) and prefill.code == FailureCode.INVALID_ARGUMENT, prefill
    assert isinstance(decode, TransferError) and decode.code == FailureCode.INVALID_ARGUMENT, decode
    assert ("layout mismatch" if mismatch == "layout" else "transport") in decode.message
    assert all(torch.equal(b, a) for b, a in zip(dst_pool.buffers, before))
