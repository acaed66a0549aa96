"""Speculative decoding in the offline engine against the same model without it (HF has no MTP):
greedy outputs identical token for token over seeded prompts and batch mixes (chunked prefill,
page sizes, budgets, penalties, stop ids and strings, logprobs), seeded sampling identical too, the
KV pool back to empty; and, with the tiny MTP layer trained for a few seconds, an accept length
well above 1 (so the accept path is exercised, not only the reject path)."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.speculative.training import train_mtp

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]
CHUNK = 8  # small prefill chunks: the prompt's hidden states are gathered over several rounds


@pytest.fixture(scope="module")
def setup(tiny_mtp_checkpoint, module_seed):
    """(checkpoint, base engine, speculative engine with a trained MTP layer, training prompts)."""
    path = tiny_mtp_checkpoint
    base = Engine(str(path), chunked_prefill_size=CHUNK, page_size=4)
    rng = random.Random(module_seed)
    prompts = [[rng.randrange(2, base.vocab_size) for _ in range(rng.randint(2, 10))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    sequences = [p + r.output_ids for p, r in zip(prompts, base.generate_batch(prompts, greedy))]
    spec = Engine(str(path), chunked_prefill_size=CHUNK, page_size=4, speculative_num_steps=3)
    accuracy, steps = train_mtp(spec.runner, sequences, seconds=15.0)
    print(f"MTP training: {steps} steps, next-next-token accuracy {accuracy:.3f}")
    return path, base, spec, prompts


def _same(a, b) -> None:
    assert a.output_ids == b.output_ids
    assert (a.finish_reason, a.matched_stop, a.text) == (b.finish_reason, b.matched_stop, b.text)
    torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0)
    assert [t.token_ids for t in a.output_top_logprobs] == [t.token_ids for t in b.output_top_logprobs]


def test_trained_mtp_accepts_and_output_is_unchanged(setup):
    _, base, spec, prompts = setup
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    spec.speculative.stats.__init__()
    got = spec.generate_batch(prompts, greedy)
    stats = spec.speculative.stats
    print(f"accept length {stats.accept_length:.2f} (drafted {stats.drafted}, accepted {stats.accepted}, "
          f"histogram {dict(sorted(stats.histogram.items()))})")
    for a, b in zip(got, base.generate_batch(prompts, greedy)):
        _same(a, b)
    assert stats.accept_length > 1.8
    assert max(stats.histogram) == 4  # some steps accepted every draft (3 + the bonus token)
    assert spec.runner.kv_pool.num_used_pages == 0
    # For the record (no bound): prompts it was not trained on. A few seconds memorise the training
    # sequences rather than learn the model, so expect little above 1 here.
    rng = random.Random(len(prompts))
    held_out = [[rng.randrange(2, base.vocab_size) for _ in range(rng.randint(2, 10))] for _ in range(6)]
    spec.speculative.stats.__init__()
    for a, b in zip(spec.generate_batch(held_out, greedy), base.generate_batch(held_out, greedy)):
        _same(a, b)
    print(f"held-out accept length {spec.speculative.stats.accept_length:.2f}")


@pytest.mark.parametrize("steps", [1, 2, 3, 8])
def test_greedy_identical_over_prompts_and_batch_mixes(setup, module_seed, steps):
    path, base, trained, train_prompts = setup
    spec = trained if steps == 3 else Engine(str(path), chunked_prefill_size=CHUNK, page_size=4,
                                              speculative_num_steps=steps)
    if spec is not trained and steps != 1:  # k = 1 keeps its random MTP layer: mostly rejections
        spec.runner.model.mtp.load_state_dict(trained.runner.model.mtp.state_dict())
    rng = random.Random(module_seed + steps)
    for _ in range(3):
        batch = rng.sample(train_prompts, rng.randint(0, 3))
        batch += [[rng.randrange(2, base.vocab_size) for _ in range(rng.randint(1, 25))]
                  for _ in range(rng.randint(1, 4))]
        rng.shuffle(batch)
        params = [SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 20), ignore_eos=True,
                                 frequency_penalty=rng.choice([0.0, 0.5]), top_logprobs_num=rng.choice([0, 3]))
                  for _ in batch]
        for a, b in zip(spec.generate_batch(batch, params), base.generate_batch(batch, params)):
            _same(a, b)
        assert spec.runner.kv_pool.num_used_pages == 0


def test_stops_mid_acceptance_as_without_speculation(setup):
    _, base, spec, prompts = setup
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    reference = base.generate_batch(prompts, greedy)
    # stop on a token the trained draft will have accepted inside a step, and on a text snippet
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, stop_token_ids=(r.output_ids[5],))
              for r in reference]
    for a, b in zip(spec.generate_batch(prompts, params), base.generate_batch(prompts, params)):
        _same(a, b)
        assert a.finish_reason == "stop"
    texts = [r.text for r in reference]
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, stop=(t[len(t) // 2:][:2],))
              if len(t) > 4 else SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True) for t in texts]
    for a, b in zip(spec.generate_batch(prompts, params), base.generate_batch(prompts, params)):
        _same(a, b)


def test_seeded_sampling_identical(setup, module_seed):
    _, base, spec, prompts = setup
    rng = random.Random(module_seed)
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9]),
                             top_k=rng.choice([-1, 20]), max_new_tokens=16, ignore_eos=True, seed=rng.randrange(1 << 30))
              for _ in prompts]
    spec.speculative.stats.__init__()
    for a, b in zip(spec.generate_batch(prompts, params), base.generate_batch(prompts, params)):
        _same(a, b)
    print(f"sampled accept length {spec.speculative.stats.accept_length:.2f}")


def test_padded_catch_up_drafts_what_the_exact_one_does(setup, module_seed):
    """The decoder runs the catch-up over all of a row's verify positions, the emitted tokens padded
    (model/speculative/decoder.py says why that is safe): the MTP KV it writes past the last emitted
    token must never be read before it is written again. Against the exact catch-up (over the
    emitted tokens only, `pad_catch_up = False`): every step's drafts (not only the outputs, which are
    the target's whatever the drafts) are the same, with the trained layer accepting."""
    _, _, spec, prompts = setup
    rng = random.Random(module_seed + 7)
    batch = rng.sample(prompts, 4) + [[rng.randrange(2, spec.vocab_size) for _ in range(rng.randint(2, 12))]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(10, 24), ignore_eos=True)
    decoder = spec.speculative
    chain = decoder._chain

    def run(padded: bool) -> tuple[list, list]:
        drafts: list = []
        decoder.pad_catch_up = padded

        def recording(*args):
            out = chain(*args)
            drafts.append(out.tolist())
            return out

        decoder._chain = recording
        # Steps in order in both runs: the exact catch-up reads its counts, so it never launches
        # ahead, and a step launched ahead drafts for the most its row may have emitted.
        decoder.can_launch_ahead = lambda *args: False
        try:
            return [r.output_ids for r in spec.generate_batch(batch, greedy)], drafts
        finally:
            decoder._chain = chain
            decoder.pad_catch_up = True
            del decoder.can_launch_ahead

    before = decoder.stats.accepted
    exact, padded = run(False), run(True)
    assert padded == exact, module_seed
    assert decoder.stats.accepted > before, module_seed  # drafts were accepted: the padded rows had real neighbours


