"""The deployment secret's edge cases (workers/transport/internal_auth.py): replays, stale or
misaddressed tokens, answers to another stream, unsafe secret files, contradicting flags, and
the replay guard's own bookkeeping (bounded, forgets in order, O(1) per message)."""
from __future__ import annotations

import asyncio
import os
import random
import time

import grpc
import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.transport import internal_auth
from deepseek_pd.workers.transport.bootstrap_protocol import PROTOCOL_VERSION
from deepseek_pd.workers.transport.internal_auth import (
    SECRET_FILE_ENV, AuthError, InternalAuth, ReplayGuard, create_secret_file, read_secret_file, resolve_auth)
from deepseek_pd.workers.transport import TransportConfig, build_sender
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush
from pdtest.kv_transfer_harness import random_pool

pytestmark = pytest.mark.timeout(60)


# ---- ReplayGuard ------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = random.uniform(0, 1e6)

    def __call__(self) -> float:
        return self.now


class _CountingNonce(bytes):
    """A nonce that counts how often it is hashed: each hash is one entry the guard touched."""
    hashes = 0

    def __hash__(self) -> int:
        type(self).hashes += 1
        return bytes.__hash__(self)


def test_replay_guard_refuses_replays_and_forgets_expired_nonces_in_order():
    clock, window = _Clock(), random.uniform(10, 100)
    guard = ReplayGuard(window, clock=clock)
    lifetime = 2 * window
    arrivals, count = [], random.randrange(50, 100)
    for _ in range(count):  # all within one lifetime: none expires yet
        nonce = random.randbytes(16)
        guard.check(nonce)
        arrivals.append((clock.now, nonce))
        clock.now += random.uniform(0, lifetime / (2 * count))
    assert len(guard) == count
    for _, nonce in random.sample(arrivals, 10):
        with pytest.raises(AuthError, match="replay"):
            guard.check(nonce)
    with pytest.raises(AuthError, match="16-byte"):
        guard.check(random.randbytes(15))
    # Move past the first k arrivals' lifetime: exactly those are forgotten (at the next check).
    k = random.randrange(1, len(arrivals) - 1)
    clock.now = arrivals[k - 1][0] + lifetime
    expired = sum(t + lifetime <= clock.now for t, _ in arrivals)  # k, or more on equal times
    guard.check(random.randbytes(16))
    assert len(guard) == len(arrivals) - expired + 1
    guard.check(arrivals[0][1])  # expired: a fresh message may reuse it (its timestamp would be stale)
    with pytest.raises(AuthError, match="replay"):
        guard.check(arrivals[-1][1])  # still within its lifetime


def test_replay_guard_memory_is_bounded_by_the_rate_times_the_lifetime():
    clock, window = _Clock(), 5.0
    guard = ReplayGuard(window, clock=clock)
    rate = random.randrange(200, 400)  # messages per second, sustained
    sizes = []
    for _ in range(int(rate * 2 * window * 3)):
        clock.now += 1 / rate
        guard.check(random.randbytes(16))
        sizes.append(len(guard))
    assert max(sizes) <= rate * 2 * window + 1


def test_replay_guard_touches_a_constant_number_of_entries_per_message():
    """Under sustained load with more than 4,096 live nonces (the old guard's pruning threshold),
    the old guard rebuilt its whole table on every message (thousands of hashes each); this one
    hashes the new nonce and the few that expire."""
    guard = ReplayGuard(window_s=3600)
    live = 4096 + random.randrange(100, 300)
    for _ in range(live):
        guard.check(_CountingNonce(random.randbytes(16)))
    _CountingNonce.hashes = 0
    checks = 50
    for _ in range(checks):
        guard.check(_CountingNonce(random.randbytes(16)))
    assert _CountingNonce.hashes <= 3 * checks, f"{_CountingNonce.hashes / checks:.0f} entries per message"


# ---- tokens on the bootstrap port ---------------------------------------------------------------
def _handshake(room: int, pool) -> pb.Handshake:
    handshake = pb.Handshake(protocol_version=PROTOCOL_VERSION, room=room, num_tokens=8, page_ids=[0, 1],
                             layout=layout_of(pool))
    handshake.grpc.max_chunk_bytes = 1 << 20
    return handshake


