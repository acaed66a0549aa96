"""The prefill side over Mooncake RDMA (workers/transport/mooncake.py, staging.py), on the stub
engine: its KV pool is never registered (a peer on the fabric could read and write whatever is:
the radix cache, so later requests' KV); each send's pages are gathered into a registered send
staging, written from there (the bytes the NIC reads equal the pool's pages), and zeroed after;
a send bigger than the staging goes in pieces. Over TCP too the writes read the send staging
(where the KV is encrypted), which is then never registered. The decode side's MAC is still computed from the pool, so a stranger's write into the
send staging fails that request, nothing else."""
from __future__ import annotations

import asyncio
import ctypes
import random

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeSender
from pdtest import mooncake_stub


def _snapshotting(monkeypatch) -> list[list[bytes]]:
    """Makes the stub engine keep, per write, the bytes at its local addresses when it is called."""
    read: list[list[bytes]] = []
    original = mooncake_stub.StubTransferEngine.batch_transfer_sync_write

    def write(self, session, local, remote, lengths):
        read.append([ctypes.string_at(addr, length) for addr, length in zip(local, lengths)])
        return original(self, session, local, remote, lengths)
    monkeypatch.setattr(mooncake_stub.StubTransferEngine, "batch_transfer_sync_write", write)
    return read


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_the_prefill_pool_is_never_registered_and_the_nic_reads_its_pages_bytes(monkeypatch, protocol):
    rng = random.Random()
    engines = mooncake_stub.install(monkeypatch)
    read = _snapshotting(monkeypatch)
    pool = KVPool(rng.randrange(2, 5), 48, 4, 16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    staging_pages = rng.randrange(2, 6)
    sender = MooncakeSender(pool, TransportConfig(advertise_host="127.0.0.1", mooncake_protocol=protocol,
                                                  mooncake_staging_tokens=staging_pages * pool.page_size))
    engine = engines[0]
    lo = {b.data_ptr() for b in pool.buffers}
    in_pool = lambda addr: any(base <= addr < base + pool.num_pages * pool.bytes_per_page for base in lo)  # noqa: E731
    assert not any(in_pool(addr) for addr in engine.registered)
    count = rng.randrange(staging_pages + 1, 3 * staging_pages + 2)  # more than the staging: pieces
    src_pages = rng.sample(range(48), count)
    handshake = pb.Handshake(page_ids=rng.sample(range(64), count), layout=layout_of(pool), num_tokens=count * 4)
    handshake.mooncake.session_id = "127.0.0.1:1"
    handshake.mooncake.layer_base_addrs.extend((1 << 40) + layer * (1 << 30) for layer in range(pool.num_layers))
    handshake.mooncake.page_bytes = pool.bytes_per_page
    handshake.mooncake.pool_pages = 64
    handshake.mooncake.protocol = protocol
    channel = sender.open(handshake, emit=None)
    layer = rng.randrange(pool.num_layers)
    asyncio.run(channel.send(src_pages, 0))
    asyncio.run(channel.send(src_pages[:2], 0, layer_begin=layer, layer_end=layer + 1))  # layer-wise too
    assert channel.bytes_sent == (count * pool.num_layers + 2) * pool.bytes_per_page
    # Every page the engine was asked to write holds, where it read it, the source page the
    # handshake maps to that destination page, of that layer.
    page_bytes = pool.bytes_per_page
    source_of = dict(zip(handshake.page_ids, src_pages))
    checked = 0
    for (_, _, remote, lengths), pieces in zip(engine.writes, read):
        for addr, length, data in zip(remote, lengths, pieces):
            layer, offset = divmod(addr - (1 << 40), 1 << 30)
            for j in range(length // page_bytes):
                want = pool.buffers[layer][source_of[offset // page_bytes + j]].numpy().tobytes()
                assert data[j * page_bytes:(j + 1) * page_bytes] == want
                checked += 1
    assert checked * page_bytes == channel.bytes_sent
    locals_ = [addr for _, local, _, _ in engine.writes for addr in local]
    # Over either protocol the writes read the send staging (where a cipher encrypts: test_kv_cipher.py),
    # registered only over RDMA (the NIC's memory regions).
    assert set(engine.registered) == (set(sender.staging.base_addrs) if protocol == "rdma" else set())
    assert all(any(base <= addr < base + staging_pages * page_bytes for base in sender.staging.base_addrs)
               for addr in locals_)
    assert len(engine.writes) == -(-count // staging_pages) + 1  # one write per piece
    assert sender.staging.num_used == 0 and not any(b.any() for b in sender.staging.buffers)
    sender.close()
    assert not engine.registered
