"""A randomized stress test of `LockstepModelThread` in a real group (one process per rank, gloo):
every rank, from several asyncio tasks at once, runs forwards (EXTEND or DECODE, random tokens),
jobs that run no forward, idle gaps long enough for the group to sleep or just around the
threshold, and near-simultaneous wakes from several ranks; rank 0 closes the group after all that
or (every other run) in the middle of it, when the jobs that come later must be refused.

The oracle is the ranks themselves: a forward's all-reduce carries every rank's tokens, extend
flag and step index (pdtest.lockstep_harness), so every rank's log of forwards (own and idle) must
be the same list, each own forward's tokens must come back in its step, and the group's mode must
be EXTEND exactly when some rank extended in that step. A fresh seed each run; it is in every
assertion message (rerun one with DEEPSEEK_PD_LOCKSTEP_SEED=<seed>).
"""
from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from deepseek_pd.workers.group.lockstep import GroupStopped
from pdtest.lockstep_harness import run_script, step_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
FORWARD_DEADLINE_S = 8.0  # far above a forward's ms, far below the collective timeout (30 s)
SCHEDULE_S = 4.0  # the random part of a run; the rest is process start-up and the close


def _sleep_threshold_s(sleep_after_ticks: int) -> float:
    """About how long a group idles before it sleeps: the idle ticks' backoff, 1 ms doubling up to
    `idle_max_s` (20 ms), over `sleep_after_ticks` ticks (8 ticks: ~90 ms)."""
    return sum(min(0.001 * 2 ** tick, 0.02) for tick in range(sleep_after_ticks))


def _phases(rng: random.Random, world: int, threshold_s: float) -> list[dict]:
    """The group-wide schedule (same on every rank): start offsets and what each phase does."""
    phases, at = [], 0.0
    while at < SCHEDULE_S:
        kind = rng.choice(["chaos", "chaos", "quiet", "quiet", "burst"])
        if kind == "quiet":  # long enough to sleep, or around the threshold
            length = rng.choice([rng.uniform(0.1, 0.3), rng.uniform(0.5, 1.5) * threshold_s])
            phase = {"local_jobs": rng.sample(range(world), rng.randint(0, world))}
        elif kind == "burst":  # several ranks wake the (likely sleeping) group at once
            length = rng.uniform(0.02, 0.1)
            phase = {"ranks": {r: rng.choice(["EXTEND", "DECODE"]) for r in rng.sample(range(world),
                                                                                     rng.randint(2, world))}}
        else:
            length = rng.uniform(0.2, 0.6)
            phase = {"tasks": rng.randint(1, 4)}
        phases.append(dict(phase, kind=kind, at=at, length=length))
        at += length
    return phases


class _Rank:
    """One rank's side of a run: launches its jobs and records what came back."""

    def __init__(self, rank: int, thread, step, report: dict, options: dict) -> None:
        self.rank, self.thread, self.step, self.world = rank, thread, step, options["world"]
        self.rng = random.Random(options["seed"] * 7919 + rank)
        self.threshold_s = _sleep_threshold_s(options["sleep_after_ticks"])
        self.report = report
        report.update(forwards_sent=[], problems=[], refused=0)

    async def refused(self, what: str) -> None:
        """A job refused with GroupStopped: right only once rank 0 has stopped the group."""
        if await asyncio.to_thread(self.thread.group_stopped.wait, 5):
            self.report["refused"] += 1
        else:
            self.report["problems"].append(f"{what} refused, but the group has not stopped")

    async def forward(self, mode: str) -> None:
        tokens = self.rng.randint(1, 99)
        try:
            group_mode, result = await asyncio.wait_for(
                self.thread.run(step_job, self.thread, self.step, tokens, self.rank, self.world, mode),
                FORWARD_DEADLINE_S)
        except asyncio.TimeoutError:
            self.report["problems"].append(f"a {mode} forward of {tokens} tokens hung")
            return
        except GroupStopped:
            await self.refused(f"a {mode} forward")
            return
        except Exception as exc:  # noqa: BLE001 - reported
            self.report["problems"].append(f"a {mode} forward raised {exc!r}")
            return
        self.report["forwards_sent"].append(result)
        extend_flags = result[self.world:2 * self.world]
        if result[self.rank] != tokens or extend_flags[self.rank] != (mode == "EXTEND"):
            self.report["problems"].append(f"own forward {mode}/{tokens} came back as {result}")
        if (group_mode == "EXTEND") != any(extend_flags):
            self.report["problems"].append(f"group mode {group_mode} for extend flags {extend_flags}")

    async def no_forward(self) -> None:
        job = (int,) if self.rng.random() < 0.5 else (time.sleep, self.rng.uniform(0.0005, 0.005))
        try:
            await self.thread.run(*job)
        except GroupStopped:
            await self.refused("a job without a forward")

    def going(self, until: float) -> bool:
        return time.monotonic() < until and not self.thread.group_stopped.is_set()

    async def chaos(self, until: float) -> None:
        """Random jobs and gaps from one task until `until` (monotonic)."""
        while self.going(until):
            action = self.rng.random()
            if action < 0.4:
                await self.forward(self.rng.choice(["EXTEND", "DECODE"]))
            elif action < 0.7:
                await self.no_forward()
            elif action < 0.9:
                await asyncio.sleep(self.rng.uniform(0.0, 0.02))
            else:
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.threshold_s)

    async def local_jobs(self, until: float) -> None:
        """Jobs that run no forward while the group idles (they must not split its sleep)."""
        while self.going(until):
            await self.no_forward()
            await asyncio.sleep(self.rng.uniform(0.0, 0.03))


