"""The per-step draft count (model/speculative/policy.py): expected tokens over measured cost."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.model.speculative.policy import AcceptRate, SpeculationPolicy, StepCosts, expected_tokens
from deepseek_pd.model.speculative.acceptance import AcceptStats


def test_the_docstring_example():
    costs = StepCosts((1, 128), ((10, 40), (11, 75), (12, 110), (13, 145)))
    policy = SpeculationPolicy(costs, 3, AcceptRate(prior=0.8))
    assert [round(expected_tokens(k, 0.8), 2) for k in range(4)] == [1, 1.8, 2.44, 2.95]
    assert policy.steps_for(1) == 3 and policy.steps_for(128) == 0
    assert policy.steps_for(512) == 0  # beyond the table: costs grow in proportion


def test_choice_is_the_argmax_over_random_tables():
    seed = random.randrange(1 << 20)
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(200):
        batches = tuple(sorted(rng.sample(range(1, 300), 4)))
        ms = tuple(tuple(rng.uniform(1, 100) for _ in batches) for _ in range(rng.randint(1, 5)))
        rate = rng.random()
        policy = SpeculationPolicy(StepCosts(batches, ms), rng.randint(0, 6), AcceptRate(prior=rate))
        batch = rng.randint(1, 400)
        k = policy.steps_for(batch)
        limit = min(policy.max_steps, len(ms) - 1)
        score = [expected_tokens(j, rate) / StepCosts(batches, ms).at(batch, j) for j in range(limit + 1)]
        assert 0 <= k <= limit and score[k] == max(score)


def test_cost_interpolation():
    costs = StepCosts((1, 9), ((2.0, 10.0),))
    assert costs.at(1, 0) == 2.0 and costs.at(5, 0) == 6.0 and costs.at(18, 0) == 20.0 and costs.at(0, 0) == 2.0
    for bad in (((), ((1.0,),)), ((2, 1), ((1.0, 1.0),)), ((1,), ((0.0,),)), ((1, 2), ((1.0,),))):
        with pytest.raises(UserError):
            StepCosts(*bad)


def test_accept_rate_starts_at_the_prior_and_follows_the_traffic():
    rate = AcceptRate(prior=0.7, weight=16, decay=0.99)
    assert rate.value == pytest.approx(0.7)
    for _ in range(2000):
        rate.observe(accepted=1, rejected=3)
    assert rate.value == pytest.approx(0.25, abs=0.03)  # the prior's 16 drafts against ~400 decayed ones
    for _ in range(2000):
        rate.observe(accepted=9, rejected=1)
    assert rate.value == pytest.approx(0.9, abs=0.03)


def test_stats_count_the_drafts_the_target_looked_at():
    stats = AcceptStats()
    stats.add(drafted=3, accepted=1, emitted=2)  # d1 accepted, d2 rejected, d3 never compared
    stats.add(drafted=3, accepted=3, emitted=4)  # all accepted, plus the bonus token
    stats.add(drafted=3, accepted=1, emitted=1)  # stopped on d1: d2 never compared
    assert (stats.accepted, stats.rejected) == (5, 1) and stats.accept_rate == pytest.approx(5 / 6)


def test_a_policy_at_no_drafts_probes_and_follows_easier_traffic():
    """A rate learnt on traffic the MTP layer predicts badly makes k = 0 the choice; no step then
    measures a rate, so without a probe the choice would stay 0 when easier traffic comes. After
    `probe_every` undrafted steps one step drafts 1; its accepted draft lifts the rate, and the
    policy drafts again (the traffic here accepts every draft)."""
    seed = random.randrange(1 << 20)
    rng = random.Random(seed)
    probe = rng.randint(2, 12)
    costs = StepCosts((1,), ((10.0,), (11.0,), (12.0,)))
    policy = SpeculationPolicy(costs, 2, AcceptRate(prior=0.01, weight=1.0, decay=0.9), probe_every=probe)
    never = SpeculationPolicy(costs, 2, AcceptRate(prior=0.01, weight=1.0, decay=0.9), probe_every=0)
    choices = []
    for _ in range(3 * probe):
        k = policy.steps_for(1)
        choices.append(k)
        policy.rate.observe(accepted=k, rejected=0)
        assert never.steps_for(1) == 0
    assert choices[:probe] == [0] * probe and choices[probe] == 1, (seed, choices)
    assert choices[-1] == 2 and policy.rate.value > 0.5, (seed, choices)
