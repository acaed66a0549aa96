"""The Mooncake staging area (workers/transport/staging.py) and the decode sink over it, on the stub
engine: slots lowest first, bounded (a transfer waits for room; a prompt bigger than all of it moves
through half of it in windows, each reported run copied out as it comes), recycled at once after a copy and only after the late-write grace after a
failure; the copy against plain indexing; what the decode side registers (never its pool).
Its decode workers run the write direction (`mooncake_kv_direction=write`), the one these sinks
and channels serve; pulled transfers, the default: test_mooncake_pull.py."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver
from deepseek_pd.workers.transport.staging import StagingArea
from deepseek_pd.workers.transport.wire import ChunkView
from pdtest import mooncake_stub


def _pool(rng: random.Random, num_pages: int = 32) -> KVPool:
    return KVPool(rng.randrange(1, 4), num_pages, rng.choice([1, 4]), rng.choice([8, 16]), dtype=torch.float32)


def test_slots_are_taken_lowest_first_and_a_full_staging_makes_a_transfer_wait():
    rng = random.Random()
    area = StagingArea(_pool(rng), 8)

    async def run():
        first, _ = await area.acquire(5, 1.0)
        assert first == [0, 1, 2, 3, 4] and area.num_used == 5
        waiter = asyncio.ensure_future(area.acquire(4, 10.0))
        await asyncio.sleep(0.1)
        assert not waiter.done()  # 3 free, 4 asked: it waits
        # Released from a worker thread, as `land` does: the waiter on the loop wakes.
        await asyncio.to_thread(area.release, first[:2], 0.0, True)
        slots, _ = await asyncio.wait_for(waiter, 5)
        assert slots == [0, 1, 5, 6]
    asyncio.run(run())


def test_a_prompt_bigger_than_the_staging_or_no_room_in_time_is_refused_and_a_cancel_ends_the_wait():
    rng = random.Random()
    area = StagingArea(_pool(rng), 4)

    async def run():
        with pytest.raises(TransferError, match="mooncake_staging_tokens") as big:
            await area.acquire(5, 1.0)
        assert big.value.code is FailureCode.RESOURCE_EXHAUSTED
        await area.acquire(3, 1.0)
        with pytest.raises(TransferError, match="no room") as late:
            await area.acquire(2, 0.05)
        assert late.value.code is FailureCode.RESOURCE_EXHAUSTED
        waiter = asyncio.ensure_future(area.acquire(2, 60.0))
        behind = asyncio.ensure_future(area.acquire(1, 60.0))  # fits, but waits behind the first
        await asyncio.sleep(0.05)
        assert not behind.done()
        waiter.cancel()  # the transfer ended: it gives up its place, the next one gets its slot
        slots, _ = await asyncio.wait_for(behind, 5)
        assert slots == [3]
    asyncio.run(run())


def test_slots_of_a_failed_transfer_cool_for_the_grace_before_reuse():
    rng = random.Random()
    area = StagingArea(_pool(rng), 4)

    async def run():
        slots, _ = await area.acquire(4, 1.0)
        area.release(slots, delay_s=0.3)
        with pytest.raises(TransferError):
            await area.acquire(1, 0.05)  # cooling: a late write of the failed transfer may still land
        started = time.monotonic()
        again, dirty = await area.acquire(4, 5.0)
        # and zeroed as the grace ended (test_staging_cooling.py), before they serve again
        assert again == [0, 1, 2, 3] and dirty == [] and not any(staged.any() for staged in area.buffers)
        assert time.monotonic() - started > 0.15
    asyncio.run(run())


def test_the_copy_puts_each_slot_into_its_page_and_later_staging_writes_reach_no_page():
    rng = random.Random()
    pool = _pool(rng)
    area = StagingArea(pool, 12)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in area.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    count = rng.randrange(1, 8)
    slots, pages = rng.sample(range(12), count), rng.sample(range(pool.num_pages), count)
    expected = [staged[slots].clone() for staged in area.buffers]
    area.copy_into(pool, slots, pages)
    for staged, buffer, want in zip(area.buffers, pool.buffers, expected):
        assert torch.equal(buffer[pages], want)
        assert not staged[slots].any()  # zeroed: a registered slot never shows a later reader this KV
    before = [buffer.clone() for buffer in pool.buffers]
    for staged in area.buffers:
        staged.fill_(float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.buffers))


def test_a_failed_transfers_bytes_are_zeroed_before_its_slots_serve_again(monkeypatch):
    """Its slots go back unscrubbed (the failure path runs on the event loop); whoever takes them
    next zeroes them in `expose`, before it registers or names them, so a reader of the new
    transfer's registered slots never sees the failed one's KV."""
    rng = random.Random()
    mooncake_stub.install(monkeypatch)
    pool = _pool(rng, 16)
    receiver = MooncakeReceiver(pool, TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write",
                                                      mooncake_staging_tokens=6 * pool.page_size))
    staging = receiver.staging
    failed = receiver.open_sink(list(range(4)))
    asyncio.run(failed.reserve())
    failed.expose()
    for staged in staging.buffers:
        staged[failed.slots] = 1.0 + torch.rand(staged[failed.slots].shape,
                                                generator=torch.Generator().manual_seed(rng.randrange(99)))
    failed.withdraw()  # before the handshake went out: no cooling
    nxt = receiver.open_sink(list(range(4, 10)))
    asyncio.run(nxt.reserve())
    assert any(staged.any() for staged in staging.buffers)  # not yet: zeroing blocks, so expose does it
    nxt.expose()
    assert not any(staged.any() for staged in staging.buffers)


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_the_decode_pool_is_never_registered_only_the_staging(monkeypatch, protocol):
    """What a stranger on the engine's ports can reach: over TCP a transfer's slots while it runs,
    over RDMA the (small) staging for good; the pool the model reads, never."""
    rng = random.Random()
    engines = mooncake_stub.install(monkeypatch)
    pool = _pool(rng, 64)
    tokens = rng.randrange(1, 40)
    receiver = MooncakeReceiver(pool, TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write", mooncake_protocol=protocol,
                                                      mooncake_staging_tokens=tokens))
    staging = receiver.staging
    assert staging.num_pages == min(pool.num_pages, -(-tokens // pool.page_size))
    engine = engines[0]
    pool_ranges = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in pool.buffers]

    def registered_in_pool() -> bool:
        return any(lo <= addr < hi for addr in engine.registered for lo, hi in pool_ranges)
    assert set(engine.registered) == (set(staging.base_addrs) if protocol == "rdma" else set())
    count = rng.randrange(1, staging.num_pages + 1)
    sink = receiver.open_sink(rng.sample(range(pool.num_pages), count))
    asyncio.run(sink.reserve())
    sink.expose()
    handshake = pb.Handshake(page_ids=sink.pages, layout=layout_of(pool))
    receiver.fill_destination(handshake)
    sink.offer_into(handshake)
    assert list(handshake.page_ids) == sink.slots and list(handshake.mooncake.layer_base_addrs) == staging.base_addrs
    assert handshake.mooncake.pool_pages == staging.num_pages
    assert not registered_in_pool()
    if protocol == "tcp":
        assert engine.registered and all(any(lo <= addr < lo + staging.num_pages * staging.page_bytes
                                             for lo in staging.base_addrs) for addr in engine.registered)
    sink.withdraw()  # failed after the handshake went out: the slots cool, nothing stays registered
    assert set(engine.registered) == (set(staging.base_addrs) if protocol == "rdma" else set())
    assert staging.num_used == count and not sink.exposure.may_be_written
    receiver.close()
    assert not engine.registered


def test_staging_copy_cost_per_megabyte():
    """Not a bound (2 shared CI cores): prints what `copy_into` (copy plus zeroing) adds to a
    transfer's first-token path on a CPU pool, per MB of KV (docs/operations.md §8 quotes it)."""
    rng = random.Random()
    pool = KVPool(4, 512, 16, 576, dtype=torch.bfloat16)  # V2-Lite's kv_dim: 18 KiB a page a layer
    area = StagingArea(pool, 256)
    first = rng.randrange(256)
    for name, pages in (("consecutive pages", list(range(first, first + 256))),
                        ("scattered pages", rng.sample(range(512), 256))):
        slots = list(range(256))
        mb = len(pages) * pool.num_layers * pool.bytes_per_page / 1e6
        area.copy_into(pool, slots, pages)  # warm
        started = time.perf_counter()
        for _ in range(3):
            area.copy_into(pool, slots, pages)
        per_mb = (time.perf_counter() - started) / 3 / mb
        print(f"staging copy, {name}: {per_mb * 1e3:.3f} ms per MB ({1 / per_mb / 1e3:.2f} GB/s), {mb:.1f} MB")


