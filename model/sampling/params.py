"""Per-request sampling parameters, validated once at the edge (CLI or gRPC).

SGLang's defaults, not proto3's zeros: the gRPC layer maps its message onto this class and the
router always fills the fields in. `validate()` raises `UserError` naming the bad field, which the
CLI prints and the servicers turn into INVALID_ARGUMENT.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepseek_pd.errors import UserError

# A request's output budget when it names none: SGLang's default, so the gRPC path (the router
# leaves max_new_tokens unset), the offline Engine and `deepseek-pd generate` all stop at the same
# length. Each path then caps it to the context left after the prompt (request_rules.max_new_tokens).
DEFAULT_MAX_NEW_TOKENS = 128

# The most top logprobs a request may ask for per position (OpenAI's `top_logprobs` cap).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, what the sampler reports about it, and when to stop.

    Example: greedy with a 16-token budget is `SamplingParams(temperature=0.0, max_new_tokens=16)`;
    `temperature=0.7, top_p=0.9, seed=1` is reproducible token for token across runs and workers.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0 disables
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 disables
    frequency_penalty: float = 0.0  # in [-2, 2]
    presence_penalty: float = 0.0  # in [-2, 2]
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenised output
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # The k most likely tokens and their logprobs at each step, under the same distribution as the
    # sampled token's logprob (0: none). The gRPC layer sets it only with return_logprob, as SGLang.
    top_logprobs_num: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def greedy(self) -> bool:
        # SGLang's rule (_SAMPLING_EPS): below 1e-6 the distribution is argmax in all but name,
        # and logits / temperature would overflow fp32 into inf - inf = nan.
        return self.temperature < 1e-6 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise UserError for nonsense values; returns self so it can be chained."""
        def bad(name: str, value: object, want: str) -> UserError:
            return UserError(f"sampling parameter {name}={value!r} is invalid: {want}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise bad("top_k", self.top_k, "must be >= 1, or -1/0 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, getattr(self, name), "must be in [-2, 2]")
        for token_id in self.stop_token_ids:
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise bad("stop_token_ids", token_id, f"must be in [0, {vocab_size})")
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "stop strings must be non-empty")
        if (not isinstance(self.top_logprobs_num, int) or isinstance(self.top_logprobs_num, bool)
                or not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS):
            raise UserError(f"top_logprobs_num={self.top_logprobs_num!r} is invalid: at most "
                            f"{MAX_TOP_LOGPROBS} top logprobs per position are supported (0 for none)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # torch.Generator's range
            raise bad("seed", self.seed, "must fit in 64 bits")
        return self
