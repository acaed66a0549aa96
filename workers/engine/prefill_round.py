"""The prefill round: the one way every engine computes prompts, written once.

The prefill worker, the decode worker (colocated prompts) and the offline engine each keep a queue
of prompts being prefilled and go through `PrefillRounds` for every round of it:

    prompt   = rounds.start(owner, token_ids, pages, cached_tokens)  # pages held for the prompt;
                                                                     # a cached prefix is computed
    plan     = rounds.plan(queue)          # chunked: at most `chunk_budget` new tokens, FIFO
    rounds.hold(plan)                      # owners' pages are in use by a forward (in_flight)
    output   = rounds.forward(plan, ...)   # model thread: the extend (MHA / MHA_CHUNKED_KV / MLA over
                                           # the cached prefix, as the runner's policy picks), the
                                           # first token of each prompt it completes, and with the
                                           # MTP layer its pass over the round and the first drafts
    rounds.commit(plan, output)            # computed advanced; owners that ended meanwhile released;
                                           # the role hears of the chunk and of each first token

`run` (offline engine, synchronous) and `run_in` (workers, through their model thread) do all of
it. What differs by role is a `RoundHooks` strategy: the prefill worker sends each chunk's pages
and streams layers (`chunk_done`, `layer_progress`), decode admits a completed prompt into its
continuous batch (`first_token`), the offline engine records tokens. Pages are never freed here:
an owner that `ended` while a forward used its pages is handed back to the role (`release`) once
no forward holds it (`in_flight` 0).

Shared by roles that must not know each other, so this module knows none of them; it imports
only model/ and its forward (`extend_step`), so the offline engine can use it too.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

import torch

from deepseek_pd.model.kv.layer_progress import LayerProgress
from deepseek_pd.workers.engine.prefill_planner import ExtendPlan, PromptProgress, plan_extend_batch
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine.extend_step import run_extend, run_extend_with_mtp
from deepseek_pd.workers.engine.round_clock import RoundClock

log = logging.getLogger(__name__)


class RoundOwner(Protocol):
    """What a round needs of the object a role tracks a prompt with (its request record).

    `sampling` draws its first token. `in_flight` counts the forwards (prefill rounds, and for
    decode its launched steps) that use the owner's pages; `ended` is set by the role once the
    request is over. Pages go back when both say so: ended and nothing in flight.
    """

    sampling: SamplingState
    ended: bool
    in_flight: int


Owner = TypeVar("Owner", bound=RoundOwner)
T = TypeVar("T")


class ForwardThread(Protocol):
    """Where a worker runs its forwards: `ModelThread` or, one rank of a group, `LockstepModelThread`."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...


