"""The Mooncake staging on a CUDA pool (workers/transport/staging.py): the slots are device memory
beside the pool (what a CUDA Mooncake build registers and writes over RDMA or TCP), the copy into
the request's pages runs on a side stream and is complete when `land` returns, and the KV MAC of
the private copy equals the prefill side's tag; a write into the slots after `land` reaches no
page. On the stub engine (no NIC needed); the CPU twins are test_staging.py and test_kv_mac.py."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import pytest
import torch

from deepseek_pd.model import host_copy_staging
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport import kv_mac, wire
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver, MooncakeSender
from deepseek_pd.workers.transport.staging import SLICE_RUNS, StagingArea
from pdtest import mooncake_stub
from pdtest.kv_transfer_harness import pages_equal, random_exchange, run_exchange

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_a_cuda_transfer_lands_through_device_staging_and_passes_its_mac(monkeypatch, protocol):
    rng = random.Random()
    engines = mooncake_stub.install(monkeypatch)
    layers, page_size, kv_dim = rng.randrange(2, 6), 16, 576
    src = KVPool(layers, 64, page_size, kv_dim, dtype=torch.bfloat16, device="cuda")
    dst = KVPool(layers, 64, page_size, kv_dim, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(1 << 30))
    for buffer in src.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen, device="cuda"))
    config = TransportConfig(advertise_host="127.0.0.1", mooncake_protocol=protocol, mooncake_staging_tokens=512,
                             mooncake_kv_direction="write")  # (this one writes into decode's staging)
    sender, receiver = MooncakeSender(src, config), MooncakeReceiver(dst, config)
    staging = receiver.staging
    assert all(buffer.device.type == "cuda" for buffer in staging.buffers)
    count = rng.randrange(1, staging.num_pages + 1)
    src_pages, dst_pages = rng.sample(range(64), count), rng.sample(range(64), count)
    sink = receiver.open_sink(dst_pages)
    asyncio.run(sink.reserve())
    sink.expose()
    handshake = pb.Handshake(page_ids=dst_pages, layout=layout_of(dst), num_tokens=count * page_size)
    receiver.fill_destination(handshake)
    sink.offer_into(handshake)
    slots = list(handshake.page_ids)
    registered = engines[1].registered
    pool_lo = [b.data_ptr() for b in dst.buffers]
    assert not any(lo <= addr < lo + dst.num_pages * dst.bytes_per_page for addr in registered for lo in pool_lo)
    reported = []

    async def emit(encoded):  # the send's report (decode lands it below, after the write)
        reported.append(wire.decode_event(encoded.payload).chunk)
    channel = sender.open(handshake, emit=emit)
    room, key = rng.randrange(1 << 40), bytes(rng.randrange(256) for _ in range(32))
    sink.begin_check(key, room, kv_mac.algorithms()[0])
    asyncio.run(channel.send(src_pages, 0))
    for s, d in zip(src.buffers, staging.buffers):  # what the NIC (or CUDA TCP server) would write
        d[slots] = s[src_pages]
    torch.cuda.synchronize()
    for chunk in reported:  # copied into the pages and MACed there as it lands
        sink.on_chunk(chunk)
    assert len(reported) == 1 and not sink.check_reads()
    sink.land()
    for staged in staging.buffers:  # a body that lands after the copy
        staged[slots] = float("nan")
    torch.cuda.synchronize()
    done = pb.TransferDone(num_pages=count)
    channel.seal(done, key, room)
    sink.check_sealed(done, key, room)
    assert sink.failed is None and done.kv_mac_algorithm == kv_mac.algorithms()[0]
    for s, d in zip(src.buffers, dst.buffers):
        assert torch.equal(d[dst_pages], s[src_pages])
    assert staging.num_used == 0


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_a_pulled_cuda_transfer_lands_every_page_and_decode_registers_nothing_over_tcp(monkeypatch, protocol):
    """Pulled transfers (the default) between CUDA pools, through both device stagings, on the stub
    engine (its reads copy device memory as a CUDA-enabled engine's would): bit for bit, with the
    deployment secret (cipher and MAC) and layer-wise sends."""
    engines = mooncake_stub.install(monkeypatch)
    rng = random.Random()
    exchange = random_exchange(rng, "mooncake", num_tokens=rng.randrange(20, 300), page_size=16, num_layers=4,
                               kv_dim=576, dtype=torch.bfloat16, layerwise=True, seed=rng.randrange(1 << 30))
    cuda = {}
    for side in (exchange.src, exchange.dst):
        pool = side.pool
        cuda[id(side)] = moved = KVPool(pool.num_layers, pool.num_pages, pool.page_size, pool.kv_dim,
                                        dtype=pool.dtype, device="cuda")
        for mine, theirs in zip(moved.buffers, pool.buffers):
            mine.copy_(theirs)
    exchange = dataclasses.replace(
        exchange, src=dataclasses.replace(exchange.src, pool=cuda[id(exchange.src)]),
        dst=dataclasses.replace(exchange.dst, pool=cuda[id(exchange.dst)]),
        transport_config=TransportConfig(mooncake_protocol=protocol, mooncake_staging_tokens=rng.choice([64, 4096])))
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(prefill, BaseException), repr(prefill)
    assert not isinstance(decode, BaseException), repr(decode)
    torch.cuda.synchronize()
    assert pages_equal(exchange)
    sender_engine, receiver_engine = engines
    assert receiver_engine.reads and not sender_engine.writes
    if protocol == "tcp":
        assert receiver_engine.ever_registered == [] and sender_engine.registered == {}


def test_staging_copy_time_for_a_4k_token_v2_lite_prompt():
    """Not a bound: prints what `land`'s copy (plus zeroing the slots) adds to the first token of a
    4096-token V2-Lite prompt (27 layers x 256 pages of 16 x 576 bf16, 127 MB) on this GPU, with
    the slots in one run and with them scattered (the indexed path)."""
    rng = random.Random()
    pool = KVPool(27, 1024, 16, 576, dtype=torch.bfloat16, device="cuda")
    area = StagingArea(pool, 512)
    mb = 256 * pool.num_layers * pool.bytes_per_page / 1e6
    first = rng.randrange(768)
    for name, slots, pages in (("one run", list(range(256)), list(range(first, first + 256))),
                               ("scattered", rng.sample(range(512), 256), rng.sample(range(1024), 256))):
        area.copy_into(pool, slots, pages)  # warm
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(5):
            area.copy_into(pool, slots, pages)
        wall_ms = (time.perf_counter() - began) / 5 * 1e3
        print(f"staging copy ({name}): {wall_ms:.2f} ms for {mb:.0f} MB "
              f"({mb / wall_ms:.1f} GB/s including launches)")


@pytest.mark.parametrize("scattered", [False, True])
def test_a_send_staging_on_cuda_gathers_the_pages_of_the_layers_asked(scattered):
    """The prefill side over RDMA gathers each send into its send staging (MooncakeChannel._write_staged):
    on the device, one run of slices or one indexed copy per layer, complete when `fill_from` returns."""
    rng = random.Random()
    pool = KVPool(4, 64, 16, 576, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen, device="cuda"))
    area = StagingArea(pool, 32)
    count = rng.randrange(1, 32)
    pages = rng.sample(range(64), count) if scattered else list(range(5, 5 + count))
    slots = rng.sample(range(32), count) if scattered else list(range(count))
    layers = range(1, 3)
    area.fill_from(pool, layers, pages, slots)
    for layer in range(pool.num_layers):
        staged = area.buffers[layer][slots]
        assert torch.equal(staged, pool.buffers[layer][pages]) if layer in layers else not staged.any()
    area.scrub(slots, layers)
    assert not any(buffer.any() for buffer in area.buffers)


def test_a_transport_thread_uploads_its_slot_ids_through_its_reserved_page_locked_buffer(monkeypatch):
    """Scattered slots (past SLICE_RUNS: one indexed copy per layer) reach the device by
    `host_copy.upload`'s rule: a thread that reserved buffers (a transport thread after its warm-up)
    copies the slot ids through its own page-locked buffer, never a pageable copy; gather, land and
    zero still move exactly the pages asked (oracle: the pool's own pages)."""
    rng = random.Random()
    src = KVPool(3, 64, 16, 64, dtype=torch.bfloat16, device="cuda")
    dst = KVPool(3, 64, 16, 64, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(1 << 30))
    for buffer in src.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen, device="cuda"))
    area = StagingArea(src, 64)
    count = rng.randrange(2 * SLICE_RUNS + 2, 48)
    slots = sorted(rng.sample(range(0, 64, 2), min(count, 32)))  # never adjacent: one run each
    pages, landed = rng.sample(range(64), len(slots)), rng.sample(range(64), len(slots))
    uploaded: list[list[int]] = []
    upload = host_copy_staging.HostStaging.upload

    def recorded(self, values):
        uploaded.append(values.tolist())
        return upload(self, values)
    monkeypatch.setattr(host_copy_staging.HostStaging, "upload", recorded)
    errors: list[BaseException] = []

    def transport_thread() -> None:
        try:
            host_copy_staging.reserve(src.device, torch.long, 64)
            area.fill_from(src, range(3), pages, slots)
            area.copy_into(dst, slots, landed)
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)
    thread = threading.Thread(target=transport_thread)
    thread.start()
    thread.join()
    assert not errors, errors
    assert slots in uploaded, "the slot ids did not go through the thread's reserved page-locked buffer"
    for layer in range(3):
        assert torch.equal(dst.buffers[layer][landed], src.buffers[layer][pages])
    assert not any(buffer.any() for buffer in area.buffers)  # copy_into zeroed what it landed
