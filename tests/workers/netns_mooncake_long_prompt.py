"""Prompts longer than the decode side's whole Mooncake staging, run by test_pd_mooncake_staging.py
inside a private network namespace: such a transfer moves through the staging in windows (the
prefill side writes a window's slots only after decode copied the pages they held into the request's
own pages), so every prompt that fits the KV pool is served. A burst of long and short prompts,
together many times the staging, completes too; every output equals the oracle's, and staging and
pools end empty. Prints one line; exits non-zero on a failed check."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import sys

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.pd_engine_harness import PAGE_SIZE, PDPair, oracle, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def main(seed: int, burst: bool) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    staging_pages = rng.randint(2, 4)
    count = rng.randint(5, 8) if burst else 1
    # Longer than the staging (some by many windows), and in a burst a few that fit it.
    lengths = [rng.randint(staging_pages * PAGE_SIZE + 1, 6 * staging_pages * PAGE_SIZE) for _ in range(count)]
    if burst:
        lengths += [rng.randint(1, staging_pages * PAGE_SIZE) for _ in range(rng.randint(1, 3))]
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]

    async def run():
        config = worker_config("mooncake")
        staged = dataclasses.replace(config, transport=dataclasses.replace(
            config.transport, mooncake_staging_tokens=staging_pages * PAGE_SIZE))
        async with PDPair("mooncake", prefill_config=config, decode_config=staged) as pair:
            staging = pair.decode.receiver.staging
            assert staging.num_pages == staging_pages
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)))
            bad = [(i, d.terminal if not d.ok else d.tokens) for i, ((_, d), want) in enumerate(zip(outcomes, expected))
                   if not (d.ok and d.tokens == want)]
            assert not bad, bad
            await pair.wait_pools_clean(5)
            assert staging.num_used == 0
            print(f"{len(prompts)} prompts of {sorted(lengths)} tokens through a {staging_pages}-page "
                  f"({staging_pages * PAGE_SIZE}-token) staging: all equal the oracle's")

    asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] == "burst")
    print("long prompts ok")
