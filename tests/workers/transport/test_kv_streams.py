"""Parallel KV streams of the grpc transport (`TransportConfig.grpc_streams`): the blocks each
stream carries, byte-exact pages with 1 and N streams (per chunk and layer-wise, fp32 and bf16),
the fallback when one end offers fewer, and a stream that dies mid-transfer failing the room on
both sides with nothing leaked."""
from __future__ import annotations

import asyncio
import random
import zlib

import pytest
import torch

from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.transport.checksum import crc32
from deepseek_pd.workers.transport.plan import split_for_streams
from deepseek_pd.workers.engine.request_failure import RequestFailure
from pdtest.kv_transfer_harness import Exchange, kv_streams_die_after, pages_equal, random_exchange, run_exchange

pytestmark = pytest.mark.timeout(90)


def test_stream_blocks_cover_every_cell_once_contiguously():
    rng = random.Random()
    for _ in range(300):
        first_layer, first_page = rng.randrange(5), rng.randrange(9)
        layers = range(first_layer, first_layer + rng.randrange(1, 30))
        pages = range(first_page, first_page + rng.randrange(1, 70))
        streams = rng.randrange(1, 9)
        blocks = split_for_streams(layers, pages, streams)
        assert 1 <= len(blocks) <= streams
        cells = [(layer, page) for block_layers, block_pages in blocks
                 for layer in block_layers for page in block_pages]
        assert sorted(cells) == sorted((layer, page) for layer in layers for page in pages)  # each once
        assert all(len(b[0]) and len(b[1]) and b[0].step == 1 and b[1].step == 1 for b in blocks)
        # As many blocks as the longer dimension allows, so every stream gets work when it can.
        assert len(blocks) == min(streams, max(len(layers), len(pages)))


def test_isal_or_zlib_crc32_is_zlibs():
    data = torch.randint(0, 256, (random.randrange(1, 1 << 20),), dtype=torch.uint8).numpy().tobytes()
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[7:]) == zlib.crc32(data[7:])


def exchange(rng: random.Random, streams: int, decode_streams: int | None = None, layerwise: bool = False,
             dtype: torch.dtype = torch.float32) -> Exchange:
    page_size = rng.choice([1, 2, 4])
    # A small chunk limit: many chunks per send, so every stream carries several.
    return random_exchange(rng, num_tokens=rng.randrange(8, 80), page_size=page_size, num_layers=rng.randrange(2, 7),
                           dtype=dtype, transport_config=TransportConfig(max_chunk_bytes=1024, grpc_streams=streams),
                           layerwise=layerwise, seed=rng.randrange(1 << 30),
                           decode_transport_config=TransportConfig(max_chunk_bytes=1024,
                                                                   grpc_streams=decode_streams or streams))


def run(ex: Exchange, **hooks):
    return asyncio.run(run_exchange(ex, **hooks))


def spy_streams(used: list[int]):
    def hook(emit):
        async def wrapped(chunk):
            used.append(chunk.stream)
            await emit(chunk)
        return wrapped
    return hook


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_are_exact_with_one_and_several_streams(layerwise, dtype):
    rng = random.Random()
    for streams in (1, rng.randrange(2, 6)):
        ex = exchange(rng, streams, layerwise=layerwise, dtype=dtype)
        used: list[int] = []
        prefill, decode = run(ex, emit_hook=spy_streams(used))
        assert not isinstance(prefill, BaseException), prefill
        assert not isinstance(decode, BaseException), decode
        assert pages_equal(ex), f"{streams} streams"
        counts = [used.count(i) for i in range(streams)]
        assert list(decode.stream_chunks) == counts[1:], (decode.stream_chunks, counts)
        if streams > 1:  # the extra streams really carried KV
            assert sum(counts[1:]) > 0, counts
        else:
            assert set(used) == {0}


def test_the_smaller_offer_wins():
    rng = random.Random()
    prefill_streams, decode_streams = rng.sample(range(1, 6), 2)
    ex = exchange(rng, prefill_streams, decode_streams=decode_streams)
    used: list[int] = []
    prefill, decode = run(ex, emit_hook=spy_streams(used))
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(ex)
    assert max(used) < min(prefill_streams, decode_streams) and len(decode.stream_chunks) == min(
        prefill_streams, decode_streams) - 1


def test_a_stream_that_dies_mid_transfer_fails_the_room_on_both_sides(monkeypatch):
    """KV stream 1 breaks on the prefill side after its first chunk (as if its connection died):
    the decode side fails with UNAVAILABLE naming the stream, the prefill side fails too, its
    sink is marked failed, and no room is left in the registry (checked by run_exchange)."""
    rng = random.Random()
    kv_streams_die_after(monkeypatch, chunks=1)
    while True:  # a transfer big enough that stream 1 carries at least two chunks
        ex = exchange(rng, rng.randrange(2, 5))
        pool = ex.src.pool
        if len(ex.src.pages) * pool.num_layers * pool.bytes_per_page > 8 * 1024 * ex.transport_config.grpc_streams:
            break
    sinks: list = []
    prefill, decode = run(ex, sinks=sinks)
    assert isinstance(decode, RequestFailure) and decode.code == FailureCode.UNAVAILABLE, decode
    assert "KV stream 1" in decode.message, decode.message
    assert isinstance(prefill, RequestFailure), prefill
    assert sinks[0].failed is not None
