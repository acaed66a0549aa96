"""The rules every entry point applies to a request before any forward sees it.

One place for them: the offline `Engine`, the gRPC edge (workers/api/validation.py) and both
worker engines call these, so a prompt that one refuses the others refuse with the same message.
"""
from __future__ import annotations

from typing import Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.params import SamplingParams


def check_prompt_length(num_tokens: int, max_context: int, where: str = "") -> None:
    """Raises UserError for a prompt that is empty or leaves no room for one new token.

    Needs only the length, so the gRPC edge refuses a huge prompt before copying its ids."""
    if num_tokens == 0:
        raise UserError(f"{where}prompt is empty")
    if num_tokens >= max_context:
        raise UserError(f"{where}prompt has {num_tokens} tokens but the model's maximum context is "
                        f"{max_context} tokens (prompt plus at least one new token)")


def check_prompt(input_ids: Sequence[int], vocab_size: int, max_context: int, where: str = "") -> None:
    """Raises UserError for a prompt no forward may see: one bad request must not fail a batch.

    Its length first (`check_prompt_length`), then every id: an int (not a bool) in [0, vocab_size).
    `where` prefixes the message (the offline engine says which prompt of a batch it means).
    """
    check_prompt_length(len(input_ids), max_context, where)
    bad = [t for t in input_ids if type(t) is not int or not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"{where}token ids {bad[:5]}{' ...' if len(bad) > 5 else ''} are outside the "
                        f"vocabulary [0, {vocab_size})")


def max_new_tokens(params: SamplingParams, prompt_len: int, max_context: int) -> int:
    """The request's output budget: its own `max_new_tokens`, capped so prompt + output fit the context."""
    return min(params.max_new_tokens, max_context - prompt_len)


def kv_tokens_needed(prompt_len: int, max_new: int) -> int:
    """KV slots a request can ever fill: the last sampled token is never fed back."""
    return prompt_len + max_new - 1
