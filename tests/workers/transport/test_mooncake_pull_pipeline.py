"""A pulled Mooncake send moves in groups of layers as a pipeline (mooncake_pull_channel.py,
layer_groups.py): the prefill side stages (encrypts, hashes) group g + 1 while decode still reads
group g (a written send: while decode lands group g), each group read is released at its
credit, and what lands is still bit for bit the prefill pool's, under the cipher and the MAC; a
group tampered with on its way is refused by the MAC. In one process on the stub engine
(pdtest/mooncake_stub.py), whose reads (and writes) are slowed here so that the overlap shows in
timestamps."""
from __future__ import annotations

import asyncio
import ctypes
import random
import threading
import time

import torch

from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport import layer_groups as grouping
from deepseek_pd.workers.transport.base import TransportConfig
from deepseek_pd.workers.transport.layer_groups import layer_groups
from deepseek_pd.workers.transport.mooncake_pull_channel import MooncakePullChannel
from deepseek_pd.workers.transport.mooncake_sink import MooncakeSink
from deepseek_pd.workers.transport.staging import StagingArea
from pdtest import mooncake_stub
from pdtest.kv_transfer_harness import pages_equal, random_exchange, run_exchange

READ_S = 0.05  # each stub read takes this long: the transfer the next group's staging overlaps


def _pipelined(monkeypatch, rng: random.Random, tamper_read: int | None = None, fail_read: int | None = None,
               before_read=None):
    """A one-send pulled transfer (cipher and MAC on: the harness signs with a secret) cut into
    groups of 1-2 layers; returns (exchange, results, stage starts, read spans, a layer's bytes,
    the stub engines: prefill's, decode's)
    with each stub read slowed by READ_S, the `tamper_read`-th read's first landed byte flipped, the
    `fail_read`-th read failing (status -1, as a lost peer); `before_read(remote addresses, groups
    staged so far, engines)` runs in each read after its delay, before it moves a byte."""
    engines = mooncake_stub.install(monkeypatch)
    page_size = rng.choice([1, 2, 4])
    layers = rng.randrange(4, 8)
    exchange = random_exchange(rng, "mooncake", num_tokens=rng.randrange(8, 40), page_size=page_size,
                               num_layers=layers, chunks=1, seed=rng.randrange(1 << 30))
    layer_bytes = len(exchange.src.pages) * exchange.src.pool.bytes_per_page
    monkeypatch.setattr(grouping, "PIPELINE_PIECE_BYTES", layer_bytes * rng.choice([1, 2]))
    starts: list[tuple[float, range]] = []
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()
    stage = MooncakePullChannel._stage

    def timed_stage(self, group, *args, **kwargs):
        with lock:
            starts.append((time.perf_counter(), group))
        return stage(self, group, *args, **kwargs)
    monkeypatch.setattr(MooncakePullChannel, "_stage", timed_stage)

    read = mooncake_stub.StubTransferEngine.batch_transfer_sync_read

    def slowed(engine, session, local, remote, lengths):  # (only decode's engine reads)
        began = time.perf_counter()
        time.sleep(READ_S)
        if before_read is not None:
            with lock:
                staged = [group for _, group in starts]
            before_read(remote, staged, engines)
        status = read(engine, session, local, remote, lengths)
        with lock:
            spans.append((began, time.perf_counter()))
            if len(spans) - 1 == fail_read:
                return -1
            if len(spans) - 1 == tamper_read:
                byte = ctypes.c_uint8.from_address(local[0])
                byte.value ^= 1 << rng.randrange(8)
        return status
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "batch_transfer_sync_read", slowed)
    return exchange, asyncio.run(run_exchange(exchange)), starts, spans, layer_bytes, engines


def test_the_next_layer_group_is_staged_while_decode_reads_the_one_before(monkeypatch):
    rng = random.Random()
    exchange, (prefill, decode), starts, spans, layer_bytes, _ = _pipelined(monkeypatch, rng)
    assert not isinstance(prefill, BaseException), repr(prefill)
    assert not isinstance(decode, BaseException), repr(decode)
    assert pages_equal(exchange), "a pipelined, encrypted transfer landed other bytes than the prefill pool's"
    groups = [group for _, group in starts]
    assert len(groups) >= 2 and groups == layer_groups(range(exchange.src.pool.num_layers), layer_bytes)
    assert len(spans) == len(groups)  # one read per group
    # Group g + 1's staging began while group g's read was still running.
    for (start, _), (read_began, read_ended) in zip(starts[1:], spans):
        assert start < read_ended, (starts, spans)


def test_a_tampered_layer_group_is_refused_by_the_mac(monkeypatch):
    rng = random.Random()
    exchange, (prefill, decode), starts, spans, _, _ = _pipelined(monkeypatch, rng, tamper_read=1)
    assert len(starts) >= 2
    assert isinstance(decode, TransferError) and "MAC" in str(decode), repr(decode)


