"""`--deterministic` end to end: PD at concurrency 16 gives the offline engine's greedy tokens, one
prompt at a time, in fp32 and bf16, over a seeded random mix of prompt lengths (chunked ones too).

Oracle: the offline `Engine` with the same flag and chunk size, each prompt alone.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, PDPair, worker_config

pytestmark = [pytest.mark.timeout(600)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _config(dtype: str):
    base = worker_config("grpc")
    return dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, deterministic=True,
                                                                    prefix_cache=False))


ON_GPU = pytest.param("cuda", "bfloat16", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "bfloat16"), ON_GPU])
def test_pd_concurrency_16_equals_offline_one_at_a_time(device, dtype, monkeypatch):
    """On the GPU: the Triton backends with the batch-invariant kernels, bf16 (issue 25's case)."""
    rng = random.Random()
    offline = Engine("tiny", page_size=PAGE_SIZE, chunked_prefill_size=CHUNK, dtype=dtype, device=device,
                     deterministic=True)
    vocab = offline.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(1, 3 * CHUNK))] for _ in range(16)]
    expected = [offline.generate(p, GREEDY).output_ids for p in prompts]

    import pdtest.pd_engine_harness as harness
    monkeypatch.setattr(harness, "runner", lambda num_pages=256, device="cpu": ModelRunner(RunnerConfig(
        model="tiny", page_size=PAGE_SIZE, num_pages=num_pages, dtype=dtype, device=device, deterministic=True)))

    async def run():
        async with PDPair("grpc", prefill_config=_config(dtype), decode_config=_config(dtype), device=device) as pair:
            return await asyncio.gather(*(pair.run(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)))

    outcomes = asyncio.run(run())
    for i, (prefill, decode) in enumerate(outcomes):
        assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
        assert decode.tokens == expected[i], f"prompt {i} ({len(prompts[i])} tokens): PD {decode.tokens} != {expected[i]}"
