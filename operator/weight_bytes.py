"""Bytes of the weights one worker rank holds, counted from the model's config without building it.

This mirrors what `model/deepseek.py` allocates (and so what a rank has resident after loading):

    every rank (data-parallel attention; dense layers replicated, workers/group/layout.py):
        embed_tokens, lm_head                      V x H each (one when tied)
        per layer: 2 RMSNorms (H), MLA             fused_qkv_a [q_lora + kv_lora + rope, H] (or
                                                   q_proj + kv_a_proj without q_lora), q_b_proj,
                                                   w_kc + w_vc (= kv_b_proj, always model dtype),
                                                   o_proj [H, heads x v], norms
        dense layers (first_k_dense_replace)       gate_up [2I, H] + down [H, I]
        MoE layers                                 fp32 router [E, H] (+ fp32 bias for noaux_tc),
                                                   shared experts [2 x mi x n_shared, H] + down
    this rank's routed expert slots ((E + R) / ep): w13 [2 mi, H] + w2 [H, mi] each, R being
                                                   EPLB's redundant experts (`--ep-num-redundant-experts`)

    the MTP layer (speculative decoding only,     enorm, hnorm, shared_head.norm (H each), eh_proj
    model/speculative/mtp.py), layer id num_hidden_layers:    [H, 2H] in the model dtype, and one decoder layer
                                                  as above (its routed experts split as the others');
                                                  embedding and lm_head are the main model's

Without speculation the MTP layer is not loaded. Linear weights are FP8 when the
checkpoint is and the workers keep it (`--engine-opt fp8_backend` not `dequant`): 1 byte per value
plus an fp32 scale per block (`Fp8Spec.block_for`: a fused parameter's blocks shrink to the gcd of
its parts' offsets); otherwise, and for norms, router, w_kc/w_vc and embeddings, the model dtype
(the router and its bias are always fp32).

Worked example, DeepSeek-V3 in FP8 on EP16: 58 MoE layers x 256 experts x 3 x 7168 x 2048 =
653.9B routed values, 40.9 GB per rank with their scales; the replicated rest is 20.3 GB:
57.0 GiB per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.speculative.mtp_names import mtp_layer_id

FP32_BYTES = 4


@dataclass(frozen=True)
class WeightFormat:
    """How weights are stored: the model dtype's bytes, and FP8 blocks when FP8 is kept."""

    dtype_bytes: int
    fp8_block: tuple[int, int] | None = None  # (block_out, block_in); None: dequantised at load


@dataclass(frozen=True)
class RankWeights:
    """One rank's weights: what every rank holds, and its share of the routed experts."""

    replicated_bytes: int
    expert_bytes: int
    parameters: int  # values, scales not counted

    @property
    def total_bytes(self) -> int:
        return self.replicated_bytes + self.expert_bytes


