"""A stranger on the Mooncake ports against a transfer that moves through the staging in windows
(a prompt longer than the whole staging), run by test_security_mooncake_pool.py inside a private
network namespace. The prefill side's report of its first window is held, so the window's slots hold
KV that decode has not copied out yet, and the stranger writes finite garbage into the first one.
That request is refused by its KV MAC (checked over the whole private copy after the TransferDone),
never decoded from; a request that fits the staging's other half runs meanwhile and equals the
oracle; staging and pools end empty. Prints one line; exits non-zero on a failed check. The decode
worker runs the write direction (`mooncake_kv_direction=write`): a pulled transfer's windows are
decode's own reads into slots no peer reaches."""
from __future__ import annotations

import asyncio
import random
import sys
import time

import torch

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.mooncake_wire import (assert_refused_by_mac, first_page_addr, hold_first_report, record_handshakes,
                                  staged_pair)
from pdtest.pd_engine_harness import PAGE_SIZE, collect, oracle

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
STAGING_PAGES = 4  # a window of 2 for the long prompt, 2 slots for the short one


def stranger():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    staging_tokens = STAGING_PAGES * PAGE_SIZE
    long = [rng.randrange(2, vocab) for _ in range(rng.randint(staging_tokens + 1, 5 * staging_tokens))]
    short = [rng.randrange(2, vocab) for _ in range(rng.randint(1, STAGING_PAGES // 2 * PAGE_SIZE))]
    expected_short = oracle().generate(short, GREEDY).output_ids

    async def run():
        # Windows through decode's staging: the write direction (pulled windows are decode's own reads).
        async with staged_pair(staging_tokens, mooncake_kv_direction="write") as pair:
            handshakes = record_handshakes(pair.prefill.sender)
            sent, release = asyncio.Event(), asyncio.Event()

            async def hold() -> None:
                sent.set()
                await release.wait()
            hold_first_report(pair.prefill.sender, hold, decode_rid="long-d")
            p_req, d_req = pair.requests(long, GREEDY, "long")
            held = asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req))
            await asyncio.wait_for(sent.wait(), 60)
            window = handshakes["long-d"].mooncake.window_pages
            assert window == STAGING_PAGES // 2, handshakes["long-d"]
            target, page = first_page_addr(handshakes["long-d"])  # page 0's slot: written, not copied out
            pool = pair.decode.pool
            garbage = torch.randn(page // pool.buffers[0].element_size(), dtype=torch.float32,
                                  generator=torch.Generator().manual_seed(seed)).to(pool.dtype)
            landed, deadline = False, time.monotonic() + 20
            while not landed and time.monotonic() < deadline:  # a fresh engine learns the ranges now
                landed = stranger().transfer_sync_write(pair.decode.receiver.engine.session_id,
                                                        garbage.data_ptr(), target, page) == 0
                if not landed:
                    await asyncio.sleep(0.2)
            # Meanwhile a prompt that fits the staging's other half is served, unharmed.
            _, other = await asyncio.wait_for(pair.run(short, GREEDY, "short"), 60)
            release.set()
            _, outcome = await held
            assert landed, "the stranger's write into the window never landed"
            assert other.ok and other.tokens == expected_short, other
            assert_refused_by_mac(outcome)
            await pair.wait_pools_clean(pair.prefill.config.transport.send_timeout_s + 10)
            assert pair.decode.receiver.staging.num_used == 0
            print(f"a {len(long)}-token prompt through a {window}-page window: the stranger's write into it is "
                  f"refused by the KV MAC; the {len(short)}-token prompt beside it equals the oracle")

    asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("window attack ok")
