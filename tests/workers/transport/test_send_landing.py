"""Decode's MAC built as a mooncake transfer's sends land (transport/send_landing.py, kv_mac.LandedMacs):
against the one-shot reference MAC under random cuts and landing orders, landed side by side; a cell
reported twice, outside the transfer, or never, and a report that comes before its write: each
still fails only its own transfer, as the one-shot check after the TransferDone did.
Its decode workers run the write direction (`mooncake_kv_direction=write`), the one these sinks
and channels serve; pulled transfers, the default: test_mooncake_pull.py."""
from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport import kv_mac, wire
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver, MooncakeSender
from deepseek_pd.workers.transport.send_landing import SendLanding
from pdtest import mooncake_stub
from test_kv_mac import _filled_pool, _random_sends, _random_tag_inputs, _reference


def _cells_in_random_cuts(rng: random.Random, num_layers: int, num_pages: int) -> list[tuple[range, int, int]]:
    """A random cover of every (layer, page) cell, each exactly once, in a random order: the sends
    of KVPush's cuts, some of them split further by pages (any cut a prefill worker may report)."""
    cuts = []
    for layers, begin, end in _random_sends(rng, num_layers, num_pages):
        while begin < end:
            stop = rng.randrange(begin + 1, end + 1)
            cuts.append((layers, begin, stop))
            begin = stop
    rng.shuffle(cuts)
    return cuts


def test_the_tag_built_as_cells_land_is_the_one_shot_tag():
    """Any cut, any order, several landings at once, some cells never landed (read by `digest`):
    the documented tag. Landed whole, each cell is read exactly once and `digest` reads none."""
    rng = random.Random()
    for _ in range(10):
        pool, pages, key, head = _random_tag_inputs(rng)
        cuts = _cells_in_random_cuts(rng, pool.num_layers, len(pages))
        whole = rng.random() < 0.6
        if not whole:
            cuts = [cut for cut in cuts if rng.random() < 0.7]
        macs = kv_mac.LandedMacs(pool, pages, key, head)
        with ThreadPoolExecutor(rng.randrange(1, 5)) as landings:
            list(landings.map(lambda cut: macs.landed(*cut), cuts))
        before = macs.pages_read
        tag = macs.digest()
        assert tag == _reference(pool, pages, key, head) == kv_mac.kv_mac(pool, pages, key, head)
        assert macs.pages_read == pool.num_layers * len(pages)  # each cell once, landed or at `digest`
        if whole:
            assert before == macs.pages_read  # nothing left for the first token's path


def test_landing_refuses_a_cell_twice_or_outside_and_names_a_cell_never_reported():
    rng = random.Random()
    layers, pages = rng.randrange(1, 5), rng.randrange(2, 9)
    landing = SendLanding(layers, pages)
    assert landing.missing() is None and not landing.reported  # no report at all: an older prefill
    page = rng.randrange(pages)
    assert landing.claim(range(0, layers), page, page + 1) is None
    assert "twice" in landing.claim(range(rng.randrange(layers), layers), rng.randrange(page + 1), page + 1)
    assert "the transfer has" in landing.claim(range(0, layers + 1), 0, 1)
    assert "the transfer has" in landing.claim(range(0, 1), pages - 1, pages + 1)
    assert "the transfer has" in landing.claim(range(0, 1), 1, 1)
    assert f"{layers} of the transfer's {layers * pages}" in landing.missing()
    for other in range(pages):
        if other != page:
            assert landing.claim(range(0, layers), other, other + 1) is None
    assert landing.missing() is None


