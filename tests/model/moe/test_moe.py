"""MoE routing and experts against plain per-token references written here, independently of the
model code (Python loops over tokens, groups and experts)."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from deepseek_pd.errors import UserError
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.moe import MOE_BACKENDS, DeepseekMoE
from deepseek_pd.model.moe.topk import SCORING, TOPK_METHODS, TopKSpec, finish_weights

pytestmark = pytest.mark.timeout(60)


def _reference_route(logits: list[float], method: str, scoring: str, bias: list[float], k: int, n_group: int,
                     topk_group: int, norm: bool, scale: float) -> dict[int, float]:
    """One token: {expert id: weight}."""
    if scoring == "softmax":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        scores = [e / sum(exps) for e in exps]
    else:
        scores = [1 / (1 + math.exp(-x)) for x in logits]
    n = len(scores)
    per_group = n // n_group
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(n_group)]
    if method == "greedy":
        chosen = sorted(range(n), key=lambda e: -scores[e])[:k]
    elif method == "group_limited_greedy":
        best = sorted(range(n_group), key=lambda g: -max(scores[e] for e in groups[g]))[:topk_group]
        candidates = [e for g in best for e in groups[g]]
        chosen = sorted(candidates, key=lambda e: -scores[e])[:k]
    else:  # noaux_tc
        choice = [s + b for s, b in zip(scores, bias)]
        group_score = [sum(sorted((choice[e] for e in groups[g]), reverse=True)[:2]) for g in range(n_group)]
        best = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in best for e in groups[g]]
        chosen = sorted(candidates, key=lambda e: -choice[e])[:k]
    weights = {e: scores[e] for e in chosen}
    if norm:
        total = sum(weights.values()) + 1e-20
        weights = {e: w / total for e, w in weights.items()}
    return {e: w * scale for e, w in weights.items()}


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_topk_methods_match_reference(method, scoring):
    rng = random.Random()
    n_group = rng.choice([1, 2, 4])
    per_group = rng.choice([2, 3, 4])
    num_experts = n_group * per_group
    topk_group = rng.randint(1, n_group)
    k = rng.randint(1, topk_group * per_group if method != "greedy" else num_experts)
    spec = TopKSpec(k, n_group, topk_group, norm_topk_prob=rng.random() < 0.5,
                    routed_scaling_factor=rng.choice([1.0, 2.5]))
    tokens = rng.randint(1, 20)
    logits = torch.randn(tokens, num_experts, dtype=torch.float64).float() * 3
    bias = torch.randn(num_experts) * 0.5
    weights, ids = TOPK_METHODS[method](SCORING[scoring](logits), bias, spec)
    weights = finish_weights(weights, spec)
    for t in range(tokens):
        want = _reference_route(logits[t].tolist(), method, scoring, bias.tolist(), k, n_group, topk_group,
                                spec.norm_topk_prob, spec.routed_scaling_factor)
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want), (method, scoring, t, got, want)
        for e in want:
            assert got[e] == pytest.approx(want[e], rel=1e-5, abs=1e-7)


def _reference_experts(hidden, ids, weights, w13, w2) -> torch.Tensor:
    out = torch.zeros_like(hidden, dtype=torch.float64)
    inter = w2.shape[-1]
    for t in range(hidden.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            if not 0 <= e < w13.shape[0]:
                continue  # owned by another EP rank
            x = hidden[t].double()
            gate = w13[e, :inter].double() @ x
            up = w13[e, inter:].double() @ x
            out[t] += w * (w2[e].double() @ (F.silu(gate) * up))
    return out


def test_torch_moe_kernel_matches_per_token_reference():
    rng = random.Random()
    experts, hidden_size, inter = rng.randint(2, 9), rng.randint(4, 24), rng.randint(2, 16)
    tokens, k = rng.randint(1, 30), rng.randint(1, 3)
    hidden = torch.randn(tokens, hidden_size)
    w13, w2 = torch.randn(experts, 2 * inter, hidden_size), torch.randn(experts, hidden_size, inter)
    ids = torch.randint(-1, experts + 1, (tokens, k))  # -1 and `experts` are not local experts
    weights = torch.rand(tokens, k)
    got = MOE_BACKENDS.build("torch")(hidden, ids, weights, w13, w2)
    torch.testing.assert_close(got.double(), _reference_experts(hidden, ids, weights, w13, w2), rtol=1e-4, atol=1e-4)
    empty = MOE_BACKENDS.build("torch")(hidden[:0], ids[:0], weights[:0], w13, w2)
    assert empty.shape == (0, hidden_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_torch_kernel_keeps_its_expert_counts_on_the_device_bit_for_bit(dtype):
    """On the CPU the "torch" kernel runs its per-expert GEMMs from device offsets (`_grouped_mm`):
    the same products and sums as its loop over host counts (the oracle: today's kernel), bit
    for bit, whatever the batch (a CPU BLAS multiplies a row differently at different row counts,
    so only the same per-expert GEMMs can be equal), with dropped and repeated ids."""
    from deepseek_pd.model.moe.experts import TorchMoEKernel

    class HostCounts(TorchMoEKernel):
        def _groups_on_device(self, hidden, w2):
            return False

    kernel = MOE_BACKENDS.build("torch")
    rng = random.Random()
    for _ in range(10):
        experts, k = rng.randint(1, 12), rng.randint(1, 4)
        hidden_size, inter = 8 * rng.randint(1, 8), 8 * rng.randint(1, 6)  # rows of 16-byte multiples
        tokens = rng.choice([1, 2, 3, 4, 8, rng.randint(5, 40)])
        hidden = torch.randn(tokens, hidden_size).to(dtype)
        w13 = (torch.randn(experts, 2 * inter, hidden_size) / hidden_size ** 0.5).to(dtype)
        w2 = (torch.randn(experts, hidden_size, inter) / inter ** 0.5).to(dtype)
        ids = torch.randint(-1, experts + 1, (tokens, k))  # -1 and `experts`: another rank's; repeats too
        weights = torch.rand(tokens, k)
        assert kernel._groups_on_device(hidden, w2)
        got, want = kernel(hidden, ids, weights, w13, w2), HostCounts()(hidden, ids, weights, w13, w2)
        assert torch.equal(got, want), (experts, k, hidden_size, inter, tokens, (got - want).abs().max())


def _moe_config(**over) -> ModelConfig:
    base = {"model_type": "deepseek_v3", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
            "moe_intermediate_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2, "kv_lora_rank": 4,
            "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2, "n_routed_experts": 8,
            "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "first_k_dense_replace": 0}
    return ModelConfig.from_hf({**base, **over})


def test_fused_shared_experts_equal_separate_shared_mlp():
    cfg = _moe_config()
    separate = DeepseekMoE(cfg, BuildOptions())
    fused = DeepseekMoE(cfg, BuildOptions(num_fused_shared_experts=2))
    inter = cfg.moe_intermediate_size
    with torch.no_grad():
        for p in separate.parameters():
            p.copy_(torch.randn(p.shape))
        fused.gate_weight.copy_(separate.gate_weight)
        fused.e_score_correction_bias.copy_(separate.e_score_correction_bias)
        fused.experts.w13[:8].copy_(separate.experts.w13)
        fused.experts.w2[:8].copy_(separate.experts.w2)
        gate_up = separate.shared_experts.gate_up_proj.weight
        gate, up = gate_up[:2 * inter], gate_up[2 * inter:]
        for s in range(2):
            fused.experts.w13[8 + s].copy_(torch.cat([gate[s * inter:(s + 1) * inter], up[s * inter:(s + 1) * inter]]))
            fused.experts.w2[8 + s].copy_(separate.shared_experts.down_proj.weight[:, s * inter:(s + 1) * inter])
    x = torch.randn(7, cfg.hidden_size)

    def run(moe: DeepseekMoE) -> torch.Tensor:
        weights, ids = moe.select_experts(moe.router_logits(x))
        shared = moe.shared(x)
        routed = moe.experts(x, ids, weights)
        return routed if shared is None else routed + shared

    weights, ids = fused.select_experts(fused.router_logits(x))
    assert ids[:, -2:].tolist() == [[8, 9]] * 7 and weights[:, -2:].eq(1).all()
    torch.testing.assert_close(run(fused), run(separate), rtol=1e-5, atol=1e-5)


def test_bad_fused_shared_count_is_a_user_error():
    with pytest.raises(UserError, match="num_fused_shared_experts"):
        DeepseekMoE(_moe_config(), BuildOptions(num_fused_shared_experts=1))
    with pytest.raises(UserError, match="unknown MoE backend 'nope'"):
        DeepseekMoE(_moe_config(), BuildOptions(moe_backend="nope"))
