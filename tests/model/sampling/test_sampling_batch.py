"""SamplingBatch against per-request oracles: each request alone in a batch of one, and the plain
references of sampling_reference computed from the host-known tokens; fresh random logits, params,
seeds and join/leave schedules every run. Plus: no host sync inside `sample`, and an op count that
does not grow with the batch."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepseek_pd.model.sampling.sampler import Sampler, SamplingBatch, SamplingState
from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.sampling_reference import assert_frequencies_match, random_params, ref_logprob, ref_penalised, ref_probs

pytestmark = pytest.mark.timeout(180)
VOCAB = 97


@dataclasses.dataclass(eq=False)
class _Request:
    tag: int  # its logits at step t are _logits(tag, t): a function of the request and step only
    params: SamplingParams
    prompt: list[int]
    state: SamplingState
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)


_LOGITS_BASE = random.randrange(2**30)


def _logits(tag: int, step: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(_LOGITS_BASE + 7919 * tag + step)
    return (torch.randn(VOCAB, generator=generator) * 2.5).to(device)


def _mixed_params(rng: random.Random, kind: str) -> SamplingParams:
    params = random_params(rng, seed=rng.randrange(-2**63, 2**64) if kind == "seeded" else None)
    if kind == "greedy":
        params = dataclasses.replace(params, **rng.choice([{"temperature": 0.0}, {"top_k": 1}]))
    elif params.greedy:
        params = dataclasses.replace(params, top_k=rng.choice([-1, 5]))
    return params


def _new_request(rng: random.Random, tag: int, kind: str, device: str = "cpu") -> _Request:
    params = _mixed_params(rng, kind)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
    return _Request(tag, params, prompt, SamplingState.create(params, prompt, VOCAB, device=device))


def _step(batch: SamplingBatch, requests: dict[int, _Request], device: str = "cpu") -> None:
    rows = [requests[id(s)] for s in batch.states]
    logits = torch.stack([_logits(r.tag, r.state.num_sampled, device) for r in rows])
    out = batch.sample(logits)
    for request, token, logprob in zip(rows, out.token_ids.tolist(), out.logprobs.tolist()):
        request.tokens.append(token)
        request.logprobs.append(logprob)


def _run_schedule(rng: random.Random, rounds: int = 24) -> list[_Request]:
    """Requests of every kind wander between two batches (as between a prefill and a decode batch)
    and an idle pool; both batches sample every round."""
    kinds = ["seeded", "greedy", "unseeded"] * 4
    requests = [_new_request(rng, tag, kind) for tag, kind in enumerate(kinds)]
    by_state = {id(r.state): r for r in requests}
    batches = [SamplingBatch(VOCAB, "cpu", torch.Generator().manual_seed(rng.randrange(2**31))) for _ in range(2)]
    idle = list(requests)
    for _ in range(rounds):
        for batch in batches:
            leaving = [s for s in batch.states if rng.random() < 0.2]
            batch.remove(leaving)
            idle += [by_state[id(s)] for s in leaving]
        rng.shuffle(idle)
        for request in [r for r in idle if rng.random() < 0.5]:
            idle.remove(request)
            rng.choice(batches).add(request.state)
        for batch in batches:
            if len(batch):
                _step(batch, by_state)
    return requests


def _alone(request: _Request, steps: int) -> tuple[list[int], list[float]]:
    """The oracle: the same request alone in a batch of one, sampled `steps` times."""
    solo = _Request(request.tag, request.params, request.prompt,
                    SamplingState.create(request.params, request.prompt, VOCAB))
    batch = SamplingBatch(VOCAB, "cpu")
    batch.add(solo.state)
    for _ in range(steps):
        _step(batch, {id(solo.state): solo})
    return solo.tokens, solo.logprobs


def test_batched_equals_each_request_alone_as_rows_join_and_leave():
    requests = _run_schedule(random.Random())
    compared = [r for r in requests if r.params.greedy or r.params.seed is not None]
    assert sum(len(r.tokens) for r in compared) > 50
    for request in compared:
        tokens, logprobs = _alone(request, len(request.tokens))
        assert request.tokens == tokens, request.params
        assert request.logprobs == pytest.approx(logprobs, abs=1e-5)
        assert request.state.num_sampled == len(request.tokens)


def test_device_penalties_and_logprobs_equal_reference_from_host_tokens():
    """Every row, the generator-drawn ones too: after many steps on the device, each logprob is the
    reference's for the host-known tokens before it, greedy rows took the reference argmax,
    sampled rows a token the reference keeps, and the device counts are the tokens' counts."""
    requests = _run_schedule(random.Random())
    for r in requests:
        for step, (token, logprob) in enumerate(zip(r.tokens, r.logprobs)):
            logits, before = _logits(r.tag, step).tolist(), r.tokens[:step]
            assert logprob == pytest.approx(ref_logprob(logits, r.params, r.prompt, before, token), abs=1e-4)
            penalised = ref_penalised(logits, r.params, r.prompt, before)
            if r.params.greedy:
                assert token == max(range(VOCAB), key=lambda t: penalised[t])
            else:
                assert ref_probs(penalised, r.params)[token] > 0, (r.params, step)
        counts = r.state.output_counts  # a view of a batch table or the state's own, written back
        if r.state.penalised:
            assert counts.tolist() == torch.bincount(torch.tensor(r.tokens, dtype=torch.long),
                                                     minlength=VOCAB).float().tolist()
        else:
            assert counts is None


