"""The request rules every entry point applies (workers/engine/request_rules.py), on fresh random inputs.

Oracles: a prompt passes exactly when it is non-empty, every id is an int in [0, vocab) and it
leaves room for one new token; the output budget is the largest that is <= the request's own and
keeps prompt + output inside the context; the KV slots are counted by replaying a generation.
"""
from __future__ import annotations

import random

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.request_rules import check_prompt, kv_tokens_needed, max_new_tokens
from deepseek_pd.model.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def _valid(ids, vocab: int, max_context: int) -> bool:
    return (len(ids) > 0 and len(ids) < max_context
            and all(type(t) is int and 0 <= t < vocab for t in ids))


@pytest.mark.parametrize("trial", range(30))
def test_check_prompt_refuses_exactly_the_bad_prompts(trial):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    vocab, max_context = rng.randint(2, 500), rng.randint(2, 40)
    ids: list = [rng.randrange(vocab) for _ in range(rng.randint(0, max_context + 2))]
    if ids and rng.random() < 0.5:  # spoil one position
        ids[rng.randrange(len(ids))] = rng.choice([vocab, vocab + rng.randrange(100), -1, True, 1.0, "7", None])
    if _valid(ids, vocab, max_context):
        check_prompt(ids, vocab, max_context)
    else:
        with pytest.raises(UserError, match="^prompt 3: "):
            check_prompt(ids, vocab, max_context, where="prompt 3: ")


def test_check_prompt_messages_name_the_problem():
    with pytest.raises(UserError, match="empty"):
        check_prompt([], 10, 10)
    with pytest.raises(UserError, match=r"\[12, -1\] are outside the vocabulary \[0, 10\)"):
        check_prompt([1, 12, -1], 10, 10)
    with pytest.raises(UserError, match="maximum context is 4 tokens"):
        check_prompt([1, 2, 3, 4], 10, 4)
    check_prompt([1, 2, 3], 10, 4)  # three tokens leave room for one new one


@pytest.mark.parametrize("trial", range(30))
def test_max_new_tokens_is_the_largest_budget_that_fits(trial):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    max_context = rng.randint(2, 4096)
    prompt_len = rng.randint(1, max_context - 1)  # a prompt check_prompt accepts
    asked = rng.randint(1, 2 * max_context)
    got = max_new_tokens(SamplingParams(max_new_tokens=asked), prompt_len, max_context)
    fits = [n for n in range(1, asked + 1) if prompt_len + n <= max_context]
    assert got == max(fits), f"seed {seed}"


@pytest.mark.parametrize("trial", range(10))
def test_kv_tokens_needed_counts_the_slots_a_generation_fills(trial):
    rng = random.Random()
    prompt_len, max_new = rng.randint(1, 300), rng.randint(1, 300)
    # Replay: the prompt's KV is written, then every sampled token but the last is fed back.
    written = prompt_len
    for step in range(max_new):
        if step < max_new - 1:
            written += 1
    assert kv_tokens_needed(prompt_len, max_new) == written


def test_the_generate_cli_has_the_api_default_budget():
    """One default output budget: `deepseek-pd generate` without --max-new-tokens asks for what
    SamplingParams (and the gRPC edge, test_validation.py) use."""
    import argparse

    from deepseek_pd.commands.generate import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--input-ids", "1,2"])
    assert args.max_new_tokens == SamplingParams().max_new_tokens
