"""`speculative_overlap` in the decode worker (workers/decode/engine.py): the model thread launches
step N+1 (before reading step N when the rows stay the same: future_positions.py) and collects step N
in one call, and the event loop streams N's tokens while N+1 runs.
Against the offline engine without speculation (same tiny checkpoint, MTP layer trained so drafts
are accepted): colocated greedy and seeded requests, stop tokens and strings landing inside a
step, max_tokens, logprobs, all the same token for token; an abort mid-stream ends once; the
pools end empty; and steps really overlapped (a collect and a launch in the same call, launches
queued while the step before was unread)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

import pytest

from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.engine.interface import Failed, GenerateRequest
from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.speculative.training import train_mtp
from pdtest.pd_engine_harness import (CHUNK, PAGE_SIZE, abort_after_first_event, collect, device_fails_once_ended,
                                      pages_back, streaming_fails_once_ended, worker_config)

pytestmark = [pytest.mark.timeout(300)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, module_seed):
    rng = random.Random(module_seed)
    path = str(make_tiny_model(tmp_path_factory.mktemp("spec-overlap") / "v3", seed=rng.randrange(1000), mtp_layers=1))
    oracle = Engine(path, page_size=PAGE_SIZE, chunked_prefill_size=CHUNK)
    prompts = [[rng.randrange(2, oracle.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    sequences = [p + r.output_ids for p, r in zip(prompts, oracle.generate_batch(prompts, GREEDY))]
    trained = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3))
    train_mtp(trained, sequences, seconds=8.0)
    return path, oracle, trained, prompts, rng


def _engine(path: str, trained: ModelRunner, oracle: Engine) -> DecodeEngine:
    runner = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3))
    runner.model.mtp.load_state_dict(trained.model.mtp.state_dict())
    config = worker_config("fake")
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, speculative_overlap=True))
    engine = DecodeEngine(runner, config, tokenizer=oracle.tokenizer)
    overlapped = engine.overlapped = [0]
    ahead = engine.ahead = [0]  # launches queued before the step before them was read
    collect_and_launch = engine.speculation.collect_and_launch
    decoder = engine.speculation.decoder
    launch, finish = decoder.launch, decoder.finish
    unread: set[int] = set()

    def counting(pending, rows, *stopped):
        overlapped[0] += pending is not None and bool(rows)
        return collect_and_launch(pending, rows, *stopped)

    def launching(requests, num_steps=None, after=None):
        ahead[0] += bool(unread)
        launched = launch(requests, num_steps, after)
        if launched is not None:
            unread.add(id(launched))
        return launched

    def finishing(launched, *void):
        unread.discard(id(launched))
        return finish(launched, *void)

    engine.speculation.collect_and_launch = counting
    decoder.launch, decoder.finish = launching, finishing
    return engine


def test_overlapped_steps_give_the_offline_tokens(setup):
    path, oracle, trained, prompts, rng = setup
    reference = oracle.generate_batch(prompts, GREEDY)
    params = []
    for r in reference:
        cut = rng.randint(1, len(r.output_ids) - 2)
        params.append(rng.choice([
            GREEDY, dataclasses.replace(GREEDY, max_new_tokens=rng.randint(1, 6)),
            dataclasses.replace(GREEDY, stop_token_ids=(r.output_ids[cut],)),
            dataclasses.replace(GREEDY, stop=(r.text[len(r.text) // 2:][:2],)) if len(r.text) >= 4 else GREEDY,
            SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=12, ignore_eos=True, seed=rng.randrange(1 << 20),
                           frequency_penalty=0.3)]))
    all_prompts, params = prompts * 2, params + [GREEDY] * len(prompts)
    expected = oracle.generate_batch(all_prompts, params)

    async def run():
        engine = _engine(path, trained, oracle)
        await engine.start()
        try:
            outcomes = await asyncio.gather(*(collect(engine, GenerateRequest(f"o{i}", tuple(p), sp, return_logprob=True))
                                              for i, (p, sp) in enumerate(zip(all_prompts, params))))
            await pages_back(engine)
            return outcomes, engine.overlapped[0], engine.ahead[0], engine.speculation.stats
        finally:
            await engine.stop()

    outcomes, overlapped, ahead, stats = asyncio.run(run())
    for outcome, want in zip(outcomes, expected):
        assert outcome.ok and outcome.tokens == want.output_ids
        assert (outcome.terminal.reason, outcome.terminal.matched_stop) == (want.finish_reason, want.matched_stop)
        assert outcome.terminal.completion_tokens == len(want.output_ids)
        assert all(abs(a - b) < 1e-4 for a, b in zip(outcome.logprobs, want.output_logprobs))
    assert overlapped > 0 and stats.accepted > 0
    assert ahead > 0  # step N+1 queued while step N was unread (its positions from the device)


@pytest.mark.parametrize("fails", [None, device_fails_once_ended, streaming_fails_once_ended],
                         ids=["none", "device", "streaming"])
def test_abort_while_a_step_is_pending_ends_once_and_frees_pages(setup, fails):
    """`fails`: the round that collects the aborted request's pending step fails (a device error, or
    a raise while streaming its tokens) after the abort ended it; its pages and draft state must
    still come back. Before: the failure handler did not see the step the round had taken (device),
    and a raise while streaming skipped the step's end, `_done_with` (streaming): they leaked."""
    path, oracle, trained, prompts, _ = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)

    async def run():
        engine = _engine(path, trained, oracle)
        await engine.start()
        try:
            with fails(engine, "long") if fails else contextlib.nullcontext() as raised:
                outcome, (rest,) = await abort_after_first_event(
                    engine, GenerateRequest("long", tuple(prompts[0]), params),
                    GenerateRequest("other", tuple(prompts[1]), params if fails else GREEDY),
                    events=10 if fails else 1)  # (a failure: once both decode, in steps of both)
                await pages_back(engine)
            assert not engine.speculation.decoder._drafts  # their draft state went with them
            assert raised is None or raised == ["other"]  # (streaming: it did raise, on the other's token)
            return outcome, rest
        finally:
            await engine.stop()

    outcome, rest = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code.value == "aborted"
    assert 1 <= len(outcome.tokens) < 400
    if fails:  # the other request ended too: finished before the failure, or failed by it
        assert rest.ok or rest.terminal.code.value == "internal"
    else:
        assert rest.ok and rest.tokens == oracle.generate_batch([prompts[1]], GREEDY)[0].output_ids


