"""The sampler against plain per-row reference implementations (sampling_reference, written from
deepseek_pd.model.sampling.sampler's docstring), on fresh random logits; plus seeds and distributions.
The persistent SamplingBatch has its own tests in test_sampling_batch.py."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.sampler import (Finish, IncrementalDetokenizer, Sampler, SamplingState, StopChecker,
                                        apply_penalties, truncation_mask)
from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.sampling_reference import assert_frequencies_match
from pdtest.sampling_reference import random_params as _random_params
from pdtest.sampling_reference import ref_penalised as _ref_penalised
from pdtest.sampling_reference import ref_probs as _ref_probs

pytestmark = pytest.mark.timeout(120)


def _states(params_list, vocab, prompts=None, outputs=None):
    states = []
    for i, params in enumerate(params_list):
        state = SamplingState.create(params, prompts[i] if prompts else [], vocab)
        for token in (outputs[i] if outputs else []):
            state.append(token)
        states.append(state)
    return states


# ---- tests --------------------------------------------------------------------------------

def test_penalties_match_reference_on_the_right_tokens():
    rng = random.Random()
    vocab = 40
    params = [_random_params(rng) for _ in range(8)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 10))] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in params]
    logits = torch.randn(len(params), vocab) * 3
    got = apply_penalties(logits, _states(params, vocab, prompts, outputs))
    for i, p in enumerate(params):
        want = _ref_penalised(logits[i].tolist(), p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=1e-6, atol=1e-6)
    # untouched rows and tokens stay bit-identical
    plain = _states([SamplingParams()] * 2, vocab, outputs=[[1, 2], [3]])
    assert torch.equal(apply_penalties(logits[:2], plain), logits[:2])


def test_truncation_mask_matches_reference():
    rng = random.Random()
    vocab = 50
    params = [_random_params(rng) for _ in range(32)]
    logits = torch.randn(len(params), vocab) * 2
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    mask = truncation_mask(probs,
                           torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]),
                           torch.tensor([p.top_p for p in params]),
                           torch.tensor([p.min_p for p in params]))
    for i, p in enumerate(params):
        want = [x > 0 for x in _ref_probs(logits[i].tolist(), p)]
        assert mask[i].tolist() == want, (p, i)
        kept_mass = probs[i][mask[i]].sum().item()
        if p.top_k <= 0 and p.min_p == 0:
            assert kept_mass >= p.top_p - 1e-6  # top-p keeps at least the requested mass


def test_greedy_is_argmax_of_penalised_logits():
    vocab = 30
    logits = torch.randn(4, vocab)
    outputs = [[int(logits[i].argmax())] for i in range(4)]  # penalise the current argmax
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0), SamplingParams(top_k=1),
              SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
              SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits, _states(params, vocab, outputs=outputs))
    for i, p in enumerate(params):
        ref = _ref_penalised(logits[i].tolist(), p, [], outputs[i])
        assert out.token_ids[i].item() == max(range(vocab), key=lambda t: ref[t])


def test_extreme_but_valid_values_do_not_break_the_batch():
    """A near-zero temperature or repetition penalty overflows fp32 (inf - inf = nan) and made
    torch.multinomial raise for the WHOLE batch; now each row still gets a sensible token."""
    rng = random.Random()
    vocab = 40
    logits = torch.randn(3, vocab) * 4
    seen = [rng.randrange(vocab) for _ in range(6)]
    tiny_temp = SamplingParams(temperature=10.0 ** -rng.uniform(7, 44), seed=rng.randrange(2**31))
    tiny_rep = SamplingParams(temperature=1.0, repetition_penalty=1e-40, seed=rng.randrange(2**31))
    normal = SamplingParams(temperature=0.9, seed=rng.randrange(2**31))
    out = Sampler().sample(logits, _states([tiny_temp, tiny_rep, normal], vocab, outputs=[[], seen, []]))
    assert out.token_ids[0].item() == int(logits[0].argmax())  # the temperature -> 0 limit: greedy
    boosted = [t for t in set(seen) if logits[1, t] > 0]  # what a vanishing penalty makes certain
    if boosted:
        assert out.token_ids[1].item() in boosted
    alone = Sampler().sample(logits[2:], _states([normal], vocab)).token_ids[0].item()
    assert out.token_ids[2].item() == alone
    assert not torch.isnan(out.logprobs).any()


@pytest.mark.parametrize("seeded", [False, True], ids=["fallback-generator", "counter-seeded"])
def test_sampled_distribution_matches_reference(seeded):
    """Many rows, each one draw: the fallback generator's rows, or rows with distinct fresh seeds."""
    rng = random.Random()
    vocab, draws = 12, 6000
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.8),
                   SamplingParams(temperature=1.0, top_k=4, min_p=0.02), _random_params(rng)):
        if params.greedy:
            continue
        logits = torch.randn(vocab) * 1.5
        output = [rng.randrange(vocab) for _ in range(3)]
        ref = _ref_probs(_ref_penalised(logits.tolist(), params, [], output), params)
        rows = ([dataclasses.replace(params, seed=rng.randrange(-2**63, 2**64)) for _ in range(draws)]
                if seeded else [params] * draws)
        states = _states(rows, vocab, outputs=[output] * draws)
        tokens = Sampler().sample(logits.expand(draws, vocab).contiguous(), states).token_ids
        assert_frequencies_match(tokens, ref, params)


