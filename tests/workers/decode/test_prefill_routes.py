"""The decode side's route to the prefill rank that holds a room (prefill_routes.py), against a
real prefill bootstrap server: the table it publishes, the room -> rank rule, the refusals."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from deepseek_pd.workers.transport.bootstrap_routes import RankEndpoint, RouteTable, dp_rank_for_room
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport.base import TransferError
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.decode.prefill_routes import PrefillRoutes, RouteUnavailable
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry

pytestmark = pytest.mark.timeout(60)


async def _serve(auth: InternalAuth, routes: RouteTable | None) -> BootstrapServer:
    config = BootstrapConfig(host="127.0.0.1", port=0, auth=auth)
    server = BootstrapServer(RoomRegistry(config), config, 1 << 20)
    server.servicer.routes = routes
    await server.start()
    return server


def _table(rng: random.Random) -> RouteTable:
    dp = rng.randint(2, 6)
    return RouteTable((RankEndpoint("", 0),) + tuple(RankEndpoint(f"127.0.0.{rng.randint(2, 250)}",
                                                                  rng.randint(1024, 65535)) for _ in range(dp - 1)))


def test_rooms_route_to_their_dp_rank_and_rank_zero_is_the_dialled_address() -> None:
    rng = random.Random()
    auth = InternalAuth(random.randbytes(32))
    table = _table(rng)

    async def run() -> None:
        server = await _serve(auth, table)
        routes = PrefillRoutes(auth, "decode@test")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            for _ in range(20):
                room = rng.randrange(2**31)
                got = await routes.route(channel, "127.0.0.1", server.port, room)
                dp_rank = dp_rank_for_room(room, table.dp_size)
                rank = table.ranks[dp_rank]
                want = ("127.0.0.1", server.port) if rank.host == "" else (rank.host, rank.port)
                assert (got.address, got.dp_rank, got.dp_size) == (want, dp_rank, table.dp_size)
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())


def test_a_reply_signed_with_another_secret_is_refused_and_a_forming_group_is_retried() -> None:
    async def run() -> None:
        server = await _serve(InternalAuth(random.randbytes(32)), _table(random.Random()))
        insecure = InternalAuth.insecure()
        forming = await _serve(insecure, None)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            with pytest.raises(TransferError, match="route request|not this deployment"):
                await PrefillRoutes(InternalAuth(random.randbytes(32)), "decode@test").route(
                    channel, "127.0.0.1", server.port, 1)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{forming.port}") as other:
                with pytest.raises(RouteUnavailable):
                    await PrefillRoutes(insecure, "decode@test").route(other, "127.0.0.1", forming.port, 1)
        finally:
            await channel.close()
            await server.stop(0)
            await forming.stop(0)

    asyncio.run(run())


def test_route_table_from_a_reply_that_does_not_hold_together_is_refused() -> None:
    table = _table(random.Random())
    reply = table.to_proto()
    assert RouteTable.from_proto(reply) == table
    reply.dp_size += 1
    with pytest.raises(ValueError):
        RouteTable.from_proto(reply)
    broken = table.to_proto()
    broken.ranks[1].host = ""
    with pytest.raises(ValueError):
        RouteTable.from_proto(broken)
