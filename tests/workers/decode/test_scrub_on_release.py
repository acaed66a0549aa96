"""A failed transfer's pages are zeroed before reuse only if the transfer may have written them, and
kept for the late-write grace only if a write can still land (a one-sided transport whose peer was
told the pages): workers/transport/exposure.py. The zeroing runs off the event loop, and the
pages go back to the pool only after it returned; if it fails they never go back.

Before: every failed PD transfer was zeroed after the receiver's grace, also one refused before the
peer learnt its pages (mooncake: held for the grace; grpc: zeroed for nothing), and the zeroing ran on
the event loop thread (on CUDA blocking it on a stream sync)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, FailureCode, GenerateRequest
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.transport.grpc_stream import GrpcReceiver
from deepseek_pd.workers.decode import engine as decode_engine
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.decode.page_budget import PageBudget
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest import mooncake_stub
from pdtest.hostile_prefill import lie_about_first_token, withhold_a_layer
from pdtest.pd_engine_harness import PDPair, collect, oracle, runner, worker_config

pytestmark = pytest.mark.timeout(120)

GRACE_S = 1.5
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(10, 30))]


def _fill_random(pool: KVPool, rng: random.Random) -> list[torch.Tensor]:
    """Random non-zero contents in every page (a zero page afterwards was zeroed); returns a copy."""
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for buffer in pool.buffers:
        buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)
    return [buffer.clone() for buffer in pool.buffers]


def _record_pages(engine: DecodeEngine) -> list[list[int]]:
    """The destination pages of every transfer the engine opens, in order."""
    opened: list[list[int]] = []
    open_sink = engine.receiver.open_sink

    def recording(pages, peer_host=None):
        opened.append(list(pages))
        return open_sink(pages, peer_host)
    engine.receiver.open_sink = recording
    return opened


class _ScrubSpy:
    """Wraps the engine's scrub: which pages, on which thread, when, and whether they held bytes."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[list[int], threading.Thread, float, bool]] = []
        scrub = decode_engine.scrub_pages

        def spy(pool, pages):
            held = any(bool(torch.count_nonzero(buffer[list(pages)])) for buffer in pool.buffers)
            self.calls.append((list(pages), threading.current_thread(), time.monotonic(), held))
            scrub(pool, pages)
        monkeypatch.setattr(decode_engine, "scrub_pages", spy)


def _zero_pages(pool: KVPool, pages: list[int]) -> bool:
    return all(torch.count_nonzero(buffer[pages]).item() == 0 for buffer in pool.buffers)


async def _fail_untouched(engine: DecodeEngine, request: GenerateRequest, rng: random.Random):
    """Runs `request` (it fails) on `engine` with random contents in its pool: (its outcome, the pool's
    used pages as it ended, the pages of its transfers, whether those kept their contents)."""
    before = _fill_random(engine.pool, rng)
    opened = _record_pages(engine)
    used_at_end = []

    async def on_event(event):
        if isinstance(event, Failed):
            used_at_end.append(engine.pool.num_used_pages)
    outcome = await collect(engine, request, on_event)
    await asyncio.sleep(0.2)  # a scrub would have been started by now
    kept = all(torch.equal(buffer[opened[0]], old[opened[0]]) for buffer, old in zip(engine.pool.buffers, before))
    return outcome, used_at_end, opened, kept


async def _lied_transfer(pair: PDPair, rng: random.Random):
    """One PD request whose prefill side lies about the first token (so decode refuses it after the
    transfer), over random pool contents: (decode's outcome, the pages of its transfers, and when
    it failed with the pool's used pages then, as [(time, used)])."""
    _fill_random(pair.decode.pool, rng)
    opened = _record_pages(pair.decode)
    lie_about_first_token(pair.prefill, rng)
    ended: list[tuple[float, int]] = []

    async def on_event(event):
        if isinstance(event, Failed):
            ended.append((time.monotonic(), pair.decode.pool.num_used_pages))
    p_req, d_req = pair.requests(_prompt(rng), GREEDY, "lied")
    _, failed = await asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req, on_event))
    return failed, opened, ended


def _assert_freed_at_once_untouched(used_at_end, opened, kept, spy: "_ScrubSpy") -> None:
    assert len(opened) == 1 and opened[0], "the request never got pages: the test proves nothing"
    assert used_at_end == [0], f"pages still held when the request ended: {used_at_end}"
    assert spy.calls == [] and kept, "pages nothing could have written were zeroed"