def open_reported_transfer(sender: MooncakeSender, receiver: MooncakeReceiver, dst: KVPool, dst_pages: list[int],
                           num_tokens: int):
    """Decode's side of a mooncake transfer into `dst_pages` opened as the bootstrap client opens it
    (destination filled, slots reserved and offered), and the prefill side's channel whose send
    reports are collected: (handshake, sink, decode's staging slots, channel, reports)."""
    handshake = pb.Handshake(page_ids=dst_pages, layout=layout_of(dst), num_tokens=num_tokens)
    receiver.fill_destination(handshake)
    sink = receiver.open_sink(dst_pages)
    asyncio.run(sink.reserve())
    sink.expose()
    sink.offer_into(handshake)
    reports: list = []

    async def emit(encoded):
        reports.append(wire.decode_event(encoded.payload).chunk)
    channel = sender.open(handshake, emit=emit)
    return handshake, sink, list(handshake.page_ids), channel, reports


def _reporting_transfer(monkeypatch, rng: random.Random, nan: bool = False):
    """A mooncake transfer over the stub engine whose decode side asked for each send's report
    (`nan`: one value of one sent page is NaN, as a prefill worker with the secret may send it):
    (sender's channel, decode sink, the reports in send order, write(report): copies that report's
    cells into the staging as the engine would, the key, the room, source pool and pages, decode
    pool and pages)."""
    mooncake_stub.install(monkeypatch)
    src = _filled_pool(rng, 24)
    dst = KVPool(src.num_layers, 24, src.page_size, src.kv_dim, dtype=src.dtype)
    config = TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction="write")
    sender, receiver = MooncakeSender(src, config), MooncakeReceiver(dst, config)
    count = rng.randrange(2, 8)
    src_pages, dst_pages = rng.sample(range(24), count), rng.sample(range(24), count)
    if nan:
        src.buffers[rng.randrange(src.num_layers)][rng.choice(src_pages), rng.randrange(src.page_size), 0] = float("nan")
    handshake, sink, slots, channel, reports = open_reported_transfer(sender, receiver, dst, dst_pages,
                                                                      count * src.page_size)
    room, key = rng.randrange(1 << 40), bytes(rng.randrange(256) for _ in range(32))
    channel.begin_seal(key, room)
    sink.begin_check(key, room, kv_mac.algorithms()[0])
    for layers, first, end in _random_sends(rng, src.num_layers, count):
        asyncio.run(channel.send(src_pages[first:end], first, layers.start, layers.stop))

    def write(report) -> None:
        for layer in range(report.layer_begin, report.layer_end):
            staged, pages = receiver.staging.buffers[layer], range(report.page_begin, report.page_end)
            staged[[slots[i] for i in pages]] = src.buffers[layer][[src_pages[i] for i in pages]]
    return channel, sink, reports, write, key, room, src, src_pages, dst, dst_pages


def _finish(channel, sink, key: int, room: int) -> pb.TransferDone:
    """The TransferDone after the last landing, checked as `pull_kv` checks it (raises TransferError)."""
    done = pb.TransferDone(num_pages=len(sink.pages), bytes_sent=channel.bytes_sent)
    sink.check_complete(done)
    sink.land()
    channel.seal(done, key, room)
    sink.check_sealed(done, key, room)
    return done


def test_reports_landed_as_written_give_the_sent_pages_and_leave_only_a_digest(monkeypatch):
    rng = random.Random()
    channel, sink, reports, write, key, room, src, src_pages, dst, dst_pages = _reporting_transfer(monkeypatch, rng)
    for report in reports:  # each send's cells land once written, as the stream brings their report
        write(report)
        sink.on_chunk(report)
    assert not sink.check_reads()
    _finish(channel, sink, key, room)
    assert sink.failed is None
    for s, d in zip(src.buffers, dst.buffers):
        assert torch.equal(d[dst_pages], s[src_pages])


