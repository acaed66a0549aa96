"""Prompts longer than the decode side's whole Mooncake staging, run by test_pd_mooncake_staging.py
inside a private network namespace: such a transfer moves through the staging in windows (the
prefill side writes a window's slots only after decode copied the pages they held into the request's
own pages), so every prompt that fits the KV pool is served. A burst of long and short prompts,
together many times the staging, completes too; every output equals the oracle's, and staging and
pools end empty. Prints one line; exits non-zero on a failed check."""
from __future__ import annotations

import asyncio
import random
import sys

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.mooncake_wire import hold_first_report, serve_all_as_the_oracle, staged_pair
from pdtest.pd_engine_harness import PAGE_SIZE, oracle

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def main(seed: int, shape: str) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    staging_pages = 4 if shape == "queue" else rng.randint(2, 4)
    count = {"one": 1, "burst": rng.randint(5, 8), "queue": 3}[shape]
    # Longer than the staging (some by many windows), and in a burst a few that fit it.
    lengths = [rng.randint(staging_pages * PAGE_SIZE + 1, 6 * staging_pages * PAGE_SIZE) for _ in range(count)]
    if shape == "burst":
        lengths += [rng.randint(1, staging_pages * PAGE_SIZE) for _ in range(rng.randint(1, 3))]
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]

    async def run():
        # queue: two long prompts hold both halves of the staging longer than `send_timeout_s` (their
        # first window reports are held): the third queues for its window past that, within the
        # transfer's own deadline (`transfer_timeout_s`), and is served.
        send_timeout = {"send_timeout_s": 1.0} if shape == "queue" else {}
        async with staged_pair(staging_pages * PAGE_SIZE, **send_timeout) as pair:
            assert pair.decode.receiver.staging.num_pages == staging_pages
            if shape == "queue":
                hold_first_report(pair.prefill.sender, lambda: asyncio.sleep(3 * send_timeout["send_timeout_s"]),
                                  each_channel=True)
            await serve_all_as_the_oracle(pair, prompts, GREEDY, expected)
            print(f"{len(prompts)} prompts of {sorted(lengths)} tokens through a {staging_pages}-page "
                  f"({staging_pages * PAGE_SIZE}-token) staging: all equal the oracle's")

    asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
    print("long prompts ok")
