"""Decode's two checks of the landed KV (the transport's MAC, `KVSink.check_sealed`, and the finite
check) only read the pages, so `pull_kv` runs them side by side: the first token waits for the
slower, not for both. When both refuse, the MAC's verdict is the one reported. (Over the fake
transport, whose peer writes the pages itself: grpc and mooncake check each part as it lands,
leaving only the verdict.)"""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from deepseek_pd.workers.decode import kv_pull
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.base import KVSink
from pdtest.kv_transfer_harness import pages_equal, random_exchange, run_exchange

pytestmark = pytest.mark.timeout(120)


def _exchange(rng: random.Random):
    return random_exchange(rng, "fake", num_tokens=rng.randrange(2, 40), page_size=rng.choice([1, 4, 16]))


def test_the_mac_and_the_finite_check_run_side_by_side(monkeypatch):
    both = threading.Barrier(2, timeout=10)  # each check waits until the other has started
    sealed, finite = KVSink.check_sealed, kv_pull.check_kv_finite

    def check_sealed(self, done, key, room):
        both.wait()
        return sealed(self, done, key, room)

    def check_kv_finite(pool, pages, rid):
        both.wait()
        return finite(pool, pages, rid)
    monkeypatch.setattr(KVSink, "check_sealed", check_sealed)
    monkeypatch.setattr(kv_pull, "check_kv_finite", check_kv_finite)
    exchange = _exchange(random.Random())
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(exchange)


def test_when_both_refuse_the_mac_is_reported(monkeypatch):
    def check_sealed(self, done, key, room):
        raise self.fail(TransferError(FailureCode.INTERNAL, "does not match the MAC"))

    def check_kv_finite(pool, pages, rid):
        raise TransferError(FailureCode.INTERNAL, "holds NaN")
    monkeypatch.setattr(KVSink, "check_sealed", check_sealed)
    monkeypatch.setattr(kv_pull, "check_kv_finite", check_kv_finite)
    prefill, decode = asyncio.run(run_exchange(_exchange(random.Random())))
    assert isinstance(decode, TransferError) and "MAC" in decode.message, decode
