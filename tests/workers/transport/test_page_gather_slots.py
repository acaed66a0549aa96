"""`PageGather`: staged bytes equal the reference gather, and waiting for a staging slot is
reported apart from the copy (the GPU profile's `stage` must say which of the two it was)."""
from __future__ import annotations

import random
import threading
import time

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.page_io import PageGather, read_pages


def _pool(rng: random.Random) -> KVPool:
    pool = KVPool(num_layers=rng.randint(2, 5), num_pages=rng.randint(8, 20), page_size=rng.choice([1, 4, 16]),
                  kv_dim=rng.randint(3, 40), dtype=rng.choice([torch.float32, torch.bfloat16]))
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape))
    return pool


def test_gather_bytes_equal_the_reference_and_a_free_slot_costs_no_wait() -> None:
    rng = random.Random()
    pool = _pool(rng)
    gather = PageGather(pool, pool.num_layers * pool.num_pages * pool.bytes_per_page, slots=2)
    for _ in range(5):
        pages = rng.sample(range(pool.num_pages), rng.randint(1, pool.num_pages))
        layers = range(rng.randrange(pool.num_layers), pool.num_layers)
        waits: list[float] = []
        with gather.gather(layers, pages, on_slot_wait=waits.append) as data:
            assert bytes(data) == read_pages(pool, layers, pages)
        assert len(waits) == 1 and waits[0] < 0.05


def test_a_chunk_waiting_for_the_only_slot_reports_that_wait() -> None:
    rng = random.Random()
    pool = _pool(rng)
    gather = PageGather(pool, pool.num_layers * pool.num_pages * pool.bytes_per_page, slots=1)
    hold_s = rng.uniform(0.2, 0.4)
    holding = threading.Event()
    pages = rng.sample(range(pool.num_pages), 3)

    def first() -> None:
        with gather.gather(range(pool.num_layers), pages):
            holding.set()
            time.sleep(hold_s)

    thread = threading.Thread(target=first)
    thread.start()
    holding.wait(5)
    waits: list[float] = []
    with gather.gather(range(pool.num_layers), pages, on_slot_wait=waits.append) as data:
        assert bytes(data) == read_pages(pool, range(pool.num_layers), pages)
    thread.join(5)
    assert waits and waits[0] >= hold_s * 0.5, (waits, hold_s)


def test_every_slot_is_made_when_the_gather_is_built() -> None:
    """A slot made during a send would allocate page-locked memory while the next forward is
    queued, and that allocation waits for the device (warm_up.py): all are made up front."""
    rng = random.Random()
    pool = _pool(rng)
    slots = rng.randint(1, 4)
    gather = PageGather(pool, pool.num_layers * pool.num_pages * pool.bytes_per_page, slots=slots)
    made = [gather._slots.get_nowait() for _ in range(slots)]
    assert len({id(slot) for slot in made}) == slots
    for slot in made:
        gather._slots.put(slot)
    gather.warm([1, pool.num_pages])  # through every slot, then they are all back
    pages = rng.sample(range(pool.num_pages), rng.randint(1, pool.num_pages))
    with gather.gather(range(pool.num_layers), pages) as data:
        assert bytes(data) == read_pages(pool, range(pool.num_layers), pages)
    assert gather._slots.qsize() == slots
