"""A request's sampling state is host data until the thread that samples builds its tables: opening a
penalised request (and recording the first token the prefill worker sent) runs no torch op, so the
event loop that does both launches no kernel (issue 25); the tables built later hold exactly the
prompt's tokens and the recorded ones (oracle: a mask and a bincount of the same ids)."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import SamplingBatch, SamplingState

VOCAB = 211


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _penalised(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.0, 0.7]), repetition_penalty=rng.uniform(1.05, 2.0),
                          frequency_penalty=rng.choice([0.0, 0.4]), presence_penalty=rng.choice([0.0, 0.3]),
                          seed=rng.randrange(1 << 31))


def test_opening_a_penalised_request_and_recording_its_first_token_run_no_torch_op():
    rng = random.Random()
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 64))]
    with _Ops() as seen:
        state = SamplingState.create(_penalised(rng), prompt, VOCAB, device="cpu")
        state.record(rng.randrange(VOCAB))  # the decode worker, as the transfer's done arrives
    assert not seen.ops, f"built on the opening thread: {dict(seen.ops)}"
    assert state.num_sampled == 1


def test_the_tables_built_later_hold_the_prompt_and_the_recorded_tokens():
    rng = random.Random()
    for _ in range(6):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 40))]
        recorded = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]
        params = _penalised(rng)
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[prompt] = True
        # Outside any batch (the prefill worker's one-off sampler reads them so).
        alone = SamplingState.create(params, prompt, VOCAB)
        for token in recorded:
            alone.record(token)
        assert torch.equal(alone.prompt_mask, mask)
        assert torch.equal(alone.output_counts, torch.bincount(torch.tensor(recorded, dtype=torch.long),
                                                              minlength=VOCAB).float())
        # In a batch, beside other rows, some penalised: its row of the batch's tables.
        batch = SamplingBatch(VOCAB, "cpu")
        others = [SamplingState.create(dataclasses.replace(_penalised(rng), repetition_penalty=rng.choice([1.0, 1.3])),
                                       [rng.randrange(VOCAB) for _ in range(5)], VOCAB) for _ in range(rng.randrange(0, 3))]
        state = SamplingState.create(params, prompt, VOCAB)
        for token in recorded:
            state.record(token)
        for other in others[:1] + [state] + others[1:]:
            batch.add(other)
        out = batch.sample(torch.randn(len(batch), VOCAB))
        row = batch.states.index(state)
        sampled = int(out.token_ids[row])
        assert torch.equal(batch._tables.prompt[row], mask)
        assert torch.equal(state.output_counts, torch.bincount(torch.tensor(recorded + [sampled], dtype=torch.long),
                                                               minlength=VOCAB).float())
        batch.remove([state])  # and back on its own: the counts written back, the prompt kept
        assert state.output_counts.sum() == len(recorded) + 1 and torch.equal(state.prompt_mask, mask)
