"""A transport thread's page ids reach the device through its reserved page-locked buffer
(workers/transport/page_io.py `reserve_page_index`), and the buffer is never written while a queued
copy still reads it: many sends' ids, more than it holds, queued on streams that wait behind a
long kernel, all arrive as sent (oracle: the ids themselves)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport import page_io

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(60)]


def test_reserved_ids_arrive_as_sent_across_wraps_and_streams():
    rng = random.Random()
    pool = KVPool(num_layers=1, num_pages=rng.randrange(64, 256), page_size=16, kv_dim=8, device="cuda")
    capacity = rng.randrange(8, 24)
    sent: list[list[int]] = []
    arrived: list[torch.Tensor] = []
    host_copies: list[bool] = []

    def transport_thread() -> None:
        page_io.reserve_page_index(pool.device, capacity)
        staging = page_io._index_staging.by_device[str(pool.device)]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        blocked = torch.cuda.Event()
        torch.cuda._sleep(10 ** 8)  # the copies below wait behind it, so a reused region would show
        blocked.record()
        for stream in streams:
            stream.wait_event(blocked)
        for _ in range(rng.randrange(12, 24)):
            with torch.cuda.stream(rng.choice(streams)):
                pages = rng.sample(range(pool.num_pages), rng.randrange(0, capacity + 1))
                ids = page_io.page_index(pool, pages)
                sent.append(pages)
                arrived.append(ids)
                # The ids came from the reserved buffer (not a pageable copy, not a new allocation).
                host_copies.append(page_io._index_staging.by_device[str(pool.device)] is staging)
        torch.cuda.synchronize()

    thread = threading.Thread(target=transport_thread)
    thread.start()
    thread.join()
    assert all(host_copies)
    assert sum(map(len, sent)) > capacity  # the buffer wrapped at least once
    assert [ids.tolist() for ids in arrived] == sent
    assert all(ids.device.type == "cuda" for ids in arrived)


def test_an_unreserved_thread_or_an_oversized_send_still_gets_its_ids():
    rng = random.Random()
    pool = KVPool(num_layers=1, num_pages=rng.randrange(64, 256), page_size=16, kv_dim=8, device="cuda")
    capacity = rng.randrange(4, 16)
    results: dict[str, list[int]] = {}
    expected: dict[str, list[int]] = {}

    def cold() -> None:  # no reservation in this thread: the pageable copy, as before
        expected["cold"] = rng.sample(range(pool.num_pages), rng.randrange(1, 40))
        results["cold"] = page_io.page_index(pool, expected["cold"]).tolist()

    def oversized() -> None:
        page_io.reserve_page_index(pool.device, capacity)
        expected["oversized"] = rng.sample(range(pool.num_pages), capacity + rng.randrange(1, 40))
        results["oversized"] = page_io.page_index(pool, expected["oversized"]).tolist()

    for target in (cold, oversized):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert results == expected
