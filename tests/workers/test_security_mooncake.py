"""Forged Mooncake handshakes (the issue's "3 of 3 legitimate outputs changed"): a handshake that
names a Mooncake destination makes the prefill worker write one-sided into whatever it lists, so
an unsigned or forged one must be refused before any write, and a signed one may name only pages
inside the decode pool. The TransferEngine is a stub (pdtest/mooncake_stub.py): no network, and
it records every write the prefill worker would have made."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.transport.bootstrap_protocol import PROTOCOL_VERSION, PULL_PROTOCOL_VERSION, handshake_version
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport import TransportConfig, build_receiver, build_sender, kv_cipher, kv_mac
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush
from pdtest import mooncake_stub
from pdtest.kv_transfer_harness import random_pool

pytestmark = pytest.mark.timeout(60)

PAGE_SIZE = 4


async def _answer(port: int, handshake: pb.Handshake) -> list:
    """The prefill worker's events for `handshake` up to its first non-ack, its refusal code, or
    a note that it kept silent (it took the handshake and is waiting to write)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.BootstrapStub(channel).Transfer()
        await call.write(pb.DecodeMessage(handshake=handshake))
        events = []
        try:
            while not events or events[-1].WhichOneof("event") == "accepted":
                events.append(await asyncio.wait_for(call.read(), 5))
        except grpc.aio.AioRpcError as exc:
            events.append(exc.code())
        except asyncio.TimeoutError:
            events.append("no answer within 5s")
        call.cancel()
        return events


async def _started_bootstrap(config: BootstrapConfig) -> tuple[RoomRegistry, BootstrapServer]:
    """A prefill worker's bootstrap side, listening (stop it with `server.stop(0)`)."""
    registry = RoomRegistry(config)
    server = BootstrapServer(registry, config, 1 << 20)
    await server.start()
    return registry, server


