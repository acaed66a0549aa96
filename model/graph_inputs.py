"""Static decode inputs for CUDA graphs: batch-size buckets, padding, and one packed upload.

A captured graph reads its inputs from fixed device addresses, so every decode step copies its
inputs into the same buffers. All five inputs live in ONE packed int64 device tensor, filled by
one host→device copy per step:

    [ input_ids (B) | positions (B) | out_slots (B) | seq_lens (B) | page_table (B x W) ]

B is the bucket (the captured batch size), W the page-table width fixed at capture
(`ceil(max_context / page_size)`). A batch of n < B sequences is padded with B - n rows that
decode token 0 at position 0 into slot 0 of a *scratch page* (one page the graph runner keeps
allocated for itself), with a page-table row of scratch pages only: a padded row never reads or
writes a page a request owns. Real rows' unused page-table columns also point at the scratch page
(they are masked by `seq_lens`, but then not even a stray read reaches a real page).

The host-side lengths of the static `ForwardBatch` are the capture-time upper bound (every
sequence "W * page_size long"), so anything a backend derives from them on the host (e.g. the MLA
decode split count) is fixed per capture; the real lengths live only in `seq_lens` on the device.
A backend that must plan on the host from the real lengths (FlashInfer) gets them before each
replay instead (`replay_layout`, `prepare_replay` in cuda_graph.py).

Example, page_size 4, W 2, bucket 2, scratch page 9, one sequence at position 5 with pages [7, 2]:
    input_ids [t, 0]  positions [5, 0]  out_slots [2*4+1, 9*4]  seq_lens [6, 1]
    page_table [[7, 2], [9, 9]]
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import AttentionMethod, ForwardBatch, ForwardMode
from deepseek_pd.model.host_copy import upload_into
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.runner_rules import range_blocker


@dataclass(frozen=True)
class CudaGraphConfig:
    """Which decode batches are captured: sizes up to `max_batch`, contexts up to `max_context` tokens."""

    max_batch: int = 128
    max_context: int = 4096

    def __post_init__(self) -> None:
        if (blocker := range_blocker(cuda_graph_max_batch=self.max_batch,
                                     cuda_graph_max_context=self.max_context)) is not None:
            raise UserError(blocker)

    def buckets(self) -> tuple[int, ...]:
        return graph_buckets(self.max_batch)

    def table_width(self, page_size: int) -> int:
        return -(-self.max_context // page_size)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below `max_batch`, then `max_batch` itself: 1, 2, 4, ..., max_batch."""
    if (blocker := range_blocker(cuda_graph_max_batch=max_batch)) is not None:
        raise UserError(blocker)
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch)
    return tuple(sizes)


def bucket_for(buckets: Sequence[int], batch_size: int) -> int | None:
    """The smallest bucket that holds `batch_size` sequences; None when none does (or the batch is empty)."""
    if batch_size < 1:
        return None
    for bucket in buckets:
        if bucket >= batch_size:
            return bucket
    return None


