"""A prefill request's phases on its worker (`prefill_request_phase_seconds`: handshake, prefill,
finish) say where its time there went.

Oracle: time put in on purpose, a random draw of the run's seed each: decode's request sent that
much after prefill's must show in `handshake`; each KV chunk's emit held that long (all of them
after the forward, layer-wise off) must show in `finish`; and the phases add up to no more than
the time the caller waited for the prefill worker's first token. A real prefill and decode engine
over the gRPC transport, the tiny model on the CPU.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Finished, TokenChunk
from deepseek_pd.workers.metrics.worker_metrics import REQUEST_PHASES
from pdtest.pd_engine_harness import PDPair, collect, oracle, worker_config

pytestmark = pytest.mark.timeout(120)


def test_time_put_into_the_handshake_and_the_sends_shows_in_their_phases():
    rng = random.Random()
    late, slow_emit = rng.uniform(0.05, 0.1), rng.uniform(0.03, 0.06)
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(8, 40))]
    config = worker_config("grpc")
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, layerwise_transfer=False))

    async def run():
        async with PDPair("grpc", config, config) as pair:
            seen: list[dict[str, float]] = []
            observe = pair.prefill.metrics.observe_request_phases
            pair.prefill.metrics.observe_request_phases = lambda phases: seen.append(dict(phases)) or observe(phases)
            open_channel = pair.prefill.sender.open

            def slow_open(handshake, emit, streams=1):
                async def slow(chunk):
                    await asyncio.sleep(slow_emit)
                    await emit(chunk)
                return open_channel(handshake, slow, streams)
            pair.prefill.sender.open = slow_open
            p_req, d_req = pair.requests(prompt, SamplingParams(temperature=0.0, max_new_tokens=2), "r")
            first_token_at: list[float] = []

            async def on_event(event) -> None:
                if isinstance(event, TokenChunk):
                    first_token_at.append(time.perf_counter())

            async def decode_later():
                await asyncio.sleep(late)
                return await collect(pair.decode, d_req)

            began = time.perf_counter()
            prefill, decode = await asyncio.gather(
                collect(pair.prefill, p_req, on_event=on_event),
                decode_later())
            assert isinstance(prefill.terminal, Finished) and isinstance(decode.terminal, Finished)
            await pair.wait_pools_clean()
            return seen, first_token_at[0] - began

    seen, waited = asyncio.run(run())
    assert len(seen) == 1 and set(seen[0]) == set(REQUEST_PHASES), seen
    phases = seen[0]
    assert phases["handshake"] >= late * 0.95, (late, phases)
    assert phases["finish"] >= slow_emit * 0.95, (slow_emit, phases)
    assert 0 < sum(phases.values()) <= waited, (waited, phases)  # (nothing counted twice)
