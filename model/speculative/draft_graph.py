"""`DraftGraphRunner`: the MTP layer's draft step captured as one CUDA graph per batch-size bucket.

A draft step (model/speculative/decoder.py, `_chain`) is a decode-mode forward of the MTP layer
alone: one token per sequence, the previous step's MTP hidden state as its second input. It is
short (one layer) and runs k - 1 times per speculative step, so Python dispatch dominates it even
more than it does a decode step. It is captured like decode (model/cuda_graph.py): the same
packed static inputs (`graph_inputs.StaticDecodeInputs`: token ids, positions, KV slots, lengths,
page table) plus a static `[bucket, hidden]` buffer for the input hidden states; the graph
writes the MTP layer's normed output `[bucket, hidden]`, whose real rows a replay returns.
Padding rows decode on the scratch page, as decode's do, and their hidden input is zeros.

Not yet captured: the verify forward (k + 1 queries per sequence through absorbed MLA) and the
catch-up (a variable number of tokens per sequence); they run eagerly.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.cuda_graph import capture_per_bucket, check_capturable
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.graph_inputs import CudaGraphConfig, StaticDecodeInputs, bucket_for
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.speculative.future_positions import fill_static

log = logging.getLogger(__name__)


class StaticDraftInputs:
    """One bucket's static inputs of a draft step: decode's packed buffer and the hidden states."""

    def __init__(self, decode: StaticDecodeInputs, hidden_size: int, dtype: torch.dtype) -> None:
        self.decode = decode
        self.hidden = torch.zeros(decode.bucket, hidden_size, dtype=dtype, device=decode.kv_pool.device)

    def load(self, token_ids: Sequence[int], positions: Sequence[int], pages: Sequence[Sequence[int]],
             prev_hidden: torch.Tensor) -> None:
        """Copies one step's inputs in (the caller checked the bucket and `decode.fits`)."""
        n = len(token_ids)
        if prev_hidden.shape != (n, self.hidden.shape[1]):
            raise ValueError(f"draft step: hidden states {tuple(prev_hidden.shape)} for {n} sequences "
                             f"of hidden size {self.hidden.shape[1]}")
        self.decode.load(self.decode.pack(token_ids, positions, pages))
        self.hidden[:n].copy_(prev_hidden)
        self.hidden[n:].zero_()  # padding rows: no stale state from an earlier, larger step


class DraftGraphRunner:
    """The captured draft steps of every bucket; `draft` replays one or returns None (run eagerly)."""

    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, config: CudaGraphConfig,
                 scratch_page: int, pool: object | None = None) -> None:
        if model.mtp is None:
            raise UserError("draft CUDA graphs need the model's MTP layer (speculative_num_steps > 0)")
        check_capturable(model)
        mtp_layer = model.mtp.layer
        if not getattr(mtp_layer.self_attn.backend, "cuda_graph_safe", False):
            raise UserError("cuda_graph: the MTP layer's attention backend is not capturable")
        self.model = model
        self.buckets = config.buckets()
        width = config.table_width(kv_pool.page_size)
        hidden, dtype = model.config.hidden_size, model.embed_tokens.weight.dtype
        self._inputs = {b: StaticDraftInputs(StaticDecodeInputs(b, width, kv_pool, scratch_page,
                                                                model.config.vocab_size), hidden, dtype)
                        for b in self.buckets}
        self._planning = [mtp_layer.self_attn.backend] if hasattr(mtp_layer.self_attn.backend, "prepare_replay") else []
        self._graphs, self._out = capture_per_bucket(
            self.buckets, lambda b: self._inputs[b].decode.load(self._inputs[b].decode.pack_padding_only()),
            lambda b: model.forward_mtp(self._inputs[b].decode.forward_batch(), self._inputs[b].hidden), pool)
        log.info("CUDA graphs: captured the MTP draft step for batch sizes %s", list(self.buckets))

    def draft(self, token_ids: Sequence[int], positions: Sequence[int], pages: Sequence[Sequence[int]],
              prev_hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
              starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MTP layer's normed output `[n, hidden]` by replay (`input_ids`: device ids `[n]` over
        `token_ids`; `starts`: device `[n]` true positions, which `positions` bound), or None when the
        step must run eagerly."""
        if starts is not None and self._planning:
            raise ValueError("a backend that plans on the host needs exact positions, not device starts")
        bucket = bucket_for(self.buckets, len(token_ids))
        if bucket is None or not self._inputs[bucket].decode.fits(positions):
            return None
        inputs = self._inputs[bucket]
        inputs.load(token_ids, positions, pages, prev_hidden)
        if input_ids is not None:
            inputs.decode.input_ids[:len(token_ids)].copy_(input_ids)
        if starts is not None:
            d = inputs.decode
            fill_static(d.positions, d.out_slots, d.seq_lens, d.page_table, starts, 1, d.kv_pool.page_size)
        if self._planning:
            lengths, page_lists = inputs.decode.replay_layout(positions, pages)
            for backend in self._planning:
                backend.prepare_replay(bucket, lengths, page_lists)
        self.model.dispatcher.prepare_step(ForwardMode.DECODE)
        self._graphs[bucket].replay()
        return self._out[bucket][:len(token_ids)].clone()