def test_adaptive_policy_and_per_call_settings(setup, module_seed):
    """`speculative_adaptive` in the offline engine: the step costs measured as it is built, each
    step drafting what the policy picks for the batch (0..3, recorded in `last_speculative_run`),
    its accept rate fed by the steps read; `set_speculation` switches one loaded model between
    plain decode, a fixed k and the policy. Every setting gives the plain engine's greedy tokens."""
    from deepseek_pd.errors import UserError
    from deepseek_pd.workers.engine.offline import EngineConfig

    path, base, spec, prompts = setup
    # A small pool: the start-up costs are measured at batch 1, 2, 4 only (as many as fit at 256 tokens).
    engine = Engine(str(path), chunked_prefill_size=CHUNK, page_size=4, speculative_num_steps=3,
                    speculative_adaptive=True, max_total_tokens=2048)
    engine.runner.model.mtp.load_state_dict(spec.runner.model.mtp.state_dict())
    costs = engine.speculation_policy.costs
    assert costs.batches == (1, 2, 4) and costs.max_steps == 3
    rng = random.Random(module_seed)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(12, 24), ignore_eos=True)
    want = [r.output_ids for r in base.generate_batch(prompts, greedy)]
    rate = engine.speculation_policy.rate
    for k, adaptive in ((3, True), (0, False), (rng.randint(1, 3), False), (3, True)):
        engine.set_speculation(k, adaptive)
        engine.last_speculative_run = None
        drafted = engine.speculative.stats.drafted
        observed = rate.accepted + rate.rejected
        assert [r.output_ids for r in engine.generate_batch(prompts, greedy)] == want, (k, adaptive)
        run = engine.last_speculative_run
        if k == 0:
            assert run is None and engine.speculative.stats.drafted == drafted  # plain decode
            continue
        assert run.requested and set(run.requested) <= set(range(k + 1)), run.requested
        assert all(max(lens) <= asked for lens, asked in zip(run.lens, run.requested))
        assert (rate.accepted + rate.rejected > observed) == adaptive or max(run.requested) == 0
        if not adaptive:
            assert set(run.requested) == {k}
    assert engine.runner.kv_pool.num_used_pages == 0
    for bad in (dict(num_steps=4), dict(num_steps=0, adaptive=True)):
        with pytest.raises(UserError):
            engine.set_speculation(**bad)
    with pytest.raises(UserError, match="speculative_adaptive"):
        spec.set_speculation(2, adaptive=True)  # built without the policy
    with pytest.raises(UserError, match="speculative_num_steps >= 1"):
        EngineConfig(speculative_adaptive=True)
