"""On CUDA a prefill round's clock (workers/engine/round_clock.py) puts the time the host waits for
the device in `gpu_wait`, not in the forward's `launch`, and adds no host sync of its own.

Oracle: the GPU is kept busy by a spin kernel of a measured length queued right before the round,
so the round's one wait (its tokens' copy, extend_step.py) must take about that long; and torch's
sync-debug mode counts the synchronizing ops of the round with a clock and without: the same.
"""
from __future__ import annotations

import random
import time
import warnings

import pytest
import torch

from deepseek_pd.model.runner import ExtendSeq
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine.extend_step import run_extend
from deepseek_pd.workers.engine.round_clock import RoundClock
from pdtest.pd_engine_harness import runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPIN_CYCLES = 10 ** 8  # tens of milliseconds on a current card


def _spin_seconds() -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    torch.cuda._sleep(SPIN_CYCLES)
    torch.cuda.synchronize()
    return time.perf_counter() - began


def test_the_wait_for_a_busy_gpu_is_gpu_wait_and_the_clock_adds_no_sync() -> None:
    rng = random.Random()
    model = runner(device="cuda")
    prompts = [[rng.randrange(2, model.model_config.vocab_size) for _ in range(rng.randint(3, 40))]]
    rows, params = [0], SamplingParams(temperature=0.0, max_new_tokens=1)  # (a round of one prompt, as at c=1)

    def round_once(clock: RoundClock | None, spin: bool, debug: bool) -> list[str]:
        seqs = [ExtendSeq(p, 0, model.kv_pool.alloc(model.kv_pool.pages_for_tokens(len(p)))) for p in prompts]
        states = [SamplingState.create(params, prompts[r], model.model_config.vocab_size, device="cuda") for r in rows]
        if spin:
            torch.cuda._sleep(SPIN_CYCLES)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if debug:
                    torch.cuda.set_sync_debug_mode("warn")
                run_extend(model, Sampler(), seqs, rows, states, clock=clock)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            for seq in seqs:
                model.kv_pool.free(list(seq.pages))
        return [str(w.message) for w in seen if "synchroniz" in str(w.message)]

    round_once(None, False, False)  # kernels loaded, allocators warm
    spin = _spin_seconds()
    clock = RoundClock()
    round_once(clock, True, False)
    phases = clock.phases
    assert phases["gpu_wait"] >= 0.5 * spin, (spin, phases)
    assert phases.get("prepare", 0.0) + phases["launch"] < 0.5 * spin, (spin, phases)
    assert round_once(RoundClock(), False, True) == round_once(None, False, True)