def _run_seeded(rows: list[SamplingParams], steps: int, vocab: int, logits_seed: int) -> list[list[int]]:
    """Sample `steps` tokens for every row; logits depend only on (row's seed, step), as a model's would."""
    states = _states(rows, vocab)
    tokens: list[list[int]] = [[] for _ in rows]
    sampler = Sampler()
    for step in range(steps):
        logits = torch.stack([
            torch.randn(vocab, generator=torch.Generator().manual_seed(logits_seed + 1000 * step + (p.seed or 0)))
            for p in rows])
        out = sampler.sample(logits, states).token_ids.tolist()
        for i, token in enumerate(out):
            tokens[i].append(token)
            states[i].append(token)
    return tokens


def test_seed_reproducible_regardless_of_batch():
    vocab, steps = 64, 12
    base = random.randrange(2**20)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=base)
    alone = _run_seeded([target], steps, vocab, base)[0]
    others = [SamplingParams(temperature=0.8, seed=base + k) for k in (1, 2)] + [SamplingParams(temperature=1.0)]
    for position in range(4):
        batch = others[:position] + [target] + others[position:]
        assert _run_seeded(batch, steps, vocab, base)[position] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=base + 7)
    assert _run_seeded([other_seed], steps, vocab, base)[0] != alone


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.1, "temperature=-0.1"), ("top_p", 0.0, "top_p=0.0"), ("top_p", 1.5, "top_p=1.5"),
    ("top_k", -2, "top_k=-2"), ("min_p", 1.2, "min_p=1.2"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("frequency_penalty", 2.5, "frequency_penalty=2.5"), ("presence_penalty", -3.0, "presence_penalty"),
    ("max_new_tokens", 0, "max_new_tokens=0"), ("temperature", float("nan"), "temperature=nan"),
    ("stop", ("",), "stop"), ("stop_token_ids", (5000,), "stop_token_ids=5000"),
])
def test_invalid_sampling_values_are_one_line_user_errors(field, value, match):
    params = SamplingParams(**{field: value})
    with pytest.raises(UserError, match=match) as exc:
        params.validate(vocab_size=100)
    assert "\n" not in str(exc.value)


def test_logits_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(torch.randn(3, 10), _states([SamplingParams()] * 2, 10))


# ---- stop conditions ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    from deepseek_pd.model.checkpoint.tokenizer_builder import build_tokenizer
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_tokenizer().save(str(path))
    return Tokenizer.from_file(str(path))


def _feed(checker: StopChecker, ids: list[int]):
    for n, token in enumerate(ids, start=1):
        finish = checker.append(token)
        if finish is not None:
            return n, finish
    return len(ids), None


def test_stop_tokens_eos_and_length():
    eos = 1
    ids = [7, 8, eos, 9]
    assert _feed(StopChecker(SamplingParams(max_new_tokens=10), [eos]), ids) == (3, Finish("stop", eos))
    assert _feed(StopChecker(SamplingParams(max_new_tokens=10, ignore_eos=True), [eos]), ids) == (4, None)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=(8,))
    assert _feed(StopChecker(params, [eos]), ids) == (2, Finish("stop", 8))
    assert _feed(StopChecker(SamplingParams(max_new_tokens=2), [eos]), ids) == (2, Finish("length"))
    # eos as the last allowed token reports "stop"
    assert _feed(StopChecker(SamplingParams(max_new_tokens=3), [eos]), ids) == (3, Finish("stop", eos))
    # the engine's context cap overrides max_new_tokens
    assert _feed(StopChecker(SamplingParams(max_new_tokens=10), [eos], max_new_tokens=1), ids) == (1, Finish("length"))
    checker = StopChecker(SamplingParams(max_new_tokens=1), [eos])
    checker.append(5)
    with pytest.raises(RuntimeError):
        checker.append(6)


def test_stop_string_straddling_tokens_trims_text(tokenizer):
    text = "Hello, world! The robot painted the sea."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    rng = random.Random()
    start = rng.randrange(1, len(text) - 8)
    stop = text[start:start + rng.randint(2, 6)]
    first = text.find(stop)
    checker = StopChecker(SamplingParams(max_new_tokens=100, stop=("never here", stop)), [1], tokenizer)
    n, finish = _feed(checker, ids)
    assert finish == Finish("stop", stop)
    assert checker.text == text[:first]
    # it stopped at the first token whose text completes the stop string, not later
    assert stop in tokenizer.decode(ids[:n]) and stop not in tokenizer.decode(ids[:n - 1])


def test_incremental_detokenizer_equals_full_decode(tokenizer):
    rng = random.Random()
    alphabet = "abc xyz,.!äöü你好🙂\n"
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        detok = IncrementalDetokenizer(tokenizer)
        for n, token in enumerate(ids, start=1):
            detok.append(token)
            assert "\ufffd" not in detok.text
            assert text.startswith(detok.text)
        assert detok.text == text and detok.flush() == text
    with pytest.raises(UserError, match="stop strings need a tokenizer"):
        StopChecker(SamplingParams(stop=("x",)), [1], None)