class _Tally:
    def __init__(self, fmt: WeightFormat) -> None:
        self.fmt = fmt
        self.params = 0
        self.bytes = 0

    def plain(self, numel: int, itemsize: int | None = None) -> None:
        self.params += numel
        self.bytes += numel * (self.fmt.dtype_bytes if itemsize is None else itemsize)

    def linear(self, out: int, inp: int, count: int = 1, row_splits: tuple[int, ...] = (),
               col_splits: tuple[int, ...] = ()) -> None:
        """`count` stacked [out, inp] weights, FP8 with per-block scales when FP8 is kept."""
        self.params += count * out * inp
        if self.fmt.fp8_block is None:
            self.bytes += count * out * inp * self.fmt.dtype_bytes
            return
        block_out = math.gcd(self.fmt.fp8_block[0], *row_splits)
        block_in = math.gcd(self.fmt.fp8_block[1], *col_splits)
        scales = -(-out // block_out) * -(-inp // block_in)
        self.bytes += count * (out * inp + scales * FP32_BYTES)


def _attention(t: _Tally, c: ModelConfig) -> None:
    heads, hidden = c.num_attention_heads, c.hidden_size
    kv_a = c.kv_lora_rank + c.qk_rope_head_dim
    if c.q_lora_rank is not None:
        t.linear(c.q_lora_rank + kv_a, hidden, row_splits=(c.q_lora_rank,))
        t.plain(c.q_lora_rank)  # q_a_layernorm
        t.linear(heads * c.qk_head_dim, c.q_lora_rank)
    else:
        t.linear(heads * c.qk_head_dim, hidden)
        t.linear(kv_a, hidden)
    t.plain(c.kv_lora_rank)  # kv_a_layernorm
    t.plain(heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank)  # w_kc, w_vc
    t.linear(hidden, heads * c.v_head_dim)


def _gated_mlp(t: _Tally, hidden: int, inner: int) -> None:
    t.linear(2 * inner, hidden, row_splits=(inner,))
    t.linear(hidden, inner)


def _experts(t: _Tally, c: ModelConfig, count: int) -> None:
    mi = c.moe_intermediate_size
    t.linear(2 * mi, c.hidden_size, count, row_splits=(mi,))
    t.linear(c.hidden_size, mi, count, col_splits=(mi,))


def _decoder_layer(shared: _Tally, experts: _Tally, c: ModelConfig, layer: int, fused_shared_experts: int,
                   local_experts: int) -> None:
    shared.plain(2 * c.hidden_size)  # input / post-attention norms
    _attention(shared, c)
    if not c.is_moe_layer(layer):
        _gated_mlp(shared, c.hidden_size, c.intermediate_size)
        return
    shared.plain(c.n_routed_experts * c.hidden_size, FP32_BYTES)  # router
    if c.topk_method == "noaux_tc":
        shared.plain(c.n_routed_experts, FP32_BYTES)  # e_score_correction_bias
    if fused_shared_experts:
        _experts(shared, c, fused_shared_experts)
    elif c.n_shared_experts:
        _gated_mlp(shared, c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
    _experts(experts, c, local_experts)


def _mtp_layer(shared: _Tally, experts: _Tally, c: ModelConfig, fused_shared_experts: int,
               local_experts: int) -> None:
    shared.plain(3 * c.hidden_size)  # enorm, hnorm, shared_head.norm
    shared.plain(2 * c.hidden_size * c.hidden_size)  # eh_proj, never FP8
    _decoder_layer(shared, experts, c, mtp_layer_id(c), fused_shared_experts, local_experts)


def rank_weights(config: ModelConfig, fmt: WeightFormat, ep_size: int = 1,
                 fused_shared_experts: int = 0, redundant_experts: int = 0, mtp: bool = False) -> RankWeights:
    """The weights of one rank whose group spreads the routed experts over `ep_size` ranks
    (1: every rank holds them all). `fused_shared_experts` (0 or n_shared_experts) stacks the
    shared experts with the routed ones, as `--engine-opt num_fused_shared_experts` does.
    `redundant_experts` (R) adds EPLB's replica slots: E + R slots per MoE layer, (E + R) / ep
    per rank (model/distributed/parallel.py `ExpertPlacement`); ValueError when ep does not divide E + R.
    `mtp` adds the MTP layer, as a runner with `speculative_num_steps > 0` builds it."""
    slots = config.n_routed_experts + redundant_experts
    if slots % ep_size:
        raise ValueError(f"ep {ep_size} does not divide the {config.n_routed_experts} routed experts"
                         + (f" + {redundant_experts} redundant ones" if redundant_experts else ""))
    c = config
    shared, experts = _Tally(fmt), _Tally(fmt)
    shared.plain(c.vocab_size * c.hidden_size)  # embed_tokens
    if not c.tie_word_embeddings:
        shared.plain(c.vocab_size * c.hidden_size)  # lm_head
    shared.plain(c.hidden_size)  # final norm
    shared.plain(c.qk_rope_head_dim // 2, FP32_BYTES)  # rope inv_freq buffer
    for layer in range(c.num_hidden_layers):
        _decoder_layer(shared, experts, c, layer, fused_shared_experts, slots // ep_size)
    if mtp:
        _mtp_layer(shared, experts, c, fused_shared_experts, slots // ep_size)
    return RankWeights(shared.bytes, experts.bytes, shared.params + experts.params)
