"""Randomized runs of the tiny model's runner in a real group (pdtest.lockstep_harness), two-batch
overlap on: each rank extends new prompts and decodes its own sequences from concurrent tasks, with
idle gaps, so steps mix extend, decode and idle ranks at random and the group sleeps and wakes.

Every per-forward choice that changes a rank's collectives (the TBO vote's path, the EP layout the
group's mode picks, an idle rank's empty schedule) must come out the same on every rank: the run
must not hang or fail, every rank must run as many forwards (own + idle) and take the overlapped
path as often. A fresh seed each run, in every assertion message
(DEEPSEEK_PD_LOCKSTEP_SEED=<seed> reruns one).
"""
from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from pdtest.lockstep_harness import run_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]
PAGE = 4
MAX_DECODES = 6  # decode steps per sequence before it retires (its pages are freed)
RUN_S = 3.0


async def _random_steps(rank, thread, step, report, options) -> None:
    from deepseek_pd.model.distributed.parallel import ParallelInfo
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    world = options["world"]
    runner = ModelRunner(RunnerConfig(model="tiny", device="cpu", page_size=PAGE, num_pages=512, ep_size=world,
                                      dispatcher="all_to_all", enable_tbo=True, **options["runner"]),
                         parallel=ParallelInfo(world, rank, step), step_sync=thread)
    thread._idle_forward = runner.idle  # the harness's stand-in until the runner exists
    rng = random.Random(options["seed"] * 31 + rank)
    ready: list[list] = []  # [next token, position, pages] of sequences waiting for a decode step
    report["problems"] = []

    async def forward(fn, seqs) -> bool:
        try:
            logits = await asyncio.wait_for(thread.run(fn, seqs), 10.0)
        except Exception as exc:  # noqa: BLE001 - a hang or a failed forward, reported
            report["problems"].append(f"{fn.__name__} of {len(seqs)} raised {exc!r}")
            return False
        if logits.shape[0] != len(seqs) or not bool(logits.isfinite().all()):
            report["problems"].append(f"{fn.__name__}: logits {tuple(logits.shape)} for {len(seqs)} sequences")
        return True

    async def extender(until: float) -> None:
        while time.monotonic() < until:
            prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 10))] for _ in range(rng.randint(1, 3))]
            pages = [runner.kv_pool.alloc(-(-(len(p) + MAX_DECODES) // PAGE)) for p in prompts]
            if await forward(runner.extend, [ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)]):
                ready.extend([rng.randrange(3, 256), len(p), pg] for p, pg in zip(prompts, pages))
            await asyncio.sleep(rng.choice([0.0, rng.uniform(0.0, 0.05), rng.uniform(0.1, 0.3)]))

    async def decoder(until: float) -> None:
        while time.monotonic() < until:
            batch = [ready.pop(rng.randrange(len(ready))) for _ in range(min(len(ready), rng.randint(1, 4)))]
            if batch and await forward(runner.decode, [DecodeSeq(*seq) for seq in batch]):
                for seq in batch:
                    seq[0], seq[1] = rng.randrange(3, 256), seq[1] + 1
                    if seq[1] - len(seq[2]) * PAGE < 0 and rng.random() < 0.85:
                        ready.append(seq)
                    else:
                        runner.kv_pool.free(seq[2])
            await asyncio.sleep(rng.choice([0.0, rng.uniform(0.0, 0.02), rng.uniform(0.1, 0.2)]))

    async def local_jobs(until: float) -> None:
        while time.monotonic() < until:
            await thread.run(int)  # no forward
            await asyncio.sleep(rng.uniform(0.0, 0.05))

    import torch.distributed as dist
    dist.barrier()
    start = time.monotonic()
    thread.start()
    until = start + RUN_S
    await asyncio.gather(extender(until), decoder(until), local_jobs(until))
    await asyncio.sleep(max(0.0, start + RUN_S + 1.5 - time.monotonic()))
    if rank == 0:
        await asyncio.to_thread(thread.close)
    report["stopped"] = await asyncio.to_thread(thread.group_stopped.wait, 15)
    report["tbo"] = dict(runner.model.tbo.stats)


def test_random_extend_decode_and_idle_steps_keep_the_tbo_vote_and_ep_layout_in_step() -> None:
    seed = int(os.environ.get("DEEPSEEK_PD_LOCKSTEP_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    world = 2  # the tiny model's 8 experts split over 2 or 4 ranks; 4 processes overload the CI box
    runner = {"dispatch_mode": rng.choice(["auto", "normal", "low_latency"]), "low_latency_max_tokens": 32,
              "tbo_min_decode_tokens": rng.randint(2, 4), "tbo_min_extend_tokens": rng.randint(2, 12)}
    options = {"world": world, "seed": seed, "runner": runner, "start_thread": False,
               "sleep_after_ticks": rng.choice([1, 2, 8])}
    where = f"seed {seed} (world {world}, {runner}, sleep after {options['sleep_after_ticks']} ticks)"
    reports = run_script(world, _random_steps, options, timeout_s=120)
    print(where, [(r["forwards"], r["idle_forwards"], r["sleeps"], r["tbo"]) for r in reports])
    for rank, report in enumerate(reports):
        assert report["failures"] == [] and report["problems"] == [], (where, rank, report["failures"],
                                                                      report["problems"])
        assert report["stopped"], (where, rank)
    steps = {r["forwards"] + r["idle_forwards"] for r in reports}
    assert len(steps) == 1, (where, [(r["forwards"], r["idle_forwards"]) for r in reports])
    paths = {(r["tbo"]["overlapped"], r["tbo"]["plain"]) for r in reports}
    assert len(paths) == 1, (where, [r["tbo"] for r in reports])
    assert sum(r["forwards"] for r in reports) > 0, where
