"""A prompt longer than decode's staging, through its window, over Mooncake RDMA and TCP
(workers/transport/mooncake_channel.py `_send_windows`, mooncake_sink.py `on_chunk`), end to end in
one process: the prefill worker's `MooncakeSender` writes, decode's `MooncakeReceiver` lands, and
the window reports travel as their wire bytes (`decode_event`).

The engine is the stub (pdtest/mooncake_stub.py) made to do what a Mooncake engine does with a
write (this machine has no RDMA NIC, and the netns tests run Mooncake over TCP only): it refuses one
whose remote bytes are not all inside memory the remote engine registered (the TCP server's and the
NIC's check, by rkey), over RDMA also one whose local bytes are not inside memory this engine
registered (the NIC reads only registered memory, by lkey), and otherwise copies the bytes.

The oracle is the prefill pool itself: the request's decode pages hold exactly its source pages,
every layer; the KV MAC the prefill side signed matches decode's private copy; every write went
page i -> slot i mod W and no run was written before decode copied out the pages whose slots it
reuses; afterwards both stagings are zero and free, and neither pool was ever registered.
Its decode workers run the write direction (`mooncake_kv_direction=write`), the one these sinks
and channels serve; pulled transfers, the default: test_mooncake_pull.py."""
from __future__ import annotations

import asyncio
import ctypes
import random

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver, MooncakeSender
from deepseek_pd.workers.transport.wire import decode_event
from pdtest import mooncake_stub


def _inside(regions: dict[int, int], addr: int, length: int) -> bool:
    return any(base <= addr and addr + length <= base + size for base, size in regions.items())


def _writing_engines(monkeypatch, protocol: str) -> list[mooncake_stub.StubTransferEngine]:
    """The stub engines, each write checked as Mooncake checks it and then copied (both engines are
    in this process: the remote addresses are real); each keeps every region it ever registered
    (`ever`)."""
    engines = mooncake_stub.install(monkeypatch)
    register = mooncake_stub.StubTransferEngine.register_memory

    def register_and_keep(self, addr, length):
        self.__dict__.setdefault("ever", {})[addr] = length
        return register(self, addr, length)
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "register_memory", register_and_keep)

    def write(self, session, local, remote, lengths):
        (peer,) = [engine for engine in engines if engine is not self]
        for src, dst, length in zip(local, remote, lengths):
            if not _inside(peer.registered, dst, length):
                return -1
            if protocol == "rdma" and not _inside(self.registered, src, length):
                return -1
        self.writes.append((session, list(local), list(remote), list(lengths)))
        for src, dst, length in zip(local, remote, lengths):
            ctypes.memmove(dst, src, length)
        return 0
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "batch_transfer_sync_write", write)
    return engines


@pytest.mark.parametrize("protocol", ["rdma", "tcp"])
def test_a_prompt_longer_than_the_staging_moves_through_the_window_and_lands_whole(monkeypatch, protocol):
    rng = random.Random()
    engines = _writing_engines(monkeypatch, protocol)
    src = KVPool(rng.randrange(1, 4), 48, rng.choice([1, 4, 16]), rng.choice([8, 24]), dtype=torch.float32)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in src.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    dst = KVPool(src.num_layers, 48, src.page_size, src.kv_dim, dtype=src.dtype)
    decode_staging = rng.randint(2, 9)
    # The prefill side's send staging (RDMA) has its own size: smaller than a half window, a
    # window's run goes in pieces.
    sender = MooncakeSender(src, TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write", mooncake_protocol=protocol,
                                                 mooncake_staging_tokens=rng.randint(1, 6) * src.page_size))
    receiver = MooncakeReceiver(dst, TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write", mooncake_protocol=protocol,
                                                     mooncake_staging_tokens=decode_staging * src.page_size))
    prefill_engine, decode_engine = engines
    count = rng.randint(decode_staging + 1, 4 * decode_staging)
    src_pages, dst_pages = rng.sample(range(48), count), rng.sample(range(48), count)

    sink = receiver.open_sink(dst_pages)
    asyncio.run(sink.reserve())
    sink.expose()
    handshake = pb.Handshake(page_ids=dst_pages, layout=layout_of(dst), num_tokens=count * src.page_size)
    receiver.fill_destination(handshake)
    sink.offer_into(handshake)
    window = handshake.mooncake.window_pages
    assert window == decode_staging // 2 and list(handshake.page_ids) == [sink.slots[i % window] for i in range(count)]

    reports: list[int] = []  # the end of each window report's run

    async def transfer() -> tuple[pb.TransferDone, bytes, int]:
        stream: asyncio.Queue[bytes] = asyncio.Queue()

        async def decode_side() -> None:  # the reports' wire bytes, each landed a little later, as decode does
            while True:
                raw = await stream.get()
                await asyncio.sleep(rng.uniform(0, 0.004))
                chunk = decode_event(raw).chunk
                reports.append(chunk.page_end)
                sink.on_chunk(chunk)
                stream.task_done()

        async def emit(event) -> None:
            stream.put_nowait(event.SerializeToString())

        async def wait_landed(pages: int, timeout_s: float) -> None:  # the prefill room's wait for credits
            async def landed() -> None:
                while sink.landed_pages < pages:
                    await asyncio.sleep(0.001)
            await asyncio.wait_for(landed(), timeout_s)

        lander = asyncio.create_task(decode_side())
        channel = sender.open(handshake, emit=emit)
        assert not channel.streams_layers  # whole pages only
        channel.wait_landed = wait_landed
        room, key = rng.randrange(1 << 40), bytes(rng.randrange(256) for _ in range(32))
        channel.begin_seal(key, room)
        begin = 0
        while begin < count:  # as KVPush cuts a prompt into chunks
            end = rng.randint(begin + 1, count)
            await channel.send(src_pages[begin:end], begin)
            begin = end
        await stream.join()
        lander.cancel()
        done = pb.TransferDone(num_pages=count, bytes_sent=channel.bytes_sent)
        channel.seal(done, key, room)
        return done, key, room

    done, key, room = asyncio.run(transfer())
    sink.check_complete(done)
    sink.land()
    sink.check_sealed(done, key, room)
    assert sink.failed is None
    for layer, (sent, got) in enumerate(zip(src.buffers, dst.buffers)):
        assert torch.equal(got[dst_pages], sent[src_pages]), f"layer {layer}"
    assert len(reports) >= -(-count // max(1, window // 2))  # half a window at most per report
    written = [addr for _, _, remote, _ in prefill_engine.writes for addr in remote]
    staging_ends = [(base, base + receiver.staging.num_pages * dst.bytes_per_page) for base in receiver.staging.base_addrs]
    assert written and all(any(lo <= addr < hi for lo, hi in staging_ends) for addr in written)
    assert receiver.staging.num_used == 0 and not any(b.any() for b in receiver.staging.buffers)
    pools = [(b.data_ptr(), b.numel() * b.element_size()) for pool in (src, dst) for b in pool.buffers]
    for engine in engines:  # never registered, not even for a while
        assert not any(_inside(engine.__dict__.get("ever", {}), addr, 1) for addr, _ in pools)
    if protocol == "rdma":
        assert set(prefill_engine.registered) == set(sender.staging.base_addrs)
        assert set(decode_engine.registered) == set(receiver.staging.base_addrs)
        assert sender.staging.num_used == 0 and not any(b.any() for b in sender.staging.buffers)
    else:
        assert not prefill_engine.registered and not decode_engine.registered
    sender.close()
    receiver.close()
