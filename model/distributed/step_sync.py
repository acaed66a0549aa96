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

The group also agrees on *which* forward runs (`ForwardKind`): with speculative decoding a rank
may be about to run the MTP layer (a draft step, a catch-up, the prefill's MTP pass: one MoE
layer's collectives) while another runs the model (a verify or an extend: every MoE layer's). The
two never share a step: the ranks whose kind lost the step run the winner's idle forward and then
ask again, so every step has one kind on every rank and the collectives pair up.

An exception inside the block leaves the collectives out of step, so the implementation treats
it as fatal for the group.
"""
from __future__ import annotations

import enum
from typing import ContextManager, Protocol

from deepseek_pd.model.forward_batch import ForwardMode


class ForwardKind(enum.IntEnum):
    """Which network a group step runs: the model's layers, or the MTP layer alone (speculative
    decoding). An idle rank joins a step with that kind's idle forward (`ModelRunner.idle`)."""

    MODEL = 0
    MTP = 1


class StepSync(Protocol):
    def forward(self, mode: ForwardMode, kind: ForwardKind = ForwardKind.MODEL) -> ContextManager[ForwardMode]:
        """Enters one group-wide forward step of `kind` and `mode` (blocks until every rank joins
        one of that kind: steps of the other kind may run before, with this rank idle in them);
        yields the step's mode over the group (EXTEND if any rank of the step extends)."""
        ...
