"""`LockstepModelThread` in real groups (one process per rank, gloo, `join_group` as `serve` uses):
an idle group sleeps instead of ticking, a job on any rank wakes every rank into one paired
forward (two ranks waking it at once included), and rank 0's close stops every rank."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from pdtest.lockstep_harness import forward_job, run_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
SLEEP_AFTER_TICKS = 8  # LockstepModelThread's default


async def _idle_work_stop(rank, thread, step, report, options) -> None:
    from deepseek_pd.workers.group.lockstep import GroupStopped

    world = options["world"]
    for phase, busy in enumerate(options["phases"]):
        await asyncio.sleep(options["idle_s"])  # the whole group idle
        report[f"ticks_idle_{phase}"] = thread.ticks
        report[f"sleeps_{phase}"] = thread.sleeps
        if rank in busy:
            started = time.monotonic()
            report[f"result_{phase}"] = await thread.run(forward_job, thread, step, busy[rank], rank, world)
            report[f"latency_{phase}"] = time.monotonic() - started
        await asyncio.sleep(options["settle_s"])
    if rank == 0:
        await asyncio.to_thread(thread.close)
    report["stopped"] = await asyncio.to_thread(thread.group_stopped.wait, 15)
    try:
        await thread.run(forward_job, thread, step, 1, rank, world)
        report["run_after_stop"] = "ran"
    except GroupStopped:
        report["run_after_stop"] = "refused"


def test_idle_group_sleeps_wakes_for_any_rank_and_stops_with_rank_zero() -> None:
    rng = random.Random()
    world = rng.choice([2, 3])
    single = {rng.randrange(world): rng.randint(1, 99)}
    pair = {rank: rng.randint(1, 99) for rank in rng.sample(range(world), 2)}
    options = {"world": world, "phases": [single, pair], "idle_s": 1.5, "settle_s": 1.0}
    reports = run_script(world, _idle_work_stop, options)
    for rank, report in enumerate(reports):
        assert report["failures"] == [], report
        # 1.5 s idle: a ticking group would tick ~75 times; a sleeping one stops after a few
        assert report["ticks_idle_0"] <= SLEEP_AFTER_TICKS + 2 and report["sleeps_0"] >= 1, report
        assert report["sleeps_1"] > report["sleeps_0"], report  # it slept again after the first job
        for phase, busy in enumerate(options["phases"]):
            if rank in busy:
                result = report[f"result_{phase}"]
                assert result[rank] == busy[rank], (phase, report)
                assert all(v in (0, busy.get(r, 0)) for r, v in enumerate(result)), (phase, report)
        assert report["stopped"] and report["run_after_stop"] == "refused", report
    # every forward of a busy rank was matched by the others (own or idle forwards)
    own = sum(r["forwards"] for r in reports)
    assert own == len(single) + len(pair)
    for report in reports:
        assert report["forwards"] + report["idle_forwards"] >= 2


async def _local_jobs_then_forward(rank, thread, step, report, options) -> None:
    """Rank 0 runs jobs of its own that run no forward (what an engine does when a request arrives
    and waits for its KV) while the group idles; then one forward on rank 0 must meet the others."""
    rng = random.Random(options["seed"] + rank)
    if rank == 0:
        deadline = time.monotonic() + options["local_jobs_s"]
        while time.monotonic() < deadline:
            await thread.run(int)  # no forward: the group's sleep decision must not hear of it
            await asyncio.sleep(rng.uniform(0.0, 0.03))
    await asyncio.sleep(options["local_jobs_s"] if rank else 0.0)
    await asyncio.sleep(options["idle_s"])
    if rank == 0:
        started = time.monotonic()
        try:
            report["result"] = await asyncio.wait_for(
                thread.run(forward_job, thread, step, options["tokens"], rank, options["world"]), options["deadline_s"])
        except asyncio.TimeoutError:
            report["result"] = "hung"
        report["latency"] = time.monotonic() - started
    await asyncio.sleep(0.5)
    if rank == 0:
        await asyncio.to_thread(thread.close)
    report["stopped"] = await asyncio.to_thread(thread.group_stopped.wait, 15)


def test_jobs_without_a_forward_on_one_rank_do_not_split_the_groups_sleep() -> None:
    """Every rank must decide to sleep at the same tick. A rank that counted its own no-forward
    jobs as activity slept later than the others, so it ticked alone into a collective that no
    peer would join (the multi-rank `up` e2e hung 60 s this way, then restarted the group)."""
    rng = random.Random()
    world = rng.choice([2, 3])
    options = {"world": world, "seed": rng.randrange(1 << 30), "local_jobs_s": 0.6, "idle_s": 1.0,
               "tokens": rng.randint(1, 99), "deadline_s": 10.0}
    reports = run_script(world, _local_jobs_then_forward, options)
    result = reports[0]["result"]
    assert result != "hung", reports
    assert result[0] == options["tokens"] and not any(result[1:]), reports
    for report in reports:
        assert report["failures"] == [] and report["stopped"], report
