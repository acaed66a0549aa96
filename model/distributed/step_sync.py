"""`StepSync`: the hook a `ModelRunner` calls around every forward when it is one rank of a group.

With expert parallelism every forward of every rank takes part in the same MoE all-to-alls, so
the ranks must run forwards in lockstep: a rank with no requests in a step still runs an idle
forward (`ModelRunner.idle`). The runner does not know how the ranks agree; it only announces
each forward to its `StepSync` (workers/group/lockstep.py implements it) and runs inside it:

    with step_sync.forward(ForwardMode.DECODE) as group_mode:   # "a forward now", and wait for it
        batch.group_mode = group_mode       # EXTEND if any rank extends: the EP collectives follow it
        logits = model(batch)               # the other ranks run theirs, or an idle one

The group's mode matters because ranks may run different modes in one step (one extends while
another decodes): DeepEP `auto` must pick normal mode on every rank then (SGLang: normal mode when
any rank has an extend in the batch), a decode rank must not replay a low-latency CUDA graph, and
two-batch overlap splits only when every rank runs the same mode (model/distributed/tbo.py).

An exception inside the block leaves the collectives out of step, so the implementation treats
it as fatal for the group.
"""
from __future__ import annotations

from typing import ContextManager, Protocol

from deepseek_pd.model.forward_batch import ForwardMode


class StepSync(Protocol):
    def forward(self, mode: ForwardMode) -> ContextManager[ForwardMode]:
        """Enters one group-wide forward step of `mode` (blocks until every rank joins it); yields
        the step's mode over the group (EXTEND if any rank extends)."""
        ...
