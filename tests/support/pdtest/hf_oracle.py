"""Tiny random HF DeepSeek-V2/V3 models: the oracle the model tests compare against.

Weights are drawn fresh from a seed with scales large enough that every part of the network
matters (norm weights around 1, router bias non-zero), so a wrong sign or swapped slice shows up.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.deepseek import DeepseekForCausalLM


@dataclass(frozen=True)
class TinyShape:
    arch: str = "v3"  # "v2" | "v3"
    q_lora_rank: int | None = 12
    yarn: bool = False
    first_k_dense_replace: int = 1
    n_shared_experts: int = 1
    topk_method: str = "noaux_tc"  # v2: greedy | group_limited_greedy; v3 is always noaux_tc
    norm_topk_prob: bool = True
    num_layers: int = 2
    routed_scaling_factor: float = 2.5
    rope_interleave: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def hf_config(self) -> Any:
        common = dict(
            vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
            num_hidden_layers=self.num_layers, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=self.q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6, n_routed_experts=8, n_shared_experts=self.n_shared_experts, num_experts_per_tok=3,
            n_group=4, topk_group=2, routed_scaling_factor=self.routed_scaling_factor,
            first_k_dense_replace=self.first_k_dense_replace, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager",
        )
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
        if self.yarn:
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                    "mscale": 1.0, "mscale_all_dim": 0.8}
        common["rope_parameters"] = rope
        common.update(self.extra)
        if self.arch == "v3":
            from transformers import DeepseekV3Config
            return DeepseekV3Config(norm_topk_prob=self.norm_topk_prob, rope_interleave=self.rope_interleave,
                                    **common)
        from transformers import DeepseekV2Config
        # HF V2 ignores norm_topk_prob (never renormalises); every released V2 config has it false.
        return DeepseekV2Config(topk_method=self.topk_method, norm_topk_prob=False, **common)


def build_hf_model(shape: TinyShape, seed: int) -> torch.nn.Module:
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    config = shape.hf_config()
    torch.manual_seed(seed)
    cls = DeepseekV3ForCausalLM if shape.arch == "v3" else DeepseekV2ForCausalLM
    model = cls(config).eval().to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.numel() == 0:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif "gate.weight" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


def our_config(hf_model: torch.nn.Module) -> ModelConfig:
    return ModelConfig.from_hf(hf_model.config.to_dict())


def our_model(hf_model: torch.nn.Module, options: BuildOptions = BuildOptions()) -> DeepseekForCausalLM:
    model = DeepseekForCausalLM(our_config(hf_model), options)
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits `[len, vocab]` of one sequence, no cache."""
    ids = torch.tensor([token_ids], dtype=torch.long)
    return hf_model(input_ids=ids, use_cache=False).logits[0].float()
