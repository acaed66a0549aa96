"""Speculative decoding with two-batch overlap (model/distributed/tbo.py) in one rank: the verify extend runs as
two micro-batches (cut between sequences, or inside one sequence's drafts) and the greedy outputs are
the TBO engine's without speculation, token for token, over seeded prompts and batch mixes, with
the accept path exercised (an MTP layer trained for a few seconds)."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.speculative.training import train_mtp

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]
CHUNK = 8


def test_tbo_speculation_equals_tbo_without_it(tiny_mtp_checkpoint, module_seed):
    rng = random.Random(module_seed)
    path = tiny_mtp_checkpoint
    base = Engine(str(path), chunked_prefill_size=CHUNK, page_size=4, enable_tbo=True)
    spec = Engine(str(path), chunked_prefill_size=CHUNK, page_size=4, enable_tbo=True, speculative_num_steps=3)
    prompts = [[rng.randrange(2, base.vocab_size) for _ in range(rng.randint(2, 10))] for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    sequences = [p + r.output_ids for p, r in zip(prompts, base.generate_batch(prompts, greedy))]
    train_mtp(spec.runner, sequences, seconds=5.0)
    tbo = spec.runner.model.tbo
    verifies: list[bool] = []  # per forward over every token (verify, catch-up input): overlapped?
    final_hidden = tbo.final_hidden

    def spy(batch, *args, every_token=False, **kwargs):
        before = tbo.stats["overlapped"]
        out = final_hidden(batch, *args, every_token=every_token, **kwargs)
        if every_token:
            verifies.append(tbo.stats["overlapped"] > before)
        return out
    tbo.final_hidden = spy
    spec.speculative.stats.__init__()
    for round_ in range(3):
        batch = rng.sample(prompts, rng.randint(1, 3))
        batch += [[rng.randrange(2, base.vocab_size) for _ in range(rng.randint(1, 20))]
                  for _ in range(rng.randint(0, 3))]
        rng.shuffle(batch)
        params = [SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 16), ignore_eos=True,
                                 top_logprobs_num=rng.choice([0, 2])) for _ in batch]
        for a, b in zip(spec.generate_batch(batch, params), base.generate_batch(batch, params)):
            what = f"seed {module_seed}, round {round_}"
            assert a.output_ids == b.output_ids, what
            assert a.finish_reason == b.finish_reason, what
            torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs),
                                       atol=1e-4, rtol=0)
        assert spec.runner.kv_pool.num_used_pages == 0
    # One request alone also verifies through TBO: its k + 1 tokens cut in two chunks.
    alone = spec.generate_batch([prompts[0]], greedy)[0]
    assert alone.output_ids == base.generate_batch([prompts[0]], greedy)[0].output_ids
    stats = spec.speculative.stats
    print(f"seed {module_seed}: accept length {stats.accept_length:.2f} with TBO, {tbo.stats}")
    assert any(verifies) and len(verifies) > 10  # the verify extends did run as two micro-batches
    assert stats.accepted > 0  # not only the reject path
