"""A single prefill that takes longer than smg 1.13's default PD "silence bound" completes.

Found while testing retries (2026-12-03): smg gives up on a PD prefill leg that produced nothing
within --worker-wedge-secs (default 3 s, stretched by measured throughput) and answers 504
`prefill_worker_silent`. Our prefill worker sends nothing on its Generate stream until the first
token, so one long prompt on an idle prefill worker failed (3-8.5 s bounds seen). Both launchers
now pass gateway.WEDGE_ARGS (30 s). Here a 2,400-token prompt at an 8-token prefill chunk (~9 s
on this CPU) must complete with the offline engine's tokens; it failed before.
"""
from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from deepseek_pd.launcher.cluster import LocalCluster
from pdtest.e2e_cluster import cluster_spec
from pdtest.gateway_oracle import offline_engine, offline_greedy, post_json

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def test_one_long_prefill_on_an_idle_worker_completes(tmp_path) -> None:
    rng = random.Random()
    prompt = [rng.randrange(3, 400) for _ in range(2400)]
    want, _ = offline_greedy(offline_engine(), prompt, 4)
    spec = cluster_spec(tmp_path, extra_worker_args=("--chunked-prefill-size=8",))
    with LocalCluster(spec) as cluster:
        async def main():
            async with aiohttp.ClientSession() as session:
                return await post_json(session, f"{cluster.router_url}/generate", {
                    "model": cluster.served_model_name, "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
        reply = asyncio.run(main())
    assert reply.status == 200, reply.text
    assert reply.body[0]["output_ids"] == want
