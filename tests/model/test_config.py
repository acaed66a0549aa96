"""`ModelConfig.from_hf`: every field of real V2 / V2-Lite / V3 configs, derived values against HF,
and a UserError naming the field for each unsupported or malformed value."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.rope import RotaryEmbedding, rope_inv_freq

pytestmark = pytest.mark.timeout(60)

_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "original_max_position_embeddings": 4096, "type": "yarn"}
_COMMON = {"attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "hidden_act": "silu",
           "initializer_range": 0.02, "kv_lora_rank": 512, "max_position_embeddings": 163840,
           "moe_layer_freq": 1, "pretraining_tp": 1, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "rms_norm_eps": 1e-06, "rope_theta": 10000, "seq_aux": True, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "auto_map": {"AutoConfig": "x"}}
V3 = {**_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "bos_token_id": 0,
      "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432,
      "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
      "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
      "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": [128, 128]},
      "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, "routed_scaling_factor": 2.5,
      "scoring_func": "sigmoid", "topk_group": 4, "topk_method": "noaux_tc", "vocab_size": 129280}
V2_LITE = {**_COMMON, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
           "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_size": 2048,
           "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
           "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
           "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
           "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}, "routed_scaling_factor": 1.0,
           "scoring_func": "softmax", "topk_group": 1, "topk_method": "greedy", "vocab_size": 102400}
V2 = {**V2_LITE, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_group": 8,
      "n_routed_experts": 160, "num_attention_heads": 128, "num_hidden_layers": 60, "num_key_value_heads": 128,
      "q_lora_rank": 1536, "routed_scaling_factor": 16.0, "topk_group": 3, "topk_method": "group_limited_greedy"}


def test_v3_fields_and_derived_values():
    c = ModelConfig.from_hf(V3)
    assert (c.model_type, c.architectures, c.vocab_size, c.hidden_size) == ("deepseek_v3", ("DeepseekV3ForCausalLM",),
                                                                           129280, 7168)
    assert (c.intermediate_size, c.moe_intermediate_size, c.num_hidden_layers) == (18432, 2048, 61)
    assert (c.num_attention_heads, c.num_key_value_heads, c.q_lora_rank, c.kv_lora_rank) == (128, 128, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim) == (128, 64, 128, 192)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (256, 1, 8)
    assert (c.topk_method, c.scoring_func, c.n_group, c.topk_group) == ("noaux_tc", "sigmoid", 8, 4)
    assert (c.norm_topk_prob, c.routed_scaling_factor, c.first_k_dense_replace, c.moe_layer_freq) == (True, 2.5, 3, 1)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings, c.num_nextn_predict_layers) == (1e-6, 1e4,
                                                                                                     163840, 1)
    assert (c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids, c.torch_dtype) == (False, 0, (1,), "bfloat16")
    assert c.rope.rope_type == "yarn" and c.rope.factor == 40 and c.rope.original_max_position_embeddings == 4096
    assert (c.rope.beta_fast, c.rope.beta_slow, c.rope.mscale, c.rope.mscale_all_dim) == (32, 1, 1.0, 1.0)
    assert c.rope_interleave
    assert c.is_fp8 and c.quantization["weight_block_size"] == (128, 128)
    assert c.kv_cache_dim == 576
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    mscale = 0.1 * math.log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-12)


def test_v2_lite_and_v2_fields():
    lite = ModelConfig.from_hf(V2_LITE)
    assert lite.q_lora_rank is None and lite.topk_method == "greedy" and lite.scoring_func == "softmax"
    assert (lite.n_group, lite.topk_group, lite.n_shared_experts, lite.first_k_dense_replace) == (1, 1, 2, 1)
    assert not lite.norm_topk_prob and lite.routed_scaling_factor == 1.0 and lite.num_nextn_predict_layers == 0
    assert (lite.bos_token_id, lite.eos_token_ids, lite.quantization) == (100000, (100001,), None)
    assert lite.rope.mscale == lite.rope.mscale_all_dim == 0.707 and lite.rope.attention_factor == 1.0
    v2 = ModelConfig.from_hf(V2)
    assert (v2.topk_method, v2.n_group, v2.topk_group, v2.routed_scaling_factor) == ("group_limited_greedy", 8, 3,
                                                                                    16.0)
    assert v2.q_lora_rank == 1536 and v2.num_hidden_layers == 60


def test_moe_layer_freq_and_dense_model():
    c = ModelConfig.from_hf({**V2_LITE, "first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert [c.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    dense = ModelConfig.from_hf({**V2_LITE, "n_routed_experts": None})
    assert not any(dense.is_moe_layer(i) for i in range(4))


def test_reads_file_directory_and_new_rope_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V3))
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(tmp_path / "config.json") == ModelConfig.from_hf(V3)
    newer = {k: v for k, v in V3.items() if k not in ("rope_scaling", "rope_theta")}
    newer["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096}
    assert ModelConfig.from_hf(newer) == ModelConfig.from_hf(V3)
    plain = ModelConfig.from_hf({k: v for k, v in V3.items() if k != "rope_scaling"})
    assert plain.rope.rope_type == "default" and plain.softmax_scale == 192 ** -0.5


def test_hf_config_objects_round_trip():
    from transformers import DeepseekV2Config, DeepseekV3Config
    v3 = ModelConfig.from_hf(DeepseekV3Config().to_dict())
    assert (v3.topk_method, v3.scoring_func, v3.n_routed_experts, v3.num_nextn_predict_layers) == (
        "noaux_tc", "sigmoid", 256, 1)
    v2 = ModelConfig.from_hf(DeepseekV2Config(num_experts_per_tok=6).to_dict())
    assert (v2.topk_method, v2.scoring_func, v2.q_lora_rank) == ("greedy", "softmax", 1536)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 1.0), (0.707, 0.707), (1.0, 0.8), (None, 0.8), (0.9, None)])
def test_yarn_matches_hf(mscale, mscale_all_dim):
    """inv_freq, cos/sin attention factor and softmax scale against HF's own code."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    rng = random.Random()
    rope = {"rope_type": "yarn", "rope_theta": rng.choice([10000.0, 50000.0]), "factor": rng.uniform(1.5, 40),
            "original_max_position_embeddings": rng.choice([64, 4096]), "beta_fast": 32, "beta_slow": 1}
    if mscale is not None:
        rope["mscale"] = mscale
    if mscale_all_dim is not None:
        rope["mscale_all_dim"] = mscale_all_dim
    hf = DeepseekV3Config(hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                          num_key_value_heads=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                          num_hidden_layers=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=rng.choice([4, 16, 64]), v_head_dim=8, n_routed_experts=8,
                          rope_parameters=rope, max_position_embeddings=8192)
    ours = ModelConfig.from_hf(hf.to_dict())
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(rope_inv_freq(ours.rope, ours.qk_rope_head_dim), want_freq)
    assert ours.rope.attention_factor == pytest.approx(want_factor, rel=1e-12)
    assert ours.softmax_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)


