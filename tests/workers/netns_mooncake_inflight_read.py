"""A stranger on the Mooncake ports (no deployment secret, its own TransferEngine) reads a transfer
in flight over Mooncake TCP and gets no KV: run by test_security_mooncake_inflight_read.py inside a
private network namespace. Prints one line per probe; exits non-zero on a failed check.

Mooncake's TCP server serves a READ of any registered range as it serves a WRITE
(pdtest/mooncake_wire.py). With pulled transfers (the default) decode registers nothing (its staging
read is refused), and the prefill side's send-staging slots of a piece are registered from before
its report until decode read them (workers/transport/mooncake_pull_channel.py). With the deployment
secret they hold ciphertext (workers/transport/kv_cipher.py): the stranger reads the slot's bytes
exactly, and they are not the KV. The oracles: the plaintext is the prefill pool's page the
request's first page was sent from (the request's MAC then proves decode landed it); the bytes read
are that page XOR the documented keystream (PyPI `cryptography`'s ChaCha20 under the room's key).
Once the slots are copied out and unregistered, the same read is refused. Before KV encryption the
read returned the plaintext: docs/operations.md §8.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.mooncake_wire import record_channels, record_handshakes, record_reports, source_addr, start_held_transfer
from pdtest.pd_engine_harness import PDPair, oracle, recorded_pulls, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def read(session: str, addr: int, length: int) -> bytes | None:
    """`length` bytes at `addr` of the peer, read by a fresh stranger's engine (it fetches the
    peer's registered ranges now); None when refused."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = torch.zeros(length, dtype=torch.uint8)
    return buf.numpy().tobytes() if engine.transfer_sync_read(session, buf.data_ptr(), addr, length) == 0 else None


def main(seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(8, 40))]
    expected = oracle().generate(prompt, GREEDY).output_ids

    async def run() -> None:
        config = worker_config("mooncake")
        async with PDPair("mooncake", prefill_config=config, decode_config=config) as pair:
            handshakes = record_handshakes(pair.prefill.sender)
            channels = record_channels(pair.prefill.sender)
            reports = record_reports(pair.prefill.sender)  # (before the hold: its report is recorded too)
            session = pair.prefill.sender.engine.session_id
            staging = pair.prefill.sender.staging
            held, release = await start_held_transfer(pair, prompt, GREEDY, "victim")
            handshake, report = handshakes["victim-d"], reports["victim-d"][0]
            assert report.page_begin == 0 and report.layer_begin == 0, report  # request page 0, layer 0 first
            addr, length = source_addr(pair.prefill.sender, report)  # the send-staging slot decode reads
            in_slot = staging.buffers[0][report.source_slots[0]].contiguous().view(torch.uint8).numpy().tobytes()
            source = pair.prefill.sender.pool.buffers[0][channels["victim-d"].src_pages[0]]
            plaintext = source.contiguous().view(torch.uint8).numpy().tobytes()  # request page 0, layer 0
            decode_staging = pair.decode.receiver.staging
            landing = await asyncio.to_thread(read, pair.decode.receiver.engine.session_id,
                                              decode_staging.base_addrs[0], decode_staging.page_bytes)
            got = await asyncio.to_thread(read, session, addr, length)
            deadline = time.monotonic() + 20  # (a loaded run may see the ranges before they were registered)
            while got is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                got = await asyncio.to_thread(read, session, addr, length)
            release.set()
            _, outcome = await held
            assert landing is None, "the stranger read decode's staging: a pulled transfer registers none of it"
            print("cannot: read decode's staging (a pulled transfer registers none of it)")
            assert got is not None, "the stranger's read of the transfer in flight was refused"
            assert got == in_slot, "the stranger read other bytes than the slot's"
            assert any(plaintext) and got != plaintext, "the stranger read the KV of a transfer in flight"
            key = config.bootstrap.auth.kv_cipher_key(handshake.room, handshake.auth.nonce)
            # Layer 0 of request page 0: block counter 0, nonce 0 (workers/transport/kv_cipher.py).
            stream = Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor().update(bytes(length))
            assert got == bytes(a ^ b for a, b in zip(plaintext, stream)), "the slot holds no ChaCha20 of the KV"
            assert outcome.ok and outcome.tokens == expected, outcome  # decode decrypted the genuine KV
            print(f"cannot: read the KV of a transfer in flight over tcp ({length} bytes read: its ChaCha20 "
                  f"ciphertext, not the KV)")
            assert await asyncio.to_thread(read, session, addr, length) is None, "read the slot after the copy"
            print("cannot: read the slot once the transfer landed")
            await pair.wait_pools_clean(config.transport.send_timeout_s + 10)

    with recorded_pulls():
        asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("read probes ok")
