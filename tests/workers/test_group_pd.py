"""PD between two multi-rank groups: a prefill group (dp 2, ep 2) and a decode group (dp 2, ep 2).

Each request's room picks its prefill DP rank (`room % 2`, where that rank's engine computes the
prompt and keeps the KV) and its decode DP rank; the decode rank asks the prefill group's rank 0
for the route table and pulls the KV from the prefill rank's own bootstrap endpoint. The oracle is
the single-process offline engine (no TBO); the rooms are drawn so that both prefill ranks serve
requests; with `--enable-tbo` both groups run two-batch overlap, and a first prompt sent alone
(one sequence on one prefill rank, the other idle) is prefilled in two chunks of one sequence.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from pdtest.group_harness import GroupWorker, offline_greedy

pytestmark = [pytest.mark.slow]

VOCAB = 256


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tbo", [False, True], ids=["plain", "tbo"])
def test_pd_between_dp_groups_equals_offline_engine(tmp_path, tbo) -> None:
    from deepseek_pd.client.pd_dispatch import PDClient
    from deepseek_pd.client.scheduler_grpc import sampling_proto

    rng = random.Random()
    count = rng.randint(10, 12) if tbo else rng.randint(5, 7)  # TBO: batches of >= 2 on both ranks
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(count)]
    prompts[0] = [rng.randrange(3, VOCAB) for _ in range(rng.randint(24, 40))]  # > one 16-token prefill chunk
    max_new = [rng.randint(12, 20) if tbo else rng.randint(1, 8) for _ in range(count)]
    rooms = [rng.randrange(2**31 - 1) for _ in range(count)]
    rooms[0] -= rooms[0] % 2  # both prefill DP ranks get work, whatever else was drawn
    rooms[1] |= 1
    want = offline_greedy(prompts, max_new)
    group = ["--dp", "2", "--ep", "2"] + (["--enable-tbo"] if tbo else [])
    with GroupWorker("prefill", group, tmp_path / "prefill.log") as prefill, \
            GroupWorker("decode", group, tmp_path / "decode.log") as decode:
        async def run() -> list:
            await asyncio.gather(prefill.wait_healthy(), decode.wait_healthy())
            async with PDClient(prefill.address, "127.0.0.1", prefill.bootstrap_port, decode.address) as client:
                def one(i: int):
                    return client.generate(prompts[i], sampling_proto(max_new_tokens=max_new[i], temperature=0.0),
                                           stream=bool(i % 2), room=rooms[i])
                # TBO: the first prompt alone, so its prefill rank has one sequence and the other is idle
                first = [await one(0)] if tbo else []
                return first + list(await asyncio.gather(*(one(i) for i in range(len(first), count))))
        results = asyncio.run(run())
        assert all(r.ok for r in results), ([(r.prefill_error, r.decode_error) for r in results],
                                            prefill.log_tail(), decode.log_tail())
        assert [r.output_ids for r in results] == want, (prefill.log_tail(), decode.log_tail())
        if tbo:  # the overlapped path ran (and not only its fallback): decode ranks split their batches
            assert "two-batch overlap: split a decode batch" in decode.log_path.read_text(), decode.log_tail()
            # ... and the lone prompt's first prefill chunk was cut in two inside it (the other rank idle)
            assert "two-batch overlap: split a extend batch of 1 sequences" in prefill.log_path.read_text(), \
                prefill.log_tail()
