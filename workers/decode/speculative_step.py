"""The decode worker's speculative step (model/speculative/decoder.py): draft, verify, accept, catch up.

Runs in the model thread; the event loop streams the tokens afterwards. Each request has one
`SpecRow` for its life: the speculative decoder keeps its draft state by that row, and the row
holds a host copy of the output (the model thread appends the step's tokens there; the event
loop's own `output_ids` grow as it streams them, `DecodeEngine._accept`).

Only the output budget ends a row inside a step (`SpecRow.finished`); a stop token or string is
found on the host when the tokens are streamed, and the tokens after it are dropped there. The
target's tokens up to a stop are those of a run without speculation, so this changes nothing but
a little wasted work. The rows' sampling states live in the decoder's `SamplingBatch` (on the
device, model thread only) from their first step on; a failed step `reset`s it.

    stepper = SpeculativeStepper(runner, num_steps, sampler)
    stepper.seed(row, draft, hidden)                 # colocated: the prefill round's first draft
    emitted = stepper.step(rows)                     # per row: [(token, logprob, top), ...]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Sequence

import torch

from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.model.speculative.policy import SpeculationPolicy, StepCosts
from deepseek_pd.model.speculative.decoder import LaunchedSpecStep, SpeculativeDecoder
from deepseek_pd.model.speculative.step_costs import calibrated_policy


Emitted = tuple[int, float, "TopLogprobs | None"]  # (token, logprob, top logprobs)


@dataclass(eq=False)
class SpecRow:
    """A request as the speculative decoder sees it (`model.speculative.SpecRequest`)."""

    prompt_ids: list[int]
    pages: list[int]
    max_new: int
    sampling: SamplingState
    output_ids: list[int] = field(default_factory=list)
    # this step's tokens, for the event loop: (token, logprob, top logprobs or None)
    new: list[Emitted] = field(default_factory=list)
    # A PD request's first draft as the prefill worker sent it (token, hidden), until a step seeds it.
    wire_draft: tuple[int, list[float]] | None = None

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new


@dataclass
class PendingSpecStep:
    """A launched step: the rows it was asked for, and the decoder's launch (None: none was unfinished)."""

    rows: list[SpecRow]
    launched: LaunchedSpecStep | None


class SpeculativeStepper:
    def __init__(self, runner: ModelRunner, num_steps: int, sampler: Sampler) -> None:
        self.sampler = sampler
        self.decoder = SpeculativeDecoder(runner, num_steps, _emit, sampler.fallback_generator)
        self.runner = runner
        # With `speculative_adaptive`: drafts per step by batch size (`calibrate` measures the costs).
        self.policy: SpeculationPolicy | None = None

    def calibrate(self, max_batch: int, context: int = 256, repeats: int = 3) -> StepCosts:
        """Measures the step costs at batch 1, 2, 4, .. max_batch (as the pool's free pages allow)
        and turns the per-step choice on. Model thread, before serving."""
        self.policy = calibrated_policy(self.runner, self.decoder.num_steps, max_batch, context, repeats)
        return self.policy.costs

    @property
    def stats(self):
        return self.decoder.stats

    def seed(self, row: SpecRow, token: int, hidden: torch.Tensor) -> None:
        """A colocated prompt's first draft, from the MTP pass of the prefill round that completed
        it (workers/engine/prefill_round.py)."""
        self.decoder.seed(row, token, hidden)

    def step(self, rows: Sequence[SpecRow]) -> list[list[Emitted]]:
        """One speculative step for every row; returns each row's emitted tokens, in order."""
        return self.collect(self.launch(rows))

    def launch(self, rows: Sequence[SpecRow], after: PendingSpecStep | None = None) -> PendingSpecStep:
        """Queues one step for `rows` (nothing waits for the device); `after`: the step before, not
        yet collected, which this one starts from on the device (`SpeculativeDecoder.launch`)."""
        for row in rows:
            if row.wire_draft is not None:
                token, hidden = row.wire_draft
                row.wire_draft = None
                weight = self.runner.model.embed_tokens.weight
                # Pinned and asynchronous (`upload`): the step that follows does not wait for it.
                self.decoder.seed(row, token, upload(torch.tensor(hidden, dtype=weight.dtype), weight.device))
        steps = None if self.policy is None else self.policy.steps_for(len(rows))
        return PendingSpecStep(list(rows), self.decoder.launch(list(rows), steps,
                                                               None if after is None else after.launched))

    def collect(self, pending: PendingSpecStep, stopped: Collection[SpecRow] = ()) -> list[list[Emitted]]:
        """A launched step's one host read; each of its rows' emitted tokens, in order. `stopped`:
        rows whose request the event loop saw stop before this step (a stop token or string in the
        step before, which this one was launched ahead of): void, they get nothing and count in no
        stats (so neither in the accept-length metric nor in the policy's accept rate)."""
        for row in pending.rows:
            row.new.clear()
        if pending.launched is not None:
            stats = self.stats
            accepted, rejected = stats.accepted, stats.rejected
            self.decoder.finish(pending.launched, {id(row) for row in stopped})
            if self.policy is not None:
                self.policy.rate.observe(stats.accepted - accepted, stats.rejected - rejected)
        return [list(row.new) for row in pending.rows]

    def collect_and_launch(self, pending: PendingSpecStep | None, rows: Sequence[SpecRow],
                           stopped: Collection[SpecRow] = ()) -> tuple[list[list[Emitted]], PendingSpecStep | None]:
        """The overlapped round's one model-thread call: step N+1 queued and step N's tokens, so the
        device runs N+1 while the event loop streams N's. When N+1 has N's rows it is launched first,
        from N's counts on the device (model/speculative/future_positions.py): the host builds it while
        the device still runs N, and reads N after. Otherwise (rows joined or left) N is read first,
        and N+1 starts from the host's lengths. `stopped`: as in `collect`, of N's rows."""
        if (pending is not None and pending.launched is not None and rows
                and self.decoder.can_launch_ahead(rows, pending.launched)):
            launched = self.launch(rows, after=pending)
            return self.collect(pending, stopped), launched
        collected = [] if pending is None else self.collect(pending, stopped)
        return collected, (self.launch(rows) if rows else None)

    def forget(self, row: SpecRow) -> None:
        self.decoder.forget(row)

    def reset(self) -> None:
        """After a failed step (model thread): the decoder's device state can no longer be trusted."""
        self.decoder.reset()


def _emit(row: SpecRow, token: int, logprob: float, top: TopLogprobs | None) -> None:
    """A step's token joins its row, for the event loop to stream (`SpeculativeDecoder`'s emit)."""
    row.output_ids.append(token)
    row.new.append((token, logprob, top))


def wire_draft(done, vocab_size: int, hidden_size: int) -> tuple[int, list[float]] | None:
    """The first draft a prefill worker sent in `TransferDone` (`mtp_draft_token_id`, `mtp_hidden`),
    or None when there is none or it does not fit this model (then the first step verifies the
    first token alone: output is unaffected, only that step's speedup is lost)."""
    hidden = list(done.mtp_hidden)
    if len(hidden) != hidden_size or not 0 <= done.mtp_draft_token_id < vocab_size:
        return None
    if not all(math.isfinite(v) for v in hidden):
        return None
    return done.mtp_draft_token_id, hidden
