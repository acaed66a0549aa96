"""The prefill worker's per-layer KV notices reach the event loop with one wake-up per batch the loop
has not drained yet (workers/prefill/layer_relay.py), every layer still sent, in order."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.prefill.layer_relay import LayerRelay
from pdtest.pd_engine_harness import CHUNK, PDPair, oracle, worker_config

pytestmark = [pytest.mark.timeout(180)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)


def test_notices_while_the_loop_is_busy_wake_it_once_and_arrive_in_order():
    rng = random.Random()
    count = rng.randrange(2, 40)

    async def run() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        got: list[int] = []
        wakes = 0
        schedule = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal wakes
            wakes += 1
            return schedule(*args)
        loop.call_soon_threadsafe = counted
        relay = LayerRelay(loop, lambda layer, ready: got.append(layer))
        noticed = threading.Event()

        def model_thread() -> None:
            for layer in range(count):
                relay.notice(layer, None)
            noticed.set()
        thread = threading.Thread(target=model_thread)
        thread.start()
        noticed.wait(10)  # (the loop is held here: busy, as with other streams)
        thread.join()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return got, wakes
    got, wakes = asyncio.run(run())
    assert got == list(range(count)) and wakes == 1


def test_a_forward_that_the_loop_cannot_follow_wakes_it_once_and_sends_every_layer():
    """The tiny model's forward (layer-wise streaming over grpc) runs while the event loop is held
    busy: before, each layer's notice wrote the loop's self-pipe (one `call_soon_threadsafe` per
    layer); now the first one does, and the loop takes all the layers in one drain. The tokens
    are the offline engine's (every layer was sent)."""
    rng = random.Random()
    vocab = oracle().vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(2, CHUNK))]
    expected = oracle().generate(prompt, GREEDY).output_ids
    base = worker_config("grpc")
    cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=True))

    async def run():
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            loop = asyncio.get_running_loop()
            schedule = loop.call_soon_threadsafe
            from_forward: list[int] = []
            in_forward = threading.local()

            def counted(*args):
                if getattr(in_forward, "on", False):
                    from_forward.append(1)
                return schedule(*args)
            loop.call_soon_threadsafe = counted
            rounds = pair.prefill.rounds
            forward = rounds.forward

            def forward_with_the_loop_held(*args):
                done = threading.Event()
                schedule(done.wait, 30)  # the loop is busy until the forward has ended
                in_forward.on = True
                try:
                    return forward(*args)
                finally:
                    in_forward.on = False
                    done.set()
            rounds.forward = forward_with_the_loop_held
            outcome = await pair.run(prompt, GREEDY, "held")
            pair.assert_pools_clean()
            return outcome, from_forward, pair.prefill.pool.num_layers
    (prefill, decode), wakes, layers = asyncio.run(run())
    assert prefill.ok and decode.ok and decode.tokens == expected, (prefill, decode)
    assert layers > 1 and len(wakes) == 1, (layers, wakes)
