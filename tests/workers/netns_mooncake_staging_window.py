"""More concurrent PD requests over Mooncake than the decode side's staging holds at once, run by
test_pd_mooncake_staging.py inside a private network namespace: the staging works as a window (a
transfer waits for slots before its handshake goes out; the prefill side computes only handshaken
requests, so the slot holders are the ones it works on), every request completes with the oracle's
tokens, and staging and pools end empty. Prints one line; exits non-zero on a failed check."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import sys

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.pd_engine_harness import PAGE_SIZE, PDPair, oracle, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(20, 40))] for _ in range(rng.randrange(6, 10))]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]
    longest = max(map(len, prompts))

    async def run():
        config = worker_config("mooncake")
        # Room for the longest prompt and a bit: at most two transfers at a time.
        staged = dataclasses.replace(config, transport=dataclasses.replace(
            config.transport, mooncake_staging_tokens=longest + 2 * PAGE_SIZE))
        async with PDPair("mooncake", prefill_config=config, decode_config=staged) as pair:
            staging = pair.decode.receiver.staging
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)))
            bad = [i for i, ((_, d), want) in enumerate(zip(outcomes, expected)) if not (d.ok and d.tokens == want)]
            assert not bad, [outcomes[i][1] for i in bad]
            await pair.wait_pools_clean(5)
            assert staging.num_used == 0
            print(f"{len(prompts)} requests of up to {longest} tokens through a {staging.num_pages}-page staging: all "
                  f"equal the oracle's")

    asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("staging window ok")
