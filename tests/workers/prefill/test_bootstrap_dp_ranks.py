"""A prefill group's DP ranks on the bootstrap channel: a room's KV moves from its own prefill rank
(`room % dp`), and a handshake that reaches another rank is refused at once, naming both ranks,
instead of waiting out the claim timeout.

Two real bootstrap servers stand for DP ranks 0 and 1 of a prefill group (rank 0 publishes the
route table, as `group_main` does); the decode side is the production `pull_kv`.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from deepseek_pd.workers.engine.interface import DisaggParams
from deepseek_pd.workers.transport.bootstrap_routes import RankEndpoint, RouteTable
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport import TransportConfig, build_receiver, build_sender
from deepseek_pd.workers.metrics.worker_metrics import HANDSHAKE_FAILURE_REASONS, WorkerMetrics
from deepseek_pd.workers.engine.request_failure import RequestFailure
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush
from pdtest.kv_transfer_harness import random_pool

pytestmark = pytest.mark.timeout(60)

CLAIM_TIMEOUT_S = 20.0  # what a misrouted handshake used to wait for; the refusal must come long before
PAGE_SIZE = 4


class _Rank:
    """One prefill DP rank's bootstrap server, KV pool and sender."""

    def __init__(self, config: BootstrapConfig, rng: random.Random) -> None:
        self.registry = RoomRegistry(config)
        self.metrics = WorkerMetrics()
        self.server = BootstrapServer(self.registry, config, 1 << 20, metrics=self.metrics)
        self.pool = random_pool(rng, 12, PAGE_SIZE)
        self.sender = build_sender("grpc", self.pool, TransportConfig())

    async def serve_room(self, room: int, pages: list[int], num_tokens: int) -> None:
        push = KVPush(self.registry, self.sender, room, f"p{room}", num_tokens)
        try:
            await push.handshake(self.registry.config.handshake_timeout_s)
            push.pages_ready(num_tokens, pages)
            await push.finish(first_token_id=room % 100, logprob=0.0, cached_tokens=0)
        finally:
            push.close()


async def _group(rng: random.Random, auth: InternalAuth) -> list[_Rank]:
    ranks = [_Rank(BootstrapConfig(port=0, auth=auth, dp_rank=d, dp_size=2, claim_timeout_s=CLAIM_TIMEOUT_S,
                                   handshake_timeout_s=CLAIM_TIMEOUT_S), rng) for d in range(2)]
    for rank in ranks:
        await rank.server.start()
    ranks[0].server.servicer.routes = RouteTable((RankEndpoint("", 0), RankEndpoint("127.0.0.1", ranks[1].server.port)))
    return ranks


def _room(rng: random.Random, dp_rank: int) -> int:
    room = rng.randrange(2**31 - 2)
    return room - room % 2 + dp_rank


def test_each_room_moves_from_its_own_dp_rank_through_rank_zeros_address() -> None:
    rng = random.Random()
    auth = InternalAuth(random.randbytes(32))

    async def run() -> None:
        ranks = await _group(rng, auth)
        decode_pool = random_pool(rng, 12, PAGE_SIZE)
        client = BootstrapClient(BootstrapConfig(auth=auth, dp_rank=rng.randrange(3), dp_size=3))
        receiver = build_receiver("grpc", decode_pool, TransportConfig())
        try:
            for dp_rank in rng.sample([0, 1], 2):
                room, num_tokens = _room(rng, dp_rank), rng.randint(1, 3 * PAGE_SIZE)
                count = -(-num_tokens // PAGE_SIZE)
                src, dst = rng.sample(range(12), count), rng.sample(range(12), count)
                params = DisaggParams("127.0.0.1", ranks[0].server.port, room)
                done, _ = await asyncio.gather(pull_kv(client, receiver, params, f"d{room}", num_tokens, dst),
                                               ranks[dp_rank].serve_room(room, src, num_tokens))
                assert done.first_token_id == room % 100 and done.num_pages == count
                for layer, buffer in enumerate(decode_pool.buffers):
                    assert torch.equal(buffer[dst], ranks[dp_rank].pool.buffers[layer][src]), (dp_rank, layer)
        finally:
            await client.close()
            for rank in ranks:
                await rank.server.stop(0)

    asyncio.run(run())


@pytest.mark.parametrize("owner", [0, 1], ids=["other-rank-s-room", "own-room-stale-table"])
def test_a_handshake_at_the_wrong_dp_rank_fails_at_once_naming_both_ranks(owner) -> None:
    """The decode side names DP rank 1's own address as the group's (its Route answers a one-rank
    table). A room of rank 0 is not rank 1's; a room of rank 1, routed by a table that says one rank,
    means decode's picture of the group is wrong: half its rooms would fail, so all are refused."""
    rng = random.Random()
    auth = InternalAuth(random.randbytes(32))
    decode_rank = rng.randrange(4)

    async def run() -> tuple[RequestFailure, float, dict]:
        ranks = await _group(rng, auth)
        client = BootstrapClient(BootstrapConfig(auth=auth, dp_rank=decode_rank, dp_size=4))
        receiver = build_receiver("grpc", random_pool(rng, 12, PAGE_SIZE), TransportConfig())
        room = _room(rng, owner)
        started = time.monotonic()
        try:
            with pytest.raises(RequestFailure) as caught:
                await pull_kv(client, receiver, DisaggParams("127.0.0.1", ranks[1].server.port, room), "d", 4, [0])
            assert ranks[1].registry.get(room) is None  # refused before it touched a room
            refusals = {reason: ranks[1].metrics.registry.get_sample_value(
                "deepseek_pd:bootstrap_handshake_failures_total",
                {"role": "", "model_name": "", "rank": "0", "reason": reason}) for reason in HANDSHAKE_FAILURE_REASONS}
            return caught.value, time.monotonic() - started, refusals
        finally:
            await client.close()
            for rank in ranks:
                await rank.server.stop(0)

    failure, seconds, refusals = asyncio.run(run())
    assert seconds < CLAIM_TIMEOUT_S / 4, seconds
    # The prefill rank counts it too (decode does not retry a refused handshake).
    assert refusals == {reason: float(reason == "wrong_dp_rank") for reason in HANDSHAKE_FAILURE_REASONS}
    message = str(failure)
    assert "misrouted handshake" in message, message
    assert f"belongs to prefill DP rank {owner} of 2" in message, message
    assert "this is prefill DP rank 1" in message, message
    assert f"decode DP rank {decode_rank} routed it to prefill DP rank 0 of 1" in message, message
