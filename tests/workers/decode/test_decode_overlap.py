"""The overlap scheduler (step N+1 launched before step N's tokens are collected) against the plain
loop: the same tokens, stops and finish reasons for the same requests, pools clean afterwards; and
proof that it really overlaps (a launch precedes the previous step's collect)."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Failed, FailureCode, GenerateRequest, TokenChunk
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
from deepseek_pd.workers.decode import decode_step
from deepseek_pd.workers.decode.engine import DecodeEngine
from pdtest.pd_engine_harness import (CHUNK, abort_after_first_event, collect, device_fails_once_ended, oracle,
                                      pages_back, runner, streaming_fails_once_ended, worker_config)

pytestmark = pytest.mark.timeout(180)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(3, 3 * CHUNK))]


def _cases(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded, penalised, stop-token and stop-string requests of different lengths."""
    cases = []
    for _ in range(3):
        p = _prompt(rng)
        cases.append((p, SamplingParams(temperature=0.0, max_new_tokens=rng.randrange(1, 14), ignore_eos=True)))
    p = _prompt(rng)
    reference = oracle().generate(p, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    cases.append((p, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(reference.output_ids[5],))))
    stop_text = reference.text[len(reference.text) // 2:][:2]
    if stop_text:
        cases.append((p, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, stop=(stop_text,))))
    for _ in range(3):
        cases.append((_prompt(rng), SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=rng.randrange(1 << 30),
                                                   max_new_tokens=rng.randrange(4, 12), ignore_eos=True,
                                                   frequency_penalty=rng.choice([0.0, 0.7]))))
    return cases


async def _serve(cases, overlap: bool, max_running: int, stagger_s: float):
    config = dataclasses.replace(worker_config("fake"), scheduler=SchedulerConfig(
        chunked_prefill_size=CHUNK, max_running_requests=max_running, overlap_schedule=overlap))
    engine = DecodeEngine(runner(256), config, tokenizer=oracle().tokenizer)
    await engine.start()
    try:
        async def one(i, p, params):
            await asyncio.sleep(stagger_s * i)
            return await collect(engine, GenerateRequest(f"o{i}", tuple(p), params))
        outcomes = await asyncio.gather(*(one(i, p, params) for i, (p, params) in enumerate(cases)))
        await asyncio.sleep(0.02)
        assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0, "pages leaked"
        return outcomes
    finally:
        await engine.stop()


@pytest.mark.parametrize("max_running,stagger_s", [(64, 0.0), (3, 0.005)])
def test_overlap_gives_the_tokens_of_the_plain_loop(max_running, stagger_s):
    cases = _cases(random.Random())
    plain = asyncio.run(_serve(cases, overlap=False, max_running=max_running, stagger_s=stagger_s))
    overlapped = asyncio.run(_serve(cases, overlap=True, max_running=max_running, stagger_s=stagger_s))
    for (p, params), a, b in zip(cases, plain, overlapped):
        assert a.ok and b.ok, (a.terminal, b.terminal)
        assert b.tokens == a.tokens, params
        assert (b.terminal.reason, b.terminal.matched_stop, b.terminal.completion_tokens) == \
            (a.terminal.reason, a.terminal.matched_stop, a.terminal.completion_tokens)
        if params.greedy:  # and both equal the offline engine
            assert a.tokens == oracle().generate(p, params).output_ids


def test_overlap_launches_the_next_step_before_collecting_the_last(monkeypatch):
    order: list[str] = []
    real_launch, real_collect = decode_step.DecodeStepper.launch, decode_step.LaunchedStep.collect

    def launch(self, *args):
        order.append("launch")
        return real_launch(self, *args)

    def collect_(self):
        order.append("collect")
        return real_collect(self)

    monkeypatch.setattr(decode_step.DecodeStepper, "launch", launch)
    monkeypatch.setattr(decode_step.LaunchedStep, "collect", collect_)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    p = _prompt(random.Random())
    [outcome] = asyncio.run(_serve([(p, params)], overlap=True, max_running=8, stagger_s=0))
    assert outcome.ok and outcome.tokens == oracle().generate(p, params).output_ids
    # 7 decode steps after the prefill's token; all but the first launch come before a collect.
    assert order.count("launch") == 7 and order.count("collect") == 7
    assert order[:3] == ["launch", "launch", "collect"], order


def _overlapping_engine() -> DecodeEngine:
    config = dataclasses.replace(worker_config("fake"), scheduler=SchedulerConfig(
        chunked_prefill_size=CHUNK, overlap_schedule=True))
    return DecodeEngine(runner(256), config, tokenizer=oracle().tokenizer)


def test_abort_while_a_step_is_in_flight_frees_pages_once_the_step_is_done():
    rng = random.Random()
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    survivor_params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    p, q = _prompt(rng), _prompt(rng)

    async def run():
        engine = _overlapping_engine()
        await engine.start()
        try:
            seen = {"tokens": 0}

            async def abort_after_tokens(event):
                if isinstance(event, TokenChunk):
                    seen["tokens"] += 1
                    if seen["tokens"] == 5:
                        await engine.abort("victim")
            victim = asyncio.ensure_future(collect(engine, GenerateRequest("victim", tuple(p), params),
                                                   on_event=abort_after_tokens))
            survivor = await collect(engine, GenerateRequest("survivor", tuple(q), survivor_params))
            victim = await victim
            await asyncio.sleep(0.05)
            assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0, "pages leaked"
            return victim, survivor
        finally:
            await engine.stop()

    victim, survivor = asyncio.run(run())
    assert isinstance(victim.terminal, Failed) and victim.terminal.code == FailureCode.ABORTED
    assert survivor.ok and survivor.tokens == oracle().generate(q, survivor_params).output_ids


@pytest.mark.parametrize("fails", [device_fails_once_ended, streaming_fails_once_ended], ids=["device", "streaming"])
def test_a_step_that_fails_after_an_abort_still_frees_the_aborted_requests_pages(fails):
    """A request aborted while its step was pending has left the running batch (its consumer ended
    it) and waits for that step to give its pages back. When the round that collects the step fails
    (a device error, or a raise while streaming its tokens), the failure must give them back instead.
    Before: the round had taken the pending step out of the engine, and the failure handler freed
    only what it still found there and in the running batch, so the aborted request's pages leaked
    for good; a raise while streaming skipped the step's end (`_done_with`), with the same leak."""
    rng = random.Random()
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)

    async def run():
        engine = _overlapping_engine()
        await engine.start()
        try:
            with fails(engine, "victim") as raised:  # (a request beside it: the one whose token raises)
                request = GenerateRequest("victim", tuple(_prompt(rng)), params)
                outcome, (beside,) = await abort_after_first_event(
                    engine, request, GenerateRequest("beside", tuple(_prompt(rng)), params), events=3)
                await pages_back(engine)
            return outcome, beside, raised
        finally:
            await engine.stop()

    outcome, beside, raised = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.ABORTED
    assert 1 <= len(outcome.tokens) < 400
    assert isinstance(beside.terminal, Failed) and beside.terminal.code == FailureCode.INTERNAL
    assert raised is None or raised == ["beside"]  # (streaming: it did raise)
