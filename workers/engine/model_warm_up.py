"""Before a worker serves: its model thread runs the extend kernels its first requests would load.

Why. The first launch of a kernel in a process loads its module (CUDA's lazy loading), and a
module load may synchronise the whole context: it waits for every kernel queued so far, another
thread's copies included. On an H100 the first forward with a cached prefix was the first to run
some kernels (tests/workers/prefill/test_chunk_send_order_cuda.py). A decode worker's CUDA graph
capture (model/cuda_graph.py) has run its decode kernels before it serves; the extends that every
prefill round runs (and a decode worker's colocated rounds) had nothing alike.

`warm_up` runs, on scratch pages, the extends a prefill round runs, through the role's own
`PrefillRounds.forward` (so with the MTP pass where the runner has the layer): two fresh prompts,
then the same two with their cached prefix (MLA over the cache), then, where the pool has room, a
prefix past the policy's threshold (MHA over prefix chunks), and over that prompt's cached prefix
(MLA, below the threshold) one-token extends over 1, 2, 4, ... tokens of it and extends of 1, 2,
4, ... tokens up to the chunk over the longest; then fresh prompts of 1, 2, 4, ... tokens up to
the round's chunk. Why the ladders: a kernel's integer arguments that follow the batch are
unspecialised (model/kernels/__init__.py), but some compile-time tile sizes follow it in a few
classes (the MoE sort's pair block and tiles by token count, the MLA decode split count's power of
two by length); a doubling meets every such class of a quantity proportional to the size
(tests/model/kernels/test_kernel_specialisation.py's GPU test checks that a warmed engine compiles
nothing more). Each samples its first tokens, one row greedy and one
seeded with truncation and penalties, so the sampling kernels load too; seeded draws come from
their own keys, so no serving request's draw changes. The pages go back to the pool in the order
they left it: the pool's free list is as it was.

The rule (`wants_warm_up`), the same for both roles: on CUDA (the CPU has no lazy kernel loads),
not as one rank of a group, whose every forward the other ranks must join
(model/distributed/step_sync.py, tp_replay.py), and not while the runner counts tokens per expert
(the scratch tokens would join the counts EPLB plans from).
"""
from __future__ import annotations

import logging
import time

import torch

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import SamplingState
from deepseek_pd.workers.engine.prefill_planner import ExtendPlan, PromptProgress
from deepseek_pd.workers.engine.prefill_round import PrefillRounds

log = logging.getLogger(__name__)

_PARAMS = (SamplingParams(temperature=0.0, max_new_tokens=1),
           SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.01, seed=0, repetition_penalty=1.1,
                          max_new_tokens=1))


def wants_warm_up(runner: ModelRunner) -> bool:
    """Whether a worker warms this runner's model up before serving (module docstring)."""
    return (torch.device(runner.model.options.device).type == "cuda"
            and runner.step_sync is None and runner.tp_replay is None and runner.expert_load is None)


def warm_up(rounds: PrefillRounds) -> int:
    """Runs the scratch extends (module docstring) through `rounds` in the calling thread, the model
    thread; returns how many forwards ran (0: the pool had no room). Leaves the pool's pages as it
    found them."""
    runner = rounds.runner
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    began = time.perf_counter()
    cached = 2 * pool.page_size + 1  # past two pages, so the prefix ends inside a page
    # Each step: (prompt, prefix, new tokens) per row; prompt i is `_tokens(lengths[i], .., i)`.
    lengths = [cached + pool.page_size, cached + 5]
    steps = [[(0, 0, cached), (1, 0, cached + 3)], [(0, cached, pool.page_size), (1, cached + 3, 2)]]
    need = sum(pool.pages_for_tokens(n) for n in lengths)
    threshold = runner.policy.chunked_kv_threshold
    for long in (threshold + rounds.chunk_budget, threshold + 1):  # room for the MLA ladder's longest row?
        if need + pool.pages_for_tokens(long) <= pool.num_free_pages:
            lengths.append(long)
            steps += [[(2, 0, threshold)], [(2, threshold, 1)]]
            # Over prompt 2's cached prefix (MLA, below the threshold): one token over prefixes of
            # 1, 2, 4, ... tokens, then 1, 2, 4, ... tokens over the longest.
            steps += [[(2, prefix, 1)] for prefix in _ladder(threshold - 1)]
            steps += [[(2, threshold - 1, n)] for n in _ladder(long - threshold + 1)]
            need += pool.pages_for_tokens(long)
            break
    if need > pool.num_free_pages:
        log.info("model warm-up skipped: %d pages needed, %d free", need, pool.num_free_pages)
        return 0
    ladder = _ladder(min(rounds.chunk_budget, pool.page_size * (pool.num_free_pages - need)))
    if ladder:
        lengths.append(ladder[-1])
        steps += [[(len(lengths) - 1, 0, n)] for n in ladder]
        need += pool.pages_for_tokens(ladder[-1])
    prompts = [_tokens(n, vocab, i) for i, n in enumerate(lengths)]
    taken = pool.alloc(need)
    try:
        pages, start = [], 0
        for n in lengths:
            pages.append(taken[start:start + pool.pages_for_tokens(n)])
            start += len(pages[-1])
        for step in steps:
            # Each row ends its (scratch) prompt here, so the round samples its first token.
            plan: ExtendPlan = ExtendPlan([PromptProgress(prompts[i][:p + n], pages[i], p) for i, p, n in step],
                                          [ExtendSeq(prompts[i][p:p + n], p, pages[i]) for i, p, n in step])
            states = [SamplingState.create(_PARAMS[row % len(_PARAMS)], plan.items[row].token_ids, vocab,
                                           device=runner.model.options.device) for row in plan.finishing]
            rounds.forward(plan, states)
        if torch.device(runner.model.options.device).type == "cuda":
            torch.cuda.current_stream().synchronize()
    finally:
        pool.free(taken[::-1])  # alloc popped them off the free list's end: back as they were
    log.info("model warm-up: %d extends in %.2f s", len(steps), time.perf_counter() - began)
    return len(steps)


def _ladder(top: int) -> list[int]:
    """1, 2, 4, ... up to `top`, and `top`: a round's size classes (module docstring)."""
    sizes = [1 << i for i in range(max(0, top).bit_length()) if 1 << i < top]
    return sizes + [top] if top >= 1 else []


def _tokens(n: int, vocab: int, salt: int) -> list[int]:
    """`n` fixed token ids (no draw: the run's seeded draws stay as they were), none of them 0 or 1."""
    return [2 + (salt * 7919 + 31 * i) % (vocab - 2) for i in range(n)]
