"""What one request carries between sampling steps, wherever it is sampled.

A `SamplingState` is the request's params plus how far it got: `num_sampled` (the step of its next
draw, which seeded sampling keys on) and, with a penalty, its output-token counts `[V]`. While it
sits in a `SamplingBatch` the batch owns both on the device and advances them in each `sample`;
the state's properties read them through the batch, so they are right at any time with no
per-step host work. Removing it from the batch writes them back, so it can join another batch
(e.g. the prefill worker samples step 0, the decode batch continues at step 1) and go on exactly
as if it had stayed. `create` and `record` outside a batch do no device work (they run on the
worker's event loop): the prompt mask and counts are built by whoever first reads them, in practice
the model thread (a batch builds all its new rows' at once from `prompt_token_ids`).

Example, a request in the decode worker whose first token came from the prefill worker:

    state = SamplingState.create(params, prompt_ids, vocab_size, device="cuda")
    state.record(first_token)          # sampled elsewhere: step 1 next, its count penalised
    batch.add(state)                   # a SamplingBatch
    batch.sample(logits)               # draws step 1 on the device; state.num_sampled == 2
    batch.remove([state])              # counts and step now live in the state again
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, Sequence

import numpy as np
import torch

from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.sampling.noise import seed_key
from deepseek_pd.model.sampling.params import SamplingParams



class RowOwner(Protocol):
    """What a state asks of the batch that holds it (`sampling_batch.SamplingBatch`)."""

    @property
    def tick(self) -> int: ...

    def counts_row(self, row: int) -> torch.Tensor: ...

    def record(self, state: "SamplingState", token_id: int) -> None: ...


@dataclass(eq=False)
class SamplingState:
    """Per-request sampling state; build it with `create`. Compared by identity."""

    params: SamplingParams
    vocab_size: int
    _prompt_ids: Sequence[int] = field(default=(), repr=False)  # for `prompt_mask`, built on first use
    _device: torch.device | str = "cpu"
    _prompt_mask: torch.Tensor | None = field(default=None, repr=False)
    # [V] fp32 while no batch holds it; None outside a batch: zeros plus `_recorded`, not yet built
    _counts: torch.Tensor | None = field(default=None, repr=False)
    _recorded: list[int] = field(default_factory=list, repr=False)  # tokens `record`ed before `_counts` exists
    _steps: int = 0  # draws so far, as of joining the batch's tables (or all of them outside one)
    _host_tokens: int = 0  # tokens the host has appended (see `append`)
    _batch: RowOwner | None = field(default=None, repr=False)
    _row: int | None = None  # row in the batch's device tables; None: not (yet) in them
    _joined_tick: int = 0  # the batch's tick when this state got its row

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
               device: torch.device | str = "cpu") -> "SamplingState":
        """Builds no tensor: a penalised request's `[V]` tables on `device` are made where they are
        first read (`prompt_mask`, `output_counts`: the model thread, as its batch takes the row), not
        on the event loop that opens the request. `prompt_ids` is kept, not copied: leave it unchanged."""
        return cls(params, vocab_size, prompt_ids if params.repetition_penalty != 1.0 else (), device)

    @property
    def prompt_mask(self) -> torch.Tensor | None:
        """`[V]` bool, the prompt's tokens, only when repetition_penalty != 1 (built on first read;
        a `SamplingBatch` builds its rows' from `prompt_token_ids` instead, all in one go)."""
        if self._prompt_mask is None and self.params.repetition_penalty != 1.0:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self._device)
            mask[upload(torch.from_numpy(self.prompt_token_ids()), self._device)] = True
            self._prompt_mask = mask
        return self._prompt_mask

    def prompt_token_ids(self) -> np.ndarray:
        """The prompt's token ids inside the vocabulary, as int64 (empty without a repetition penalty)."""
        ids = np.asarray(self._prompt_ids, dtype=np.int64).reshape(-1)
        return ids[(ids >= 0) & (ids < self.vocab_size)]

    def take_recorded(self) -> list[int]:
        """The tokens `record`ed since the counts were last built (for a batch that builds them)."""
        recorded, self._recorded = self._recorded, []
        return recorded

    def own_counts(self) -> torch.Tensor | None:
        """`[V]` fp32 output-token counts held outside any batch (built on first read; None without
        penalties)."""
        if self._counts is None and self.penalised:
            counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self._device)
            if self._recorded:
                counts.index_put_((upload(torch.tensor(self._recorded, dtype=torch.int64), self._device),),
                                  torch.ones((), device=self._device), accumulate=True)
            self._counts, self._recorded = counts, []
        return self._counts

    # ---- what the request asks for (host knowledge, fixed for its life) ----

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def seeded(self) -> bool:
        """Draws from the counter-based noise of its seed (a greedy request draws nothing)."""
        return self.params.seed is not None and not self.params.greedy

    @property
    def penalised(self) -> bool:
        """Needs output-token counts: any of the three penalties is active."""
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    @property
    def truncates(self) -> bool:
        """Needs the sorted distribution: top-k, top-p or min-p removes tokens."""
        p = self.params
        return not p.greedy and (0 < p.top_k < self.vocab_size or p.top_p < 1.0 or p.min_p > 0.0)

    @cached_property
    def packed_ints(self) -> tuple[int, int]:
        """(seed key, effective top_k): this row's int64 columns in a batch's parameter table."""
        p = self.params
        top_k = self.vocab_size if p.greedy or p.top_k <= 0 else min(p.top_k, self.vocab_size)
        return (seed_key(p.seed) if self.seeded else 0, top_k)

    @cached_property
    def packed_floats(self) -> tuple[float, ...]:
        """This row's fp32 columns; see `sampling_batch.FloatColumn` for their order."""
        p = self.params
        greedy = p.greedy
        return (1.0 if greedy else p.temperature,  # greedy logprobs use temperature 1
                1.0 if greedy else p.top_p, 0.0 if greedy else p.min_p,
                p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                float(greedy), float(self.seeded), float(self.penalised))

    # ---- how far it got ----

    @property
    def num_sampled(self) -> int:
        """Tokens drawn or recorded so far: the step of the next draw. Exact at any time."""
        if self._row is None:
            return self._steps
        return self._steps + self._batch.tick - self._joined_tick

    @property
    def output_counts(self) -> torch.Tensor | None:
        """`[V]` fp32 output-token counts (None without penalties).

        Inside a batch this is a view of the batch's table, valid until its rows next change:
        `.clone()` it to keep it.
        """
        if self._row is None:
            return self.own_counts()
        return self._batch.counts_row(self._row) if self.penalised else None

    @property
    def generator(self) -> None:
        """Always None: seeded draws need no generator any more (they are keyed on seed and step).

        Kept for callers that still ship a generator state between workers (there is none to ship).
        """
        return None

    def record(self, token_id: int) -> None:
        """Counts a token that this state's sampler did not draw (e.g. the prefill worker's first
        token, arriving at the decode worker): the next draw is one step later, and penalised."""
        if self._row is not None:
            self._batch.record(self, token_id)  # the device tables own the step and counts
        else:
            self._steps += 1
            if self._counts is not None:
                self._counts[token_id] += 1
            elif self.penalised:  # host only (the decode worker records its first token on the event loop)
                self._recorded.append(token_id)
        self._host_tokens += 1

    def append(self, token_id: int) -> None:
        """The host learned the next output token; for callers that append every token.

        A token a sampler already drew for this state (`Sampler.sample` or a `SamplingBatch`
        advanced it) is only acknowledged; any other is `record`ed. Code that does not append
        the tokens it sampled must use `record` for tokens from elsewhere instead.
        """
        if self._host_tokens < self.num_sampled:
            self._host_tokens += 1
        else:
            self.record(token_id)
