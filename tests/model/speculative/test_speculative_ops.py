"""A speculative step's eager ops outside its forwards (bench/speculative_ops.py): each is a CUDA
kernel launch beside the step's graph replays, and on an H100 they cost the step more than its
draft forwards (6.57 ms a step against 4.90 ms of replays at batch 1, k = 2, 2026-12-07).

In the common step (every row drafting k, the rows those of the last catch-up) the decoder takes
the catch-up's tensors as they are and gathers nothing per row: the count is a constant plus what
each extra draft step needs (its argmax, its LM head, and launched ahead its start positions), and
does not grow with the batch past 2 (a reshape is a view at batch 1 only). Before the cut (per-row
stacks and index copies of the drafts, the verify's and the catch-up's row gathers, the host copy's
packing, greedy rows' noise and top-k tables) a step ran 46 + 7 (k - 1) ops in order and
49 + 10 (k - 1) launched ahead at batch 1 (4 more at batch 4); after it 29 + 2 (k - 1) and
31, 33, 36 for k = 1, 2, 3 (2 more at batch 4).
"""
from __future__ import annotations

import json
import random

import pytest

from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.bench_scripts import bench_module

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def bound(k: int) -> int:
    """Most eager ops a step drafting k may run outside its forwards (between after and before)."""
    return 38 + 3 * (k - 1)


def test_a_common_step_runs_a_bounded_number_of_eager_ops_at_any_batch(tiny_mtp_checkpoint, module_seed, tmp_path):
    rng = random.Random(module_seed)
    bench = bench_module("speculative_ops")
    k, page, context, batch = rng.randint(1, 3), 16, rng.randint(5, 40), rng.randint(2, 5)
    runner = ModelRunner(RunnerConfig(model=str(tiny_mtp_checkpoint), device="cpu", dtype="float32", page_size=page,
                                      num_pages=bench.pages_needed(batch, k, context, 3, page),
                                      speculative_num_steps=k))
    counts = {batch: bench.count_step_ops(runner, batch, k, context, seed=rng.randrange(1 << 20))}
    # Batch 1 through the script's command line, with its phase times.
    out = tmp_path / "ops.json"
    counts[1] = bench.main(["--model", str(tiny_mtp_checkpoint), "--page-size", str(page), "--context", str(context),
                            "--batch", "1", "--steps", str(k), "--time-steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(counts[1]))
    ms = counts[1].pop("ms")
    assert set(ms) == {*bench.PHASES, "forwards"} and all(t >= 0 for t in ms.values()) and ms["forwards"] > 0
    for b, by_mode in counts.items():
        for mode, got in by_mode.items():
            assert got["forwards"] == {"draft": k, "verify": 1}  # k - 1 chain steps and the catch-up
            assert got["total"] <= bound(k), (b, k, mode, got["ops"], got["names"])
