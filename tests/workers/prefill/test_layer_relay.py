"""The prefill worker's per-layer KV notices reach the event loop with one wake-up per group of layers
(and none while the loop has not drained the last), every layer still sent, in order
(workers/prefill/layer_relay.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.prefill.layer_relay import LayerRelay, layers_per_send
from pdtest.pd_engine_harness import CHUNK, PDPair, oracle, worker_config

pytestmark = [pytest.mark.timeout(180)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)


def counted_wakes(loop: asyncio.AbstractEventLoop) -> list:
    """From now on, each `call_soon_threadsafe` on `loop` (a wake-up) appends to the list returned."""
    wakes: list = []
    schedule = loop.call_soon_threadsafe

    def counted(*args):
        wakes.append(args)
        return schedule(*args)
    loop.call_soon_threadsafe = counted
    return wakes


def test_notices_while_the_loop_is_busy_wake_it_once_and_arrive_in_order():
    rng = random.Random()
    count = rng.randrange(2, 40)

    async def run() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        got: list[int] = []
        wakes = counted_wakes(loop)
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
        return got, len(wakes)
    got, wakes = asyncio.run(run())
    assert got == list(range(count)) and wakes == 1


def test_a_group_holds_the_floor_s_bytes_and_no_more_layers_than_needed():
    rng = random.Random()
    layers, layer_bytes = rng.randrange(1, 80), rng.randrange(1, 1 << 24)
    floor = rng.randrange(1, 1 << 26)
    every = layers_per_send(layer_bytes, floor, layers)
    assert 1 <= every <= layers
    assert every == layers or every * layer_bytes >= floor  # the group reaches the floor ...
    assert every == 1 or (every - 1) * layer_bytes < floor  # ... with no layer to spare
    assert layers_per_send(layer_bytes, 0, layers) == 1  # no floor: every layer alone
    assert layers_per_send(0, floor, layers) == layers  # nothing streamed: one hand-off at the end


def test_a_following_loop_is_woken_once_per_group_and_at_the_last_layer():
    rng = random.Random()
    layers = rng.randrange(2, 40)
    every = rng.randrange(1, layers + 1)

    async def run() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        got: list[int] = []
        wakes = counted_wakes(loop)
        relay = LayerRelay(loop, lambda layer, ready: got.append(layer), every=every, last_layer=layers - 1)
        for layer in range(layers):
            relay.notice(layer, None)
            for _ in range(3):  # the loop keeps up: each drain runs before the next notice
                await asyncio.sleep(0)
        return got, len(wakes)
    got, wakes = asyncio.run(run())
    assert got == list(range(layers)) and wakes == -(-layers // every), (layers, every, wakes)


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
    cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=True,
                                                                  layerwise_min_bytes=0))  # a group a layer

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


def test_a_round_of_groups_sends_each_group_once_and_gives_the_offline_tokens():
    """`layerwise_min_bytes` set to a drawn number of the round's layers: each forward hands its
    layers over in groups of that many (the last one shorter), one send each, and the decode side
    gets every cell (its tokens are the offline engine's); a floor above every layer's bytes sends
    the round per chunk, with no progress object at all."""
    rng = random.Random()
    vocab = oracle().vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(2, CHUNK))]
    expected = oracle().generate(prompt, GREEDY).output_ids
    base = worker_config("grpc", same_host_direct="off")
    cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=True))

    async def run(groups_of: int | None):
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            prefill = pair.prefill
            layers, pool = len(prefill.runner.model.layers), prefill.pool
            per_layer = len(prompt) * pool.bytes_per_page // pool.page_size
            floor = per_layer * (groups_of if groups_of is not None else layers + 1)
            prefill.config = dataclasses.replace(prefill.config, scheduler=dataclasses.replace(
                prefill.config.scheduler, layerwise_min_bytes=floor))
            sends, progresses = [], []
            open_channel, extend = prefill.sender.open, prefill.runner.extend

            def traced_open(handshake, emit, streams=1):
                channel = open_channel(handshake, emit, streams)
                send = channel.send

                async def traced_send(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
                    sends.append((layer_begin, layers if layer_end is None else layer_end))
                    await send(src_pages, page_begin, layer_begin, layer_end, ready)
                channel.send = traced_send
                return channel

            def traced_extend(seqs, progress=None):
                progresses.append(progress)
                return extend(seqs, progress=progress)
            prefill.sender.open, prefill.runner.extend = traced_open, traced_extend
            _, decode = await pair.run(prompt, GREEDY, "groups")
            await pair.wait_pools_clean()
            return decode.tokens, sends, progresses, layers

    every = rng.randrange(2, 4)  # the tiny model has 4 layers
    tokens, sends, progresses, layers = asyncio.run(run(every))
    assert tokens == expected and progresses[0] is not None
    # In order, every layer once; a group of at least `every` layers a send but the last (a loop that
    # drains late takes what was written meanwhile too), so at most ceil(layers / every) sends.
    assert [begin for begin, _ in sends] == [0] + [end for _, end in sends[:-1]] and sends[-1][1] == layers, sends
    assert all(end - begin >= every for begin, end in sends[:-1]) and len(sends) <= -(-layers // every), sends
    tokens, sends, progresses, layers = asyncio.run(run(None))
    assert tokens == expected and sends == [(0, layers)] and [getattr(p, "inner", p) for p in progresses] == [None]
