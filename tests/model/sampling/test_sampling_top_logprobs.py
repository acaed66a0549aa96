"""Top logprobs from the batched sampler against the plain reference (sampling_reference): fresh
random logits, params, per-row k in 0..MAX_TOP_LOGPROBS and join/leave schedules every run.

What must hold: each asking row gets exactly min(k, V) entries, descending, every entry's value is
the reference logprob of its token (the sampled token's distribution: penalised, temperature-scaled,
untruncated, temperature 1 when greedy), the values are the reference's k largest; the sampled
token's entry equals its reported logprob; rows that ask for none get None; asking changes no
token; and `sample` + `pack` still read nothing back from the device."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.sampled_host import pack, unpack
from deepseek_pd.model.sampling.sampler import SamplingBatch, SamplingState
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from pdtest.sampling_reference import random_params, ref_logprob

pytestmark = pytest.mark.timeout(180)
VOCAB = 61


@dataclasses.dataclass(eq=False)
class _Row:
    params: SamplingParams
    prompt: list[int]
    state: SamplingState
    logits: list[torch.Tensor]  # per step, fixed in advance
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    tops: list = dataclasses.field(default_factory=list)


def _params(rng: random.Random) -> SamplingParams:
    params = random_params(rng, seed=rng.choice([None, rng.randrange(2**63)]))
    if rng.random() < 0.3:
        params = dataclasses.replace(params, temperature=0.0)
    k = rng.choice([0, 0, rng.randint(1, MAX_TOP_LOGPROBS)])
    return dataclasses.replace(params, top_logprobs_num=k)


def _row(rng: random.Random, steps: int, vocab: int = VOCAB, **changes) -> _Row:
    params = dataclasses.replace(_params(rng), **changes)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
    logits = [torch.randn(vocab) * rng.choice([0.5, 2.5, 6.0]) for _ in range(steps)]
    return _Row(params, prompt, SamplingState.create(params, prompt, vocab), logits)


def _run(rng: random.Random, rows: list[_Row], rounds: int, vocab: int = VOCAB) -> None:
    """Rows join and leave at random; each sampled step goes through pack/unpack like a worker's."""
    batch = SamplingBatch(vocab, "cpu")
    waiting, inside = list(rows), []
    for _ in range(rounds):
        if waiting and (not inside or rng.random() < 0.5):
            row = waiting.pop()
            batch.add(row.state)
            inside.append(row)
        if inside and rng.random() < 0.2:
            gone = rng.sample(inside, rng.randint(1, len(inside)))
            batch.remove([r.state for r in gone])
            inside = [r for r in inside if r not in gone]
        inside = [r for r in inside if len(r.tokens) < len(r.logits)]
        ordered = [next(r for r in inside if r.state is s) for s in batch.states if any(r.state is s for r in inside)]
        batch.remove([s for s in batch.states if not any(r.state is s for r in inside)])
        if not ordered:
            continue
        out = batch.sample(torch.stack([r.logits[len(r.tokens)] for r in ordered]))
        sampled = unpack(pack(out).cpu(), out.top_counts)
        for i, row in enumerate(ordered):
            row.tokens.append(sampled.token_ids[i])
            row.logprobs.append(sampled.logprobs[i])
            row.tops.append(sampled.top[i])


def test_top_logprobs_equal_the_reference_distribution():
    rng = random.Random()
    rows = [_row(rng, steps=rng.randint(1, 6)) for _ in range(12)]
    # Make sure of an asking greedy row and an asking penalised, temperature-scaled one.
    rows.append(_row(rng, steps=4, temperature=0.0, top_logprobs_num=MAX_TOP_LOGPROBS))
    rows.append(_row(rng, steps=4, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                     top_logprobs_num=3))
    _run(rng, rows, rounds=200)
    checked = 0
    for row in rows:
        k = row.params.top_logprobs_num
        for step, (token, logprob, top) in enumerate(zip(row.tokens, row.logprobs, row.tops)):
            if k == 0:
                assert top is None
                continue
            logits, before = row.logits[step].tolist(), row.tokens[:step]
            ref = [ref_logprob(logits, row.params, row.prompt, before, t) for t in range(VOCAB)]
            assert len(top.token_ids) == len(top.logprobs) == k
            assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
            assert len(set(top.token_ids)) == k
            for t, value in zip(top.token_ids, top.logprobs):
                assert value == pytest.approx(ref[t], abs=1e-4), (row.params, step, t)
            assert list(top.logprobs) == pytest.approx(sorted(ref, reverse=True)[:k], abs=1e-4)
            assert logprob == pytest.approx(ref[token], abs=1e-4)
            if token in top.token_ids:  # the same arithmetic: bit for bit
                assert top.logprobs[top.token_ids.index(token)] == logprob
            checked += 1
    assert checked >= 2


