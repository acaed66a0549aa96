"""PD into an attention-TP decode group: `serve decode --tp 2 --ep 2` (one DP group of two TP
ranks, the heads split, the experts spread) behind a 1-rank prefill worker.

Rank 0 runs the engine; rank 1 replays its forwards (model/distributed/tp_replay.py), including the pages
each PD transfer wrote into rank 0's pool. The oracle is the single-process offline engine: the
greedy tokens must be the same. One prefill process and one decode group for the whole file.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from pdtest.group_harness import GroupWorker, offline_greedy

pytestmark = [pytest.mark.slow]

VOCAB = 256


@pytest.mark.timeout(240)
def test_pd_into_a_tp2_decode_group_equals_offline_engine(tmp_path) -> None:
    from deepseek_pd.client.pd_dispatch import PDClient
    from deepseek_pd.client.scheduler_grpc import sampling_proto

    rng = random.Random()
    count = rng.randint(4, 6)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(count)]
    max_new = [rng.randint(2, 10) for _ in range(count)]
    want = offline_greedy(prompts, max_new)
    with GroupWorker("prefill", [], tmp_path / "prefill.log") as prefill, \
            GroupWorker("decode", ["--tp", "2", "--ep", "2"], tmp_path / "decode.log") as decode:
        async def run() -> list:
            await asyncio.gather(prefill.wait_healthy(), decode.wait_healthy())
            async with PDClient(prefill.address, "127.0.0.1", prefill.bootstrap_port, decode.address) as client:
                return await asyncio.gather(*(
                    client.generate(p, sampling_proto(max_new_tokens=n, temperature=0.0), stream=bool(i % 2))
                    for i, (p, n) in enumerate(zip(prompts, max_new))))
        results = asyncio.run(run())
        assert all(r.ok for r in results), ([(r.prefill_error, r.decode_error) for r in results],
                                            prefill.log_tail(), decode.log_tail())
        assert [r.output_ids for r in results] == want, (prefill.log_tail(), decode.log_tail())
        log = decode.log_path.read_text()
        assert "TP rank 1 of DP group 0, replaying rank 0's forwards" in log, decode.log_tail()
