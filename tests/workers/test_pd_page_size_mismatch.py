"""Prefill and decode at different KV page sizes, through the real bootstrap service on 127.0.0.1
(tiny model, CPU, the grpc transport): what a user gets who gives `--page-size` to one role only,
where the two defaults differ (model/kv/page_size.py: 64 where FlashMLA runs, else 16).

The transfer moves whole pages of one layout and does not re-page, so each request ends, on both
sides, with exactly one INVALID_ARGUMENT naming both page sizes and what to do; no KV byte is
copied, every page comes back, and the pair still serves a request it can (the oracle: the offline
engine's greedy tokens, from a decode worker paired with a prefill of its own page size).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Failed, FailureCode
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest.pd_engine_harness import PDPair, collect, oracle, worker_config

pytestmark = [pytest.mark.timeout(120)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _runner(page_size: int) -> ModelRunner:
    return ModelRunner(RunnerConfig(model="tiny", page_size=page_size, num_pages=4096 // page_size))


def test_prefill_and_decode_at_different_page_sizes_fail_each_request_clearly():
    prefill_page, decode_page = random.sample([4, 16, 64], 2)
    prompt = [random.randrange(2, oracle().vocab_size) for _ in range(random.randint(3, 90))]

    async def run():
        decode_runner = _runner(decode_page)
        async with PDPair("grpc", runners=(_runner(prefill_page), decode_runner)) as pair:
            before = [buffer.clone() for buffer in pair.decode.pool.buffers]
            prefill, decode = await pair.run(prompt, GREEDY, "mismatch")
            await pair.wait_pools_clean()
            untouched = all(bool((b == a).all()) for b, a in zip(pair.decode.pool.buffers, before))
            # The same decode worker, asked with a prefill of its own page size, serves the prompt.
            same = PrefillEngine(_runner(decode_page), worker_config("grpc"))
            await same.start()
            try:
                p_req, d_req = pair.requests(prompt, GREEDY, "matched", prefill=same)
                matched = await asyncio.gather(collect(same, p_req), collect(pair.decode, d_req))
            finally:
                await same.stop()
            await pair.wait_pools_clean()
            return prefill, decode, untouched, matched

    prefill, decode, untouched, (matched_p, matched_d) = asyncio.run(run())
    for side in (prefill, decode):
        assert isinstance(side.terminal, Failed) and side.terminal.code == FailureCode.INVALID_ARGUMENT, side.terminal
        assert not side.tokens
    message = decode.terminal.message
    assert "decode has layers=" in message and f"page_size={decode_page}" in message, message
    assert f"page_size={prefill_page}" in message, message
    assert "give both the same --page-size (unset, it is 64 where FlashMLA" in message, message
    assert untouched, "a KV byte reached the decode pool across mismatched layouts"
    assert matched_p.ok and matched_d.ok, (matched_p.terminal, matched_d.terminal)
    assert matched_d.tokens == oracle().generate(prompt, GREEDY).output_ids
