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


def hold_reports(sender, seconds: float) -> None:
    """Every windowed transfer's first report waits `seconds`: its staging window stays taken."""
    opener = sender.open

    def holding(handshake, emit, *args, **kwargs):
        first = []

        async def emit_late(chunk):
            if not first:
                first.append(chunk)
                await asyncio.sleep(seconds)
            await emit(chunk)
        return opener(handshake, emit_late, *args, **kwargs)
    sender.open = holding


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
        config = worker_config("mooncake")
        transport = dataclasses.replace(config.transport, mooncake_staging_tokens=staging_pages * PAGE_SIZE)
        if shape == "queue":
            # Two long prompts hold both halves of the staging longer than `send_timeout_s` (their
            # first window reports are held): the third queues for its window past that, within the
            # transfer's own deadline (`transfer_timeout_s`), and is served.
            transport = dataclasses.replace(transport, send_timeout_s=1.0)
        staged = dataclasses.replace(config, transport=transport)
        async with PDPair("mooncake", prefill_config=config, decode_config=staged) as pair:
            staging = pair.decode.receiver.staging
            assert staging.num_pages == staging_pages
            if shape == "queue":
                hold_reports(pair.prefill.sender, 3 * transport.send_timeout_s)
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
    main(int(sys.argv[1]), sys.argv[2])
    print("long prompts ok")
