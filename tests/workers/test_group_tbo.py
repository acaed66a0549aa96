"""Two-batch overlap inside a group's lockstep thread, with the experts spread over the ranks.

A decode group (dp 2, ep 2, colocated: it runs the chunked prompts and the decode steps) with
`enable_tbo` gets enough concurrent requests that every rank has batches to split; its greedy
tokens must equal the single-process offline engine's (which runs without TBO). The log line of
the first split shows the overlapped path ran, and not only its fallback. `--deepep-mode auto`:
the prompts' extend steps run the normal EP layout, the decode steps the low-latency (masked,
fixed-capacity) one, whose capacity `serve` sizes from max_running_requests.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from pdtest.group_harness import GroupWorker, generate_all, offline_greedy

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(300)
def test_tbo_in_a_group_equals_the_offline_engine_without_tbo(tmp_path) -> None:
    rng = random.Random()
    count = rng.randint(8, 12)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 40))] for _ in range(count)]
    max_new = [rng.randint(3, 10) for _ in range(count)]
    want = offline_greedy(prompts, max_new)
    with GroupWorker("decode", ["--dp", "2", "--ep", "2", "--deepep-mode", "auto", "--engine-opt=enable_tbo=true",
                                "--engine-opt=max_running_requests=16"],
                     tmp_path / "group.log") as worker:
        asyncio.run(worker.wait_healthy())
        got = asyncio.run(generate_all(worker.address, prompts, max_new))
        assert got == want, worker.log_tail()
        log = worker.log_path.read_text()
        assert "two-batch overlap: split" in log, worker.log_tail()
        assert "low-latency EP capacity: 16 tokens per rank" in log, worker.log_tail()
