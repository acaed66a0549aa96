"""Batch-invariant kernels (`--deterministic`): a row's bits do not depend on the rest of the batch.

CPU through Triton's interpreter (TRITON_INTERPRET=1), or on a GPU; the torch ops are the oracles
for the values, the row computed alone (or in another batch) for the bits.
"""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, HAS_CUDA, needs_triton  # noqa: E402 (first: it sets TRITON_INTERPRET)

pytestmark = needs_triton
# Triton 3.6's interpreter multiplies bf16 tiles as raw integers (numpy has no bf16): bf16 on the GPU.
DTYPES = [torch.float32] + [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] * HAS_CUDA


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_invariant_row_bits_do_not_depend_on_the_batch(dtype):
    from deepseek_pd.model.kernels.matmul_invariant import INVARIANT_TILE, matmul_invariant

    rng = random.Random()
    k, n = rng.randrange(40, 200), rng.randrange(20, 150)
    m = rng.randrange(INVARIANT_TILE.block_m + 1, 2 * INVARIANT_TILE.block_m + 30)  # two row tiles
    a = torch.randn(2, m, k, device=DEVICE).to(dtype)
    b = torch.randn(2, k, n, device=DEVICE).to(dtype)
    full = matmul_invariant(a, b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(full.float(), torch.bmm(a.float(), b.float()), **tol)
    for row in rng.sample(range(m), 3):
        alone = matmul_invariant(a[:, row:row + 1], b)
        lo = rng.randrange(0, row + 1)
        window = matmul_invariant(a[:, lo:row + 1 + rng.randrange(0, 5)], b)  # another M, another slot
        assert torch.equal(alone[:, 0], full[:, row])
        assert torch.equal(window[:, row - lo], full[:, row])


def test_matmul_invariant_takes_a_transposed_weight_view():
    from deepseek_pd.model.kernels.matmul_invariant import matmul_invariant

    w = torch.randn(33, 70, device=DEVICE)  # [N, K] as nn.Linear stores it
    x = torch.randn(5, 70, device=DEVICE)
    out = matmul_invariant(x.unsqueeze(0), w.t().unsqueeze(0))[0]
    torch.testing.assert_close(out, x @ w.t(), atol=1e-4, rtol=1e-4)


def test_matmul_invariant_refuses_shapes_that_do_not_fit():
    from deepseek_pd.model.kernels.matmul_invariant import matmul_invariant

    with pytest.raises(ValueError, match="shapes do not fit"):
        matmul_invariant(torch.randn(1, 3, 4, device=DEVICE), torch.randn(1, 5, 2, device=DEVICE))
