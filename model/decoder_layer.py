"""One DeepSeek decoder layer, written as the ops listed in `layer_ops` (see its table of keys).

MoE layers run `MOE_LAYER_OPS`, dense layers `DENSE_LAYER_OPS`; the list is picked when the layer
is built. Residual adds are fused into the norms: `prepare_attn` adds the previous layer's output
to the running residual and normalises (the first layer's residual is its input).

Under attention TP with EP a MoE layer's `prepare_mlp` keeps only this TP rank's slice of the
rows as `mlp_input` (the residual keeps all of them) and `output` all-gathers the MoE output back
(`attention/tensor_parallel.py`, `TokenScatter`); otherwise both are the identity.
"""
from __future__ import annotations

from torch import nn

from deepseek_pd.model.attention.mla import MLAAttention
from deepseek_pd.model.attention.tensor_parallel import NO_SCATTER, token_scatter
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.fp8_linear import fp8_spec
from deepseek_pd.model.layer_ops import DENSE_LAYER_OPS, MOE_LAYER_OPS, OpState, bound_ops
from deepseek_pd.model.moe.dispatcher import CombineInput, Dispatcher
from deepseek_pd.model.moe.layer import DeepseekMoE
from deepseek_pd.model.moe.mlp import GatedMLP
from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.rope import RotaryEmbedding


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
        # Which rows of the MoE input this rank dispatches (chosen once; dense layers: all).
        self.scatter = token_scatter(options.parallel) if self.is_moe else NO_SCATTER
        self.ops = bound_ops(self)

    # ---- attention ------------------------------------------------------------------------
    def op_prepare_attn(self, state: OpState, batch: ForwardBatch) -> None:
        hidden, residual = self.input_layernorm.add_and_norm(state.pop("hidden_states"), state.pop("residual"))
        state.update(attn_input=hidden, residual=residual)

    def op_attn_prepare(self, state: OpState, batch: ForwardBatch) -> None:
        state["attn_intermediate"] = self.self_attn.prepare(state.pop("attn_input"), batch)

    def op_attn_core(self, state: OpState, batch: ForwardBatch) -> None:
        state["attn_output"] = self.self_attn.core(state.pop("attn_intermediate"), batch)

    def op_prepare_mlp(self, state: OpState, batch: ForwardBatch) -> None:
        hidden, residual = self.post_attention_layernorm.add_and_norm(state.pop("attn_output"), state.pop("residual"))
        state.update(mlp_input=self.scatter.scatter(hidden), residual=residual)

    # ---- dense MLP ------------------------------------------------------------------------
    def op_mlp(self, state: OpState, batch: ForwardBatch) -> None:
        state["mlp_output"] = self.mlp(state.pop("mlp_input"))

    # ---- MoE ------------------------------------------------------------------------------
    def op_gate(self, state: OpState, batch: ForwardBatch) -> None:
        state["router_logits"] = self.mlp.router_logits(state["mlp_input"])

    def op_select_experts(self, state: OpState, batch: ForwardBatch) -> None:
        weights, ids = self.mlp.select_experts(state.pop("router_logits"))
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
        # All of the layer's rows (the residual's), back on every TP rank.
        state["mlp_output"] = self.scatter.gather(routed if shared is None else routed + shared,
                                                  state["residual"].shape[0])

    # ---- end of layer ---------------------------------------------------------------------
    def op_postprocess(self, state: OpState, batch: ForwardBatch) -> None:
        state["hidden_states"] = state.pop("mlp_output")
