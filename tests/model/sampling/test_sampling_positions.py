"""`SamplingBatch.sample_positions` and `advance` (the speculative verify's draws, all positions at
once) against plain one-position sampling: position i of a row must be the very draw a plain
`Sampler.sample` makes for that request after d_1..d_i were its output (same seeded noise, same
penalties, same logprobs and top logprobs), and after `advance` + `advanced` the request's step and
output counts must be those of a request that recorded the kept tokens."""
from __future__ import annotations

import random

import torch

from deepseek_pd.model.sampling.batch import SamplingBatch
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler
from deepseek_pd.model.sampling.state import SamplingState

VOCAB = 37


def _params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    return SamplingParams(temperature=0.0 if greedy else rng.choice([0.6, 1.0, 1.4]),
                          top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.85]), min_p=rng.choice([0.0, 0.05]),
                          frequency_penalty=rng.choice([0.0, 0.7]), presence_penalty=rng.choice([0.0, 0.4]),
                          repetition_penalty=rng.choice([1.0, 1.25]), top_logprobs_num=rng.choice([0, 3]),
                          seed=None if greedy else rng.randrange(1 << 30))


def _state(params: SamplingParams, prompt: list[int], recorded: list[int]) -> SamplingState:
    state = SamplingState.create(params, prompt, VOCAB)
    for token in recorded:
        state.record(token)
    return state


def test_each_position_is_the_plain_draw_after_its_drafts(module_seed):
    rng = random.Random(module_seed)
    gen = torch.Generator().manual_seed(module_seed)
    for _ in range(4):
        rows, q = rng.randint(1, 6), rng.randint(1, 4)
        params = [_params(rng) for _ in range(rows)]
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(rows)]
        outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))] for _ in range(rows)]
        drafts = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, q - 1))] for _ in range(rows)]
        drafts = [d + [-1] * (q - 1 - len(d)) for d in drafts]
        logits = torch.randn(rows, q, VOCAB, generator=gen) * 3
        batch = SamplingBatch(VOCAB, "cpu")
        states = [_state(p, prompt, out) for p, prompt, out in zip(params, prompts, outputs)]
        for state in states:
            batch.add(state)
        got = batch.sample_positions(logits, torch.tensor(drafts, dtype=torch.long).view(rows, q - 1))
        for b in range(rows):
            for i in range(q):
                if i and drafts[b][i - 1] < 0:
                    break  # past its drafts: drawn, never kept
                oracle = _state(params[b], prompts[b], outputs[b] + drafts[b][:i])
                want = Sampler().sample(logits[b, i].unsqueeze(0), [oracle])
                row = b * q + i
                assert got.token_ids[row] == want.token_ids[0], (module_seed, b, i, params[b])
                torch.testing.assert_close(got.logprobs[row], want.logprobs[0])
                k = params[b].top_logprobs_num
                assert got.top_ids[row, :k].tolist() == want.top_ids[0, :k].tolist()
        # Keep a random number of each row's tokens: steps and counts as if they were recorded.
        tokens = got.token_ids.view(rows, q)
        taken = [rng.randint(1, q) for _ in range(rows)]
        batch.advance(tokens, torch.tensor(taken))
        for state, n in zip(states, taken):
            batch.advanced(state, n)
        for b, state in enumerate(states):
            kept = outputs[b] + tokens[b, :taken[b]].tolist()
            oracle = _state(params[b], prompts[b], kept)
            assert state.num_sampled == oracle.num_sampled == len(kept)
            if state.penalised:
                torch.testing.assert_close(state.output_counts, oracle.output_counts)
        batch.remove(states)  # and written back
        for b, state in enumerate(states):
            assert state.num_sampled == len(outputs[b]) + taken[b]
