"""Absorbed-MLA decode (kernels/mla_decode.py) as a CUDA graph runs it: the host max length is the
captured max context, the real lengths (on the device) are far shorter. The output must match the
torch backend, and the splits past a sequence's real length must move no partial (their rows of the
split buffer stay as `torch.empty` left them, here poisoned with NaN), so the work follows the real
context, not the captured one."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, TRITON_RUNS  # noqa: E402 (first: it sets TRITON_INTERPRET)

pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU, or Triton whose CPU interpreter runs here")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_graph_sized_split_count_moves_only_the_real_context(monkeypatch):
    from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
    from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
    from deepseek_pd.model.kernels.mla_decode import MLADecodeTile, mla_decode, num_splits
    from deepseek_pd.model.kv.pool import KVPool

    rng = random.Random()
    heads, rank, rope, page_size, width = 4, 32, 16, 8, 16  # a table of 16 pages: 128 captured tokens
    lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 3))]
    pool = KVPool(num_layers=1, num_pages=64, page_size=page_size, kv_dim=rank + rope, dtype=torch.float32,
                  device=DEVICE)
    pages = [pool.alloc(pool.pages_for_tokens(n)) for n in lengths]
    pool.buffers[0].copy_(torch.randn(pool.buffers[0].shape, device=DEVICE))
    batch = ForwardBatch.build(ForwardMode.DECODE, [[0]] * len(lengths), [n - 1 for n in lengths], pages, pool,
                               vocab_size=1, device=DEVICE)
    table = torch.zeros(len(lengths), width, dtype=torch.int32, device=DEVICE)
    for i, p in enumerate(pages):
        table[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q_latent = torch.randn(len(lengths), heads, rank, device=DEVICE)
    q_pe = torch.randn(len(lengths), heads, rope, device=DEVICE)
    scale = (rank + rope) ** -0.5
    want = TorchAttentionBackend().mla_decode(q_latent, q_pe, pool.buffers[0], batch, rank, scale)

    made = []
    plain = torch.empty

    def empty(*args, **kwargs):
        out = plain(*args, **kwargs)
        made.append(out)
        return out.fill_(float("nan")) if out.dtype.is_floating_point else out

    monkeypatch.setattr(torch, "empty", empty)
    tile = MLADecodeTile(block_n=8, max_splits=16, target_programs=64)
    captured = width * page_size
    got = mla_decode(q_latent, q_pe, pool.buffers[0], table, seq_lens, captured, scale, tile)
    monkeypatch.setattr(torch, "empty", plain)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    splits = num_splits(len(lengths), 1, captured, tile)
    mid_out = next(t for t in made if t.dim() == 4)  # [batch, heads, splits, rank]
    assert mid_out.shape[2] == splits
    for i, n in enumerate(lengths):
        share = _cdiv(_cdiv(n, splits), tile.block_n) * tile.block_n  # the kernel's rule, on the real length
        used = _cdiv(n, share)
        assert used < splits  # the real context leaves splits empty
        assert not torch.isnan(mid_out[i, :, :used]).any()
        assert torch.isnan(mid_out[i, :, used:]).all(), "an empty split wrote its partial"
