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
meanwhile, is untouched. That was a denial of another user's request: a bad peer was not bounded to
its own requests. All of the above runs against a decode worker that chose the write direction
(`mooncake_kv_direction=write`, still available).

The default, pulled transfers (`pull_probe`): decode reads the KV out of the prefill side's send
staging and registers nothing, so the same bad peer, knowing every address of decode's staging and
holding request A in flight, finds nothing writable on decode: the decode engine's metadata lists
no buffer, and writes over each of its staging layers, on every port that listens, are refused. A
and E, decoding meanwhile, both equal the oracle: the last probe no longer fails another user's
request.
"""
from __future__ import annotations

import asyncio
import random
import struct
import sys

import torch

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import TokenChunk
from pdtest.mooncake_wire import (ask_metadata, assert_refused_by_mac, find_data_port,
                                  record_handshakes, send_bodies, start_held_transfer, start_write, write_direction)
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
        async with PDPair("mooncake", prefill_config=config, decode_config=write_direction(config)) as pair:
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
            served_e, served_a, release = await hold_beside_decoding(pair, prompt_e, prompt_a)
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
    asyncio.run(pull_probe(seed, prompt_a, prompt_e))


def stranger_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine


async def hold_beside_decoding(pair: PDPair, prompt_e: list[int], prompt_a: list[int]):
    """E decoding, then A's transfer held in flight: (E's outcomes, A's outcomes, A's release)."""
    decoding = asyncio.Event()

    async def on_decode(event):
        decoding.set()
    p_req, d_req = pair.requests(prompt_e, GREEDY, "e")
    served_e = asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req, on_decode))
    await asyncio.wait_for(decoding.wait(), 60)
    served_a, release = await start_held_transfer(pair, prompt_a, GREEDY, "a")
    return served_e, served_a, release


async def pull_probe(seed: int, prompt_a: list[int], prompt_e: list[int]) -> None:
    """The last probe against the default, pulled transfers (see the module doc)."""
    expected_a, expected_e = (oracle().generate(p, GREEDY).output_ids for p in (prompt_a, prompt_e))
    config = worker_config("mooncake")
    async with PDPair("mooncake", prefill_config=config, decode_config=config) as pair:
        served_e, served_a, release = await hold_beside_decoding(pair, prompt_e, prompt_a)  # A in flight
        engine, staging = pair.decode.receiver.engine, pair.decode.receiver.staging
        rpc_port = int(engine.session_id.rsplit(":", 1)[1])
        buffers = ask_metadata("127.0.0.1", rpc_port).get("buffers", [])
        # What it writes: every buffer decode's engine lists (a real attacker's targets), and each
        # whole staging layer, through both engines (the ports' scan is netns_mooncake_ports.py's).
        span = staging.num_pages * staging.page_bytes
        targets = [(b["addr"], b["length"]) for b in buffers] + [(base, span) for base in staging.base_addrs]
        garbage = torch.randn(max(length for _, length in targets) // 4, generator=torch.Generator().manual_seed(seed))
        attacker, landed = stranger_engine(), []
        sessions = [engine.session_id, pair.prefill.sender.engine.session_id]
        for addr, length in targets:  # finite KV-like values: only the MAC could see them
            landed += [(session, addr) for session in sessions
                       if attacker.transfer_sync_write(session, garbage.data_ptr(), addr, length) == 0]
        release.set()
        (_, outcome_a), (_, outcome_e) = await served_a, await served_e
        assert outcome_a.ok and outcome_a.tokens == expected_a, ("the bad peer failed A", outcome_a)
        assert outcome_e.ok and outcome_e.tokens == expected_e, outcome_e
        assert not landed, f"a write reached decode's staging: {landed}"
        assert buffers == [], f"decode's engine listed registered memory while A was in flight: {buffers}"
        print(f"pulled: decode lists no registered buffer and refused writes over its {len(staging.base_addrs)} "
              f"staging layers through both engines while A was in flight")
        print("pulled: A (in flight) and E (decoding) both equal the oracle: the bad peer failed no other "
              "user's request")
        await pair.wait_pools_clean(config.transport.send_timeout_s + 10)
        assert staging.num_used == 0 and pair.prefill.sender.staging.num_used == 0


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("bad-peer probe ok")
