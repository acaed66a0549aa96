"""Multi-head latent attention (DeepSeek-V2/V3) with three interchangeable methods.

Weights (HF names in brackets):
    fused_qkv_a_proj  [q_a_proj ; kv_a_proj_with_mqa] when q_lora_rank is set, else
    q_proj + kv_a_proj_with_mqa;  q_a_layernorm, q_b_proj, kv_a_layernorm, o_proj;
    w_kc `[H, nope, R]` and w_vc `[H, v, R]`: kv_b_proj split per head into its K and V halves
    (always in the model dtype; with FP8 weights kept, the other projections are `Fp8Linear`).

`prepare` projects q, the latent `c_kv` (normalised) and `k_pe`, applies rope, and writes
`[c_kv | k_pe]` of the new tokens into the paged pool. `core` then runs the batch's method:
    MHA             k_nope = w_kc·c_kv, v = w_vc·c_kv for new tokens; causal attention.
    MHA_CHUNKED_KV  MHA on new tokens, plus the cached prefix read from the pool in chunks,
                    up-projected the same way, attended, and merged by log-sum-exp.
    MLA (absorbed)  q_latent = q_nope·w_kc; scores = q_latent·c_kv + q_pe·k_pe over the cache;
                    out = (probs·c_kv)·w_vc.

With attention TP (`options.parallel.tp_size > 1`) the layer holds only its TP rank's heads
(`num_heads` counts those; q_b_proj / q_proj, w_kc, w_vc and o_proj's input are sliced by the loader) and
`core` returns o_proj's partial sum: the decoder layer's communicator reduces it over the TP group,
all-reduced or reduce-scattered by where the MLP runs (model/distributed/layer_communicator.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from deepseek_pd.model import batch_invariant
from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS, AttentionBackend, RopeSplit
from deepseek_pd.model.attention.tensor_parallel import local_heads
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.forward_batch import AttentionMethod, ForwardBatch, ForwardMode
from deepseek_pd.model.host_copy import upload_parts
from deepseek_pd.model.quant.fp8_linear import fp8_spec, make_linear
from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.norm_rope import NORM_ROPE_BACKENDS, NormRopeOps
from deepseek_pd.model.quant.norm_fp8_linear import NormThenLinear, Rows, apply
from deepseek_pd.model.rope import RotaryEmbedding


def _matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


@dataclass
class AttnIntermediate:
    """What `prepare` hands to `core` (the state between attn_prepare and attn_core)."""

    q_nope: torch.Tensor  # [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope], roped
    c_kv: torch.Tensor  # [T, R], normalised latent of the new tokens
    k_pe: torch.Tensor  # [T, rope], roped


@dataclass(frozen=True)
class PrefixChunk:
    """One MHA_CHUNKED_KV step: the flat pool slots of a slice of every sequence's prefix."""

    slots: torch.Tensor  # [S] long
    kv_offsets: tuple[int, ...]  # [B+1] split of `slots` by sequence (empty segments allowed)


