"""Idle cost and first-request latency of a group's lockstep thread: sleeping vs ticking.

Spawns `--world` rank processes on loopback (gloo, `rank_group.join_group` as `serve` joins them),
each with a `LockstepModelThread` but no model: a forward is one all-reduce over the step group.
For each mode (`sleep`: the idle group sleeps on the TCPStore; `tick`: no waker, the idle group
ticks every `idle_max_s`, as before) it measures, in one run:

    idle ticks/s       all-reduce ticks per second of one rank while the whole group is idle
    wake latency       a forward submitted on a random rank after `--gap` seconds of idleness,
                       until its result (every rank joined it); p50 and max over `--trials`

and prints a table with the sleep/tick ratios last. CPU only, a few seconds:

    .venv/bin/python bench/lockstep_wake.py --world 4 --trials 20
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import time


def _forward(thread, group, world: int, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from deepseek_pd.model.forward_batch import ForwardMode

    with thread.forward(ForwardMode.DECODE):
        dist.all_reduce(torch.ones(world), group=group)


async def _script(rank: int, world: int, thread, group, args, schedule: list[int]) -> dict:
    await asyncio.sleep(args.idle)
    ticks_idle = thread.ticks
    latencies = []
    for trial, busy in enumerate(schedule):
        await asyncio.sleep(args.gap)
        if rank == busy:
            started = time.perf_counter()
            await thread.run(_forward, thread, group, world, rank)
            latencies.append(time.perf_counter() - started)
    await asyncio.sleep(args.gap)
    if rank == 0:
        await asyncio.to_thread(thread.close)
    await asyncio.to_thread(thread.group_stopped.wait, 30)
    return {"idle_ticks_per_s": ticks_idle / args.idle, "latencies": latencies}


def _rank(rank: int, port: int, sleep: bool, args, schedule: list[int], out) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from deepseek_pd.workers.group.layout import GroupLayout
    from deepseek_pd.workers.group.lockstep import LockstepModelThread
    from deepseek_pd.workers.group.rank_group import join_group

    world = args.world
    group = join_group(GroupLayout(dp=world, ep=world, dist_init_addr=f"127.0.0.1:{port}"), rank, "cpu")

    def idle(mode) -> None:
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(world), group=group.step)

    thread = LockstepModelThread(f"r{rank}", group.control, idle, leader=rank == 0,
                                 waker=group.waker if sleep else None)
    thread.start()
    result = asyncio.run(_script(rank, world, thread, group.step, args, schedule))
    out.put((rank, result))
    out.close()
    out.join_thread()
    os._exit(0)


def measure(sleep: bool, args) -> dict:
    from deepseek_pd.ports import pick_free_ports

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    rng = random.Random(args.seed)
    schedule = [rng.randrange(args.world) for _ in range(args.trials)]
    port = pick_free_ports(1)[0]
    procs = [context.Process(target=_rank, args=(r, port, sleep, args, schedule, out)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=args.idle + args.trials * (args.gap + 5) + 60) for _ in procs)
    for proc in procs:
        proc.join(10)
    latencies = [x for r in results.values() for x in r["latencies"]]
    return {"idle_ticks_per_s": statistics.mean(r["idle_ticks_per_s"] for r in results.values()),
            "p50_ms": 1e3 * statistics.median(latencies), "max_ms": 1e3 * max(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of idleness for the tick rate")
    parser.add_argument("--gap", type=float, default=0.3, help="idle seconds before each timed forward")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = {mode: measure(mode == "sleep", args) for mode in ("tick", "sleep")}
    print(f"world {args.world}, {args.trials} trials, {args.gap}s idle before each")
    print(f"{'mode':<6} {'idle ticks/s':>13} {'wake p50 ms':>12} {'wake max ms':>12}")
    for mode, row in rows.items():
        print(f"{mode:<6} {row['idle_ticks_per_s']:>13.1f} {row['p50_ms']:>12.2f} {row['max_ms']:>12.2f}")
    tick, sleep = rows["tick"], rows["sleep"]
    print(f"ratio sleep/tick: idle ticks {sleep['idle_ticks_per_s'] / max(tick['idle_ticks_per_s'], 1e-9):.3f}, "
          f"wake p50 {sleep['p50_ms'] / tick['p50_ms']:.2f}, wake max {sleep['max_ms'] / tick['max_ms']:.2f}")


if __name__ == "__main__":
    main()
