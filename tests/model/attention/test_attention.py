"""The torch attention backend (the oracle for faster kernels) against naive dense attention:
causal ragged MHA, cross attention + log-sum-exp merge over a key split, and absorbed MLA over a
shuffled paged cache against explicit up-projection. Small query tiles exercise the tiling."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.kv.pool import KVPool

pytestmark = pytest.mark.timeout(60)


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q `[n,H,D]`, k `[m,H,D]`, v `[m,H,Dv]`, mask `[n,m]` True = visible. fp64."""
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, -1).nan_to_num(0.0), v.double())
    return out, lse.transpose(0, 1)


def _offsets(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


@pytest.mark.parametrize("tile", [1, 3, 1024])
def test_mha_causal_and_cross_with_merge(tile):
    rng = random.Random()
    heads, d, dv = rng.randint(1, 4), rng.randint(2, 9), rng.randint(2, 7)
    lengths = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
    qo = _offsets(lengths)
    q, k, v = torch.randn(qo[-1], heads, d), torch.randn(qo[-1], heads, d), torch.randn(qo[-1], heads, dv)
    backend = TorchAttentionBackend(query_tile=tile)
    out, lse = backend.mha_causal(q, k, v, qo, 0.3)
    # Extra "prefix" keys per sequence, some sequences with none.
    prefix = [rng.choice([0, rng.randint(1, 9)]) for _ in lengths]
    kvo = _offsets(prefix)
    pk, pv = torch.randn(kvo[-1], heads, d), torch.randn(kvo[-1], heads, dv)
    cross, cross_lse = backend.mha_cross(q, pk, pv, qo, kvo, 0.3)
    merged, merged_lse = backend.merge_states(out, lse, cross, cross_lse)
    for i, n in enumerate(lengths):
        qs = slice(qo[i], qo[i + 1])
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        want, want_lse = _naive(q[qs], k[qs], v[qs], causal, 0.3)
        torch.testing.assert_close(out[qs].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[qs].double(), want_lse, rtol=1e-5, atol=1e-5)
        keys = torch.cat([pk[kvo[i]:kvo[i + 1]], k[qs]])
        values = torch.cat([pv[kvo[i]:kvo[i + 1]], v[qs]])
        full_mask = torch.cat([torch.ones(n, prefix[i], dtype=torch.bool), causal], dim=1)
        want, want_lse = _naive(q[qs], keys, values, full_mask, 0.3)
        torch.testing.assert_close(merged[qs].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged_lse[qs].double(), want_lse, rtol=1e-5, atol=1e-5)
        if prefix[i] == 0:
            assert torch.isinf(cross_lse[qs]).all() and (cross[qs] == 0).all()


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_absorbed_mla_equals_up_projected_attention(mode):
    """q_nope·(W_k c) = (q_nope W_k)·c: absorbed MLA over the paged cache vs explicit per-head K/V."""
    rng = random.Random()
    heads, nope, rope, v_dim, rank = rng.randint(1, 4), rng.randint(2, 6), 2 * rng.randint(1, 3), 5, rng.randint(3, 8)
    page_size = rng.randint(1, 5)
    batch_size = rng.randint(1, 4)
    news = [1 if mode is ForwardMode.DECODE else rng.randint(1, 6) for _ in range(batch_size)]
    prefixes = [rng.randint(0, 9) for _ in range(batch_size)]
    # Room for every sequence, with spare pages to shuffle among (a fixed 40 was too few for 4
    # sequences of up to 15 tokens in pages of 1: stress run seed 4164224378).
    num_pages = sum(-(-(p + n) // page_size) for p, n in zip(prefixes, news)) + rng.randint(0, 20)
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page_size, kv_dim=rank + rope)
    all_pages = pool.alloc(num_pages)
    rng.shuffle(all_pages)
    pages, used = [], 0
    for p, n in zip(prefixes, news):
        count = pool.pages_for_tokens(p + n)
        pages.append(all_pages[used:used + count])
        used += count
    pool.buffers[0].normal_()  # cache contents for every slot (prefix and new tokens)
    batch = ForwardBatch.build(mode, [[0] * n for n in news], prefixes, pages, pool, 1, "cpu")
    w_kc, w_vc = torch.randn(heads, nope, rank), torch.randn(heads, v_dim, rank)
    q_nope, q_pe = torch.randn(sum(news), heads, nope), torch.randn(sum(news), heads, rope)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_kc)
    backend = TorchAttentionBackend(query_tile=rng.randint(1, 4))
    kernel = backend.mla_decode if mode is ForwardMode.DECODE else backend.mla_extend
    latent_out = kernel(q_latent, q_pe, pool.buffers[0], batch, rank, 0.7)
    got = torch.einsum("thr,hvr->thv", latent_out, w_vc)
    qo = batch.qo_offsets
    for i, (p, n) in enumerate(zip(prefixes, news)):
        cache = pool.flat(0)[pool.slots(pages[i], torch.arange(p + n))]
        c_kv, k_pe = cache[:, :rank], cache[:, rank:]
        k = torch.cat([torch.einsum("mr,hnr->mhn", c_kv, w_kc), k_pe[:, None].expand(-1, heads, -1)], -1)
        v = torch.einsum("mr,hvr->mhv", c_kv, w_vc)
        qs = slice(qo[i], qo[i + 1])
        mask = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        want, _ = _naive(torch.cat([q_nope[qs], q_pe[qs]], -1), k, v, mask, 0.7)
        torch.testing.assert_close(got[qs].double(), want, rtol=1e-4, atol=1e-4)