def test_seeded_request_ignores_batch_order_and_companions():
    rng = random.Random()
    target = _new_request(rng, 0, "seeded")
    target = dataclasses.replace(target, params=dataclasses.replace(
        target.params, temperature=1.0, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5))
    steps = 10
    want, _ = _alone(target, steps)
    for trial in range(4):
        subject = _Request(0, target.params, target.prompt, SamplingState.create(target.params, target.prompt, VOCAB))
        companions = [_new_request(rng, 1 + 10 * trial + k, rng.choice(["seeded", "greedy", "unseeded"]))
                      for k in range(rng.randint(1, 6))]
        rows = companions + [subject]
        rng.shuffle(rows)
        batch = SamplingBatch(VOCAB, "cpu")
        for request in rows:
            batch.add(request.state)
        by_state = {id(r.state): r for r in rows}
        for _ in range(steps):
            _step(batch, by_state)
        assert subject.tokens == want


def test_pd_handoff_continues_the_sequence():
    """Token 1 sampled by one sampler (the prefill worker's `Sampler.sample`, then `append`), the
    rest by a fresh state in a decode batch that `record`s it: the same tokens as one state alone."""
    rng = random.Random()
    for kind in ("seeded", "greedy"):
        request = _new_request(rng, rng.randrange(1000), kind)
        request.params = dataclasses.replace(request.params, frequency_penalty=1.0, repetition_penalty=1.3)
        want, _ = _alone(request, 8)
        prefill = SamplingState.create(request.params, request.prompt, VOCAB)
        first = Sampler().sample(_logits(request.tag, 0).unsqueeze(0), [prefill]).token_ids.tolist()[0]
        prefill.append(first)  # acknowledged, not counted twice
        assert prefill.num_sampled == 1 and prefill.generator is None
        decode = _Request(request.tag, request.params, request.prompt,
                          SamplingState.create(request.params, request.prompt, VOCAB), tokens=[first])
        decode.state.record(first)
        batch = SamplingBatch(VOCAB, "cpu")
        batch.add(decode.state)
        for _ in range(7):
            _step(batch, {id(decode.state): decode})
        assert decode.tokens == want
        # the prefill side counted its token once, not again on append
        assert prefill.output_counts.tolist() == torch.bincount(torch.tensor([first]), minlength=VOCAB).tolist()


def test_record_inside_a_batch_equals_record_outside():
    """A token counted while the row sits in the device tables (one step, one count on the device)
    continues exactly like the same token recorded on a state outside any batch."""
    rng = random.Random()
    request = _new_request(rng, rng.randrange(1000), "seeded")
    # diffuse, so that a draw at the wrong step shows in the tokens
    request.params = dataclasses.replace(request.params, temperature=2.0, top_k=-1, top_p=1.0, min_p=0.0,
                                         frequency_penalty=1.5, presence_penalty=0.5)
    extra = rng.randrange(VOCAB)
    results = []
    for inside in (True, False):
        r = _Request(request.tag, request.params, request.prompt,
                     SamplingState.create(request.params, request.prompt, VOCAB))
        batch = SamplingBatch(VOCAB, "cpu")
        batch.add(r.state)
        _step(batch, {id(r.state): r})
        if not inside:
            batch.remove([r.state])
        r.state.record(extra)
        if not inside:
            batch.add(r.state)
        for _ in range(4):
            _step(batch, {id(r.state): r})
        assert r.state.num_sampled == 6
        results.append((r.tokens, r.logprobs, r.state.output_counts.tolist()))
    assert results[0] == results[1]
    assert results[0][2] == torch.bincount(torch.tensor(results[0][0][:1] + [extra] + results[0][0][1:]),
                                           minlength=VOCAB).float().tolist()


