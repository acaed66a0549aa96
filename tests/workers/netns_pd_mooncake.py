"""PD engines with the mooncake transport, run by test_pd_engines_mooncake.py in a network namespace.

Checks greedy parity with the offline engine (chunked prompts, a prefix-cache hit, concurrency)
and that an abort mid-request frees both pools. Exits non-zero with the assertion on failure.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import sys

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import TransportConfig
from pdtest.pd_engine_harness import CHUNK, PDPair, collect, oracle, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    shared = [rng.randrange(2, vocab) for _ in range(CHUNK + 7)]
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 3 * CHUNK))] for _ in range(3)]
    prompts += [shared + [rng.randrange(2, vocab) for _ in range(5)]]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]

    async def run():
        config = worker_config("mooncake")
        async with PDPair("mooncake", prefill_config=config, decode_config=config) as pair:
            await pair.run(shared, GREEDY, "warm")
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"m{i}") for i, p in enumerate(prompts)))
            p_req, d_req = pair.requests(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=50,
                                                                    ignore_eos=True), "victim")
            decoding = asyncio.Event()

            async def on_decode_event(event):
                decoding.set()

            tasks = [asyncio.ensure_future(collect(pair.prefill, p_req)),
                     asyncio.ensure_future(collect(pair.decode, d_req, on_event=on_decode_event))]
            await asyncio.wait_for(decoding.wait(), 30)  # abort in the decode phase
            await pair.decode.abort(d_req.rid)
            await asyncio.gather(*tasks)
            await pair.wait_pools_clean()  # a forward in flight frees its pages when it returns
            return outcomes

    async def abort_in_transfer():
        # A short send timeout, so the decode side's late-write grace (pages held back after a
        # failed one-sided transfer) is short too.
        config = dataclasses.replace(worker_config("mooncake"), transport=TransportConfig(send_timeout_s=0.5))
        async with PDPair("mooncake", prefill_config=config, decode_config=config) as pair:
            p_req, d_req = pair.requests(prompts[0] * 3, GREEDY, "early")
            tasks = [asyncio.ensure_future(collect(pair.prefill, p_req)),
                     asyncio.ensure_future(collect(pair.decode, d_req))]
            await asyncio.sleep(0.01)
            await pair.decode.abort(d_req.rid)
            prefill, decode = await asyncio.gather(*tasks)
            await pair.wait_pools_clean()  # a forward in flight frees its pages when it returns
            return prefill, decode

    outcomes = asyncio.run(run())
    for i, (prefill, decode) in enumerate(outcomes):
        assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
        assert decode.tokens == expected[i], f"prompt {i}: {decode.tokens} != {expected[i]}"
        print(f"parity ok prompt={i} tokens={len(prompts[i])} cached={decode.terminal.cached_tokens}")
    assert outcomes[-1][1].terminal.cached_tokens >= CHUNK, "the shared prefix missed the cache"
    print("abort ok")
    prefill, decode = asyncio.run(abort_in_transfer())
    assert not decode.ok and decode.terminal.code == FailureCode.ABORTED, decode.terminal
    print("early abort ok", prefill.terminal)


if __name__ == "__main__":
    main(int(sys.argv[1]))
