"""The three-launch Triton expert sort (`moe_align_large`) against the torch oracle (`moe_align`).

Same capacity and block experts; inside each expert's rows the pairs may come in any order
(atomics), so rows are compared as sets per block. Fresh random routings, with ids other EP
ranks own; through Triton's interpreter on CPU, or on the GPU.
"""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, needs_triton  # noqa: E402 (first: it sets TRITON_INTERPRET)

from deepseek_pd.model.kernels.moe_align import align_by_expert  # noqa: E402

pytestmark = [pytest.mark.timeout(300), needs_triton]


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_large_align_matches_torch_align(block_m):
    from deepseek_pd.model.kernels.moe_align_large import align_by_expert_large

    experts = random.choice([3, 64, 257])
    tokens, k = random.randint(0, 700), random.randint(1, 8)
    ids = torch.randint(-2, experts + 4, (tokens, k), device=DEVICE)
    want = align_by_expert(ids, experts, block_m)
    got = align_by_expert_large(ids.to(torch.int32), experts, block_m)
    assert got.capacity == want.capacity and got.num_pairs == want.num_pairs
    assert torch.equal(got.block_expert.cpu(), want.block_expert.cpu())
    g, w = got.sorted_pair_ids.view(-1, block_m).cpu(), want.sorted_pair_ids.view(-1, block_m).cpu()
    # The contract: each expert's blocks hold exactly its pairs (and the padding); the order of
    # pairs inside an expert is free (the GPU kernel places them by atomics, in any order).
    owner = want.block_expert.cpu()
    for expert in owner.unique().tolist():
        rows = owner == expert
        assert torch.equal(g[rows].flatten().sort().values, w[rows].flatten().sort().values), expert


def test_fused_moe_past_the_one_launch_sort_matches_torch_backend():
    from deepseek_pd.model.kernels.moe_align_small import MAX_PAIRS
    from deepseek_pd.model.moe import MOE_BACKENDS

    experts, k, hidden, inter = 5, 2, 32, 16
    tokens = MAX_PAIRS // k + random.randint(1, 40)  # more pairs than the one-launch sort takes
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device=DEVICE) / inter ** 0.5
    x = torch.randn(tokens, hidden, device=DEVICE)
    ids = torch.rand(tokens, experts, device=DEVICE).topk(k, dim=1).indices
    weights = torch.rand(tokens, k, device=DEVICE)
    want = MOE_BACKENDS.build("torch")(x, ids, weights, w13, w2)
    got = MOE_BACKENDS.build("triton")(x, ids, weights, w13, w2)
    assert float((got - want).norm() / want.norm()) < 1e-5
