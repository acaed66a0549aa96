"""bench/speculative_floor.py: the weight-read bound of a speculative step against a plain one.
Oracles: a Monte-Carlo count of the experts random routing touches (seeded), and the built tiny
model's own parameter bytes (every byte lands in exactly one part, stacked experts split evenly)."""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import torch

from pdtest.bench_scripts import bench_module


def test_expected_distinct_experts_match_random_routing() -> None:
    floor = bench_module("speculative_floor")
    rng = random.Random()
    seed = rng.randrange(2**31)
    print(f"routing seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        experts = rng.choice([8, 64, 256])
        top_k = rng.randint(1, min(8, experts))
        tokens = rng.randint(1, 12)
        trials = 3000
        touched = [len(set(torch.cat([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).tolist()))
                   for _ in range(trials)]
        mean = sum(touched) / trials
        sd = (sum((t - mean) ** 2 for t in touched) / trials) ** 0.5
        expected = floor.expected_distinct(experts, top_k, tokens)
        # 1e-3 absolute: a draw that touches every expert in all trials has sd 0 while the mean is just below E
        assert abs(mean - expected) <= 5 * sd / trials ** 0.5 + 1e-3, (experts, top_k, tokens, mean, expected)
    assert floor.expected_distinct(64, 6, 1) == pytest.approx(6)
    assert floor.expected_distinct(64, 6, 0) == 0


@pytest.fixture(scope="module")
def tiny_mtp_model():
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-mtp", mtp_layers=1)
    runner = ModelRunner(RunnerConfig(model=str(path), device="cpu", dtype="float32", page_size=16, num_pages=16,
                                      speculative_num_steps=1))
    return runner.model, runner.model_config


def test_step_bytes_account_for_every_weight_once(tiny_mtp_model) -> None:
    floor = bench_module("speculative_floor")
    model, config = tiny_mtp_model
    split = floor.step_bytes(model, config.n_routed_experts, config.num_experts_per_tok)
    total = embed = mtp_experts = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        embed += nbytes if "embed_tokens" in name and p is not model.lm_head.weight else 0
        mtp_experts += nbytes if name.startswith("mtp.") and ".mlp.experts." in name else 0
    assert split.moe_layers == sum(1 for layer in model.layers if layer.is_moe) and split.mtp_moe
    assert (split.dense + split.lm_head + split.moe_layers * split.experts * split.expert + split.mtp_dense
            + mtp_experts) == total - embed
    assert split.lm_head == model.lm_head.weight.numel() * model.lm_head.weight.element_size()


def test_the_bound_counts_the_verify_drafts_and_catch_up(tiny_mtp_model) -> None:
    floor = bench_module("speculative_floor")
    model, config = tiny_mtp_model
    split = floor.step_bytes(model, config.n_routed_experts, config.num_experts_per_tok)
    rng = random.Random()
    batch, k = rng.randint(1, 8), rng.randint(1, 3)
    # Routing that reads every expert for any token (top_k = E) leaves only the drafts and catch-up.
    dense_like = floor.StepBytes(**{**split.__dict__, "top_k": split.experts})
    full_mtp = split.mtp_dense + split.experts * split.expert
    assert dense_like.speculative(batch, k) - dense_like.plain(batch) == pytest.approx(
        k * (full_mtp + split.lm_head) + full_mtp)
    rows = floor.floor_rows(split, [batch], [k], (1.8, 2.4, 3.0))
    assert rows[0][f"spec{k}_over_plain"] > 1
    for a in (1.8, 2.4, 3.0):
        key = f"spec{k}_floor_speedup_at_{a}"
        assert (key in rows[0]) == (a <= k + 1)
        if key in rows[0]:
            assert rows[0][key] == pytest.approx(a / rows[0][f"spec{k}_over_plain"], rel=2e-3)


def _v2_lite_on_meta(rng: random.Random, fused: bool):
    """DeepSeek-V2-Lite's shape (operator/known_models.py) on the meta device, with an MTP layer
    added, its shared experts fused into the stacked tensors or not, FP8 block-scaled or bf16 (the
    draws are `rng`'s), and tied embeddings sometimes."""
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM
    from deepseek_pd.operator.known_models import KNOWN_MODELS

    raw = {**KNOWN_MODELS["DeepSeek-V2-Lite"], "num_nextn_predict_layers": 1,
           "tie_word_embeddings": rng.random() < 0.3}
    fp8 = rng.random() < 0.5
    if fp8:
        raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    config = ModelConfig.from_hf(raw)
    return DeepseekForCausalLM(config, BuildOptions(
        dtype=torch.bfloat16, device="meta", fp8_backend="torch" if fp8 else None, mtp=True,
        num_fused_shared_experts=config.n_shared_experts if fused else 0)), config


def _kinds_by_module(model) -> dict[int, str]:
    """Each parameter's kind from where it sits in the module tree (the oracle: no names)."""
    from deepseek_pd.model.moe.experts import FusedExperts

    kinds: dict[int, str] = {}
    for module in model.mtp.modules():
        for p in module.parameters(recurse=False):
            kinds[id(p)] = "mtp_experts" if isinstance(module, FusedExperts) else "mtp_dense"
    for module in model.modules():
        for p in module.parameters(recurse=False):
            kinds.setdefault(id(p), "experts" if isinstance(module, FusedExperts) else "dense")
    kinds[id(model.embed_tokens.weight)] = "embedding"
    kinds[id(model.lm_head.weight)] = "lm_head"  # tied: the head wins
    return kinds


def test_every_parameter_has_one_read_kind_and_each_kind_is_seen(tiny_mtp_model) -> None:
    """bench/param_reads.py, the one rule both weight-byte counters use, against the module tree:
    on the tiny model and on a V2-Lite-shaped one (meta, MTP, FP8 or not, shared experts fused or
    not) each parameter's kind is the one its module gives it, their bytes add up to the model's,
    and every kind occurs (a kind the rule stopped seeing fails)."""
    reads = bench_module("param_reads")
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    print(f"V2-Lite build seed {seed}")
    rng.seed(seed)
    models = [tiny_mtp_model[0], _v2_lite_on_meta(rng, fused=rng.random() < 0.5)[0]]
    seen: set[str] = set()
    for model in models:
        oracle = _kinds_by_module(model)
        by_kind = dict.fromkeys(reads.KINDS, 0)
        for name, p in model.named_parameters():
            kind = reads.param_kind(model, name, p)
            assert kind == oracle[id(p)], (name, kind, oracle[id(p)])
            by_kind[kind] += reads.nbytes(p)
        assert sum(by_kind.values()) == sum(reads.nbytes(p) for p in model.parameters())
        seen |= {kind for kind, size in by_kind.items() if size}
    assert seen == set(reads.KINDS)


def test_fused_shared_experts_are_read_every_step_not_split_as_routed() -> None:
    """The oracle is the same V2-Lite shape with the shared experts as their own MLP (dense): fusing
    them into the stacked tensors changes neither one routed expert's bytes nor what every step
    reads, in `step_bytes`, in `step_reads` (what `OpScopes` counts per parameter) and in
    `active_values` (the prefill floors'). Failed before: `step_bytes` split the fused tensors by
    the routed count (66 slots / 64) and left their shared slots out; the prefill floors
    (kernel_parts_runner.py, v3_slice_gpu.py) counted an unfused shared MLP twice."""
    floor, reads = bench_module("speculative_floor"), bench_module("param_reads")
    seed = random.randrange(1 << 30)
    print(f"V2-Lite build seed {seed}")
    (plain, config), (fused, _) = (_v2_lite_on_meta(random.Random(seed), fused=f) for f in (False, True))
    top_k, experts = config.num_experts_per_tok, config.n_routed_experts
    a, b = (floor.step_bytes(m, experts, top_k) for m in (plain, fused))
    assert (a.expert, a.dense, a.mtp_dense, a.lm_head) == (b.expert, b.dense, b.mtp_dense, b.lm_head)
    read = random.randint(1, top_k)
    totals = [sum(reads.step_reads(m, name, p, read) for name, p in m.named_parameters()) for m in (plain, fused)]
    assert totals[0] == totals[1]
    # The prefill floors' FLOPs (`active_values`): the unfused shared MLP counted once, as the fused slots.
    assert reads.active_values(plain) == reads.active_values(fused)



def test_a_decode_steps_weight_floor_is_the_plain_step_plus_its_rows_and_the_mtp_layer(tiny_mtp_model) -> None:
    """`param_reads.decode_weight_bytes` (the GPU benches' decode floors: kernel_parts_runner.py,
    v3_slice_gpu.py) against `StepBytes.plain`: the same weights, plus the embedding rows of the
    batch and the loaded MTP layer (read whole but for its routed experts)."""
    floor, reads = bench_module("speculative_floor"), bench_module("param_reads")
    model, config = tiny_mtp_model
    split = floor.step_bytes(model, config.n_routed_experts, config.num_experts_per_tok)
    batch = random.randint(1, 64)
    row = model.embed_tokens.weight.shape[-1] * model.embed_tokens.weight.element_size()
    mtp = split.mtp_dense + floor.expected_distinct(split.experts, split.top_k, batch) * split.expert
    assert reads.decode_weight_bytes(model, batch) == pytest.approx(split.plain(batch) + batch * row + mtp)
