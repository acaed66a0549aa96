"""Top logprobs through the prefill and decode engines (PD over the real bootstrap service, and
colocated), against an independent oracle: log_softmax of one full forward per position
(pdtest.gateway_oracle.reference_logprobs; no sampler involved), and the offline Engine's own.

The first token's top logprobs come from the prefill worker inside TransferDone; the decode
worker streams them with the rest, one entry per token, each min(k, V) long, most likely first.
A prefill peer that sends another count for the first token (an older worker) fails the request
on the decode side with one clear error, and every page comes back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from deepseek_pd.workers.engine.interface import Failed, FailureCode, GenerateRequest
from deepseek_pd.workers.decode.engine import DecodeEngine
from pdtest.top_logprobs_check import assert_top_matches
from pdtest.pd_engine_harness import PDPair, collect, oracle, runner, worker_config

pytestmark = [pytest.mark.timeout(180)]

TOL = 2e-3  # fp32 on CPU: paged decode vs one full forward differ in summation order (as LOGPROB_TOL)


def random_prompt(rng: random.Random, low: int = 3, high: int = 40) -> list[int]:
    return [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(low, high))]


@pytest.mark.parametrize("transport", ["fake", "grpc"])
def test_pd_top_logprobs_equal_full_forwards_and_the_offline_engine(transport):
    rng = random.Random()
    cases = []
    for i in range(4):
        k = rng.randint(1, MAX_TOP_LOGPROBS)
        params = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(2, 6), ignore_eos=True,
                                top_logprobs_num=k)
        cases.append((random_prompt(rng), params))
    cases.append((random_prompt(rng), SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)))
    temperature = rng.choice([0.6, 1.3])
    sampled = SamplingParams(temperature=temperature, seed=rng.randrange(1 << 30), max_new_tokens=4,
                             ignore_eos=True, top_logprobs_num=rng.randint(1, MAX_TOP_LOGPROBS))
    cases.append((random_prompt(rng), sampled))

    async def run():
        async with PDPair(transport) as pair:
            outcomes = await asyncio.gather(*(pair.run(p, params, f"r{i}", return_logprob=True)
                                              for i, (p, params) in enumerate(cases)))
            pair.assert_pools_clean()
            return outcomes

    for (prompt, params), (prefill, decode) in zip(cases, asyncio.run(run())):
        assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
        k = params.top_logprobs_num
        if k == 0:  # asked for none: none, and the sampled logprobs still come
            assert prefill.top_logprobs == [] and decode.top_logprobs == [] and len(decode.logprobs) == len(decode.tokens)
            continue
        # The first token's entry travelled in TransferDone: the same values the prefill side reports.
        assert decode.top_logprobs[0] == prefill.top_logprobs[0]
        assert_top_matches(oracle(), decode.top_logprobs, decode.tokens, prompt, k, 1.0 if params.greedy else params.temperature)
        offline = oracle().generate(prompt, params)
        assert decode.tokens == offline.output_ids
        assert len(offline.output_top_logprobs) == len(offline.output_ids)
        for got, want in zip(decode.top_logprobs, offline.output_top_logprobs):
            assert list(got.logprobs) == pytest.approx(list(want.logprobs), abs=TOL)
        # The sampled token's logprob is its entry where it made the list (greedy: always, first).
        for token, logprob, top in zip(decode.tokens, decode.logprobs, decode.top_logprobs):
            if token in top.token_ids:
                assert top.logprobs[top.token_ids.index(token)] == pytest.approx(logprob, abs=1e-6)
            if params.greedy:
                assert top.logprobs[0] == pytest.approx(logprob, abs=1e-6)


def test_colocated_decode_worker_reports_top_logprobs():
    rng = random.Random()
    prompts = [random_prompt(rng, 3, 50) for _ in range(3)]
    ks = [rng.randint(1, MAX_TOP_LOGPROBS) for _ in prompts]

    async def run():
        engine = DecodeEngine(runner(), worker_config("fake"), tokenizer=oracle().tokenizer)
        await engine.start()
        try:
            requests = [GenerateRequest(f"c{i}", tuple(p), SamplingParams(
                temperature=0.0, max_new_tokens=rng.randint(2, 5), ignore_eos=True, top_logprobs_num=k),
                return_logprob=True) for i, (p, k) in enumerate(zip(prompts, ks))]
            return await asyncio.gather(*(collect(engine, r) for r in requests))
        finally:
            await engine.stop()

    for prompt, k, outcome in zip(prompts, ks, asyncio.run(run())):
        assert outcome.ok, outcome.terminal
        assert_top_matches(oracle(), outcome.top_logprobs, outcome.tokens, prompt, k)


def test_a_prefill_peer_without_first_token_top_logprobs_fails_the_request_cleanly():
    rng = random.Random()
    prompt = random_prompt(rng)
    wants = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True,
                           top_logprobs_num=rng.randint(1, MAX_TOP_LOGPROBS))
    old_peer = dataclasses.replace(wants, top_logprobs_num=0)

    async def run():
        async with PDPair("grpc") as pair:
            prefill, decode = await pair.run(prompt, wants, "mismatch", return_logprob=True, prefill_params=old_peer)
            # The pair keeps serving: the next request is whole.
            again = await pair.run(prompt, wants, "after", return_logprob=True)
            pair.assert_pools_clean()
            return prefill, decode, again

    _, decode, (_, again) = asyncio.run(run())
    assert isinstance(decode.terminal, Failed) and decode.terminal.code is FailureCode.INTERNAL
    assert "top logprobs" in decode.terminal.message and decode.tokens == []
    # (The prefill side already had its TransferDone confirmed; what the user sees is decode's error.)
    assert again.ok and len(again.top_logprobs) == len(again.tokens) == 4
