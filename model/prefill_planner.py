"""Chunked prefill: which prompt tokens go into the next extend forward.

Shared by the offline `Engine` and both workers, so every path prefills the same way. Each round
takes prompt tokens first-come first-served until `budget` tokens (summed over requests) are used,
so one long prompt is split over several rounds and short ones ride along:

    budget 8, prompts A (10 tokens) and B (3):  round 1: A[0:8]   round 2: A[8:10] + B[0:3]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Sequence, TypeVar

from deepseek_pd.model.runner import ExtendSeq

Owner = TypeVar("Owner")


@dataclass(eq=False)
class PromptProgress(Generic[Owner]):
    """A prompt being prefilled: tokens [0, computed) already have KV in `pages`.

    `owner` is whatever the caller tracks the prompt with (an engine's request object).
    """

    token_ids: Sequence[int]
    pages: list[int]
    computed: int = 0
    owner: Owner | None = None

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.computed


@dataclass
class ExtendPlan(Generic[Owner]):
    """One extend forward: `items[i]` contributes `seqs[i]`."""

    items: list[PromptProgress[Owner]] = field(default_factory=list)
    seqs: list[ExtendSeq] = field(default_factory=list)

    @property
    def finishing(self) -> list[int]:
        """Rows whose prompt this round completes: their logits give the first token."""
        return [row for row, (item, seq) in enumerate(zip(self.items, self.seqs))
                if seq.prefix_len + len(seq.token_ids) == len(item.token_ids)]

    def advance(self) -> None:
        """Marks the planned tokens as computed (call once the forward has run)."""
        for item, seq in zip(self.items, self.seqs):
            item.computed = seq.prefix_len + len(seq.token_ids)


def plan_extend_batch(queue: Sequence[PromptProgress[Owner]], budget: int) -> ExtendPlan[Owner]:
    """The next round over `queue` (in order) within `budget` new tokens."""
    plan: ExtendPlan[Owner] = ExtendPlan()
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