async def _stress(rank, thread, step, report, options) -> None:
    import torch.distributed as dist

    me = _Rank(rank, thread, step, report, options)
    dist.barrier()  # the default group: every rank starts its schedule within a few ms
    base = time.monotonic()
    thread.start()
    tasks = []
    if rank == 0 and options["close_at"] is not None:  # the group stops in the middle of it all
        tasks.append(asyncio.create_task(_close_at(thread, base + options["close_at"])))
    for phase in options["phases"]:
        start, end = base + phase["at"], base + phase["at"] + phase["length"]
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        if phase["kind"] == "chaos":
            tasks += [asyncio.create_task(me.chaos(end)) for _ in range(phase["tasks"])]
        elif phase["kind"] == "quiet" and rank in phase["local_jobs"]:
            tasks.append(asyncio.create_task(me.local_jobs(end)))
        elif phase["kind"] == "burst" and rank in phase["ranks"]:
            tasks.append(asyncio.create_task(me.forward(phase["ranks"][rank])))
    await asyncio.gather(*tasks)
    await asyncio.sleep(max(0.0, base + SCHEDULE_S + options["settle_s"] - time.monotonic()))
    if rank == 0:
        await asyncio.to_thread(thread.close)
    report["stopped"] = await asyncio.to_thread(thread.group_stopped.wait, 15)


async def _close_at(thread, when: float) -> None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    await asyncio.to_thread(thread.close)


def _seed() -> int:
    return int(os.environ.get("DEEPSEEK_PD_LOCKSTEP_SEED") or random.randrange(1 << 30))


def test_random_jobs_gaps_and_wakes_keep_every_ranks_forwards_in_step() -> None:
    seed = _seed()
    rng = random.Random(seed)
    world = rng.choice([2, 3])
    # A short sleep threshold makes the group decide to sleep (and race the wakes) far more often.
    sleep_after_ticks = rng.choice([1, 2, 8])
    phases = _phases(rng, world, _sleep_threshold_s(sleep_after_ticks))
    close_at = rng.choice([None, rng.uniform(0.3, SCHEDULE_S)])  # None: after the schedule and a settle
    options = {"world": world, "seed": seed, "phases": phases, "settle_s": 1.5, "start_thread": False,
               "sleep_after_ticks": sleep_after_ticks, "close_at": close_at}
    where = f"seed {seed} (world {world}, sleep after {sleep_after_ticks} ticks, close at {close_at})"
    reports = run_script(world, _stress, options, timeout_s=60)
    print(where, {key: [report[key] for report in reports]
                  for key in ("forwards", "idle_forwards", "sleeps", "refused")})
    for rank, report in enumerate(reports):
        assert report["failures"] == [] and report["problems"] == [], (where, rank, report["failures"],
                                                                      report["problems"])
        assert report["stopped"], (where, rank)
    logs = [report["steps"] for report in reports]
    for rank, log in enumerate(logs[1:], 1):
        first_diff = next((i for i, (a, b) in enumerate(zip(logs[0], log)) if a != b), min(len(logs[0]), len(log)))
        assert log == logs[0], (where, f"rank {rank}'s forwards differ from rank 0's at step {first_diff} "
                                       f"of {len(logs[0])}/{len(log)}", logs[0][first_diff:first_diff + 3],
                                log[first_diff:first_diff + 3])
    for index, (mode, result) in enumerate(logs[0]):
        assert result[2 * world:] == [index] * world, (where, index, result)  # every rank's step index
        assert (mode == "EXTEND") == any(result[world:2 * world]), (where, index, mode, result)
    sent = sum(len(report["forwards_sent"]) for report in reports)
    assert sent == sum(report["forwards"] for report in reports), where
    for report in reports:
        assert report["forwards"] + report["idle_forwards"] == len(logs[0]), where
    if close_at is None:
        assert sum(report["refused"] for report in reports) == 0, where
        assert sum(report["sleeps"] for report in reports) > 0, where  # the quiet phases did put it to sleep