def test_a_big_prompt_is_not_passed_over_by_small_ones_that_came_later():
    rng = random.Random()
    area = StagingArea(_pool(rng), 8)

    async def run():
        held, _ = await area.acquire(6, 1.0)
        big = asyncio.ensure_future(area.acquire(8, 10.0))
        await asyncio.sleep(0.05)
        small = asyncio.ensure_future(area.acquire(2, 10.0))  # 2 are free: it would fit, but comes second
        await asyncio.sleep(0.05)
        assert not big.done() and not small.done()
        area.release(held)
        slots, _ = await asyncio.wait_for(big, 5)
        assert len(slots) == 8 and not small.done()
        area.release(slots)
        assert len((await asyncio.wait_for(small, 5))[0]) == 2
    asyncio.run(run())


def test_a_staging_of_no_tokens_is_refused_with_the_setting():
    with pytest.raises(ValueError, match="mooncake_staging_tokens"):
        TransportConfig(mooncake_staging_tokens=0)


def _report(pool: KVPool, begin: int, end: int) -> ChunkView:
    """The prefill side's report that request pages [begin, end) of every layer are in their slots."""
    return ChunkView(0, pool.num_layers, begin, end, memoryview(b""), 0, written_directly=True)


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_a_prompt_longer_than_the_staging_lands_window_by_window(monkeypatch, device):
    """Page i goes through slot page_ids[i % W] (W: half the staging); each reported run is copied
    into the request's pages at once and its slots zeroed, so the writer may reuse them; after the
    last, the pages hold exactly what was sent and the staging is empty. A report past the window
    (a writer that would overwrite pages not copied out yet) fails that transfer alone. On CUDA the
    copies run on the side stream and are complete when `on_chunk` returns."""
    rng = random.Random()
    mooncake_stub.install(monkeypatch)
    pool = KVPool(rng.randrange(1, 4), 64, rng.choice([1, 4, 16]), rng.choice([8, 16, 576]),
                  dtype=torch.float32 if device == "cpu" else torch.bfloat16, device=device)
    staging_pages = rng.randint(2, 7)
    receiver = MooncakeReceiver(pool, TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write",
                                                      mooncake_staging_tokens=staging_pages * pool.page_size))
    staging = receiver.staging
    count = rng.randint(staging_pages + 1, 4 * staging_pages)
    pages = rng.sample(range(pool.num_pages), count)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    sent = [torch.randn((count, pool.page_size, pool.kv_dim), generator=gen).to(device=device, dtype=pool.dtype)
            for _ in range(pool.num_layers)]
    sink = receiver.open_sink(pages)
    asyncio.run(sink.reserve())
    sink.expose()
    handshake = pb.Handshake(page_ids=pages, layout=layout_of(pool))
    receiver.fill_destination(handshake)
    sink.offer_into(handshake)
    window = handshake.mooncake.window_pages
    assert window == staging_pages // 2 and list(handshake.page_ids) == [sink.slots[i % window] for i in range(count)]
    begin = 0
    while begin < count:  # as the prefill side writes: a run only once the slots it reuses are copied out
        end = min(count, begin + rng.randint(1, window))
        assert sink.landed_pages >= end - window
        for staged, layer in zip(staging.buffers, sent):
            staged[list(handshake.page_ids)[begin:end]] = layer[begin:end]
        sink.on_chunk(_report(pool, begin, end))
        assert sink.landed_pages == end and not any(staged.any() for staged in staging.buffers)
        begin = end
    sink.check_complete(pb.TransferDone(num_pages=count, bytes_sent=count * pool.num_layers * pool.bytes_per_page))
    sink.land()
    assert all(torch.equal(buffer[pages], layer) for buffer, layer in zip(pool.buffers, sent))
    assert sink.failed is None and staging.num_used == 0

    greedy = receiver.open_sink(rng.sample(range(pool.num_pages), count))
    asyncio.run(greedy.reserve())
    greedy.expose()
    greedy.offer_into(pb.Handshake())
    with pytest.raises(TransferError) as refused:
        greedy.on_chunk(_report(pool, 0, window + 1))
    assert refused.value.code == FailureCode.INTERNAL and greedy.failed is refused.value
    greedy.withdraw()