def _pools(rng: random.Random):
    """(prompt tokens, its pages, the prefill pool, the decode pool: the victim's)."""
    num_tokens = rng.randrange(9, 30)
    num_pages = -(-num_tokens // PAGE_SIZE)
    src = random_pool(rng, num_pages + rng.randrange(8), PAGE_SIZE)
    dst = random_pool(rng, num_pages + rng.randrange(1, 8), PAGE_SIZE)
    return num_tokens, num_pages, src, dst


def _stubbed_pair_setting(monkeypatch):
    """The stub engine installed, and (its engines, rng, prompt tokens, pages, prefill pool, decode
    pool, bootstrap config, transport config) for a prefill worker and its victim decode worker."""
    engines = mooncake_stub.install(monkeypatch)
    rng = random.Random()
    num_tokens, num_pages, src, dst = _pools(rng)
    config = BootstrapConfig(port=0, handshake_timeout_s=5, claim_timeout_s=5)
    return engines, rng, num_tokens, num_pages, src, dst, config, TransportConfig(advertise_host="127.0.0.1")


def test_forged_mooncake_handshakes_write_nothing_and_signed_ones_stay_in_the_pool(monkeypatch):
    engines, rng, num_tokens, num_pages, src, dst, config, transport = _stubbed_pair_setting(monkeypatch)

    async def run():
        registry, server = await _started_bootstrap(config)
        sender = build_sender("mooncake", src, transport)
        # The victim decode worker, in the write direction (a pulled transfer writes nothing into decode)
        receiver = build_receiver("mooncake", dst, dataclasses.replace(transport, mooncake_kv_direction="write"))
        prefill_engine = engines[0]
        rooms = [rng.randrange(1 << 31) for _ in range(3)]
        pushes = [KVPush(registry, sender, room, f"victim{room}", num_tokens) for room in rooms]
        waits = [asyncio.ensure_future(push.handshake(5)) for push in pushes]
        target = f"127.0.0.1:{server.port}"

        def handshake(room: int, pages: list[int]) -> pb.Handshake:
            message = pb.Handshake(protocol_version=PROTOCOL_VERSION, room=room, num_tokens=num_tokens,
                                   page_ids=pages, layout=layout_of(dst))
            receiver.fill_destination(message)  # what the victim's handshake reveals
            return message

        try:
            inside = rng.sample(range(dst.num_pages), num_pages)
            # 1. Unsigned, then signed with another secret: refused, the room never sees it.
            unsigned = handshake(rooms[0], inside)
            forged = handshake(rooms[0], inside)
            InternalAuth(secret=random.randbytes(32)).sign(forged, "handshake", "decode@evil", target)
            for message in (unsigned, forged):
                assert await _answer(server.port, message) == [grpc.StatusCode.UNAUTHENTICATED]
            assert not waits[0].done() and prefill_engine.writes == []
            # 2. Signed (a deployment member), but a page at or past the decode pool's end: refused.
            outside = inside[:-1] + [dst.num_pages + rng.randrange(0, 1 << 16)]
            rng.shuffle(outside)
            signed = handshake(rooms[1], outside)
            config.auth.sign(signed, "handshake", "decode@127.0.0.1", target)
            events = await _answer(server.port, signed)
            assert [e.WhichOneof("event") for e in events] == ["accepted", "failed"], events
            assert "outside" in events[-1].failed.reason, events[-1]
            with pytest.raises(TransferError, match="outside"):
                await waits[1]
            assert prefill_engine.writes == []
            # 3. The control: a signed handshake inside the pool is written, and only there.
            good = handshake(rooms[2], inside)
            config.auth.sign(good, "handshake", "decode@127.0.0.1", target)
            answer = asyncio.ensure_future(_answer(server.port, good))
            await waits[2]
            pushes[2].pages_ready(num_tokens, src.alloc(num_pages))
            while not prefill_engine.writes:
                await asyncio.sleep(0.01)
            answer.cancel()
            page_bytes = dst.bytes_per_page
            for session, _, remote, lengths in prefill_engine.writes:
                assert session == good.mooncake.session_id
                for addr, length in zip(remote, lengths):
                    base = next(b for b in good.mooncake.layer_base_addrs if b <= addr < b + dst.num_pages * page_bytes)
                    assert (addr - base) % page_bytes == 0 and addr + length <= base + dst.num_pages * page_bytes
                    assert {(addr - base) // page_bytes + i for i in range(length // page_bytes)} <= set(inside)
        finally:
            for push in pushes:
                push.close()
            for wait in waits:
                wait.cancel()
            await server.stop(0)
            sender.close()
            receiver.close()

    asyncio.run(run())


def test_a_mooncake_engine_warns_that_it_listens_on_every_interface(monkeypatch, caplog):
    mooncake_stub.install(monkeypatch)
    host = f"127.0.0.{random.randrange(2, 250)}"
    with caplog.at_level("WARNING"):
        receiver = build_receiver("mooncake", random_pool(random.Random(), 2, PAGE_SIZE),
                                  TransportConfig(advertise_host=host))
        receiver.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("ALL interfaces (0.0.0.0)" in w and host in w for w in warnings), warnings


def test_of_a_groups_ranks_only_each_nodes_first_one_warns(monkeypatch, caplog):
    """The ranks of a group on one node share its interfaces: its local rank 0 warns once for
    them (as a one-rank worker does), the others stay quiet."""
    mooncake_stub.install(monkeypatch)
    host = f"127.0.0.{random.randrange(2, 250)}"
    ranks = random.randint(2, 8)
    config = TransportConfig(advertise_host=host)
    warned = []
    for local_rank in random.sample(range(ranks), ranks):
        caplog.clear()
        with caplog.at_level("WARNING"):
            build_receiver("mooncake", random_pool(random.Random(), 2, PAGE_SIZE),
                           config.for_local_rank(local_rank)).close()
        if any("ALL interfaces (0.0.0.0)" in r.getMessage() for r in caplog.records):
            warned.append(local_rank)
    assert warned == [0], (ranks, warned)


def test_the_prefill_side_encrypts_and_macs_with_what_decode_offered_or_refuses_the_handshake(monkeypatch):
    """kv_cipher.py's and kv_mac.py's negotiations through the real bootstrap servicer: decode's
    offers picked (the first MAC it computes) and named in the signed ack, the channel's MAC the
    ack's, the cipher's one-time key bound to the room and the handshake on the channel; an offer
    of ciphers or MACs this worker lacks refused before any write, naming them; an older decode
    worker's handshake (no cipher, BLAKE2b alone) served in the clear with BLAKE2b, an even older
    one's (no MAC either) with no MAC."""
    engines, rng, num_tokens, num_pages, src, dst, config, transport = _stubbed_pair_setting(monkeypatch)

    async def run():
        registry, server = await _started_bootstrap(config)
        sender, receiver = build_sender("mooncake", src, transport), build_receiver("mooncake", dst, transport)
        ciphers, macs = list(kv_cipher.algorithms()), list(kv_mac.algorithms())
        offers = [(ciphers, macs), (["aes-someday"], macs), (ciphers, ["md5-layers"]), ([], [kv_mac.BLAKE2B]),
                  ([], [])]
        rooms = [rng.randrange(1 << 31) for _ in offers]
        pushes = [KVPush(registry, sender, room, f"r{room}", num_tokens) for room in rooms]
        waits = [asyncio.ensure_future(push.handshake(5)) for push in pushes]
        try:
            for (offer, mac_offer), room, push, wait in zip(offers, rooms, pushes, waits):
                message = pb.Handshake(protocol_version=PROTOCOL_VERSION, room=room, num_tokens=num_tokens,
                                       page_ids=rng.sample(range(dst.num_pages), num_pages), layout=layout_of(dst))
                receiver.fill_destination(message)
                message.protocol_version = handshake_version(message)  # (pulled: 3)
                message.mooncake.ClearField("kv_cipher_algorithms")
                message.mooncake.kv_cipher_algorithms.extend(offer)
                message.mooncake.ClearField("kv_mac_algorithms")
                message.mooncake.kv_mac_algorithms.extend(mac_offer)
                config.auth.sign(message, "handshake", "decode@127.0.0.1", f"127.0.0.1:{server.port}")
                unknown = [name for name in ("aes-someday", "md5-layers") if name in offer + mac_offer]
                if unknown:
                    assert await _answer(server.port, message) == [grpc.StatusCode.FAILED_PRECONDITION]
                    with pytest.raises(TransferError, match=unknown[0]):
                        await wait
                    continue
                async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                    call = pb_grpc.BootstrapStub(channel).Transfer()
                    await call.write(pb.DecodeMessage(handshake=message))
                    ack = (await asyncio.wait_for(call.read(), 5)).accepted
                    await wait
                    call.cancel()
                config.auth.verify(ack, "ack", f"room={room}", challenge=message.auth.nonce)  # (signed with it)
                assert ack.kv_cipher == (kv_cipher.ALGORITHM if offer else "")
                assert ack.kv_mac == (mac_offer[0] if mac_offer else "")  # (this worker computes both)
                assert (push.channel._mac_algorithm or "") == ack.kv_mac
                cipher = push.channel._cipher
                if not offer:
                    assert cipher is None
                    continue
                assert cipher.algorithm == kv_cipher.ALGORITHM
                assert cipher.key == config.auth.kv_cipher_key(room, message.auth.nonce)
                assert cipher.key != config.auth.kv_key(room, message.auth.nonce)
            assert engines[0].writes == []
        finally:
            for push in pushes:
                push.close()
            for wait in waits:
                wait.cancel()
            await server.stop(0)
            sender.close()
            receiver.close()

    asyncio.run(run())


def _overlaps(registered: dict[int, int], buffers) -> bool:
    """Whether any registered region [addr, addr + length) touches one of `buffers`' bytes."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
    return any(addr < end and start < addr + length for addr, length in registered.items() for start, end in spans)


def test_no_mooncake_engine_registers_the_kv_pool(monkeypatch):
    """Mooncake authenticates no peer: a registered pool is every request's KV open to whoever
    reaches the port. A bare engine (as any new caller would build it), a sender and a receiver over
    either protocol register none of the pool's bytes; over RDMA the stagings are registered, and
    nothing is once closed. Before: `MooncakeEngine(pool, config)` registered the whole pool for the
    engine's lifetime unless its caller remembered `register_pool=False`."""
    from deepseek_pd.workers.transport.mooncake_engine import MooncakeEngine

    engines = mooncake_stub.install(monkeypatch)
    rng = random.Random()
    pool = random_pool(rng, rng.randrange(2, 12), PAGE_SIZE)
    transport = TransportConfig(advertise_host=f"127.0.0.{rng.randrange(2, 250)}",
                                mooncake_staging_tokens=PAGE_SIZE * rng.randrange(1, 4))
    bare = MooncakeEngine(pool, transport)
    assert engines[-1].registered == {}
    bare.close()
    for protocol in rng.sample(["tcp", "rdma"], 2):
        config = dataclasses.replace(transport, mooncake_protocol=protocol)
        for build in rng.sample([build_sender, build_receiver], 2):
            side = build("mooncake", pool, config)
            registered = dict(engines[-1].registered)
            assert not _overlaps(registered, pool.buffers), (protocol, build.__name__)
            assert _overlaps(registered, side.staging.buffers) == (protocol == "rdma"), (protocol, build.__name__)
            side.close()
            assert engines[-1].registered == {}


def test_a_pulled_handshake_is_answered_with_the_send_staging_in_the_signed_ack_and_only_as_version_3(monkeypatch):
    """The prefill side serves a pulled transfer only under bootstrap protocol 3 (an older worker
    refuses that version, so never writes where decode offered nothing), answering with its send
    staging (engine, layer addresses, slots) inside the signed ack; a pull flag under version 2, or
    version 3 without it, is refused before any room sees it."""
    _, rng, num_tokens, num_pages, src, dst, config, transport = _stubbed_pair_setting(monkeypatch)

    async def run():
        registry, server = await _started_bootstrap(config)
        sender, receiver = build_sender("mooncake", src, transport), build_receiver("mooncake", dst, transport)
        server.servicer.answer = sender.answer_handshake
        target = f"127.0.0.1:{server.port}"
        try:
            def handshake(version: int, pull: bool) -> pb.Handshake:
                message = pb.Handshake(protocol_version=version, room=rng.randrange(1 << 31), num_tokens=num_tokens,
                                       page_ids=range(num_pages), layout=layout_of(dst))
                receiver.fill_destination(message)
                message.mooncake.pull = pull
                config.auth.sign(message, "handshake", "decode@127.0.0.1", target)
                return message
            for version, pull in ((PROTOCOL_VERSION, True), (PULL_PROTOCOL_VERSION, False)):
                assert await _answer(server.port, handshake(version, pull)) == [grpc.StatusCode.FAILED_PRECONDITION]
            assert registry.num_active == 0
            good = handshake(PULL_PROTOCOL_VERSION, True)
            async with grpc.aio.insecure_channel(target) as channel:
                call = pb_grpc.BootstrapStub(channel).Transfer()
                await call.write(pb.DecodeMessage(handshake=good))
                ack = (await asyncio.wait_for(call.read(), 5)).accepted
                call.cancel()
            config.auth.verify(ack, "ack", f"room={good.room}", challenge=good.auth.nonce)
            source = ack.mooncake_source
            assert ack.protocol_version == PULL_PROTOCOL_VERSION
            assert source.session_id == sender.engine.session_id and list(source.layer_base_addrs) == \
                sender.staging.base_addrs and source.pool_pages == sender.staging.num_pages
            assert not good.mooncake.layer_base_addrs  # decode named nothing of its own to write
        finally:
            await server.stop(0)
            sender.close()
            receiver.close()

    asyncio.run(run())