def test_rope_rotation_matches_hf_interleaved_and_half():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3
    for interleave, apply in ((True, m3.apply_rotary_pos_emb_interleave), (False, m3.apply_rotary_pos_emb)):
        cfg = ModelConfig.from_hf({**V3, "rope_interleave": interleave, "qk_rope_head_dim": 8})
        rotary = RotaryEmbedding(cfg)
        pos = torch.randint(0, 5000, (7,))
        q, k = torch.randn(7, 3, 8), torch.randn(7, 8)
        got_q, got_k = rotary(pos, q, k)
        freqs = pos[:, None].float() * rotary.inv_freq[None]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos() * rotary.attention_factor, emb.sin() * rotary.attention_factor
        want_q, want_k = apply(q.transpose(0, 1)[None], k[None, None], cos[None], sin[None])
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k[0, 0], rtol=1e-5, atol=1e-5)


BAD = [
    ({"topk_method": "foo"}, "topk_method"),
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"rope_scaling": {**_YARN, "type": "dynamic"}}, "rope_type"),
    ({"rope_scaling": {**_YARN, "factor": "big"}}, "rope_scaling.factor"),
    ({"hidden_size": "7168"}, "hidden_size"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"q_lora_rank": [1]}, "q_lora_rank"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"n_group": 7}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "llama"}, "model_type"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"eos_token_id": "</s>"}, "eos_token_id"),
]


@pytest.mark.parametrize("change, field", BAD, ids=[f for _, f in BAD])
def test_unsupported_values_name_the_field(change, field):
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        ModelConfig.from_hf({**V3, **change})


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "kv_lora_rank", "num_attention_heads",
                                   "moe_intermediate_size", "qk_nope_head_dim", "v_head_dim", "num_hidden_layers"])
def test_missing_required_field(field):
    with pytest.raises(UserError, match=f"'{field}' is missing"):
        ModelConfig.from_hf({k: v for k, v in V2_LITE.items() if k != field})


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(UserError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


def test_frozen():
    c = ModelConfig.from_hf(V3)
    with pytest.raises(Exception):
        c.hidden_size = 1  # type: ignore[misc]
