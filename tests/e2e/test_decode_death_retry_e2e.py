"""A decode worker killed under load, behind the real gateway with retries on (gateway.RETRY_ARGS).

1 prefill + 2 decode workers, `up`'s supervisor running, a small prefill chunk so that long prompts
take seconds to prefill: when one decode worker is SIGKILLed, several requests are still waiting
for their KV, i.e. before their first token. What must hold:

- nothing hangs: every request ends within a bound;
- every request either completes with exactly the offline engine's greedy tokens, or fails with a
  clear error (an HTTP error with a message, or one well-formed JSON error event in a stream);
- unstreamed requests all complete (smg retries them on a fresh pair; nothing had been sent), and
  the gateway's retry counter shows that retries happened;
- the supervisor restarts the dead worker, the gateway takes it back, it serves again, and every
  KV pool is back to zero.
"""
from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
import urllib.request

import aiohttp
import pytest

from deepseek_pd.launcher.cluster import LocalCluster
from deepseek_pd.launcher.health import router_ready_workers
from deepseek_pd.launcher.supervisor import SupervisorConfig
from pdtest.e2e_cluster import cluster_spec, supervise, used_pages, wait_for_pages
from pdtest.gateway_oracle import offline_engine, offline_greedy_batch, post_json, post_stream

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

SLOW_CHUNK = 8
REQUESTS = 12
MAX_NEW = 6
REQUEST_DEADLINE_S = 200  # five attempts over ~15 s of backoff, each bounded by the workers' timeouts


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = cluster_spec(tmp_path_factory.mktemp("retry"), num_decode=2,
                        extra_worker_args=(f"--chunked-prefill-size={SLOW_CHUNK}",))
    with LocalCluster(spec) as running:
        stop = threading.Event()
        thread, _ = supervise(running, stop, SupervisorConfig(initial_backoff_s=0.5))
        try:
            yield running
        finally:
            stop.set()
            thread.join(5)


def retries_counted(cluster) -> float:
    """smg_worker_retries_total summed over its labels, from the gateway's Prometheus port."""
    url = f"http://{cluster.spec.host}:{cluster.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("smg_worker_retries_total"))


def test_decode_killed_mid_load_requests_complete_or_fail_cleanly(cluster) -> None:
    rng = random.Random()
    engine = offline_engine()
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(300, 500))] for _ in range(REQUESTS)]
    expected = offline_greedy_batch(engine, prompts, [MAX_NEW] * len(prompts))
    streamed = [i % 2 == 0 for i in range(REQUESTS)]
    host = cluster.spec.host
    victim = cluster.decode_workers()[rng.randrange(2)]
    old_pid = victim.process.pid

    async def one(session, prompt, stream):
        body = {"model": cluster.served_model_name, "input_ids": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}}
        call = post_stream if stream else post_json
        return await asyncio.wait_for(call(session, f"{cluster.router_url}/generate", body), REQUEST_DEADLINE_S)

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            tasks = [asyncio.create_task(one(session, p, s)) for p, s in zip(prompts, streamed)]
            deadline = time.monotonic() + 60
            while await used_pages(victim.address(host)) == 0:  # the victim holds KV of some requests
                assert time.monotonic() < deadline, "no request reached the victim decode worker"
                await asyncio.sleep(0.05)
            victim.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - killed_at

    results, elapsed = asyncio.run(main())
    hung = [i for i, r in enumerate(results) if isinstance(r, asyncio.TimeoutError)]
    assert not hung, f"requests {hung} did not end within {REQUEST_DEADLINE_S}s"
    crashed = [r for r in results if isinstance(r, BaseException)]
    assert not crashed, crashed
    completed = failed = 0
    for reply, want, stream in zip(results, expected, streamed):
        if stream and reply.status == 200:
            errors = [e["error"] for e in reply.events if e.get("error")]
            ids = [t for e in reply.events for t in e.get("output_ids") or []]
            if errors:
                assert len(errors) == 1 and str(errors[0]), reply.events  # one clear terminal error
                assert ids == want[:len(ids)], "tokens before the error must be the right ones"
                failed += 1
            else:
                assert ids == want
                completed += 1
        elif reply.status == 200:
            item = reply.body[0] if isinstance(reply.body, list) else reply.body
            assert item["output_ids"] == want
            completed += 1
        else:
            assert reply.status >= 400 and reply.error_message(), (reply.status, reply.text)
            failed += 1
    unstreamed = [r for r, s in zip(results, streamed) if not s]
    assert all(r.status == 200 for r in unstreamed), [(r.status, r.error_message()[:300]) for r in unstreamed if r.status != 200]
    assert completed + failed == REQUESTS and completed >= REQUESTS // 2, (completed, failed)
    assert retries_counted(cluster) > 0, "the kill caused no retry"
    print(f"after the kill: {completed} completed, {failed} failed, all ended {elapsed:.1f}s after it")

    # The supervisor restarts the victim; the gateway takes it back; it serves again.
    deadline = time.monotonic() + 120
    while not (victim.process.is_alive() and victim.process.pid != old_pid
               and router_ready_workers(cluster.router_url) == len(cluster.workers)):
        assert time.monotonic() < deadline, "the dead decode worker was not restarted and re-admitted"
        time.sleep(0.5)

    async def after():
        async with aiohttp.ClientSession() as session:
            replies = [await post_json(session, f"{cluster.router_url}/generate", {
                "model": cluster.served_model_name, "input_ids": p[:40],
                "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}})
                for p in prompts[:4]]
        assert all(r.status == 200 for r in replies), [r.text for r in replies]
        for worker in cluster.workers:
            assert await wait_for_pages(worker.address(host), 0, timeout_s=30) == 0, worker.process.name
    asyncio.run(after())


def test_decode_killed_after_first_tokens_ends_streams_with_one_wellformed_error(cluster) -> None:
    """Once tokens have reached the client a retry would duplicate them: smg must not retry, and
    the stream must end with exactly one error event that is valid JSON, after the right tokens."""
    import json

    rng = random.Random()
    engine = offline_engine()
    max_new = 400
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    expected = offline_greedy_batch(engine, prompts, [max_new] * len(prompts))  # 400 steps, not 2,400
    host = cluster.spec.host
    started = [asyncio.Event() for _ in prompts]

    async def one(session, index: int):
        body = {"model": cluster.served_model_name, "input_ids": prompts[index], "stream": True,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}
        ids, errors = [], []
        async with session.post(f"{cluster.router_url}/generate", json=body) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data:"):])  # a malformed event fails here
                if event.get("error"):
                    errors.append(event["error"])
                ids.extend(event.get("output_ids") or [])
                if len(ids) >= 2:
                    started[index].set()
        started[index].set()
        return ids, errors

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            tasks = [asyncio.create_task(one(session, i)) for i in range(len(prompts))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            holders = [w for w in cluster.decode_workers() if await used_pages(w.address(host)) > 0]
            assert holders, "no decode worker holds a running stream"
            victim = rng.choice(holders)
            victim.process.send_signal(signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_DEADLINE_S)

    results = asyncio.run(main())
    cut = 0
    for (ids, errors), want in zip(results, expected):
        assert ids == want[:len(ids)], "streamed tokens must be the offline engine's, never repeated"
        if errors:
            assert len(errors) == 1 and str(errors[0]), errors
            assert len(ids) < max_new
            cut += 1
        else:
            assert ids == want
    assert cut >= 1, "killing a decode worker mid-stream ended no stream"
