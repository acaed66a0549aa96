"""Where a runner has verify CUDA graphs, every speculative step offers them one shape: rows that
draft fewer than the step's most (near their budgets, at different steps in a batch) are padded to
the step's verify length, their positions past their own pages pointed at the graphs' scratch page.
Before, such a step ran its verify and catch-up eagerly (the trained-MTP bench's batch 8 and 32 on
an H100 paid 1.8x a step for it). On the CPU the graphs are a spy over the real interface that
declines every replay, so the padded forwards run eagerly and the oracle is the engine without
speculation: greedy tokens equal, the KV pool back to where it was."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.speculative.policy import SpeculationPolicy, StepCosts
from deepseek_pd.model.speculative.training import train_mtp
from deepseek_pd.workers.engine.offline import Engine

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
STEPS = 3


class OfferedShapes:
    """`SpeculativeGraphs`' interface: records what each forward offers a replay, replays nothing."""

    def __init__(self, scratch_page: int, captured: list[int]) -> None:
        self.scratch_page = scratch_page
        self.verify_graphs = {q: None for q in captured}  # tokens per row of the captured verifies
        self.verify_lengths: list[set[int]] = []  # tokens per row of each verify offered
        self.catch_up_lengths: list[set[int]] = []
        self.scratch_used = 0  # verifies with a row reaching into the scratch page

    def verify(self, token_ids, prefix_lens, pages, input_ids=None, starts=None):
        self.verify_lengths.append({len(t) for t in token_ids})
        self.scratch_used += any(self.scratch_page in p for p in pages)
        return None

    def draft(self, *args):
        return None

    def catch_up(self, token_ids, prefix_lens, *args):
        if any(prefix_lens):  # not the prompts' MTP pass (the prompts fit one prefill round, from 0)
            self.catch_up_lengths.append({len(t) for t in token_ids})
        return None


def test_rows_near_their_budgets_keep_the_graph_shape(tiny_mtp_checkpoint, module_seed) -> None:
    rng = random.Random(module_seed)
    base = Engine(str(tiny_mtp_checkpoint), page_size=4)
    spec = Engine(str(tiny_mtp_checkpoint), page_size=4, speculative_num_steps=STEPS)
    # Batch 32, as bench/mtp_trained_gpu.py's largest row.
    prompts = [[rng.randrange(2, base.vocab_size) for _ in range(rng.randint(2, 9))] for _ in range(32)]
    # Budgets end at different steps, and some exactly at a page's end (no slack for the padding).
    budgets = [rng.randint(6, 20) for _ in prompts]
    budgets[0] = 4 * rng.randint(3, 5) + 1 - len(prompts[0])  # prompt + max_new - 1: whole pages
    budgets[0] += 4 * (budgets[0] < 2)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in budgets]
    want = [r.output_ids for r in base.generate_batch(prompts, params)]
    train_mtp(spec.runner, [p + w for p, w in zip(prompts, want)], seconds=2.0)  # some drafts accepted

    pool = spec.runner.kv_pool
    scratch = pool.alloc(1)[0]
    used = pool.num_used_pages
    # Graphs for every draft count (the adaptive policy's runner), first.
    graphs = spec.runner.spec_forwards.graphs = OfferedShapes(scratch, [k + 1 for k in range(STEPS + 1)])
    # The adaptive policy too, over step costs drawn at random (so its choice of k varies by batch size).
    costs = [[rng.uniform(1.0, 2.0) * (1 + k * rng.uniform(0.0, 0.5)) for _ in range(6)] for k in range(STEPS + 1)]
    spec.speculation_policy = SpeculationPolicy(StepCosts((1, 2, 4, 8, 16, 32), tuple(map(tuple, costs))), STEPS)
    for k, adaptive in [(k, False) for k in range(1, STEPS + 1)] + [(STEPS, True)]:
        spec.set_speculation(k, adaptive)
        got = [r.output_ids for r in spec.generate_batch(prompts, params)]
        assert got == want, (module_seed, k, adaptive)
        lens = spec.last_speculative_run.lens
        assert any(min(step) < max(step) for step in lens), (module_seed, k, lens)  # rows drafted differently
    assert graphs.verify_lengths and all(len(s) == 1 for s in graphs.verify_lengths), graphs.verify_lengths
    assert graphs.catch_up_lengths and all(len(s) == 1 for s in graphs.catch_up_lengths), graphs.catch_up_lengths
    assert graphs.scratch_used > 0, module_seed
    # Graphs for the configured k only (a runner without the policy): a step whose rows all draft
    # fewer (the batch's last rows near their budgets) is padded to that k.
    graphs = spec.runner.spec_forwards.graphs = OfferedShapes(scratch, [STEPS + 1])
    spec.set_speculation(STEPS)
    assert [r.output_ids for r in spec.generate_batch(prompts, params)] == want, module_seed
    assert any(max(step) < STEPS for step in spec.last_speculative_run.lens), module_seed
    assert graphs.verify_lengths and all(s == {STEPS + 1} for s in graphs.verify_lengths), graphs.verify_lengths
    assert all(s == {STEPS + 1} for s in graphs.catch_up_lengths), graphs.catch_up_lengths
    assert pool.num_used_pages == used