@dataclass(frozen=True)
class FirstToken:
    """The first output token of a prompt the round completed (sampled at step 0 of its seed).

    `draft` (with the MTP layer only): the first draft token and the MTP hidden state it came from,
    which seed speculative decoding here or travel to decode in TransferDone.
    """

    token_id: int
    logprob: float
    top: TopLogprobs | None = None
    draft: tuple[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class RoundOutput:
    """What a round's forward produced: `firsts[i]` is the first token of plan row `rows[i]`."""

    rows: tuple[int, ...]
    firsts: tuple[FirstToken, ...]


class RoundHooks(Generic[Owner]):
    """A role's side of the prefill round; the defaults do nothing (the offline engine's case).

    Every hook runs on the caller's side (the event loop for the workers), never in the model
    thread, and only for owners that have not `ended`.
    """

    def layer_progress(self, plan: ExtendPlan[Owner]) -> LayerProgress | None:
        """Told of each layer's KV write during the forward (the prefill worker's layer-wise
        transfer); None: nobody listens."""
        return None

    def chunk_done(self, owners: Sequence[Owner]) -> None:
        """The round's forward ran: each owner's `progress.computed` now covers its chunk."""

    def first_token(self, owner: Owner, first: FirstToken) -> None:
        """The round completed the owner's prompt; `first` is its first output token."""

    def release(self, owner: Owner) -> None:
        """The owner ended while the round held its pages; no forward holds them now."""

    def failed(self, owners: Sequence[Owner], error: Exception) -> None:
        """The forward raised `error` (already logged); `owners` are those it held that live on.
        The default re-raises (the offline engine's caller sees the error)."""
        raise error


@dataclass(eq=False)
class PrefillRounds(Generic[Owner]):
    """Plans and runs chunked prefill rounds over a role's queue of prompts (module docstring).

    `chunk_budget`: new prompt tokens per round, summed over its prompts. `on_step(seconds,
    prompts, tokens)` hears of every forward that succeeded (the workers' step metrics), and
    `on_phases(phases)` of where its seconds went (round_clock.py: contiguous phases that add up
    to about `seconds`, host timestamps only).
    """

    runner: ModelRunner
    sampler: Sampler
    chunk_budget: int
    hooks: RoundHooks[Owner]
    on_step: Callable[[float, int, int], None] | None = None
    on_phases: Callable[[dict[str, float]], None] | None = None
    # Cut prompts only at multiples of chunk_budget from their own start (--deterministic: a
    # prompt's chunks, and so its numerics, do not depend on the queue).
    aligned: bool = False
    # The tokens the next round may take, when a role sizes rounds itself (the prefill worker's
    # RoundBudget, for decode sharing the GPU); None: chunk_budget.
    round_tokens: Callable[[], int] | None = None
    # With the MTP layer (speculative decoding) every round also runs it, so its KV is in the
    # pages with the rest and each completed prompt gets its first draft.
    with_mtp: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.chunk_budget < 1:
            raise ValueError(f"chunk_budget must be >= 1, got {self.chunk_budget}")
        self.with_mtp = self.runner.model.mtp is not None

    # ---- the steps --------------------------------------------------------------------------
    def start(self, owner: Owner, token_ids: Sequence[int], pages: list[int],
              cached_tokens: int = 0) -> PromptProgress[Owner]:
        """A prompt to prefill into `pages` (held by the role: allocated, reserved or from the
        prefix cache), whose first `cached_tokens` already have KV there (a cached prefix: its
        rounds extend over it)."""
        page_size = self.runner.kv_pool.page_size
        if len(pages) * page_size < len(token_ids):
            raise ValueError(f"{len(pages)} pages of {page_size} tokens cannot hold a {len(token_ids)}-token prompt")
        if not 0 <= cached_tokens < len(token_ids) or cached_tokens % page_size:
            raise ValueError(f"cached prefix of {cached_tokens} tokens: not whole pages of {page_size} "
                             f"short of the {len(token_ids)}-token prompt")
        return PromptProgress(token_ids, pages, computed=cached_tokens, owner=owner)

    def plan(self, queue: Sequence[PromptProgress[Owner]]) -> ExtendPlan[Owner]:
        """The next round over `queue`, in order (empty when nothing is left to compute)."""
        budget = self.chunk_budget if self.round_tokens is None else self.round_tokens()
        return plan_extend_batch(queue, budget, aligned=self.aligned)

    def hold(self, plan: ExtendPlan[Owner]) -> list[Owner]:
        """Marks the round's owners' pages as in use by a forward; returns the owners, in row order."""
        owners = [item.owner for item in plan.items]
        for owner in owners:
            owner.in_flight += 1
        return owners

    def forward(self, plan: ExtendPlan[Owner], states: Sequence[SamplingState],
                progress: LayerProgress | None = None, clock: RoundClock | None = None) -> RoundOutput:
        """Model thread: the round's extend and the first token of each prompt it completes
        (`states[i]` samples for `plan.finishing[i]`); with the MTP layer, its pass too. `clock`
        (the round's, started by the caller) gets the model thread's phases."""
        if clock is not None:
            clock.mark("hop_in")
        rows = plan.finishing
        if self.with_mtp:
            sampled, drafts = run_extend_with_mtp(self.runner, self.sampler, plan.seqs, rows, states,
                                                  [item.token_ids for item in plan.items], progress, clock)
        else:
            sampled = run_extend(self.runner, self.sampler, plan.seqs, rows, states, progress, clock)
            drafts = [None] * len(rows)
        firsts = tuple(FirstToken(token, logprob, top, draft) for token, logprob, top, draft
                       in zip(sampled.token_ids, sampled.logprobs, sampled.top, drafts))
        if clock is not None:
            clock.mark("other")
        return RoundOutput(tuple(rows), firsts)

    def commit(self, plan: ExtendPlan[Owner], output: RoundOutput | None,
               error: Exception | None = None) -> None:
        """After the forward (`output`), or its failure (`error`): releases the hold, then tells
        the role what the round did for the owners that live on."""
        owners = [item.owner for item in plan.items]
        self._let_go(owners)
        live = [owner for owner in owners if not owner.ended]
        if error is not None:
            self.hooks.failed(live, error)
            return
        for item, seq in zip(plan.items, plan.seqs):
            if not item.owner.ended:
                item.computed = seq.prefix_len + len(seq.token_ids)
        self.hooks.chunk_done(live)
        for row, first in zip(output.rows, output.firsts):
            owner = plan.items[row].owner
            if not owner.ended:
                self.hooks.first_token(owner, first)

    # ---- whole rounds -----------------------------------------------------------------------
    def run(self, queue: Sequence[PromptProgress[Owner]]) -> ExtendPlan[Owner]:
        """One round, here and now (the offline engine); returns its plan (empty: nothing to do)."""
        plan, states, progress = self._begin(queue)
        if plan.items:
            began = time.perf_counter()
            try:
                output = self.forward(plan, states, progress)
            except Exception as exc:
                self.commit(plan, None, exc)
                return plan
            self._end(plan, output, time.perf_counter() - began, None)
        return plan

    async def run_in(self, model_thread: ForwardThread, queue: Sequence[PromptProgress[Owner]]) -> ExtendPlan[Owner]:
        """One round whose forward runs in `model_thread`; the rest runs here, on the event loop."""
        plan, states, progress = self._begin(queue)
        if plan.items:
            began = time.perf_counter()
            clock = RoundClock() if self.on_phases is not None else None
            try:
                output = await model_thread.run(self.forward, plan, states, progress, clock)
            except Exception as exc:
                log.exception("prefill forward failed")
                self.commit(plan, None, exc)
                return plan
            if clock is not None:
                clock.mark("hop_out")
            self._end(plan, output, time.perf_counter() - began, clock)
        return plan

    def _begin(self, queue: Sequence[PromptProgress[Owner]]) -> tuple[ExtendPlan[Owner], list, LayerProgress | None]:
        plan = self.plan(queue)
        if not plan.items:
            return plan, [], None
        states = [plan.items[row].owner.sampling for row in plan.finishing]
        progress = self.hooks.layer_progress(plan)
        self.hold(plan)
        return plan, states, progress

    def _end(self, plan: ExtendPlan[Owner], output: RoundOutput, seconds: float, clock: RoundClock | None) -> None:
        if self.on_step is not None:
            self.on_step(seconds, len(plan.items), sum(len(seq.token_ids) for seq in plan.seqs))
        if clock is not None and self.on_phases is not None:
            self.on_phases(clock.phases)
        self.commit(plan, output)

    def _let_go(self, owners: Sequence[Owner]) -> None:
        for owner in owners:
            owner.in_flight -= 1
            if owner.ended and owner.in_flight == 0:
                self.hooks.release(owner)
