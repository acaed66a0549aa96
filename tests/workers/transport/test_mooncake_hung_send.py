"""A prefill send over Mooncake whose write hangs past its deadline (workers/transport/mooncake_channel.py):
its send-staging slots stay its own until its write returns, so its late zeroing never reaches the
slots of another send (which would then write zeros: that request fails decode's MAC), and a write
that had not begun by the deadline is never made (it would land in decode slots that may already
serve another transfer). On the stub engine, whose writes block until the test lets them go."""
from __future__ import annotations

import asyncio
import ctypes
import functools
import random
import threading

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeSender
from pdtest import mooncake_stub

TIMEOUT_S = 0.2  # send_timeout_s: the write's deadline (and, before the fix, its slots' cooling)


def _sender(monkeypatch, rng: random.Random, staging_pages: int):
    engines = mooncake_stub.install(monkeypatch)
    pool = KVPool(rng.randrange(2, 4), 32, 4, 16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    config = TransportConfig(advertise_host="127.0.0.1", mooncake_protocol="tcp", send_timeout_s=TIMEOUT_S,
                             mooncake_staging_tokens=staging_pages * pool.page_size)
    return MooncakeSender(pool, config), engines[0], pool


def _handshake(pool: KVPool, rng: random.Random, session: str, count: int) -> pb.Handshake:
    handshake = pb.Handshake(page_ids=rng.sample(range(64), count), layout=layout_of(pool), num_tokens=count * 4)
    handshake.mooncake.session_id = session
    handshake.mooncake.layer_base_addrs.extend((1 << 40) + layer * (1 << 30) for layer in range(pool.num_layers))
    handshake.mooncake.page_bytes = pool.bytes_per_page
    handshake.mooncake.pool_pages = 64
    handshake.mooncake.protocol = "tcp"
    return handshake


def _gated_writes(monkeypatch, gates: dict[str, threading.Event], entered: dict[str, threading.Event],
                  read: dict[str, list[bytes]]) -> None:
    """The stub's write for a gated session waits for its gate, then takes the bytes at its local
    addresses (what the NIC would read, late)."""
    original = mooncake_stub.StubTransferEngine.batch_transfer_sync_write

    def write(self, session, local, remote, lengths):
        entered[session].set()
        gates[session].wait(10)
        read[session] = [ctypes.string_at(addr, length) for addr, length in zip(local, lengths)]
        return original(self, session, local, remote, lengths)
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "batch_transfer_sync_write", write)


def _signal_end(channel, ended: threading.Event) -> None:
    """Sets `ended` once the channel's worker-thread part of a send is over (whatever it did)."""
    inner = channel._write_from_slots

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        finally:
            ended.set()
    channel._write_from_slots = wrapped


def test_a_hung_write_never_wipes_the_send_staging_of_a_later_send(monkeypatch):
    rng = random.Random()
    count = rng.randrange(1, 4)
    sender, engine, pool = _sender(monkeypatch, rng, 2 * count)
    gates = {"a:1": threading.Event(), "b:1": threading.Event()}
    entered = {name: threading.Event() for name in gates}
    read: dict[str, list[bytes]] = {}
    _gated_writes(monkeypatch, gates, entered, read)
    hung = sender.open(_handshake(pool, rng, "a:1", count), emit=None)
    other = sender.open(_handshake(pool, rng, "b:1", count), emit=None)
    hung_over = threading.Event()
    _signal_end(hung, hung_over)
    src_a, src_b = rng.sample(range(pool.num_pages), count), rng.sample(range(pool.num_pages), count)

    async def scenario() -> None:
        with pytest.raises(TransferError) as failed:
            await hung.send(src_a, 0)
        assert failed.value.code == FailureCode.DEADLINE_EXCEEDED
        # Past the deadline and any cooling after it: the hung write still reads its slots.
        await asyncio.sleep(2.5 * TIMEOUT_S)
        later = asyncio.create_task(other.send(src_b, 0))
        assert await asyncio.to_thread(entered["b:1"].wait, 5)
        gates["a:1"].set()  # the hung write returns and its thread finishes (zeroing what it used)
        assert await asyncio.to_thread(hung_over.wait, 5)
        gates["b:1"].set()
        await later
    asyncio.run(scenario())
    # The later send's write read its own pages' bytes, not zeros from the hung send's late scrub.
    want = b"".join(pool.buffers[layer][page].numpy().tobytes() for layer in range(pool.num_layers) for page in src_b)
    assert b"".join(read["b:1"]) == want
    assert sender.staging.num_used == 0 and not any(buffer.any() for buffer in sender.staging.buffers)
    sender.close()


def test_a_send_past_its_deadline_before_its_write_began_writes_nothing(monkeypatch):
    rng = random.Random()
    count = rng.randrange(1, 4)
    sender, engine, pool = _sender(monkeypatch, rng, count)
    late = sender.open(_handshake(pool, rng, "a:1", count), emit=None)
    gate, over = threading.Event(), threading.Event()
    _signal_end(late, over)
    fill = sender.staging.fill_from

    def slow_fill(*args, **kwargs):  # the gather (encryption, a busy device) outlasts the deadline
        gate.wait(10)
        return fill(*args, **kwargs)
    monkeypatch.setattr(sender.staging, "fill_from", slow_fill)

    async def scenario() -> None:
        with pytest.raises(TransferError):
            await late.send(rng.sample(range(pool.num_pages), count), 0)
        gate.set()  # (a thread that had not even begun by the deadline never fills)
        assert await asyncio.to_thread(over.wait, 5)
    asyncio.run(scenario())
    # Its decode slots may serve another transfer by now: nothing is written there.
    assert engine.writes == []
    assert sender.staging.num_used == 0 and not any(buffer.any() for buffer in sender.staging.buffers)
    sender.close()
