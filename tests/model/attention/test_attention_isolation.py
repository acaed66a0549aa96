"""One request's attention never reads another's KV: NaN anywhere outside a row's own positions
(pages no row owns, page 0 among them, and the slots past each row's length in its own last page)
leaves every output exactly as it is with finite values there.

Before the fix the batch padded shorter rows' page tables with page 0 and the torch backend masked
by multiplying (`0 * NaN = NaN`): a NaN in page 0, written there by a transfer not yet checked,
turned the outputs of every shorter row into NaN (and the served tokens into runs of token 0).

The torch backend runs always; the Triton kernels in the interpreter on CPU (when it runs) and for
real on a GPU (`-m gpu`).
"""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import HAS_CUDA, HAS_TRITON, interpreter_runs  # first: before the kernels

from deepseek_pd.model.attention import ATTENTION_BACKENDS  # noqa: E402
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from deepseek_pd.model.kv.pool import KVPool  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _backends() -> list:
    params = [pytest.param("torch", "cpu", id="torch-cpu")]
    if HAS_CUDA:
        params.append(pytest.param("torch", "cuda", id="torch-cuda", marks=pytest.mark.gpu))
        params.append(pytest.param("triton", "cuda", id="triton-cuda", marks=pytest.mark.gpu))
    elif HAS_TRITON and interpreter_runs():
        params.append(pytest.param("triton", "cpu", id="triton-interpreter"))
    return params


def _batch(rng: random.Random, mode: ForwardMode, device: str):
    """A batch whose rows own shuffled pages of a pool, never page 0, with lengths that differ (so
    shorter rows are padded); returns it, the pool and the flat slots its rows may read."""
    page_size = rng.randint(2, 5)
    rows = rng.randint(2, 5)
    news = [1 if mode is ForwardMode.DECODE else rng.randint(1, 6) for _ in range(rows)]
    prefixes = [rng.randint(0, 13) for _ in range(rows)]
    prefixes[0] = max(prefixes) + 2 * page_size  # one long row, so the others are padded
    counts = [-(-(p + n) // page_size) for p, n in zip(prefixes, news)]
    pool = KVPool(1, sum(counts) + rng.randint(2, 6), page_size, 16 + 4, device=device)
    free = list(range(1, pool.num_pages))  # page 0 stays unowned: the old padding page
    rng.shuffle(free)
    pages, used = [], 0
    for count in counts:
        pages.append(free[used:used + count])
        used += count
    print(f"page_size {page_size} prefixes {prefixes} new {news} pages {pages}")
    own = torch.zeros(pool.num_pages * page_size, dtype=torch.bool)
    for seq_pages, p, n in zip(pages, prefixes, news):
        for pos in range(p + n):
            own[seq_pages[pos // page_size] * page_size + pos % page_size] = True
    ids = [[0] * n for n in news]
    batch = ForwardBatch.build(mode, ids, prefixes, pages, pool, vocab_size=1, device=device)
    return batch, pool, own.to(device)


@pytest.mark.parametrize("backend,device", _backends())
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_nan_outside_a_rows_own_positions_changes_nothing(backend, device, mode):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch, pool, own = _batch(rng, mode, device)
    rank, rope, heads = 16, 4, rng.randint(1, 3)
    flat = pool.flat(0)
    flat.copy_(torch.randn(flat.shape, device=device))
    q_latent = torch.randn(batch.num_tokens, heads, rank, device=device)
    q_pe = torch.randn(batch.num_tokens, heads, rope, device=device)
    kernel = ATTENTION_BACKENDS.build(backend)
    run = kernel.mla_decode if mode is ForwardMode.DECODE else kernel.mla_extend
    clean = run(q_latent, q_pe, pool.buffers[0], batch, rank, 0.3)
    assert torch.isfinite(clean).all()
    flat[~own] = float("nan")  # every slot that is no row's: page 0, free pages, tails
    poisoned = run(q_latent, q_pe, pool.buffers[0], batch, rank, 0.3)
    assert torch.isfinite(poisoned).all(), "NaN outside the rows' own positions reached an output"
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)


def test_padding_repeats_the_rows_own_page():
    """The page table a kernel sees holds only each row's own pages, padding included."""
    rng = random.Random()
    batch, _, _ = _batch(rng, ForwardMode.DECODE, "cpu")
    for row, pages in zip(batch.page_table.tolist(), batch.page_lists):
        assert set(row) == set(pages)


@pytest.mark.parametrize("backend,device", _backends())
def test_merge_selects_away_a_side_without_keys(backend, device):
    """A side whose lse is -inf (it saw no keys) contributes nothing, even if its output holds NaN."""
    tokens, heads, dim = 5, 2, 8
    out_a = torch.randn(tokens, heads, dim, device=device)
    lse_a = torch.randn(tokens, heads, device=device)
    out_b = torch.full((tokens, heads, dim), float("nan"), device=device)
    lse_b = torch.full((tokens, heads), float("-inf"), device=device)
    out, lse = ATTENTION_BACKENDS.build(backend).merge_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
