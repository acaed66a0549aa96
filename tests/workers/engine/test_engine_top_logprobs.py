"""The offline Engine's top logprobs against full forwards of its own runner (one extend of prompt +
output prefix per position, no sampler: pdtest.gateway_oracle.reference_logprobs), for a batch
whose prompts ask for different k (or none), greedy and temperature-scaled, chunked prefill."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from pdtest.top_logprobs_check import assert_top_matches

pytestmark = pytest.mark.timeout(180)


def test_engine_top_logprobs_equal_full_forwards() -> None:
    rng = random.Random()
    engine = Engine("tiny", page_size=4, chunked_prefill_size=16)
    prompts = [[rng.randrange(2, engine.vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=rng.randint(2, 5), ignore_eos=True,
                             top_logprobs_num=rng.randint(1, MAX_TOP_LOGPROBS)),
              SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True),
              SamplingParams(temperature=rng.choice([0.5, 1.5]), seed=rng.randrange(2**30), max_new_tokens=4,
                             ignore_eos=True, top_logprobs_num=rng.randint(1, MAX_TOP_LOGPROBS)),
              SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, top_logprobs_num=MAX_TOP_LOGPROBS)]
    results = engine.generate_batch(prompts, params)
    for prompt, p, result in zip(prompts, params, results):
        if p.top_logprobs_num == 0:
            assert result.output_top_logprobs == []
            continue
        assert_top_matches(engine, result.output_top_logprobs, result.output_ids, prompt, p.top_logprobs_num,
                           1.0 if p.greedy else p.temperature)
        assert engine.runner.kv_pool.num_used_pages == 0
