"""Acceptance of a draft chain against the target's verify logits (the math of speculative decoding).

The rule, for one request with drafts d1..dk and verify logits at positions 0..k:
    for i = 0, 1, ...: the target's token t_i is drawn from position i by the request's own
    sampler (argmax when greedy; a draw from the temperature / top-p / top-k / penalised
    distribution otherwise) and emitted; go on to i + 1 only while t_i == d_{i+1} (and the
    request has not stopped); position k's token is the "bonus" token and always the last.
So greedy keeps the longest agreeing prefix plus the target's next token, and sampling is
rejection sampling with a deterministic (one-hot) draft: d_{i+1} is accepted with probability
p_i(d_{i+1}), and on rejection the token comes from p_i with d_{i+1} removed and renormalised,
which is what `t_i ~ p_i, t_i != d` is. Each emitted token therefore has the target's conditional
distribution given the emitted prefix, and the sequence the target's joint distribution: the
statistical test checks it, and that a wrong rule fails.

Worked example: drafts [5, 9, 2]; the target draws 5 at position 0 (accept), 9 at 1 (accept), 7 at
2 (reject: emitted, then stop): emitted [5, 9, 7], accepted 2, accept length 3.

On the device (`accept_on_device`, SGLang keeps acceptance there too): every position of every
row is drawn at once (`SamplingBatch.sample_positions`: position i as if d_1..d_i had been emitted,
the same step's noise and penalties as a plain decode step there), then `agreeing_prefix` counts
the accepted drafts as tensor ops. Draws past the first disagreement are simply not kept, which
changes nothing: each kept draw is the one the sequential rule makes. Nothing is read back to the
host; the caller reads the step's result once (`DeviceAccept`), and a stop found there ends the
row's tokens early. The statistical test is tests/model/speculative/test_device_acceptance.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from deepseek_pd.model.sampling.batch import SampleOutput, SamplingBatch


@dataclass
class AcceptStats:
    """Counts since start: verify rows (one per request per step), drafted, accepted, emitted tokens."""

    verify_rows: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # drafts the target's token was compared with and differed from (<= 1 per row)
    emitted: int = 0
    # tokens emitted by one verify row -> how many rows emitted that many
    histogram: dict[int, int] = field(default_factory=dict)

    @property
    def accept_length(self) -> float:
        """Mean tokens a request gets per verify forward (1.0: every draft rejected)."""
        return self.emitted / self.verify_rows if self.verify_rows else 0.0

    @property
    def accept_rate(self) -> float:
        """Of the drafts the target looked at, the share it confirmed (a chain's per-draft rate)."""
        looked = self.accepted + self.rejected
        return self.accepted / looked if looked else 0.0

    def add(self, drafted: int, accepted: int, emitted: int) -> None:
        self.verify_rows += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += int(accepted < drafted and emitted > accepted)
        self.emitted += emitted
        self.histogram[emitted] = self.histogram.get(emitted, 0) + 1

    def snapshot(self) -> AcceptStats:
        """A copy of the counts now, for `since`."""
        return dataclasses.replace(self, histogram=dict(self.histogram))

    def since(self, before: AcceptStats) -> AcceptStats:
        """The counts added after `before` (a `snapshot` of these stats): e.g. one step's."""
        return AcceptStats(self.verify_rows - before.verify_rows, self.drafted - before.drafted,
                           self.accepted - before.accepted, self.rejected - before.rejected,
                           self.emitted - before.emitted,
                           {n: c - before.histogram.get(n, 0) for n, c in self.histogram.items()
                            if c > before.histogram.get(n, 0)})

    def accept_lengths(self) -> list[int]:
        """Each verify row's emitted tokens (the histogram unrolled; rows in no particular order)."""
        return [n for n, count in sorted(self.histogram.items()) for _ in range(count)]


def agreeing_prefix(tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """`[B]` long: how many leading drafts `drafts` `[B, q-1]` (-1: none) the target's tokens
    `tokens` `[B, q]` confirm (`tokens[:, i] == drafts[:, i]`), as tensor ops."""
    return (tokens[:, :-1] == drafts).cumprod(dim=1, dtype=torch.long).sum(dim=1)


@dataclass
class DeviceAccept:
    """One verify's acceptance, on the device. Row b emits `tokens[b, :emitted[b]]`."""

    sampled: SampleOutput  # every position's draw, row b * q + i (token, logprob, top logprobs)
    tokens: torch.Tensor  # [B, q] long
    accepted: torch.Tensor  # [B] long: drafts confirmed
    emitted: torch.Tensor  # [B] long: accepted + 1 (the target's own next token)


def accept_on_device(batch: SamplingBatch, logits: torch.Tensor, drafts: torch.Tensor) -> DeviceAccept:
    """The rule above for every row of `batch` at once: `logits` `[B, q, V]` are row b's verify
    positions (positions past its drafts may repeat its last one: they are never kept), `drafts`
    `[B, q-1]` long with -1 past each row's drafts. Advances each row's sampling state by its
    emitted tokens on the device (the host tells the states with `SamplingBatch.advanced`)."""
    rows, q = logits.shape[0], logits.shape[1]
    sampled = batch.sample_positions(logits, drafts)
    tokens = sampled.token_ids.view(rows, q)
    accepted = agreeing_prefix(tokens, drafts)
    emitted = accepted + 1
    batch.advance(tokens, emitted)
    return DeviceAccept(sampled, tokens, accepted, emitted)
