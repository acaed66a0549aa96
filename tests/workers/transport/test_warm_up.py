"""warm_up.py: the warm-up reaches every transport thread once, and changes no byte of the pool."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport import warm_up
from deepseek_pd.workers.transport.warm_up import in_every_thread, warm_page_counts


def test_in_every_thread_runs_once_in_each_thread_of_the_pool() -> None:
    threads = random.randint(1, 6)
    seen: list[int] = []
    lock = threading.Lock()
    with ThreadPoolExecutor(threads) as executor:
        def note() -> None:
            with lock:
                seen.append(threading.get_ident())
        in_every_thread(executor, threads, note)
        assert len(seen) == threads and len(set(seen)) == threads
        # The threads it warmed are the pool's: later work runs in one of them.
        assert executor.submit(threading.get_ident).result() in seen


def test_in_every_thread_raises_what_a_call_raised() -> None:
    with ThreadPoolExecutor(2) as executor:
        with pytest.raises(ZeroDivisionError):
            in_every_thread(executor, 2, lambda: 1 / 0)


def test_the_warm_page_counts_cover_both_index_kernels_and_the_largest_copy_within_the_pool() -> None:
    rng = random.Random()
    for pages in (1, 5, warm_up.SMALL_INDEX, warm_up.SMALL_INDEX + 1, 1000):
        pool = KVPool(num_layers=1, num_pages=pages, page_size=rng.choice([1, 4]), kv_dim=2, dtype=torch.float32)
        largest = rng.randint(0, 2000) * pool.bytes_per_page
        counts = warm_page_counts(pool, largest)
        assert counts[0] == 1 and max(counts) <= pages and counts == sorted(set(counts))
        assert (max(counts) > warm_up.SMALL_INDEX) == (pages > warm_up.SMALL_INDEX)
        assert min(pages, largest // pool.bytes_per_page) in counts or largest < pool.bytes_per_page
