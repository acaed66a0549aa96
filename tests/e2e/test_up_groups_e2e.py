"""`up` with multi-rank workers behind the real gateway (smg): one cluster for the whole module.

1 prefill group (2 ranks: dp 2, ep 2) and 2 decode groups (2 ranks each: dp 2, ep 2, two-batch
overlap), gloo on CPU, `up`'s supervisor running. What must hold:

- greedy tokens through the gateway equal the single-process offline engine's (no EP, no TBO) for
  chunked prompts, for prompts sharing a prefix (cache hits on the prefill ranks), and for 64
  concurrent requests; every rank of every group did work (its own metrics port), decode's TBO
  path ran, and every KV pool is back to zero;
- last: SIGKILL of one follower rank of a decode group takes that whole group down within
  seconds, leaving no process of it behind; the gateway's health checks take it out of rotation;
  requests keep completing correctly meanwhile (the other decode group serves; the gateway
  retries what the dead group dropped); the untouched
  groups are never restarted; the gang restarts as one and serves PD on both its DP ranks again.

A second decode group is what lets the failure test show "the others keep serving"; the parity
tests run over both. CPU: six rank processes on the tiny model, one thread each.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
import urllib.request

import pytest

from deepseek_pd.client.pd_dispatch import PDClient
from deepseek_pd.client.router_http import RouterClient
from deepseek_pd.client.scheduler_grpc import sampling_proto
from deepseek_pd.launcher.cluster import LocalCluster
from deepseek_pd.launcher.health import router_ready_workers, worker_is_healthy
from deepseek_pd.launcher.supervisor import SupervisorConfig
from deepseek_pd.launcher.worker_plan import GroupShape
from pdtest.e2e_cluster import CHUNKED_PREFILL_SIZE, PAGE_SIZE, cluster_spec, supervise, wait_for_pages
from pdtest.gateway_oracle import offline_engine, offline_greedy_batch
from pdtest.process_tree import alive, descendants, group_rank_pids, wait_gone

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.usefixtures("cluster_logs_on_failure")]

PREFILL = GroupShape(ranks=2, dp=2, ep=2)
DECODE = GroupShape(ranks=2, dp=2, ep=2, enable_tbo=True)
GROUP_DOWN_S = 30  # a failed rank -> its whole group gone (seen: ~6 s; STOP_GRACE_S is 10)
REQUEST_DEADLINE_S = 200  # the gateway's retries over its backoff, each bounded by the workers' timeouts


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    """(the running cluster, its supervisor), started once for the module."""
    spec = cluster_spec(tmp_path_factory.mktemp("groups"), num_decode=2, prefill_group=PREFILL,
                        decode_group=DECODE, startup_timeout_s=300)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # six ranks on a couple of cores: one thread each
        with LocalCluster(spec) as running:
            stop = threading.Event()
            thread, supervisor = supervise(running, stop, SupervisorConfig(initial_backoff_s=0.5))
            try:
                yield running, supervisor
            finally:
                stop.set()
                thread.join(5)


@pytest.fixture(scope="module")
def cluster(supervised) -> LocalCluster:
    return supervised[0]


@pytest.fixture(scope="module")
def engine():
    return offline_engine()


def tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


async def generate_all(cluster, jobs) -> list:
    """(prompt, max_new, stream) jobs, all at once, greedy, through the gateway."""
    async with RouterClient(cluster.router_url, cluster.served_model_name, timeout_s=REQUEST_DEADLINE_S) as client:
        return await asyncio.gather(*(client.generate(input_ids=p, stream=s, max_new_tokens=n, temperature=0.0,
                                                      ignore_eos=True) for p, n, s in jobs))


def assert_pools_empty(cluster) -> None:
    async def check():
        for worker in cluster.workers:  # rank 0 reports its group's sum (followers polled each second)
            pages = await wait_for_pages(worker.address(cluster.spec.host), 0, timeout_s=30)
            assert pages == 0, f"{worker.process.name} still holds {pages} KV pages"
    asyncio.run(check())


def test_chunked_prompts_equal_the_offline_engine(cluster, engine) -> None:
    rng = random.Random()
    jobs = [(tokens(rng, engine.vocab_size, CHUNKED_PREFILL_SIZE * rng.randint(1, 3) + rng.randint(1, 9)),
             rng.randint(3, 8), stream) for stream in (False, True) for _ in range(3)]
    want = offline_greedy_batch(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])
    got = asyncio.run(generate_all(cluster, jobs))
    assert [r.output_ids for r in got] == want
    assert all(r.prompt_tokens == len(p) for r, (p, _, _) in zip(got, jobs))


def test_shared_prefixes_hit_the_prefill_ranks_caches(cluster, engine) -> None:
    """Each prefill DP rank has its own radix cache and a request runs on rank `room % dp`, so
    the first request to reach each rank misses; every later one (sent after) hits."""
    rng = random.Random()
    prefix = tokens(rng, engine.vocab_size, CHUNKED_PREFILL_SIZE + rng.randint(4, 12))
    jobs = [(prefix + tokens(rng, engine.vocab_size, rng.randint(1, 9)), rng.randint(3, 6), i % 2 == 1)
            for i in range(6)]
    want = offline_greedy_batch(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])
    got = [asyncio.run(generate_all(cluster, [job]))[0] for job in jobs]  # one after another
    assert [r.output_ids for r in got] == want
    cacheable = len(prefix) // PAGE_SIZE * PAGE_SIZE
    hits = [r.cached_tokens for r in got]
    assert sum(h >= cacheable for h in hits) >= len(jobs) - PREFILL.dp, hits
    assert all(h < len(p) for h, (p, _, _) in zip(hits, jobs)), hits


def rank_step_tokens(cluster, worker, rank: int) -> float:
    """deepseek_pd:step_tokens (all modes) from one rank's own exporter."""
    with urllib.request.urlopen(worker.metrics_url(cluster.spec.host, rank), timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("deepseek_pd:step_tokens_total"))


