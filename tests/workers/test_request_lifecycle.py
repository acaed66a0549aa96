"""The request lifecycle both engines share (workers/engine/request_lifecycle.py), on each role.

Oracles: check_prompt's own message for a bad prompt; the offline `Engine` for the tokens of a
request that a duplicate id must leave untouched; the pool and the request table for cleanup.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.request_rules import check_prompt
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, FailureCode, GenerateRequest, TokenChunk
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest.pd_engine_harness import collect, oracle, runner, worker_config

pytestmark = pytest.mark.timeout(120)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(3, 30))]


def _engine(role: str):
    if role == "prefill":
        return PrefillEngine(runner(), worker_config("grpc"))
    return DecodeEngine(runner(), worker_config("grpc"), tokenizer=oracle().tokenizer)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_bad_prompt_gets_the_shared_rule_message(role):
    rng = random.Random()
    vocab = oracle().vocab_size
    prompt = _prompt(rng)
    prompt[rng.randrange(len(prompt))] = vocab + rng.randrange(50)
    with pytest.raises(UserError) as want:
        check_prompt(prompt, vocab, oracle().model_config.max_position_embeddings)
    disagg = DisaggParams("127.0.0.1", 1, rng.randrange(1 << 30)) if role == "prefill" else None

    async def run():
        engine = _engine(role)
        await engine.start()
        try:
            request = GenerateRequest(rid="bad", input_ids=tuple(prompt),
                                      sampling=SamplingParams(max_new_tokens=4), disagg=disagg)
            return await collect(engine, request), dict(engine._requests)
        finally:
            await engine.stop()

    outcome, table = asyncio.run(run())
    assert outcome.terminal == Failed(FailureCode.INVALID_ARGUMENT, str(want.value)) and not table


def test_prefill_refuses_a_duplicate_id_and_abort_ends_the_first():
    """The first request waits for a decode handshake that never comes; the second with its id is
    refused at once; abort then ends the first with ABORTED, and nothing is left behind."""
    rng = random.Random()

    async def run():
        engine = _engine("prefill")
        await engine.start()
        try:
            request = GenerateRequest(rid="same", input_ids=tuple(_prompt(rng)),
                                      sampling=SamplingParams(max_new_tokens=4),
                                      disagg=DisaggParams("127.0.0.1", engine.bootstrap_port, rng.randrange(1 << 30)))
            first = asyncio.create_task(collect(engine, request))
            while "same" not in engine._requests:
                await asyncio.sleep(0.01)
            second = await collect(engine, request)
            assert await engine.abort("same") and not await engine.abort("unknown")
            return await first, second, engine.registry.num_active, engine.pool.num_used_pages
        finally:
            await engine.stop()

    first, second, rooms, used = asyncio.run(run())
    assert second.terminal == Failed(FailureCode.INVALID_ARGUMENT, "request id 'same' is already running")
    assert isinstance(first.terminal, Failed) and first.terminal.code is FailureCode.ABORTED
    assert rooms == 0 and used == 0


def test_decode_refuses_a_duplicate_id_without_disturbing_the_first():
    rng = random.Random()
    prompt = _prompt(rng)
    params = SamplingParams(temperature=0.0, max_new_tokens=rng.randrange(3, 9), ignore_eos=True)
    request = GenerateRequest(rid="same", input_ids=tuple(prompt), sampling=params)

    async def run():
        engine = _engine("decode")
        await engine.start()
        seconds = []

        async def on_event(event):
            if isinstance(event, TokenChunk) and not seconds:  # the first request is running now
                seconds.append(await collect(engine, request))

        try:
            return await collect(engine, request, on_event), seconds[0], engine.pool.num_used_pages
        finally:
            await engine.stop()

    first, second, used = asyncio.run(run())
    assert second.terminal == Failed(FailureCode.INVALID_ARGUMENT, "request id 'same' is already running")
    assert first.ok and first.tokens == oracle().generate(prompt, params).output_ids
    assert used == 0
