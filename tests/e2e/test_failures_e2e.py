"""Failures between real worker processes: a peer killed mid-request must end the request on the
survivor with exactly one error, within the bootstrap timeouts, with its KV pages freed.

The cluster (2 prefill, 3 decode, the real router) uses a tiny prefill chunk so a long prompt takes
seconds to prefill: long enough to kill a peer while KV is still moving. The first scenario goes
through the router; the others use our own PD dual-dispatch client so each picks a live pair.
Each scenario kills one worker, so they run in file order on the workers still alive. (The
router does not always notice a worker that dies before it ever opened a connection to it, so
later scenarios do not go through the router.)
"""
from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import pytest

from deepseek_pd.client.pd_dispatch import PDClient
from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from deepseek_pd.launcher.cluster import LocalCluster
from pdtest.e2e_cluster import cluster_spec, used_pages, wait_for_pages

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SLOW_CHUNK = 8
LONG_PROMPT = 2400
# Worker-side limits from e2e_cluster.WORKER_ARGS, plus slack for a loaded 2-core machine.
FAILURE_DEADLINE_S = 20 + 15
RETRY_BUDGET_S = 60  # the gateway's retries (~18.5 s of backoff) plus a slow re-prefill
FAILED_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = cluster_spec(tmp_path_factory.mktemp("failures"), num_prefill=2, num_decode=3,
                        extra_worker_args=(f"--chunked-prefill-size={SLOW_CHUNK}",))
    with LocalCluster(spec) as running:
        yield running


def pd_client(cluster, prefill, decode) -> PDClient:
    host = cluster.spec.host
    return PDClient(prefill.address(host), host, prefill.bootstrap_port, decode.address(host))


def live(workers):
    alive = [w for w in workers if w.process.is_alive()]
    assert alive, "an earlier scenario left no live worker of this role"
    return alive


async def wait_until(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval_s)
    return False


async def running_requests(address: str) -> int:
    async with SchedulerClient(address) as client:
        return (await client.loads()).num_running_reqs


def long_prompt() -> list[int]:
    rng = random.Random()
    return [rng.randrange(3, 400) for _ in range(LONG_PROMPT)]


def test_healthy_pair_serves_before_failures(cluster) -> None:
    async def main():
        for p, d in ((0, 0), (1, 1), (0, 2)):
            prefill, decode = cluster.prefill_workers()[p], cluster.decode_workers()[d]
            async with pd_client(cluster, prefill, decode) as client:
                result = await client.generate([5, 9, 11, 13], sampling_proto(max_new_tokens=4))
                assert result.ok, (result.prefill_error, result.decode_error)
                assert len(result.output_ids) == 4 and len(result.prefill_ids) == 1

    asyncio.run(main())