class StaticDecodeInputs:
    """The packed input buffer of one bucket, its views, and the host packing of a step's batch."""

    def __init__(self, bucket: int, table_width: int, kv_pool: KVPool, scratch_page: int, vocab_size: int) -> None:
        if not 0 <= scratch_page < kv_pool.num_pages:
            raise ValueError(f"scratch page {scratch_page} outside the pool (0..{kv_pool.num_pages - 1})")
        self.bucket = bucket
        self.table_width = table_width
        self.kv_pool = kv_pool
        self.scratch_page = scratch_page
        self.vocab_size = vocab_size
        device = kv_pool.device
        b, w = bucket, table_width
        self.packed = torch.zeros(4 * b + b * w, dtype=torch.long, device=device)
        self.input_ids = self.packed[0:b]
        self.positions = self.packed[b:2 * b]
        self.out_slots = self.packed[2 * b:3 * b]
        self.seq_lens = self.packed[3 * b:4 * b]
        self.page_table = self.packed[4 * b:].view(b, w)
        # Constant for a decode batch of B rows: one token per sequence.
        self.token_seq = torch.arange(b, dtype=torch.long, device=device)
        self.qo_indptr = torch.arange(b + 1, dtype=torch.long, device=device)
        self._max_context = w * kv_pool.page_size
        # Padding row pieces (Python lists, reused every step).
        self._pad_table_row = [scratch_page] * w
        self.load(self.pack_padding_only())

    # ---- host side ---------------------------------------------------------------------------
    def fits(self, positions: Sequence[int]) -> bool:
        """Whether every sequence's context (position + 1 tokens) fits the captured table width."""
        return all(p < self._max_context for p in positions)

    def pack(self, token_ids: Sequence[int], positions: Sequence[int],
             pages: Sequence[Sequence[int]]) -> torch.Tensor:
        """The packed host tensor of one step (padded to the bucket), validated like `ForwardBatch.build`.

        The caller checked `fits(positions)` and `len(token_ids) <= bucket`.
        """
        n, b, w = len(token_ids), self.bucket, self.table_width
        if not (n == len(positions) == len(pages)) or not 1 <= n <= b:
            raise ValueError(f"{n} token ids / {len(positions)} positions / {len(pages)} page lists for bucket {b}")
        page_size = self.kv_pool.page_size
        scratch_slot = self.scratch_page * page_size
        ids, pos, slots, lens, table = [], [], [], [], []
        for i in range(n):
            token, position = _as_int(token_ids[i], i, "token id"), _as_int(positions[i], i, "position")
            seq_pages = pages[i]
            if position < 0:
                raise UserError(f"sequence {i}: prefix_len {position} < 0")
            if len(seq_pages) * page_size <= position:
                raise UserError(f"sequence {i}: {len(seq_pages)} pages of {page_size} "
                                f"cannot hold {position + 1} tokens")
            ids.append(token)
            pos.append(position)
            slots.append(_as_int(seq_pages[position // page_size], i, "page") * page_size + position % page_size)
            lens.append(position + 1)
            row = list(seq_pages[:w])
            table.extend(row)
            table.extend(self._pad_table_row[:w - len(row)])
        pad = b - n
        host = torch.tensor(ids + [0] * pad + pos + [0] * pad + slots + [scratch_slot] * pad + lens + [1] * pad
                            + table + self._pad_table_row * pad, dtype=torch.long)
        self._validate(host, n)
        return host

    def pack_padding_only(self) -> torch.Tensor:
        """A step of padding rows only (what the buffers hold while capturing)."""
        b, page_size = self.bucket, self.kv_pool.page_size
        return torch.tensor([0] * b + [0] * b + [self.scratch_page * page_size] * b + [1] * b
                            + self._pad_table_row * b, dtype=torch.long)

    def _validate(self, host: torch.Tensor, n: int) -> None:
        b, w = self.bucket, self.table_width
        ids = host[:n]
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            bad = next(i for i, t in enumerate(ids.tolist()) if not 0 <= t < self.vocab_size)
            raise UserError(f"sequence {bad}: token id outside the vocabulary (0..{self.vocab_size - 1})")
        table = host[4 * b:4 * b + n * w]
        if int(table.min()) < 0 or int(table.max()) >= self.kv_pool.num_pages:
            bad = next(i for i in range(n) if not 0 <= int(table[i * w:(i + 1) * w].min())
                       <= int(table[i * w:(i + 1) * w].max()) < self.kv_pool.num_pages)
            raise UserError(f"sequence {bad}: page ids reach outside the pool (0..{self.kv_pool.num_pages - 1})")

    # ---- device side -------------------------------------------------------------------------
    def load(self, host: torch.Tensor) -> None:
        """The one host→device copy of a step. On CUDA through pinned memory, asynchronously: torch's
        pinned-memory cache keeps the staging block until the copy has run, and a pageable
        `copy_` would block the host on the previous step every time."""
        upload_into(self.packed, host)

    def forward_batch(self) -> ForwardBatch:
        """A fresh `ForwardBatch` over the static buffers (fresh so `derived` is rebuilt where it is
        computed: inside the captured forward, never carried over from a warm-up run)."""
        b = self.bucket
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids, positions=self.positions, out_slots=self.out_slots,
            token_seq=self.token_seq, qo_indptr=self.qo_indptr, page_table=self.page_table,
            seq_lens_t=self.seq_lens, prefix_lens=(self._max_context - 1,) * b, extend_lens=(1,) * b,
            kv_pool=self.kv_pool, attention_method=AttentionMethod.MLA,
            page_lists=(tuple(self._pad_table_row),) * b, graph_bucket=b)

    def replay_layout(self, positions: Sequence[int],
                      pages: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """Host lengths and page lists of every row of a step as `pack` lays it out (padding rows:
        one token on the scratch page), for backends that re-plan before a replay."""
        pad = self.bucket - len(positions)
        lengths = tuple(p + 1 for p in positions) + (1,) * pad
        return lengths, tuple(tuple(p) for p in pages) + ((self.scratch_page,),) * pad


def _as_int(value: object, index: int, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise UserError(f"sequence {index}: {what} must be an integer, got {value!r}") from None