def test_a_cpu_scrub_zeroes_exactly_its_slots_in_its_layers_without_torch_index_fill(monkeypatch):
    # torch's index_fill_ forks an OpenMP team per call, whose threads spin on shared cores: a
    # quarter of a 4k-token transfer's CPU on 2 cores (docs/performance.md, session 16).
    rng = random.Random()
    pool = _pool(rng)
    area = StagingArea(pool, rng.randrange(4, 16))
    for buffer in area.buffers:
        buffer.copy_(torch.randn(buffer.shape))
    before = [buffer.clone() for buffer in area.buffers]
    slots = rng.sample(range(area.num_pages), rng.randrange(1, area.num_pages))
    layer_begin = rng.randrange(len(area.buffers))
    layers = range(layer_begin, rng.randrange(layer_begin + 1, len(area.buffers) + 1))

    def refused(*args, **kwargs):
        raise AssertionError("a CPU staging zeroed its slots with torch's index_fill_")
    monkeypatch.setattr(torch.Tensor, "index_fill_", refused)
    area.scrub(slots, layers)
    for layer, (buffer, old) in enumerate(zip(area.buffers, before)):
        for slot in range(area.num_pages):
            zeroed = layer in layers and slot in slots
            assert torch.equal(buffer[slot], torch.zeros_like(old[slot]) if zeroed else old[slot]), (layer, slot)


