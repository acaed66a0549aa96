"""Radix prefix cache against a brute-force oracle: matches, ownership, pinning, LRU eviction."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.model.kv.pool import KVPool, KVPoolExhausted
from deepseek_pd.workers.prefill.radix_cache import RadixCache

pytestmark = pytest.mark.timeout(60)


def run_request(cache: RadixCache, pool: KVPool, prompt: list[int], page_of: dict[int, tuple]) -> int:
    """What the prefill engine does: match, allocate the rest, 'compute', insert, release."""
    hit = cache.match(prompt)
    ps = pool.page_size
    for i, page in enumerate(hit.pages):  # a hit's pages hold exactly the prompt's tokens
        assert page_of[page] == tuple(prompt[i * ps:(i + 1) * ps])
    own = cache.alloc(pool.pages_for_tokens(len(prompt)) - len(hit.pages))
    pages = hit.pages + own
    for i, page in enumerate(pages):
        page_of[page] = tuple(prompt[i * ps:(i + 1) * ps])
    pool.free(cache.insert(prompt, pages))
    cache.release(hit)
    return len(hit.pages)


def test_matches_equal_the_longest_cached_full_page_prefix():
    rng = random.Random()
    for _ in range(20):
        page_size = rng.randrange(1, 5)
        pool = KVPool(1, 400, page_size, 2)
        cache = RadixCache(pool)
        page_of: dict[int, tuple] = {}
        inserted: list[list[int]] = []
        for _ in range(30):
            base = rng.choice(inserted) if inserted and rng.random() < 0.6 else []
            prompt = base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            limit = (len(prompt) - 1) // page_size
            expected = 0
            for other in inserted:  # oracle: longest common prefix in whole pages
                common = 0
                while common < min(len(other), len(prompt)) and other[common] == prompt[common]:
                    common += 1
                expected = max(expected, min(common // page_size, len(other) // page_size, limit))
            assert run_request(cache, pool, prompt, page_of) == expected
            inserted.append(prompt)
            assert pool.num_used_pages == cache.num_pages and cache.num_pinned_nodes == 0
        cache.clear()
        assert pool.num_used_pages == 0 and cache.num_pages == 0


def test_duplicate_pages_come_back_to_the_caller():
    pool = KVPool(1, 20, 2, 2)
    cache = RadixCache(pool)
    prompt = [1, 2, 3, 4, 5]
    first, second = cache.match(prompt), cache.match(prompt)  # two concurrent misses
    a, b = cache.alloc(3), cache.alloc(3)
    assert cache.insert(prompt, a) == [a[2]]  # tree adopts a's full pages, partial page returned
    assert sorted(cache.insert(prompt, b)) == sorted(b)  # b's copies are duplicates
    pool.free([a[2]] + b)
    cache.release(first)
    cache.release(second)
    assert pool.num_used_pages == cache.num_pages == 2


def test_eviction_is_lru_over_unpinned_leaves_and_never_takes_pinned_pages():
    pool = KVPool(1, 8, 1, 2)
    cache = RadixCache(pool)
    page_of: dict[int, tuple] = {}
    run_request(cache, pool, [1, 2, 3], page_of)  # caches (1)->(2)->(3)
    run_request(cache, pool, [7, 8], page_of)  # caches (7)->(8), used later
    assert cache.num_pages == 5
    pinned = cache.match([1, 2, 9])  # pins (1) (2)
    assert len(pinned.pages) == 2
    assert cache.evict(2) == 2  # unpinned leaves, oldest first: (3), then (8)
    assert cache.num_pages == 3
    again = cache.match([1, 2, 3, 9])  # (3) is gone; the pinned path is intact
    assert again.pages == pinned.pages
    cache.release(pinned)
    cache.release(again)
    assert cache.evict(1) == 1  # (7) was used before (2): it goes first
    assert cache.match([7, 9]).pages == []
    hit = cache.match([1, 2, 5])
    assert hit.pages == pinned.pages
    cache.release(hit)
    assert pool.num_used_pages == cache.num_pages == 2


def test_alloc_evicts_when_short_and_fails_clearly_when_everything_is_pinned():
    pool = KVPool(1, 4, 1, 2)
    cache = RadixCache(pool)
    page_of: dict[int, tuple] = {}
    run_request(cache, pool, [1, 2, 3, 0], page_of)  # 3 cached pages, 1 free
    assert len(cache.alloc(3)) == 3 and cache.num_pages == 1  # evicted 2 of them
    pinned = cache.match([1, 5])
    with pytest.raises(KVPoolExhausted, match="pinned"):
        cache.alloc(1)
    cache.release(pinned)
