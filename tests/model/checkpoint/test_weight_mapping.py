"""The HF → ours weight mapping as the pure function it is: parameters by name in, no model object.

Oracle: the single-process model loaded from the same HF tensors (itself checked against HF logits in
test_hf_parity.py). Checked: every parameter gets written (none is left NaN) for each tiny shape,
and an EP rank's shard — a plain dict of tensors with that rank's shapes, no process group — equals
the matching rows of the single-process load, for a random rank, from stacked and per-expert names.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.distributed.parallel import ExpertPlacement, ParallelInfo
from deepseek_pd.model.checkpoint.weight_mapping import load_hf_weights
from pdtest.ep_worker import per_expert_names
from pdtest.hf_oracle import TinyShape, build_hf_model, our_config, our_model

pytestmark = pytest.mark.timeout(120)

SHAPES = {
    "v3_qlora_shared1": TinyShape(arch="v3", n_shared_experts=1),
    "v3_noqlora_shared2_alldense0": TinyShape(arch="v3", q_lora_rank=None, n_shared_experts=2, first_k_dense_replace=0),
    "v2_tied_shared0": TinyShape(arch="v2", topk_method="greedy", n_shared_experts=0,
                                 extra={"tie_word_embeddings": True}),
}


def _nan_like(tensor: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    shape = tensor.shape if rows is None else (rows, *tensor.shape[1:])
    return torch.full(shape, math.nan, dtype=tensor.dtype)


def _assert_all_written(params: dict[str, torch.Tensor]) -> None:
    unwritten = sorted(name for name, t in params.items() if torch.isnan(t).any())
    assert not unwritten, f"parameters the mapping never wrote: {unwritten}"


@pytest.fixture
def seed() -> int:
    return random.randrange(1 << 30)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fused", [False, True])
def test_every_parameter_is_written_and_equals_the_model_load(shape, fused, seed):
    torch.set_num_threads(1)
    hf = build_hf_model(SHAPES[shape], seed)
    config = our_config(hf)
    num_fused = config.n_shared_experts if fused else 0
    reference = our_model(hf, BuildOptions(num_fused_shared_experts=num_fused))
    params = {name: _nan_like(t) for name, t in reference.named_parameters()}
    placement = ExpertPlacement(config.n_routed_experts, num_fused, ParallelInfo())
    load_hf_weights(config, placement, params, per_expert_names(hf.state_dict()).items())
    _assert_all_written(params)
    for name, want in reference.named_parameters():
        assert torch.equal(params[name], want), f"seed={seed} {name}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stacked", [False, True])
def test_an_ep_shard_is_the_rows_of_the_single_process_load(world, stacked, seed):
    torch.set_num_threads(1)
    rng = random.Random(seed)
    hf = build_hf_model(TinyShape(arch="v3", n_shared_experts=1, first_k_dense_replace=1), seed)
    config = our_config(hf)
    num_fused = rng.choice([0, config.n_shared_experts])
    reference = dict(our_model(hf, BuildOptions(num_fused_shared_experts=num_fused)).named_parameters())
    rank = rng.randrange(world)
    placement = ExpertPlacement(config.n_routed_experts, num_fused, ParallelInfo(world, rank))
    # This rank's parameter shapes: stacked expert weights hold only its block (+ fused shared ones).
    params = {name: _nan_like(t, placement.num_local_experts if name.endswith(("experts.w13", "experts.w2")) else None)
              for name, t in reference.items()}
    hf_weights = hf.state_dict() if stacked else per_expert_names(hf.state_dict())
    load_hf_weights(config, placement, params, hf_weights.items())
    _assert_all_written(params)
    first, n = placement.first_local, placement.num_local_routed
    for name, want in reference.items():
        if name.endswith(("experts.w13", "experts.w2")):
            routed, shared = want[:config.n_routed_experts], want[config.n_routed_experts:]
            want = torch.cat([routed[first:first + n], shared])
        assert torch.equal(params[name], want), f"seed={seed} world={world} rank={rank} fused={num_fused} {name}"