def test_asking_for_top_logprobs_changes_no_token():
    rng = random.Random()
    rows = [_row(rng, steps=5) for _ in range(10)]
    plain = [_Row(dataclasses.replace(r.params, top_logprobs_num=0), r.prompt,
                  SamplingState.create(dataclasses.replace(r.params, top_logprobs_num=0), r.prompt, VOCAB), r.logits)
             for r in rows]
    outs = []
    for group in (rows, plain):
        seed = 1234
        batch = SamplingBatch(VOCAB, "cpu", torch.Generator().manual_seed(seed))
        for r in group:
            batch.add(r.state)
        steps = []
        for step in range(5):
            out = batch.sample(torch.stack([r.logits[step] for r in group]))
            steps.append((out.token_ids.tolist(), out.logprobs.tolist()))
        outs.append(steps)
    assert outs[0] == outs[1]


def test_a_vocabulary_smaller_than_k_gives_every_token():
    rng = random.Random()
    vocab = rng.randint(2, 9)
    params = SamplingParams(temperature=0.0, top_logprobs_num=MAX_TOP_LOGPROBS)
    batch = SamplingBatch(vocab, "cpu")
    batch.add(SamplingState.create(params, [], vocab))
    batch.add(SamplingState.create(SamplingParams(temperature=0.0), [], vocab))
    logits = torch.randn(2, vocab)
    out = batch.sample(logits)
    sampled = unpack(pack(out).cpu(), out.top_counts)
    assert sorted(sampled.top[0].token_ids) == list(range(vocab)) and sampled.top[1] is None
    want = torch.log_softmax(logits[0], dim=-1)
    assert list(sampled.top[0].logprobs) == pytest.approx(sorted(want.tolist(), reverse=True), abs=1e-6)


def test_sample_and_pack_read_nothing_back(monkeypatch):
    rng = random.Random()
    rows = [_row(rng, steps=2) for _ in range(8)] + [_row(rng, steps=2, top_logprobs_num=7)]
    width = max(r.params.top_logprobs_num for r in rows)
    batch = SamplingBatch(VOCAB, "cpu")
    for r in rows:
        batch.add(r.state)
    logits = torch.stack([r.logits[0] for r in rows])

    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync inside the sampler")
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        out = batch.sample(logits)
        packed = pack(out)
    assert packed.shape == (len(rows), 2 + 2 * width)


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, 10**6, True, 2.0])
def test_out_of_range_top_logprobs_num_is_a_user_error(value):
    with pytest.raises(UserError, match=f"top_logprobs_num.*at most {MAX_TOP_LOGPROBS}"):
        SamplingParams(top_logprobs_num=value).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_top_logprobs_do_not_synchronise_and_equal_cpu():
    rng = random.Random()
    # No penalties: the second step's distribution must not depend on which tokens the first drew.
    params = [dataclasses.replace(_params(rng), top_logprobs_num=rng.randint(0, MAX_TOP_LOGPROBS),
                                  repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
              for _ in range(16)]
    logits = torch.randn(len(params), VOCAB) * 2
    results = []
    for device in ("cpu", "cuda"):
        batch = SamplingBatch(VOCAB, device)
        for p in params:
            batch.add(SamplingState.create(p, [], VOCAB, device=device))
        rows = logits.to(device)
        batch.sample(rows)  # the rebuild uploads; the next step must not sync
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = batch.sample(rows)
            packed = pack(out)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        results.append(unpack(packed.cpu(), out.top_counts))
    for a, b in zip(*[r.top for r in results]):
        assert (a is None) == (b is None)
        if a is not None:
            assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)
