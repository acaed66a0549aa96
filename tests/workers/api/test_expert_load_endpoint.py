"""A worker that records expert load (`--engine-opt record_expert_load=true`) serves its rank's
dump at `/expert_load` on the metrics port: the router's own top-k choices, counted in logical
ids, in the format `deepseek-pd eplb plan` reads; CUDA graphs stay off for it; a worker that does
not record answers 404 with the flag to set."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
import torch

from deepseek_pd.model.eplb.load_dump import ExpertLoadDump
from deepseek_pd.model.runner import ExtendSeq
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.workers.serve.builders import build_prefill_engine
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.metrics.server import MetricsConfig, MetricsServer
from deepseek_pd.workers.serve.resolution import ServeFlags, resolve_serve_config

pytestmark = pytest.mark.timeout(120)


def _fetch(metrics: WorkerMetrics) -> tuple[int, dict]:
    """GET /expert_load from a real exporter on a free loopback port."""
    async def main():
        server = MetricsServer(metrics, MetricsConfig("127.0.0.1", 0))
        await server.start()
        try:
            url = f"http://127.0.0.1:{server.bound_port}/expert_load"
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                return response.status, await response.json()
        finally:
            await server.stop()
    return asyncio.run(main())


def _serve(record: bool):
    options = ("record_expert_load=true",) if record else ()
    config = resolve_serve_config(ServeFlags(role="prefill", model="tiny", device="cpu", num_pages=64,
                                             engine_options=options))
    metrics = WorkerMetrics()
    return config, metrics, build_prefill_engine(config, metrics)


def test_a_recording_worker_serves_its_dump(tmp_path):
    rng = random.Random()
    config, metrics, engine = _serve(record=True)
    assert config.runner.record_expert_load and not config.runner.cuda_graph
    runner = engine.runner
    seen = []
    for layer in runner.model.layers:
        if layer.is_moe:
            def spied(scores, bias, spec, _choose=layer.mlp.choose, _row=len(seen)):
                weights, ids = _choose(scores, bias, spec)
                seen[_row].append(ids.clone())
                return weights, ids
            layer.mlp.choose = spied
            seen.append([])
    for _ in range(rng.randint(1, 3)):
        ids = [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))]
        runner.extend([ExtendSeq(ids, 0, runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(ids))))])
    status, body = _fetch(metrics)
    assert status == 200
    (tmp_path / "rank0.json").write_text(json.dumps(body))
    dump = ExpertLoadDump.load(tmp_path / "rank0.json")  # what `eplb plan --dump` reads
    n = runner.model_config.n_routed_experts
    want = [torch.bincount(torch.cat(chosen).reshape(-1), minlength=n).tolist() for chosen in seen]
    assert [list(row) for row in dump.logical_counts] == want


def test_a_worker_that_does_not_record_says_how_to():
    _, metrics, _ = _serve(record=False)
    status, body = _fetch(metrics)
    assert status == 404 and "record_expert_load=true" in body["error"]


def test_recording_keeps_cuda_graphs_off():
    assert "record_expert_load" in (RunnerConfig(device="cuda", record_expert_load=True).cuda_graph_blocker() or "")
