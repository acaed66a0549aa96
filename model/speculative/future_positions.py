"""Future positions: a speculative step's positions and KV slots computed on the device, from the
previous step's accepted counts, so the host can launch step N+1 before it reads step N's result.

Step N+1 of a request starts where step N's emitted tokens end: its first position is step N's
first position plus the tokens step N emitted (1..k+1), a count that lives on the device until
step N is read back. The host knows only a range for it, so it builds the step's batch with an
upper bound (`FuturePositions.bounds`: every host length a kernel sizes a loop or a grid by,
never less than the truth) and the device fills in the exact values (`starts`):

    positions  = starts[seq] + j                       (j: the token's index in its sequence)
    out_slots  = page_table[seq, positions // page] * page + positions % page
    seq_lens_t = starts + extend_lens

Kernels read the exact values from these tensors (attention masks by position, KV writes go to
`out_slots`), and the host lengths only bound the work (`ForwardBatch`'s capture-time bounds in
CUDA graphs are the same idea). SGLang's overlap scheduler does this for token ids (`FutureMap`:
a batch's input ids are negative placeholders resolved on the device from the step before); here
positions and slots are future too, and the token ids come straight from the last step's draws.

Worked example, page size 4, one request with pages [7, 2, 5] (positions 0..11), step N started
at position 5 with 2 drafts (so it may emit 1..3 tokens) and emitted 2; step N+1 drafts 2 again:
    step N      starts [5]  bounds (5,)
    step N+1    starts [5 + 2] = [7]  bounds (min(5 + 3, room 11 - 2),) = (8,)
    its verify of 3 tokens: positions [7, 8, 9], out_slots [2*4+3, 5*4+0, 5*4+1], seq_lens [10]

A request that may have finished in step N (the host does not know yet) still gets a row in step
N+1 (the rows must stay those of step N: the sampling batch's device state is kept by row). Its
start is clamped to the last position its pages can take (`room`), so its writes stay in its own
pages; a request that did not finish is never clamped (its positions stay inside its budget, and
the draft count the host chose from the bound keeps them there: decoder.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.host_copy import upload


@dataclass(frozen=True)
class FuturePositions:
    """Each row's first new position: exact on the device, bounded on the host.

    `starts` `[B]` long on the device; `bounds` the host's upper bound of each (the prefix length the
    host builds the batch with)."""

    starts: torch.Tensor
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.starts.shape != (len(self.bounds),) or self.starts.dtype != torch.long:
            raise ValueError(f"starts must be [{len(self.bounds)}] long, got {tuple(self.starts.shape)} "
                             f"{self.starts.dtype}")

    @classmethod
    def known(cls, positions: Sequence[int], device: torch.device | str) -> "FuturePositions":
        """Positions the host knows exactly (a step launched after the previous one was read)."""
        host = torch.tensor(list(positions), dtype=torch.long)
        return cls(upload(host, device), tuple(int(p) for p in positions))

    def advanced(self, emitted: torch.Tensor, most: Sequence[int], room: Sequence[int]) -> "FuturePositions":
        """The next step's starts: these plus `emitted` `[B]` (device, each in 1..most[i]); each start
        at most `room[i]` (the last start a row's pages can take with its next step's tokens)."""
        if not len(most) == len(room) == len(self.bounds):
            raise ValueError(f"{len(most)} counts and {len(room)} rooms for {len(self.bounds)} rows")
        bounds = tuple(min(b + m, r) for b, m, r in zip(self.bounds, most, room))
        if any(b < 0 for b in bounds):
            raise ValueError(f"no room for the next step's tokens: bounds {bounds}")
        cap = upload(torch.tensor(bounds, dtype=torch.long), self.starts.device)
        return FuturePositions(torch.minimum(self.starts + emitted, cap), bounds)


def with_device_starts(batch: ForwardBatch, starts: torch.Tensor) -> ForwardBatch:
    """`batch` (built with host prefix lengths that bound the true ones) with its positions, KV slots
    and lengths recomputed on the device from `starts` `[B]` (each sequence's true first new
    position); nothing is read back. Returns the same batch object."""
    if starts.shape != (batch.batch_size,):
        raise ValueError(f"starts must be [{batch.batch_size}], got {tuple(starts.shape)}")
    seq = batch.token_seq
    index_in_seq = torch.arange(batch.num_tokens, device=seq.device) - batch.qo_indptr.index_select(0, seq)
    batch.positions = starts.index_select(0, seq) + index_in_seq
    batch.out_slots = slots(batch.page_table.index_select(0, seq), batch.positions, batch.kv_pool.page_size)
    batch.seq_lens_t = starts + (batch.qo_indptr[1:] - batch.qo_indptr[:-1])
    batch.derived.clear()  # nothing derived from the host-built tensors survives
    return batch


def fill_static(positions: torch.Tensor, out_slots: torch.Tensor, seq_lens: torch.Tensor,
                page_table: torch.Tensor, starts: torch.Tensor, q: int, page_size: int) -> None:
    """A captured graph's static inputs of its first `n = len(starts)` rows of q tokens each, in
    place (the host packed them from the bounds): `positions`/`out_slots` `[n*q]`, `seq_lens` `[n]`,
    `page_table` `[n, W]`."""
    n = starts.shape[0]
    pos = (starts.unsqueeze(1) + torch.arange(q, device=starts.device)).reshape(-1)
    positions[:n * q].copy_(pos)
    out_slots[:n * q].copy_(slots(page_table[:n].repeat_interleave(q, dim=0, output_size=n * q), pos, page_size))
    seq_lens[:n].copy_(starts + q)


def slots(page_rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """The flat KV slot of each token: `page_rows` `[T, W]` (its sequence's page table row) at
    `positions` `[T]`."""
    return page_rows.gather(1, (positions // page_size).unsqueeze(1)).squeeze(1) * page_size + positions % page_size