def _record_send_staging(monkeypatch) -> tuple[list[StagingArea], list[int], list[int]]:
    """(the staging areas as built: the prefill worker's send staging first, the send staging's
    slots as given back, the addresses unregistered with any stub engine), filled as the run goes."""
    areas: list[StagingArea] = []
    released: list[int] = []
    unregistered: list[int] = []
    init, release = StagingArea.__init__, StagingArea.release
    unregister = mooncake_stub.StubTransferEngine.unregister_memory

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        areas.append(self)

    def recorded_release(self, slots, *args, **kwargs):
        if self is areas[0]:
            released.extend(slots)
        return release(self, slots, *args, **kwargs)

    def recorded_unregister(engine, addr):
        unregistered.append(addr)
        return unregister(engine, addr)
    monkeypatch.setattr(StagingArea, "__init__", recorded_init)
    monkeypatch.setattr(StagingArea, "release", recorded_release)
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "unregister_memory", recorded_unregister)
    return areas, released, unregistered


def _in_layers(staging: StagingArea, addr: int, layers) -> bool:
    span = staging.num_pages * staging.page_bytes
    return any(staging.base_addrs[layer] <= addr < staging.base_addrs[layer] + span for layer in layers)


def test_a_credited_group_is_unregistered_and_zeroed_before_the_next_group_is_read(monkeypatch):
    rng = random.Random()
    areas, released, unregistered = _record_send_staging(monkeypatch)
    seen: list[tuple[int, list[str]]] = []  # (group read, what of the groups before it was still exposed)

    def earlier_groups_released(remote, staged, engines):
        send_staging = areas[0]
        index = next(i for i, group in enumerate(staged) if _in_layers(send_staging, remote[0], group))
        read_before = [layer for group in staged[:index] for layer in group]
        deadline = time.monotonic() + 40 * READ_S  # (its credit crosses the stream meanwhile; bounded)
        while True:
            left = [f"registered {addr:#x}" for addr in list(engines[0].registered)
                    if _in_layers(send_staging, addr, read_before)]
            left += [f"layer {layer} holds bytes" for layer in read_before
                     if send_staging.buffers[layer].view(torch.uint8).any()]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        seen.append((index, left))
    exchange, (prefill, decode), starts, spans, _, engines = _pipelined(monkeypatch, rng,
                                                                        before_read=earlier_groups_released)
    assert not isinstance(prefill, BaseException), repr(prefill)
    assert not isinstance(decode, BaseException), repr(decode)
    assert pages_equal(exchange)
    assert len(starts) >= 2 and sorted(index for index, _ in seen) == list(range(len(starts)))
    assert all(not left for _, left in seen), seen
    # Each registration undone exactly once, every slot back once.
    registered = [addr for addr, _ in engines[0].ever_registered]
    assert registered and sorted(unregistered) == sorted(registered), (registered, unregistered)
    assert areas[0].num_used == 0 and sorted(released) == sorted(set(released)), released


def test_a_group_whose_read_fails_fails_the_transfer_and_every_send_slot_goes_back_once(monkeypatch):
    rng = random.Random()
    areas, released, unregistered = _record_send_staging(monkeypatch)
    exchange, (prefill, decode), starts, spans, _, engines = _pipelined(monkeypatch, rng, fail_read=1)
    assert len(starts) >= 2
    assert isinstance(decode, TransferError) and "failed" in str(decode), repr(decode)
    assert isinstance(prefill, BaseException), repr(prefill)
    send_staging = areas[0]
    deadline = time.monotonic() + 5  # (a staging thread still running gives them back as it ends)
    while send_staging.num_used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert send_staging.num_used == 0 and sorted(released) == sorted(set(released)), released
    assert engines[0].registered == {}, "a send slot stayed registered"
    registered = [addr for addr, _ in engines[0].ever_registered]
    assert sorted(unregistered) == sorted(registered), "a registration was undone twice or never"
    assert all(not any(buffer[slot].any() for slot in range(send_staging.num_pages))
               for buffer in send_staging.buffers), "a send slot went back holding KV"


