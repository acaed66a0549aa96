"""The acceptance rule's output distribution equals the target's (model/speculative/acceptance.py).

A small-vocabulary target (logits a fixed random function of the prefix) and a deterministic
draft chain; each trial runs one verify step through `accept_drafts` with the target's own
sampler, then continues by plain sampling to a fixed length. The empirical distribution of those
sequences must match the target's exact joint distribution (chi-square, p < 1e-4 to fail). Wrong
rules (ignoring the comparison, comparing with the wrong draft) must fail the same test.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from deepseek_pd.model.speculative import acceptance as speculative_sampling
from deepseek_pd.model.speculative.acceptance import AcceptStats, accept_drafts, accept_prefix
from pdtest.sequence_distribution import PrefixTarget, chi_square_fails, distinguishing_case

VOCAB, LENGTH, STEPS, TRIALS = 5, 3, 2, 24_000


@dataclass
class _Request:
    output_ids: list[int] = field(default_factory=list)
    stop_after: int | None = None

    @property
    def finished(self) -> bool:
        return self.stop_after is not None and len(self.output_ids) >= self.stop_after


def _sampler(gen: torch.Generator):
    def sample(requests: list[_Request], logits: torch.Tensor) -> None:
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1).tolist()
        for request, token in zip(requests, tokens):
            request.output_ids.append(token)
    return sample


def _draws(target: PrefixTarget, drafts: list[int], gen: torch.Generator) -> tuple[list[tuple[int, ...]], AcceptStats]:
    """TRIALS sequences of LENGTH tokens: one verify step of `drafts`, then plain sampling."""
    requests = [_Request() for _ in range(TRIALS)]
    rows = torch.stack([target.logits(tuple(drafts[:i])) for i in range(len(drafts) + 1)])
    stats = AcceptStats()
    accept_drafts(requests, [drafts] * TRIALS, rows.repeat(TRIALS, 1), [n * len(rows) for n in range(TRIALS)],
                  _sampler(gen), stats)
    sample = _sampler(gen)
    for _ in range(LENGTH):
        short = [r for r in requests if len(r.output_ids) < LENGTH]
        if short:
            sample(short, torch.stack([target.logits(tuple(r.output_ids)) for r in short]))
    return [tuple(r.output_ids[:LENGTH]) for r in requests], stats


def _chi_square_fails(target: PrefixTarget, draws: list[tuple[int, ...]]) -> tuple[bool, float, float]:
    return chi_square_fails(target.joint, draws, VOCAB, LENGTH)


def _case(seed: int, temperature: float) -> tuple[PrefixTarget, list[int]]:
    """A target and a draft chain that agrees with its most likely tokens (so both paths happen)."""
    target = PrefixTarget(seed, VOCAB, scale=1.5 / temperature)
    return target, target.likely_chain(STEPS)


@pytest.fixture
def seed() -> int:
    value = random.randrange(1 << 30)
    print(f"seed={value}")
    return value


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_emitted_tokens_have_the_target_distribution(seed, temperature):
    target, drafts = _case(seed, temperature)
    draws, stats = _draws(target, drafts, torch.Generator().manual_seed(seed))
    fails, stat, critical = _chi_square_fails(target, draws)
    print(f"T={temperature}: chi2 {stat:.1f} (critical {critical:.1f}), accept length {stats.accept_length:.2f}")
    assert not fails
    assert 1.0 < stats.accept_length < STEPS + 1  # both accepting and rejecting steps were drawn


def _ignores_the_comparison(request, drafts, position):
    return not request.finished and position < len(drafts)


def _compares_with_the_next_draft(request, drafts, position):
    return (not request.finished and position < len(drafts)
            and request.output_ids[-1] == drafts[min(position + 1, len(drafts) - 1)])


@pytest.mark.parametrize("wrong_rule", [_ignores_the_comparison, _compares_with_the_next_draft])
def test_a_wrong_rule_is_detected(seed, monkeypatch, wrong_rule):
    monkeypatch.setattr(speculative_sampling, "continues", wrong_rule)
    target, drafts = distinguishing_case(seed, VOCAB, STEPS)
    fails, stat, critical = _chi_square_fails(target, _draws(target, drafts, torch.Generator().manual_seed(seed))[0])
    print(f"{wrong_rule.__name__}: chi2 {stat:.1f} (critical {critical:.1f})")
    assert fails


def test_greedy_keeps_the_longest_agreeing_prefix_plus_the_next_token():
    rows = torch.full((4, VOCAB), -10.0)
    for i, token in enumerate([3, 1, 4, 2]):  # the target's argmax at verify positions 0..3
        rows[i, token] = 10.0
    greedy = lambda requests, logits: [r.output_ids.append(int(x.argmax())) for r, x in zip(requests, logits)]  # noqa: E731
    for drafts, expected in (([3, 1, 4], [3, 1, 4, 2]), ([3, 0, 4], [3, 1]), ([0, 1, 4], [3]), ([], [3])):
        request = _Request()
        assert accept_drafts([request], [drafts], rows, [0], greedy) == [len(expected)]
        assert request.output_ids == expected
        assert accept_prefix(drafts, expected) == len(expected) - 1
    stopping = _Request(stop_after=2)  # a stop inside an agreeing run ends the step there
    assert accept_drafts([stopping], [[3, 1, 4]], rows, [0], greedy) == [2]
    assert stopping.output_ids == [3, 1]
