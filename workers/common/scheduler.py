"""Batching core shared by the prefill engine and the decode engine's colocated mode.

- `ModelThread`: the model runs in one dedicated thread, one call at a time, so the asyncio loop
  that serves gRPC (and the bootstrap stream) never waits on a forward.
- `PromptProgress` + `plan_extend_batch`: chunked prefill. Each round takes prompt tokens
  first-come first-served until `chunked_prefill_size` tokens (summed over requests) are used,
  so one long prompt is split over several rounds and short ones ride along:

      budget 8, prompts A (10 tokens) and B (3):  round 1: A[0:8]   round 2: A[8:10] + B[0:3]

- `run_extend` / `run_decode`: one forward plus sampling of the rows that need a token, as one
  call into the model thread.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.sampling import Sampler, SamplingState

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def check_prompt(input_ids: Sequence[int], vocab_size: int, max_context: int) -> None:
    """Raises UserError for a prompt no forward may see: one bad request must not fail a batch.

    The servicer validates too; engines check again because they are also driven directly.
    """
    if not input_ids:
        raise UserError("the prompt is empty")
    if len(input_ids) >= max_context:
        raise UserError(f"prompt has {len(input_ids)} tokens, the model's context is {max_context} "
                        "(prompt plus at least one new token)")
    bad = next((t for t in input_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise UserError(f"input token id {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass(eq=False)
class PromptProgress:
    """A prompt being prefilled: tokens [0, computed) have KV in `pages`."""

    token_ids: Sequence[int]
    pages: list[int]
    computed: int = 0
    sampling: SamplingState | None = None  # None: no token is sampled at the end (never the case today)

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.computed


@dataclass
class ExtendPlan:
    items: list[PromptProgress] = field(default_factory=list)
    seqs: list[ExtendSeq] = field(default_factory=list)

    @property
    def finishing(self) -> list[int]:
        """Rows whose prompt this round completes: their logits give the first token."""
        return [row for row, (item, seq) in enumerate(zip(self.items, self.seqs))
                if seq.prefix_len + len(seq.token_ids) == len(item.token_ids)]


def plan_extend_batch(queue: Sequence[PromptProgress], budget: int) -> ExtendPlan:
    plan = ExtendPlan()
    for item in queue:
        if budget <= 0:
            break
        take = min(budget, item.remaining)
        if take <= 0:
            continue
        chunk = item.token_ids[item.computed:item.computed + take]
        plan.items.append(item)
        plan.seqs.append(ExtendSeq(list(chunk), prefix_len=item.computed, pages=item.pages))
        budget -= take
    return plan


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]


def run_extend(runner: ModelRunner, sampler: Sampler, seqs: list[ExtendSeq], rows: list[int],
               states: list[SamplingState]) -> Sampled:
    """Extends all `seqs`; samples one token for each of `rows` (with `states[i]` for rows[i])."""
    logits = runner.extend(seqs)
    if logits.is_cuda:
        # The KV written by this forward is read next by the transport (copies or one-sided RDMA
        # writes) outside this stream's order: make it complete first.
        torch.cuda.current_stream(logits.device).synchronize()
    if not rows:
        return Sampled([], [])
    index = torch.tensor(rows, device=logits.device)
    out = sampler.sample(logits[index], states)
    return Sampled(out.token_ids.tolist(), out.logprobs.tolist())


def run_decode(runner: ModelRunner, sampler: Sampler, seqs: list[DecodeSeq],
               states: list[SamplingState]) -> Sampled:
    out = sampler.sample(runner.decode(seqs), states)
    return Sampled(out.token_ids.tolist(), out.logprobs.tolist())