@pytest.mark.parametrize("transport", ["mooncake", "grpc"])
def test_a_transfer_refused_before_the_handshake_frees_its_pages_at_once_unscrubbed(transport, monkeypatch):
    """The decode worker refuses the named prefill address before it connects: no peer ever learnt
    the pages, so they go back at once (mooncake's grace, the send timeout, is not waited) and keep
    their contents. grpc is made to state a grace too: it must not matter."""
    mooncake_stub.install(monkeypatch)
    monkeypatch.setattr(GrpcReceiver, "late_write_grace_s", property(lambda self: 30.0))
    spy = _ScrubSpy(monkeypatch)
    rng = random.Random()
    registered, dialled = rng.sample(range(20000, 30000), 2)
    config = worker_config(transport, prefill_peers=(f"127.0.0.1:{registered}",))
    config = dataclasses.replace(config, transport=TransportConfig(send_timeout_s=30))

    async def run():
        engine = DecodeEngine(runner(), config, tokenizer=oracle().tokenizer)
        await engine.start()
        try:
            assert engine.receiver.late_write_grace_s == (30 if transport == "grpc" else 0)
            request = GenerateRequest("refused", tuple(_prompt(rng)), GREEDY,
                                      disagg=DisaggParams("127.0.0.1", dialled, rng.randrange(1 << 31)))
            return await _fail_untouched(engine, request, rng)
        finally:
            await engine.stop()

    outcome, used_at_end, opened, kept = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.INVALID_ARGUMENT, outcome
    _assert_freed_at_once_untouched(used_at_end, opened, kept, spy)


def test_a_grpc_transfer_that_failed_before_any_chunk_frees_its_pages_at_once_unscrubbed(monkeypatch):
    """The prefill side takes the handshake (it knows the pages) but no prefill request claims the
    room, so it fails the transfer before sending any chunk: with grpc only our own receiver writes
    the pages, so they go back at once and keep their contents."""
    monkeypatch.setattr(GrpcReceiver, "late_write_grace_s", property(lambda self: 30.0))
    spy = _ScrubSpy(monkeypatch)
    rng = random.Random()

    async def run():
        async with PDPair("grpc", prefill_config=worker_config("grpc", claim_timeout_s=0.3)) as pair:
            _, d_req = pair.requests(_prompt(rng), GREEDY, "unclaimed")
            return await _fail_untouched(pair.decode, d_req, rng)  # the prefill engine never gets it

    outcome, used_at_end, opened, kept = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and "never received the request" in outcome.terminal.message, outcome
    _assert_freed_at_once_untouched(used_at_end, opened, kept, spy)


def test_a_grpc_transfer_that_wrote_chunks_is_zeroed_off_the_loop_without_the_grace(monkeypatch):
    """A hostile prefill's chunks are written but one layer never comes, so decode refuses the KV
    at the TransferDone: the pages are zeroed in a worker thread and freed without waiting any grace
    (nothing writes into them once the receiver stopped), though the receiver is made to state one.
    (A chunk with a NaN no longer serves here: decode refuses it before its bytes reach a page,
    test_grpc_landing_check.py.)"""
    monkeypatch.setattr(GrpcReceiver, "late_write_grace_s", property(lambda self: 30.0))
    spy = _ScrubSpy(monkeypatch)
    rng = random.Random()

    async def run():
        loop_thread = threading.current_thread()
        async with PDPair("grpc") as pair:
            opened = _record_pages(pair.decode)
            hostile = PrefillEngine(runner(), worker_config("grpc"))
            await hostile.start()
            withhold_a_layer(hostile)
            try:
                p_req, d_req = pair.requests(_prompt(rng), GREEDY, "short", prefill=hostile)
                _, failed = await asyncio.gather(collect(hostile, p_req), collect(pair.decode, d_req))
                await pair.wait_pools_clean(5)  # far below the stated grace
                return failed, opened, _zero_pages(pair.decode.pool, opened[0]), loop_thread
            finally:
                await hostile.stop()

    failed, opened, zeroed, loop_thread = asyncio.run(run())
    assert isinstance(failed.terminal, Failed) and "never arrived" in failed.terminal.message, failed.terminal
    assert [(pages, held) for pages, _, _, held in spy.calls] == [(opened[0], True)], spy.calls
    assert spy.calls[0][1] is not loop_thread, "the scrub ran on the event loop thread"
    assert zeroed, "the refused pages were not zeroed"


