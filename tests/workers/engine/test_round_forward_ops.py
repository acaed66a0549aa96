"""The prefill worker's round issues exactly its runner's extend plus the first tokens' sampling.

On the GPU the prefill worker is host-bound (session 15: its round's host time 1.6x the runner's
synced extend of the same prompt), so every torch op counts. The round's forward as the worker runs
it (`PrefillRounds.forward` with its `RoundClock` and layer-wise `LayerEvents`) is counted op by op
under a TorchDispatchMode against the oracle: `runner.extend` of the same batch, plus `run_extend`'s
own work after the forward, counted over a runner that hands back those very logits. Per-layer
callbacks, clocks and hand-offs must add no torch op (bench/prefill_host_overhead.py times them).
"""
from __future__ import annotations

import random
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepseek_pd.model.kv.layer_progress import LayerEvents
from deepseek_pd.model.runner import ExtendSeq
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine.extend_step import run_extend
from deepseek_pd.workers.engine.prefill_planner import PromptProgress
from deepseek_pd.workers.engine.prefill_round import PrefillRounds, RoundHooks
from deepseek_pd.workers.engine.round_clock import RoundClock
from pdtest.pd_engine_harness import runner


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _Owner:
    def __init__(self, sampling: SamplingState) -> None:
        self.sampling, self.ended, self.in_flight = sampling, False, 0


class _LogitsOnly:
    """What `run_extend` sees of a runner, handing back precomputed logits: its own ops alone."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def extend(self, seqs, progress=None) -> torch.Tensor:
        return self.logits


def test_the_round_adds_no_op_to_the_runners_extend() -> None:
    rng = random.Random()
    model = runner()
    pool, vocab = model.kv_pool, model.model_config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 40))] for _ in range(rng.randint(1, 3))]
    params = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([-1, 5]), max_new_tokens=1, seed=7)
    pages = [pool.alloc(pool.pages_for_tokens(len(p))) for p in prompts]
    seqs = [ExtendSeq(p, 0, page) for p, page in zip(prompts, pages)]

    def states() -> list[SamplingState]:
        return [SamplingState.create(params, p, vocab) for p in prompts]

    with torch.inference_mode():
        with _Ops() as extend:
            logits = model.extend(seqs)
        with _Ops() as after_forward:
            run_extend(_LogitsOnly(logits), Sampler(), seqs, list(range(len(prompts))), states())
        rounds = PrefillRounds(model, Sampler(), sum(map(len, prompts)), RoundHooks())
        queue = [PromptProgress(p, page, owner=_Owner(state)) for p, page, state in zip(prompts, pages, states())]
        plan = rounds.plan(queue)
        assert len(plan.finishing) == len(prompts)  # the whole batch in one round, every prompt completed
        layers: list[int] = []
        with _Ops() as round_ops:
            rounds.forward(plan, [item.owner.sampling for item in plan.items],
                           LayerEvents("cpu", lambda layer, event: layers.append(layer)), RoundClock())
    assert layers == list(range(len(model.model.layers)))
    assert round_ops.ops == extend.ops + after_forward.ops
