"""The one rule for `--speculative-num-steps`: how many tokens the MTP layer drafts per decode step.

0 turns speculation off (the MTP layer is not even loaded). DeepSeek-V3 ships one MTP layer, which
is chained for more steps; past a handful the chain's accept rate makes more steps a loss
(SGLang's recommended settings use 1-5), so values above `MAX_SPECULATIVE_NUM_STEPS` are refused.
"""
from __future__ import annotations

from deepseek_pd.errors import UserError

DEFAULT_SPECULATIVE_NUM_STEPS = 3  # `--speculative-num-steps auto` on a checkpoint with an MTP layer
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


def graph_draft_counts(steps: int, adaptive: bool) -> tuple[int, ...]:
    """The draft counts whose verify a runner captures as CUDA graphs (model/speculative/graphs.py):
    the configured k, or with the adaptive policy every k it may choose, 0 included (a verify of
    the last token alone: without its graph the policy's start-up costs would time k = 0 eagerly,
    and it could never pick it where a graph-replayed k >= 1 is dearer per token)."""
    return tuple(range(steps + 1)) if adaptive else (steps,)


def graph_tokens_per_sequence(steps: int) -> int:
    """Tokens per sequence in a worker's largest captured CUDA graph: the speculative verify's
    k + 1 with speculation (model/speculative/verify_graph.py), else decode's one. Its activation
    headroom scales with it (`RunnerConfig.headroom_gib`, the operator's memory plan)."""
    return steps + 1


def resolve_speculative_num_steps(value: str | int, num_nextn_predict_layers: int) -> int:
    """A command's `--speculative-num-steps`: "auto" is `DEFAULT_SPECULATIVE_NUM_STEPS` for a
    checkpoint that ships an MTP layer and 0 (off) for one that does not; else a checked integer
    (a positive one on a checkpoint without an MTP layer fails when the model loads, naming it)."""
    if value == "auto":
        return DEFAULT_SPECULATIVE_NUM_STEPS if num_nextn_predict_layers > 0 else 0
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise UserError(f"--speculative-num-steps must be 'auto' or an integer in "
                            f"0..{MAX_SPECULATIVE_NUM_STEPS}, got {value!r}") from None
    return check_speculative_num_steps(value)
