"""The rules every entry point applies to a request before any forward sees it.

One place for them: the offline `Engine`, the prefill worker and the decode worker all call these,
so a prompt that one refuses the others refuse with the same message.
"""
from __future__ import annotations

from typing import Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling_params import SamplingParams


def check_prompt(input_ids: Sequence[int], vocab_size: int, max_context: int, where: str = "") -> None:
    """Raises UserError for a prompt no forward may see: one bad request must not fail a batch.

    `where` prefixes the message (the offline engine says which prompt of a batch it means).
    """
    if not input_ids:
        raise UserError(f"{where}prompt is empty")
    bad = [t for t in input_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"{where}token ids {bad[:5]}{' ...' if len(bad) > 5 else ''} are outside the "
                        f"vocabulary [0, {vocab_size})")
    if len(input_ids) >= max_context:
        raise UserError(f"{where}prompt has {len(input_ids)} tokens but the model's maximum context is "
                        f"{max_context} tokens (prompt plus at least one new token)")


def max_new_tokens(params: SamplingParams, prompt_len: int, max_context: int) -> int:
    """The request's output budget: its own `max_new_tokens`, capped so prompt + output fit the context."""
    return min(params.max_new_tokens, max_context - prompt_len)


def kv_tokens_needed(prompt_len: int, max_new: int) -> int:
    """KV slots a request can ever fill: the last sampled token is never fed back."""
    return prompt_len + max_new - 1
