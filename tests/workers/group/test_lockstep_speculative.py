"""Speculative decoding in a real EP group (pdtest.lockstep_harness: one process per rank, gloo, the
experts spread over both ranks with `all_to_all`): each rank prefills its prompts as a prefill
worker does (extend, then the MTP layer over the prompt: `run_extend_with_mtp`) and decodes them
with `SpeculativeDecoder` steps (MTP draft steps, a verify extend, an MTP catch-up).

The ranks' forwards differ in kind (one drafts with the MTP layer while another verifies with the
model) and in count (each rank's drafts and requests are its own, and a rank may have none at all):
the group must agree on each step's network (step_sync.ForwardKind) and idle ranks must join the
MTP layer's all-to-alls with its idle forward. Every job has a bounded wait: a hang fails the test.
The greedy tokens must equal a single-process runner's plain decode (no speculation, no group).
"""
from __future__ import annotations

import asyncio
import pathlib
import random
import time

import pytest

from pdtest.lockstep_harness import run_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PAGE = 4
JOB_TIMEOUT_S = 30.0  # one prefill round or speculative step; far above its cost, far below a hang's


def _oracle(path: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Plain greedy decode, one process, no speculation."""
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    runner = ModelRunner(RunnerConfig(model=path, page_size=PAGE, num_pages=256))
    out = []
    for prompt, n in zip(prompts, max_new):
        pages = runner.kv_pool.alloc(-(-(len(prompt) + n) // PAGE))
        tokens = [int(runner.extend([ExtendSeq(prompt, 0, pages)]).argmax())]
        while len(tokens) < n:
            tokens.append(int(runner.decode([DecodeSeq(tokens[-1], len(prompt) + len(tokens) - 1, pages)]).argmax()))
        out.append(tokens)
    return out


async def _speculate(rank, thread, step, report, options) -> None:
    from deepseek_pd.model.distributed.parallel import ParallelInfo
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.model.speculative.decoder import SpeculativeDecoder
    from deepseek_pd.workers.engine.extend_step import run_extend_with_mtp
    from pdtest.speculative_runner import SpecRow

    world, path = options["world"], options["path"]
    runner = ModelRunner(RunnerConfig(model=path, page_size=PAGE, num_pages=256, ep_size=world,
                                      dispatcher="all_to_all", speculative_num_steps=options["steps"]),
                         parallel=ParallelInfo(world, rank, step), step_sync=thread)
    thread._idle_forward = runner.idle  # the harness's stand-in until the runner exists
    thread.start()
    rng = random.Random(options["seed"] * 31 + rank)
    count = 0 if rank in options["idle_ranks"] else rng.randint(1, 3)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 14))] for _ in range(count)]
    max_new = [rng.randint(4, 12) for _ in range(count)]  # room for drafts (draft_len caps them by it)
    rows = [SpecRow(p, n, runner.kv_pool.alloc(-(-(len(p) + n) // PAGE))) for p, n in zip(prompts, max_new)]
    decoder = SpeculativeDecoder(runner, options["steps"])
    sampler = Sampler()

    def prefill() -> None:
        states = [SamplingState.create(SamplingParams(temperature=0.0), r.prompt_ids, runner.model_config.vocab_size)
                  for r in rows]
        seqs = [ExtendSeq(r.prompt_ids, 0, r.pages) for r in rows]
        sampled, drafts = run_extend_with_mtp(runner, sampler, seqs, range(len(rows)), states,
                                              [r.prompt_ids for r in rows])
        for row, state, token, draft in zip(rows, states, sampled.token_ids, drafts):
            row.output_ids.append(token)
            row.sampling = state
            decoder.seed(row, *draft)

    async def job(fn, *args):
        try:
            return await asyncio.wait_for(thread.run(fn, *args), JOB_TIMEOUT_S)
        except asyncio.TimeoutError:
            report["hung"] = f"rank {rank}: {fn.__name__} did not finish within {JOB_TIMEOUT_S}s"
            raise

    if rows:
        await asyncio.sleep(rng.uniform(0.0, 0.2))  # the ranks' steps interleave at random
        await job(prefill)
        while not all(r.finished for r in rows):
            await job(decoder.step, rows)
    report["got"] = [r.output_ids for r in rows]
    report["want"] = _oracle(path, prompts, max_new)
    report["drafted"] = decoder.stats.drafted
    # The other ranks may still step (this rank joins them idle): rank 0 stops the group only once
    # every rank is done.
    done = pathlib.Path(options["done_dir"])
    (done / f"rank{rank}").touch()
    if rank == 0:
        deadline = time.monotonic() + 120
        while len(list(done.iterdir())) < world and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(thread.close)
    await asyncio.to_thread(thread.group_stopped.wait, 60)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> str:
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("ep-spec") / "v3", seed=random.randrange(1000), mtp_layers=1))


@pytest.mark.parametrize("idle_ranks", [(), (1,), (0,)], ids=["both-busy", "rank1-idle", "rank0-idle"])
def test_speculation_in_an_ep_group_never_hangs_and_equals_plain_greedy(mtp_checkpoint, idle_ranks,
                                                                       tmp_path) -> None:
    options = {"world": 2, "seed": random.randrange(1 << 20), "start_thread": False, "path": mtp_checkpoint,
               "steps": 3, "idle_ranks": idle_ranks, "done_dir": str(tmp_path)}
    reports = run_script(2, _speculate, options, timeout_s=200)
    for rank, report in enumerate(reports):
        assert "hung" not in report and report["failures"] == [], (options["seed"], rank, report)
        assert report["got"] == report["want"], (options["seed"], rank)
    assert sum(r["drafted"] for r in reports) > 0 or all(not r["got"] for r in reports), options["seed"]
    # the idle rank joined the busy rank's forwards, MTP layer's included, one for one
    forwards = [r["forwards"] + r["idle_forwards"] for r in reports]
    assert forwards[0] == forwards[1], (options["seed"], forwards)
