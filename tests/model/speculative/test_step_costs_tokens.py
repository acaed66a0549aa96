"""The speculative step-cost table (model/speculative/step_costs.py `measure_step_costs`, what the
per-step policy chooses from) is timed on varied tokens: with one token at every position every row
routes to the same experts, and the MoE's cost of a larger verify went uncounted (on an H100 a k = 2
step at batch 32 timed below a plain decode step). Oracle: the tokens the runner was given. And
`calibrated_policy` fits its context to the pool."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.speculative.step_costs import measure_step_costs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_cost_table_is_timed_on_varied_tokens(tiny_mtp_checkpoint, monkeypatch):
    runner = ModelRunner(RunnerConfig(model=str(tiny_mtp_checkpoint), device="cpu", dtype="float32", page_size=4,
                                      num_pages=64, speculative_num_steps=2))
    verifies: list[list[list[int]]] = []
    extend_hidden = runner.extend_hidden

    def recorded(seqs, *args, **kwargs):
        verifies.append([list(seq.token_ids) for seq in seqs])
        return extend_hidden(seqs, *args, **kwargs)

    monkeypatch.setattr(runner, "extend_hidden", recorded)
    costs = measure_step_costs(runner, [1, 4], 2, context=8, repeats=1)
    assert len(costs.ms) == 3 and all(ms > 0 for row in costs.ms for ms in row)
    widest = [ids for ids in verifies if len(ids) == 4 and len(ids[0]) == 3]
    assert widest, verifies
    tokens = [token for ids in widest[0] for token in ids]
    # 12 positions drawn from the tiny vocabulary: far more than one distinct token
    assert len(set(tokens)) > len(tokens) // 2, tokens


def test_a_small_pool_times_a_shorter_context(tiny_mtp_checkpoint):
    """`calibrated_policy` on a pool too small for one sequence of the asked context times batch 1
    over the context the pool holds (it raised KVPoolExhausted); a pool that holds no step at all
    is a clear error."""
    from deepseek_pd.errors import UserError
    from deepseek_pd.model.speculative.step_costs import calibrated_policy

    pages = random.randint(3, 6)
    runner = ModelRunner(RunnerConfig(model=str(tiny_mtp_checkpoint), page_size=4, num_pages=pages,
                                      speculative_num_steps=2))
    policy = calibrated_policy(runner, 2, max_batch=8, context=256, repeats=1)
    assert policy.costs.batches == (1,) and policy.costs.max_steps == 2
    assert runner.kv_pool.num_free_pages == pages
    runner.kv_pool.alloc(pages)
    with pytest.raises(UserError, match="cannot hold"):
        calibrated_policy(runner, 2, max_batch=8)
