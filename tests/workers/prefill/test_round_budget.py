"""`RoundBudget`: prefill rounds sized to a target time from measured rounds (decode sharing the GPU).

Oracle: a simulated GPU whose round time is overhead + tokens x a per-token cost that changes
(decode's load comes and goes); the budget must bring rounds to the target within a few rounds and
stay inside [min_tokens, chunked_prefill_size].
"""
from __future__ import annotations

import random

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
from deepseek_pd.workers.prefill.round_budget import TOKEN_QUANTUM, RoundBudget, RoundBudgetConfig


def test_off_is_the_chunk_whatever_was_measured():
    rng = random.Random()
    chunk = rng.randrange(1, 20000)
    budget = RoundBudget(RoundBudgetConfig(chunk))
    for _ in range(10):
        budget.observe(rng.randrange(1, chunk + 1), rng.uniform(1e-4, 1.0))
        assert budget.tokens() == chunk


def test_rounds_converge_to_the_target_and_follow_the_load():
    rng = random.Random()
    chunk, target = 8192, rng.uniform(0.02, 0.05)
    budget = RoundBudget(RoundBudgetConfig(chunk, target, min_tokens=256))
    assert budget.tokens() == chunk  # nothing measured yet
    for per_token in (rng.uniform(5e-6, 1e-5), rng.uniform(2e-5, 4e-5)):  # decode idle, then busy
        for _ in range(15):
            tokens = budget.tokens()
            assert 256 <= tokens <= chunk and (tokens == chunk or tokens % TOKEN_QUANTUM == 0 or tokens == 256)
            budget.observe(tokens, tokens * per_token)
        expected = min(chunk, max(256, int(target / per_token) // TOKEN_QUANTUM * TOKEN_QUANTUM))
        assert abs(budget.tokens() - expected) <= TOKEN_QUANTUM
        assert budget.tokens() * per_token <= target * 1.05 or budget.tokens() == 256


def test_the_floor_and_the_ceiling_hold():
    budget = RoundBudget(RoundBudgetConfig(4096, 0.03, min_tokens=512))
    budget.observe(100, 10.0)  # a very slow GPU: the floor
    assert budget.tokens() == 512
    fast = RoundBudget(RoundBudgetConfig(4096, 0.03, min_tokens=512))
    fast.observe(4096, 1e-6)  # a very fast one: the chunk
    assert fast.tokens() == 4096


def test_deterministic_scheduling_refuses_a_time_sized_round():
    with pytest.raises(UserError, match="prefill_round_target_ms"):
        SchedulerConfig(deterministic=True, prefix_cache=False, prefill_round_target_ms=30)
    with pytest.raises(UserError, match=">= 0"):
        SchedulerConfig(prefill_round_target_ms=-1)
