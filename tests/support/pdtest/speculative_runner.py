"""Greedy speculative decoding on one `ModelRunner`, as a decode worker runs it: the prompt's extend
then the MTP layer over it (`run_extend_with_mtp`: the first token and first draft), then
`SpeculativeDecoder` steps (draft chain, verify, catch-up) until every request has its tokens.
Every request ignores EOS (max_new tokens each), as the oracles it is compared with do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.model.speculative.decoder import SpeculativeDecoder
from deepseek_pd.workers.engine.extend_step import run_extend_with_mtp


@dataclass
class SpecRow:
    """A request as `SpeculativeDecoder` reads it (decoder.SpecRequest): done at `max_new` tokens.
    Its `sampling` is set by whoever samples its first token."""

    prompt_ids: list[int]
    max_new: int
    pages: list[int]
    output_ids: list[int] = field(default_factory=list)
    sampling: SamplingState | None = None

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new


def speculative_greedy(runner: ModelRunner, prompts: Sequence[list[int]], max_new: Sequence[int], steps: int,
                       drafts_per_step: Callable[[], int] | None = None) -> tuple[list[list[int]], SpeculativeDecoder]:
    """(each prompt's output ids, the decoder: its `stats` count drafted and accepted tokens).
    All prompts form one batch; their pages are freed at the end. `drafts_per_step()`, when given,
    is how many tokens each step drafts (as an adaptive policy picks them), else `steps`."""
    pool = runner.kv_pool
    rows = [SpecRow(list(p), n, pool.alloc(pool.pages_for_tokens(len(p) + n))) for p, n in zip(prompts, max_new)]
    decoder = SpeculativeDecoder(runner, steps)
    try:
        greedy = SamplingParams(temperature=0.0)
        states = [SamplingState.create(greedy, r.prompt_ids, runner.model_config.vocab_size) for r in rows]
        sampled, drafts = run_extend_with_mtp(runner, Sampler(), [ExtendSeq(r.prompt_ids, 0, r.pages) for r in rows],
                                              range(len(rows)), states, [r.prompt_ids for r in rows])
        for row, state, token, draft in zip(rows, states, sampled.token_ids, drafts):
            row.output_ids.append(token)
            row.sampling = state
            decoder.seed(row, *draft)
        while not all(r.finished for r in rows):
            decoder.step([r for r in rows if not r.finished], None if drafts_per_step is None else drafts_per_step())
    finally:
        for row in rows:
            pool.free(row.pages)
    return [r.output_ids for r in rows], decoder
