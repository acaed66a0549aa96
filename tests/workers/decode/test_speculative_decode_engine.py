"""Speculative decoding in the decode worker (workers/decode/speculative_step.py) against the
offline engine without speculation (same tiny checkpoint with an MTP layer, fp32, CPU):
colocated requests, greedy and seeded sampling, equal token for token with the tiny MTP layer
trained so drafts are accepted; PD requests when both workers hold the MTP layer; a prefill
without it is refused at the handshake (the KV layouts differ by the MTP layer); the pools end empty."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from deepseek_pd.model.engine import Engine
from deepseek_pd.model.runner import ModelRunner, RunnerConfig
from deepseek_pd.model.sampling_params import SamplingParams
from deepseek_pd.model.tiny import make_tiny_model
from deepseek_pd.workers.common.api import DisaggParams, Failed, GenerateRequest
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest.mtp_training import train_mtp
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, collect, worker_config

pytestmark = [pytest.mark.timeout(300)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    seed = random.randrange(1000)
    print(f"seed={seed}")
    path = str(make_tiny_model(tmp_path_factory.mktemp("spec-worker") / "v3", seed=seed, mtp_layers=1))
    oracle = Engine(path, page_size=PAGE_SIZE, chunked_prefill_size=CHUNK)
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, oracle.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    sequences = [p + r.output_ids for p, r in zip(prompts, oracle.generate_batch(prompts, GREEDY))]
    trained = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3))
    accuracy, steps = train_mtp(trained, sequences, seconds=15.0)
    print(f"MTP training: {steps} steps, accuracy {accuracy:.3f}")
    return path, oracle, trained, prompts, rng


def _spec_runner(path: str, trained: ModelRunner) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3))
    runner.model.mtp.load_state_dict(trained.model.mtp.state_dict())
    return runner


def test_colocated_speculative_equals_offline(setup):
    path, oracle, trained, prompts, rng = setup
    extra = [[rng.randrange(2, oracle.vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    params = [GREEDY] * (len(prompts) + len(extra))
    params += [SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=12, ignore_eos=True, seed=rng.randrange(1 << 20))
               for _ in prompts]
    params += [dataclasses.replace(GREEDY, max_new_tokens=rng.randint(1, 5)) for _ in extra]
    all_prompts = (prompts + extra) * 2
    expected = oracle.generate_batch(all_prompts, params)

    async def run():
        engine = DecodeEngine(_spec_runner(path, trained), worker_config("fake"), tokenizer=oracle.tokenizer)
        await engine.start()
        try:
            outcomes = await asyncio.gather(*(collect(engine, GenerateRequest(f"c{i}", tuple(p), sp, return_logprob=True))
                                              for i, (p, sp) in enumerate(zip(all_prompts, params))))
            assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0
            return outcomes, engine.speculation.stats
        finally:
            await engine.stop()

    outcomes, stats = asyncio.run(run())
    for outcome, want in zip(outcomes, expected):
        assert outcome.ok and outcome.tokens == want.output_ids
        assert all(abs(a - b) < 1e-4 for a, b in zip(outcome.logprobs, want.output_logprobs))
    print(f"worker accept length {stats.accept_length:.2f} ({dict(sorted(stats.histogram.items()))})")
    assert stats.accept_length > 1.3


def _pd(prefill_runner: ModelRunner, decode_runner: ModelRunner, oracle: Engine, prompts, transport: str):
    async def run():
        prefill = PrefillEngine(prefill_runner, worker_config(transport))
        decode = DecodeEngine(decode_runner, worker_config(transport), tokenizer=oracle.tokenizer)
        await prefill.start()
        await decode.start()
        try:
            outcomes = []
            for i, prompt in enumerate(prompts):
                disagg = DisaggParams("127.0.0.1", prefill.bootstrap_port, 5000 + i)
                base = GenerateRequest(rid=f"r{i}", input_ids=tuple(prompt), sampling=GREEDY, disagg=disagg)
                outcomes.append(await asyncio.gather(collect(prefill, dataclasses.replace(base, rid=f"r{i}-p")),
                                                     collect(decode, dataclasses.replace(base, rid=f"r{i}-d"))))
            for _ in range(100):
                if decode.pool.num_used_pages == 0:
                    break
                await asyncio.sleep(0.05)
            assert decode.pool.num_used_pages == 0 and decode.budget.reserved == 0
            return outcomes
        finally:
            await decode.stop()
            await prefill.stop()
    return asyncio.run(run())


@pytest.mark.parametrize("transport", ["fake", "grpc"])
def test_pd_with_mtp_on_both_sides_equals_offline(setup, transport):
    path, oracle, trained, prompts, _ = setup
    expected = oracle.generate_batch(prompts, GREEDY)
    prefill_runner = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3))
    for (p_out, d_out), want in zip(_pd(prefill_runner, _spec_runner(path, trained), oracle, prompts, transport),
                                    expected):
        assert p_out.ok and d_out.ok, (p_out.terminal, d_out.terminal)
        assert d_out.tokens == want.output_ids


def test_prefill_without_the_mtp_layer_is_refused(setup):
    path, oracle, trained, prompts, _ = setup
    plain = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256))
    (p_out, d_out), = _pd(plain, _spec_runner(path, trained), oracle, prompts[:1], "grpc")
    assert isinstance(d_out.terminal, Failed) and isinstance(p_out.terminal, Failed)
    print(d_out.terminal.message)
    assert "layers=5" in d_out.terminal.message and "--speculative-num-steps" in d_out.terminal.message
