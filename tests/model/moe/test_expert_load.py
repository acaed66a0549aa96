"""`ExpertLoadRecorder` (the statistics an expert-placement rebalancer plans from): its counts per
MoE layer and routed expert equal the router's own top-k choices, captured as the router makes them,
for fresh random prompts, with and without fused shared experts (which are never counted); counts
add up over forwards and `reset` starts again."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig

pytestmark = pytest.mark.timeout(120)
PAGE = 4


def _spy(runner: ModelRunner) -> dict[int, list[torch.Tensor]]:
    """Wraps each MoE layer's top-k method; returns layer id -> the ids it chose, per call."""
    seen: dict[int, list[torch.Tensor]] = {}
    for layer in runner.model.layers:
        if not layer.is_moe:
            continue
        choose = layer.mlp.choose

        def spied(scores, bias, spec, _choose=choose, _id=layer.layer_id):
            weights, ids = _choose(scores, bias, spec)
            seen.setdefault(_id, []).append(ids.clone())
            return weights, ids
        layer.mlp.choose = spied
    return seen


def _extend(runner: ModelRunner, rng: random.Random, count: int) -> int:
    seqs, tokens = [], 0
    for _ in range(count):
        ids = [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))]
        seqs.append(ExtendSeq(ids, 0, runner.kv_pool.alloc(-(-len(ids) // PAGE))))
        tokens += len(ids)
    runner.extend(seqs)
    return tokens


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused-shared"])
def test_counts_equal_the_routers_topk_choices(fused) -> None:
    rng = random.Random()
    runner = ModelRunner(RunnerConfig(model="tiny", device="cpu", page_size=PAGE, num_pages=256,
                                      num_fused_shared_experts=1 if fused else 0))
    recorder = runner.record_expert_load()
    seen = _spy(runner)
    tokens = sum(_extend(runner, rng, rng.randint(1, 4)) for _ in range(rng.randint(2, 3)))
    counts = recorder.snapshot()
    config = runner.model_config
    assert counts.shape == (len(recorder.moe_layer_ids), config.n_routed_experts)
    for row, layer_id in enumerate(recorder.moe_layer_ids):
        chosen = torch.cat(seen[layer_id]).reshape(-1)
        assert torch.equal(counts[row], torch.bincount(chosen, minlength=config.n_routed_experts))
        assert int(counts[row].sum()) == tokens * config.num_experts_per_tok  # no fused shared ids
    recorder.reset()
    assert int(recorder.snapshot().sum()) == 0
