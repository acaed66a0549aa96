"""Attacks on the prefill <-> decode channel by a peer without the deployment secret: each fails;
and by a prefill peer with it that lies (pdtest/hostile_prefill.py): only its own requests fail.

Checked on main before the fix: the unauthenticated reader got the room's KV chunks, the
unauthenticated Abort failed the room, decode dialled the unregistered port; all pass now.
"""
from __future__ import annotations

import asyncio
import random
import socket

import grpc
import pytest
import torch

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.engine.interface import DisaggParams, FailureCode
from deepseek_pd.workers.transport.bootstrap_protocol import PROTOCOL_VERSION
from deepseek_pd.workers.transport import build_receiver, build_sender
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush
from pdtest.hostile_prefill import LIES
from pdtest.pd_engine_harness import PDPair, collect, oracle, runner, worker_config

pytestmark = pytest.mark.timeout(180)


def _pool(rng: random.Random, pages: int = 8) -> KVPool:
    pool = KVPool(2, pages, 4, 16)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return pool


async def _prefill(config: BootstrapConfig, pool: KVPool):
    registry = RoomRegistry(config)
    server = BootstrapServer(registry, config, 1 << 20)
    await server.start()
    return registry, server, build_sender("grpc", pool, TransportConfig())


def test_reading_another_rooms_kv_without_the_secret_fails():
    rng = random.Random()
    room = rng.randrange(1 << 31)

    async def run():
        src = _pool(rng)
        registry, server, sender = await _prefill(BootstrapConfig(port=0, handshake_timeout_s=2), src)
        push = KVPush(registry, sender, room, "victim", 8)
        try:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
            handshake = pb.Handshake(protocol_version=PROTOCOL_VERSION, room=room, num_tokens=8,
                                     page_ids=[0, 1], layout=layout_of(src))
            handshake.grpc.max_chunk_bytes = 1 << 20
            call = pb_grpc.BootstrapStub(channel).Transfer()
            await call.write(pb.DecodeMessage(handshake=handshake))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert registry.get(room).handshake.done() is False  # the room never saw the attacker
            await channel.close()
        finally:
            push.close()
            await server.stop(0)
            sender.close()

    asyncio.run(run())


def test_abort_without_the_token_fails_and_the_room_survives():
    rng = random.Random()
    room = rng.randrange(1 << 31)

    async def run():
        registry, server, sender = await _prefill(BootstrapConfig(port=0), _pool(rng))
        push = KVPush(registry, sender, room, "victim", 8)
        try:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.BootstrapStub(channel).Abort(pb.AbortRoom(room=room, reason="attack"))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not registry.get(room).peer_gone.done()
            await channel.close()
            # A forged token (another secret) fails the same way.
            other = BootstrapConfig(auth=type(registry.config.auth)(secret=b"x" * 32))
            client = BootstrapClient(other)
            await client.abort(DisaggParams("127.0.0.1", server.port, room), "attack")
            assert not registry.get(room).peer_gone.done()
            # The deployment's own decode worker may still abort it.
            client = BootstrapClient(registry.config)
            await client.abort(DisaggParams("127.0.0.1", server.port, room), "decode gave up")
            assert registry.get(room).peer_gone.done()
            await client.close()
        finally:
            push.close()
            await server.stop(0)
            sender.close()

    asyncio.run(run())


def test_decode_refuses_an_unregistered_bootstrap_address_before_connecting():
    rng = random.Random()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    registered = f"127.0.0.1:{rng.randrange(20000, 30000)}"
    config = BootstrapConfig(handshake_timeout_s=1, prefill_peers=(registered,))
    pool = _pool(rng)

    async def run():
        client = BootstrapClient(config)
        receiver = build_receiver("grpc", pool, TransportConfig())
        try:
            handshake = pb.Handshake(num_tokens=4, page_ids=[0], layout=layout_of(pool))
            receiver.fill_destination(handshake)
            with pytest.raises(TransferError) as refused:
                await client.transfer(DisaggParams("127.0.0.1", port, 1), handshake, receiver.open_sink([0]))
            return refused.value
        finally:
            await client.close()
            receiver.close()

    error = asyncio.run(run())
    assert error.code == FailureCode.INVALID_ARGUMENT and "not a registered prefill" in error.message
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody ever connected: no timing to tell an open port from a closed one
    listener.close()


