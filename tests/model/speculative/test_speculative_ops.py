"""A speculative step's eager ops outside its forwards (bench/speculative_ops.py): each is a CUDA
kernel launch beside the step's graph replays, and on an H100 they cost the step more than its
draft forwards (6.57 ms a step against 4.90 ms of replays at batch 1, k = 2, 2026-12-07).

In the common step (every row drafting k, the rows those of the last catch-up) the decoder takes
the catch-up's tensors as they are and gathers nothing per row: the count is a constant plus what
each extra draft step needs (its argmax, its LM head, and launched ahead its start positions), the
same at every batch size. Before the cut (per-row stacks and index copies of the drafts, the
verify's and the catch-up's row gathers, the host copy's packing) a step ran 41 + 7 (k - 1) ops in
order and 44 + 10 (k - 1) launched ahead; after it 27 + 2 (k - 1), and 29, 31, 34 for k = 1, 2, 3.
"""
from __future__ import annotations

import random

import pytest

from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.bench_scripts import bench_module

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def bound(k: int) -> int:
    """Most eager ops a step drafting k may run outside its forwards (between after and before)."""
    return 34 + 4 * (k - 1)


def test_a_common_step_runs_a_bounded_number_of_eager_ops_at_any_batch(tiny_mtp_checkpoint, module_seed):
    rng = random.Random(module_seed)
    bench = bench_module("speculative_ops")
    k, page, context = rng.randint(1, 3), 16, rng.randint(5, 40)
    batches = [1, rng.randint(2, 5)]
    longest = context + 4 * (k + 1) + 2
    runner = ModelRunner(RunnerConfig(model=str(tiny_mtp_checkpoint), device="cpu", dtype="float32", page_size=page,
                                      num_pages=max(batches) * -(-longest // page) + 2, speculative_num_steps=k))
    counts = {b: bench.count_step_ops(runner, b, k, context, seed=rng.randrange(1 << 20)) for b in batches}
    for b, by_mode in counts.items():
        for mode, got in by_mode.items():
            assert got["forwards"] == {"draft": k, "verify": 1}  # k - 1 chain steps and the catch-up
            assert got["total"] <= bound(k), (b, k, mode, got["ops"], got["names"])
    # The count does not grow with the batch: nothing is gathered row by row.
    assert {m: c["ops"] for m, c in counts[batches[0]].items()} == {m: c["ops"] for m, c in counts[batches[1]].items()}
