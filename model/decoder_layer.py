"""One DeepSeek decoder layer, written as the ops listed in `layer_ops` (see its table of keys).

MoE layers run `MOE_LAYER_OPS`, dense layers `DENSE_LAYER_OPS`; the list is picked when the layer
is built. Residual adds are fused into the norms: `prepare_attn` adds the previous layer's output
to the running residual and normalises (the first layer's residual is its input).

Where the rows live between the ops is the layer's `LayerCommunicator` (model/distributed/layer_communicator.py,
modes from model/distributed/scatter_mode.py), chosen when the layer is built: under attention TP the
attention block sees all of its TP group's rows, the MLP (dense, or MoE under EP) only this TP
rank's share, and `prepare_attn` / `prepare_mlp` / `postprocess` move hidden states and residual
between the two. At tp 1 the communicator is the norms alone.
"""
from __future__ import annotations

from torch import nn

from deepseek_pd.model.attention.mla import MLAAttention
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.quant.fp8_linear import fp8_spec
from deepseek_pd.model.quant.norm_fp8_linear import norm_quant_group
from deepseek_pd.model.distributed.layer_communicator import LayerCommunicator
from deepseek_pd.model.layer_ops import DENSE_LAYER_OPS, MOE_LAYER_OPS, OpState, bound_ops
from deepseek_pd.model.moe.dispatcher import CombineInput, Dispatcher
from deepseek_pd.model.moe.layer import DeepseekMoE
from deepseek_pd.model.moe.mlp import GatedMLP
from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.rope import RotaryEmbedding
from deepseek_pd.model.distributed.scatter_mode import LayerScatterModes


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, options: BuildOptions,
                 dispatcher: Dispatcher) -> None:
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        self.layer_id = layer_id
        norm = options.norm_rope_backend
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw, backend=norm)
        self.self_attn = MLAAttention(config, layer_id, rotary, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw, backend=norm)
        self.is_moe = config.is_moe_layer(layer_id)
        if self.is_moe:
            self.mlp: nn.Module = DeepseekMoE(config, options, layer_id)
            self.op_names = MOE_LAYER_OPS
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, **kw,
                                fp8=fp8_spec(config, options.fp8_backend))
            self.op_names = DENSE_LAYER_OPS
        self.dispatcher = dispatcher
        self.comm = LayerCommunicator(LayerScatterModes.for_layer(config, layer_id, options.parallel),
                                      self.input_layernorm, self.post_attention_layernorm, options.parallel,
                                      norm_quant_group(self.input_layernorm, self.self_attn.input_projections),
                                      # a MoE layer's router reads the normed rows unquantised
                                      None if self.is_moe else
                                      norm_quant_group(self.post_attention_layernorm, (self.mlp.gate_up_proj,)))
        self.ops = bound_ops(self)

    # ---- attention ------------------------------------------------------------------------
    def op_prepare_attn(self, state: OpState, batch: ForwardBatch) -> None:
        hidden, residual = self.comm.prepare_attn(state.pop("hidden_states"), state.pop("residual"), batch.num_tokens)
        state.update(attn_input=hidden, residual=residual)

    def op_attn_prepare(self, state: OpState, batch: ForwardBatch) -> None:
        state["attn_intermediate"] = self.self_attn.prepare(state.pop("attn_input"), batch)

    def op_attn_core(self, state: OpState, batch: ForwardBatch) -> None:
        state["attn_output"] = self.self_attn.core(state.pop("attn_intermediate"), batch)

    def op_prepare_mlp(self, state: OpState, batch: ForwardBatch) -> None:
        hidden, residual = self.comm.prepare_mlp(state.pop("attn_output"), state.pop("residual"), batch.num_tokens)
        state.update(mlp_input=hidden, residual=residual)

    # ---- dense MLP ------------------------------------------------------------------------
    def op_mlp(self, state: OpState, batch: ForwardBatch) -> None:
        state["mlp_output"] = self.mlp(state.pop("mlp_input"))

    # ---- MoE ------------------------------------------------------------------------------
    def op_gate(self, state: OpState, batch: ForwardBatch) -> None:
        state["router_logits"] = self.mlp.router_logits(state["mlp_input"])

    def op_select_experts(self, state: OpState, batch: ForwardBatch) -> None:
        weights, ids = self.mlp.select_experts(state.pop("router_logits"), batch.counted_tokens)
        state.update(topk_weights=weights, topk_ids=ids)

    def op_dispatch_a(self, state: OpState, batch: ForwardBatch) -> None:
        state["dispatch_handle"] = self.dispatcher.dispatch_a(
            state["mlp_input"], state.pop("topk_ids"), state.pop("topk_weights"), batch.ep_mode)

    def op_dispatch_b(self, state: OpState, batch: ForwardBatch) -> None:
        state["dispatched"] = self.dispatcher.dispatch_b(state.pop("dispatch_handle"))

    def op_experts(self, state: OpState, batch: ForwardBatch) -> None:
        d = state.pop("dispatched")
        state["expert_output"] = CombineInput(self.mlp.experts(d.hidden, d.topk_ids, d.topk_weights), d.handle)

    def op_combine_a(self, state: OpState, batch: ForwardBatch) -> None:
        state["combine_handle"] = self.dispatcher.combine_a(state.pop("expert_output"))

    def op_shared_experts(self, state: OpState, batch: ForwardBatch) -> None:
        state["shared_output"] = self.mlp.shared(state.pop("mlp_input"))

    def op_combine_b(self, state: OpState, batch: ForwardBatch) -> None:
        state["routed_output"] = self.dispatcher.combine_b(state.pop("combine_handle"))

    def op_output(self, state: OpState, batch: ForwardBatch) -> None:
        routed, shared = state.pop("routed_output"), state.pop("shared_output")
        state["mlp_output"] = routed if shared is None else routed + shared

    # ---- end of layer ---------------------------------------------------------------------
    def op_postprocess(self, state: OpState, batch: ForwardBatch) -> None:
        hidden, residual = self.comm.postprocess(state.pop("mlp_output"), state.pop("residual"), batch.num_tokens)
        state.update(hidden_states=hidden, residual=residual)