def test_one_seed_many_steps_matches_the_distribution():
    """The noise is fresh at every step: 20 seeds x 300 steps of fixed logits follow the reference."""
    rng = random.Random()
    vocab = 12
    params = SamplingParams(temperature=0.9, top_p=0.9, min_p=0.01)
    logits = torch.randn(vocab) * 1.5
    ref = ref_probs(logits.tolist(), params)
    batch = SamplingBatch(vocab, "cpu")
    for _ in range(20):
        batch.add(SamplingState.create(dataclasses.replace(params, seed=rng.randrange(2**64)), [], vocab))
    tokens = torch.cat([batch.sample(logits.expand(20, vocab).contiguous()).token_ids for _ in range(300)])
    assert_frequencies_match(tokens, ref, params)


def test_bad_use_is_a_clear_error():
    batch, other = SamplingBatch(VOCAB, "cpu"), SamplingBatch(VOCAB, "cpu")
    state = SamplingState.create(SamplingParams(), [], VOCAB)
    batch.add(state)
    with pytest.raises(ValueError, match="already in a batch"):
        other.add(state)
    with pytest.raises(ValueError, match="not in this batch"):
        other.remove([state])
    with pytest.raises(ValueError, match="do not match"):
        batch.sample(torch.randn(2, VOCAB))
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingBatch(VOCAB + 1, "cpu").add(SamplingState.create(SamplingParams(), [], VOCAB))


# ---- structure: no host sync, ops independent of the batch size -------------------------------

_SYNCING_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "allclose", "item"}


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _full_batch(rng: random.Random, size: int, device: str = "cpu") -> tuple[SamplingBatch, dict]:
    """Every path on: greedy, seeded, generator rows, penalties with prompts, truncation."""
    batch = SamplingBatch(VOCAB, device)
    requests = {}
    for tag in range(size):
        request = _new_request(rng, tag, ("seeded", "greedy", "unseeded")[tag % 3], device)
        if tag < 3:  # make sure of a repetition penalty and a truncation
            request.state = SamplingState.create(dataclasses.replace(
                request.params, repetition_penalty=1.3, top_p=0.5), request.prompt, VOCAB, device=device)
            request.params = request.state.params
        requests[id(request.state)] = request
        batch.add(request.state)
    return batch, requests


def _guarded(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync inside SamplingBatch")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_sample_add_remove_never_read_the_device(monkeypatch):
    rng = random.Random()
    batch, requests = _full_batch(rng, 9)
    states = batch.states
    logits = [torch.stack([_logits(requests[id(s)].tag, k) for s in states]) for k in range(3)]
    with monkeypatch.context() as patch, _OpLog() as log:
        _guarded(patch)
        batch.sample(logits[0])  # with the rebuild
        batch.sample(logits[1])
        batch.remove(states[:4])
        batch.add(states[1])
        batch.sample(torch.cat([logits[2][4:], logits[2][1:2]]))
    assert not _SYNCING_OPS & set(log.ops), log.ops


def test_ops_per_step_do_not_grow_with_the_batch():
    rng = random.Random()
    counts = []
    for size in (4, 40):
        batch, requests = _full_batch(rng, size)
        rows = torch.stack([_logits(requests[id(s)].tag, 0) for s in batch.states])
        with _OpLog() as rebuild_and_step:
            batch.sample(rows)
        with _OpLog() as step:
            batch.sample(rows)
        counts.append((sum(rebuild_and_step.ops.values()), sum(step.ops.values())))
    assert counts[0] == counts[1], counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sample_does_not_synchronise():
    rng = random.Random()
    batch, requests = _full_batch(rng, 12, "cuda")
    states = batch.states
    logits = [torch.stack([_logits(requests[id(s)].tag, k, "cuda") for s in states]) for k in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch.sample(logits[0])
        batch.sample(logits[1])
        batch.remove(states[:4])
        batch.add(states[1])
        out = batch.sample(torch.cat([logits[2][4:], logits[2][1:2]]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (9,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_tokens_equal_cpu():
    """Same bits on both devices; the fp32 logs may differ in the last place, so allow a rare flip."""
    rng = random.Random()
    params = [_mixed_params(rng, "seeded") for _ in range(64)]
    results = []
    for device in ("cpu", "cuda"):
        batch = SamplingBatch(VOCAB, device)
        for p in params:
            batch.add(SamplingState.create(p, [], VOCAB, device=device))
        logits = torch.stack([_logits(tag, 0, device) for tag in range(len(params))])
        results.append(batch.sample(logits).token_ids.cpu())
    assert (results[0] == results[1]).float().mean() > 0.95
