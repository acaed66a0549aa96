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


def test_mla_decode_fixed_splits_row_bits_do_not_depend_on_the_batch():
    """Fixed 256-position splits: a row's output is the same alone and in a batch whose longest
    context (and so split count) is another; the values match the default split's."""
    from deepseek_pd.model.kernels.mla_decode import INVARIANT_DECODE_TILE, MLADecodeTile, mla_decode

    rng = random.Random()
    heads, rank, rope, page = 16, 64, 16, 8
    lengths = [rng.randrange(1, 700) for _ in range(5)] + [rng.randrange(520, 800)]  # >= 3 splits for one
    need = [-(-n // page) for n in lengths]
    cache = torch.randn(sum(need), page, rank + rope, device=DEVICE)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=DEVICE)
    order = torch.randperm(sum(need)).tolist()
    for row, n in enumerate(need):
        table[row, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lengths), heads, rank, device=DEVICE)
    q_pe = torch.randn(len(lengths), heads, rope, device=DEVICE)

    def run(rows: list[int], tile: MLADecodeTile) -> torch.Tensor:
        idx = torch.tensor(rows, device=DEVICE)
        return mla_decode(q[idx], q_pe[idx], cache, table[idx], seq_lens[idx], max(lengths[r] for r in rows),
                          0.125, tile=tile)

    everyone = list(range(len(lengths)))
    full = run(everyone, INVARIANT_DECODE_TILE)
    torch.testing.assert_close(full, run(everyone, MLADecodeTile()), atol=1e-4, rtol=1e-4)
    for row in range(len(lengths) - 1):  # each short row alone, and beside the longest one
        assert torch.equal(run([row], INVARIANT_DECODE_TILE)[0], full[row])
        assert torch.equal(run([len(lengths) - 1, row], INVARIANT_DECODE_TILE)[1], full[row])


def test_fused_moe_invariant_row_bits_do_not_depend_on_the_batch():
    from deepseek_pd.model.kernels.fused_moe import fused_moe

    rng = random.Random()
    experts, top_k, hidden, inter = 6, 3, 256, 160  # K over several BLOCK_K steps of either tile
    tokens = rng.randrange(40, 90)  # > 16 rows per expert: the default tile table picks another tile than alone
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE) / 8
    w2 = torch.randn(experts, hidden, inter, device=DEVICE) / 8
    x = torch.randn(tokens, hidden, device=DEVICE)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, device=DEVICE)
    full = fused_moe(x, ids, weights, w13, w2, invariant=True)
    torch.testing.assert_close(full, fused_moe(x, ids, weights, w13, w2), atol=1e-4, rtol=1e-4)
    default = fused_moe(x, ids, weights, w13, w2)
    default_same = []
    for row in rng.sample(range(tokens), 3):
        alone = fused_moe(x[row:row + 1], ids[row:row + 1], weights[row:row + 1], w13, w2, invariant=True)
        assert torch.equal(alone[0], full[row])
        default_same.append(torch.equal(fused_moe(x[row:row + 1], ids[row:row + 1], weights[row:row + 1], w13, w2)[0],
                                        default[row]))
    assert not all(default_same), "the default tile table should vary here; else this test shows nothing"
