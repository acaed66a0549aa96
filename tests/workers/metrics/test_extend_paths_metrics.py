"""Both workers' /metrics export their runner's extend forwards by path (`extend_forwards_total{path}`,
`ModelRunner.extend_paths`), as the decode worker exports its decode steps.

The real engines behind a real `MetricsServer`, on CPU, with piecewise extend graphs whose pieces run
as plain calls (tests/model/test_extend_graph.py) up to a largest bucket of 64 tokens: PD requests
make the prefill worker extend, colocated ones the decode worker; prompts of at most 64 tokens go
through the graphs, longer ones (one round each: the chunk is larger) run eagerly. Oracle: how many
prompts of each size each worker was sent. Failed before: no such series.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepseek_pd.model.extend_graph import ExtendGraphRunner
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import GenerateRequest
from deepseek_pd.workers.metrics.server import MetricsConfig, MetricsServer
from pdtest.pd_engine_harness import PDPair, collect, runner, worker_config

pytestmark = pytest.mark.timeout(120)
LARGEST_BUCKET = 64


def _graphed_runner() -> ModelRunner:
    model = runner()
    model.extend_graphs = ExtendGraphRunner(model.model, model.kv_pool, LARGEST_BUCKET, model.kv_pool.alloc(1)[0],
                                            capture=False)
    return model


async def _extend_forwards(metrics) -> dict[str, float]:
    exporter = MetricsServer(metrics, MetricsConfig("127.0.0.1", 0))
    port = await exporter.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                text = await response.text()
    finally:
        await exporter.stop()
    return {sample.labels["path"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "deepseek_pd:extend_forwards_total"}


def test_both_workers_export_graphed_and_eager_extends() -> None:
    rng = random.Random()
    config = worker_config("grpc")
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, chunked_prefill_size=256))
    sizes = {"pd": [rng.choice([rng.randint(2, LARGEST_BUCKET), rng.randint(LARGEST_BUCKET + 1, 120)])
                    for _ in range(rng.randint(2, 4))] + [LARGEST_BUCKET, LARGEST_BUCKET + 1],
             "colocated": [rng.randint(2, LARGEST_BUCKET), rng.randint(LARGEST_BUCKET + 1, 120)]}
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)

    async def scenario() -> tuple[dict, dict]:
        async with PDPair("grpc", config, config, runners=(_graphed_runner(), _graphed_runner())) as pair:
            vocab = pair.prefill.runner.model_config.vocab_size
            for i, size in enumerate(sizes["pd"] + sizes["colocated"]):
                prompt = [2 + i] + [rng.randrange(2, vocab) for _ in range(size - 1)]  # no shared prefix
                if i < len(sizes["pd"]):
                    outcomes = await pair.run(prompt, params, f"pd-{i}")
                else:
                    outcomes = [await collect(pair.decode, GenerateRequest(rid=f"co-{i}", input_ids=tuple(prompt),
                                                                           sampling=params))]
                assert all(o.ok for o in outcomes), [o.terminal for o in outcomes]
            return await _extend_forwards(pair.prefill.metrics), await _extend_forwards(pair.decode.metrics)

    prefill, decode = asyncio.run(scenario())

    def expected(prompts: list[int]) -> dict[str, float]:
        graphed = sum(size <= LARGEST_BUCKET for size in prompts)
        return {"cuda_graph": graphed, "eager": len(prompts) - graphed}
    assert prefill == expected(sizes["pd"])
    assert decode == expected(sizes["colocated"])
