"""One step in which the ranks of a group run different modes: rank 0 extends new prompts while
rank 1 decodes, with the experts spread over both ranks (all_to_all) and two-batch overlap on.

Both ranks' jobs are queued before their threads start, so the steps pair deterministically: the
case a colocated or PD decode group meets all the time. The MoE collectives
must follow the group's mode and TBO must not split on one rank only; each rank's logits must equal
a single-process runner's (ep 1, no TBO, no group) on the same requests. A first step in which both
ranks extend two prompts checks the TBO split path itself against the same oracle.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pdtest.lockstep_harness import run_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PAGE = 4
REL_TOL = 1e-4


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


async def _mixed_modes(rank, thread, step, report, options) -> None:
    from deepseek_pd.model.distributed.parallel import ParallelInfo
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    world = options["world"]
    config = dict(model="tiny", device="cpu", page_size=PAGE, num_pages=256)
    runner = ModelRunner(RunnerConfig(**config, ep_size=world, dispatcher="all_to_all", enable_tbo=True),
                         parallel=ParallelInfo(world, rank, step), step_sync=thread)
    thread._idle_forward = runner.idle  # the harness's stand-in until the runner exists
    oracle = ModelRunner(RunnerConfig(**config))
    rng = random.Random(options["seed"] * 31 + rank)

    def seqs_for(target: ModelRunner, prompts) -> list:
        return [ExtendSeq(p, 0, target.kv_pool.alloc(-(-(len(p) + 4) // PAGE))) for p in prompts]

    first = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 12))] for _ in range(2)]
    mine, theirs = seqs_for(runner, first), seqs_for(oracle, first)

    if rank == 0:  # new prompts, extended while rank 1 decodes
        fresh = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 12))] for _ in range(2)]
        second = (runner.extend, seqs_for(runner, fresh))
        oracle_second = (oracle.extend, seqs_for(oracle, fresh))
    else:
        next_ids = [rng.randrange(3, 256) for _ in first]
        second = (runner.decode, [DecodeSeq(t, len(p), s.pages) for t, p, s in zip(next_ids, first, mine)])
        oracle_second = (oracle.decode, [DecodeSeq(t, len(p), s.pages) for t, p, s in zip(next_ids, first, theirs)])
    # Both jobs are queued before the thread starts: on every rank the first tick is job 1's forward
    # and the second job 2's, so the steps pair exactly as described above.
    jobs = [asyncio.ensure_future(thread.run(runner.extend, mine)), asyncio.ensure_future(thread.run(*second))]
    await asyncio.sleep(0.05)
    thread.start()
    got_first, got = await asyncio.gather(*jobs)
    errors = {"extend_both": _rel_err(got_first, oracle.extend(theirs))}
    want = oracle_second[0](oracle_second[1])
    errors["mixed_step"] = _rel_err(got, want)
    report["errors"] = errors
    if rank == 0:
        await asyncio.to_thread(thread.close)
    await asyncio.to_thread(thread.group_stopped.wait, 15)


def test_a_step_where_one_rank_extends_and_another_decodes_equals_single_process() -> None:
    options = {"world": 2, "seed": random.randrange(1 << 20), "start_thread": False}
    reports = run_script(2, _mixed_modes, options, timeout_s=150)
    for rank, report in enumerate(reports):
        assert report["failures"] == [], report
        for case, err in report["errors"].items():
            assert err <= REL_TOL, (options["seed"], rank, case, err)