def test_a_cell_reported_twice_fails_its_transfer_before_the_second_copy(monkeypatch):
    """A second copy over a landed (hashed) page would let the model read bytes the tag never
    covered: the report is refused first, and the page keeps what landed."""
    rng = random.Random()
    channel, sink, reports, write, key, room, *_, dst, dst_pages = _reporting_transfer(monkeypatch, rng)
    for report in reports:
        write(report)
        sink.on_chunk(report)
    landed = [buffer[dst_pages].clone() for buffer in dst.buffers]
    again = rng.choice(reports)
    for staged in sink._staging.buffers:  # what a second copy would have put there
        staged[sink.slots] = 1.0
    with pytest.raises(TransferError, match="twice"):
        sink.on_chunk(again)
    assert sink.failed is not None and sink.exposure.may_be_written  # scrubbed when freed
    assert all(torch.equal(buffer[dst_pages], before) for buffer, before in zip(dst.buffers, landed))
    with pytest.raises(TransferError):
        _finish(channel, sink, key, room)


def test_reports_that_miss_a_cell_fail_the_transfer_at_its_done(monkeypatch):
    """(Reports of some cells, not all. None at all is an older prefill worker: `land` copies all.)"""
    rng = random.Random()
    reports = []
    while len(reports) < 2:
        channel, sink, reports, write, key, room, *_ = _reporting_transfer(monkeypatch, rng)
    for report in reports:
        write(report)
    kept = rng.sample(reports, len(reports) - 1)
    for report in kept:
        sink.on_chunk(report)
    with pytest.raises(TransferError, match="cells written"):
        _finish(channel, sink, key, room)


def test_a_report_landed_before_its_write_fails_the_mac(monkeypatch):
    """A report that comes before its cells are written (a forged one, or a bug) copies what the
    slots held then: the tag does not match, and only this transfer fails."""
    rng = random.Random()
    channel, sink, reports, write, key, room, *_ = _reporting_transfer(monkeypatch, rng)
    early = rng.randrange(len(reports))
    for index, report in enumerate(reports):
        if index != early:
            write(report)
        sink.on_chunk(report)
        if index == early:
            write(report)  # the honest write lands after the copy: in the staging only
    with pytest.raises(TransferError, match="does not match the MAC the prefill worker signed"):
        _finish(channel, sink, key, room)


def test_a_report_carrying_kv_bytes_is_refused(monkeypatch):
    rng = random.Random()
    channel, sink, reports, write, key, room, *_ = _reporting_transfer(monkeypatch, rng)
    report = reports[0]
    forged = wire.ChunkView(report.layer_begin, report.layer_end, report.page_begin, report.page_end,
                            memoryview(b"\x00" * 8), 0, written_directly=False)
    with pytest.raises(TransferError, match="carry none"):
        sink.on_chunk(forged)


def test_the_finite_check_runs_on_each_landing_and_its_refusal_waits_for_the_macs_verdict(monkeypatch):
    """Decode's finite check (`check_on_landing`, as pull_kv sets it) runs on every cell as its send
    lands, once, so none is left after the TransferDone; a NaN that lands is kept as the transfer's
    `landing_failure` (pull_kv reports it after the MAC's verdict, as before)."""
    from deepseek_pd.workers.decode.kv_checks import FiniteOnLanding

    rng = random.Random()
    nan = rng.random() < 0.5
    channel, sink, reports, write, key, room, src, src_pages, dst, dst_pages = _reporting_transfer(
        monkeypatch, rng, nan=nan)
    checked = torch.zeros(dst.num_layers, dst.num_pages, dtype=torch.int)

    class Counted(FiniteOnLanding):
        def pages(self, layers, pages):
            checked[layers.start:layers.stop, pages] += 1
            super().pages(layers, pages)
    sink.check_on_landing(Counted(dst, "r"))
    for report in reports:
        write(report)
        sink.on_chunk(report)
    _finish(channel, sink, key, room)  # the MAC passes: the NaN is what was sent
    assert sink.checked_on_landing()
    assert bool(checked[:, dst_pages].eq(1).all()) and int(checked.sum()) == dst.num_layers * len(dst_pages)
    if not nan:
        assert sink.landing_failure is None
    else:
        assert isinstance(sink.landing_failure, TransferError) and "NaN" in sink.landing_failure.message
