"""Real groups of `LockstepModelThread`s without a model: one spawned process per rank, gloo on
loopback, joined exactly as `serve` joins them (`rank_group.join_group`).

A "forward" is one SUM all-reduce over the step group of a vector with three slots per rank:
its tokens (zero for an idle rank), whether it extends, and how many forwards (own or idle) it has
run before this one. The forwards of all ranks pair up only if the lockstep invariant holds; the
result (every rank's tokens) is checked against what each rank contributed, and the step indices
all match iff no rank ran a forward more or fewer. Every forward of this process, in order, is
appended to `STEPS` as (group mode name, result), so the ranks' step logs can be compared.

`run_script(world, script, options)` runs `script(rank, thread, step_group, report, options)` (a
module-level async function) in every rank and returns each rank's `report` dict. With
`options["start_thread"] = False` the script starts the thread itself (after queueing jobs that
must meet in the same ticks on every rank).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import traceback
from typing import Any, Callable

import torch


STEPS: list[tuple[str, list[int]]] = []  # this process's forwards, own and idle, in order


def _step(group, world: int, rank: int, tokens: int, extend: bool, mode_name: str) -> list[int]:
    import torch.distributed as dist

    vector = torch.zeros(3 * world, dtype=torch.int64)
    vector[rank], vector[world + rank], vector[2 * world + rank] = tokens, int(extend), len(STEPS)
    dist.all_reduce(vector, group=group)
    STEPS.append((mode_name, vector.tolist()))
    return vector.tolist()


def step_job(thread, group, tokens: int, rank: int, world: int, mode_name: str = "DECODE") -> tuple[str, list[int]]:
    """The body of one forward of this rank in mode `mode_name` ("EXTEND"/"DECODE"): ticks as the
    runner's StepSync hook does, then the collective; returns the group's mode and the result."""
    from deepseek_pd.model.forward_batch import ForwardMode

    mode = ForwardMode[mode_name]
    with thread.forward(mode) as group_mode:
        return group_mode.name, _step(group, world, rank, tokens, mode is ForwardMode.EXTEND, group_mode.name)


def forward_job(thread, group, tokens: int, rank: int, world: int) -> list[int]:
    """A decode forward of `tokens`; returns the group-wide token sums per rank slot."""
    return step_job(thread, group, tokens, rank, world)[1][:world]


def idle_forward(group, world: int, rank: int):
    def run(mode, kind=None) -> None:  # the stand-in runs one network: the kind does not matter
        _step(group, world, rank, 0, False, mode.name)
    return run


def _rank_main(world: int, rank: int, port: int, script: Callable, results, options: dict) -> None:
    import faulthandler

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.dump_traceback_later(options.get("dump_stacks_after_s", 60))  # a hang shows where
    report: dict[str, Any] = {}
    try:
        from deepseek_pd.workers.group.layout import GroupLayout
        from deepseek_pd.workers.group.lockstep import LockstepModelThread
        from deepseek_pd.workers.group.rank_group import join_group

        layout = GroupLayout(dp=world, ep=world, dist_init_addr=f"127.0.0.1:{port}", collective_timeout_s=30)
        group = join_group(layout, rank, "cpu")
        failures: list[str] = []
        thread = LockstepModelThread(f"r{rank}", group.control, idle_forward(group.step, world, rank), leader=rank == 0,
                                     waker=group.waker if options.get("sleep", True) else None,
                                     on_failure=failures.append,
                                     sleep_after_ticks=options.get("sleep_after_ticks", 8))
        if options.get("start_thread", True):
            thread.start()
        asyncio.run(script(rank, thread, group.step, report, options))
        report["failures"] = failures
        report.update(ticks=thread.ticks, sleeps=thread.sleeps, forwards=thread.forwards,
                      idle_forwards=thread.idle_forwards, steps=STEPS)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        report["error"] = traceback.format_exc()
    results.put((rank, report))
    results.close()
    results.join_thread()  # the queue's feeder thread must flush before _exit
    os._exit(0)  # gloo's teardown may wait on peers that already left


def run_script(world: int, script: Callable, options: dict, timeout_s: float = 90.0) -> list[dict]:
    from deepseek_pd.ports import pick_free_ports

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = pick_free_ports(1)[0]
    procs = [context.Process(target=_rank_main, args=(world, rank, port, script, results, options))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    reports: dict[int, dict] = {}
    try:
        for _ in range(world):
            rank, report = results.get(timeout=timeout_s)
            reports[rank] = report
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    errors = {rank: r["error"] for rank, r in reports.items() if "error" in r}
    assert not errors, errors
    return [reports[rank] for rank in range(world)]
