"""Layer-wise KV streaming over Mooncake, run by test_pd_layerwise_mooncake.py in a network namespace.

With `layerwise_transfer` on, the prefill engine hands each layer to the Mooncake channel as soon as
the forward has written it (one-sided writes of single layers, a CUDA event per layer on GPUs);
with it off, one send per chunk covers every layer. Both must give the offline engine's tokens
(greedy and seeded; chunked prompts, a partial last page, a prefix-cache hit), the layer-wise run
must really have sent single layers (else the test would pass on the per-chunk path), and both
pools must be clean afterwards. Decode lands each send as its report comes, MACing it then: every
request's check after its TransferDone must have had only a digest left (no page to read: the MAC
and the finite check are off the first token's path). Exits non-zero with the assertion on failure.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import time

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, PDPair, oracle, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def config(layerwise: bool):
    base = worker_config("mooncake")
    # (every layer its own send: the tiny model's layers are far below the worker's default floor)
    return dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=layerwise,
                                                                   layerwise_min_bytes=0))


def trace_sends(pair: PDPair, log: list[tuple[int, int]]) -> None:
    """Records (layer_begin, layer_end) of every send the prefill engine makes on a Mooncake channel."""
    open_channel = pair.prefill.sender.open

    def traced_open(handshake, emit, streams=1):
        channel = open_channel(handshake, emit, streams)
        send = channel.send

        async def traced_send(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
            log.append((layer_begin, pair.prefill.pool.num_layers if layer_end is None else layer_end))
            await send(src_pages, page_begin, layer_begin, layer_end, ready)
        channel.send = traced_send
        return channel
    pair.prefill.sender.open = traced_open


def trace_checks(pair: PDPair, left: list[bool]) -> None:
    """Records, for every transfer decode checks, whether its MAC or finite check still had pages to read."""
    open_sink = pair.decode.receiver.open_sink

    def traced_open(pages, peer_host=None):
        sink = open_sink(pages, peer_host)
        check = sink.check_sealed

        def traced_check(done, key, room):  # (the finite check too: run as the sends landed)
            left.append(sink.check_reads() or not sink.checked_on_landing())
            check(done, key, room)
        sink.check_sealed = traced_check
        return sink
    pair.decode.receiver.open_sink = traced_open


def slow_last_layer(pair: PDPair, seconds: float) -> None:
    """The last layer's final op sleeps, so layer 0's send surely starts before the forward ends
    (on the tiny model a whole forward can finish before the event loop runs the first send, and
    queued sends of consecutive layers then leave as one)."""
    last = pair.prefill.runner.model.layers[-1]
    ops = list(last.ops)
    final_op = ops[-1]

    def slow_final(state, batch):
        time.sleep(seconds)
        final_op(state, batch)
    last.ops = tuple(ops[:-1] + [slow_final])


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    lengths = [1, PAGE_SIZE + 1, CHUNK + rng.randrange(1, CHUNK), 3 * CHUNK + rng.randrange(1, PAGE_SIZE)]
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
    shared = prompts[-1][:CHUNK + PAGE_SIZE]
    prompts.append(shared + [rng.randrange(2, vocab) for _ in range(CHUNK // 2)])  # hits the cache
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 20), max_new_tokens=6,
                            ignore_eos=True)
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]
    expected_seeded = oracle().generate(prompts[2], seeded).output_ids

    async def run(layerwise: bool):
        cfg = config(layerwise)
        async with PDPair("mooncake", prefill_config=cfg, decode_config=cfg) as pair:
            sends: list[tuple[int, int]] = []
            trace_sends(pair, sends)
            reads_left: list[bool] = []
            trace_checks(pair, reads_left)
            slow_last_layer(pair, 0.05)
            await pair.run(shared, GREEDY, "warm")  # the cached prefix of the last prompt
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"g{i}") for i, p in enumerate(prompts[:-1])))
            outcomes.append(await pair.run(prompts[-1], GREEDY, "cached"))
            outcomes.append(await pair.run(prompts[2], seeded, "seeded"))
            await pair.wait_pools_clean()  # a forward in flight frees its pages when it returns
            assert len(reads_left) == len(outcomes) + 1 and not any(reads_left), reads_left  # (+ the warm-up)
            return outcomes, sends, pair.prefill.pool.num_layers

    for layerwise in (True, False):
        outcomes, sends, num_layers = asyncio.run(run(layerwise))
        for i, (prefill, decode) in enumerate(outcomes):
            assert prefill.ok and decode.ok, (layerwise, i, prefill.terminal, decode.terminal)
        tokens = [d.tokens for _, d in outcomes]
        assert tokens[:-1] == expected, f"layerwise={layerwise}: {tokens[:-1]} != {expected}"
        assert tokens[-1] == expected_seeded, f"layerwise={layerwise} seeded: {tokens[-1]} != {expected_seeded}"
        assert outcomes[-2][1].terminal.cached_tokens >= CHUNK, "the shared prefix missed the cache"
        partial = sum(1 for send in sends if send != (0, num_layers))
        if layerwise:  # at least layer 0 of every uncached prompt left alone, during its forward
            assert partial >= len(prompts), f"layer-wise run sent {partial} partial layer ranges: {sends[:8]}"
        else:
            assert partial == 0, sends[:8]
        print(f"layerwise={layerwise} parity ok: {len(outcomes)} requests, {len(sends)} sends, "
              f"{partial} of part of the layers")


if __name__ == "__main__":
    main(int(sys.argv[1]))
