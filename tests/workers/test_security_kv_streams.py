"""A peer without the deployment secret cannot attach to a room's extra KV stream (Bootstrap.KVStream):
unsigned, or signed with another secret, it is refused UNAUTHENTICATED while the room's own
decode side, which opened its streams with tokens bound to its handshake, gets every page exactly."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport import TransportConfig
from pdtest.kv_transfer_harness import pages_equal, random_exchange, run_exchange

pytestmark = pytest.mark.timeout(90)

ROOM = 7  # run_exchange's room


def test_a_kv_stream_without_the_secret_is_refused_and_the_transfer_is_untouched():
    rng = random.Random()
    exchange = random_exchange(rng, num_tokens=rng.randrange(60, 90), page_size=4, chunks=1,
                               transport_config=TransportConfig(max_chunk_bytes=1024, grpc_streams=3))
    refused: list[grpc.StatusCode] = []

    def slow(emit):  # keeps the room streaming while the attacker tries
        async def wrapped(chunk):
            await asyncio.sleep(0.01)
            await emit(chunk)
        return wrapped

    async def attack(coro, server):
        transfer = asyncio.ensure_future(coro)
        while (room := server.registry.get(ROOM)) is None or not room.handshake.done():
            await asyncio.sleep(0.005)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for signer in (None, InternalAuth(secret=random.randbytes(32))):
                call = channel.stream_stream("/deepseek_pd.pd.v1.Bootstrap/KVStream",
                                             request_serializer=pb.KVStreamMessage.SerializeToString,
                                             response_deserializer=pb.TransferEvent.FromString)()
                opening = pb.KVStreamOpen(room=ROOM, index=rng.randrange(1, 3))
                if signer is not None:
                    signer.sign(opening, "kvstream", "decode@evil", f"127.0.0.1:{server.port}",
                                f"room={ROOM};index={opening.index}", random.randbytes(16))
                await call.write(pb.KVStreamMessage(open=opening))
                try:
                    event = await call.read()
                    raise AssertionError(f"the attacker's KV stream was served: {event}")
                except grpc.aio.AioRpcError as exc:
                    refused.append(exc.code())
        return await transfer

    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=slow, decode_hook=attack))
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 2, refused
    assert not isinstance(prefill, BaseException), prefill
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(exchange) and len(decode.stream_chunks) == 2 and sum(decode.stream_chunks) > 0
