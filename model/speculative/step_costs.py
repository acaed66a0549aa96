"""The start-up cost model of the adaptive draft count (model/speculative/policy.py): one
speculative step timed at each batch size and draft count, and the policy built from it.

    policy = calibrated_policy(runner, max_steps=3, max_batch=32)    # batches 1, 2, 4, .., 32
    k = policy.steps_for(len(rows))
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.speculative.policy import SpeculationPolicy, StepCosts


def calibrated_policy(runner: ModelRunner, max_steps: int, max_batch: int, context: int = 256,
                      repeats: int = 3) -> SpeculationPolicy:
    """A policy over step costs measured at batch 1, 2, 4, .. `max_batch` (as many as the pool's
    free pages hold at `context` tokens a sequence; batch 1 at least, over a shorter context where
    the pool holds less), k = 0..`max_steps`."""
    pool = runner.kv_pool
    context = min(context, pool.num_free_pages * pool.page_size - max_steps - 1)
    if context < 1:
        raise UserError(f"the KV pool ({pool.num_free_pages} free pages of {pool.page_size} tokens) cannot hold "
                        f"one speculative step of {max_steps} drafts to time")
    per_seq = pool.pages_for_tokens(context + max_steps + 1)
    batches, b = [], 1
    while b <= max_batch and b * per_seq <= pool.num_free_pages:
        batches.append(b)
        b *= 2
    return SpeculationPolicy(measure_step_costs(runner, batches or [1], max_steps, context, repeats), max_steps)


def measure_step_costs(runner: ModelRunner, batches: Sequence[int], max_steps: int, context: int,
                       repeats: int = 3) -> StepCosts:
    """Median milliseconds of one speculative step (k - 1 MTP decode steps, a verify of k + 1 tokens
    per sequence, an MTP catch-up of k + 1 tokens: its largest) for k = 0..max_steps at each batch
    size, over `context` cached tokens of scratch pages (whatever they hold: costs do not depend
    on it). The table `speculation_policy.SpeculationPolicy` chooses from.

    Every position gets its own token, drawn from a fixed seed: with one token everywhere every row
    routes to the same experts, so the MoE read k + 1 experts' weights whatever the batch and the
    table under-counted the cost of larger verifies (on an H100, V2-Lite, 2026-12-07, a k = 2 step at
    batch 32 timed below a plain decode step of random tokens)."""
    pool, device = runner.kv_pool, runner.model.embed_tokens.weight.device
    hidden_size, dtype = runner.model_config.hidden_size, runner.model.embed_tokens.weight.dtype

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    table = [[0.0] * len(batches) for _ in range(max_steps + 1)]
    rng = random.Random(0)
    for col, batch in enumerate(batches):
        pages = [pool.alloc(pool.pages_for_tokens(context + max_steps + 1)) for _ in range(batch)]
        tokens = [[rng.randrange(runner.model_config.vocab_size) for _ in range(max_steps + 1)] for _ in pages]
        try:
            h = torch.zeros(batch, hidden_size, dtype=dtype, device=device)
            for k in range(max_steps + 1):
                def one_step() -> None:
                    for j in range(1, k):
                        runner.logits(runner.draft([ExtendSeq([ids[j]], context + j - 1, p)
                                                    for ids, p in zip(tokens, pages)], h))
                    verify = [ExtendSeq(ids[:k + 1], context, p) for ids, p in zip(tokens, pages)]
                    states = runner.extend_hidden(verify, force_mla=True)
                    runner.logits(states)
                    runner.logits(runner.draft(verify, states))
                one_step()  # warm-up
                sync()
                times = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    one_step()
                    sync()
                    times.append((time.perf_counter() - began) * 1e3)
                table[k][col] = max(statistics.median(times), 1e-6)
        finally:
            for p in pages:
                pool.free(p)
    return StepCosts(tuple(batches), tuple(tuple(row) for row in table))
