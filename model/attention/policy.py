"""`AttentionPolicy`: picks the attention method for a whole batch, once, before the layers run.

Rules (ARCHITECTURE §5), as a lookup rather than if-chains spread over the model:
    decode                                   → MLA (absorbed; the cache is the only K/V)
    extend, no cached prefix                 → MHA
    extend, sum(prefix_lens) >= threshold    → MHA_CHUNKED_KV
    extend, shorter prefix                   → MLA
A forced method ("mha", "mha_chunked_kv", "mla") applies to extend batches; "mha" on a batch that
has a prefix becomes MHA_CHUNKED_KV (plain MHA cannot see the cache).

Example: threshold 256; prefixes (0, 0) → MHA; (100, 50) → MLA; (300, 0) → MHA_CHUNKED_KV.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import AttentionMethod, ForwardMode
from deepseek_pd.model.runner_rules import RUNNER_CHOICES, choice_blocker, range_blocker

ATTENTION_METHOD_CHOICES = RUNNER_CHOICES["attention_method"]


@dataclass(frozen=True)
class AttentionPolicy:
    method: str = "auto"
    chunked_kv_threshold: int = 256  # total cached-prefix tokens from which MHA_CHUNKED_KV beats MLA

    def __post_init__(self) -> None:
        if (blocker := choice_blocker(attention_method=self.method)) is not None:
            raise UserError(blocker)
        if (blocker := range_blocker(mha_chunked_kv_threshold=self.chunked_kv_threshold)) is not None:
            raise UserError(blocker)

    def choose(self, mode: ForwardMode, prefix_lens: tuple[int, ...]) -> AttentionMethod:
        if mode is ForwardMode.DECODE:
            return AttentionMethod.MLA
        has_prefix = any(prefix_lens)
        if self.method != "auto":
            return method_with_prefix(AttentionMethod(self.method), has_prefix)
        if not has_prefix:
            return AttentionMethod.MHA
        if sum(prefix_lens) >= self.chunked_kv_threshold:
            return AttentionMethod.MHA_CHUNKED_KV
        return AttentionMethod.MLA


def method_with_prefix(method: AttentionMethod, has_prefix: bool) -> AttentionMethod:
    """`method` for a batch (or a two-batch-overlap micro-batch, model/distributed/tbo.py) that has a
    cached prefix: plain MHA cannot see the cache, so it becomes MHA_CHUNKED_KV; the others read it."""
    return AttentionMethod.MHA_CHUNKED_KV if method is AttentionMethod.MHA and has_prefix else method
