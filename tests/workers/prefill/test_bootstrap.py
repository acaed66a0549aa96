"""The bootstrap rendezvous: arrival order, retries, version and duplicate checks, aborts, timeouts."""
from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import DisaggParams, FailureCode
from deepseek_pd.workers.transport import TransportConfig, build_receiver, build_sender
from deepseek_pd.workers.engine.request_failure import RequestAborted, TransferError
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.wire import ChunkHeader, encode_chunk_event
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.room import Room, TransferPhase
from deepseek_pd.workers.prefill.kv_push import KVPush
from pdtest.kv_transfer_harness import pages_equal, random_pool, Exchange, Side

pytestmark = pytest.mark.timeout(60)


class Prefill:
    """A bootstrap server plus the prefill engine's side of one room, steps under test control."""

    def __init__(self, config: BootstrapConfig, pool) -> None:
        self.registry = RoomRegistry(config)
        self.server = BootstrapServer(self.registry, config, 1 << 20)
        self.sender = build_sender("grpc", pool, TransportConfig())
        self.pool = pool
        self.rooms: list[Room] = []

    async def serve_room(self, room: int, pages: list[int], num_tokens: int) -> int:
        push = KVPush(self.registry, self.sender, room, f"p{room}", num_tokens)
        self.rooms.append(push.room)
        try:
            await push.handshake(self.registry.config.handshake_timeout_s)
            push.pages_ready(num_tokens, pages)
            await push.finish(first_token_id=room % 1000, logprob=0.0, cached_tokens=0)
            return room
        finally:
            push.close()


def copy(handshake: pb.Handshake) -> pb.Handshake:
    clone = pb.Handshake()
    clone.CopyFrom(handshake)
    return clone


def setup(seed: int, **config):
    rng = random.Random(seed)
    settings = dict(port=0, handshake_timeout_s=5, claim_timeout_s=5, transfer_timeout_s=10)
    settings.update(config)
    bootstrap = BootstrapConfig(**settings)
    src, dst = random_pool(rng, 10, 4), random_pool(rng, 10, 4)
    return bootstrap, src, dst


@pytest.mark.parametrize("decode_first", [True, False])
def test_either_side_may_arrive_first(decode_first):
    bootstrap, src, dst = setup(random.randrange(1 << 20))

    async def run():
        prefill = Prefill(bootstrap, src)
        await prefill.server.start()
        client = BootstrapClient(bootstrap)
        receiver = build_receiver("grpc", dst, TransportConfig())
        params = DisaggParams("127.0.0.1", prefill.server.port, 11)
        try:
            decode = asyncio.ensure_future(pull_kv(client, receiver, params, "d", 10, [7, 2, 5]))
            serve = None
            if decode_first:
                await asyncio.sleep(0.3)
            serve = asyncio.ensure_future(prefill.serve_room(11, [1, 4, 3], 10))
            if not decode_first:
                await asyncio.sleep(0.3)
            done, _ = await asyncio.gather(decode, serve)
            return done, prefill.rooms[0].phase
        finally:
            await client.close()
            await prefill.server.stop(0)

    done, phase = asyncio.run(run())
    assert done.first_token_id == 11 and done.num_pages == 3
    assert phase is TransferPhase.DONE
    assert pages_equal(Exchange("grpc", Side(src, [1, 4, 3]), Side(dst, [7, 2, 5]), 10, [10]))


def test_decode_retries_until_the_prefill_bootstrap_comes_up():
    port = pick_free_ports(1)[0]
    bootstrap, src, dst = setup(1, port=port, retry_initial_s=0.05)

    async def run():
        client = BootstrapClient(bootstrap)
        receiver = build_receiver("grpc", dst, TransportConfig())
        decode = asyncio.ensure_future(pull_kv(client, receiver, DisaggParams("127.0.0.1", port, 3), "d", 4, [0]))
        await asyncio.sleep(0.6)  # the decode side is already retrying
        prefill = Prefill(bootstrap, src)
        await prefill.server.start()
        try:
            return (await asyncio.gather(decode, prefill.serve_room(3, [9], 4)))[0]
        finally:
            await client.close()
            await prefill.server.stop(0)

    assert asyncio.run(run()).first_token_id == 3


