"""On the CPU, in wall time: chunk k's KV reaches decode while chunk k+1's forward still runs.

The GPU check of the same overlap is test_chunk_send_order_cuda.py; this one needs no device. Every
forward after the first is slowed in the model thread (a sleep, which lets go of the GIL as a
CUDA forward's host does while it waits for the GPU), and each chunk's emission to decode is
timed. A send that waits for the next forward (queued behind it on the event loop, in the model
thread, or on a lock the forward holds) is emitted only after that forward ends.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.pd_engine_harness import CHUNK, PDPair, oracle, timed_emits, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
SLOW_FORWARD_S = 0.6


@pytest.mark.parametrize("direct", ["on", "off"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_each_chunk_is_emitted_while_the_next_forward_runs(direct, layerwise) -> None:
    rng = random.Random()
    chunks = rng.randint(3, 4)
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range((chunks - 1) * CHUNK + rng.randrange(1, CHUNK))]

    async def run():
        base = worker_config("grpc", same_host_direct=direct)
        cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=layerwise))
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            emitted, _ = timed_emits(pair.prefill)
            forwards: list[tuple[float, float]] = []  # (began, ended) of each prefill forward
            extend = pair.prefill.runner.extend

            def slowed_extend(seqs, progress=None, **kwargs):
                began = time.monotonic()
                logits = extend(seqs, progress=progress, **kwargs)
                if forwards:
                    time.sleep(SLOW_FORWARD_S)  # the host waiting for a long forward on the GPU
                forwards.append((began, time.monotonic()))
                return logits
            pair.prefill.runner.extend = slowed_extend
            outcome = await pair.run(prompt, GREEDY, "overlap")
            await pair.wait_pools_clean()
            return outcome, emitted, forwards

    (prefill, decode), emitted, forwards = asyncio.run(run())
    assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
    assert len(forwards) == chunks
    # Chunk k (k < last) completes CHUNK * k tokens; some emission covering it must come out
    # before forward k + 1 ends (with time to spare: at most half the slowed forward).
    for k in range(1, chunks):
        began, ended = forwards[k]
        during = [when for when in emitted if forwards[k - 1][1] <= when < ended - SLOW_FORWARD_S / 2]
        assert during, (f"nothing of chunk {k} was emitted during forward {k + 1} "
                        f"({began - forwards[0][0]:.3f}s..{ended - forwards[0][0]:.3f}s); emissions at "
                        f"{[round(when - forwards[0][0], 3) for when in emitted]}")
