"""Chunked prefill: which prompt tokens go into the next extend forward.

Shared by the offline `Engine` and both workers, so every path prefills the same way. Each round
takes prompt tokens first-come first-served until `budget` tokens (summed over requests) are used,
so one long prompt is split over several rounds and short ones ride along:

    budget 8, prompts A (10 tokens) and B (3):  round 1: A[0:8]   round 2: A[8:10] + B[0:3]

`aligned` (`--deterministic`): a prompt is only ever cut at multiples of `budget` from its own
start, so its chunks, and with them every chunk's prefix and attention, are the ones it gets when
prefilled alone; a round takes a prompt's next whole chunk or nothing of it:

    budget 8, prompts B (3) then A (10), aligned:  round 1: B[0:3]   round 2: A[0:8]   round 3: A[8:10]
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


def plan_extend_batch(queue: Sequence[PromptProgress[Owner]], budget: int,
                      aligned: bool = False) -> ExtendPlan[Owner]:
    """The next round over `queue` (in order) within `budget` new tokens; `aligned`: cuts only at
    multiples of `budget` from each prompt's start (module docstring)."""
    plan: ExtendPlan[Owner] = ExtendPlan()
    chunk = budget
    for item in queue:
        if budget <= 0:
            break
        if aligned:
            take = min(chunk - item.computed % chunk, item.remaining)
            if take > budget:  # its next chunk does not fit whole: it leads the next round
                break
        else:
            take = min(budget, item.remaining)
        if take <= 0:
            continue
        tokens = item.token_ids[item.computed:item.computed + take]
        plan.items.append(item)
        plan.seqs.append(ExtendSeq(list(tokens), prefix_len=item.computed, pages=item.pages))
        budget -= take
    return plan
