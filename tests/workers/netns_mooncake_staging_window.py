"""More concurrent PD requests over Mooncake than the decode side's staging holds at once, run by
test_pd_mooncake_staging.py inside a private network namespace: the staging works as a window (a
transfer waits for slots before its handshake goes out; the prefill side computes only handshaken
requests, so the slot holders are the ones it works on), every request completes with the oracle's
tokens, and staging and pools end empty. Prints one line; exits non-zero on a failed check."""
from __future__ import annotations

import asyncio
import random
import sys

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.mooncake_wire import serve_all_as_the_oracle, staged_pair
from pdtest.pd_engine_harness import PAGE_SIZE, oracle

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(20, 40))] for _ in range(rng.randrange(6, 10))]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]
    longest = max(map(len, prompts))

    async def run():
        # Room for the longest prompt and a bit: at most two transfers at a time.
        async with staged_pair(longest + 2 * PAGE_SIZE) as pair:
            await serve_all_as_the_oracle(pair, prompts, GREEDY, expected)
            print(f"{len(prompts)} requests of up to {longest} tokens through a "
                  f"{pair.decode.receiver.staging.num_pages}-page staging: all equal the oracle's")

    asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("staging window ok")