def test_rows_stopped_by_a_stop_token_count_in_no_accept_length(setup):
    """A request that stops at a stop token in step N is still a row of step N+1, launched before N
    was read (the model thread knows budgets only). That row verified nothing for anyone: the
    accept-length metric (the decoder's stats, which `/metrics` and the adaptive policy read) counts
    exactly the (step, request) pairs that delivered a token, the oracle counted here from the
    tokens the event loop streamed. Every request stops at a token from the middle of its output."""
    path, oracle, trained, prompts, rng = setup
    reference = oracle.generate_batch(prompts, GREEDY)
    params = [dataclasses.replace(GREEDY, stop_token_ids=(r.output_ids[rng.randint(2, len(r.output_ids) - 3)],))
              for r in reference]
    expected = oracle.generate_batch(prompts, params)

    async def run():
        engine = _engine(path, trained, oracle)
        delivered: set[tuple[int, int]] = set()  # (speculative round, request)
        rounds, inside = [0], [False]  # a prefill round's first tokens are no step's
        speculative_round, accept = engine._speculative_round, engine._accept

        async def counting_round(*args, **kwargs):
            rounds[0] += 1
            inside[0] = True
            try:
                return await speculative_round(*args, **kwargs)
            finally:
                inside[0] = False

        def counting_accept(state, *args):
            if inside[0]:
                delivered.add((rounds[0], id(state)))
            return accept(state, *args)

        engine._speculative_round, engine._accept = counting_round, counting_accept
        await engine.start()
        try:
            outcomes = await asyncio.gather(*(collect(engine, GenerateRequest(f"s{i}", tuple(p), sp))
                                              for i, (p, sp) in enumerate(zip(prompts, params))))
            await pages_back(engine)
            return outcomes, engine.ahead[0], engine.speculation.stats, len(delivered)
        finally:
            await engine.stop()

    outcomes, ahead, stats, delivered = asyncio.run(run())
    for outcome, want in zip(outcomes, expected):
        assert outcome.ok and outcome.tokens == want.output_ids and outcome.terminal.reason == "stop"
    assert ahead > 0
    assert stats.verify_rows == delivered, (stats.verify_rows, delivered)
