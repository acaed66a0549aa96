"""PD between two multi-rank groups: a prefill group (dp 2, ep 2) and a decode group (dp 2, ep 2).

Each request's room picks its prefill DP rank (`room % 2`, where that rank's engine computes the
prompt and keeps the KV) and its decode DP rank; the decode rank asks the prefill group's rank 0
for the route table and pulls the KV from the prefill rank's own bootstrap endpoint. The oracle is
the single-process offline engine (no TBO); the rooms are drawn so that both prefill ranks serve
requests; with `--enable-tbo` both groups run two-batch overlap, and a first prompt sent alone
(one sequence on one prefill rank, the other idle) is prefilled in two chunks of one sequence.
A request whose bootstrap address names prefill DP rank 1 for a room of rank 0 fails at once, the
error naming both ranks.
"""
from __future__ import annotations

import asyncio
import random
import time

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
        if not tbo:
            asyncio.run(_misrouted_request_fails_at_once(prefill, decode, rng))
        if tbo:  # the overlapped path ran (and not only its fallback): decode ranks split their batches
            assert "two-batch overlap: split a decode batch" in decode.log_path.read_text(), decode.log_tail()
            # ... and the lone prompt's first prefill chunk was cut in two inside it (the other rank idle)
            assert "two-batch overlap: split a extend batch of 1 sequences" in prefill.log_path.read_text(), \
                prefill.log_tail()


async def _misrouted_request_fails_at_once(prefill: GroupWorker, decode: GroupWorker, rng: random.Random) -> None:
    """The decode side is sent to prefill DP rank 1's own bootstrap endpoint for a room of DP rank 0
    (a misconfigured router): rank 1 refuses the handshake at once instead of waiting for a claim."""
    import grpc

    from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect
    from deepseek_pd.workers.transport.internal_auth import resolve_auth
    from deepseek_pd.workers.decode.prefill_routes import PrefillRoutes
    from pdtest.group_harness import greedy_request

    async with grpc.aio.insecure_channel(f"127.0.0.1:{prefill.bootstrap_port}") as channel:
        rank1 = await PrefillRoutes(resolve_auth(None, False), "decode@test").route(
            channel, "127.0.0.1", prefill.bootstrap_port, 1)
    assert rank1.dp_rank == 1 and rank1.port != prefill.bootstrap_port
    room = rng.randrange(2**31 - 2) // 2 * 2
    request = greedy_request(f"misrouted-{room}", [rng.randrange(3, VOCAB) for _ in range(5)], 3)
    request.disaggregated_params.bootstrap_host, request.disaggregated_params.bootstrap_port = rank1.address
    request.disaggregated_params.bootstrap_room = room
    started = time.monotonic()
    async with SchedulerClient(decode.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(client.generate(request, 60.0))
    seconds = time.monotonic() - started
    message = caught.value.details()
    assert seconds < 5.0, (seconds, message)  # the harness's handshake timeout is 10 s, the claim's 30 s
    assert f"room {room} belongs to prefill DP rank 0 of 2" in message, message
    assert "this is prefill DP rank 1" in message and "routed it to prefill DP rank 0 of 1" in message, message
