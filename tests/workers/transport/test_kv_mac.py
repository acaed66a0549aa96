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
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from pdtest import mooncake_stub
from pdtest.kv_mac_reference import gmac, kv_tag


def _filled_pool(rng: random.Random, num_pages: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> KVPool:
    pool = KVPool(rng.randrange(1, 4), num_pages, rng.choice([1, 4, 16]), rng.choice([8, 24]), dtype=dtype,
                  device=device)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return pool


def _reference(pool: KVPool, pages: list[int], key: bytes, head: bytes, algorithm: str | None = None) -> bytes:
    """The documented construction (None: the preferred algorithm), sequentially, from each page's bytes."""
    return kv_tag(pool.buffers, pages, key, head, algorithm or kv_mac.algorithms()[0])


def test_the_pure_python_gmac_reference_gives_the_gcm_spec_tag():
    """The reference the "gmac-pages" tests trust: GCM's test case 1 (McGrew and Viega, AES-128,
    zero key and nonce, nothing to authenticate), and AES-256 with associated data of odd lengths
    against `cryptography`'s AES-GCM (another implementation: OpenSSL's)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    assert gmac(bytes(16), bytes(12), b"") == bytes.fromhex("58e2fccefa7e3061367f1d57a4e7455a")
    rng = random.Random()
    for length in (1, 16, 17, rng.randrange(2, 300)):
        key, nonce = rng.randbytes(32), rng.randbytes(12)
        associated = rng.randbytes(length)
        assert gmac(key, nonce, associated) == AESGCM(key).encrypt(nonce, b"", associated)


def test_gmac_is_offered_first_where_cryptography_releases_the_gil():
    """This environment installs a `cryptography` that has it (pyproject's floor is older): decode
    offers it first; a release before the measured floor is offered BLAKE2b alone."""
    import cryptography
    release = tuple(int(part) for part in cryptography.__version__.split(".")[:2])
    assert kv_mac.algorithms() == ((kv_mac.GMAC, kv_mac.BLAKE2B) if release >= kv_mac.GIL_FREE_CRYPTOGRAPHY
                                   else (kv_mac.BLAKE2B,))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cryptography, "__version__", "50.9.0")
        assert not kv_mac._gmac_usable()
    # A build on BoringSSL or AWS-LC (their AEAD path keeps the GIL in the releases measured) either.
    from cryptography.hazmat.bindings._rust import openssl as built_on
    for flag in ("CRYPTOGRAPHY_IS_BORINGSSL", "CRYPTOGRAPHY_IS_AWSLC"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(built_on, flag, True, raising=False)
            assert not kv_mac._gmac_usable()


@pytest.mark.parametrize("algorithm", kv_mac.algorithms())
def test_the_tag_covers_exactly_the_pages_bytes_in_request_order(algorithm):
    rng = random.Random()
    src = _filled_pool(rng, 32)
    pages = rng.sample(range(32), rng.randrange(1, 12))
    if len(pages) > 2 and pages[0] + 1 < 32 and pages[0] + 1 not in pages:  # a run of consecutive pages too
        pages[1] = pages[0] + 1
    key = bytes(rng.randrange(256) for _ in range(kv_mac.KEY_BYTES))
    head = kv_mac.header(rng.randrange(1 << 40), pages)
    tag = kv_mac.kv_mac(src, pages, key, head, algorithm)
    assert tag == _reference(src, pages, key, head, algorithm)
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
    # Two layers swapped, or two pages: another tag (each layer's key and the root bind the order).
    if dst.num_layers > 1 and not torch.equal(dst.buffers[0][dst_pages], dst.buffers[1][dst_pages]):
        swapped = KVPool(dst.num_layers, 40, dst.page_size, dst.kv_dim, dtype=dst.dtype)
        for layer, buffer in enumerate(swapped.buffers):
            buffer.copy_(dst.buffers[{0: 1, 1: 0}.get(layer, layer)])
        assert kv_mac.kv_mac(swapped, dst_pages, key, head, algorithm) != tag
    if len(dst_pages) > 1:
        assert kv_mac.kv_mac(dst, [dst_pages[1], dst_pages[0]] + dst_pages[2:], key, head, algorithm) != tag
    # The other algorithm's tag of the same bytes is another tag.
    for other in kv_mac.algorithms():
        if other != algorithm:
            assert kv_mac.kv_mac(dst, dst_pages, key, head, other) != tag


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
        sink.begin_check(key, room, kv_mac.agreed(handshake.mooncake.kv_mac_algorithms,
                                                  kv_mac.choose(handshake.mooncake.kv_mac_algorithms)))
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
    assert bool(done.kv_mac) == offer and done.kv_mac_algorithm == (kv_mac.algorithms()[0] if offer else "")
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



def test_the_prefill_side_picks_the_first_offered_mac_it_computes_and_decode_reads_the_ack():
    assert kv_mac.choose([]) == "" and kv_mac.agreed([], "") == ""  # no MAC offered (an older decode)
    assert kv_mac.choose(list(kv_mac.algorithms())) == kv_mac.algorithms()[0]
    assert kv_mac.choose(["md5-layers", kv_mac.BLAKE2B]) == kv_mac.BLAKE2B  # an older decode's offer
    with pytest.raises(ValueError, match="run one version on both"):
        kv_mac.choose(["md5-layers"])
    offered = list(kv_mac.algorithms())
    assert kv_mac.agreed(offered, offered[-1]) == offered[-1]
    assert kv_mac.agreed(offered, "") == kv_mac.OLDER_PEERS  # an older prefill's ack names none
    with pytest.raises(ValueError, match="decode offered"):
        kv_mac.agreed([kv_mac.GMAC], "")  # (an older prefill computes only BLAKE2b)
    with pytest.raises(ValueError, match="decode offered"):
        kv_mac.agreed(offered, "md5-layers")


def _offer_only(monkeypatch, algorithms: tuple[str, ...]) -> None:
    """This process computes (and its decode side offers) `algorithms` alone: an older worker's."""
    monkeypatch.setattr(kv_mac, "_ALGORITHMS", algorithms)


@pytest.mark.parametrize("older", ["prefill", "decode"])
def test_an_older_peer_on_either_side_agrees_on_blake2b_and_the_check_passes(monkeypatch, older):
    """A rolling upgrade: a decode worker that offers BLAKE2b alone gets a BLAKE2b seal from a new
    prefill worker; a new decode worker's offer (GMAC first) gets BLAKE2b from an older prefill
    worker, whose ack names no MAC, and builds its landed tag with it (no second read)."""
    if kv_mac.GMAC not in kv_mac.algorithms():
        pytest.skip("this cryptography release is not offered GMAC")
    rng = random.Random()
    engines = mooncake_stub.install(monkeypatch)
    src = _filled_pool(rng, 16)
    dst = KVPool(src.num_layers, 16, src.page_size, src.kv_dim, dtype=src.dtype)
    config = TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write")
    count = rng.randrange(1, 6)
    src_pages, dst_pages = rng.sample(range(16), count), rng.sample(range(16), count)
    handshake = pb.Handshake(page_ids=dst_pages, layout=layout_of(dst), num_tokens=count * src.page_size)
    new = (kv_mac.GMAC, kv_mac.BLAKE2B)
    decode_has = (kv_mac.BLAKE2B,) if older == "decode" else new
    prefill_has = (kv_mac.BLAKE2B,) if older == "prefill" else new
    _offer_only(monkeypatch, decode_has)
    receiver = MooncakeReceiver(dst, config)
    receiver.fill_destination(handshake)
    handshake.mooncake.report_sends = False  # (landed whole at the done: no stream here)
    sink = receiver.open_sink(dst_pages)
    asyncio.run(sink.reserve())
    sink.expose()
    sink.offer_into(handshake)
    _offer_only(monkeypatch, prefill_has)  # the prefill side: its ack, its channel, its seal
    ack_names = "" if older == "prefill" else kv_mac.choose(handshake.mooncake.kv_mac_algorithms)
    channel = MooncakeSender(src, config).open(handshake, emit=None)
    room, key = rng.randrange(1 << 40), bytes(rng.randrange(256) for _ in range(32))
    channel.begin_seal(key, room)
    _offer_only(monkeypatch, decode_has)
    sink.begin_check(key, room, kv_mac.agreed(handshake.mooncake.kv_mac_algorithms, ack_names))
    asyncio.run(channel.send(src_pages, 0))
    assert any(engine.writes for engine in engines)  # (the stub wrote nothing: copied as it would, below)
    for s, d in zip(src.buffers, receiver.staging.buffers):
        d[list(handshake.page_ids)] = s[src_pages]
    done = pb.TransferDone(num_pages=count, bytes_sent=channel.bytes_sent)
    sink.check_complete(done)
    sink.land()
    _offer_only(monkeypatch, prefill_has)
    channel.seal(done, key, room)
    assert done.kv_mac_algorithm == kv_mac.BLAKE2B
    _offer_only(monkeypatch, decode_has)
    sink.check_sealed(done, key, room)
    assert sink.failed is None


def test_a_done_that_names_another_mac_than_the_ack_is_refused(monkeypatch):
    """Both are signed, so only a broken or hostile deployment member sends it: refused with a clear
    error naming both, not checked under whichever the done names."""
    if len(kv_mac.algorithms()) < 2:
        pytest.skip("this process computes one MAC")
    sink, done, key, room, *_ = _transfer(monkeypatch, random.Random(), check=True)
    sink.begin_check(key, room, kv_mac.algorithms()[0])
    done.kv_mac_algorithm = kv_mac.algorithms()[1]
    with pytest.raises(TransferError, match="its ack agreed") as refused:
        sink.check_sealed(done, key, room)
    assert refused.value.code == FailureCode.INVALID_ARGUMENT and sink.failed is not None


@pytest.mark.parametrize("named", ["md5-layers", "older"])
def test_an_ack_that_names_a_mac_decode_did_not_offer_fails_the_transfer_before_any_check(monkeypatch, named):
    """The bootstrap client's reading of the signed ack: a MAC decode did not offer (or none, from an
    older prefill worker, which computes BLAKE2b, when decode offered GMAC alone) fails the sink
    with INVALID_ARGUMENT naming both, instead of checking the KV under a MAC nobody agreed on."""
    from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
    mooncake_stub.install(monkeypatch)
    rng = random.Random()
    pool = _filled_pool(rng, 8)
    receiver = MooncakeReceiver(pool, TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write"))
    pages = rng.sample(range(8), rng.randrange(1, 5))
    handshake = pb.Handshake(page_ids=pages, layout=layout_of(pool), num_tokens=len(pages) * pool.page_size)
    receiver.fill_destination(handshake)
    if named == "older":
        if kv_mac.GMAC not in kv_mac.algorithms():
            pytest.skip("this cryptography release is not offered GMAC")
        handshake.mooncake.ClearField("kv_mac_algorithms")
        handshake.mooncake.kv_mac_algorithms.append(kv_mac.GMAC)
    sink = receiver.open_sink(pages)
    ack = pb.HandshakeAck(kv_mac=named if named != "older" else "")
    with pytest.raises(TransferError, match="decode offered") as refused:
        BootstrapClient._mac_agreed(handshake, ack, sink)
    assert refused.value.code == FailureCode.INVALID_ARGUMENT and sink.failed is refused.value
    assert (named if named != "older" else kv_mac.BLAKE2B) in refused.value.message
    # What decode offered itself is read back as agreed.
    ack.kv_mac = handshake.mooncake.kv_mac_algorithms[-1]
    assert BootstrapClient._mac_agreed(handshake, ack, receiver.open_sink(pages)) == ack.kv_mac


def test_gmac_pages_hash_without_holding_the_gil():
    """A Python thread keeps running while a layer hashes (the scheduler thread on a decode worker,
    beside the MAC's threads): AES-GCM releases the GIL in the releases this process offers it for.
    Held through one call (as Poly1305's update does in cryptography 51), the thread would not tick
    until it ended; the test hashes 64 MB pages for that."""
    if kv_mac.GMAC not in kv_mac.algorithms():
        pytest.skip("this cryptography release is not offered GMAC")
    import threading
    layer = kv_mac._LayerMac(kv_mac.GMAC, bytes(32), 0, b"")
    data = memoryview(bytes(64 << 20))
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        time.sleep(0.05)  # the ticker's own rate, alone
        began = time.perf_counter()
        for _ in range(4):
            layer.update(data, len(data))
        ended = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    alone = [t for t in ticks if t < began]
    rate = (len(alone) - 1) / (alone[-1] - alone[0])
    during = sum(began <= t <= ended for t in ticks)
    assert during >= max(3, 0.25 * rate * (ended - began)), (during, rate, ended - began)
