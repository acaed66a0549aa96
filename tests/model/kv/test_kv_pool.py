"""KVPool: allocator invariants under random alloc/free sequences, exhaustion and double free as
clear errors, usage reporting, slot addressing, and the per-token byte count of the contract."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.pool import KVPool, KVPoolExhausted
from pdtest.seeding import examples

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=examples(150))
@given(num_pages=st.integers(1, 24),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 30), st.randoms()), max_size=60))
def test_random_alloc_free_never_hands_out_a_page_twice(num_pages, ops):
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=2, kv_dim=3)
    owners: list[list[int]] = []  # pages each live "request" holds
    for kind, n, rnd in ops:
        held = {p for pages in owners for p in pages}
        if kind == "alloc":
            if n > num_pages - len(held):
                with pytest.raises(KVPoolExhausted):
                    pool.alloc(n)
            else:
                pages = pool.alloc(n)
                assert len(pages) == len(set(pages)) == n
                assert not held & set(pages), "page handed out twice"
                assert all(0 <= p < num_pages for p in pages)
                owners.append(pages)
        elif owners:
            pages = owners.pop(rnd.randrange(len(owners)))
            pool.free(pages)
            if pages:
                with pytest.raises(RuntimeError, match="double free"):
                    pool.free(pages[:1])
        held = {p for pages in owners for p in pages}
        assert pool.num_used_pages == len(held)
        assert pool.num_free_pages == num_pages - len(held)
        assert pool.usage == pytest.approx(len(held) / num_pages)
    for pages in owners:
        pool.free(pages)
    assert pool.num_free_pages == num_pages and pool.usage == 0.0


def test_exhaustion_is_a_user_error_and_changes_nothing():
    pool = KVPool(num_layers=2, num_pages=5, page_size=4, kv_dim=8)
    first = pool.alloc(3)
    with pytest.raises(UserError, match="need 3 pages, 2 of 5 free"):
        pool.alloc(3)
    assert pool.num_free_pages == 2
    pool.free(first)
    assert sorted(pool.alloc(5)) == list(range(5))


def test_free_rejects_bad_pages_atomically():
    pool = KVPool(num_layers=1, num_pages=4, page_size=1, kv_dim=1)
    pages = pool.alloc(2)
    for bad in ([pages[0], pages[0]], [pages[0], 99], [-1]):
        with pytest.raises(RuntimeError):
            pool.free(bad)
        assert pool.num_used_pages == 2  # nothing freed by the failed call
    with pytest.raises(UserError):
        KVPool(num_layers=1, num_pages=0, page_size=1, kv_dim=1)


def test_slots_follow_the_request_local_layout():
    rng = random.Random()
    page_size = rng.randint(1, 7)
    pool = KVPool(num_layers=1, num_pages=30, page_size=page_size, kv_dim=2)
    pages = pool.alloc(pool.num_free_pages)
    rng.shuffle(pages)
    mine = pages[:rng.randint(1, 10)]
    positions = torch.arange(len(mine) * page_size)
    slots = pool.slots(mine, positions)
    want = [mine[p // page_size] * page_size + p % page_size for p in positions.tolist()]
    assert slots.tolist() == want
    # Writing through the flat view lands in [page, offset] of the layer buffer.
    pool.flat(0)[slots] = positions[:, None].float().expand(-1, 2)
    for p in positions.tolist():
        assert pool.buffers[0][mine[p // page_size], p % page_size, 0] == p


def test_bytes_per_token_matches_contract():
    pool = KVPool(num_layers=61, num_pages=1, page_size=64, kv_dim=512 + 64, dtype=torch.bfloat16)
    assert pool.bytes_per_token == 61 * 576 * 2  # 68.6 KiB for V3
    assert pool.bytes_per_page == 64 * 576 * 2
    assert pool.buffers[0].shape == (1, 64, 576) and len(pool.buffers) == 61
    assert pool.pages_for_tokens(0) == 0 and pool.pages_for_tokens(64) == 1 and pool.pages_for_tokens(65) == 2
