"""`weight_bytes.rank_weights` against the models themselves: our DeepSeek model built with torch
(on the meta device) from the same config, and HF transformers' for the published shapes.

The oracle never uses the plan's formula: it sums `numel * element_size` over what the built
module holds. Configs are drawn fresh each run (the seed is in every failure message); EP ranks
come from a fake process group, so an EP model builds in one process without a collective.
"""
from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.distributed as dist
import transformers

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.eplb.expert_location import resolve_expert_location
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.checkpoint.tiny import tiny_config
from deepseek_pd.operator.known_models import KNOWN_MODELS, model_config
from deepseek_pd.operator.weight_bytes import WeightFormat, rank_weights

pytestmark = pytest.mark.timeout(120)
DTYPES = {2: torch.bfloat16, 4: torch.float32}


@contextlib.contextmanager
def _fake_world(size: int, rank: int):
    """A default process group of `size` ranks that never communicates (this process is `rank`)."""
    if size == 1:
        yield ParallelInfo()
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())
    try:
        yield ParallelInfo.from_group()
    finally:
        dist.destroy_process_group()


def _random_config(rng: random.Random) -> dict:
    """A small DeepSeek config with random dims: FP8 blocks that do and do not divide them,
    with and without q_lora, tied embeddings, dense layers, V2 and V3 routing."""
    raw = tiny_config(rng.choice(["v2", "v3"]), vocab_size=rng.choice([96, 130, 256]))
    experts = rng.choice([4, 8, 16])
    raw.update(
        hidden_size=rng.choice([64, 96, 128]), intermediate_size=rng.choice([64, 160]),
        moe_intermediate_size=rng.choice([32, 48, 64]), num_hidden_layers=rng.randint(2, 4),
        num_attention_heads=rng.choice([2, 4]), kv_lora_rank=rng.choice([32, 64]),
        qk_rope_head_dim=rng.choice([16, 32]), qk_nope_head_dim=rng.choice([16, 32]),
        v_head_dim=rng.choice([16, 48]), q_lora_rank=rng.choice([None, 48, 64]),
        n_routed_experts=experts, n_shared_experts=rng.choice([1, 2]),
        first_k_dense_replace=rng.randint(0, 1), tie_word_embeddings=rng.random() < 0.3,
        n_group=2, topk_group=1, num_experts_per_tok=2)
    raw["num_key_value_heads"] = raw["num_attention_heads"]
    if rng.random() < 0.6:
        raw["quantization_config"] = {"quant_method": "fp8",
                                      "weight_block_size": [rng.choice([16, 32, 128]), rng.choice([16, 32, 128])]}
    return raw


def _held_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every parameter and buffer, values excluding FP8 scales): what a rank holds."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    values = sum(t.numel() for name, t in tensors if not name.endswith("_scale_inv"))
    return total, values


@pytest.mark.parametrize("case", range(10))
def test_rank_weights_equal_what_the_built_model_holds(case):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    raw = _random_config(rng)
    config = ModelConfig.from_hf(raw)
    # The MTP layer (speculative decoding, 4 cases in 10) where the runner builds it today: one
    # rank, no EPLB.
    mtp = rng.random() < 0.4
    if mtp:
        raw["num_nextn_predict_layers"] = 1
        config = ModelConfig.from_hf(raw)
    # EPLB's redundant experts (half the cases): E + R slots, which ep must divide (E need not)
    redundant = 0 if mtp else rng.choice([0, rng.randint(1, 6)])
    ep = 1 if mtp else rng.choice([e for e in (1, 2, 4) if (config.n_routed_experts + redundant) % e == 0])
    fp8 = config.is_fp8 and rng.random() < 0.8
    fused = rng.choice([0, config.n_shared_experts])
    itemsize = rng.choice([2, 4])
    location = resolve_expert_location(config, ep, redundant, None)
    with _fake_world(ep, rng.randrange(ep)) as parallel:
        model = DeepseekForCausalLM(config, BuildOptions(
            dtype=DTYPES[itemsize], device="meta", dispatcher="local" if ep == 1 else "all_to_all",
            parallel=parallel, fp8_backend="torch" if fp8 else None, num_fused_shared_experts=fused,
            expert_location=location, mtp=mtp))
    expected_bytes, expected_values = _held_bytes(model)

    block = tuple(config.quantization["weight_block_size"]) if fp8 else None
    plan = rank_weights(config, WeightFormat(itemsize, block), ep, fused, redundant, mtp=mtp)
    what = (f"seed {seed}: ep {ep}, redundant {redundant}, fp8 {fp8}, fused {fused}, dtype bytes {itemsize}, "
            f"mtp {mtp}, config {raw}")
    assert plan.total_bytes == expected_bytes, what
    assert plan.parameters == expected_values, what


