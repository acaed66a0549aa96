"""`SamplingBatch`: the device-side sampling state of a batch whose rows change between steps.

`sample(logits)` draws one token per row with a fixed number of kernels whatever the batch size,
never reads a value back to the host, and advances every row on the device (its step and, with
penalties, its output-token counts): with an overlap scheduler the host does not know the tokens
yet. The per-row parameters sit in device tables rebuilt lazily, at the first `sample` after an
`add` or `remove`, from one packed host-to-device copy; what the rows need (penalties, sorting for
truncation, seeded or generator noise) is host knowledge taken at that rebuild, so the kernels no
row needs are skipped with no sync.

Worked example, three requests over three steps:

    batch = SamplingBatch(vocab_size, "cuda")
    batch.add(a); batch.add(b)           # rows [a, b]
    out = batch.sample(logits_ab)        # rebuild (one upload), draw; a, b at step 1
    batch.add(c)                         # rows [a, b, c]; c continues at its own num_sampled
    out = batch.sample(logits_abc)       # a, b at step 2
    batch.remove([a])                    # a's step and counts written back into a
    out = batch.sample(logits_bc)        # rows [b, c]
    out.token_ids.tolist()               # the caller's one device-to-host copy, when it wants it

A request that leaves one batch and joins another continues exactly (seeded draws depend only on
its seed and step, see sampling_noise); unseeded rows share `fallback_generator`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Iterable

import numpy as np
import torch

from deepseek_pd.model.host_copy import upload, upload_parts
from deepseek_pd.model.sampling.noise import counter_uniforms, token_offsets
from deepseek_pd.model.sampling.ops import choose, gumbel, penalise, scale, top_logprobs, truncation_mask
from deepseek_pd.model.sampling.state import SamplingState


class FloatColumn(IntEnum):
    """Columns of the fp32 parameter table, one row per request (`SamplingState.packed_floats`)."""

    TEMPERATURE = 0  # 1 for greedy rows, whose logprobs use temperature 1
    TOP_P = 1
    MIN_P = 2
    REPETITION = 3
    FREQUENCY = 4
    PRESENCE = 5
    GREEDY = 6  # 1.0 / 0.0
    SEEDED = 7
    PENALISED = 8  # also the weight of a sampled token in the output counts


_INT_COLUMNS = 3  # seed key, step (advanced on the device), effective top_k


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] fp32: log-probability of the chosen token under the penalised,
    # temperature-scaled (before truncation) distribution; greedy rows use temperature 1
    top_logprobs: torch.Tensor  # [B, K] fp32, descending: each row's K best under that distribution
    top_ids: torch.Tensor  # [B, K] long, their token ids; K = max(top_counts), 0 when no row asks
    top_counts: tuple[int, ...]  # host: how many of its row's K each request asked for


@dataclass
class _Tables:
    """The device tables of one row set, plus what the host knows about them."""

    floats: torch.Tensor  # [B, len(FloatColumn)] fp32
    keys: torch.Tensor  # [B] int64 seed keys
    steps: torch.Tensor  # [B] int64, += 1 per sample
    top_k: torch.Tensor  # [B] int64
    counts: torch.Tensor | None  # [B, V] fp32, when any row is penalised
    prompt: torch.Tensor | None  # [B, V] bool, when any row has a repetition penalty
    truncates: bool  # some row needs the sorted distribution
    seeded_rows: torch.Tensor | None  # [S] int64, the rows drawing counter-based noise (None: none)
    unseeded: bool  # some row draws from the fallback generator
    top_counts: tuple[int, ...]  # each row's top_logprobs_num
    top_width: int  # the one topk's k: the largest count, at most the vocabulary

    def column(self, name: FloatColumn) -> torch.Tensor:
        return self.floats[:, name]

    def flag(self, name: FloatColumn) -> torch.Tensor:
        """`[B, 1]` bool of a 0/1 column, to broadcast over the vocabulary."""
        return self.floats[:, name].unsqueeze(1) > 0


class SamplingBatch:
    """Persistent sampling state of a decode batch; rows in `add` order, see the module docstring."""

    def __init__(self, vocab_size: int, device: torch.device | str,
                 fallback_generator: torch.Generator | None = None):
        self.vocab_size = vocab_size
        self.device = _normalise(torch.device(device))
        self.fallback_generator = fallback_generator
        self._states: list[SamplingState] = []  # row order
        self._tables: _Tables | None = None  # as of the last rebuild; rows are states with _row set
        self._dirty = False
        self._tick = 0
        self._offsets: torch.Tensor | None = None  # token_offsets, made on first seeded draw

    @property
    def states(self) -> list[SamplingState]:
        """The rows, in order: row i of `sample`'s logits belongs to `states[i]`."""
        return list(self._states)

    @property
    def tick(self) -> int:
        """Number of `sample` calls so far (how each row's step advances without host work)."""
        return self._tick

    def __len__(self) -> int:
        return len(self._states)

    def add(self, state: SamplingState) -> None:
        """Appends a row for `state`, which continues from its own `num_sampled` and counts."""
        if state._batch is not None:
            raise ValueError("this sampling state is already in a batch; remove it there first")
        if state.vocab_size != self.vocab_size:
            raise ValueError(f"state for vocabulary {state.vocab_size} added to a batch of {self.vocab_size}")
        state._batch, state._row = self, None
        self._states.append(state)
        self._dirty = True

    def remove(self, states: Iterable[SamplingState]) -> None:
        """Drops rows (the others keep their order) and writes their step and counts back."""
        states = list(states)
        for state in states:
            if state._batch is not self:
                raise ValueError("this sampling state is not in this batch")
        placed = [s for s in states if s._row is not None]
        penalised = [s for s in placed if s.penalised]
        if penalised:
            rows = upload(torch.tensor([s._row for s in penalised], dtype=torch.int64), self.device)
            block = self._tables.counts.index_select(0, rows)  # one copy for all of them
            for i, state in enumerate(penalised):
                state._counts = block[i]
        for state in placed:
            state._steps = state.num_sampled
        for state in states:
            state._batch, state._row = None, None
        gone = {id(s) for s in states}
        self._states = [s for s in self._states if id(s) not in gone]
        self._dirty = True

    def counts_row(self, row: int) -> torch.Tensor:
        return self._tables.counts[row]

    def record(self, state: SamplingState, token_id: int) -> None:
        """`state.record` for a row in the device tables: one step and one count, on the device."""
        self._tables.steps[state._row] += 1
        if state.penalised:
            self._tables.counts[state._row, token_id] += 1
        state._steps += 1

    def sample(self, logits: torch.Tensor) -> SampleOutput:
        """One token per row of `logits` `[len(states), V]`; advances every row by one step.

        The result stays on the device; nothing here waits for it.
        """
        if logits.dim() != 2 or logits.shape[0] != len(self._states) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(self._states)} requests "
                             f"over a vocabulary of {self.vocab_size}")
        if logits.device != self.device:
            raise ValueError(f"logits on {logits.device}, sampling batch on {self.device}")
        if not self._states:
            return SampleOutput(torch.empty(0, dtype=torch.int64, device=self.device),
                                torch.empty(0, dtype=torch.float32, device=self.device),
                                torch.empty(0, 0, dtype=torch.float32, device=self.device),
                                torch.empty(0, 0, dtype=torch.int64, device=self.device), ())
        if self._dirty:
            self._rebuild()
        out = self._draw(logits, self._tables)
        t = self._tables
        t.steps += 1
        if t.counts is not None:
            t.counts.scatter_add_(1, out.token_ids.unsqueeze(1), t.column(FloatColumn.PENALISED).unsqueeze(1))
        self._tick += 1
        return out

    def sample_positions(self, logits: torch.Tensor, drafts: torch.Tensor) -> SampleOutput:
        """Each row's token at `q` consecutive positions, drawn as if the tokens before position
        i were the row's output so far plus `drafts[row, :i]`; advances nothing (see `advance`).

        `logits` `[B, q, V]`, `drafts` `[B, q - 1]` long (-1: none). Position i of row b is drawn
        exactly as a plain `sample` would draw it after d_1..d_i had been emitted: at step
        `num_sampled + i` (the same seeded noise) and with those drafts counted by the penalties.
        Output row `b * q + i` is row b's position i. Nothing here waits for the device.
        """
        if logits.dim() != 3 or logits.shape[0] != len(self._states) or logits.shape[2] != self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(self._states)} requests "
                             f"over a vocabulary of {self.vocab_size}")
        rows, q = logits.shape[0], logits.shape[1]
        if drafts.shape != (rows, q - 1):
            raise ValueError(f"drafts {tuple(drafts.shape)} for {rows} rows of {q} positions")
        if rows == 0:
            return self.sample(logits.reshape(0, self.vocab_size))
        if self._dirty:
            self._rebuild()
        t = self._tables
        positions = torch.arange(q, device=self.device)

        def each(x: torch.Tensor) -> torch.Tensor:  # row b's value at each of its q positions
            return x.unsqueeze(1).expand(rows, q, *x.shape[1:]).reshape(rows * q, *x.shape[1:])

        counts = None
        if t.counts is not None:
            # Position i also counts d_1..d_i (drafts[:, j] for j < i), weighted like a sampled token.
            before = (positions[:-1].unsqueeze(0) < positions.unsqueeze(1)).float()  # [q, q-1]: j < i
            weight = before * (drafts >= 0).unsqueeze(1) * t.column(FloatColumn.PENALISED).view(rows, 1, 1)
            counts = t.counts.unsqueeze(1).repeat(1, q, 1)
            counts.scatter_add_(2, drafts.clamp(min=0).unsqueeze(1).expand(rows, q, q - 1), weight)
            counts = counts.view(rows * q, self.vocab_size)
        seeded = None
        if t.seeded_rows is not None:
            seeded = (t.seeded_rows.unsqueeze(1) * q + positions).reshape(-1)
        # Keys and steps feed only the noise, top_k only the truncation (`_draw`): a batch without
        # either (all greedy, say) skips their copies, kernels a speculative step would launch for nothing.
        noisy = t.seeded_rows is not None or t.unseeded
        wide = replace(t, floats=each(t.floats), keys=each(t.keys) if noisy else t.keys,
                       steps=(t.steps.unsqueeze(1) + positions).reshape(-1) if noisy else t.steps,
                       top_k=each(t.top_k) if t.truncates else t.top_k, counts=counts,
                       prompt=None if t.prompt is None else each(t.prompt), seeded_rows=seeded,
                       top_counts=tuple(c for c in t.top_counts for _ in range(q)))
        return self._draw(logits.reshape(rows * q, self.vocab_size), wide)

    def advance(self, tokens: torch.Tensor, taken: torch.Tensor) -> None:
        """After `sample_positions`: row b keeps its first `taken[b]` tokens of `tokens` `[B, q]`
        (device tensors): its step and counts advance by them, on the device. The host learns the
        numbers later and tells each state (`advanced`), before the rows next change."""
        t = self._tables
        t.steps += taken
        if t.counts is not None:
            kept = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0) < taken.unsqueeze(1)
            t.counts.scatter_add_(1, tokens, kept.float() * t.column(FloatColumn.PENALISED).unsqueeze(1))

    def advanced(self, state: SamplingState, steps: int) -> None:
        """The host's side of `advance`: `state` drew `steps` tokens in it."""
        if state._batch is not self:
            raise ValueError("this sampling state is not in this batch")
        state._steps += steps

    def _draw(self, logits: torch.Tensor, t: _Tables) -> SampleOutput:
        """One token per row of `logits` under the tables `t` (the rule of the module docstring)."""
        col = t.column
        logits = logits.float()
        if t.counts is not None:
            logits = penalise(logits, t.counts, t.prompt, col(FloatColumn.REPETITION).unsqueeze(1),
                              col(FloatColumn.FREQUENCY).unsqueeze(1), col(FloatColumn.PRESENCE).unsqueeze(1))
        scaled = scale(logits, col(FloatColumn.TEMPERATURE).unsqueeze(1))
        keep = None
        if t.truncates:  # greedy and untruncated rows have top_k = V, top_p = 1, min_p = 0: keep all
            keep = truncation_mask(torch.softmax(scaled, dim=-1), t.top_k, col(FloatColumn.TOP_P),
                                   col(FloatColumn.MIN_P))
        noise = None
        if t.seeded_rows is not None or t.unseeded:
            noise = gumbel(self._uniforms(t))
            noise.masked_fill_(t.flag(FloatColumn.GREEDY), 0.0)
        lse = torch.logsumexp(scaled, dim=-1)
        tokens, logprobs = choose(scaled, noise, keep, lse)
        if t.top_width > 0:  # one topk for the batch; rows that asked for fewer (or none) are cut on the host
            top_values, top_ids = top_logprobs(scaled, lse, t.top_width)
        else:
            top_values = torch.empty(logits.shape[0], 0, dtype=torch.float32, device=self.device)
            top_ids = torch.empty(logits.shape[0], 0, dtype=torch.int64, device=self.device)
        return SampleOutput(token_ids=tokens, logprobs=logprobs, top_logprobs=top_values, top_ids=top_ids,
                            top_counts=t.top_counts)

    # ---- internals ----

    def _uniforms(self, t: _Tables) -> torch.Tensor:
        """`[B, V]` uniforms: counter-based on seeded rows, the fallback generator's elsewhere."""
        shape = (t.keys.shape[0], self.vocab_size)
        if self._offsets is None and t.seeded_rows is not None:
            self._offsets = token_offsets(self.vocab_size, self.device)
        if t.seeded_rows is not None and t.seeded_rows.numel() == shape[0]:
            return counter_uniforms(t.keys, t.steps, self._offsets)
        if t.unseeded:
            uniforms = torch.rand(shape, generator=self.fallback_generator, device=self.device)
            # torch.rand may return exactly 0, whose noise would be -inf: harmless, but keep it finite.
            uniforms.clamp_(min=2.0 ** -24)
        else:  # only greedy rows besides the seeded ones: their noise is zeroed anyway
            uniforms = torch.full(shape, 0.5, device=self.device)
        if t.seeded_rows is not None:
            # Hashing is the costly part (int64 over [rows, V]): only the seeded rows pay for it.
            rows = t.seeded_rows
            uniforms.index_copy_(0, rows, counter_uniforms(t.keys.index_select(0, rows),
                                                           t.steps.index_select(0, rows), self._offsets))
        return uniforms

    def _rebuild(self) -> None:
        """New device tables for the current rows: one packed upload; surviving rows' counts are
        gathered from the old tables, new rows' from their states."""
        states, old = self._states, self._tables
        survivors = [s._row for s in states if s._row is not None]  # ascending: removal keeps order
        fresh = states[len(survivors):]  # add appends, so every new row comes after them
        n, k = len(states), len(survivors)
        any_penalised = any(s.penalised for s in states)
        gather = any_penalised and k > 0 and old is not None and old.counts is not None
        seeded = [row for row, s in enumerate(states) if s.seeded]
        top_counts = tuple(s.params.top_logprobs_num for s in states)
        ints = torch.tensor([(s.packed_ints[0], s.num_sampled, s.packed_ints[1]) for s in states],
                            dtype=torch.int64)
        # New rows' penalty tables are built here, on the thread that samples, from host ids: a state
        # holds no device tensor until then (it is made on the event loop, SamplingState.create).
        prompt_cells, recorded_cells = _cells(fresh)
        parts = upload_parts(self.device, ints.view(-1), torch.tensor(survivors if gather else [], dtype=torch.int64),
                      torch.tensor(seeded, dtype=torch.int64), prompt_cells.view(-1), recorded_cells.view(-1),
                      torch.tensor([s.packed_floats for s in states], dtype=torch.float32).view(-1))
        ints_dev, survivor_rows, seeded_rows, prompt_cells, recorded_cells, floats = parts
        ints_dev = ints_dev.view(n, _INT_COLUMNS)
        counts = prompt = None
        if any_penalised:
            counts, prompt = self._penalty_tables(old, survivor_rows, k if gather else 0, states, fresh,
                                                  prompt_cells.view(2, -1), recorded_cells.view(2, -1))
        self._tables = _Tables(
            floats=floats.view(n, len(FloatColumn)),
            keys=ints_dev[:, 0], steps=ints_dev[:, 1], top_k=ints_dev[:, 2], counts=counts, prompt=prompt,
            truncates=any(s.truncates for s in states), seeded_rows=seeded_rows if seeded else None,
            unseeded=any(not s.greedy and not s.seeded for s in states),
            top_counts=top_counts, top_width=min(max(top_counts), self.vocab_size))
        for row, state in enumerate(states):
            if state._row is None:
                state._joined_tick = self._tick
            state._row = row
            state._counts = None  # the table holds them now
        self._dirty = False

    def _penalty_tables(self, old: _Tables | None, survivor_rows: torch.Tensor, gathered: int,
                        states: list[SamplingState], fresh: list[SamplingState], prompt_cells: torch.Tensor,
                        recorded_cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[B, V]` counts and prompt tables: survivors' rows gathered from `old`, new rows' from their
        states and the `(new row, token)` cells of their prompts and recorded tokens (`_cells`)."""
        vocab, device = self.vocab_size, self.device
        zeros = torch.zeros(vocab, dtype=torch.float32, device=device)
        parts = []
        kept = len(states) - len(fresh)
        if gathered:
            parts.append(old.counts.index_select(0, survivor_rows))
        elif kept:  # no survivor was penalised, so their counts are all zero
            parts.append(torch.zeros(kept, vocab, dtype=torch.float32, device=device))
        if fresh:
            block = torch.stack([s._counts if s._counts is not None else zeros for s in fresh])
            if recorded_cells.shape[1]:
                block.index_put_((recorded_cells[0], recorded_cells[1]),
                                 torch.ones((), dtype=torch.float32, device=device), accumulate=True)
            parts.append(block)
        counts = torch.cat(parts) if len(parts) > 1 else parts[0]
        if not any(s.params.repetition_penalty != 1.0 for s in states):
            return counts, None
        parts = []
        if gathered and old.prompt is not None:
            parts.append(old.prompt.index_select(0, survivor_rows))
        elif kept:  # no survivor has a repetition penalty
            parts.append(torch.zeros(kept, vocab, dtype=torch.bool, device=device))
        if fresh:
            block = torch.zeros(len(fresh), vocab, dtype=torch.bool, device=device)
            block.index_put_((prompt_cells[0], prompt_cells[1]), torch.ones((), dtype=torch.bool, device=device))
            parts.append(block)
        return (counts, torch.cat(parts) if len(parts) > 1 else parts[0])


def _cells(fresh: list[SamplingState]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[2, N]` int64 host tables of (row among `fresh`, token) cells: each new row's prompt tokens
    (repetition penalty) and the tokens recorded into it before it had counts (taken from it)."""
    prompt, recorded = [np.empty((2, 0), dtype=np.int64)], [np.empty((2, 0), dtype=np.int64)]
    for row, state in enumerate(fresh):
        if not state.penalised:
            continue
        ids = state.prompt_token_ids()
        if ids.size:
            prompt.append(np.stack([np.full_like(ids, row), ids]))
        tokens = state.take_recorded() if state._counts is None else []
        if tokens:
            recorded.append(np.array([[row] * len(tokens), tokens], dtype=np.int64))
    return torch.from_numpy(np.concatenate(prompt, axis=1)), torch.from_numpy(np.concatenate(recorded, axis=1))


def _normalise(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
