"""A failed transfer's staging slots are zeroed as its late-write grace ends, whether or not another
transfer takes them (workers/transport/staging.py `_cool`).

Over RDMA both stagings stay registered for good (the NIC needs its memory regions), so what they
hold is readable by a peer that reaches the engine (docs/operations.md §8). A transfer that fails
after its handshake went out leaves the KV its prefill side wrote in its slots; they cool for the
grace (its prefill side may still write). Before, they were zeroed only when the next transfer took
them: on an idle decode worker (or slots above what the load reaches: they are taken lowest first)
the failed request's KV stayed readable for as long. The engine is the stub (no RDMA NIC here);
the staging is the worker's own."""
from __future__ import annotations

import asyncio
import random
import time

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.base import TransportConfig, layout_of
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver
from deepseek_pd.workers.transport.staging import StagingArea
from pdtest import mooncake_stub


def _until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_failed_transfers_kv_is_zeroed_when_its_grace_ends_over_rdma(monkeypatch):
    rng = random.Random()
    engines = mooncake_stub.install(monkeypatch)
    pool = KVPool(rng.randrange(1, 4), 32, rng.choice([1, 4, 16]), rng.choice([8, 24]), dtype=torch.float32)
    grace = rng.uniform(0.1, 0.3)
    receiver = MooncakeReceiver(pool, TransportConfig(advertise_host="127.0.0.1", mooncake_protocol="rdma",
                                                      mooncake_staging_tokens=rng.randint(8, 16) * pool.page_size,
                                                      send_timeout_s=grace))
    staging = receiver.staging
    pages = rng.sample(range(32), rng.randint(1, staging.num_pages))
    sink = receiver.open_sink(pages)
    asyncio.run(sink.reserve())
    sink.expose()
    handshake = pb.Handshake(page_ids=pages, layout=layout_of(pool))
    receiver.fill_destination(handshake)
    sink.offer_into(handshake)  # the handshake went out: its prefill side writes the slots
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for staged in staging.buffers:  # what the prefill side's NIC wrote before the transfer failed
        staged[list(handshake.page_ids)] = 1.0 + torch.rand(staged[list(handshake.page_ids)].shape, generator=gen)
    failed_at = time.monotonic()
    sink.withdraw()
    registered = engines[0].registered
    assert set(registered) == set(staging.base_addrs)  # over RDMA: readable, for good
    assert staging.num_used == len(pages) and all(staged.any() for staged in staging.buffers)  # cooling
    # No other transfer comes: the slots are zeroed, then free, once the grace is over, not before.
    assert _until(lambda: not any(staged.any() for staged in staging.buffers)), \
        "the failed transfer's KV is still in the registered staging after its grace"
    assert time.monotonic() - failed_at >= grace
    assert _until(lambda: staging.num_used == 0), "the slots never came back"
    receiver.close()


def test_slots_given_back_zeroed_cool_without_a_second_zeroing_and_many_failures_cool_together():
    """`scrubbed` slots cool untouched; several failures with their own graces each come back when
    theirs ends, zeroed, by one cooling thread that stops when nothing cools."""
    rng = random.Random()
    pool = KVPool(2, 16, 4, 8, dtype=torch.float32)
    area = StagingArea(pool, 12)
    zeroed: list[list[int]] = []
    scrub = area.scrub
    area.scrub = lambda slots, layers=None: (zeroed.append(list(slots)), scrub(slots, layers))[1]

    async def take(count: int) -> list[int]:
        slots, _ = await area.acquire(count, 1.0)
        return slots

    clean = asyncio.run(take(3))
    area.release(clean, delay_s=0.05, scrubbed=True)
    failures = [asyncio.run(take(3)) for _ in range(3)]
    graces = sorted(rng.uniform(0.05, 0.25) for _ in failures)
    for slots, grace in zip(failures, graces):
        for staged in area.buffers:
            staged[slots] = 1.0
        area.release(slots, delay_s=grace)
    assert _until(lambda: area.num_used == 0)
    assert not any(staged.any() for staged in area.buffers)
    assert sorted(slot for slots in zeroed for slot in slots) == sorted(s for slots in failures for s in slots)
    assert _until(lambda: area._cooler is None)  # (the thread ended with nothing left to cool)
