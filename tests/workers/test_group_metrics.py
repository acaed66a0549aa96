"""A multi-rank worker's metrics: one port per rank (`--metrics-port P` -> rank r on P + r), each
labelled with its rank, requests counted once (by rank 0, the group's servicer), the ranks' steps
adding up to the tokens the group was sent and produced.

Real processes (`serve decode --dp 2 --ep 2`, gloo, the tiny model), colocated requests through
rank 0's SglangScheduler; the oracle is the client's own record of prompts and output tokens.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from deepseek_pd.ports import pick_free_port_blocks
from pdtest.group_harness import GroupWorker
from pdtest.rank_metrics import scrape, value
from smg_grpc_proto import sglang_scheduler_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_each_rank_serves_its_own_metrics_and_requests_are_counted_once(tmp_path):
    rng = random.Random()
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 40))] for _ in range(rng.randint(4, 7))]
    max_new = [rng.randint(1, 6) for _ in prompts]
    port = pick_free_port_blocks([2])[0]
    with GroupWorker("decode", ["--dp", "2", "--ep", "2", "--metrics-port", str(port)],
                     tmp_path / "group.log") as worker:
        asyncio.run(worker.wait_healthy())

        async def traffic():
            async with SchedulerClient(worker.address) as client:
                async def one(i):
                    request = pb.GenerateRequest(request_id=f"m{i}", tokenized=pb.TokenizedInput(input_ids=prompts[i]),
                                                 sampling_params=sampling_proto(max_new[i], ignore_eos=True),
                                                 stream=bool(i % 2))
                    ids, _ = await collect(client.generate(request, 120))
                    return ids
                return await asyncio.gather(*(one(i) for i in range(len(prompts))))

        outputs = asyncio.run(traffic())
        (ranks0, r0), (ranks1, r1) = scrape(port), scrape(port + 1)
    assert [len(o) for o in outputs] == max_new
    assert ranks0 == {"0"} and ranks1 == {"1"}
    n = len(prompts)
    assert value(r0, "num_requests_total", finish_reason="length") == n  # rank 0's servicer: the group's
    # Concurrent requests go to the least-loaded rank, so rank 1 ran some of them: not counted again there.
    assert value(r1, "step_tokens_total", mode="prefill") > 0
    assert value(r1, "num_requests_total", finish_reason="length") == 0
    assert value(r0, "generation_tokens_total") == sum(map(len, outputs))
    both = (r0, r1)
    assert sum(value(r, "step_tokens_total", mode="prefill") for r in both) == sum(map(len, prompts))
    assert sum(value(r, "step_tokens_total", mode="decode") for r in both) == sum(max_new) - n
    # Each rank's engine times the gaps of the requests it ran: together, one per token after the first.
    assert sum(value(r, "inter_token_latency_seconds_count") for r in both) == sum(len(o) - 1 for o in outputs)
    for r in both:
        assert value(r, "decode_steps_total", path="eager") == value(r, "step_seconds_count", mode="decode")
        assert value(r, "kv_pool_used_pages") == 0 and value(r, "kv_pool_total_pages") == 512
