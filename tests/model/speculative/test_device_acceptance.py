"""The device-side acceptance (`acceptance.accept_on_device` over a real `SamplingBatch`) emits the
target's distribution for any temperature, top-k, top-p, min-p and penalties, seeded or not.

Each of TRIALS rows is one request of the same small-vocabulary target (pdtest/sequence_distribution.py)
with a deterministic draft chain; one verify step draws all its positions at once on the "device",
then the sequence continues from the target's own distribution (the plain reference sampler,
pdtest/sampling_reference.py) to a fixed length. The sequences must follow the target's exact
joint distribution (chi-square, p < 1e-4 to fail); wrong rules in `agreeing_prefix` must fail it.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepseek_pd.model.sampling.batch import SamplingBatch
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.state import SamplingState
from deepseek_pd.model.speculative import acceptance
from deepseek_pd.model.speculative.acceptance import accept_on_device
from pdtest.sampling_reference import ref_penalised, ref_probs
from pdtest.sequence_distribution import PrefixTarget, chi_square_fails, distinguishing_case

VOCAB, LENGTH, STEPS, TRIALS = 5, 3, 2, 24_000
PROMPT = [1]  # the repetition penalty's prompt tokens


def _processed(params: SamplingParams):
    """The distribution the target samples from after a prefix (penalties count the prefix)."""
    def process(logits: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(ref_probs(ref_penalised(logits.tolist(), params, PROMPT, list(prefix)), params))
    return process


def _draws(target: PrefixTarget, drafts: list[int], params: SamplingParams, seed: int,
           seeded: bool) -> tuple[list[tuple[int, ...]], float]:
    """TRIALS sequences of LENGTH tokens (one device verify of `drafts`, then the reference sampler),
    and the mean accept length."""
    batch = SamplingBatch(VOCAB, "cpu", torch.Generator().manual_seed(seed))
    for n in range(TRIALS):
        row = dataclasses.replace(params, seed=seed + n) if seeded else params
        batch.add(SamplingState.create(row, PROMPT, VOCAB))
    rows = torch.stack([target.logits(tuple(drafts[:i])) for i in range(len(drafts) + 1)])
    result = accept_on_device(batch, rows.expand(TRIALS, -1, -1), torch.tensor([drafts]).expand(TRIALS, -1))
    tokens, emitted = result.tokens.tolist(), result.emitted.tolist()
    outputs = [list(t[:e]) for t, e in zip(tokens, emitted)]
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(LENGTH):
        short = [o for o in outputs if len(o) < LENGTH]
        if short:
            probs = torch.stack([target.probs(tuple(o)) for o in short])
            for o, token in zip(short, torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()):
                o.append(token)
    return [tuple(o[:LENGTH]) for o in outputs], sum(emitted) / TRIALS


@pytest.fixture
def seed() -> int:
    value = random.randrange(1 << 30)
    print(f"seed={value}")
    return value


def _rejecting_case(seed: int) -> tuple[SamplingParams, PrefixTarget, list[int]]:
    """Sampling parameters, target and draft chain drawn from `seed`, redrawn (deterministically)
    while the chain is accepted with probability above 0.99: top-k, top-p and min-p at a low
    temperature can leave one possible sequence over VOCAB tokens, and a point mass has neither
    rejections nor a distribution to test (CI run 882486333 drew one)."""
    rng = random.Random(seed)
    while True:
        params = SamplingParams(temperature=rng.choice([0.7, 1.0, 1.5]), top_k=rng.choice([-1, 3, 4]),
                                top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]),
                                frequency_penalty=rng.choice([0.0, 0.5]), presence_penalty=rng.choice([0.0, 0.3]),
                                repetition_penalty=rng.choice([1.0, 1.3]))
        target = PrefixTarget(rng.randrange(1 << 30), VOCAB, process=_processed(params))
        drafts = target.likely_chain(STEPS)
        if target.joint(tuple(drafts)) <= 0.99:
            return params, target, drafts


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("case", range(3))
def test_device_acceptance_emits_the_target_distribution(seed, seeded, case):
    params, target, drafts = _rejecting_case(seed)
    draws, accept_length = _draws(target, drafts, params, seed, seeded)
    fails, stat, critical = chi_square_fails(target.joint, draws, VOCAB, LENGTH)
    print(f"{params}: chi2 {stat:.1f} (critical {critical:.1f}), accept length {accept_length:.2f}")
    assert not fails, seed
    assert 1.0 < accept_length < STEPS + 1  # both accepting and rejecting steps were drawn


def _ignores_the_comparison(tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    return (drafts >= 0).long().sum(dim=1)


def _compares_with_the_next_draft(tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    return _right_rule(tokens, torch.cat([drafts[:, 1:], drafts[:, -1:]], dim=1))


_right_rule = acceptance.agreeing_prefix


@pytest.mark.parametrize("wrong_rule", [_ignores_the_comparison, _compares_with_the_next_draft])
def test_a_wrong_device_rule_is_detected(seed, monkeypatch, wrong_rule):
    monkeypatch.setattr(acceptance, "agreeing_prefix", wrong_rule)
    target, drafts = distinguishing_case(seed, VOCAB, STEPS)
    params = SamplingParams(temperature=1.0)
    draws, _ = _draws(target, drafts, params, seed, seeded=False)
    fails, stat, critical = chi_square_fails(target.joint, draws, VOCAB, LENGTH)
    print(f"{wrong_rule.__name__}: chi2 {stat:.1f} (critical {critical:.1f})")
    assert fails


def test_greedy_keeps_the_longest_agreeing_prefix_plus_the_next_token():
    rows = torch.full((4, VOCAB), -10.0)
    for i, token in enumerate([3, 1, 4, 2]):  # the target's argmax at verify positions 0..3
        rows[i, token] = 10.0
    greedy = SamplingParams(temperature=0.0)
    for drafts, expected in (([3, 1, 4], [3, 1, 4, 2]), ([3, 0, 4], [3, 1]), ([0, 1, 4], [3]), ([], [3]),
                             ([3, -1, -1], [3, 1])):  # -1: no draft there (a shorter chain in the batch)
        batch = SamplingBatch(VOCAB, "cpu")
        state = SamplingState.create(greedy, PROMPT, VOCAB)
        batch.add(state)
        q = len(drafts) + 1
        result = accept_on_device(batch, rows[:q].unsqueeze(0), torch.tensor([drafts], dtype=torch.long).view(1, q - 1))
        emitted = int(result.emitted[0])
        assert result.tokens[0, :emitted].tolist() == expected
        assert int(result.accepted[0]) == len(expected) - 1
        batch.advanced(state, emitted)
        assert state.num_sampled == emitted
