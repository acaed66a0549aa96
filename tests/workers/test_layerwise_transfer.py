"""Layer-wise KV streaming from the prefill engine: same tokens as per-chunk sends and the offline
engine, really overlapped with the forward, and an abort mid-stream frees both pools."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Failed
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, PDPair, collect, oracle, worker_config

pytestmark = [pytest.mark.timeout(180)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)


def config(transport: str, layerwise: bool):
    """Layer-wise: every layer its own send (`layerwise_min_bytes` 0; the tiny model's layers hold a
    few KB, which the worker's default floor would hand over as one group)."""
    base = worker_config(transport)
    return dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=layerwise,
                                                                   layerwise_min_bytes=0))


def prompts(rng: random.Random) -> list[list[int]]:
    vocab = oracle().vocab_size
    lengths = [1, PAGE_SIZE, PAGE_SIZE + 1, CHUNK, CHUNK + 1, 2 * CHUNK + rng.randrange(1, CHUNK), 3 * CHUNK]
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("transport", ["grpc", "fake"])
def test_layerwise_equals_per_chunk_and_offline(transport):
    rng = random.Random()
    cases = prompts(rng)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 20), max_new_tokens=5, ignore_eos=True)
    expected = [oracle().generate(p, GREEDY).output_ids for p in cases] + [oracle().generate(cases[-2], seeded).output_ids]

    async def run(layerwise: bool):
        cfg = config(transport, layerwise)
        async with PDPair(transport, prefill_config=cfg, decode_config=cfg) as pair:
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"g{i}") for i, p in enumerate(cases)))
            outcomes.append(await pair.run(cases[-2], seeded, "seeded"))
            pair.assert_pools_clean()
            return [d.tokens for _, d in outcomes]

    assert asyncio.run(run(True)) == expected
    assert asyncio.run(run(False)) == expected


def _trace_sends_and_last_layer(pair: PDPair, log: list[str]) -> None:
    """Logs each channel.send and the end of the last layer's ops (slowed, so the loop can run)."""
    last = pair.prefill.runner.model.layers[-1]
    ops = list(last.ops)
    final_op = ops[-1]

    def slow_final(state, batch):
        time.sleep(0.3)
        final_op(state, batch)
        log.append("last layer done")
    last.ops = tuple(ops[:-1] + [slow_final])
    open_channel = pair.prefill.sender.open

    def traced_open(handshake, emit, streams=1):
        channel = open_channel(handshake, emit, streams)
        send = channel.send

        async def traced_send(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
            log.append(f"send {layer_begin}")
            await send(src_pages, page_begin, layer_begin, layer_end, ready)
        channel.send = traced_send
        return channel
    pair.prefill.sender.open = traced_open


@pytest.mark.parametrize("layerwise", [True, False])
def test_first_layers_are_sent_before_the_forward_reaches_its_end(layerwise):
    rng = random.Random()
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(CHUNK - 1)]  # one chunk, no cache hit

    async def run():
        cfg = config("grpc", layerwise)
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            log: list[str] = []
            _trace_sends_and_last_layer(pair, log)
            _, decode = await pair.run(prompt, GREEDY, "overlap")
            pair.assert_pools_clean()
            return log, decode.tokens

    log, tokens = asyncio.run(run())
    assert tokens == oracle().generate(prompt, GREEDY).output_ids
    done = log.index("last layer done")
    if layerwise:
        assert log[0] == "send 0" and done > 0, f"layer 0 was not sent during the forward: {log}"
    else:  # the control: per-chunk sends wait for the whole forward
        assert done == 0, log


@pytest.mark.parametrize("direct", ["on", "off"])
def test_only_channels_that_stream_layers_get_layers(direct):
    """Direct same-host copies go per chunk even with layer-wise on (no per-layer events or hand-offs
    in the forward); the byte stream of the same prompt goes layer by layer."""
    rng = random.Random()
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(2 * CHUNK + rng.randrange(1, CHUNK))]
    chunks = -(-len(prompt) // CHUNK)

    async def run():
        base = worker_config("grpc", same_host_direct=direct)
        cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=True,
                                                                      layerwise_min_bytes=0))
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            sends, progresses = [], []
            open_channel, extend = pair.prefill.sender.open, pair.prefill.runner.extend

            def traced_open(handshake, emit, streams=1):
                channel = open_channel(handshake, emit, streams)
                send = channel.send

                async def traced_send(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
                    sends.append((type(channel).__name__, layer_begin, layer_end))
                    await send(src_pages, page_begin, layer_begin, layer_end, ready)
                channel.send = traced_send
                return channel

            def traced_extend(seqs, progress=None, **kwargs):
                progresses.append(progress)
                return extend(seqs, progress=progress, **kwargs)
            pair.prefill.sender.open, pair.prefill.runner.extend = traced_open, traced_extend
            _, decode = await pair.run(prompt, GREEDY, "chunks")
            await pair.wait_pools_clean()
            return sends, progresses, decode.tokens

    sends, progresses, tokens = asyncio.run(run())
    assert tokens == oracle().generate(prompt, GREEDY).output_ids
    assert len(progresses) == chunks
    num_layers = oracle().runner.kv_pool.num_layers
    if direct == "on":
        assert {name for name, _, _ in sends} == {"DirectChannel"}
        # No role progress: the round's clock (round_clock.py) may see the layers, but it hands
        # nothing off and records no event.
        assert [getattr(p, "inner", p) for p in progresses] == [None] * chunks and len(sends) == chunks, sends
    else:
        assert {name for name, _, _ in sends} == {"GrpcChannel"}
        assert all(p is not None for p in progresses)
        assert len(sends) > chunks and any(end is not None and end - begin < num_layers for _, begin, end in sends)


def test_abort_during_a_layerwise_transfer_frees_both_pools():
    rng = random.Random()
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(3 * CHUNK + 3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)

    async def run():
        cfg = config("grpc", True)
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            sending = asyncio.Event()
            open_channel = pair.prefill.sender.open

            def slow_open(handshake, emit, streams=1):
                async def slow_emit(chunk):
                    sending.set()
                    await asyncio.sleep(0.05)
                    await emit(chunk)
                return open_channel(handshake, slow_emit, streams)
            pair.prefill.sender.open = slow_open
            p_req, d_req = pair.requests(prompt, params, "victim")
            tasks = [asyncio.ensure_future(collect(pair.prefill, p_req)),
                     asyncio.ensure_future(collect(pair.decode, d_req))]
            await asyncio.wait_for(sending.wait(), 30)
            assert await pair.prefill.abort(p_req.rid)
            prefill, decode = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            await pair.wait_pools_clean()  # a forward in flight frees its pages when it returns
            return prefill, decode

    prefill, decode = asyncio.run(run())
    assert isinstance(prefill.terminal, Failed) and isinstance(decode.terminal, Failed)


def test_layerwise_transfer_is_on_by_default_and_an_engine_option():
    from deepseek_pd.workers.serve.resolution import ServeFlags, resolve_serve_config
    assert resolve_serve_config(ServeFlags(role="prefill", device="cpu")).worker.scheduler.layerwise_transfer
    off = resolve_serve_config(ServeFlags(role="prefill", device="cpu", engine_options=("layerwise_transfer=false",)))
    assert off.worker.scheduler.layerwise_transfer is False
