"""How a multi-rank group ends when it is told to: SIGTERM to rank 0 (the leader pod) drains the
request in flight, which runs on every rank, then stops the group; the follower pod, never
signalled itself, leaves with the group with the defined status (GROUP_STOPPED_EXIT), not as failed.
The two pods are two `serve` processes, as the operator renders a 2-pod group."""
from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from deepseek_pd.client.scheduler_grpc import SchedulerClient
from deepseek_pd.workers.group.lockstep import GROUP_FAILED_EXIT, GROUP_STOPPED_EXIT
from pdtest.group_harness import GroupWorker, greedy_request, offline_greedy

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(240)
def test_sigterm_to_rank_zero_drains_and_the_follower_pod_exits_with_the_group(tmp_path) -> None:
    from deepseek_pd.ports import pick_free_ports

    rng = random.Random()
    prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 30))]
    max_new = rng.randint(12, 24)
    want = offline_greedy([prompt], [max_new])[0]
    init_port = pick_free_ports(1)[0]
    pods = [GroupWorker("decode", ["--dp", "2", "--ep", "2", "--nnodes", "2", "--node-rank", str(i),
                                   "--dist-init-addr", f"127.0.0.1:{init_port}", "--drain-timeout=60"],
                        tmp_path / f"pod{i}.log") for i in range(2)]
    with pods[0] as leader, pods[1] as follower:
        async def run() -> list[int]:
            await leader.wait_healthy()
            ids: list[int] = []
            async with SchedulerClient(leader.address) as client:
                async for response in client.generate(greedy_request("drained", prompt, max_new)):
                    kind = response.WhichOneof("response")
                    if kind == "chunk":
                        if not ids:  # in flight: now the leader pod is told to stop
                            os.kill(leader.proc.pid, signal.SIGTERM)
                        ids.extend(response.chunk.token_ids)
                    elif kind == "complete":
                        ids.extend(response.complete.output_ids)
            return ids

        got = asyncio.run(run())
        assert got == want, leader.log_tail()  # the drain let it finish on both ranks
        assert leader.proc.wait(60) == GROUP_STOPPED_EXIT, leader.log_tail()
        status = follower.proc.wait(60)
        assert status == GROUP_STOPPED_EXIT != GROUP_FAILED_EXIT, follower.log_tail()
        assert "the group stopped" in follower.log_path.read_text(), follower.log_tail()


@pytest.mark.timeout(240)
def test_a_killed_leader_pod_ends_a_sleeping_follower_as_failed(tmp_path) -> None:
    """The group is idle (asleep: no ticks that would notice a dead peer); SIGKILL of the leader
    pod must still end the follower pod within seconds, with GROUP_FAILED_EXIT: its wait on rank
    0's store breaks with the connection."""
    import time

    from deepseek_pd.ports import pick_free_ports

    init_port = pick_free_ports(1)[0]
    pods = [GroupWorker("decode", ["--dp", "2", "--ep", "2", "--nnodes", "2", "--node-rank", str(i),
                                   "--dist-init-addr", f"127.0.0.1:{init_port}"], tmp_path / f"pod{i}.log")
            for i in range(2)]
    with pods[0] as leader, pods[1] as follower:
        asyncio.run(leader.wait_healthy())
        time.sleep(random.uniform(1.0, 2.0))  # well past the idle ticks before the group sleeps
        os.kill(leader.proc.pid, signal.SIGKILL)
        started = time.monotonic()
        assert follower.proc.wait(60) == GROUP_FAILED_EXIT, follower.log_tail()
        assert time.monotonic() - started < 30, follower.log_tail()