def test_a_one_sided_transfer_told_its_pages_waits_the_grace_then_is_zeroed_off_the_loop(monkeypatch):
    """gRPC with same-host direct copies (the prefill side copies into the decode pool itself) and a
    prefill that lies about the first token: the handshake gave it the pages, so they stay out for
    the grace (the send timeout) and are zeroed after it, in a worker thread, before they go back.
    (Mooncake was this case until its writers reached only a staging area: the next test.)"""
    spy = _ScrubSpy(monkeypatch)
    rng = random.Random()
    config = dataclasses.replace(worker_config("grpc", same_host_direct="on"),
                                 transport=TransportConfig(send_timeout_s=GRACE_S, same_host_direct="on"))

    async def run():
        loop_thread = threading.current_thread()
        async with PDPair("grpc", config, config) as pair:
            failed, opened, ended = await _lied_transfer(pair, rng)
            await pair.wait_pools_clean(GRACE_S + 5)
            return failed, opened, ended, _zero_pages(pair.decode.pool, opened[0]), loop_thread

    failed, opened, ended, zeroed, loop_thread = asyncio.run(run())
    assert isinstance(failed.terminal, Failed) and "vocabulary" in failed.terminal.message, failed.terminal
    (failed_at, used), = ended
    assert used == len(opened[0]), "the pages went back before the grace was over"
    (pages, thread, scrubbed_at, _), = spy.calls
    assert pages == opened[0] and zeroed
    assert scrubbed_at - failed_at >= GRACE_S * 0.9, f"zeroed {scrubbed_at - failed_at:.2f}s after the failure"
    assert thread is not loop_thread, "the scrub ran on the event loop thread"


def test_a_mooncake_transfer_refused_after_its_copy_is_zeroed_off_the_loop_without_the_grace(monkeypatch):
    """Mooncake (stub engine: writes are recorded, not made; pulled reads are made) with a prefill that
    lies about the first token: its KV reached only decode's staging (read into it, the default, or
    written: workers/transport/staging.py), the pages hold decode's own copy of it, so they are zeroed in a worker thread and go back
    without waiting the late-write grace; the staging slots are free again too (every write of
    the prefill side completed before its TransferDone)."""
    engines = mooncake_stub.install(monkeypatch)
    spy = _ScrubSpy(monkeypatch)
    rng = random.Random()
    config = dataclasses.replace(worker_config("mooncake"), transport=TransportConfig(send_timeout_s=30))

    async def run():
        loop_thread = threading.current_thread()
        async with PDPair("mooncake", config, config) as pair:
            failed, opened, ended = await _lied_transfer(pair, rng)
            await pair.wait_pools_clean(5)  # well inside the 30 s grace
            return (failed, opened, ended, _zero_pages(pair.decode.pool, opened[0]), loop_thread,
                    pair.decode.receiver.staging.num_used)

    failed, opened, ended, zeroed, loop_thread, staged = asyncio.run(run())
    assert isinstance(failed.terminal, Failed) and "vocabulary" in failed.terminal.message, failed.terminal
    assert any(engine.writes or engine.reads for engine in engines), "no KV moved: the test proves nothing"
    (pages, thread, scrubbed_at, _), = spy.calls
    assert pages == opened[0] and zeroed and staged == 0
    (failed_at, _), = ended
    assert scrubbed_at - failed_at < 5, f"zeroed {scrubbed_at - failed_at:.2f}s after the failure"
    assert thread is not loop_thread, "the scrub ran on the event loop thread"


def test_released_pages_go_back_only_after_their_scrub_returned_and_never_if_it_failed(caplog):
    rng = random.Random()

    async def run():
        pool = KVPool(2, rng.randrange(8, 16), 4, 16)
        budget = PageBudget(pool, admission_timeout_s=0.1)
        first = await budget.admit(rng.randrange(1, 4), 0)
        second = await budget.admit(rng.randrange(1, 4), 0)
        sizes = len(first.pages), len(second.pages)
        gate = asyncio.Event()

        async def slow_scrub(pages):
            await gate.wait()

        async def failing_scrub(pages):
            raise RuntimeError("device lost")
        budget.release(first, scrub=slow_scrub)
        await asyncio.sleep(0.05)
        while_scrubbing = pool.num_used_pages
        gate.set()
        await asyncio.sleep(0.05)
        with caplog.at_level(logging.ERROR):
            budget.release(second, scrub=failing_scrub)
            await asyncio.sleep(0.05)
        return sizes, while_scrubbing, pool.num_used_pages, budget.capacity, pool.num_pages

    (first, second), while_scrubbing, left, capacity, num_pages = asyncio.run(run())
    assert while_scrubbing == first + second, "pages went back before their scrub returned"
    assert left == second, "a failed scrub's pages went back to the pool (or a good one's did not)"
    assert capacity == num_pages - second, "admission still counts the pages that will never come back"
    assert any("stay out of the pool" in record.getMessage() for record in caplog.records), caplog.text
