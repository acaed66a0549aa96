"""Oracles of the speculative acceptance's statistical tests: a target model over a tiny vocabulary
whose logits are a fixed random function of the prefix, its exact joint distribution over
sequences, and a chi-square test of drawn sequences against it.

    target = PrefixTarget(seed, vocab=5)                        # softmax of the logits
    fails, stat, critical = chi_square_fails(target.joint, draws, vocab=5, length=3)
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import torch

Z_1E4 = 3.719  # the standard normal's upper 1e-4 quantile

# (logits [V], prefix) -> the distribution a request samples from after that prefix [V]
Process = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


class PrefixTarget:
    """Logits as a fixed random function of the prefix; `probs` what the target samples from
    (softmax, or `process`: e.g. the sampler's temperature / top-k / top-p / penalties by the reference)."""

    def __init__(self, seed: int, vocab: int, scale: float = 1.5, process: Process | None = None) -> None:
        self.seed, self.vocab, self.scale = seed, vocab, scale
        self.process = process or (lambda logits, prefix: torch.softmax(logits, dim=-1))
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._probs: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._logits:
            gen = torch.Generator().manual_seed(hash((self.seed, prefix)) & 0x7FFF_FFFF)
            self._logits[prefix] = torch.randn(self.vocab, generator=gen) * self.scale
        return self._logits[prefix]

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._probs:
            self._probs[prefix] = self.process(self.logits(prefix), prefix)
        return self._probs[prefix]

    def joint(self, sequence: tuple[int, ...]) -> float:
        return math.prod(self.probs(sequence[:i])[t].item() for i, t in enumerate(sequence))

    def likely_chain(self, steps: int) -> list[int]:
        """Drafts that follow the target's most likely tokens (so drafts are both accepted and rejected)."""
        drafts: list[int] = []
        for _ in range(steps):
            drafts.append(int(self.probs(tuple(drafts)).argmax()))
        return drafts


def distinguishing_case(seed: int, vocab: int, steps: int) -> tuple[PrefixTarget, list[int]]:
    """A softmax target and its likely chain where the wrong acceptance rules (ignoring the
    comparison; comparing with the next draft) change the distribution by far more than a
    statistical test's noise.

    Comparing with the next draft differs from the right rule only when the first emitted token is
    drafts[1] (it then continues with the row of prefix [drafts[0]]): a chain that repeats a token
    makes the two rules identical, and a rare drafts[1], or two nearly equal rows, makes the change
    too small to see in ~24,000 draws (such seeds failed in ~40% of runs). Seeds are tried from
    `seed` on, deterministically, until drafts[1] is likely enough and the rows differ enough."""
    while True:
        target = PrefixTarget(seed, vocab)
        drafts = target.likely_chain(steps)
        first = target.probs(())[drafts[1]].item()
        apart = 0.5 * (target.probs((drafts[0],)) - target.probs((drafts[1],))).abs().sum().item()
        if drafts[0] != drafts[1] and first >= 0.15 and apart >= 0.3:
            return target, drafts
        seed += 1


def chi_square_fails(joint: Callable[[tuple[int, ...]], float], draws: list[tuple[int, ...]], vocab: int,
                     length: int) -> tuple[bool, float, float]:
    """(reject at p < 1e-4, statistic, critical value) of `draws` against `joint` over all
    sequences of `length`; cells with expected count < 5 pooled."""
    counts: dict[tuple[int, ...], int] = {}
    for d in draws:
        counts[d] = counts.get(d, 0) + 1
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq in itertools.product(range(vocab), repeat=length):
        expected, observed = joint(seq) * len(draws), counts.get(seq, 0)
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
            continue
        stat += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_exp == 0:
        # Every sequence outside the counted cells is impossible: a draw there is a failure the
        # statistic cannot express, and with one counted cell (a point mass, e.g. a low temperature
        # with min_p over a small vocabulary) there are no degrees of freedom left to test.
        if pooled_obs or cells <= 1:
            return pooled_obs > 0, float(pooled_obs), 0.0
    else:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df = cells - 1
    critical = df * (1 - 2 / (9 * df) + Z_1E4 * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat > critical, stat, critical
