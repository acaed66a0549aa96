"""`RoundBudget`: how many prompt tokens the next prefill round may take, so that decode sharing
the GPU is not starved behind long prefill rounds (issue 25).

With prefill and decode on one GPU (`up`, `gpu_workers > 1`) the two processes time-slice it; CUDA
stream priorities do not reach across processes (each has its own context; only under MPS do its
clients' kernels run side by side), so a decode step that arrives during a prefill round waits for
that round's kernels. What prefill controls is how long a round is. With a target round time T, the
budget is T divided by the seconds per token measured on recent rounds (an exponential average, so
it follows the load decode puts on the GPU), within [min_tokens, chunked_prefill_size]:

    target 30 ms, recent rounds 12 us/token  ->  2,500 tokens (SGLang's chunk 8,192 would take ~100 ms)

Off (`prefill_round_target_ms` 0, the default) the budget is chunked_prefill_size, as before. A
deterministic scheduler cuts prompts at multiples of the budget, so it needs it fixed: the two are
refused together (SchedulerConfig).
"""
from __future__ import annotations

from dataclasses import dataclass

# The weight of the newest round in the seconds-per-token average: a few rounds follow a change
# in decode's load, one odd round (a first-token sample, a cold kernel) does not swing the budget.
EWMA_WEIGHT = 0.3
# Budgets are whole multiples of this many tokens: kernels tile prompt rows by 64, and budgets that
# differ by a few tokens would only add CUDA-graph-free shape variety.
TOKEN_QUANTUM = 64


@dataclass(frozen=True)
class RoundBudgetConfig:
    max_tokens: int  # chunked_prefill_size
    target_s: float = 0.0  # a round's target duration; 0: off, always max_tokens
    min_tokens: int = 256  # below this a round's fixed cost (launches, sampling) dominates

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.min_tokens < 1 or self.target_s < 0:
            raise ValueError(f"round budget: max_tokens and min_tokens >= 1, target_s >= 0; got {self}")


class RoundBudget:
    """`tokens()` before a round, `observe(tokens, seconds)` after it."""

    def __init__(self, config: RoundBudgetConfig) -> None:
        self.config = config
        self._seconds_per_token: float | None = None

    def tokens(self) -> int:
        config = self.config
        if not config.target_s or self._seconds_per_token is None:
            return config.max_tokens
        wanted = int(config.target_s / self._seconds_per_token) // TOKEN_QUANTUM * TOKEN_QUANTUM
        return max(min(config.min_tokens, config.max_tokens), min(config.max_tokens, wanted))

    def observe(self, tokens: int, seconds: float) -> None:
        if not self.config.target_s or tokens <= 0 or seconds <= 0:
            return
        latest = seconds / tokens
        previous = self._seconds_per_token
        self._seconds_per_token = latest if previous is None else previous + EWMA_WEIGHT * (latest - previous)
