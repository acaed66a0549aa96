"""A compromised prefill (it holds the deployment secret) sends all-NaN KV for its own request and
holds back its TransferDone, while unrelated requests of different lengths decode. Used by
tests/workers/test_security_nan_peer.py (grpc) and netns_nan_peer_mooncake.py.

Over gRPC decode checks each chunk as it lands (kv_checks.FiniteOnLanding): the attacker's request
fails while its TransferDone is still held (before, it waited for the done, with the NaN written
into its pages). Over Mooncake the NaN lands in the decode pool, in the first pages the pool hands
out (page 0 among them; copied there out of the staging slots as each send is reported,
send_landing.py), and its refusal waits for the MAC's verdict after the done, so honest requests
decode beside it.

What must hold: every honest request's tokens equal the offline engine's greedy tokens (the run
without the attacker gives the same: PD parity is tested elsewhere), the attacker's request fails
with INTERNAL naming the NaN, and both pools end empty. Before the padding fix, shorter rows were
padded with page 0 and their masked NaN times 0 stayed NaN: their outputs became runs of token 0.
"""
from __future__ import annotations

import asyncio
import random

import torch

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import Failed, FailureCode
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest.hostile_prefill import poison_and_hold
from pdtest.pd_engine_harness import PDPair, collect, oracle, recorded_pulls, runner

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


async def attack(rng: random.Random, transport: str, config_for, honest_count: int = 6) -> None:
    """Runs the attack with `config_for(transport)` as every engine's WorkerConfig; raises
    AssertionError on any harm to an honest request."""
    vocab = oracle().vocab_size
    prompt = lambda low, high: [rng.randrange(2, vocab) for _ in range(rng.randrange(low, high))]  # noqa: E731
    evil = prompt(30, 50)
    honest = [prompt(3, 12) for _ in range(honest_count - 1)] + [prompt(30, 60)]  # page counts differ
    expected = [oracle().generate(p, GREEDY).output_ids for p in honest]
    with recorded_pulls() as pulled:
        config = config_for(transport)
        async with PDPair(transport, prefill_config=config, decode_config=config) as pair:
            hostile = PrefillEngine(runner(), config)
            await hostile.start()
            sent, release = asyncio.Event(), asyncio.Event()
            poison_and_hold(hostile, sent, release)
            p_req, d_req = pair.requests(evil, GREEDY, "evil", prefill=hostile)
            evil_prefill = asyncio.ensure_future(collect(hostile, p_req))
            evil_decode = asyncio.ensure_future(collect(pair.decode, d_req))
            try:
                if transport == "grpc":  # refused on landing: while the done is held, nothing else ends it
                    await asyncio.wait_for(asyncio.shield(evil_decode), 60)
                    assert not release.is_set()
                else:
                    await asyncio.wait_for(sent.wait(), 60)
                    # (mooncake: each send is copied out of its staging slots into the pages as it is
                    # reported, before the TransferDone and its checks)
                    await _until_nan_in(pair.decode.pool.buffers, pulled["evil-d"])
                evil_pages = pulled["evil-d"]
                assert 0 in evil_pages, f"the attacker did not get page 0 ({evil_pages}): the test proves nothing"
                honest_runs = await asyncio.gather(*(pair.run(p, GREEDY, f"honest{i}") for i, p in enumerate(honest)))
                release.set()
                evil_outcome = await evil_decode
                await evil_prefill
                # A refused one-sided transfer's pages come back after the late-write grace.
                await pair.wait_pools_clean(config.transport.send_timeout_s + 10)
            finally:
                release.set()
                for task in (evil_prefill, evil_decode):
                    task.cancel()
                await hostile.stop()
    harmed = [i for i, ((_, d), want) in enumerate(zip(honest_runs, expected)) if not (d.ok and d.tokens == want)]
    print(f"{transport}: attacker pages {evil_pages}; honest pages "
          f"{[pulled[f'honest{i}-d'] for i in range(len(honest))]}; harmed {len(harmed)} of {len(honest)}")
    assert not harmed, [(honest_runs[i][1], expected[i]) for i in harmed]
    assert isinstance(evil_outcome.terminal, Failed) and evil_outcome.terminal.code == FailureCode.INTERNAL, evil_outcome
    assert "NaN" in evil_outcome.terminal.message and not evil_outcome.tokens, evil_outcome.terminal


async def _until_nan_in(buffers: list[torch.Tensor], pages: list[int], timeout_s: float = 30) -> None:
    """Waits until `buffers` (the decode pool's) hold NaN in `pages` (the attacker's KV has landed)."""
    index = torch.tensor(pages, dtype=torch.long)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not any(torch.isnan(buffer.index_select(0, index)).any() for buffer in buffers):
        assert asyncio.get_running_loop().time() < deadline, "the attacker's NaN never reached the decode pool"
        await asyncio.sleep(0.02)
