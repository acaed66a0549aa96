"""DeepSeek-V3's multi-token-prediction (MTP) module, used as the speculative draft model.

The checkpoint stores it as the layer after the last decoder layer, `model.layers.{L}` with
`L = num_hidden_layers` (V3: 61), holding
    enorm, hnorm          RMSNorms of the next token's embedding and of the previous hidden state
    eh_proj               `[H, 2H]` over their concatenation, embedding first: `[enorm(e) ; hnorm(h)]`
                          (the order of SGLang's deepseek_nextn and vLLM's deepseek_mtp, which the
                          released weights were trained with; the V3 report writes the two the other
                          way round)
    one decoder layer     MLA + MoE, the same op list as the main model's layers (`DeepseekDecoderLayer`
                          with layer id L: its latent KV is layer L of the KV pool)
    shared_head.norm      the final norm before the lm_head
    embed_tokens, shared_head.head   copies of the main model's embedding and lm_head: not loaded,
                          the main model's are shared.

At position p it reads the target's hidden state `h_p` (final-normed, as SGLang passes it) and the
embedding of the token at p + 1, and its logits predict the token at p + 2. Chained draft steps feed
its own output (after shared_head.norm) back as the next `h`.

    hidden = mtp(batch, model.embed_tokens(batch.input_ids), prev_hidden)   # [T, H], normed
    logits = model.compute_logits(hidden)

Its linear layers follow the main model's FP8 rule (kept FP8 when the backend runs FP8); eh_proj is
in the model dtype, as SGLang keeps it (an FP8 one in a checkpoint is dequantised at load).
"""
from __future__ import annotations

import torch
from torch import nn

from deepseek_pd.errors import UserError
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.decoder_layer import DeepseekDecoderLayer
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.layer_ops import LAYER_BOUNDARY_KEYS, OpState, run_layer_ops
from deepseek_pd.model.moe.dispatcher import Dispatcher
from deepseek_pd.model.speculative.mtp_names import mtp_layer_id
from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.rope import RotaryEmbedding

def check_mtp_supported(config: ModelConfig) -> None:
    """UserError when this checkpoint cannot draft with its MTP layer."""
    if config.num_nextn_predict_layers < 1:
        raise UserError(f"speculative decoding needs the checkpoint's MTP layer, but its config.json has "
                        f"num_nextn_predict_layers={config.num_nextn_predict_layers}: run without "
                        "--speculative-num-steps (or with 0)")


class MtpLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, options: BuildOptions,
                 dispatcher: Dispatcher) -> None:
        super().__init__()
        check_mtp_supported(config)
        kw = dict(dtype=options.dtype, device=options.device)
        hidden, eps, norm = config.hidden_size, config.rms_norm_eps, options.norm_rope_backend
        self.layer_id = mtp_layer_id(config)
        self.enorm = RMSNorm(hidden, eps, **kw, backend=norm)
        self.hnorm = RMSNorm(hidden, eps, **kw, backend=norm)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, **kw)
        self.layer = DeepseekDecoderLayer(config, self.layer_id, rotary, options, dispatcher)
        self.shared_head_norm = RMSNorm(hidden, eps, **kw, backend=norm)

    def forward(self, batch: ForwardBatch, embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden states `[T, H]` for the batch's tokens; writes their KV into pool layer L.

        `embeds` are the embeddings of `batch.input_ids` (the tokens one position ahead of the
        hidden states), `prev_hidden` `[T, H]` the target's (or the previous draft step's) normed
        hidden state at each token's position."""
        if prev_hidden.shape != embeds.shape:
            raise ValueError(f"MTP: hidden states {tuple(prev_hidden.shape)} do not match the tokens' "
                             f"embeddings {tuple(embeds.shape)}")
        fused = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden.to(embeds.dtype))], dim=-1))
        state = OpState(hidden_states=fused, residual=None)
        run_layer_ops(self.layer, state, batch)
        state.expect_only(LAYER_BOUNDARY_KEYS)
        return self.shared_head_norm.add_and_norm(state.pop("hidden_states"), state.pop("residual"))[0]
