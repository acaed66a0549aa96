"""A prefill worker older than the KV cipher with a new decode worker, over real Mooncake TCP: run by
test_security_mooncake_older_prefill.py inside a private network namespace. Prints one line per
check; exits non-zero on a failed one.

An older prefill worker does not know `MooncakeDestination.kv_cipher_algorithms`: it picks no cipher
and its signed ack names none. Here the current prefill worker is made to choose none
(`kv_cipher.choose` gives ""), which is what the older one does. Decode must accept it in the clear
(workers/transport/kv_cipher.py `agreed`), so a rolling upgrade keeps serving, and warn once, not
per request. The oracles: what lands in decode's staging slot in flight is the prefill pool's page
itself (the clear), and every output equals the offline engine's.

Such a prefill worker predates pulled transfers too: it can only write into decode. So the decode
worker here runs `mooncake_kv_direction=write`, what a rolling upgrade sets until every prefill
worker is new. A decode worker left at the default (pull) is refused by it at the handshake, the
older worker's own version check (simulated by accepting only version 2, as it did), and says what
to do: the request fails with that reason, no token, and every pool ends empty (`check_refused`).
"""
from __future__ import annotations

import asyncio
import logging
import random
import sys

import torch

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.prefill import bootstrap_servicer
from deepseek_pd.workers.transport.bootstrap_protocol import PROTOCOL_VERSION
from deepseek_pd.workers.transport import kv_cipher
from pdtest.mooncake_wire import (first_page_addr, record_channels, record_handshakes, start_held_transfer,
                                  write_direction)
from pdtest.pd_engine_harness import PDPair, oracle, recorded_pulls, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(seed: int) -> None:
    rng = random.Random(seed)
    vocab = oracle().vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]
    warned = Warnings()
    logging.getLogger(kv_cipher.__name__).addHandler(warned)
    kv_cipher.choose = lambda offered: ""  # the prefill worker before the cipher (decode never chooses)

    async def run() -> None:
        config = worker_config("mooncake")
        assert config.bootstrap.auth.enabled, "the decode worker must hold a deployment secret"
        async with PDPair("mooncake", prefill_config=config, decode_config=write_direction(config)) as pair:
            handshakes = record_handshakes(pair.prefill.sender)
            channels = record_channels(pair.prefill.sender)
            staging = pair.decode.receiver.staging
            held, release = await start_held_transfer(pair, prompts[0], GREEDY, "first")
            addr, length = first_page_addr(handshakes["first-d"])
            slot = (addr - staging.base_addrs[0]) // length
            in_slot = staging.buffers[0][slot].contiguous().view(torch.uint8).numpy().tobytes()
            source = pair.prefill.sender.pool.buffers[0][channels["first-d"].src_pages[0]]
            plaintext = source.contiguous().view(torch.uint8).numpy().tobytes()
            release.set()
            outcomes = [(await held)[1]]
            assert any(plaintext) and in_slot == plaintext, "the older prefill's KV did not land in the clear"
            print("sent in the clear: decode's slot holds the prefill page itself")
            outcomes += [decode for _, decode in await asyncio.gather(
                *(pair.run(p, GREEDY, f"more{i}") for i, p in enumerate(prompts[1:])))]
            for i, outcome in enumerate(outcomes):
                assert outcome.ok and outcome.tokens == expected[i], (i, outcome, expected[i])
            print(f"accepted: {len(outcomes)} requests equal the oracle's tokens")
            await pair.wait_pools_clean()

    with recorded_pulls():
        asyncio.run(run())
    asyncio.run(check_refused(prompts[0]))
    clear = [m for m in warned.messages if "in the clear" in m]
    assert len(clear) == 1, warned.messages
    print("warned once:", clear[0][:60])


async def check_refused(prompt: list[int]) -> None:
    """A decode worker at the default (pulled transfers) and a prefill worker that only knows version 2."""
    config = worker_config("mooncake")
    accepted = bootstrap_servicer.ACCEPTED_VERSIONS
    bootstrap_servicer.ACCEPTED_VERSIONS = (PROTOCOL_VERSION,)  # the older worker's check
    try:
        async with PDPair("mooncake", prefill_config=config, decode_config=config) as pair:
            _, outcome = await pair.run(prompt, GREEDY, "refused")
            message = getattr(outcome.terminal, "message", "")
            assert not outcome.ok and not outcome.tokens, outcome
            assert "protocol version mismatch" in message and "mooncake_kv_direction=write" in message, message
            await pair.wait_pools_clean()
    finally:
        bootstrap_servicer.ACCEPTED_VERSIONS = accepted
    print("a pulling decode refused by the older prefill, clearly:", message[:120])


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("older prefill ok")