def test_layer_groups_cover_the_layers_in_order_in_pieces_of_about_the_bytes():
    rng = random.Random()
    begin = rng.randrange(0, 10)
    layers = range(begin, begin + rng.randrange(1, 70))
    layer_bytes = rng.randrange(1, 1 << 24)
    groups = layer_groups(layers, layer_bytes)
    assert [layer for group in groups for layer in group] == list(layers)
    per_group = max(1, -(-grouping.PIPELINE_PIECE_BYTES // layer_bytes))
    assert all(len(group) == per_group for group in groups[:-1]) and 1 <= len(groups[-1]) <= per_group


def test_a_written_send_goes_in_layer_groups_and_decode_lands_each_while_the_next_is_written(monkeypatch):
    """The write direction (`mooncake_kv_direction=write`) pipelines the same way: each group is
    written, then reported, so decode lands (decrypts, copies) group g while group g + 1 is staged
    and written; what lands is the prefill pool's, under the cipher and the MAC. The stub's writes
    are made real (copied into the peer's registered staging) and slowed by READ_S."""
    rng = random.Random()
    mooncake_stub.install(monkeypatch)
    exchange = random_exchange(rng, "mooncake", num_tokens=rng.randrange(8, 40), page_size=rng.choice([1, 2, 4]),
                               num_layers=rng.randrange(4, 8), chunks=1, seed=rng.randrange(1 << 30),
                               transport_config=TransportConfig(mooncake_kv_direction="write"))
    layer_bytes = len(exchange.src.pages) * exchange.src.pool.bytes_per_page
    monkeypatch.setattr(grouping, "PIPELINE_PIECE_BYTES", layer_bytes * rng.choice([1, 2]))
    lock = threading.Lock()
    writes: list[tuple[float, float]] = []
    landings: list[tuple[float, range]] = []

    def slowed_write(engine, session, local, remote, lengths):
        began = time.perf_counter()
        time.sleep(READ_S)
        peer = next(e for e in engine._registry if f"{e.hostname}:{e.get_rpc_port()}" == session)
        if not all(peer._holds(addr, n) for addr, n in zip(remote, lengths)):
            return -1
        for dst, src, n in zip(remote, local, lengths):
            ctypes.memmove(dst, src, n)
        with lock:
            writes.append((began, time.perf_counter()))
        return 0
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "batch_transfer_sync_write", slowed_write)
    land = MooncakeSink._land_send

    def timed_land(self, chunk):
        with lock:
            landings.append((time.perf_counter(), range(chunk.layer_begin, chunk.layer_end)))
        return land(self, chunk)
    monkeypatch.setattr(MooncakeSink, "_land_send", timed_land)
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(prefill, BaseException), repr(prefill)
    assert not isinstance(decode, BaseException), repr(decode)
    assert pages_equal(exchange), "a pipelined, encrypted written transfer landed other bytes than the prefill pool's"
    groups = layer_groups(range(exchange.src.pool.num_layers), layer_bytes)
    assert len(groups) >= 2 and [layers for _, layers in landings] == groups
    assert len(writes) == len(groups)  # one write per group
    # Group g landed on decode while group g + 1 was still being written.
    for (landed, _), (write_began, write_ended) in zip(landings, writes[1:]):
        assert landed < write_ended, (landings, writes)


def test_a_send_cancelled_again_while_its_credits_wind_down_gives_its_slots_back(monkeypatch):
    """A room torn down while its pulled send waits for decode's credits can cancel the send twice:
    the second cancel lands while the send's cleanup waits for its credit waiters to end. The slots
    must still go back (they leaked: the prefill send staging held them for good; seen as a flake
    of test_pd_engines_mooncake's abort in transfer). Each gap between the two cancels, in loop
    turns, is tried, since which one hits the cleanup's wait depends on asyncio's scheduling."""
    from deepseek_pd.model.kv.pool import KVPool
    from deepseek_pd.proto import bootstrap_pb2 as pb
    from deepseek_pd.workers.transport.base import layout_of
    from deepseek_pd.workers.transport.mooncake import MooncakeReceiver, MooncakeSender
    mooncake_stub.install(monkeypatch)
    rng = random.Random()
    layers, page_size, kv_dim = rng.randrange(1, 4), rng.choice([1, 4]), rng.choice([8, 16])
    count = rng.randrange(1, 8)
    config = TransportConfig(advertise_host="127.0.0.1")  # pulled, the default
    src, dst = (KVPool(layers, 24, page_size, kv_dim, dtype=torch.bfloat16) for _ in range(2))
    sender, receiver = MooncakeSender(src, config), MooncakeReceiver(dst, config)

    async def never_credited(seq: int, timeout_s: float) -> None:
        await asyncio.Event().wait()

    async def cancelled_twice(gap: int) -> int:
        handshake = pb.Handshake(page_ids=list(range(count)), layout=layout_of(dst), num_tokens=count * page_size)
        receiver.fill_destination(handshake)
        reported = asyncio.Event()

        async def emit(encoded) -> None:
            reported.set()
        channel = sender.open(handshake, emit=emit)
        channel.wait_credited = never_credited
        send = asyncio.ensure_future(channel.send(rng.sample(range(24), count), 0))
        await asyncio.wait_for(reported.wait(), 10)
        await asyncio.sleep(0.01)  # (every group reported: the send waits for the credits)
        send.cancel()
        for _ in range(gap):
            await asyncio.sleep(0)
        send.cancel()
        try:
            await send
        except asyncio.CancelledError:
            pass
        for _ in range(100):  # a staging thread still running gives them back as it ends
            if sender.staging.num_used == 0:
                break
            await asyncio.sleep(0.01)
        return sender.staging.num_used

    leaked = {gap: asyncio.run(cancelled_twice(gap)) for gap in range(6)}
    assert not any(leaked.values()), f"send-staging slots held after a second cancel, by gap: {leaked}"
