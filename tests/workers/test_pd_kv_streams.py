"""PD engines with several gRPC KV streams per room (`grpc_streams`): the offline engine's tokens
(per chunk and layer-wise), and a KV stream that dies mid-transfer ends both requests with a
clear error and leaves both pools clean."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Failed, FailureCode
from pdtest.pd_engine_harness import CHUNK, PDPair, collect, oracle, worker_config
from pdtest.kv_transfer_harness import kv_streams_die_after

pytestmark = [pytest.mark.timeout(180)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)


def config(streams: int, layerwise: bool):
    base = worker_config("grpc")
    # Small chunks, so a prompt's KV is many chunks and every stream carries some.
    return dataclasses.replace(base, transport=dataclasses.replace(base.transport, grpc_streams=streams,
                                                                   max_chunk_bytes=1024),
                               scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=layerwise))


@pytest.mark.parametrize("layerwise", [False, True])
def test_several_streams_give_the_offline_tokens(layerwise):
    rng = random.Random()
    vocab = oracle().vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in (3, CHUNK + 5, 3 * CHUNK + rng.randrange(1, 9))]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]
    streams = rng.randrange(2, 5)

    async def run():
        cfg = config(streams, layerwise)
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"s{i}") for i, p in enumerate(prompts)))
            pair.assert_pools_clean()
            return outcomes

    outcomes = asyncio.run(run())
    for (prefill, decode), want in zip(outcomes, expected):
        assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
        assert decode.tokens == want


def test_a_kv_stream_dying_mid_transfer_fails_both_requests_and_frees_both_pools(monkeypatch):
    kv_streams_die_after(monkeypatch, chunks=1)
    rng = random.Random()
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(3 * CHUNK + 3)]

    async def run():
        cfg = config(3, layerwise=False)
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            p_req, d_req = pair.requests(prompt, GREEDY, "victim")
            prefill, decode = await asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req))
            await pair.wait_pools_clean()  # a forward in flight frees its pages when it returns
            return prefill, decode

    prefill, decode = asyncio.run(run())
    assert isinstance(decode.terminal, Failed) and decode.terminal.code == FailureCode.UNAVAILABLE, decode.terminal
    assert "KV stream" in decode.terminal.message and "broke" in decode.terminal.message, decode.terminal.message
    assert isinstance(prefill.terminal, Failed), prefill.terminal
    assert decode.tokens == [] and prefill.tokens == []
