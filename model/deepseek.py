"""`DeepseekForCausalLM`: embeddings, decoder layers (op lists), final norm and lm_head.

`forward(batch, progress=None)` runs every layer's op list over one `OpState`, or, with
`enable_tbo`, hands the batch to the two-batch-overlap executor (`tbo.py`), which interleaves the
same ops over two micro-batches; either tells `progress` when each layer's KV is written. `load_weights` takes HF tensor names (see
`weight_mapping`). Parameters are allocated uninitialised: a model is always loaded before use.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from deepseek_pd.model.batch_invariant import make_linears_invariant
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.decoder_layer import DeepseekDecoderLayer
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.quant.fp8_linear import fp8_blocks
from deepseek_pd.model.layer_ops import (LAYER_BOUNDARY_KEYS, MOE_LAYER_OPS, EmptyBatch, Op, OpLayer, OpState,
                                         op_method, run_layer_ops)
from deepseek_pd.model.kv.layer_progress import LayerProgress
from deepseek_pd.model.moe.dispatcher import DISPATCHERS
from deepseek_pd.model.speculative.mtp import MtpLayer
from deepseek_pd.model.speculative.mtp_names import kv_layers
from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.distributed.parallel import ExpertPlacement
from deepseek_pd.model.rope import RotaryEmbedding
from deepseek_pd.model.distributed.tbo import TwoBatchOverlap
from deepseek_pd.model.checkpoint.weight_mapping import load_hf_weights


# The MoE ops between the attention block and the layer's end (what an idle EP rank runs).
_MOE_MLP_OPS = frozenset(MOE_LAYER_OPS[MOE_LAYER_OPS.index("gate"):MOE_LAYER_OPS.index("postprocess")])


def _end_empty_mlp(state: OpState, batch: EmptyBatch) -> None:
    state.pop("mlp_output")


class DeepseekForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, options: BuildOptions = BuildOptions()) -> None:
        super().__init__()
        self.config = config
        self.options = options
        kw = dict(dtype=options.dtype, device=options.device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.rotary = RotaryEmbedding(config).to(options.device)
        # Built before the layers so a bad EP size fails here, naming it, before any allocation.
        self.placement = ExpertPlacement(config.n_routed_experts, options.num_fused_shared_experts, options.parallel,
                                         options.expert_location)
        self.dispatcher = DISPATCHERS.build(options.dispatcher, self.placement, options.dispatch)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, self.rotary, options, self.dispatcher)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw, backend=options.norm_rope_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The draft model for speculative decoding (model/speculative/mtp.py); shares embed_tokens and lm_head.
        self.mtp = MtpLayer(config, self.rotary, options, self.dispatcher) if options.mtp else None
        if options.deterministic:  # before the weights load: the swap keeps every parameter's name
            make_linears_invariant(self)
        # Chosen once: the two-batch-overlap executor or the plain op-list loop.
        self._tbo = TwoBatchOverlap(self, options.parallel, options.tbo_rules) if options.enable_tbo else None
        # What an idle rank runs (`forward_idle`), resolved once like the layers' own `ops`: it
        # depends on the layers only, not on the step's mode (the mode travels in the EmptyBatch).
        self._idle_ops: tuple[Op, ...] = tuple(
            op for layer in self.layers for name in layer.op_names
            if (op := self.empty_op(layer, name)) is not None)

    @property
    def tbo(self) -> TwoBatchOverlap | None:
        """The two-batch-overlap executor (its `stats` count the paths taken), or None."""
        return self._tbo

    def initial_state(self, batch: ForwardBatch) -> OpState:
        return OpState(hidden_states=self.embed_tokens(batch.input_ids), residual=None)

    def final_hidden(self, state: OpState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Consumes the last layer's state: final-normed hidden states of `rows` (default all) `[n, H]`."""
        state.expect_only(LAYER_BOUNDARY_KEYS)
        hidden, residual = state.pop("hidden_states"), state.pop("residual")
        if rows is not None:
            hidden, residual = hidden[rows], residual[rows]
        return self.norm.add_and_norm(hidden, residual)[0]

    def run_layers(self, batch: ForwardBatch, progress: LayerProgress | None = None) -> OpState:
        """Embeds and runs every layer's op list; returns the {hidden_states, residual} state.
        `progress` hears of each layer's KV write (model/kv/layer_progress.py)."""
        state = self.initial_state(batch)
        for layer in self.layers:
            run_layer_ops(layer, state, batch, progress)
        return state

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, progress: LayerProgress | None = None) -> torch.Tensor:
        """fp32 logits `[B, vocab]` of each sequence's last new token.

        `progress` (optional; none for decode and CUDA graphs) is told after each layer's KV
        write, once per layer for the whole batch, on both paths."""
        if self._tbo is not None:
            return self.compute_logits(self._tbo.final_hidden(batch, progress=progress))
        hidden = self.final_hidden(self.run_layers(batch, progress), batch.last_token_index)
        return self.compute_logits(hidden)

    @torch.no_grad()
    def forward_hidden(self, batch: ForwardBatch, progress: LayerProgress | None = None) -> torch.Tensor:
        """Final-normed hidden states of every new token `[T, H]` (speculative verify and the
        MTP layer's input; `compute_logits` turns rows of them into logits)."""
        if self._tbo is not None:
            return self._tbo.final_hidden(batch, progress=progress, every_token=True)
        return self.final_hidden(self.run_layers(batch, progress))

    @torch.no_grad()
    def forward_mtp(self, batch: ForwardBatch, prev_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over the batch's tokens `[T, H]` (normed; model/speculative/mtp.py)."""
        if self.mtp is None:
            raise RuntimeError("the model was built without its MTP layer (BuildOptions.mtp)")
        return self.mtp(batch, self.embed_tokens(batch.input_ids), prev_hidden)

    @property
    def num_kv_layers(self) -> int:
        """Layers of latent KV the pool holds: the decoder layers, and the MTP layer when built."""
        return kv_layers(self.config, self.mtp is not None)

    @torch.no_grad()
    def forward_idle(self, mode: ForwardMode) -> None:
        """Takes part in one forward's EP collectives with no tokens of its own.

        With data-parallel attention a rank (under attention TP: every rank of a DP group) may have
        no requests in a step while the others run a batch; their all-to-alls still need this rank.
        It runs `empty_op` of every layer: each MoE layer's MLP ops (the same op methods, from
        `gate` to `output`) on zero rows. With TBO it votes as an idle rank and, if the group
        splits, runs the overlapped schedule with two empty micro-batches (model/distributed/tbo.py).
        """
        if self._tbo is not None and self._tbo.idle(mode, self.embed_tokens.weight.device):
            return
        stand_in, state = EmptyBatch(mode), OpState()
        for op in self._idle_ops:
            op(state, stand_in)
        state.expect_only(frozenset())

    @torch.no_grad()
    def forward_mtp_idle(self, mode: ForwardMode) -> None:
        """`forward_idle` for the MTP layer: its MoE collectives on zero rows, where the other ranks
        run `forward_mtp` (speculative decoding under EP; no TBO: the MTP layer runs whole)."""
        if self.mtp is None:
            raise RuntimeError("the model was built without its MTP layer (BuildOptions.mtp)")
        stand_in, state = EmptyBatch(mode), OpState()
        for name in self.mtp.layer.op_names:
            if (op := self.empty_op(self.mtp.layer, name)) is not None:
                op(state, stand_in)
        state.expect_only(frozenset())

    def empty_op(self, layer: OpLayer, name: str) -> Op | None:
        """What a rank with no tokens runs for `layer`'s op `name` (LayerStack): a MoE layer's MLP
        ops on zero rows, between a `prepare_mlp` that makes them and a `postprocess` that drops them."""
        if not layer.is_moe:
            return None
        if name == "prepare_mlp":
            return self._begin_empty_mlp
        if name == "postprocess":
            return _end_empty_mlp
        return op_method(layer, name) if name in _MOE_MLP_OPS else None

    def _begin_empty_mlp(self, state: OpState, batch: EmptyBatch) -> None:
        empty = self.embed_tokens.weight.new_empty(0, self.config.hidden_size)
        state["mlp_input"] = empty

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors in; raises CheckpointError listing missing/unexpected names."""
        load_hf_weights(self.config, self.placement, dict(self.named_parameters()), weights, fp8_blocks(self))