def test_64_concurrent_requests_on_every_rank_then_pools_empty(cluster, engine) -> None:
    rng = random.Random()
    jobs = [(tokens(rng, engine.vocab_size, rng.randint(2, 48)), rng.randint(2, 8), rng.random() < 0.5)
            for _ in range(64)]
    want = offline_greedy_batch(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])
    got = asyncio.run(generate_all(cluster, jobs))
    wrong = [i for i, (r, w) in enumerate(zip(got, want)) if r.output_ids != w]
    assert not wrong, f"{len(wrong)} of 64 differ from the offline engine, e.g. job {wrong[0]}"
    for worker in cluster.workers:
        for rank in range(worker.ranks):
            assert rank_step_tokens(cluster, worker, rank) > 0, f"{worker.process.name} rank {rank} never ran"
    for worker in cluster.decode_workers():
        assert "two-batch overlap: split" in worker.process.log_path.read_text(errors="replace"), worker.process.name
    assert_pools_empty(cluster)


def test_a_killed_rank_restarts_its_whole_group_while_the_others_serve(supervised, engine) -> None:
    cluster, supervisor = supervised
    rng = random.Random()
    host = cluster.spec.host
    victim = rng.choice(cluster.decode_workers())
    untouched = {w.process.name: w.process.pid for w in cluster.workers if w is not victim}
    leader = victim.process.pid
    ranks = group_rank_pids(victim.process.log_path)
    tree = descendants(leader) | {leader}
    assert set(ranks.values()) <= tree and len(ranks) == DECODE.ranks
    jobs = [(tokens(rng, engine.vocab_size, rng.randint(2, 40)), rng.randint(2, 6), False) for _ in range(24)]
    want = offline_greedy_batch(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])

    async def traffic(killed: asyncio.Event) -> tuple[list, int]:
        """Requests in waves of 4 from before the kill; how many of them completed while the victim
        was down (so another group served them), each judged as it completes: a wave also holds
        requests the gateway retries until the victim is back, so judging whole waves at their end
        could count none on a slow machine."""
        results, during_outage = [], 0
        async with RouterClient(cluster.router_url, cluster.served_model_name, timeout_s=REQUEST_DEADLINE_S) as client:
            async def one(prompt: list[int], n: int):
                nonlocal during_outage
                result = await client.generate(input_ids=prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True)
                if killed.is_set() and not await asyncio.to_thread(worker_is_healthy, victim.address(host)):
                    during_outage += 1
                return result

            for wave in range(0, len(jobs), 4):
                results += await asyncio.gather(*(one(p, n) for p, n, _ in jobs[wave:wave + 4]))
                if wave == 0:
                    killed.set()
        return results, during_outage

    async def main():
        killed = asyncio.Event()
        load = asyncio.create_task(traffic(killed))
        await killed.wait()
        victim_rank = rng.randrange(1, DECODE.ranks)
        os.kill(ranks[victim_rank], signal.SIGKILL)
        started = time.monotonic()
        left = await asyncio.to_thread(wait_gone, tree, GROUP_DOWN_S)
        down_after = time.monotonic() - started
        taken_out = False  # the gateway's health checks take the dead group out of rotation
        while not taken_out and time.monotonic() < started + GROUP_DOWN_S:
            healthy = await asyncio.to_thread(router_ready_workers, cluster.router_url)
            taken_out = 0 < healthy < len(cluster.workers)
            await asyncio.sleep(0.25)
        results, during_outage = await asyncio.wait_for(load, REQUEST_DEADLINE_S * 2)
        return left, down_after, taken_out, results, during_outage

    left, down_after, taken_out, results, during_outage = asyncio.run(main())
    assert not left, f"processes of the failed group still alive {GROUP_DOWN_S}s after the kill: {left}"
    print(f"group down {down_after:.1f}s after the kill; {during_outage} requests served during the outage")
    assert [r.output_ids for r in results] == want
    assert during_outage > 0, "no request completed while the victim group was down"
    assert taken_out, f"the gateway did not take the dead group out of rotation within {GROUP_DOWN_S}s"

    # The gang comes back as a whole (one restart of its `serve`, new ranks); nothing else restarted.
    deadline = time.monotonic() + 240
    while not (victim.process.is_alive() and victim.process.pid != leader
               and router_ready_workers(cluster.router_url) == len(cluster.workers)):
        assert time.monotonic() < deadline, f"the group was not restarted and re-admitted:\n{victim.process.log_tail()}"
        time.sleep(0.5)
    assert {w.process.name: w.process.pid for w in cluster.workers if w is not victim} == untouched
    assert supervisor.restart_counts[victim.process.name] == 1
    new_ranks = group_rank_pids(victim.process.log_path)
    assert len(new_ranks) == DECODE.ranks and not set(new_ranks.values()) & set(ranks.values())

    # The restarted group runs PD on both of its DP ranks (room % dp), with the right tokens.
    prefill = cluster.prefill_workers()[0]
    prompts = [tokens(rng, engine.vocab_size, rng.randint(2, 40)) for _ in range(4)]
    expected = offline_greedy_batch(engine, prompts, [5] * len(prompts))

    async def direct():
        async with PDClient(prefill.address(host), host, prefill.bootstrap_port, victim.address(host)) as client:
            return await asyncio.gather(*(client.generate(p, sampling_proto(max_new_tokens=5, temperature=0.0,
                                                                            ignore_eos=True),
                                                          room=2 * rng.randrange(2**29) + i % 2)
                                          for i, p in enumerate(prompts)))
    direct_results = asyncio.run(direct())
    assert all(r.ok for r in direct_results), [(r.prefill_error, r.decode_error) for r in direct_results]
    assert [r.output_ids for r in direct_results] == expected
    assert_pools_empty(cluster)
    assert not alive(tree)