def test_a_cpu_fill_gathers_scattered_pages_into_their_slots_without_torch_indexing(monkeypatch):
    # Scattered pages (more runs than SLICE_RUNS) went through torch's index_select + index_copy_,
    # an OpenMP team per layer: 2.6x the CPU of numpy's copies per run (docs/performance.md, session 16).
    rng = random.Random()
    pool = _pool(rng, num_pages=64)
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape))
    area = StagingArea(pool, rng.randrange(20, 40))
    count = rng.randrange(12, area.num_pages + 1)
    pages = rng.sample(range(pool.num_pages), count)
    slots = rng.sample(range(area.num_pages), count)
    layer_begin = rng.randrange(pool.num_layers)
    layers = range(layer_begin, rng.randrange(layer_begin + 1, pool.num_layers + 1))
    before = [buffer.clone() for buffer in area.buffers]

    def refused(*args, **kwargs):
        raise AssertionError("a CPU staging gathered pages with torch's indexed copies")
    for name in ("index_select", "index_copy_"):
        monkeypatch.setattr(torch.Tensor, name, refused)
    area.fill_from(pool, layers, pages, slots)
    for layer in range(pool.num_layers):
        expected = before[layer].clone()
        if layer in layers:
            expected[slots] = pool.buffers[layer][pages]
        assert torch.equal(area.buffers[layer], expected), layer
