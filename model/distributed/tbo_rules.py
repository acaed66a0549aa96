"""Where two-batch overlap cuts a batch, and whether it pays (SGLang's `two_batch_overlap.py` rules).

A batch is cut at one token index `t`: micro-batch A is tokens [0, t), B is tokens [t, T).

    decode   t = B // 2 (one token per sequence: half the sequences each; a batch of one gives A
             nothing, as in SGLang)
    extend   the cut between sequences where the two token sums balance best; but when even
             that cut leaves one side below `token_distribution_threshold` of the tokens (one
             sequence dominates), t = T // 2 instead, inside that sequence: A ends with its first
             chunk, and B starts with the rest, which attends to the first chunk as a cached
             prefix (A writes that KV in the same layer before B's attention reads it: A never
             runs behind B). threshold 0 turns the two-chunk split off.

    Example, threshold 0.48: extend lens (3, 4, 2, 5) → cut after 2 sequences (7 | 7) → t = 7.
    Lens (3, 4, 5): the best cut between sequences is 7 | 5, and 7/12 = 0.58 > 0.52, so t = 6:
    A = seq 0 + seq 1's first 3 tokens, B = seq 1's last token after a prefix that now holds its
    first 3, then seq 2. Lens (2, 30) → t = 16. One prompt of 100 → t = 50.

Whether it pays is a group decision (`model/distributed/tbo.py`): the group splits when the busiest rank has
at least `min_decode_tokens` / `min_extend_tokens`. SGLang has no such floor (a TODO in its code);
the defaults, 2, are the least that gives the busiest rank's two micro-batches a token each.
(DeepSeek's published decode figures put the break-even at 64-128 tokens per rank, FACTS.md.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.runner_rules import range_blocker

DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD = 0.48  # SGLang's --tbo-token-distribution-threshold
DEFAULT_MIN_TOKENS = 2


@dataclass(frozen=True)
class TboRules:
    """When and where a batch is split (engine options `tbo_*`, resolved once)."""

    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD
    min_decode_tokens: int = DEFAULT_MIN_TOKENS
    min_extend_tokens: int = DEFAULT_MIN_TOKENS

    def __post_init__(self) -> None:
        if (blocker := range_blocker(tbo_token_distribution_threshold=self.token_distribution_threshold,
                                     tbo_min_decode_tokens=self.min_decode_tokens,
                                     tbo_min_extend_tokens=self.min_extend_tokens)) is not None:
            raise UserError(blocker)

    def min_tokens(self, mode: ForwardMode) -> int:
        return self.min_decode_tokens if mode is ForwardMode.DECODE else self.min_extend_tokens

    def pays(self, mode: ForwardMode, busiest_tokens: int) -> bool:
        """Whether a group whose busiest rank runs `busiest_tokens` tokens of `mode` splits."""
        return busiest_tokens >= self.min_tokens(mode)

    def split_token(self, mode: ForwardMode, extend_lens: Sequence[int]) -> int:
        """The token index `t` where the batch is cut (see the module docstring); 0 <= t <= T."""
        if mode is ForwardMode.DECODE:
            return len(extend_lens) // 2
        total = sum(extend_lens)
        balanced = sum(extend_lens[:balanced_cut(extend_lens)])
        if self.two_chunk(balanced, total):
            return total // 2
        return balanced

    def two_chunk(self, left_tokens: int, total: int) -> bool:
        """Whether the best cut between sequences is too lopsided, so one sequence is cut instead."""
        share = self.token_distribution_threshold
        return left_tokens < total * share or left_tokens > total * (1 - share)


def balanced_cut(lens: Sequence[int]) -> int:
    """The number of leading sequences whose token sum is closest to half (ties: the later cut, as
    SGLang); 0 for a single sequence."""
    total, left, best, best_diff = sum(lens), 0, 0, None
    for cut in range(1, len(lens)):
        left += lens[cut - 1]
        diff = abs(2 * left - total)
        if best_diff is not None and diff > best_diff:
            break  # the imbalance only grows from here
        best, best_diff = cut, diff
    return best
