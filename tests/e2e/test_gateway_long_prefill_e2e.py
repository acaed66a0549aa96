"""A single prefill that takes longer than smg 1.13's PD "silence bound" is given up on.

Found while testing retries (2026-12-03): smg 1.13 gives up on a PD prefill leg that "produced
nothing within its silence bound, and its worker answered no other leg within it" and answers 504
`prefill_worker_silent` (the bound was 3-8.5 s in these runs). Our prefill worker sends nothing on
its Generate stream until the first token, i.e. until the whole prompt is prefilled, so one long
prompt on an otherwise idle prefill worker fails; with retries on it is prefilled again up to five
times. Here a 2,400-token prompt at an 8-token prefill chunk (~9 s on this CPU) shows it; on a GPU
a 100k-token prompt would. Strict xfail: when the workers report progress in a way smg accepts
(or smg drops the bound), this passes, fails the run, and the marker must go.
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


@pytest.mark.xfail(strict=True, reason="smg 1.13 answers 504 prefill_worker_silent to a prefill longer "
                                       "than its silence bound (see the module docstring)")
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