def test_nan_kv_is_refused_and_scrubbed_without_touching_other_pages():
    from deepseek_pd.workers.decode.kv_checks import check_kv_finite, scrub_pages

    rng = random.Random()
    pool = _pool(rng, pages=6)
    mine, others = [1, 4], [0, 2, 3, 5]
    before = [buffer[others].clone() for buffer in pool.buffers]
    check_kv_finite(pool, mine, "ok")  # finite KV passes
    pool.buffers[rng.randrange(2)][rng.choice(mine), rng.randrange(4), rng.randrange(16)] = float("nan")
    with pytest.raises(TransferError) as refused:
        check_kv_finite(pool, mine, "r")
    assert refused.value.code == FailureCode.INTERNAL and "NaN" in refused.value.message
    scrub_pages(pool, mine)
    for buffer, kept in zip(pool.buffers, before):
        assert torch.count_nonzero(buffer[mine]) == 0
        assert torch.equal(buffer[others], kept)


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_prefill_fails_its_own_requests_alone(lie, monkeypatch):
    """A prefill peer sends a first token past the vocabulary, or NaN in the KV: its requests fail
    (INTERNAL, saying why) while the honest requests decoding in the same batch, and a later wave
    that reuses the refused pages, give exactly the offline engine's greedy tokens. Without
    `check_first_token` the bad id failed the whole batch; without the finite check and the
    scrub, NaN pages turned later requests' outputs into runs of token 0."""
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.workers.engine.interface import Failed
    from deepseek_pd.workers.decode import engine as decode_engine
    from deepseek_pd.workers.prefill.engine import PrefillEngine

    rng = random.Random()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    vocab = oracle().vocab_size
    prompt = lambda low, high: [rng.randrange(2, vocab) for _ in range(rng.randrange(low, high))]  # noqa: E731
    honest, evil = [prompt(3, 40) for _ in range(4)], [prompt(10, 40) for _ in range(2)]
    extra = [prompt(40, 50) for _ in range(2)]  # wave 2 needs more pages than wave 1 freed
    expected = {tuple(p): oracle().generate(p, greedy).output_ids for p in honest + evil + extra}
    pulled: dict[str, list[int]] = {}
    pull_kv = decode_engine.pull_kv

    def recording_pull(client, receiver, disagg, rid, num_tokens, pages, *rest):
        pulled[rid] = list(pages)
        return pull_kv(client, receiver, disagg, rid, num_tokens, pages, *rest)
    monkeypatch.setattr(decode_engine, "pull_kv", recording_pull)

    async def run():
        async with PDPair("grpc") as pair:
            hostile = PrefillEngine(runner(), worker_config("grpc"))
            await hostile.start()
            LIES[lie](hostile, rng)
            try:
                decoding = asyncio.Event()

                async def on_event(event):
                    decoding.set()

                async def lied_to(i, p):
                    await decoding.wait()  # the honest requests are in the decode batch by now
                    p_req, d_req = pair.requests(p, greedy, f"evil{i}", prefill=hostile)
                    return (await asyncio.gather(collect(hostile, p_req), collect(pair.decode, d_req)))[1]

                async def honest_run(i, p):
                    p_req, d_req = pair.requests(p, greedy, f"honest{i}")
                    return (await asyncio.gather(collect(pair.prefill, p_req),
                                                 collect(pair.decode, d_req, on_event)))[1]

                wave1 = await asyncio.gather(*(honest_run(i, p) for i, p in enumerate(honest)),
                                             *(lied_to(i, p) for i, p in enumerate(evil)))
                await pair.wait_pools_clean()
                wave2 = await asyncio.gather(*(pair.run(p, greedy, f"later{i}")
                                               for i, p in enumerate(honest + evil + extra)))
                await pair.wait_pools_clean()
                return wave1, [d for _, d in wave2]
            finally:
                await hostile.stop()

    wave1, wave2 = asyncio.run(run())
    reason = "outside the vocabulary" if lie == "first_token" else "NaN"
    for outcome, p in zip(wave1, honest + evil):
        if p in evil:
            assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.INTERNAL
            assert reason in outcome.terminal.message and not outcome.tokens, outcome.terminal
        else:
            assert outcome.ok and outcome.tokens == expected[tuple(p)], outcome
    for outcome, p in zip(wave2, honest + evil + extra):
        assert outcome.ok and outcome.tokens == expected[tuple(p)], (outcome, "wave 2")
    refused = {page for rid, pages in pulled.items() if rid.startswith("evil") for page in pages}
    reused = {page for rid, pages in pulled.items() if rid.startswith("later") for page in pages}
    assert refused and refused <= reused, "wave 2 did not reuse the refused pages: the test proves nothing"
