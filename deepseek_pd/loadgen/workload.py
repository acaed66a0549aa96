"""Prompts for a serving benchmark: random token ids of random or fixed length.

Token ids are sent as `input_ids`, so the prompt length is exact (no tokenizer round trip), and
requests set `ignore_eos` so every request produces exactly its output length: that makes runs
comparable across models and seeds, as SGLang's bench_serving does with its random dataset.

Example: `WorkloadSpec(num_prompts=3, input_len=100, output_len=20, range_ratio=0.5)` gives prompt
lengths drawn uniformly from [50, 100] and output lengths from [10, 20]; with
`output_range_ratio=0.0` every output is exactly 20 tokens (prompts still in [50, 100]).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from deepseek_pd.errors import UserError

DATASETS = ("random", "fixed")


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = 100
    dataset: str = "random"  # "random": lengths in [len*(1-range_ratio), len]; "fixed": exactly len
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.5
    seed: int = 0
    first_token_id: int = 3  # skip the special tokens at the bottom of the vocabulary
    output_range_ratio: float | None = None  # random dataset, outputs only; None: range_ratio

    @property
    def output_ratio(self) -> float:
        return self.range_ratio if self.output_range_ratio is None else self.output_range_ratio

    def token_pool(self, vocabulary: "int | Sequence[int]") -> Sequence[int]:
        """The ids prompts are drawn from: `vocabulary` is the vocabulary's size (ids from
        `first_token_id` up), or the ids a tokenizer produced (those from `first_token_id` up)."""
        if isinstance(vocabulary, int):
            return range(self.first_token_id, max(vocabulary, self.first_token_id))
        return sorted({token for token in vocabulary if token >= self.first_token_id})

    def validate(self, vocabulary: "int | Sequence[int]", max_context: int | None) -> "WorkloadSpec":
        """`max_context` None: not known (a gateway whose control plane is closed); lengths unchecked."""
        if self.dataset not in DATASETS:
            raise UserError(f"--dataset {self.dataset!r}: choose one of {', '.join(DATASETS)}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise UserError("--num-prompts, --input-len and --output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise UserError(f"--range-ratio {self.range_ratio} must be in [0, 1)")
        if not 0.0 <= self.output_ratio < 1.0:
            raise UserError(f"--output-range-ratio {self.output_ratio} must be in [0, 1)")
        if max_context is not None and self.input_len + self.output_len > max_context:
            raise UserError(f"--input-len + --output-len = {self.input_len + self.output_len} exceeds "
                            f"the model's context of {max_context}")
        if not self.token_pool(vocabulary):
            size = vocabulary if isinstance(vocabulary, int) else f"{len(vocabulary)} tokenizer ids"
            raise UserError(f"vocabulary of {size} is too small")
        return self


@dataclass(frozen=True)
class BenchRequest:
    input_ids: tuple[int, ...]
    output_len: int


def build_requests(spec: WorkloadSpec, vocab_size: "int | Sequence[int]") -> list[BenchRequest]:
    """`vocab_size`: the vocabulary's size, or the ids to draw from (`WorkloadSpec.token_pool`)."""
    rng = random.Random(spec.seed)
    pool = spec.token_pool(vocab_size)

    def length(full: int, ratio: float) -> int:
        if spec.dataset == "fixed":
            return full
        return rng.randint(max(1, int(full * (1 - ratio))), full)

    requests = []
    for _ in range(spec.num_prompts):
        n_in, n_out = length(spec.input_len, spec.range_ratio), length(spec.output_len, spec.output_ratio)
        ids = tuple(rng.choice(pool) for _ in range(n_in))  # over a range: the same draws as randrange
        requests.append(BenchRequest(ids, n_out))
    return requests
