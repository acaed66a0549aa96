"""How many tokens to draft this step: speculation only where it pays.

At small batches decode is memory-bound and a verify forward of k + 1 tokens per sequence costs
little more than a plain step, so drafting pays; at large batches it is compute-bound and every
drafted token costs about as much as a decoded one (SGLang's wide-EP runs gained only 14%). The
policy picks, per step, the k in 0..max_steps that maximises expected tokens per second:

    tokens(k, a) = 1 + a + a^2 + ... + a^k      (each draft accepted with probability a, in a chain)
    k* = argmax_k tokens(k, a) / cost(batch, k)

`cost` is a table of step times measured at start-up (`StepCosts`, from
`step_costs.measure_step_costs`), interpolated over the batch size; `a` is the accept rate seen so
far (`AcceptRate`: drafted and accepted counts with a prior, decaying so it follows the traffic).
k = 0 is a verify of the last token alone (the MTP layer still runs over it, to keep its KV current).

Example: a = 0.8, cost(1, k) = 10, 11, 12, 13 ms for k = 0..3 -> tokens 1, 1.8, 2.44, 2.95 ->
rates 0.10, 0.16, 0.20, 0.23 per ms: k = 3. cost(128, k) = 40, 75, 110, 145 ms -> 0.025, 0.024,
0.022, 0.020: k = 0.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from deepseek_pd.errors import UserError


def expected_tokens(steps: int, accept_rate: float) -> float:
    """Tokens a request gets from one verify of `steps` chained drafts (the bonus token included)."""
    return sum(accept_rate ** i for i in range(steps + 1))


@dataclass(frozen=True)
class StepCosts:
    """Measured milliseconds of one speculative step: `ms[k][i]` at batch `batches[i]`, k = 0..max."""

    batches: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.batches or list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise UserError(f"step cost batches must be increasing positive sizes, got {self.batches}")
        if not self.ms or any(len(row) != len(self.batches) or min(row) <= 0 for row in self.ms):
            raise UserError("step costs need one positive time per batch size and draft count")

    @property
    def max_steps(self) -> int:
        return len(self.ms) - 1

    def at(self, batch: int, steps: int) -> float:
        """Milliseconds at `batch`: linear between measured sizes, proportional beyond the largest."""
        row, sizes = self.ms[steps], self.batches
        if batch <= sizes[0]:
            return row[0]
        if batch >= sizes[-1]:
            return row[-1] * batch / sizes[-1]
        i = bisect.bisect_left(sizes, batch)
        lo, hi = sizes[i - 1], sizes[i]
        return row[i - 1] + (row[i] - row[i - 1]) * (batch - lo) / (hi - lo)


@dataclass
class AcceptRate:
    """The chain's per-draft accept rate: accepted / (accepted + rejected) drafts (those the target
    compared, `AcceptStats`), with `prior` counted as `weight` drafts, old counts decaying by
    `decay` per step so the estimate follows the traffic."""

    prior: float = 0.7
    weight: float = 16.0
    decay: float = 0.99
    accepted: float = 0.0
    rejected: float = 0.0

    def observe(self, accepted: int, rejected: int) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + rejected

    @property
    def value(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.accepted + self.rejected + self.weight)


@dataclass
class SpeculationPolicy:
    """`steps_for` is asked once per step. Steps without drafts measure no accept rate, so after
    `probe_every` of them in a row one step drafts 1: a rate learnt on traffic the layer predicts
    badly would otherwise pin the choice at 0 for good, whatever came next (measured on the tiny
    V2 model: a rate of 0.02 from held-out prompts kept k = 0 on the prompts it had been trained
    on, whose accept length at k = 1 was 1.9). 0: never probe."""

    costs: StepCosts
    max_steps: int
    rate: AcceptRate = field(default_factory=AcceptRate)
    probe_every: int = 32
    _undrafted: int = 0  # steps in a row that drafted nothing

    def steps_for(self, batch: int) -> int:
        """The draft count that maximises expected tokens per millisecond at `batch` (or a probe)."""
        a = min(self.rate.value, 0.999)
        limit = min(self.max_steps, self.costs.max_steps)
        k = max(range(limit + 1), key=lambda k: expected_tokens(k, a) / self.costs.at(batch, k))
        self._undrafted = self._undrafted + 1 if k == 0 else 0
        if self.probe_every and limit and self._undrafted > self.probe_every:
            self._undrafted = 0
            return 1
        return k