def test_bad_request_to_real_worker_is_invalid_argument(cluster) -> None:
    async def main():
        address = cluster.decode_workers()[0].address(cluster.spec.host)
        async with SchedulerClient(address) as client:
            from smg_grpc_proto import sglang_scheduler_pb2 as pb

            request = pb.GenerateRequest(request_id="bad", tokenized=pb.TokenizedInput(input_ids=[1] * 5000),
                                         sampling_params=sampling_proto(max_new_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(client.generate(request))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "5000 tokens" in info.value.details()

    asyncio.run(main())


def test_router_client_gets_one_error_or_a_retried_answer_when_decode_dies_mid_transfer(cluster) -> None:
    """No token has reached the client yet, so smg may retry on a live decode worker
    (gateway.RETRY_ARGS: the retry re-prefills the long prompt); either way the request ends in
    bounded time, whole or with one >= 500 error, and the prefill side keeps no pages."""
    from deepseek_pd.client.router_http import RouterClient, RouterError

    host = cluster.spec.host
    prefills, decodes = live(cluster.prefill_workers()), live(cluster.decode_workers())

    async def main():
        baselines = {w.process.name: await used_pages(w.address(host)) for w in prefills}
        async with RouterClient(cluster.router_url, cluster.served_model_name, timeout_s=120) as client:
            call = asyncio.create_task(client.generate(input_ids=long_prompt(), stream=True,
                                                       max_new_tokens=4, temperature=0.0))
            busy: list = []

            async def transferring() -> bool:
                running = [w for w in prefills if await running_requests(w.address(host)) > 0]
                holding = [w for w in decodes if await used_pages(w.address(host)) > 0]
                busy[:] = holding
                return bool(running and holding)
            assert await wait_until(transferring, 30), "the request never reached the transfer phase"
            busy[0].process.send_signal(signal.SIGKILL)
            killed = busy[0]
            try:
                result = await asyncio.wait_for(call, FAILURE_DEADLINE_S + RETRY_BUDGET_S)
            except RouterError as exc:
                assert exc.status >= 500, exc
            else:
                assert len(result.output_ids) == 4 and result.finish_reason is not None, result
        await asyncio.to_thread(killed.process.wait, 30)  # reaped before the next scenario (see _kill_during_transfer)
        for worker in prefills:
            pages = await wait_for_pages(worker.address(host), baselines[worker.process.name],
                                         timeout_s=FAILURE_DEADLINE_S)
            assert pages == baselines[worker.process.name], f"{worker.process.name} kept pages"
            assert await running_requests(worker.address(host)) == 0

    asyncio.run(main())


def test_decode_killed_mid_transfer_frees_prefill_room(cluster) -> None:
    host = cluster.spec.host
    prefill = live(cluster.prefill_workers())[0]
    decode = live(cluster.decode_workers())[0]

    async def main():
        baseline = await used_pages(prefill.address(host))
        result, elapsed = await _kill_during_transfer(cluster, prefill, decode, victim=decode)
        assert result.decode_error is not None and result.decode_error.code() in FAILED_CODES
        assert result.prefill_error is not None, "prefill must not report success to a dead peer"
        assert result.prefill_error.code() in FAILED_CODES, result.prefill_error
        assert elapsed < FAILURE_DEADLINE_S
        pages = await wait_for_pages(prefill.address(host), baseline, timeout_s=FAILURE_DEADLINE_S)
        assert pages == baseline, f"prefill kept {pages - baseline} pages of the failed request"
        assert await running_requests(prefill.address(host)) == 0

    asyncio.run(main())


def test_prefill_killed_after_handshake_fails_decode_and_frees_pages(cluster) -> None:
    host = cluster.spec.host
    prefill = live(cluster.prefill_workers())[-1]
    decode = live(cluster.decode_workers())[0]

    async def main():
        baseline = await used_pages(decode.address(host))
        result, elapsed = await _kill_during_transfer(cluster, prefill, decode, victim=prefill)
        assert result.prefill_error is not None
        assert result.decode_error is not None, "decode must not answer without the prompt's KV"
        assert result.decode_error.code() in FAILED_CODES, result.decode_error
        assert elapsed < FAILURE_DEADLINE_S
        pages = await wait_for_pages(decode.address(host), baseline, timeout_s=FAILURE_DEADLINE_S)
        assert pages == baseline, f"decode kept {pages - baseline} pages of the failed request"

    asyncio.run(main())


async def _kill_during_transfer(cluster, prefill, decode, victim):
    """Dispatches one long PD request, SIGKILLs `victim` once its KV is on the move, and returns the
    dual-dispatch result and how long the survivors took to answer after the kill."""
    host = cluster.spec.host
    async with pd_client(cluster, prefill, decode) as client:
        call = asyncio.create_task(client.generate(long_prompt(), sampling_proto(max_new_tokens=4), timeout_s=None))
        # Decode has its pages (handshake done) and prefill is computing: KV is on the move.
        started = await wait_until(
            lambda: _both(running_requests(prefill.address(host)), used_pages(decode.address(host))), 30)
        assert started, "the request never reached the transfer phase"
        victim.process.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        result = await asyncio.wait_for(call, FAILURE_DEADLINE_S)
        elapsed = time.monotonic() - t0
    # Reaped before the next scenario picks its workers: a SIGKILLed worker stops accepting before
    # its exit completes, and `live` (is_alive) once handed a loaded run's next scenario that worker.
    await asyncio.to_thread(victim.process.wait, 30)
    return result, elapsed


async def _both(first, second) -> bool:
    a, b = await asyncio.gather(first, second)
    return a > 0 and b > 0

