"""bench/prefill_host_overhead.py on a GPU (tiny model): the worker's round adds exactly one host wait
(its first tokens' copy) to the runner's extend, at every stage, and no cudaMalloc retries; the
CPU path is tests/bench/test_prefill_host_overhead_script.py."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.bench_scripts import bench_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]


def test_the_round_adds_one_wait_and_no_allocator_retry() -> None:
    rng = random.Random()
    result = bench_module("prefill_host_overhead").main(
        ["--model", "tiny", "--device", "cuda", "--tokens", str(rng.randint(16, 300)), "--repeats", "2",
         "--engine-requests", "3", "--busy-cap-s", "1", "--seed", str(rng.randrange(1 << 30))])
    counts = result["device_counts"]
    assert set(counts) == {stage for stage in result["seconds"] if not stage.startswith("busy")}
    for stage in ("first_token", "round_clock", "layer_events", "model_thread"):
        assert counts[stage]["syncs"] == counts["runner"]["syncs"] + 1, (stage, counts)
    assert all(row["num_alloc_retries"] == 0 for row in counts.values()), counts
    assert result["engine"]["engine_ratio"] > 0
