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


def test_every_parameter_has_one_read_kind_and_each_kind_is_seen(tiny_mtp_model) -> None:
    """bench/param_reads.py, the one rule both weight-byte counters use: on a model with an MTP
    layer every kind occurs, the experts are exactly the stacked 3-D tensors under `.mlp.experts.`
    (main and MTP), and the LM head is the head's own tensor."""
    reads = bench_module("param_reads")
    model, config = tiny_mtp_model
    kinds = {name: reads.param_kind(model, name, p) for name, p in model.named_parameters()}
    assert set(kinds.values()) == set(reads.KINDS)
    for name, p in model.named_parameters():
        stacked = ".mlp.experts." in name and p.dim() == 3
        assert (kinds[name] in ("experts", "mtp_experts")) == stacked, name
        if stacked:
            assert p.shape[0] == config.n_routed_experts and (kinds[name] == "mtp_experts") == name.startswith("mtp.")
        assert (kinds[name] == "lm_head") == (p is model.lm_head.weight), name
