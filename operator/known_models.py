"""The DeepSeek checkpoints the operator knows by name, as the parts of their `config.json` that
shape memory, and how a `DeepSeekDeployment` names one.

The operator never sees the checkpoint (it sits on a volume only the worker pods mount), so the
memory plan (memory_plan.py) takes the model's shape from this table. A deployment names its model
by `model.architecture` (one of `KNOWN_MODELS`), or else the name is recognised from the Hub id
(`deepseek-ai/DeepSeek-V3-0324`), the checkpoint directory's last component (`path: DeepSeek-V3`)
or `servedName`, in that order: the longest known family name that starts the lower-cased name,
followed by its end, a `-` or a `_`, wins. Distilled models (`DeepSeek-R1-Distill-Qwen-7B`) are
other architectures and are not recognised, nor are unlisted versions (`DeepSeek-V3.2-Exp`).

Example: `DeepSeek-V2.5-1210` -> DeepSeek-V2 (the same 236B shape); `deepseek-v2-lite-chat` ->
DeepSeek-V2-Lite; `deepseek-r1-0528` -> DeepSeek-V3 (R1 is a V3-shaped FP8 checkpoint).
"""
from __future__ import annotations

from typing import Any, Mapping

from deepseek_pd.model.config import ModelConfig

_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
         "beta_slow": 1}
_MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rope_theta": 10000, "moe_layer_freq": 1,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
_V2_LITE = {**_MLA, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
            "num_key_value_heads": 16, "q_lora_rank": None, "n_routed_experts": 64,
            "n_shared_experts": 2, "num_experts_per_tok": 6, "topk_method": "greedy", "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": 1, "scoring_func": "softmax",
            "norm_topk_prob": False, "routed_scaling_factor": 1.0,
            "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}
# Full HF configs of the published checkpoints, reduced to the fields ModelConfig reads.
KNOWN_MODELS: dict[str, Mapping[str, Any]] = {
    "DeepSeek-V2-Lite": _V2_LITE,
    "DeepSeek-V2": {**_V2_LITE, "hidden_size": 5120, "intermediate_size": 12288,
                    "moe_intermediate_size": 1536, "num_hidden_layers": 60, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "q_lora_rank": 1536, "n_routed_experts": 160,
                    "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
                    "routed_scaling_factor": 16.0},
    "DeepSeek-V3": {**_MLA, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "q_lora_rank": 1536, "n_routed_experts": 256,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "topk_method": "noaux_tc",
                    "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                    "num_nextn_predict_layers": 1,
                    "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
                    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                            "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}},
}
# Family name (lower case) -> table entry. V2.5 has V2's shape; R1 and V3.1 have V3's.
_FAMILIES = {"deepseek-v2-lite": "DeepSeek-V2-Lite", "deepseek-coder-v2-lite": "DeepSeek-V2-Lite",
             "deepseek-v2": "DeepSeek-V2", "deepseek-v2.5": "DeepSeek-V2",
             "deepseek-coder-v2": "DeepSeek-V2", "deepseek-v3": "DeepSeek-V3",
             "deepseek-v3.1": "DeepSeek-V3", "deepseek-r1": "DeepSeek-V3"}


def recognise(name: str) -> str | None:
    """The `KNOWN_MODELS` key a checkpoint or repo name stands for, or None."""
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    if "distill" in base:  # e.g. DeepSeek-R1-Distill-Llama-70B: a Llama
        return None
    for family in sorted(_FAMILIES, key=len, reverse=True):
        rest = base[len(family):]
        if base.startswith(family) and (not rest or rest[0] in "-_"):
            return _FAMILIES[family]
    return None


def model_config(name: str) -> ModelConfig:
    """The parsed config of a `KNOWN_MODELS` entry."""
    return ModelConfig.from_hf(KNOWN_MODELS[name])