async def raw_handshake(port: int, handshake: pb.Handshake, config: BootstrapConfig, pool):
    client = BootstrapClient(config)
    receiver = build_receiver("grpc", pool, TransportConfig())
    try:
        return await client.transfer(DisaggParams("127.0.0.1", port, handshake.room), handshake,
                                     receiver.open_sink(list(handshake.page_ids)))
    finally:
        await client.close()


def test_protocol_version_mismatch_is_refused_on_both_sides():
    bootstrap, src, dst = setup(2)

    async def run():
        prefill = Prefill(bootstrap, src)
        await prefill.server.start()
        try:
            push = KVPush(prefill.registry, prefill.sender, 21, "p", 4)
            handshake = pb.Handshake(room=21, num_tokens=4, page_ids=[0], layout=layout_of(dst))
            client = BootstrapClient(bootstrap)
            stub_call = client._stub(DisaggParams("127.0.0.1", prefill.server.port, 21)).Transfer()
            handshake.protocol_version = 999  # what a future decode worker might send
            bootstrap.auth.sign(handshake, "handshake", "decode", f"127.0.0.1:{prefill.server.port}")
            await stub_call.write(pb.DecodeMessage(handshake=handshake))
            with pytest.raises(Exception) as decode_error:
                await stub_call.read()
            start = time.monotonic()
            with pytest.raises(TransferError) as prefill_error:
                await push.handshake(5)
            assert time.monotonic() - start < 1  # not the handshake timeout
            push.close()
            await client.close()
            return decode_error.value, prefill_error.value
        finally:
            await prefill.server.stop(0)

    decode_error, prefill_error = asyncio.run(run())
    assert "FAILED_PRECONDITION" in str(decode_error) and "version" in str(decode_error)
    assert "version" in prefill_error.message


def test_a_room_takes_one_handshake_and_one_prefill_request():
    bootstrap, src, dst = setup(3, claim_timeout_s=1)

    async def run():
        prefill = Prefill(bootstrap, src)
        await prefill.server.start()
        try:
            handshake = pb.Handshake(room=5, num_tokens=4, page_ids=[0], layout=layout_of(dst))
            handshake.grpc.max_chunk_bytes = 1 << 20
            first = asyncio.ensure_future(raw_handshake(prefill.server.port, copy(handshake), bootstrap, dst))
            await asyncio.sleep(0.2)
            with pytest.raises(TransferError) as duplicate:
                await raw_handshake(prefill.server.port, copy(handshake), bootstrap, dst)
            prefill.registry.claim(9, "a")
            with pytest.raises(TransferError) as twice:
                prefill.registry.claim(9, "b")
            prefill.registry.release(prefill.registry.get(9))
            with pytest.raises(TransferError) as unclaimed:
                await first  # nobody claims room 5: the claim timeout answers the decode side
            return duplicate.value, twice.value, unclaimed.value
        finally:
            await prefill.server.stop(0)

    duplicate, twice, unclaimed = asyncio.run(run())
    assert duplicate.code == FailureCode.INVALID_ARGUMENT and "already" in duplicate.message
    assert twice.code == FailureCode.INVALID_ARGUMENT
    assert unclaimed.code == FailureCode.DEADLINE_EXCEEDED and "never received" in unclaimed.message


def test_abort_before_the_prefill_request_arrives_fails_it_at_once():
    bootstrap, src, dst = setup(4, claim_timeout_s=2)

    async def run():
        prefill = Prefill(bootstrap, src)
        await prefill.server.start()
        client = BootstrapClient(bootstrap)
        try:
            await client.abort(DisaggParams("127.0.0.1", prefill.server.port, 31), "client went away")
            push = KVPush(prefill.registry, prefill.sender, 31, "late", 4)
            start = time.monotonic()
            with pytest.raises(RequestAborted) as error:  # the decode side's abort, by meaning
                await push.handshake(5)
            push.close()
            assert time.monotonic() - start < 1
            return error.value, len(prefill.registry)
        finally:
            await client.close()
            await prefill.server.stop(0)

    error, rooms_left = asyncio.run(run())
    assert error.code == FailureCode.ABORTED and "client went away" in error.message
    assert rooms_left == 0


