"""A worker that is a group of ranks: `serve --dp N --ep N` on CPU (gloo, tiny model), end to end.

The oracle is the single-process offline engine: the group's greedy tokens, through rank 0's real
SglangScheduler servicer, must equal it for a batch of fresh random prompts (several chunks long,
streaming and unary), with DP attention (requests spread over the ranks, each rank's KV its own)
and the routed experts spread over every rank (the all_to_all dispatcher).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from group_harness import GroupWorker, generate_all, offline_greedy

pytestmark = [pytest.mark.slow]

VOCAB = 256  # the tiny model's vocabulary is larger; stay in its byte range


def _prompts(rng: random.Random, count: int) -> tuple[list[list[int]], list[int]]:
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(count)]
    return prompts, [rng.randint(1, 8) for _ in range(count)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [["--dp", "2", "--ep", "2"], ["--tp", "2", "--dp", "2", "--ep", "4"]],
                         ids=["dp2-ep2", "tp2-dp2-ep4"])
def test_group_equals_offline_engine(tmp_path, layout) -> None:
    rng = random.Random()
    prompts, max_new = _prompts(rng, rng.randint(5, 7))
    want = offline_greedy(prompts, max_new)
    with GroupWorker("decode", layout, tmp_path / "group.log") as worker:
        asyncio.run(worker.wait_healthy())
        got = asyncio.run(generate_all(worker.address, prompts, max_new))
        assert got == want, worker.log_tail()
