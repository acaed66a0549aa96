"""Mooncake KV transfers, run by test_kv_transfer_mooncake.py inside a private network namespace.

Exits non-zero (with the assertion) on any mismatch; prints one line per check on success.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import sys
import time

from deepseek_pd import env
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import TransportConfig, build_receiver, build_sender
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.wire import ChunkView
from pdtest.kv_transfer_harness import Exchange, pages_equal, random_exchange, random_pool, run_exchange


def exchange_for(seed: int, layerwise: bool = False) -> Exchange:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4])
    return random_exchange(rng, "mooncake", num_tokens=rng.randrange(2, 50), page_size=page_size, layerwise=layerwise,
                           seed=seed)


def check_copies(seed: int) -> None:
    """Pulled (the default) as a whole and layer by layer, through stagings smaller than the prompt
    on both sides, and the write direction a decode worker may still choose."""
    for k in range(3):
        exchange = exchange_for(seed + k, layerwise=k == 1)  # the second one layer by layer, in random order
        if k == 1:  # ... and longer than either staging: pieces through 4 prefill slots, decode's window
            tiny = TransportConfig(mooncake_staging_tokens=4 * exchange.src.pool.page_size)
            exchange = dataclasses.replace(exchange, transport_config=tiny)
        if k == 2:
            exchange = dataclasses.replace(exchange, decode_transport_config=TransportConfig(mooncake_kv_direction="write"))
        prefill, decode = asyncio.run(run_exchange(exchange))
        assert not isinstance(prefill, BaseException), repr(prefill)
        assert not isinstance(decode, BaseException), repr(decode)
        assert decode.num_pages == len(exchange.dst.pages)
        assert pages_equal(exchange), f"seed {seed + k}: pages differ"
        direction = (exchange.decode_transport_config or exchange.transport_config).mooncake_kv_direction
        print(f"copy ok seed={seed + k} {direction} pages={len(exchange.dst.pages)} bytes={prefill}")


def check_dead_peer() -> None:
    """A decode engine that is gone: the write fails fast with UNAVAILABLE, not a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    pool = random_pool(random.Random(), 6, 2)
    sender = build_sender("mooncake", pool, TransportConfig(send_timeout_s=10))
    handshake = pb.Handshake(num_tokens=4, page_ids=[0, 1], layout=layout_of(pool))
    handshake.mooncake.session_id = f"127.0.0.1:{dead_port}"
    handshake.mooncake.layer_base_addrs.extend(b.data_ptr() for b in pool.buffers)
    handshake.mooncake.page_bytes = pool.bytes_per_page
    handshake.mooncake.pool_pages = pool.num_pages

    async def run() -> None:
        async def no_emit(chunk):
            raise AssertionError("mooncake must not use the stream")
        channel = sender.open(handshake, no_emit)
        await channel.send([2, 3], 0)

    try:
        asyncio.run(run())
    except TransferError as exc:
        assert exc.code == FailureCode.UNAVAILABLE, exc
        print("dead peer ok:", exc.message)
    else:
        raise AssertionError("write to a dead mooncake peer succeeded")
    finally:
        sender.close()


def check_dead_source() -> None:
    """A pulled transfer whose prefill engine is gone: decode's read fails fast with UNAVAILABLE and
    fails the sink, not a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    pool = random_pool(random.Random(), 6, 2)
    receiver = build_receiver("mooncake", pool, TransportConfig(send_timeout_s=10))
    ack = pb.HandshakeAck()
    ack.mooncake_source.session_id = f"127.0.0.1:{dead_port}"
    ack.mooncake_source.layer_base_addrs.extend([1 << 20] * pool.num_layers)
    ack.mooncake_source.page_bytes = pool.bytes_per_page
    ack.mooncake_source.pool_pages = 4
    sink = receiver.open_sink([1, 2])
    began = time.monotonic()
    try:
        asyncio.run(sink.reserve())
        sink.expose()
        sink.accept_answer(ack)
        sink.on_chunk(ChunkView(0, pool.num_layers, 0, 2, memoryview(b""), 0, True, (0, 1)))
    except TransferError as exc:
        assert exc.code == FailureCode.UNAVAILABLE and sink.failed is exc, exc
        print(f"dead source ok ({time.monotonic() - began:.1f}s):", exc.message)
    else:
        raise AssertionError("a read from a dead mooncake prefill engine succeeded")
    finally:
        sink.withdraw()
        receiver.close()


def listening_ports() -> set[int]:
    """The TCP ports listened on in this namespace (only this script runs in it)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def check_engine_ports() -> None:
    """Every port a Mooncake engine listens on lies in the range local port picks stay out of
    (deepseek_pd/ports.py): the assumption the pickers rest on, checked against the library."""
    before = listening_ports()
    pool = random_pool(random.Random(), 4, 2)
    senders = [build_sender("mooncake", pool, TransportConfig()) for _ in range(3)]
    try:
        opened = listening_ports() - before
        assert len(opened) >= 3 and opened <= set(env.mooncake_rpc_ports()), (sorted(opened), env.mooncake_rpc_ports())
        print(f"engine ports ok: {sorted(opened)}")
    finally:
        for sender in senders:
            sender.close()


if __name__ == "__main__":
    check_engine_ports()
    check_copies(int(sys.argv[1]))
    check_dead_peer()
    check_dead_source()
