"""Static buffers of piecewise extend graphs: token-count buckets, padded inputs, the cores' seams.

A captured piece (model/extend_graph_pieces.py) reads and writes fixed device addresses, so an
extend of n tokens runs at the smallest bucket N >= n (64, 128, 256, .. below the largest, then the
largest, `extend_graph_max_tokens`): its rows are the real tokens first, then N - n padding rows.
Every buffer is sized for the largest bucket and a bucket uses its first N rows (buckets replay one
at a time, so they share them):

    packed        [3, N_max] long: input ids | positions | KV slots, the pieces' inputs
    core inputs   q_nope, q_pe, c_kv, k_pe of N_max rows: what a piece leaves for the eager core
    attn_output   [N_max, hidden]: what the eager core leaves for the next piece

Per forward, `load` copies the real batch's ids, positions and slots into rows [0, n) and the
padding template into rows [n, N): padding rows embed token 0 at position 0 and write their KV into
the scratch page (one page the runner keeps for itself, as the decode graphs' padding rows do:
model/graph_inputs.py), slot `scratch * page_size + row % page_size`, so they never touch a page a
request owns. The eager core reads only the first n rows of its inputs and writes only the first n
of attn_output (`load` zeroes the rest): padding rows go on through the pieces, and no piece op
mixes rows, so they change nothing in the real rows; their results are never read.

Example, page_size 4, scratch page 9, bucket 64, one sequence of 3 tokens at prefix 5 on pages [7, 2]:
    ids [t0, t1, t2, 0, ..]  positions [5, 6, 7, 0, ..]  slots [9, 10, 11, 36 + 3, 36 + 0, 36 + 1, ..]
"""
from __future__ import annotations

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention.mla import AttnIntermediate
from deepseek_pd.model.forward_batch import AttentionMethod, ForwardBatch, ForwardMode
from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.runner_rules import range_blocker

EXTEND_GRAPH_MIN_TOKENS = 64  # the smallest bucket: below it the per-piece copies outweigh little launch time


def extend_graph_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts captured: 64, 128, 256, .. below `max_tokens`, then `max_tokens` itself."""
    if (blocker := range_blocker(extend_graph_max_tokens=max_tokens)) is not None:
        raise UserError(blocker)
    sizes, size = [], EXTEND_GRAPH_MIN_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, max_tokens)


class StaticExtendInputs:
    """The static buffers (module docstring) of one model and KV pool, shared by every bucket."""

    def __init__(self, max_tokens: int, kv_pool: KVPool, scratch_page: int, *, heads: int, nope_dim: int,
                 rope_dim: int, kv_lora_rank: int, hidden_size: int, dtype: torch.dtype) -> None:
        if not 0 <= scratch_page < kv_pool.num_pages:
            raise ValueError(f"scratch page {scratch_page} outside the pool (0..{kv_pool.num_pages - 1})")
        self.max_tokens = max_tokens
        self.kv_pool = kv_pool
        self.scratch_page = scratch_page
        device, n = kv_pool.device, max_tokens
        self.packed = torch.zeros(3, n, dtype=torch.long, device=device)
        rows = torch.arange(n, dtype=torch.long)
        template = torch.stack([torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                                scratch_page * kv_pool.page_size + rows % kv_pool.page_size])
        self._template = template.to(device)
        self.packed.copy_(self._template)
        kw = dict(dtype=dtype, device=device)
        self.q_nope = torch.zeros(n, heads, nope_dim, **kw)
        self.q_pe = torch.zeros(n, heads, rope_dim, **kw)
        self.c_kv = torch.zeros(n, kv_lora_rank, **kw)
        self.k_pe = torch.zeros(n, rope_dim, **kw)
        self.attn_output = torch.zeros(n, hidden_size, **kw)

    def load(self, batch: ForwardBatch, bucket: int) -> None:
        """Rows [0, n) from the real batch (device copies, no upload), rows [n, bucket) padding."""
        n = batch.num_tokens
        if not 1 <= n <= bucket <= self.max_tokens:
            raise ValueError(f"{n} tokens do not fit bucket {bucket} (largest {self.max_tokens})")
        self.packed[0, :n].copy_(batch.input_ids)
        self.packed[1, :n].copy_(batch.positions)
        self.packed[2, :n].copy_(batch.out_slots)
        if n < bucket:
            self.packed[:, n:bucket].copy_(self._template[:, n:bucket])
            # The cores write rows [0, n) only: the padding rows' attention output is zero for the whole
            # forward, never a value an earlier forward left (which could be another request's NaN).
            self.attn_output[n:bucket].zero_()

    def load_padding(self, bucket: int) -> None:
        """Rows [0, bucket) all padding (what the buffers hold while a bucket is captured)."""
        self.packed[:, :bucket].copy_(self._template[:, :bucket])

    def piece_batch(self, bucket: int) -> ForwardBatch:
        """The batch the pieces of `bucket` run over: the static rows as one sequence. Pieces read only
        its ids, positions, slots, pool and mode (row-wise ops); the sequence layout is a placeholder."""
        device = self.packed.device
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.packed[0, :bucket], positions=self.packed[1, :bucket],
            out_slots=self.packed[2, :bucket], token_seq=torch.zeros(bucket, dtype=torch.long, device=device),
            qo_indptr=upload(torch.tensor([0, bucket], dtype=torch.long), device),
            page_table=torch.full((1, 1), self.scratch_page, dtype=torch.long, device=device),
            seq_lens_t=upload(torch.tensor([bucket], dtype=torch.long), device), prefix_lens=(0,),
            extend_lens=(bucket,), kv_pool=self.kv_pool, attention_method=AttentionMethod.MHA,
            page_lists=((self.scratch_page,),))

    def store_core_inputs(self, inter: AttnIntermediate) -> None:
        """A piece's last act: its attention intermediate into the core's static inputs."""
        rows = inter.q_nope.shape[0]
        self.q_nope[:rows].copy_(inter.q_nope)
        self.q_pe[:rows].copy_(inter.q_pe)
        self.c_kv[:rows].copy_(inter.c_kv)
        self.k_pe[:rows].copy_(inter.k_pe)

    def core_inputs(self, num_tokens: int) -> AttnIntermediate:
        """The real rows of the core's inputs (views)."""
        n = num_tokens
        return AttnIntermediate(self.q_nope[:n], self.q_pe[:n], self.c_kv[:n], self.k_pe[:n])
