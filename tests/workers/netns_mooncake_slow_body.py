"""The slow-body write (issue 20), run by test_security_mooncake_slow_body.py inside a private network
namespace: a stranger (no secret) sends a Mooncake WRITE header for the first page a transfer in
flight writes, while that page is registered, holds the body back until the request has passed
every check and is decoding, then sends NaNs. Mooncake checked the range when the header came, so
the body lands wherever the header pointed, whatever was unregistered since.

Before staging, that page was one of the request's own decode pages: the NaNs reached the pages the
model reads after the KV MAC and the finite check, and the output changed. With the staging
(workers/transport/staging.py) it is a staging slot, copied into the request's private pages and
checked before; the body lands in the staging and the output equals the oracle's.
Prints one line per finding; exits non-zero on a failed check.
"""
from __future__ import annotations

import asyncio
import random
import sys

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import TokenChunk
from pdtest.mooncake_wire import (find_data_port, first_page_addr, record_handshakes, send_bodies,
                                  start_held_transfer, start_write, write_direction)
from pdtest.pd_engine_harness import PDPair, oracle, worker_config

MAX_NEW = 64
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(12, 40))]
    expected = oracle().generate(prompt, GREEDY).output_ids

    async def run():
        config = worker_config("mooncake")
        # A body written into decode's staging: the write direction (a pulled transfer has none).
        async with PDPair("mooncake", prefill_config=config, decode_config=write_direction(config)) as pair:
            handshakes = record_handshakes(pair.prefill.sender)
            tokens_when_landed: list[int] = []
            emitted = 0
            late: dict[str, object] = {}

            async def on_event(event):
                nonlocal emitted
                if not isinstance(event, TokenChunk):
                    return
                emitted += len(event.token_ids)
                if "sock" in late and not tokens_when_landed:  # checked and decoding: now the body
                    await send_bodies([(late["sock"], *late["target"])])
                    tokens_when_landed.append(emitted)
            # every byte is sent, the transfer still in flight:
            victim, release = await start_held_transfer(pair, prompt, GREEDY, "victim", on_event)
            addr, length = first_page_addr(handshakes["victim-d"])
            port = find_data_port(addr, length)
            late["target"], late["sock"] = (addr, length), start_write(port, addr, length)
            print(f"header accepted: a {length}-byte WRITE at {addr:#x} on port {port}, body held back")
            release.set()
            _, outcome = await victim
            late["sock"].close()
            assert tokens_when_landed and tokens_when_landed[0] <= MAX_NEW // 2, \
                f"the late body landed after {tokens_when_landed} of {MAX_NEW} tokens: too late to tell"
            print(f"the late body landed after the checks, {tokens_when_landed[0]} of {MAX_NEW} tokens in")
            assert outcome.ok, outcome
            assert outcome.tokens == expected, (
                f"the late write changed the output: {sum(a != b for a, b in zip(outcome.tokens, expected))} "
                f"of {MAX_NEW} tokens differ")
            print("the output equals the oracle's: the late write reached no page the model reads")
            await pair.wait_pools_clean(config.transport.send_timeout_s + 10)
            assert pair.decode.receiver.staging.num_used == 0

    asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("slow-body probe ok")
