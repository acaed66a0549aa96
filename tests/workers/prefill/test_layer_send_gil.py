"""While the prefill worker's model thread runs a forward, its other threads run (almost) no Python:
layer-wise KV streaming hands a round's layers to the transport in groups that hold
`layerwise_min_bytes` (a short round's, all in one: per chunk, after the forward), not one send per
layer (workers/prefill/layer_relay.py), each of which was Python on the event loop and the KV threads
that the forward waited for through the GIL.

The model is V2-Lite's layer and expert count at tiny widths (bench/prefill_host_overhead.py's `ops`
shape: 27 layers, so per-layer work weighs as in serving), both engines in this process, KV over the
gRPC byte stream (the channel that streams layers), the worker's default `layerwise_min_bytes`.
CPU time per thread (bench/thread_cpu_probe.py's accounting, what bench/prefill_thread_cpu.py
reports in `up`), not wall time: a loaded machine stretches both alike. Before the groups the
other threads ran 0.3-0.5 of the model thread's CPU during its forwards (27 sends a forward)."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.offline import Engine
from pdtest.bench_scripts import bench_module
from pdtest.pd_engine_harness import PAGE_SIZE, PDPair, worker_config

pytestmark = [pytest.mark.timeout(120)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
# The other threads' Python CPU during forwards, as a share of the model thread's: 0-5% measured with
# the groups (here one group would hold every layer, so the round goes per chunk), 30-50% with a send
# per layer.
MAX_OTHER_SHARE = 0.15


@pytest.fixture(scope="module")
def ops_checkpoint(tmp_path_factory):
    checkpoint = bench_module("random_checkpoint")
    directory = tmp_path_factory.mktemp("ops")
    shape = bench_module("prefill_host_overhead").OPS_SHAPE
    checkpoint.ensure_random_checkpoint(directory, dict(shape), device="cpu", seed=random.randrange(1 << 20))
    return directory


@pytest.fixture(scope="module")
def observed(ops_checkpoint, tmp_path_factory):
    """Seed-drawn prompts of one round each through the PD pair, the prefill forwards observed by the
    bench's probe: (prompts, the decode outcomes, the offline engine's tokens, the probe's records)."""
    rng = random.Random()
    # Long enough that the forward is many launches, short enough that a layer's KV is far below the
    # worker's send floor (as a 789-token V2-Lite prompt's is).
    chunk = 256
    runners = [ModelRunner(RunnerConfig(model=str(ops_checkpoint), page_size=PAGE_SIZE, num_pages=256))
               for _ in range(2)]
    vocab = runners[0].model_config.vocab_size
    warm, *prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(32, chunk))] for _ in range(4)]
    oracle = Engine(str(ops_checkpoint), page_size=PAGE_SIZE, chunked_prefill_size=chunk)
    expected = [oracle.generate(prompt, GREEDY).output_ids for prompt in prompts]
    base = worker_config("grpc", same_host_direct="off")
    cfg = dataclasses.replace(base, scheduler=dataclasses.replace(
        base.scheduler, chunked_prefill_size=chunk, layerwise_transfer=True))
    forwards = tmp_path_factory.mktemp("probe") / "forwards.jsonl"  # a line per forward (/proc figures)

    async def run():
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg, runners=tuple(runners)) as pair:
            await pair.run(warm, GREEDY, "warm")  # first calls: the threads start, the channel opens
            bench_module("thread_cpu_probe").probe(pair.prefill.rounds, forwards, None)
            outcomes = [await pair.run(prompt, GREEDY, f"r{i}") for i, prompt in enumerate(prompts)]
            await pair.wait_pools_clean()
            return outcomes

    outcomes = asyncio.run(run())
    return prompts, outcomes, expected, bench_module("prefill_thread_cpu").read_records(forwards)


def test_a_forward_runs_without_other_threads_python(observed):
    prompts, outcomes, expected, records = observed
    assert [decode.tokens for _, decode in outcomes] == expected, outcomes
    assert all(prefill.ok for prefill, _ in outcomes)
    shares = bench_module("prefill_thread_cpu").thread_shares(records)
    assert len(records) == len(prompts) and shares["other_python_share"] < MAX_OTHER_SHARE, (
        f"the other threads ran {shares['other_python_share']:.2f} of the model thread's CPU during "
        f"{len(records)} forwards: {shares['roles']}")


def test_the_bench_holds_each_forward_against_the_runner_at_its_tokens(observed, ops_checkpoint):
    """bench/prefill_thread_cpu.py's report of the same forwards: the model thread's figures are the
    probe's, the runner alone measured here at the shortest and longest prompt and read at each
    level's median tokens."""
    bench = bench_module("prefill_thread_cpu")
    prompts, _, _, records = observed
    batches = [[min(prompts, key=len)], [max(prompts, key=len)]]
    runs = bench.runner_alone(ops_checkpoint, "cpu", batches, repeats=1)
    assert [run["tokens"] for run in runs] == [len(batch[0]) for batch in batches]
    summary = bench.summarise(records, runs)
    tokens = sorted(len(p) for p in prompts)[1]  # the median forward (one prompt each)
    assert summary["forwards"] == len(prompts) and summary["tokens"] == tokens
    assert runs[0]["wall_s"] <= summary["runner"]["wall_s"] <= runs[1]["wall_s"] or (
        runs[1]["wall_s"] <= summary["runner"]["wall_s"] <= runs[0]["wall_s"])  # between the two, either way
    model = sorted(next(t for t in r["threads"].values() if t["role"] == "model")["cpu_s"] for r in records)
    assert summary["model_cpu_ms"] == pytest.approx(1e3 * model[1])
    text = bench.report(1, summary)
    assert text.startswith(f"c=1: {len(prompts)} forwards of {tokens} tokens")
    assert all(f"\n  {role:<22} {figures['cpu_ms']:14.2f}" in text for role, figures in summary["roles"].items())
