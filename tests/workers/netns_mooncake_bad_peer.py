"""A compromised prefill worker (it holds the secret and serves request B, so it legitimately learns
where B's KV goes) against another user's request D, run by test_security_mooncake_bad_peer.py in a
private network namespace. Prints one line per finding; exits non-zero on a failed check.

While B's transfer runs, the bad peer starts a Mooncake WRITE to every page of B's destination (the
range check passes: they are registered for B), and sends B's KV honestly: B is served. Once B is
over, D (same prompt length, another user, another prefill's KV) is admitted and decoding; then the
bad peer sends NaN bodies on the writes it started.

Before staging, B's destination was B's decode pages, freed when B ended and handed to D (the pool
is a stack): the NaNs landed in D's pages after D's checks and D's output changed, unnoticed. With
staging (workers/transport/staging.py) B's destination was staging slots: the bodies land there,
D's private pages are untouched and D's output equals the oracle's.

A write into slots while another transfer uses them fails that transfer's MAC check, never its
output (the KV MAC held before the staging too; kept here as a guard): the last probe writes
garbage into request A's slots while A's transfer runs; A is refused by its MAC, E, decoding
meanwhile, is untouched.
"""
from __future__ import annotations

import asyncio
import random
import struct
import sys

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import TokenChunk
from pdtest.mooncake_wire import (assert_refused_by_mac, find_data_port, record_handshakes, send_bodies,
                                  start_held_transfer, start_write)
from pdtest.pd_engine_harness import PDPair, collect, oracle, recorded_pulls, worker_config

MAX_NEW = 64
ONE = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)  # B: its pages, no more
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    length = rng.randrange(12, 40)
    prompt_b, prompt_d, prompt_a, prompt_e = ([rng.randrange(2, vocab) for _ in range(length)] for _ in range(4))
    expected_b, expected_d, expected_e = (oracle().generate(p, s).output_ids
                                          for p, s in ((prompt_b, ONE), (prompt_d, GREEDY), (prompt_e, GREEDY)))

    async def run(pulled: dict[str, list[int]]):
        config = worker_config("mooncake")
        async with PDPair("mooncake", prefill_config=config, decode_config=config) as pair:
            handshakes = record_handshakes(pair.prefill.sender)
            served_b, release = await start_held_transfer(pair, prompt_b, ONE, "b")
            handshake = handshakes["b-d"]
            destination, page = handshake.mooncake, handshake.mooncake.page_bytes
            targets = [destination.layer_base_addrs[0] + slot * page for slot in handshake.page_ids]
            port = find_data_port(targets[0], page)
            writes = [(start_write(port, addr, page), addr, page) for addr in targets]
            release.set()
            _, outcome_b = await served_b
            assert outcome_b.ok and outcome_b.tokens == expected_b, outcome_b
            print(f"B served; {len(writes)} writes into its destination started, bodies held back")
            await pair.wait_pools_clean(5)

            struck: list[int] = []

            async def on_event(event):
                if isinstance(event, TokenChunk) and not struck:  # D checked and decoding: now the bodies
                    await send_bodies(writes)
                    struck.append(len(event.token_ids))
            p_req, d_req = pair.requests(prompt_d, GREEDY, "d")
            _, outcome_d = await asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req, on_event))
            for sock, _, _ in writes:
                sock.close()
            reused = sorted(set(pulled["b-d"]) & set(pulled["d-d"]))
            print(f"the bodies landed while D decoded; D holds {len(reused)} of B's former decode pages")
            assert struck and outcome_d.ok, outcome_d
            assert outcome_d.tokens == expected_d, (
                f"B's prefill changed D's output: {sum(a != b for a, b in zip(outcome_d.tokens, expected_d))} "
                f"of {MAX_NEW} tokens differ")
            print("D's output equals the oracle's: the bad peer reached no page of another request")
            await pair.wait_pools_clean(config.transport.send_timeout_s + 10)

            # Into another request's slots while its transfer runs (it learns them as a stranger
            # would): finite KV-like garbage fails that request by its MAC, and only it; E, decoding
            # meanwhile, is untouched.
            garbage = random.Random(seed + 1)
            decoding = asyncio.Event()

            async def on_decode(event):
                decoding.set()
            p_req, d_req = pair.requests(prompt_e, GREEDY, "e")
            served_e = asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req, on_decode))
            await asyncio.wait_for(decoding.wait(), 60)
            served_a, release = await start_held_transfer(pair, prompt_a, GREEDY, "a")
            handshake = handshakes["a-d"]
            targets = [handshake.mooncake.layer_base_addrs[0] + slot * page for slot in handshake.page_ids]
            await send_bodies([(start_write(port, addr, page), addr, page) for addr in targets],
                              body=lambda n: struct.pack(f"<{n // 4}f", *(garbage.gauss(0, 1) for _ in range(n // 4))))
            release.set()
            (_, outcome_a), (_, outcome_e) = await served_a, await served_e
            assert_refused_by_mac(outcome_a)
            assert outcome_e.ok and outcome_e.tokens == expected_e, outcome_e
            print("a write into another request's slots in flight failed that request by its MAC; "
                  "the one decoding meanwhile is untouched")
            await pair.wait_pools_clean(config.transport.send_timeout_s + 10)

    with recorded_pulls() as pulled:
        asyncio.run(run(pulled))


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("bad-peer probe ok")
