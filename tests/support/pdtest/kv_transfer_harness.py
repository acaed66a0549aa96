"""Moves random KV pages between two KVPools through the real bootstrap service on 127.0.0.1.

Shared by the transport tests (fake, grpc in-process; mooncake inside a network namespace).
The prefill side uses the production `KVPush`, the decode side `pull_kv`, so these tests cover
the same code paths the engines run.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.engine.interface import DisaggParams
from deepseek_pd.workers.transport import TransportConfig, build_receiver, build_sender
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.prefill import bootstrap_servicer
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush


def random_pool(rng: random.Random, num_pages: int, page_size: int, num_layers: int = 3,
                kv_dim: int = 24, dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(num_layers, num_pages, page_size, kv_dim, dtype=dtype)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(dtype))
    return pool


def scattered_alloc(pool: KVPool, rng: random.Random, count: int) -> list[int]:
    """Allocates `count` pages that are not one contiguous run: allocate extra, free a random subset."""
    pages = pool.alloc(min(pool.num_free_pages, count * 2))
    rng.shuffle(pages)
    keep, spare = pages[:count], pages[count:]
    pool.free(spare)
    # Keep some neighbours adjacent so run merging has something to merge.
    return sorted(keep[: count // 2]) + keep[count // 2:]


@dataclass
class Side:
    pool: KVPool
    pages: list[int]


@dataclass
class Exchange:
    """Both ends of one transfer; `chunk_tokens` are the prefill chunk boundaries.

    `layerwise`: after each chunk the prefill side hands over its layers in random contiguous
    groups, in random order (`KVPush.layers_ready`), instead of all layers at once.
    """

    transport: str
    src: Side
    dst: Side
    num_tokens: int
    chunk_tokens: list[int]
    transport_config: TransportConfig = field(default_factory=TransportConfig)
    bootstrap_config: BootstrapConfig = field(
        default_factory=lambda: BootstrapConfig(port=0, handshake_timeout_s=5, claim_timeout_s=5,
                                                transfer_timeout_s=20))
    layerwise: bool = False
    seed: int = 0
    decode_transport_config: TransportConfig | None = None  # None: transport_config


def random_exchange(rng: random.Random, transport: str = "grpc", *, num_tokens: int, page_size: int,
                    num_layers: int = 3, kv_dim: int = 24, dtype: torch.dtype = torch.float32, chunks: int = 4,
                    **fields) -> Exchange:
    """A transfer of `num_tokens` tokens of random KV between two pools of a few spare pages, each
    side's pages scattered (not one run, not the same numbers on both sides), cut into up to
    `chunks` prefill chunks at random points; `fields` are the Exchange's other fields."""
    num_pages = -(-num_tokens // page_size)
    src = random_pool(rng, num_pages * 3 + 2, page_size, num_layers, kv_dim, dtype)
    dst = random_pool(rng, num_pages * 3 + 5, page_size, num_layers, kv_dim, dtype)
    cuts = sorted(rng.sample(range(1, num_tokens), k=min(chunks - 1, num_tokens - 1)))
    return Exchange(transport, Side(src, scattered_alloc(src, rng, num_pages)),
                    Side(dst, scattered_alloc(dst, rng, num_pages)), num_tokens, cuts + [num_tokens], **fields)


def slowed(delay_s: float):
    """An `emit_hook`: the stream waits `delay_s` after each chunk it sends, so that the transfer is
    still on the wire when the test acts."""
    def hook(emit):
        async def wrapped(chunk):
            await emit(chunk)
            await asyncio.sleep(delay_s)
        return wrapped
    return hook


def server_stopped_after(delay_s: float):
    """A `decode_hook`: the prefill side's bootstrap server stops `delay_s` into the pull (a prefill
    worker killed mid-transfer)."""
    async def hook(pull, server):
        task = asyncio.ensure_future(pull)
        await asyncio.sleep(delay_s)
        await server.stop(0)
        return await task
    return hook


def kv_streams_die_after(monkeypatch, chunks: int = 1) -> None:
    """The prefill side's extra KV streams serve `chunks` chunks in all, then the next one raises
    (a connection lost mid-transfer): its KVStream call ends with an error status."""
    real = bootstrap_servicer._next_chunk
    served = 0

    async def dying(queue, room, credit_task):
        nonlocal served
        chunk = await real(queue, room, credit_task)
        served += 1
        if served > chunks:
            raise RuntimeError("connection lost")
        return chunk
    monkeypatch.setattr(bootstrap_servicer, "_next_chunk", dying)


def layer_groups(rng: random.Random, num_layers: int) -> list[range]:
    """`range(num_layers)` cut at random points into contiguous groups, shuffled."""
    cuts = sorted(rng.sample(range(1, num_layers), k=rng.randrange(num_layers))) if num_layers > 1 else []
    bounds = [0, *cuts, num_layers]
    groups = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    rng.shuffle(groups)
    return groups


def pages_equal(exchange: Exchange) -> bool:
    for layer in range(exchange.src.pool.num_layers):
        src = exchange.src.pool.buffers[layer][exchange.src.pages]
        dst = exchange.dst.pool.buffers[layer][exchange.dst.pages]
        # The last page holds only num_tokens % page_size valid slots, but the whole page is sent.
        if not torch.equal(src, dst):
            return False
    return True


async def run_exchange(exchange: Exchange, room: int = 7, emit_hook=None, decode_hook=None,
                       sinks: list | None = None, dial_host: str = "127.0.0.1"):
    """Runs both sides concurrently; returns (prefill outcome, decode outcome), each a value or an exception.

    `sinks`, if given, receives the decode side's sink (to check it is marked failed).
    """
    registry = RoomRegistry(exchange.bootstrap_config)
    server = BootstrapServer(registry, exchange.bootstrap_config, exchange.transport_config.max_chunk_bytes,
                             kv_streams=exchange.transport_config.grpc_streams)
    await server.start()
    sender = build_sender(exchange.transport, exchange.src.pool, exchange.transport_config)
    server.servicer.answer = sender.answer_handshake
    receiver = build_receiver(exchange.transport, exchange.dst.pool,
                              exchange.decode_transport_config or exchange.transport_config)
    client = BootstrapClient(exchange.bootstrap_config)
    params = DisaggParams(dial_host, server.port, room)  # the host decode dials (and signs for)
    if sinks is not None:
        open_sink = receiver.open_sink

        def capture(pages, peer_host=None):
            sinks.append(open_sink(pages, peer_host))
            return sinks[-1]
        receiver.open_sink = capture
    rng = random.Random(exchange.seed)

    async def prefill():
        push = KVPush(registry, sender, room, "p-req", exchange.num_tokens)
        try:
            await push.handshake(exchange.bootstrap_config.handshake_timeout_s)
            if emit_hook is not None:
                push.channel.emit = emit_hook(push.channel.emit)
            for computed in exchange.chunk_tokens:
                if exchange.layerwise:
                    for layers in layer_groups(rng, exchange.src.pool.num_layers):
                        push.layers_ready(computed, exchange.src.pages, layers.start, layers.stop)
                        await asyncio.sleep(0)
                else:
                    push.pages_ready(computed, exchange.src.pages)
                await asyncio.sleep(0)
            await push.finish(first_token_id=42, logprob=-0.5, cached_tokens=0)
            return push.channel.bytes_sent
        finally:
            push.close()

    async def decode():
        coro = pull_kv(client, receiver, params, "d-req", exchange.num_tokens, exchange.dst.pages)
        if decode_hook is not None:
            return await decode_hook(coro, server)
        return await coro

    try:
        results = await asyncio.wait_for(
            asyncio.gather(prefill(), decode(), return_exceptions=True), 30)
    finally:
        await client.close()
        await server.stop(0)
        sender.close()
        receiver.close()
    assert registry.num_active == 0, "a room leaked in the registry"
    return results
