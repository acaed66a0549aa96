"""A prefill round's phases (workers/engine/round_clock.py) say where its step went.

The oracle is time put in on purpose: a round whose model thread is busy when it is handed over, whose
per-layer callback sleeps, or whose event loop is blocked when the forward returns, must show that
time in `hop_in`, `handoffs` or `hop_out` (and not in `launch`, where the forward's own host time
goes), while the phases of every round add up to its step as `on_step` measures it, with its own
timestamps. The delays are random draws of the run's seed. The tiny model on the CPU, in a real
`ModelThread`; one round per case, a few tens of milliseconds each.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest
import torch

from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine.model_thread import ModelThread
from deepseek_pd.workers.engine.prefill_round import PrefillRounds, RoundHooks
from deepseek_pd.workers.engine.round_clock import PHASES, RoundClock

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)  # as the engine harness: a 2-core machine shared by several test runs


@dataclass(eq=False)
class Prompt:
    sampling: SamplingState
    ended: bool = False
    in_flight: int = 0


class SleepyLayers(RoundHooks[Prompt]):
    """Each layer's KV notice sleeps `per_layer` s on the model thread (a slow layer-wise hand-off);
    the last one also blocks the event loop for `loop_block` s (a loop busy when the round returns)."""

    def __init__(self, per_layer: float, loop_block: float, layers: int) -> None:
        self.per_layer, self.loop_block, self.layers = per_layer, loop_block, layers
        self.calls = 0

    def layer_progress(self, plan):
        if not self.per_layer and not self.loop_block:
            return None
        loop = asyncio.get_running_loop()
        hooks = self

        class Progress:
            def kv_written(self, layer_id: int) -> None:
                hooks.calls += 1
                time.sleep(hooks.per_layer)
                if layer_id == hooks.layers - 1 and hooks.loop_block:
                    loop.call_soon_threadsafe(time.sleep, hooks.loop_block)
        return Progress()


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(RunnerConfig(model="tiny", page_size=16, num_pages=64))


def prompt(runner: ModelRunner, rng: random.Random) -> list[int]:
    return [rng.randrange(2, runner.model_config.vocab_size) for _ in range(rng.randrange(16, 96))]


def one_round(runner: ModelRunner, ids: list[int], hooks: RoundHooks, busy_thread: float = 0.0):
    """One round of the prompt `ids` through a fresh ModelThread: (its step seconds, its phases)."""
    steps, phases = [], []
    rounds = PrefillRounds(runner, Sampler(), 4096, hooks, on_step=lambda s, p, t: steps.append(s),
                           on_phases=phases.append)
    pool = runner.kv_pool
    pages = pool.alloc(pool.pages_for_tokens(len(ids)))
    owner = Prompt(SamplingState.create(SamplingParams(temperature=0.0), ids, runner.model_config.vocab_size))
    queue = [rounds.start(owner, ids, pages)]
    thread = ModelThread("clock-test")

    async def run():
        if busy_thread:  # the model thread is still busy when the round is handed to it
            asyncio.get_running_loop().run_in_executor(thread._executor, time.sleep, busy_thread)  # noqa: SLF001
        await rounds.run_in(thread, queue)
    try:
        asyncio.run(run())
    finally:
        thread.close()
        pool.free(pages)
    assert len(steps) == 1 and len(phases) == 1
    return steps[0], phases[0]


def test_the_phases_add_up_to_the_step_and_name_only_known_phases(runner):
    rng = random.Random()
    step, phases = one_round(runner, prompt(runner, rng), RoundHooks())
    assert set(phases) <= set(PHASES) and {"hop_in", "prepare", "launch", "sample", "gpu_wait", "hop_out"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values()), phases
    # on_step's own timestamps enclose the clock's: what the phases leave is two perf_counter calls.
    assert 0 <= step - sum(phases.values()) < 1e-3, (step, phases)


@pytest.mark.parametrize("where", ["hop_in", "handoffs", "hop_out"])
def test_time_put_into_a_phase_shows_there_and_not_in_the_forward(runner, where):
    rng = random.Random()
    delay = rng.uniform(0.03, 0.06)
    layers = runner.model_config.num_hidden_layers
    ids = prompt(runner, rng)
    one_round(runner, ids, RoundHooks())  # (this length's first forward: allocator, caches)
    _, plain = one_round(runner, ids, RoundHooks())
    hooks = SleepyLayers(delay / layers if where == "handoffs" else 0.0, delay if where == "hop_out" else 0.0, layers)
    step, phases = one_round(runner, ids, hooks, busy_thread=delay if where == "hop_in" else 0.0)
    assert 0 <= step - sum(phases.values()) < 1e-3, (step, phases)
    if where == "handoffs":
        assert hooks.calls == layers
        assert phases["handoffs"] >= delay * 0.99, phases
    else:
        # (the loop's block starts at the last layer's notice: the rest of the forward runs beside it)
        assert phases[where] >= delay * (0.9 if where == "hop_in" else 0.5), phases
    # The forward's own host time is not charged with the delay (a margin for the shared machine's noise).
    assert phases["prepare"] + phases["launch"] < plain["prepare"] + plain["launch"] + delay / 2, (plain, phases)


def test_a_clock_marks_contiguous_intervals_and_moves_handoffs_out_of_them():
    rng = random.Random()
    clock = RoundClock()
    handed = 0.0
    for phase in rng.sample(PHASES, rng.randrange(2, len(PHASES))):
        if phase == "handoffs":
            continue
        time.sleep(rng.uniform(0, 0.002))
        if rng.random() < 0.5:
            seconds = rng.uniform(0, 0.001)
            time.sleep(seconds)
            clock.exclude(seconds)
            handed += seconds
        clock.mark(phase)
    assert sum(clock.phases.values()) == pytest.approx(clock.total, abs=1e-9)
    assert clock.phases.get("handoffs", 0.0) == pytest.approx(handed, abs=1e-12)
    assert all(seconds >= 0 for seconds in clock.phases.values()), clock.phases
