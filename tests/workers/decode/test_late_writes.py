"""A one-sided transfer (Mooncake) can still write into a failed request's pages until the
transport's late-write grace is over. The pages must be zeroed when they are freed, after that
grace, not when the transfer failed: before, the scrub ran at failure time, a late write landed
after it, and the next owner of the pages read it."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Failed
from deepseek_pd.workers.transport import KVReceiver
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest.hostile_prefill import poison_sent_kv
from pdtest.pd_engine_harness import PDPair, collect, oracle, runner, worker_config

pytestmark = pytest.mark.timeout(120)

GRACE_S = 1.5


class LateWritingReceiver(KVReceiver):
    """The fake transport's receiver, one-sided like Mooncake: it keeps a failed request's pages
    for GRACE_S, and `write_late(pages)` lands a write (NaN) there, as a late one-sided write would."""

    name = "fake"

    def __init__(self, inner: KVReceiver) -> None:
        super().__init__(inner.pool, inner.config)
        self.inner = inner
        self.last_pages: list[int] = []

    def fill_destination(self, handshake) -> None:
        self.inner.fill_destination(handshake)

    def open_sink(self, pages, peer_host=None):
        self.last_pages = list(pages)
        return self.inner.open_sink(pages, peer_host)

    @property
    def late_write_grace_s(self) -> float:
        return GRACE_S

    def write_late(self, pages: list[int]) -> None:
        for buffer in self.pool.buffers:
            buffer[pages] = float("nan")

    def close(self) -> None:
        self.inner.close()


def test_a_late_one_sided_write_is_wiped_before_the_pages_are_reused():
    rng = random.Random()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    vocab = oracle().vocab_size
    victim = [rng.randrange(2, vocab) for _ in range(rng.randrange(10, 30))]
    later = [[rng.randrange(2, vocab) for _ in range(rng.randrange(30, 50))] for _ in range(3)]

    async def run():
        async with PDPair("fake") as pair:
            receiver = pair.decode.receiver = LateWritingReceiver(pair.decode.receiver)
            hostile = PrefillEngine(runner(), worker_config("fake"))
            await hostile.start()
            poison_sent_kv(hostile, rng)  # its transfer fails decode's checks
            loop = asyncio.get_running_loop()
            landed = loop.create_future()

            async def on_event(event):
                if isinstance(event, Failed):  # the pages wait out the grace; a write lands meanwhile
                    pages = receiver.last_pages
                    loop.call_later(GRACE_S / 3, lambda: (receiver.write_late(pages), landed.set_result(pages)))
            try:
                p_req, d_req = pair.requests(victim, greedy, "victim", prefill=hostile)
                _, failed = await asyncio.gather(collect(hostile, p_req), collect(pair.decode, d_req, on_event))
                pages = await landed
                assert pair.decode.pool.num_used_pages == len(pages)  # still held: the grace is not over
                await pair.wait_pools_clean(GRACE_S + 5)
                wiped = [torch.count_nonzero(buffer[pages]).item() for buffer in pair.decode.pool.buffers]
                outcomes = await asyncio.gather(*(pair.run(p, greedy, f"later{i}") for i, p in enumerate(later)))
                return failed, wiped, [d for _, d in outcomes]
            finally:
                await hostile.stop()

    failed, wiped, outcomes = asyncio.run(run())
    assert isinstance(failed.terminal, Failed) and "NaN" in failed.terminal.message, failed.terminal
    assert wiped == [0] * len(wiped), f"non-zero values left in the freed pages, per layer: {wiped}"
    for outcome, p in zip(outcomes, later):
        assert outcome.ok and outcome.tokens == oracle().generate(p, greedy).output_ids, outcome
