"""The chunked-prefill planner against what its docstring promises, on fresh random queues.

Oracle: replaying the rounds, every prompt is covered exactly once, in order; each round fills
min(budget, tokens left) with prompts served first-come first-served (a later prompt gets tokens
only once every earlier one has all of its tokens planned); `finishing` names exactly the rows a
round completes.
"""
from __future__ import annotations

import random

import pytest

from deepseek_pd.workers.engine.prefill_planner import PromptProgress, plan_extend_batch

pytestmark = pytest.mark.timeout(60)


def _random_queue(rng: random.Random) -> list[PromptProgress[int]]:
    queue = []
    for owner in range(rng.randint(1, 8)):
        tokens = [rng.randrange(1000) for _ in range(rng.randint(1, 50))]
        # A prefix-cache hit starts a prompt part-way through (never complete: the last token is new).
        computed = rng.choice([0, 0, rng.randrange(len(tokens))])
        queue.append(PromptProgress(tokens, pages=[rng.randrange(100) for _ in range(3)], computed=computed,
                                    owner=owner))
    return queue


@pytest.mark.parametrize("trial", range(20))
def test_rounds_cover_every_prompt_exactly_within_the_budget(trial):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    queue = _random_queue(rng)
    budget = rng.randint(1, 64)
    start = {id(item): item.computed for item in queue}
    covered: dict[int, list[int]] = {id(item): list(item.token_ids[:item.computed]) for item in queue}
    for _ in range(10_000):
        left = sum(item.remaining for item in queue)
        if left == 0:
            break
        before = [item.remaining for item in queue]
        plan = plan_extend_batch(queue, budget)
        sizes = [len(seq.token_ids) for seq in plan.seqs]
        assert sum(sizes) == min(budget, left), f"seed {seed}: round does not fill its budget"
        assert all(s > 0 for s in sizes), f"seed {seed}: an empty chunk was planned"
        # First-come first-served: the planned items are the queue's unfinished ones in order, and
        # every item but the last of the round is taken to its end.
        unfinished = [item for item in queue if item.remaining > 0]
        assert plan.items == unfinished[:len(plan.items)], f"seed {seed}: order broken"
        for item, size in zip(plan.items[:-1], sizes):
            assert size == item.remaining, f"seed {seed}: an earlier prompt was cut short"
        for item, seq in zip(plan.items, plan.seqs):
            assert seq.prefix_len == item.computed and seq.pages is item.pages, f"seed {seed}"
            assert list(seq.token_ids) == list(item.token_ids[item.computed:item.computed + len(seq.token_ids)])
            covered[id(item)] += list(seq.token_ids)
        expected_finishing = [row for row, (item, size) in enumerate(zip(plan.items, sizes))
                              if size == item.remaining]
        assert plan.finishing == expected_finishing, f"seed {seed}"
        plan.advance()
        for item, was in zip(queue, before):
            assert item.remaining == was - dict(zip(map(id, plan.items), sizes)).get(id(item), 0)
    else:
        raise AssertionError(f"seed {seed}: the planner never finished the queue")
    for item in queue:
        assert covered[id(item)] == list(item.token_ids), f"seed {seed}: prompt {item.owner} not covered exactly"
        assert item.computed == len(item.token_ids) >= start[id(item)]


def test_docstring_example():
    a = PromptProgress(list(range(10)), pages=[0], owner="A")
    b = PromptProgress(list(range(3)), pages=[1], owner="B")
    first = plan_extend_batch([a, b], 8)
    assert [(i.owner, len(s.token_ids)) for i, s in zip(first.items, first.seqs)] == [("A", 8)]
    assert first.finishing == []
    first.advance()
    second = plan_extend_batch([a, b], 8)
    assert [(i.owner, s.prefix_len, len(s.token_ids)) for i, s in zip(second.items, second.seqs)] == [
        ("A", 8, 2), ("B", 0, 3)]
    assert second.finishing == [0, 1]


@pytest.mark.parametrize("budget", [0, -3])
def test_no_budget_plans_nothing(budget):
    queue = [PromptProgress([1, 2, 3], pages=[0])]
    assert plan_extend_batch(queue, budget).items == []