def prefix_chunks(batch: ForwardBatch, chunk_size: int) -> tuple[PrefixChunk, ...]:
    """Chunk j covers prefix positions [j*C, (j+1)*C) of each sequence; computed once per batch."""
    key = ("prefix_chunks", chunk_size)
    if key not in batch.derived:
        page_size = batch.kv_pool.page_size
        # Host tensors, one vectorised gather per sequence and chunk (a Python loop per position
        # cost milliseconds at 8k-token prefixes).
        tables = [torch.tensor(pages, dtype=torch.long) for pages in batch.page_lists]
        slots, split = [], []
        for start in range(0, max(batch.prefix_lens, default=0), chunk_size):
            parts: list[torch.Tensor] = []
            offsets = [0]
            for table, prefix in zip(tables, batch.prefix_lens):
                pos = torch.arange(start, max(start, min(start + chunk_size, prefix)), dtype=torch.long)
                parts.append(table[pos // page_size] * page_size + pos % page_size)
                offsets.append(offsets[-1] + int(pos.numel()))
            slots.append(torch.cat(parts))
            split.append(tuple(offsets))
        # Every chunk's slots in one pinned, asynchronous upload (a pageable copy would wait in the
        # driver for the forward queued before it, holding up other threads' copies).
        on_device = upload_parts(batch.positions.device, *slots)
        batch.derived[key] = tuple(PrefixChunk(s, o) for s, o in zip(on_device, split))
    return batch.derived[key]


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, options: BuildOptions) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = len(local_heads(config.num_attention_heads, options.parallel))  # this TP rank's
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scale = config.softmax_scale
        self.prefix_chunk_size = options.prefix_chunk_size
        self.rotary = rotary
        kw = dict(dtype=options.dtype, device=options.device)
        hidden, heads, qk = config.hidden_size, self.num_heads, config.qk_head_dim
        kv_a_dim = config.kv_lora_rank + config.qk_rope_head_dim
        fp8 = fp8_spec(config, options.fp8_backend)  # None: plain nn.Linear in the model dtype
        # Under TP a rank's slice of q_b_proj / o_proj starts at a multiple of its width: FP8 scale
        # blocks must not straddle it (fp8_linear.Fp8Spec.block_for).
        q_split, o_split = ((heads * qk,), (heads * self.v_dim,)) if options.parallel.tp_size > 1 else ((), ())
        if self.q_lora_rank is not None:
            self.fused_qkv_a_proj = make_linear(hidden, self.q_lora_rank + kv_a_dim, fp8, **kw,
                                                row_splits=(self.q_lora_rank,))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, **kw,
                                         backend=options.norm_rope_backend)
            self.q_b_proj = make_linear(self.q_lora_rank, heads * qk, fp8, **kw, row_splits=q_split)
            self._q_b_of_q_a = NormThenLinear(self.q_a_layernorm, self.q_b_proj)  # one launch less in FP8
            self._project_q_and_latent = self._project_lora
        else:
            self.q_proj = make_linear(hidden, heads * qk, fp8, **kw, row_splits=q_split)
            self.kv_a_proj_with_mqa = make_linear(hidden, kv_a_dim, fp8, **kw)
            self._project_q_and_latent = self._project_plain
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps, **kw,
                                      backend=options.norm_rope_backend)
        self.norm_rope: NormRopeOps = NORM_ROPE_BACKENDS.build(options.norm_rope_backend)
        # The kv_a norm inside the rope + cache-write launch (one launch less per layer; issue 21).
        self.norm_in_rope = options.small_batch_fusions
        self.w_kc = nn.Parameter(torch.empty(heads, self.nope_dim, self.kv_lora_rank, **kw))
        self.w_vc = nn.Parameter(torch.empty(heads, self.v_dim, self.kv_lora_rank, **kw))
        self.o_proj = make_linear(heads * self.v_dim, hidden, fp8, **kw, col_splits=o_split)
        self.backend: AttentionBackend = ATTENTION_BACKENDS.build(options.attention_backend)
        # The products over a batch's rows: batch-invariant ones under --deterministic.
        self._linear = batch_invariant.linear if options.deterministic else _matmul_t
        self._bmm = batch_invariant.bmm if options.deterministic else torch.bmm
        self._methods: dict[AttentionMethod, Callable[[AttnIntermediate, ForwardBatch], torch.Tensor]] = {
            AttentionMethod.MHA: self._mha,
            AttentionMethod.MHA_CHUNKED_KV: self._mha_chunked_kv,
            AttentionMethod.MLA: self._mla,
        }

    # ---- projections ----------------------------------------------------------------------
    @property
    def input_projections(self) -> tuple[nn.Module, ...]:
        """The linears that read the layer's normed input (`prepare`'s `hidden`)."""
        if self.q_lora_rank is not None:
            return (self.fused_qkv_a_proj,)
        return self.q_proj, self.kv_a_proj_with_mqa

    def _project_lora(self, x: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        q_a, latent = apply(self.fused_qkv_a_proj, x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], -1)
        return self._q_b_of_q_a(q_a), latent

    def _project_plain(self, x: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        return apply(self.q_proj, x), apply(self.kv_a_proj_with_mqa, x)

    def prepare(self, hidden: Rows, batch: ForwardBatch) -> AttnIntermediate:
        """Project, rope, and write the new tokens' latent KV into the pool. `hidden`: the normed
        rows, or their `QuantisedRows` where the layer's input norm quantises them."""
        q, latent = self._project_q_and_latent(hidden)
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cache = batch.kv_pool.flat(self.layer_id)
        if self.norm_in_rope:
            q_pe, k_pe, c_kv = self.norm_rope.norm_rope_and_write(
                self.rotary, batch.positions, q_pe, k_pe, c_kv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                cache, batch.out_slots)
        else:
            c_kv = self.kv_a_layernorm(c_kv)
            q_pe, k_pe = self.norm_rope.rope_and_write(self.rotary, batch.positions, q_pe, k_pe, c_kv, cache,
                                                       batch.out_slots)
        return AttnIntermediate(q_nope, q_pe, c_kv, k_pe)

    def core(self, inter: AttnIntermediate, batch: ForwardBatch) -> torch.Tensor:
        """o_proj of this rank's heads `[T, hidden]`: the output itself at tp 1, else a partial sum."""
        return self.o_proj(self.attend(inter, batch))

    def attend(self, inter: AttnIntermediate, batch: ForwardBatch) -> torch.Tensor:
        """`core` before o_proj: this rank's heads' attention, flat `[T, H * v]` (what piecewise
        extend graphs multiply into their static buffer themselves: model/extend_graph_pieces.py)."""
        out = self._methods[batch.attention_method](inter, batch)  # [T, H, v]
        return out.reshape(out.shape[0], self.num_heads * self.v_dim)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """`prepare` then `core` (a partial sum under TP, as `core` says)."""
        return self.core(self.prepare(hidden, batch), batch)

    # ---- methods --------------------------------------------------------------------------
    def _up_project(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[RopeSplit, torch.Tensor]:
        """Latent `[S, R]` + `[S, rope]` → per-head K (`[S, H, nope]` and the shared `[S, rope]`, not
        concatenated: `RopeSplit`) and V `[S, H, v]`."""
        heads = self.num_heads
        k_nope = self._linear(c_kv, self.w_kc.view(heads * self.nope_dim, -1)).view(-1, heads, self.nope_dim)
        v = self._linear(c_kv, self.w_vc.view(heads * self.v_dim, -1)).view(-1, heads, self.v_dim)
        return RopeSplit(k_nope, k_pe), v

    def _new_tokens(self, inter: AttnIntermediate, batch: ForwardBatch
                    ) -> tuple[RopeSplit, torch.Tensor, torch.Tensor]:
        # q and k go to the backend as their parts: the Triton kernel reads them where they are
        # (no concatenated copies per layer), the others join them.
        q = RopeSplit(inter.q_nope, inter.q_pe)
        k, v = self._up_project(inter.c_kv, inter.k_pe)
        out, lse = self.backend.mha_causal(q, k, v, batch.qo_offsets, self.scale)
        return q, out, lse

    def _mha(self, inter: AttnIntermediate, batch: ForwardBatch) -> torch.Tensor:
        if any(batch.prefix_lens):
            raise RuntimeError("MHA cannot see a cached prefix; the policy should pick MHA_CHUNKED_KV or MLA")
        return self._new_tokens(inter, batch)[1]

    def _mha_chunked_kv(self, inter: AttnIntermediate, batch: ForwardBatch) -> torch.Tensor:
        q, out, lse = self._new_tokens(inter, batch)
        v_dtype = inter.q_nope.dtype
        cache = batch.kv_pool.flat(self.layer_id)
        for chunk in prefix_chunks(batch, self.prefix_chunk_size):
            latent = cache[chunk.slots].to(v_dtype)
            c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            k, v = self._up_project(c_kv, k_pe)
            part, part_lse = self.backend.mha_cross(q, k, v, batch.qo_offsets, chunk.kv_offsets, self.scale)
            out, lse = self.backend.merge_states(out, lse, part, part_lse)
        return out

    def _mla(self, inter: AttnIntermediate, batch: ForwardBatch) -> torch.Tensor:
        q_latent = self._bmm(inter.q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)  # [T, H, R]
        kernel = self.backend.mla_decode if batch.mode is ForwardMode.DECODE else self.backend.mla_extend
        latent_out = kernel(q_latent, inter.q_pe, batch.kv_pool.buffers[self.layer_id], batch,
                            self.kv_lora_rank, self.scale)
        return self._bmm(latent_out.transpose(0, 1), self.w_vc.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
