"""The chi-square oracle of the speculative tests (pdtest/sequence_distribution.py) rejects what it
must: draws from another distribution, draws on impossible sequences, a point mass missed; and
passes draws from the distribution itself, a point mass included (it once divided by zero there)."""
from __future__ import annotations

import itertools
import random

import pytest

from pdtest.sequence_distribution import chi_square_fails

VOCAB, LENGTH, DRAWS = 3, 2, 6_000


def _joint(weights: list[float]):
    table = dict(zip(itertools.product(range(VOCAB), repeat=LENGTH), weights))
    total = sum(weights)
    return lambda seq: table[seq] / total


def _sample(joint, rng: random.Random, n: int = DRAWS) -> list[tuple[int, ...]]:
    cells = list(itertools.product(range(VOCAB), repeat=LENGTH))
    return rng.choices(cells, weights=[joint(c) for c in cells], k=n)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(random.randrange(1 << 30))


def test_draws_of_the_distribution_pass_and_of_another_fail(rng):
    joint = _joint([rng.uniform(0.5, 2.0) for _ in range(VOCAB ** LENGTH)])
    assert not chi_square_fails(joint, _sample(joint, rng), VOCAB, LENGTH)[0]
    other = _joint([1.0] * (VOCAB ** LENGTH - 1) + [4.0])
    assert chi_square_fails(joint, _sample(other, rng), VOCAB, LENGTH)[0]


def test_a_point_mass_passes_its_own_draws_and_fails_any_other():
    weights = [0.0] * (VOCAB ** LENGTH)
    weights[4] = 1.0
    joint = _joint(weights)
    only = list(itertools.product(range(VOCAB), repeat=LENGTH))[4]
    assert chi_square_fails(joint, [only] * DRAWS, VOCAB, LENGTH) == (False, 0.0, 0.0)
    assert chi_square_fails(joint, [only] * (DRAWS - 1) + [(0, 0)], VOCAB, LENGTH)[0]


def test_a_draw_on_an_impossible_sequence_fails(rng):
    weights = [rng.uniform(0.5, 2.0) for _ in range(VOCAB ** LENGTH)]
    weights[0] = 0.0  # (0, 0) cannot be drawn
    joint = _joint(weights)
    draws = _sample(joint, rng)
    assert not chi_square_fails(joint, draws, VOCAB, LENGTH)[0]
    assert chi_square_fails(joint, draws[1:] + [(0, 0)], VOCAB, LENGTH)[0]
