"""`ForwardBatch`: everything one model forward needs besides the weights.

Tokens of all sequences are packed ("ragged") along one axis `T`. Host-side lengths are plain
tuples (known before launch, so kernels and chunk loops never `.item()` the device); the same
information lives in device tensors for kernels.

Example: two sequences, the first with a cached prefix of 3 tokens and 2 new ones, the second a
fresh 4-token prompt, page_size 2:
    prefix_lens=(3, 0), extend_lens=(2, 4), seq_lens=(5, 4), qo_indptr=[0, 2, 6]
    positions=[3, 4, 0, 1, 2, 3], token_seq=[0, 0, 1, 1, 1, 1]
    page_table row 0 = that request's pages, padded to the longest page list with its own last page.

Padding repeats the row's own page, never page 0 or any other page: a padded column then reads
only memory that the row's own request owns, so KV that arrived for another request (perhaps
NaN from a bad peer, not yet checked) cannot reach this row even through a kernel that reads
padding. Kernels still mask padded and out-of-range positions by selecting, never by
multiplying (`model/attention/torch_backend.py`, `kernels/mla_decode.py`).
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.host_copy import upload_parts
from deepseek_pd.model.kv.pool import KVPool


class ForwardMode(enum.Enum):
    """EXTEND: new prompt tokens (possibly after a cached prefix). DECODE: one new token per sequence."""

    EXTEND = "extend"
    DECODE = "decode"


class AttentionMethod(enum.Enum):
    """How attention is computed for a batch; all give the same result (a tested property).

    MHA: up-project the new tokens' latent to per-head K/V, causal attention (no prefix).
    MHA_CHUNKED_KV: MHA for the new tokens plus the cached prefix read from the paged latent cache in
        chunks, up-projected, attended, and merged by log-sum-exp.
    MLA: absorbed; queries move into the latent space (`q_nope @ w_kc`), attend over the paged
        latent cache directly, and the output leaves through `w_vc`.
    """

    MHA = "mha"
    MHA_CHUNKED_KV = "mha_chunked_kv"
    MLA = "mla"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    out_slots: torch.Tensor  # [T] long: flat KV slot each new token is written to
    token_seq: torch.Tensor  # [T] long: which sequence each token belongs to
    qo_indptr: torch.Tensor  # [B+1] long
    page_table: torch.Tensor  # [B, max_pages] long, each row padded with its own last page
    seq_lens_t: torch.Tensor  # [B] long: prefix + new tokens
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    kv_pool: KVPool
    attention_method: AttentionMethod = AttentionMethod.MLA
    page_lists: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # Per-batch metadata derived lazily by layers and shared by all of them (e.g. prefix chunks).
    derived: dict = field(default_factory=dict, repr=False)
    # One rank of a group: the step's mode over all ranks (EXTEND if any rank extends), which the
    # EP collectives follow (model/distributed/step_sync.py); None: this batch's own mode.
    group_mode: ForwardMode | None = None
    # The static batch of a captured decode CUDA graph (model/graph_inputs.py): its bucket, else None.
    # Its host lengths are capture-time bounds; a backend that plans on the host keeps its plan per
    # bucket and re-plans it before each replay (`prepare_replay`, model/cuda_graph.py).
    graph_bucket: int | None = None
    # [T] long: 1 where a token's expert choices count in the expert load (model/moe/expert_load.py),
    # 0 where they do not: a void row of a speculative step launched ahead (its request ended in the
    # step before; model/speculative/decoder.py), which is no request's work. None: every token counts.
    counted_tokens: torch.Tensor | None = None

    @property
    def ep_mode(self) -> ForwardMode:
        """The mode the MoE dispatcher and the TBO schedule of this step follow on every rank."""
        return self.group_mode if self.group_mode is not None else self.mode

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens))

    @property
    def qo_offsets(self) -> tuple[int, ...]:
        """Host copy of qo_indptr."""
        out = [0]
        for n in self.extend_lens:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] index of each sequence's last new token in the packed axis."""
        return self.qo_indptr[1:] - 1

    @classmethod
    def build(cls, mode: ForwardMode, token_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
              pages: Sequence[Sequence[int]], kv_pool: KVPool, vocab_size: int,
              device: torch.device | str) -> "ForwardBatch":
        """Validates and packs a batch. Raises UserError on input a caller could get wrong."""
        if not token_ids:
            raise UserError("empty batch")
        if not (len(token_ids) == len(prefix_lens) == len(pages)):
            raise UserError("token_ids, prefix_lens and pages must have one entry per sequence")
        page_size = kv_pool.page_size
        # Python lists, then one tensor each: a per-sequence torch op costs microseconds, which at a
        # decode batch of hundreds added up to a fifth of an eager CPU step.
        flat_ids: list[int] = []
        page_lists: list[tuple[int, ...]] = []
        prefixes: list[int] = []
        extend_lens_l: list[int] = []
        for i, (ids, prefix, seq_pages) in enumerate(zip(token_ids, prefix_lens, pages)):
            ids_l = _ints(ids, f"sequence {i}: token ids")
            if not ids_l:
                raise UserError(f"sequence {i}: no new tokens")
            prefix = _ints([prefix], f"sequence {i}: prefix_len")[0]
            if prefix < 0:
                raise UserError(f"sequence {i}: prefix_len {prefix} < 0")
            total = prefix + len(ids_l)
            if len(seq_pages) * page_size < total:
                raise UserError(f"sequence {i}: {len(seq_pages)} pages of {page_size} cannot hold {total} tokens")
            pages_l = _ints(seq_pages, f"sequence {i}: pages")
            if min(pages_l) < 0 or max(pages_l) >= kv_pool.num_pages:
                raise UserError(f"sequence {i}: page ids {pages_l} reach outside the pool "
                                f"(0..{kv_pool.num_pages - 1})")
            if min(ids_l) < 0 or max(ids_l) >= vocab_size:
                raise UserError(f"sequence {i}: token id outside the vocabulary (0..{vocab_size - 1})")
            flat_ids.extend(ids_l)
            page_lists.append(tuple(pages_l))
            prefixes.append(prefix)
            extend_lens_l.append(len(ids_l))
        extend_lens = tuple(extend_lens_l)
        if mode is ForwardMode.DECODE and any(n != 1 for n in extend_lens):
            raise UserError("a decode batch has exactly one new token per sequence")
        qo = [0]
        for n in extend_lens:
            qo.append(qo[-1] + n)
        max_pages = max(1, max(len(p) for p in page_lists))
        table = torch.tensor([list(p) + [p[-1]] * (max_pages - len(p)) for p in page_lists], dtype=torch.long)
        lens_t = torch.tensor(extend_lens, dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(len(extend_lens)), lens_t, output_size=len(flat_ids))
        # Each token's position: its prefix plus its index among its sequence's new tokens.
        starts = torch.tensor(qo[:-1], dtype=torch.long)
        positions = (torch.arange(len(flat_ids)) - starts[seq_of_token]
                     + torch.tensor(prefixes, dtype=torch.long)[seq_of_token])
        slots = table[seq_of_token, positions // page_size] * page_size + positions % page_size

        # One pinned, asynchronous upload for all seven (`upload_parts`): a pageable copy waits in
        # the driver for the forward queued before it, and holds up other threads' copies meanwhile.
        input_ids, positions, slots, seq_of_token, qo_indptr, table, seq_lens = upload_parts(
            device, torch.tensor(flat_ids, dtype=torch.long), positions, slots, seq_of_token,
            torch.tensor(qo, dtype=torch.long), table,
            torch.tensor([p + e for p, e in zip(prefixes, extend_lens)], dtype=torch.long))
        return cls(
            mode=mode, input_ids=input_ids, positions=positions, out_slots=slots, token_seq=seq_of_token,
            qo_indptr=qo_indptr, page_table=table, seq_lens_t=seq_lens,
            prefix_lens=tuple(prefixes), extend_lens=extend_lens, kv_pool=kv_pool,
            page_lists=tuple(page_lists),
        )


def checked_device_ids(input_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`input_ids` when it is `[num_tokens]` long: device token ids that replace a batch's host ones
    (a step fed by the previous step's samples, never read back). Else a ValueError."""
    if input_ids.shape != (num_tokens,) or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be [{num_tokens}] long, got {tuple(input_ids.shape)} {input_ids.dtype}")
    return input_ids


def _ints(values: Sequence[int], what: str) -> list[int]:
    """`values` as Python ints (Python, NumPy or 0-d tensor integers), or a UserError."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dim() != 1:
            raise UserError(f"{what} must be a sequence of integers")
        return values.tolist()
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise UserError(f"{what} must be a sequence of integers") from None
