"""The decode engine in colocated mode (no PD) against the offline engine, plus admission control."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Failed, FailureCode, GenerateRequest
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
from deepseek_pd.workers.decode.engine import DecodeEngine
from pdtest.pd_engine_harness import CHUNK, collect, oracle, runner, worker_config

pytestmark = pytest.mark.timeout(120)


def prompt(rng: random.Random, low: int = 3, high: int = 40) -> list[int]:
    return [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(low, high))]


async def with_engine(fn, num_pages: int = 256, **scheduler):
    config = worker_config("fake")
    if scheduler:
        config = dataclasses.replace(config, scheduler=SchedulerConfig(**{"chunked_prefill_size": CHUNK,
                                                                           "admission_timeout_s": 10, **scheduler}))
    engine = DecodeEngine(runner(num_pages), config, tokenizer=oracle().tokenizer)
    await engine.start()
    try:
        result = await fn(engine)
        # An aborted request's pages come back when the model thread collects the step in flight
        # (the overlap scheduler): bounded wait, not a fixed 20 ms that a loaded machine outran.
        for _ in range(500):
            if engine.pool.num_used_pages == 0 and engine.budget.reserved == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0, "pages leaked"
        return result
    finally:
        await engine.stop()


def test_stops_lengths_and_seeds_match_the_offline_engine():
    rng = random.Random()
    p = prompt(rng, 5, 30)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    reference = oracle().generate(p, greedy)
    stop_text = reference.text[len(reference.text) // 2:][:3] or reference.text[:1]
    cases = [
        greedy,
        SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, stop=(stop_text,)) if stop_text else greedy,
        SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(reference.output_ids[4],)),
        SamplingParams(temperature=0.0, max_new_tokens=1),
        SamplingParams(temperature=1.1, top_k=20, seed=rng.randrange(1 << 20), max_new_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, seed=rng.randrange(1 << 20), max_new_tokens=10,
                       repetition_penalty=1.3, frequency_penalty=0.5),
    ]

    async def run(engine):
        return await asyncio.gather(*(collect(engine, GenerateRequest(f"s{i}", tuple(p), params))
                                      for i, params in enumerate(cases)))

    outcomes = asyncio.run(with_engine(run))
    for params, outcome in zip(cases, outcomes):
        want = oracle().generate(p, params)
        assert outcome.ok, outcome.terminal
        assert outcome.tokens == want.output_ids, params
        assert outcome.terminal.reason == want.finish_reason
        assert outcome.terminal.matched_stop == want.matched_stop
        assert outcome.terminal.completion_tokens == len(want.output_ids)


def test_continuous_batching_with_staggered_arrivals_and_a_small_batch_cap():
    rng = random.Random()
    prompts = [prompt(rng, 3, 3 * CHUNK) for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)

    async def run(engine):
        async def late(i, p):
            await asyncio.sleep(0.01 * i)
            return await collect(engine, GenerateRequest(f"b{i}", tuple(p), params))
        return await asyncio.gather(*(late(i, p) for i, p in enumerate(prompts)))

    outcomes = asyncio.run(with_engine(run, max_running_requests=2))
    for p, outcome in zip(prompts, outcomes):
        assert outcome.ok and outcome.tokens == oracle().generate(p, params).output_ids


def test_decoding_past_the_reserve_grows_pages_on_demand():
    rng = random.Random()
    p = prompt(rng, 5, 10)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)

    async def run(engine):
        return await collect(engine, GenerateRequest("grow", tuple(p), params))

    outcome = asyncio.run(with_engine(run, decode_reserve_tokens=2))
    assert outcome.ok and outcome.tokens == oracle().generate(p, params).output_ids


def test_abort_mid_decode_frees_pages_and_ends_once():
    rng = random.Random()
    p = prompt(rng)
    params = SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True)

    async def run(engine):
        started = asyncio.Event()

        async def on_event(event):
            started.set()

        task = asyncio.ensure_future(collect(engine, GenerateRequest("long", tuple(p), params), on_event))
        await asyncio.wait_for(started.wait(), 30)
        assert await engine.abort("long") and not await engine.abort("unknown")
        return await asyncio.wait_for(task, 30)

    outcome = asyncio.run(with_engine(run))
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.ABORTED
    assert 1 <= len(outcome.tokens) < 500


def test_abort_is_honoured_even_while_the_consumer_lags_behind():
    """A slow stream consumer leaves tokens queued; an Abort must still end the request at the
    next event (pages freed now), not only once the consumer has drained a backlog that keeps
    growing (which could run the request to max_new_tokens)."""
    rng = random.Random()
    p = prompt(rng)
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)

    async def run(engine):
        events = engine.generate(GenerateRequest("lagging", tuple(p), params))
        first = await asyncio.wait_for(events.__anext__(), 30)
        state = engine._requests["lagging"]
        for _ in range(3000):  # bounded: the consumer "stalls" until a backlog of tokens is queued
            if state.events.qsize() >= 3:
                break
            await asyncio.sleep(0.01)
        assert state.events.qsize() >= 3
        assert await engine.abort("lagging")
        after_abort = [event async for event in events]
        return first, after_abort

    first, after_abort = asyncio.run(with_engine(run))
    assert len(first.token_ids) == 1
    assert len(after_abort) == 1, f"{len(after_abort) - 1} events streamed after the abort"
    assert isinstance(after_abort[0], Failed) and after_abort[0].code == FailureCode.ABORTED


def test_admission_waits_for_pages_then_gives_up_with_resource_exhausted():
    params_long = SamplingParams(temperature=0.0, max_new_tokens=2000, ignore_eos=True)
    params_short = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)

    async def run(engine):
        # 8 + 2000 - 1 tokens = 502 pages of 4: the hog takes all but one page of the pool.
        admitted = asyncio.Event()

        async def on_event(event):
            admitted.set()

        first = asyncio.ensure_future(collect(engine, GenerateRequest("hog", tuple(range(2, 10)), params_long),
                                              on_event))
        await asyncio.wait_for(admitted.wait(), 30)  # the hog holds its pages (a sleep raced it under load)
        second = await collect(engine, GenerateRequest("late", tuple(range(2, 10)), params_short))
        await engine.abort("hog")
        await first
        return second

    second = asyncio.run(with_engine(run, num_pages=503, admission_timeout_s=0.3))
    assert isinstance(second.terminal, Failed) and second.terminal.code == FailureCode.RESOURCE_EXHAUSTED


def test_request_larger_than_the_usable_pool_fails_at_once_not_after_the_admission_timeout():
    """With cuda_graph the runner keeps one KV page (its scratch page): a request needing the whole
    pool can never be admitted and must fail now, not after admission_timeout_s of waiting."""
    rng = random.Random()
    num_pages = rng.randrange(12, 30)
    p = prompt(rng, 3, 9)
    # Exactly num_pages pages for prompt + reserve: fits pool.num_pages, not what is usable.
    max_new = num_pages * 4 - len(p) + 1
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    config = dataclasses.replace(worker_config("fake"), scheduler=SchedulerConfig(
        chunked_prefill_size=CHUNK, admission_timeout_s=600, decode_reserve_tokens=10**6))

    async def run():
        engine = DecodeEngine(runner(num_pages), config, tokenizer=oracle().tokenizer)
        scratch = engine.pool.alloc(1)  # what DecodeGraphRunner takes at construction
        await engine.start()
        try:
            assert engine.pool.pages_for_tokens(len(p) + max_new - 1) == num_pages
            outcome = await asyncio.wait_for(collect(engine, GenerateRequest("big", tuple(p), params)), 30)
            assert engine.pool.num_used_pages == 1 and engine.budget.reserved == 0, "pages leaked"
            return outcome
        finally:
            await engine.stop()
            engine.pool.free(scratch)

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.RESOURCE_EXHAUSTED


def test_page_budget_admits_in_arrival_order_so_big_requests_are_not_starved():
    """FIFO, as documented: while a large request waits for pages, later small ones that would
    fit queue behind it; otherwise a steady stream of small requests starves it into
    RESOURCE_EXHAUSTED."""
    from deepseek_pd.model.kv.pool import KVPool
    from deepseek_pd.workers.decode.page_budget import PageBudget

    rng = random.Random()
    num_pages = rng.randrange(20, 40)
    big = num_pages - rng.randrange(2, 5)

    async def run():
        budget = PageBudget(KVPool(1, num_pages, 4, 8), admission_timeout_s=30)
        hog = await budget.admit(num_pages - 3, 0)
        order: list[str] = []

        async def admit(name: str, pages: int):
            reservation = await budget.admit(pages, 0)
            order.append(name)
            return reservation

        waiting_big = asyncio.ensure_future(admit("big", big))
        await asyncio.sleep(0.01)
        waiting_small = asyncio.ensure_future(admit("small", 1))  # fits now, but arrived later
        await asyncio.sleep(0.05)
        admitted_before_release = list(order)
        budget.release(hog)
        reservations = await asyncio.wait_for(asyncio.gather(waiting_big, waiting_small), 20)
        for reservation in reservations:
            budget.release(reservation)
        assert budget.pool.num_used_pages == 0 and budget.reserved == 0
        return admitted_before_release, order

    before, order = asyncio.run(run())
    assert before == [] and order == ["big", "small"]


def test_prompt_longer_than_the_context_is_invalid():
    async def run(engine):
        too_long = tuple([3] * engine.max_context)
        return await collect(engine, GenerateRequest("long", too_long, SamplingParams(max_new_tokens=1)))

    outcome = asyncio.run(with_engine(run, num_pages=4096 // 4 + 8))
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.INVALID_ARGUMENT


def test_bad_requests_fail_alone_without_hurting_the_batch():
    rng = random.Random()
    good = prompt(rng)
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)

    async def run(engine):
        vocab = engine.runner.model_config.vocab_size
        bad = [GenerateRequest("oov", (3, vocab + 7), params),
               GenerateRequest("empty", (), params),
               GenerateRequest("topp", (3, 4), SamplingParams(top_p=0.0))]
        return await asyncio.gather(collect(engine, GenerateRequest("good", tuple(good), params)),
                                    *(collect(engine, r) for r in bad))

    good_outcome, *bad_outcomes = asyncio.run(with_engine(run))
    assert good_outcome.ok and good_outcome.tokens == oracle().generate(good, params).output_ids
    for outcome, word in zip(bad_outcomes, ("vocabulary", "empty", "top_p")):
        assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.INVALID_ARGUMENT
        assert word in outcome.terminal.message


def test_a_failing_scheduler_round_fails_its_requests_and_the_engine_keeps_serving():
    """A bug in one round must end the requests it held (INTERNAL, pages freed), not strand them."""
    rng = random.Random()
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    async def run(engine):
        real_round = engine._decode_round
        calls = {"n": 0}

        async def broken_once():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected scheduler bug")
            await real_round()

        engine._decode_round = broken_once
        first = await asyncio.wait_for(collect(engine, GenerateRequest("x", tuple(prompt(rng)), params)), 20)
        assert isinstance(first.terminal, Failed) and first.terminal.code == FailureCode.INTERNAL
        assert engine.is_healthy()
        p = prompt(rng)
        second = await asyncio.wait_for(collect(engine, GenerateRequest("y", tuple(p), params)), 20)
        assert second.ok and second.tokens == oracle().generate(p, params).output_ids

    asyncio.run(with_engine(run))
