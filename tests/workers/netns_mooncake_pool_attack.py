"""What a stranger on the Mooncake ports (no deployment secret, its own TransferEngine, every
address known) can still do to PD workers over Mooncake TCP; run by test_security_mooncake_pool.py
inside a private network namespace. Prints one line per probe; exits non-zero on a failed check.

Cannot (each was possible before registrations were narrowed):
- read or write the prefill pool (its KV and radix cache): the prefill side registers nothing;
- read or write the decode pool at any time: it is never registered;
- write anything of decode's, even while a transfer runs: pulled transfers (the default) register
  none of decode's memory over TCP (its engine's metadata lists no buffer), so neither the pages of
  a decoding request nor the staging slots its transfer landed in; nor the prefill side's
  send-staging slots a transfer used once decode read them (unregistered then).
Can (still open, Mooncake authenticates no peer): write into the prefill side's send-staging slots
of a transfer in flight (from its report until decode read them); the write lands, but it changes
no output token: decode MACs what it read and landed against the tag the prefill side signed
(transport/kv_mac.py), refusing that request with a clear error, a denial of that transfer only.
Before the MAC, finite garbage went unnoticed into the request's output; before pulled transfers the
same held for decode's staging slots (netns_mooncake_slow_body.py probes that direction).
"""
from __future__ import annotations

import asyncio
import time
import random
import sys

import torch

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.mooncake_wire import (ask_metadata, assert_refused_by_mac, record_reports, source_addr,
                                  start_held_transfer)
from pdtest.pd_engine_harness import PDPair, collect, oracle, recorded_pulls, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def stranger():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine  # registers nothing: a TCP transfer reads and writes its local memory directly


def try_read(engine, session: str, addr: int, length: int) -> bool:
    """Whether the stranger read `length` bytes at `addr` of the peer."""
    buf = torch.zeros(length, dtype=torch.uint8)
    return engine.transfer_sync_read(session, buf.data_ptr(), addr, length) == 0


def try_write(engine, session: str, addr: int, length: int, data: torch.Tensor | None = None) -> bool:
    """Whether the stranger wrote `length` bytes at `addr` of the peer: `data`'s (default NaN)."""
    data = torch.full((length // 4,), float("nan")) if data is None else data
    assert data.numel() * data.element_size() >= length
    return engine.transfer_sync_write(session, data.data_ptr(), addr, length) == 0


def main(seed: int) -> None:  # noqa: C901 (one probe after another)
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]
    async def run(pulled: dict[str, list[int]]):
        config = worker_config("mooncake")
        async with PDPair("mooncake", prefill_config=config, decode_config=config) as pair:
            attacker = stranger()
            reports = record_reports(pair.prefill.sender)
            p_session = pair.prefill.sender.engine.session_id
            d_session = pair.decode.receiver.engine.session_id
            page = pair.decode.pool.bytes_per_page
            first = await pair.run(prompts[0], GREEDY, "warm")  # the prefill pool now holds cached KV
            assert first[1].ok and first[1].tokens == expected[0], first
            p_base = pair.prefill.pool.buffers[0].data_ptr()
            d_base = pair.decode.pool.buffers[0].data_ptr()
            before = [buffer.clone() for buffer in pair.prefill.pool.buffers]
            assert not try_read(attacker, p_session, p_base, page), "read the prefill pool"
            assert not try_write(attacker, p_session, p_base, page), "wrote the prefill pool"
            assert all(torch.equal(b, a) for b, a in zip(before, pair.prefill.pool.buffers))
            print("cannot: read or write the prefill pool")
            assert not try_read(attacker, d_session, d_base, page), "read the idle decode pool"
            assert not try_write(attacker, d_session, d_base, page), "wrote the idle decode pool"
            print("cannot: read or write the decode pool while no transfer runs")

            decoding = asyncio.Event()

            async def on_event(event):
                decoding.set()
            p_req, d_req = pair.requests(prompts[1], GREEDY, "victim")
            victim = asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req, on_event))
            await asyncio.wait_for(decoding.wait(), 60)
            pages = pulled["victim-d"]
            hits = [try_write(attacker, d_session, d_base + p * page, page) for p in pages]
            landing = pair.decode.receiver.staging.base_addrs[0]  # decode's slots: the lowest first
            hits.append(try_write(attacker, d_session, landing, page))
            read_from, _ = source_addr(pair.prefill.sender, reports["victim-d"][0])  # prefill's slot, read
            hits.append(try_write(attacker, p_session, read_from, page))
            _, outcome = await victim
            assert not any(hits) and outcome.ok and outcome.tokens == expected[1], (hits, outcome)
            print(f"cannot: write the pages of a decoding request ({len(pages)} pages tried), nor the "
                  f"staging slots its transfer used on either side")

            # Still open: a transfer in flight has its pages registered. Hold the prefill side's
            # TransferDone so the transfer stays in flight while the stranger writes.
            held, release = await start_held_transfer(pair, prompts[2], GREEDY, "in-flight")
            listed = ask_metadata("127.0.0.1", int(d_session.rsplit(":", 1)[1])).get("buffers", [])
            d_landing = pair.decode.receiver.staging.base_addrs[0]
            d_hit = try_write(attacker, d_session, d_landing, page)
            target, _ = source_addr(pair.prefill.sender, reports["in-flight-d"][0])  # its send-staging slot
            # An attacker retries: the stranger's engine learns a segment's registered ranges from
            # its peer's metadata, which it may hold from before this transfer registered its pages
            # (a loaded CI run saw the first write refused). The transfer stays held meanwhile.
            # So a fresh engine (which fetches the ranges now) tries, again until it lands.
            # Finite garbage (KV-like values of the pool's dtype): the finite check cannot see it.
            pool = pair.decode.pool
            garbage = torch.randn(page // pool.buffers[0].element_size(), dtype=torch.float32,
                                  generator=torch.Generator().manual_seed(seed)).to(pool.dtype)
            fresh = stranger()
            deadline = time.monotonic() + 20
            landed = try_write(fresh, p_session, target, page, garbage)
            while not landed and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                landed = try_write(fresh, p_session, target, page, garbage)
            release.set()
            _, outcome = await held
            assert listed == [] and not d_hit, ("decode exposed memory while a transfer ran", listed, d_hit)
            print("cannot: write anything of decode's while a transfer runs (its engine lists no buffer)")
            assert landed, "the stranger's write into the transfer in flight never landed"
            # No output token changed: the request is refused, with a reason that names the MAC.
            assert_refused_by_mac(outcome)
            print("can (still open): write into the prefill side's send staging of a transfer in flight; it "
                  "changes no output token: the KV MAC of decode's private copy refuses that request")
            await pair.wait_pools_clean(config.transport.send_timeout_s + 10)

    with recorded_pulls() as pulled:
        asyncio.run(run(pulled))


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("attack probes ok")