def test_transfer_done_behind_a_full_queue_times_out_instead_of_hanging():
    """Decode silently gone (host frozen, no RST) after the last KV chunk filled the room's queue:
    queuing TransferDone must give up after the send timeout, like every other wait, instead of
    holding the prefill request (and its pages) until the connection is declared dead."""
    rng = random.Random()
    depth = rng.randrange(1, 5)
    bootstrap = BootstrapConfig(port=0, event_queue_depth=depth)

    async def run():
        room = RoomRegistry(bootstrap).claim(rng.randrange(2**31), "p")
        for _ in range(depth):  # nobody reads: the stream is stuck
            await room.emit_chunk(encode_chunk_event(1, ChunkHeader(0, 1, 0, 1), b"", 0))
        with pytest.raises(TransferError) as error:
            await asyncio.wait_for(room.finish(pb.TransferDone(num_pages=1), timeout_s=0.2), 20)
        return error.value

    error = asyncio.run(run())
    assert error.code == FailureCode.DEADLINE_EXCEEDED


def test_a_busy_bootstrap_port_is_a_clear_user_error():
    """`serve --bootstrap-port` on a port in use: one line naming the port, not a grpc traceback."""
    from deepseek_pd.errors import UserError

    async def run():
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            config = BootstrapConfig(host="127.0.0.1", port=port)
            with pytest.raises(UserError, match=f"127.0.0.1:{port}"):
                BootstrapServer(RoomRegistry(config), config, 1 << 20)

    asyncio.run(run())


def test_two_bootstrap_servers_cannot_share_a_port():
    """gRPC enables SO_REUSEPORT by default: two prefill workers given the same --bootstrap-port
    both bound it and the kernel split decode handshakes between them (rooms never met)."""
    from deepseek_pd.errors import UserError

    async def run():
        first_config = BootstrapConfig(host="127.0.0.1", port=0)
        first = BootstrapServer(RoomRegistry(first_config), first_config, 1 << 20)
        await first.start()
        try:
            config = BootstrapConfig(host="127.0.0.1", port=first.port)
            with pytest.raises(UserError, match=f"127.0.0.1:{first.port}"):
                BootstrapServer(RoomRegistry(config), config, 1 << 20)
        finally:
            await first.stop(0)

    asyncio.run(run())


def test_transfer_phases_allow_only_the_steps_in_their_table():
    """HANDSHAKE -> ACCEPTED -> STREAMING -> CONFIRMING -> DONE, FAILED from any non-terminal phase;
    everything else is refused (a bug), and a terminal phase never changes."""
    from deepseek_pd.workers.prefill.room import _NEXT

    order = [TransferPhase.HANDSHAKE, TransferPhase.ACCEPTED, TransferPhase.STREAMING,
             TransferPhase.CONFIRMING, TransferPhase.DONE]

    async def run():
        for start in TransferPhase:
            for to in TransferPhase:
                room = Room(1, 1)
                room.phase = start
                allowed = (not start.terminal and (to is TransferPhase.FAILED
                                                   or order.index(to) == order.index(start) + 1))
                assert (to in _NEXT[start]) == allowed, (start, to)
                if start.terminal:
                    assert room.advance(to) is False and room.phase is start
                elif allowed:
                    assert room.advance(to) and room.phase is to
                else:
                    with pytest.raises(RuntimeError, match="not allowed"):
                        room.advance(to)

    asyncio.run(run())


def test_a_failed_handshake_check_leaves_the_room_failed():
    """A decode side with another KV layout: the room goes HANDSHAKE -> ACCEPTED -> FAILED."""
    bootstrap, src, _ = setup(random.randrange(1 << 20))
    dst = random_pool(random.Random(), 10, 4, kv_dim=8)

    async def run():
        prefill = Prefill(bootstrap, src)
        await prefill.server.start()
        client = BootstrapClient(bootstrap)
        receiver = build_receiver("grpc", dst, TransportConfig())
        try:
            decode = asyncio.ensure_future(
                pull_kv(client, receiver, DisaggParams("127.0.0.1", prefill.server.port, 12), "d", 4, [3]))
            serve = asyncio.ensure_future(prefill.serve_room(12, [1], 4))
            results = await asyncio.gather(decode, serve, return_exceptions=True)
            return results, prefill.rooms[0].phase
        finally:
            await client.close()
            await prefill.server.stop(0)

    (decode, serve), phase = asyncio.run(run())
    assert isinstance(decode, TransferError) and isinstance(serve, TransferError)
    assert "layout mismatch" in serve.message and phase is TransferPhase.FAILED
