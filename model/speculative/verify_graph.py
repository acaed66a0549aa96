"""`VerifyGraphRunner`: the speculative verify forward captured as one CUDA graph per batch bucket.

A verify (model/speculative/decoder.py) is an extend of `q = k + 1` tokens per sequence, the last
emitted token and its k drafts, through absorbed MLA over the paged cache; it returns every
token's final-normed hidden state. With every sequence drafting the configured k (the common
step) its shape depends only on the batch size, so it is captured per bucket like decode
(model/cuda_graph.py), from one packed static buffer, one host→device copy per step:

    [ input_ids (B*q) | positions (B*q) | out_slots (B*q) | seq_lens (B) | page_table (B x W) ]

Sequence i's tokens are rows i*q .. i*q + q - 1, as `ForwardBatch.build` lays them out, so the
first n*q rows of the output are the eager forward's. Padding rows extend q tokens at positions
0..q-1 on the scratch page (slot j % page_size: garbage, never a request's page). The Triton
`mla_extend` reads per-token page-table rows and lengths from the device; the host lengths are
capture-time bounds, as in decode.

The catch-up (the MTP layer over the emitted tokens) is captured the same way with `mtp`: the
decoder pads it to all q positions when the verify had q per sequence (decoder.py says why that
leaves the outputs unchanged).

Steps whose sequences draft fewer tokens (near max_new, or a request without a draft yet) are padded
to a captured length by the decoder (decoder.py); a batch or context past the graphs, and EP groups
(a verify is an extend: DeepEP's normal mode, which does not capture), run eagerly.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.cuda_graph import capture_per_bucket, check_capturable
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.forward_batch import AttentionMethod, ForwardBatch, ForwardMode
from deepseek_pd.model.graph_inputs import CudaGraphConfig, bucket_for
from deepseek_pd.model.host_copy import upload_into
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.speculative.future_positions import fill_static

log = logging.getLogger(__name__)


class StaticVerifyInputs:
    """The packed input buffer of one bucket's verify (q tokens per sequence) and its host packing."""

    def __init__(self, bucket: int, q: int, table_width: int, kv_pool: KVPool, scratch_page: int,
                 vocab_size: int) -> None:
        if not 0 <= scratch_page < kv_pool.num_pages:
            raise ValueError(f"scratch page {scratch_page} outside the pool (0..{kv_pool.num_pages - 1})")
        self.bucket, self.q, self.table_width = bucket, q, table_width
        self.kv_pool, self.scratch_page, self.vocab_size = kv_pool, scratch_page, vocab_size
        b, t, w, device = bucket, bucket * q, table_width, kv_pool.device
        self.packed = torch.zeros(3 * t + b + b * w, dtype=torch.long, device=device)
        self.input_ids = self.packed[0:t]
        self.positions = self.packed[t:2 * t]
        self.out_slots = self.packed[2 * t:3 * t]
        self.seq_lens = self.packed[3 * t:3 * t + b]
        self.page_table = self.packed[3 * t + b:].view(b, w)
        self.token_seq = torch.arange(b, dtype=torch.long, device=device).repeat_interleave(q)
        self.qo_indptr = torch.arange(b + 1, dtype=torch.long, device=device) * q
        self._max_context = w * kv_pool.page_size
        self._pad_table_row = [scratch_page] * w
        self.load(self.pack_padding_only())

    def fits(self, prefix_lens: Sequence[int]) -> bool:
        return all(p + self.q <= self._max_context for p in prefix_lens)

    def _padding(self, rows: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        page_size, q = self.kv_pool.page_size, self.q
        pos = list(range(q)) * rows
        slots = [self.scratch_page * page_size + j % page_size for j in range(q)] * rows
        return [0] * (q * rows), pos, slots, [q] * rows, self._pad_table_row * rows

    def pack(self, token_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
             pages: Sequence[Sequence[int]]) -> torch.Tensor:
        """One step's packed host tensor (padded to the bucket). The caller checked the bucket,
        `fits`, and that every sequence has q tokens."""
        n, q, w, page_size = len(token_ids), self.q, self.table_width, self.kv_pool.page_size
        if not (n == len(prefix_lens) == len(pages)) or not 1 <= n <= self.bucket:
            raise ValueError(f"{n} sequences / {len(prefix_lens)} prefixes / {len(pages)} page lists "
                             f"for bucket {self.bucket}")
        ids, pos, slots, lens, table = [], [], [], [], []
        for i in range(n):
            tokens, prefix, seq_pages = list(token_ids[i]), int(prefix_lens[i]), [int(p) for p in pages[i]]
            if len(tokens) != q:
                raise ValueError(f"sequence {i}: {len(tokens)} tokens, the graph verifies {q}")
            if prefix < 0 or len(seq_pages) * page_size < prefix + q:
                raise UserError(f"sequence {i}: {len(seq_pages)} pages of {page_size} cannot hold "
                                f"{prefix + q} tokens")
            ids.extend(tokens)
            for p in range(prefix, prefix + q):
                pos.append(p)
                slots.append(seq_pages[p // page_size] * page_size + p % page_size)
            lens.append(prefix + q)
            table.extend(seq_pages[:w] + self._pad_table_row[:w - len(seq_pages[:w])])
        pad_ids, pad_pos, pad_slots, pad_lens, pad_table = self._padding(self.bucket - n)
        host = torch.tensor(ids + pad_ids + pos + pad_pos + slots + pad_slots + lens + pad_lens + table + pad_table,
                            dtype=torch.long)
        real_ids, real_table = host[:n * q], host[-self.bucket * w:][:n * w]
        if int(real_ids.min()) < 0 or int(real_ids.max()) >= self.vocab_size:
            raise UserError(f"a token id outside the vocabulary (0..{self.vocab_size - 1})")
        if int(real_table.min()) < 0 or int(real_table.max()) >= self.kv_pool.num_pages:
            raise UserError(f"page ids reach outside the pool (0..{self.kv_pool.num_pages - 1})")
        return host

    def pack_padding_only(self) -> torch.Tensor:
        ids, pos, slots, lens, table = self._padding(self.bucket)
        return torch.tensor(ids + pos + slots + lens + table, dtype=torch.long)

    def load(self, host: torch.Tensor) -> None:
        """The one host→device copy of a step (pinned and asynchronous on CUDA, as decode's)."""
        upload_into(self.packed, host)

    def forward_batch(self) -> ForwardBatch:
        """A fresh extend batch over the static buffers; host lengths are the capture-time bounds."""
        b, q = self.bucket, self.q
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.input_ids, positions=self.positions, out_slots=self.out_slots,
            token_seq=self.token_seq, qo_indptr=self.qo_indptr, page_table=self.page_table,
            seq_lens_t=self.seq_lens, prefix_lens=(self._max_context - q,) * b, extend_lens=(q,) * b,
            kv_pool=self.kv_pool, attention_method=AttentionMethod.MLA,
            page_lists=(tuple(self._pad_table_row),) * b, graph_bucket=b)


class VerifyGraphRunner:
    """The captured forwards of q tokens per sequence of every bucket: the verify (the model), or
    with `mtp` the catch-up (the MTP layer over the same layout, its input hidden states from a
    static `[bucket * q, hidden]` buffer; decoder.py pads it to q tokens per sequence)."""

    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, config: CudaGraphConfig, q: int,
                 scratch_page: int, mtp: bool = False, pool: object | None = None) -> None:
        check_capturable(model)
        if model.options.parallel.ep_size > 1:
            raise UserError("verify CUDA graphs run without EP (a verify is an extend: DeepEP's normal mode)")
        for layer in model.layers:
            if hasattr(layer.self_attn.backend, "prepare_replay"):
                raise UserError("verify CUDA graphs need an attention backend that plans on the device (triton)")
        self.model, self.q = model, q
        self.buckets = config.buckets()
        width = config.table_width(kv_pool.page_size)
        self._inputs = {b: StaticVerifyInputs(b, q, width, kv_pool, scratch_page, model.config.vocab_size)
                        for b in self.buckets}
        self.mtp = mtp
        dtype = model.embed_tokens.weight.dtype
        self._in_hidden = {b: torch.zeros(b * q, model.config.hidden_size, dtype=dtype, device=kv_pool.device)
                           for b in self.buckets} if mtp else {}

        def forward(b: int) -> torch.Tensor:
            batch = self._inputs[b].forward_batch()
            return model.forward_mtp(batch, self._in_hidden[b]) if mtp else model.forward_hidden(batch)

        self._graphs, self._hidden = capture_per_bucket(
            self.buckets, lambda b: self._inputs[b].load(self._inputs[b].pack_padding_only()), forward, pool)
        log.info("CUDA graphs: captured the speculative %s (%d tokens per sequence) for batch sizes %s",
                 "catch-up" if mtp else "verify", q, list(self.buckets))

    def run(self, token_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int], pages: Sequence[Sequence[int]],
            hidden: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
            starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every token's hidden state `[n*q, hidden]` by replay (`hidden`: the catch-up's input
        hidden states, `[n*q, hidden]`; `input_ids`: device ids `[n*q]` over `token_ids`; `starts`:
        device `[n]` true first positions, which `prefix_lens` bound), or None
        (run eagerly): a batch larger than the largest bucket, a context past the captured width, or
        a sequence without exactly q tokens."""
        bucket = bucket_for(self.buckets, len(token_ids))
        if bucket is None or any(len(t) != self.q for t in token_ids):
            return None
        inputs = self._inputs[bucket]
        if not inputs.fits(prefix_lens):
            return None
        inputs.load(inputs.pack(token_ids, prefix_lens, pages))
        if input_ids is not None:
            inputs.input_ids[:len(token_ids) * self.q].copy_(input_ids)
        if starts is not None:
            fill_static(inputs.positions, inputs.out_slots, inputs.seq_lens, inputs.page_table, starts, self.q,
                        inputs.kv_pool.page_size)
        if self.mtp:
            rows = len(token_ids) * self.q
            self._in_hidden[bucket][:rows].copy_(hidden)
            self._in_hidden[bucket][rows:].zero_()
        self.model.dispatcher.prepare_step(ForwardMode.EXTEND)
        self._graphs[bucket].replay()
        return self._hidden[bucket][:len(token_ids) * self.q].clone()