def test_experts_split_over_ranks_and_the_rest_is_replicated():
    """Doubling ep halves the experts' share and leaves the rest alone (V3 in FP8); R redundant
    experts add R / ep expert slots per rank, and an ep that does not divide E + R is refused."""
    config = model_config("DeepSeek-V3")
    fmt = WeightFormat(2, (128, 128))
    one, eight, sixteen = (rank_weights(config, fmt, ep) for ep in (1, 8, 16))
    assert one.replicated_bytes == eight.replicated_bytes == sixteen.replicated_bytes
    assert one.expert_bytes == 8 * eight.expert_bytes == 16 * sixteen.expert_bytes
    redundant = 16 * random.randint(1, 4)
    more = rank_weights(config, fmt, 16, redundant_experts=redundant)
    assert more.replicated_bytes == sixteen.replicated_bytes
    assert more.expert_bytes * 256 == sixteen.expert_bytes * (256 + redundant)
    with pytest.raises(ValueError, match="redundant"):
        rank_weights(config, fmt, 16, redundant_experts=redundant + 1)


def _hf_model(name: str) -> torch.nn.Module:
    raw = {k: v for k, v in KNOWN_MODELS[name].items()
           if k not in ("architectures", "model_type", "torch_dtype", "quantization_config")}
    is_v3 = KNOWN_MODELS[name]["model_type"] == "deepseek_v3"
    config = (transformers.DeepseekV3Config if is_v3 else transformers.DeepseekV2Config)(**raw)
    with torch.device("meta"):
        return (transformers.DeepseekV3ForCausalLM if is_v3 else transformers.DeepseekV2ForCausalLM)(config)


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_known_models_have_the_parameters_of_hf_models_of_the_same_config(name):
    """Full-size V2-Lite (15.7B), V2 (236B) and V3 (671B without MTP), counted by HF on meta.
    HF keeps kv_b_proj where we keep w_kc/w_vc (the same values), and rope buffers we do not count."""
    model = _hf_model(name)
    hf_values = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if "rotary" not in n)
    config = model_config(name)
    ours = rank_weights(config, WeightFormat(2)).parameters - config.qk_rope_head_dim // 2  # inv_freq
    assert ours == hf_values


@pytest.mark.parametrize("name, billions", [("DeepSeek-V2-Lite", 15.7), ("DeepSeek-V2", 236), ("DeepSeek-V3", 671)])
def test_known_models_have_their_published_sizes(name, billions):
    """DeepSeek's published totals (V3: 671B, its 14B MTP module apart), a check on the table's
    transcription that does not go through it twice as the HF comparison does."""
    total = rank_weights(model_config(name), WeightFormat(2)).parameters / 1e9
    assert round(total, 1 if billions < 100 else 0) == billions


def test_the_table_matches_the_config_tests_transcription_of_the_published_configs():
    """tests/model/test_config.py copies the same config.json files, field for field."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "model" / "test_config.py"
    module_spec = importlib.util.spec_from_file_location("published_configs", path)
    published = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(published)
    ignored = {"bos_token_id", "eos_token_ids"}  # not in the table: they shape no memory
    for name, raw in (("DeepSeek-V3", published.V3), ("DeepSeek-V2", published.V2),
                      ("DeepSeek-V2-Lite", published.V2_LITE)):
        ours, theirs = model_config(name), ModelConfig.from_hf(raw)
        for field in ModelConfig.__dataclass_fields__:
            if field not in ignored:
                assert getattr(ours, field) == getattr(theirs, field), (name, field)