async def _send(port: int, handshake: pb.Handshake) -> grpc.StatusCode:
    """OK when the prefill worker acknowledged the handshake, else the code it refused it with."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.BootstrapStub(channel).Transfer()
        await call.write(pb.DecodeMessage(handshake=handshake))
        try:
            event = await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        assert event.WhichOneof("event") == "accepted", event
        call.cancel()
        return grpc.StatusCode.OK


class _Prefills:
    """Prefill bootstrap servers of one deployment (one secret), each with one waiting room."""

    def __init__(self, count: int, auth: InternalAuth, rng: random.Random, port: int = 0) -> None:
        self.config = BootstrapConfig(port=port, handshake_timeout_s=2, auth=auth)
        self.rng, self.count = rng, count
        self.servers: list[BootstrapServer] = []
        self.registries: list[RoomRegistry] = []
        self.pushes: list[KVPush] = []
        self.pool = random_pool(rng, 8, 4)
        self.sender = build_sender("grpc", self.pool, TransportConfig())

    async def __aenter__(self) -> "_Prefills":
        for _ in range(self.count):
            registry = RoomRegistry(self.config)
            server = BootstrapServer(registry, self.config, 1 << 20)
            await server.start()
            self.registries.append(registry)
            self.servers.append(server)
        return self

    def open_room(self, index: int, room: int | None = None) -> int:
        room = self.rng.randrange(1 << 31) if room is None else room
        self.pushes.append(KVPush(self.registries[index], self.sender, room, f"victim-{room}", 8))
        return room

    async def __aexit__(self, *exc) -> None:
        for push in self.pushes:
            push.close()
        for server in self.servers:
            await server.stop(0)
        self.sender.close()


def test_a_replayed_signed_handshake_is_refused():
    rng = random.Random()
    auth = InternalAuth(secret=random.randbytes(32))

    async def run():
        async with _Prefills(1, auth, rng) as prefills:
            port = prefills.servers[0].port
            handshake = _handshake(prefills.open_room(0), prefills.pool)
            auth.sign(handshake, "handshake", "decode@127.0.0.1", f"127.0.0.1:{port}")
            assert await _send(port, handshake) == grpc.StatusCode.OK
            # The same bytes again (an on-path recorder): refused before the room is looked at.
            assert await _send(port, handshake) == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(run())


def test_a_handshake_captured_before_a_restart_is_refused_after_it():
    """The used nonces live in memory: a restarted prefill (a new server on the same port, the room
    waiting again) took the captured handshake once more before tokens were bound to its start."""
    rng = random.Random()
    auth = InternalAuth(secret=random.randbytes(32))

    async def run():
        async with _Prefills(1, auth, rng) as prefills:
            port = prefills.servers[0].port
            room = prefills.open_room(0)
            handshake = _handshake(room, prefills.pool)
            auth.sign(handshake, "handshake", "decode@127.0.0.1", f"127.0.0.1:{port}")
            assert await _send(port, handshake) == grpc.StatusCode.OK
        async with _Prefills(1, auth, rng, port=port) as restarted:  # the room waits again
            restarted.open_room(0, room)
            replayed = await _send(port, handshake)
            fresh = _handshake(room, restarted.pool)
            auth.sign(fresh, "handshake", "decode@127.0.0.1", f"127.0.0.1:{port}")
            return replayed, await _send(port, fresh), restarted.registries[0].get(room).handshake.done()

    replayed, fresh, taken = asyncio.run(run())
    assert replayed == grpc.StatusCode.UNAUTHENTICATED
    assert fresh == grpc.StatusCode.OK and taken  # the deployment's own decode still gets the room


def test_a_handshake_with_a_stale_timestamp_is_refused(monkeypatch):
    rng = random.Random()
    auth = InternalAuth(secret=random.randbytes(32))

    async def run(handshake_of):
        async with _Prefills(1, auth, rng) as prefills:
            port = prefills.servers[0].port
            return await _send(port, handshake_of(prefills, port))

    def stale(prefills, port):
        handshake = _handshake(prefills.open_room(0), prefills.pool)
        real = time.time()
        with monkeypatch.context() as patch:  # signed correctly, long ago
            patch.setattr(internal_auth.time, "time", lambda: real - auth.max_skew_s * rng.uniform(1.1, 5))
            auth.sign(handshake, "handshake", "decode@127.0.0.1", f"127.0.0.1:{port}")
        return handshake

    def fresh(prefills, port):
        handshake = _handshake(prefills.open_room(0), prefills.pool)
        auth.sign(handshake, "handshake", "decode@127.0.0.1", f"127.0.0.1:{port}")
        return handshake

    assert asyncio.run(run(stale)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(run(fresh)) == grpc.StatusCode.OK


def test_a_handshake_signed_for_prefill_a_is_refused_at_prefill_b():
    rng = random.Random()
    auth = InternalAuth(secret=random.randbytes(32))

    async def run():
        async with _Prefills(2, auth, rng) as prefills:
            port_a, port_b = (server.port for server in prefills.servers)
            room = prefills.open_room(1)  # B holds the room
            handshake = _handshake(room, prefills.pool)
            auth.sign(handshake, "handshake", "decode@127.0.0.1", f"127.0.0.1:{port_a}")
            refused = await _send(port_b, handshake)
            assert not prefills.registries[1].get(room).handshake.done()  # the room never saw it
            return refused

    assert asyncio.run(run()) == grpc.StatusCode.UNAUTHENTICATED


def test_an_unauthenticated_kv_stream_learns_nothing_about_rooms():
    """Before: a missing room answered FAILED_PRECONDITION and an existing one UNAUTHENTICATED."""
    rng = random.Random()
    auth = InternalAuth(secret=random.randbytes(32))

    async def open_stream(port: int, room: int) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.BootstrapStub(channel).KVStream()
            await call.write(pb.KVStreamMessage(open=pb.KVStreamOpen(room=room, index=1)))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            return refused.value.code()

    async def run():
        async with _Prefills(1, auth, rng) as prefills:
            port = prefills.servers[0].port
            room = prefills.open_room(0)
            handshake = _handshake(room, prefills.pool)
            auth.sign(handshake, "handshake", "decode@127.0.0.1", f"127.0.0.1:{port}")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.BootstrapStub(channel).Transfer()  # the room has its handshake now
                await call.write(pb.DecodeMessage(handshake=handshake))
                assert (await call.read()).WhichOneof("event") == "accepted"
                missing = room ^ (1 + rng.randrange(1 << 20))
                codes = [await open_stream(port, room), await open_stream(port, missing)]
                call.cancel()
            return codes

    assert asyncio.run(run()) == [grpc.StatusCode.UNAUTHENTICATED] * 2


def test_an_ack_or_done_answering_another_streams_nonce_is_refused():
    auth = InternalAuth(secret=random.randbytes(32))
    mine, other = random.randbytes(16), random.randbytes(16)
    room = random.randrange(1 << 31)
    ack = pb.HandshakeAck(protocol_version=PROTOCOL_VERSION, credit_window=8, kv_streams=1)
    auth.sign(ack, "ack", "prefill@127.0.0.1:1", "decode@127.0.0.1", f"room={room}", other)
    done = pb.TransferDone(first_token_id=random.randrange(100), num_pages=2)
    auth.sign(done, "done", "prefill@127.0.0.1:1", "decode@127.0.0.1", f"room={room};seq=3", other)
    with pytest.raises(AuthError, match="another handshake"):
        auth.verify(ack, "ack", f"room={room}", mine)
    with pytest.raises(AuthError, match="another handshake"):
        auth.verify(done, "done", f"room={room};seq=3", mine)
    auth.verify(ack, "ack", f"room={room}", other)  # its own stream takes it
    with pytest.raises(AuthError, match="bad authentication token"):  # another room's done
        auth.verify(done, "done", f"room={room + 1};seq=3", other)


# ---- the secret and the flags -------------------------------------------------------------------
def test_a_secret_file_other_users_can_read_is_refused(tmp_path):
    path = create_secret_file(tmp_path / "secret")
    assert len(read_secret_file(path)) >= 32
    for mode in (0o640, 0o604, 0o644, 0o660):
        os.chmod(path, mode)
        with pytest.raises(UserError, match="readable by other users"):
            read_secret_file(path)


def test_a_short_secret_is_refused(tmp_path):
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, random.randbytes(8).hex()[:random.randrange(1, 16)].encode() + b"\n")
    os.close(fd)
    with pytest.raises(UserError, match="at least 16"):
        read_secret_file(path)
    with pytest.raises(UserError, match="at least 16"):
        InternalAuth(secret=random.randbytes(random.randrange(0, 16)))


def test_resolve_auth_refuses_contradicting_flags_and_a_missing_secret(tmp_path, monkeypatch):
    path = str(create_secret_file(tmp_path / "secret"))
    with pytest.raises(UserError, match="contradict"):
        resolve_auth(path, insecure=True)
    monkeypatch.setenv(SECRET_FILE_ENV, path)
    with pytest.raises(UserError, match="contradict"):  # the variable counts as the flag
        resolve_auth(None, insecure=True)
    assert resolve_auth(None, insecure=False).secret == read_secret_file(path)
    monkeypatch.delenv(SECRET_FILE_ENV)
    with pytest.raises(UserError, match="deployment secret"):
        resolve_auth(None, insecure=False)
    assert not resolve_auth(None, insecure=True).enabled
