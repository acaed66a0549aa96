"""The KV MAC of one-sided transfers (kv_transfer/kv_mac.py) against a reference that concatenates
the pages' bytes; the mooncake channel's seal and sink's check over the stub engine; its cost.
Its decode workers run the write direction (`mooncake_kv_direction=write`), the one these sinks
and channels serve; pulled transfers, the default: test_mooncake_pull.py."""
from __future__ import annotations

import asyncio
import hashlib
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport import kv_mac, mooncake_sink, wire
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver, MooncakeSender
from deepseek_pd.workers.engine.request_failure import TransferError
from pdtest import mooncake_stub


def _filled_pool(rng: random.Random, num_pages: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> KVPool:
    pool = KVPool(rng.randrange(1, 4), num_pages, rng.choice([1, 4, 16]), rng.choice([8, 24]), dtype=dtype,
                  device=device)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return pool


def _reference(pool: KVPool, pages: list[int], key: bytes, head: bytes) -> bytes:
    """The documented construction, sequentially, from each page's bytes."""
    layers = [hashlib.blake2b(head + b"\x00" + layer.to_bytes(4, "little") + b"".join(
                  buffer[page].contiguous().view(torch.uint8).numpy().tobytes() for page in pages),
              key=key, digest_size=32, person=b"kv-layer").digest() for layer, buffer in enumerate(pool.buffers)]
    return hashlib.blake2b(head + b"".join(layers), key=key, digest_size=32, person=b"kv-root").digest()


def test_the_tag_covers_exactly_the_pages_bytes_in_request_order():
    algorithm = kv_mac.ALGORITHM
    rng = random.Random()
    src = _filled_pool(rng, 32)
    pages = rng.sample(range(32), rng.randrange(1, 12))
    if len(pages) > 2 and pages[0] + 1 < 32 and pages[0] + 1 not in pages:  # a run of consecutive pages too
        pages[1] = pages[0] + 1
    key = bytes(rng.randrange(256) for _ in range(kv_mac.KEY_BYTES))
    head = kv_mac.header(rng.randrange(1 << 40), pages)
    tag = kv_mac.kv_mac(src, pages, key, head, algorithm)
    assert tag == _reference(src, pages, key, head)
    # The same bytes at other page ids of another pool (the decode side's): the same tag.
    dst = KVPool(src.num_layers, 40, src.page_size, src.kv_dim, dtype=src.dtype)
    dst_pages = rng.sample(range(40), len(pages))
    for s, d in zip(src.buffers, dst.buffers):
        d[dst_pages] = s[pages]
    assert kv_mac.kv_mac(dst, dst_pages, key, head, algorithm) == tag
    # One flipped byte anywhere in the covered cells changes it; a byte outside does not.
    layer = rng.randrange(dst.num_layers)
    raw = dst.buffers[layer].view(dst.num_pages, -1).view(torch.uint8)
    page, offset = rng.choice(dst_pages), rng.randrange(dst.bytes_per_page)
    original = int(raw[page, offset])
    raw[page, offset] = original ^ (1 << rng.randrange(8))
    assert kv_mac.kv_mac(dst, dst_pages, key, head, algorithm) != tag
    raw[page, offset] = original
    outside = next(p for p in range(40) if p not in dst_pages)
    raw[outside, rng.randrange(dst.bytes_per_page)] ^= 0xFF
    assert kv_mac.kv_mac(dst, dst_pages, key, head, algorithm) == tag
    # Another key, room or page list: another tag.
    assert kv_mac.kv_mac(dst, dst_pages, bytes(32), head, algorithm) != tag
    assert kv_mac.kv_mac(dst, dst_pages, key, kv_mac.header(1, pages), algorithm) != tag


def test_the_key_is_bound_to_the_secret_the_room_and_the_handshake():
    auth, other = InternalAuth(secret=b"a" * 32), InternalAuth(secret=b"b" * 32)
    nonce = bytes(range(16))
    key = auth.kv_key(7, nonce)
    assert len(key) == kv_mac.KEY_BYTES
    assert key not in (other.kv_key(7, nonce), auth.kv_key(8, nonce), auth.kv_key(7, bytes(16)))
    assert InternalAuth.insecure().kv_key(7, nonce) is None


def _transfer(monkeypatch, rng: random.Random, offer: bool = True, before_land=None, begin: bool | None = None,
              device: str = "cpu", reports: bool | None = None, check: bool | None = None):
    """A mooncake transfer over the stub engine, its bytes copied into the staging slots as the engine
    would write them, then landed (`before_land(receiver, sink)` runs first): (the decode sink, the
    sealed TransferDone, the key, the room, the decode pool, its pages, the receiver).

    `reports` (default: random): the decode side asks for each send's report (a decode worker does),
    and lands them in a random order, some side by side, after the writes; else the sink copies
    everything at `land`. `begin`/`check` (default: mostly): the prefill side MACs each send as it goes
    (`begin_seal`), the decode side each landing (`begin_check`)."""
    engines = mooncake_stub.install(monkeypatch)
    src = _filled_pool(rng, 24, device=device)
    dst = KVPool(src.num_layers, 24, src.page_size, src.kv_dim, dtype=src.dtype, device=device)
    config = TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write")
    sender, receiver = MooncakeSender(src, config), MooncakeReceiver(dst, config)
    count = rng.randrange(1, 8)
    src_pages, dst_pages = rng.sample(range(24), count), rng.sample(range(24), count)
    handshake = pb.Handshake(page_ids=dst_pages, layout=layout_of(dst), num_tokens=count * src.page_size)
    receiver.fill_destination(handshake)
    assert list(handshake.mooncake.kv_mac_algorithms) == list(kv_mac.algorithms())
    assert handshake.mooncake.report_sends
    if not offer:
        handshake.mooncake.ClearField("kv_mac_algorithms")
    if not (reports if reports is not None else rng.random() < 0.7):
        handshake.mooncake.report_sends = False  # an older decode worker
    sink = receiver.open_sink(dst_pages)
    asyncio.run(sink.reserve())
    sink.expose()
    sink.offer_into(handshake)
    slots = list(handshake.page_ids)
    assert len(slots) == count and set(slots).isdisjoint(range(receiver.staging.num_pages, 1 << 20))
    reported: list = []

    async def emit(encoded):  # the stream: decode lands the reports below, after every write
        reported.append(wire.decode_event(encoded.payload).chunk)
    channel = sender.open(handshake, emit=emit)
    room, key = rng.randrange(1 << 40), bytes(rng.randrange(256) for _ in range(32))
    if begin if begin is not None else rng.random() < 0.8:  # as KVPush does: each send MACed as it goes
        channel.begin_seal(key, room)
    if check if check is not None else rng.random() < 0.8:  # as the bootstrap client does, once accepted
        sink.begin_check(key, room)
    for layers, first, end in _random_sends(rng, src.num_layers, count):
        asyncio.run(channel.send(src_pages[first:end], first, layers.start, layers.stop))
    assert engines[0].writes  # the engine was asked; the stub wrote nothing, so copy as it would
    for s, d in zip(src.buffers, receiver.staging.buffers):
        d[slots] = s[src_pages]
    if before_land is not None:
        before_land(receiver, sink)
    assert bool(reported) == handshake.mooncake.report_sends
    rng.shuffle(reported)
    with ThreadPoolExecutor(3) as landings:  # as the bootstrap client's ingest does, side by side
        list(landings.map(sink.on_chunk, reported))
    done = pb.TransferDone(num_pages=count, bytes_sent=channel.bytes_sent)
    sink.check_complete(done)
    sink.land()
    channel.seal(done, key, room)
    assert bool(done.kv_mac) == offer and done.kv_mac_algorithm == (kv_mac.ALGORITHM if offer else "")
    return sink, done, key, room, dst, dst_pages, receiver


def _random_sends(rng: random.Random, num_layers: int, num_pages: int) -> list[tuple[range, int, int]]:
    """(layers, first page, end page) of each send of a transfer cut as KVPush may cut it: chunks of
    pages in order, each all layers at once or in layer ranges (layer-wise streaming)."""
    sends = []
    begin = 0
    while begin < num_pages:
        end = rng.randrange(begin + 1, num_pages + 1)
        layer = 0
        while layer < num_layers:
            stop = num_layers if rng.random() < 0.4 else rng.randrange(layer + 1, num_layers + 1)
            sends.append((range(layer, stop), begin, end))
            layer = stop
        begin = end
    return sends


def _random_tag_inputs(rng: random.Random) -> tuple[KVPool, list[int], bytes, bytes]:
    """A filled 40-page pool, some of its pages in a random order, a key and their header."""
    pool = _filled_pool(rng, 40)
    pages = rng.sample(range(40), rng.randrange(1, 16))
    return pool, pages, bytes(rng.randrange(256) for _ in range(kv_mac.KEY_BYTES)), kv_mac.header(
        rng.randrange(1 << 40), pages)


def test_the_tag_built_send_by_send_is_the_one_shot_tag():
    """Any cut of the transfer into sends (pages x layer ranges), in order or not, partly hashed or
    not: `digest` gives the documented tag, and reads again only what no send hashed in order."""
    rng = random.Random()
    for _ in range(12):
        pool, pages, key, head = _random_tag_inputs(rng)
        sends = _random_sends(rng, pool.num_layers, len(pages))
        in_order = rng.random() < 0.5
        if not in_order:  # some sends swapped, some never hashed (left to digest)
            for _ in range(rng.randrange(1, 3)):
                i, j = rng.randrange(len(sends)), rng.randrange(len(sends))
                sends[i], sends[j] = sends[j], sends[i]
            sends = [send for send in sends if rng.random() < 0.8]
        macs = kv_mac.LayerMacs(pool.num_layers, key, head)
        for layers, begin, end in sends:
            macs.update(pool, layers, begin, pages[begin:end]).wait()
        before = macs.pages_read
        assert macs.digest(pool, pages) == _reference(pool, pages, key, head)
        cells = pool.num_layers * len(pages)
        assert macs.pages_read >= cells  # every cell hashed (some twice: an out-of-order send's)
        if in_order:
            assert macs.pages_read == before == cells  # nothing left for the first token's path


def test_sealing_after_the_sends_reads_no_page(monkeypatch):
    """The trace of where the MAC's reads happen: with `begin_seal` (KVPush calls it at the
    handshake) every page is hashed beside its send, and `seal`, on the first token's path, reads
    none; with `begin_check` (the bootstrap client calls it once the handshake is accepted) decode
    hashes every page as its send lands, and `check_sealed`, on the first token's path, reads none
    (`check_reads` says so, so decode runs it on the event loop)."""
    rng = random.Random()
    reads: list[tuple[str, KVPool, int]] = []
    feed = kv_mac._feed

    def traced(mac, pool, layer, pages, runs, ready, synced=False):
        reads.append((phase[0], pool, len(pages)))
        feed(mac, pool, layer, pages, runs, ready, synced)
    monkeypatch.setattr(kv_mac, "_feed", traced)
    phase = ["send"]

    def mark_land(receiver, sink):
        phase[0] = "land"
    sink, done, key, room, dst, *_ = _transfer(monkeypatch, rng, before_land=mark_land, begin=True,
                                               check=True, reports=True)
    cells = dst.num_layers * len(sink.pages)
    # (`_transfer` seals right after the landings)
    assert sum(n for where, pool, n in reads if where == "send" and pool is not dst) == cells
    assert sum(n for where, pool, n in reads if pool is not dst and where != "send") == 0  # the seal read nothing
    assert sum(n for where, pool, n in reads if pool is dst) == cells  # each landed cell, once
    assert not sink.check_reads()
    phase[0] = "check"
    sink.check_sealed(done, key, room)
    assert sink.failed is None
    assert [n for where, _, n in reads if where == "check"] == []  # the check read nothing


def test_a_transfer_without_reports_is_checked_whole_after_its_done(monkeypatch):
    """An older peer on either side (no `report_sends` asked, or none sent): nothing lands before the
    TransferDone; `land` copies every page and the check reads every cell, in a worker thread."""
    rng = random.Random()
    reads: list[KVPool] = []
    feed = kv_mac._feed

    def traced(mac, pool, layer, pages, runs, ready, synced=False):
        reads.extend([pool] * len(pages))
        feed(mac, pool, layer, pages, runs, ready, synced)
    monkeypatch.setattr(kv_mac, "_feed", traced)
    sink, done, key, room, dst, *_ = _transfer(monkeypatch, rng, reports=False, check=rng.random() < 0.5)
    assert dst not in reads and sink.check_reads()
    sink.check_sealed(done, key, room)
    assert sink.failed is None and reads.count(dst) == dst.num_layers * len(sink.pages)


def test_decode_admits_the_bytes_the_prefill_side_sealed(monkeypatch):
    sink, done, key, room, *_ = _transfer(monkeypatch, random.Random())
    sink.check_sealed(done, key, room)
    assert sink.failed is None


def test_a_strangers_write_into_the_staging_before_the_copy_fails_only_that_transfer(monkeypatch):
    rng = random.Random()
    for layer in range(3):  # each layer of the pool (_filled_pool's have 1 to 3), sent in random cuts

        def strike(receiver, sink):  # finite, plausible KV, while the slots are still registered
            if layer < receiver.pool.num_layers:
                receiver.staging.buffers[layer][rng.choice(sink.slots)] += 1.0
        sink, done, key, room, dst, *_ = _transfer(monkeypatch, rng, before_land=strike)
        if layer >= dst.num_layers:
            continue
        with pytest.raises(TransferError, match="does not match the MAC the prefill worker signed"):
            sink.check_sealed(done, key, room)
        assert sink.failed is not None  # the engine scrubs and frees its pages like any failed transfer's


def test_a_write_into_the_staging_after_the_copy_reaches_no_page_the_model_reads(monkeypatch):
    """The slow-body write (a Mooncake header accepted while the slots were registered, its body
    landing later): it lands in the staging, the request's private pages keep what was sealed."""
    rng = random.Random()
    seen: dict[str, list[int]] = {}
    sink, done, key, room, dst, dst_pages, receiver = _transfer(
        monkeypatch, rng, before_land=lambda receiver, sink: seen.setdefault("slots", list(sink.slots)))
    landed = [buffer[dst_pages].clone() for buffer in dst.buffers]
    for staged in receiver.staging.buffers:  # the late body, after the copy
        staged[seen["slots"]] = float("nan")
    sink.check_sealed(done, key, room)
    assert sink.failed is None
    assert all(torch.equal(buffer[dst_pages], before) for buffer, before in zip(dst.buffers, landed))
    assert not receiver.engine.engine.registered  # over TCP the slots were registered only while it ran
    assert receiver.staging.num_used == 0  # and went back at once after the copy


def test_a_done_without_a_mac_from_an_older_prefill_is_admitted_with_a_warning(monkeypatch, caplog):
    """The done is signed, so only a prefill worker that predates the MAC sends none: refusing it
    would fail every mooncake request of a rolling upgrade that reaches decode first."""
    monkeypatch.setattr(mooncake_sink, "_warned_unsealed", False)  # said once per process
    sink, done, key, room, *_ = _transfer(monkeypatch, random.Random())
    done.ClearField("kv_mac")
    sink.check_sealed(done, None, room)  # --insecure-internal: nothing to check
    sink.check_sealed(done, key, room)
    assert sink.failed is None and "without a MAC" in caplog.text
    # An older decode worker offers no algorithm: the prefill side seals nothing for it.
    sender_side = _transfer(monkeypatch, random.Random(), offer=False)
    assert not sender_side[1].kv_mac


def test_mac_cost_per_megabyte():
    """Not a bound (2 shared CI cores): prints the CPU cost per MB of KV, as read in place from a
    CPU pool, and the wall time over the MAC's threads (docs/operations.md §8 quotes it)."""
    rng = random.Random()
    pool = KVPool(4, 256, 16, 576, dtype=torch.bfloat16)  # V2-Lite's kv_dim: 18 KiB a page a layer
    pages = list(range(256))
    mb = len(pages) * pool.num_layers * pool.bytes_per_page / 1e6
    for algorithm in kv_mac.algorithms():
        key = bytes(rng.randrange(256) for _ in range(32))
        started, wall = time.process_time(), time.perf_counter()
        for _ in range(3):
            kv_mac.kv_mac(pool, pages, key, b"", algorithm)
        per_mb = (time.process_time() - started) / 3 / mb
        wall_per_mb = (time.perf_counter() - wall) / 3 / mb
        print(f"{algorithm}: {per_mb * 1e3:.3f} ms CPU per MB ({1 / per_mb / 1e3:.2f} GB/s a core), "
              f"{wall_per_mb * 1e3:.3f} ms wall per MB, {mb:.1f} MB")

