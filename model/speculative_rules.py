"""The one rule for `--speculative-num-steps`: how many tokens the MTP layer drafts per decode step.

0 turns speculation off (the MTP layer is not even loaded). DeepSeek-V3 ships one MTP layer, which
is chained for more steps; past a handful the chain's accept rate makes more steps a loss
(SGLang's recommended settings use 1-5), so values above `MAX_SPECULATIVE_NUM_STEPS` are refused.
"""
from __future__ import annotations

from deepseek_pd.errors import UserError

DEFAULT_SPECULATIVE_NUM_STEPS = 3  # what `--speculative-num-steps` means when given without a value
MAX_SPECULATIVE_NUM_STEPS = 8


def check_speculative_num_steps(steps: object) -> int:
    """`steps` when it is an integer in 0..MAX, else a UserError naming the flag."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_SPECULATIVE_NUM_STEPS:
        raise UserError(f"--speculative-num-steps must be an integer in 0..{MAX_SPECULATIVE_NUM_STEPS} "
                        f"(0: off), got {steps!r}")
    return steps


def draft_len(steps: int, remaining_tokens: int) -> int:
    """Tokens to draft for a request that may emit `remaining_tokens` more: a verify of k drafts
    emits up to k + 1, so k stays below what is left (and the KV it writes inside the request's
    pages, which hold prompt + max_new - 1 tokens)."""
    return max(0, min(steps, remaining_tokens - 1))
